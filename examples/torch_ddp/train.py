"""A few steps of DistributedDataParallel on a tiny model, launched by torchrun on every node.

The point is not the model but the wiring: torchrun (static or c10d rendezvous) turns the
SkyPilot environment into a process group of ``nodes x nproc_per_node`` ranks, DDP keeps the
replicas in step by all-reducing gradients, and each rank prints one line that a test can
parse and compare across ranks:

    RESULT rank=3 world=4 node_rank=1 local_rank=1 host=<hostname> backend=gloo loss=0.123456 params=1.234567

``loss`` is the last step's loss averaged over every rank (an all_reduce), ``params`` a
checksum of the model after training: both must be identical on every rank, which is only
true when every rank took part in every step.  Data is synthetic and seeded per rank (so the
gradients really differ between ranks and DDP has something to average); the model's
initial weights are seeded the same everywhere (DDP broadcasts rank 0's anyway).
"""

from __future__ import annotations

import gc
import os
import socket
import sys
from datetime import timedelta

# Start-up is most of this script's cost: torch's import (and torch._dynamo's, which DDP's
# constructor pulls in) creates a few hundred thousand long-lived objects, and the cyclic
# garbage collector re-scans them over and over while they are created and once more at
# exit, about 2.5 of 7 CPU-seconds per process here.  So the collector is paused until the
# model is built, then everything made so far is frozen out of its sight (gc.freeze, the
# standard idiom for long-lived start-up state) and it runs as usual for the training loop.
gc.disable()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

STEPS = int(os.environ.get("DDP_STEPS", "5"))
BATCH = 32
FEATURES = 16


def pick_backend(local_world_size: int) -> str:
    """nccl needs one GPU per process on a node; anything else (CPU, too few GPUs) uses gloo.

    ``DDP_BACKEND`` overrides the choice, e.g. to force gloo on a GPU machine.
    """
    forced = os.environ.get("DDP_BACKEND")
    if forced:
        return forced
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def main() -> None:
    # torchrun sets these for every worker process it starts.
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    backend = pick_backend(local_world_size)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # same initial weights everywhere
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gc.freeze()  # start-up is over (see the imports)
    gc.enable()

    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of data
    true_w = torch.linspace(-1.0, 1.0, FEATURES)
    loss = torch.zeros((), device=device)
    for _ in range(STEPS):
        x = torch.randn(BATCH, FEATURES, generator=gen)
        y = (x @ true_w).unsqueeze(1) + 0.1 * torch.randn(BATCH, 1, generator=gen)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # DDP all-reduces the gradients here
        opt.step()

    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    params = sum(p.detach().double().sum() for p in model.parameters()).item()
    # One write per line: torchrun's workers share the node's stdout, and under
    # PYTHONUNBUFFERED print() would write the text and its newline separately, letting
    # another process's line land in between.
    sys.stdout.write(
        f"RESULT rank={rank} world={world} node_rank={os.environ.get('GROUP_RANK', '?')} "
        f"local_rank={local_rank} host={socket.gethostname()} backend={backend} "
        f"loss={mean_loss.item():.6f} params={params:.6f}\n"
    )
    sys.stdout.flush()
    del ddp, opt, model, loss, mean_loss  # DDP's reducer holds the process group
    shut_down()


def shut_down() -> None:
    """Leave the process group in step and while Python is still fully alive.

    gloo's process group has no real shutdown: ``destroy_process_group()`` only unregisters
    it, and the group (with its store connection and gloo's threads) lives on as long as
    anything holds it: DDP's reducer does, and ``gc.freeze()`` keeps the reducer out of the
    collector's reach.  Left to interpreter finalization, a rank whose peers (or torchrun's
    rendezvous store on the head) already closed their sockets aborts there with "terminate
    called without an active exception" (SIGABRT, after the work was done).  So: a barrier,
    so no rank leaves while another still talks to it; with DDP, the optimizer and the model
    already dropped by the caller, collect them (frozen or not); then destroy the group,
    whose last reference goes with it.  Copy this ending into any DDP script that freezes
    gc or keeps a DDP module to the end.
    """
    dist.barrier()
    gc.unfreeze()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
