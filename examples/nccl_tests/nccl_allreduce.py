"""NCCL all_reduce bandwidth with torch.distributed: the fallback where nccl-tests is not installed.

Started by torchrun, one process per GPU on every node.  Every rank times the same all_reduce
and prints one line, ``NCCL_BUSBW rank=<global rank> world=<n> bytes=<size> ... busbw_gbps=<x>``,
so a test can check that every rank took part, not only rank 0.  Bus bandwidth uses
nccl-tests' definition for all_reduce (algorithm bandwidth x 2(n-1)/n), so the two paths of
the example report comparable figures.
"""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Read a size the way nccl-tests' -b/-e do (``8M``, ``1G``, ``4096``), so the task's envs
    mean the same thing on both paths."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text.upper())
    if match is None:
        raise ValueError(f"not a size: {text!r} (e.g. 4096, 8M, 1G)")
    return int(match.group(1)) * _UNITS[match.group(2)]


def time_all_reduce(tensor: torch.Tensor, iters: int, warmup: int) -> float:
    """Seconds per all_reduce, averaged over ``iters`` after ``warmup`` untimed ones (the
    first calls set up NCCL's connections and would dominate a short measurement)."""
    for _ in range(warmup):
        dist.all_reduce(tensor)
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(seconds=300))

    # Correctness first: a bandwidth from a wrong all_reduce means nothing.
    check = torch.full((1024,), float(rank + 1), device="cuda")
    dist.all_reduce(check)
    expected = world * (world + 1) / 2
    if not torch.all(check == expected):
        raise SystemExit(f"rank {rank}: all_reduce gave {check[0].item()}, expected {expected}")

    nbytes = parse_size(os.environ.get("NCCL_MAX_BYTES", "128M"))
    iters = int(os.environ.get("NCCL_ITERS", "20"))
    tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device="cuda")
    seconds = time_all_reduce(tensor, iters=iters, warmup=5)
    algbw = tensor.numel() * tensor.element_size() / seconds / 1e9
    busbw = algbw * 2 * (world - 1) / world
    nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    print(
        f"NCCL_BUSBW rank={rank} world={world} host={os.uname().nodename} "
        f"device={torch.cuda.get_device_name(local_rank)!r} nccl={nccl} bytes={tensor.numel() * 4} "
        f"time_us={seconds * 1e6:.1f} algbw_gbps={algbw:.2f} busbw_gbps={busbw:.2f}",
        flush=True,
    )
    # Leave in step: no rank may close its sockets (rank 0 hosts the store) while another
    # still talks to it (see shut_down in examples/torch_ddp/train.py).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
