"""All-reduce each rank's number across nodes with gloo; print what every rank sees."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    rank = int(os.environ["SKYPILOT_NODE_RANK"])
    world = int(os.environ["SKYPILOT_NUM_NODES"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '29500')}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(f"rank={rank} world={world} sum={value.item():g}", flush=True)
    # Leave in step: no rank may close its sockets (rank 0 hosts the store) while another
    # still talks to it (see shut_down in examples/torch_ddp/train.py).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
