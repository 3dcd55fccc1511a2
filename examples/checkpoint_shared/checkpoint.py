"""Rank 0 saves a model's state; after a barrier every rank loads it from CKPT_DIR."""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    rank = int(os.environ["SKYPILOT_NODE_RANK"])
    world = int(os.environ["SKYPILOT_NUM_NODES"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    path = Path(os.environ["CKPT_DIR"]) / "model.pt"
    if rank == 0:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), path)
    dist.barrier()  # the checkpoint is written before anyone reads it
    code = 0
    if path.exists():
        state = torch.load(path)
        print(f"rank={rank} loaded checksum={float(sum(t.sum() for t in state.values())):.6f}", flush=True)
    else:
        print(
            f"rank={rank}: no checkpoint at {path} on {socket.gethostname()}: the nodes share no filesystem "
            "(launch with a shared directory at CKPT_DIR)",
            flush=True,
        )
        code = 1
    dist.barrier()  # leave in step: rank 0 hosts the store
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
