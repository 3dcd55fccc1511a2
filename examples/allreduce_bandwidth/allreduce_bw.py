"""Time a gloo all_reduce of a 64 MiB float32 tensor between ranks and report GB/s.

It answers one question about a cluster's network path: do two "nodes" exchange tensors as
fast as two processes on one machine's loopback?  (DESIGN.md section 5: veth at MTU 1500 was
30-40 % slower than loopback, at MTU 65535 on par.)  So the same script runs in two modes:

- on a cluster, from the SkyPilot environment: rank ``SKYPILOT_NODE_RANK`` of
  ``SKYPILOT_NUM_NODES``, the store at the head (first line of ``SKYPILOT_NODE_IPS``);
- as plain processes (or under torchrun): ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``.

``MASTER_PORT`` (default 29501) is shared by both.  ``ALLREDUCE_MIB`` (default 64),
``ALLREDUCE_WARMUPS`` (2) and ``ALLREDUCE_RUNS`` (5) size the measurement.

Each timed run starts after a barrier and lasts until the slowest rank is done (its time is
max-reduced), so the figure is the collective's, not one rank's.  Rank 0 prints
``GBPS <algorithm bandwidth>`` (tensor bytes / median time, 1 GB = 1e9 bytes); every rank
prints a ``RANK`` line saying whether its result was the exact expected sum.
"""

from __future__ import annotations

import gc
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

# torch's import creates ~170k long-lived objects that the cyclic garbage collector would
# re-scan over and over while they are created and again at exit (about a third of this
# short script's CPU time): pause it for the import, then freeze what the import made.
gc.disable()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

gc.freeze()
gc.enable()


def rendezvous() -> tuple[int, int, str, str]:
    """(rank, world, master address, port) from torchrun-style or SkyPilot variables."""
    port = os.environ.get("MASTER_PORT", "29501")
    if "RANK" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"], port
    if "SKYPILOT_NODE_RANK" in os.environ:
        head = os.environ["SKYPILOT_NODE_IPS"].split()[0]
        return int(os.environ["SKYPILOT_NODE_RANK"]), int(os.environ["SKYPILOT_NUM_NODES"]), head, port
    sys.exit("set RANK, WORLD_SIZE, MASTER_ADDR (and MASTER_PORT), or run as a SkyPilot task")


def say(line: str) -> None:
    """One write per line, so lines of processes sharing a stdout never interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    rank, world, master, port = rendezvous()
    mib = int(os.environ.get("ALLREDUCE_MIB", "64"))
    warmups = int(os.environ.get("ALLREDUCE_WARMUPS", "2"))
    runs = int(os.environ.get("ALLREDUCE_RUNS", "5"))
    dist.init_process_group(
        "gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    numel = mib * 1024 * 1024 // 4
    tensor = torch.empty(numel, dtype=torch.float32)
    expected = float(world * (world + 1) // 2)  # every rank contributes rank + 1
    times: list[float] = []
    correct = True
    for i in range(warmups + runs):
        tensor.fill_(float(rank + 1))  # refill: all_reduce works in place
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective ends with its slowest rank
        correct = correct and bool(torch.all(tensor == expected))
        if i >= warmups:
            times.append(elapsed.item())
    median = statistics.median(times)
    gbps = numel * 4 / median / 1e9
    say(
        f"RANK rank={rank} world={world} host={socket.gethostname()} mib={mib} runs={runs} "
        f"median_s={median:.4f} correct={int(correct)}"
    )
    if rank == 0:
        say(f"GBPS {gbps:.3f}")
    # Leave in step: no rank may close its sockets (rank 0 hosts the store) while another
    # still talks to it (see shut_down in examples/torch_ddp/train.py).
    dist.barrier()
    dist.destroy_process_group()
    if not correct:
        sys.exit(f"rank {rank}: all_reduce result differs from the expected sum {expected:g}")


if __name__ == "__main__":
    main()
