"""The smallest real distributed test body: init a gloo group and all_reduce 4 floats.

Run on every node of a pytest-sky cluster by ``python -m bench --peers``: rank, world size
and the head's address come from the SkyPilot variables every rank gets.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def main() -> None:
    rank = int(os.environ["SKYPILOT_NODE_RANK"])
    world = int(os.environ["SKYPILOT_NUM_NODES"])
    head = os.environ["SKYPILOT_NODE_IPS"].split()[0]
    port = os.environ.get("GLOO_TINY_PORT", "29517")
    dist.init_process_group("gloo", init_method=f"tcp://{head}:{port}", rank=rank, world_size=world)
    try:
        t = torch.ones(4)
        dist.all_reduce(t)
        if t.tolist() != [float(world)] * 4:
            raise SystemExit(f"rank {rank}: wrong sum {t.tolist()}")
        print(f"RANK {rank} OK")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
