"""Elastic training that survives a node's crash: checkpoint to a shared directory, resume.

torchrun (c10d rendezvous, ``--max-restarts``) starts one worker per node.  The workers
train a tiny model for ``ELASTIC_STEPS`` steps (gradients averaged with one gloo all_reduce
per step), global rank 0 saves a checkpoint every ``ELASTIC_CKPT_EVERY`` steps into
``CKPT_DIR`` (a directory every node shares), and every worker, whenever it starts, resumes
from the newest checkpoint there.  So when a node dies mid-training and comes back, torchrun
forms a new worker group, and the new group continues at the step after the last checkpoint,
not at step 0.

Every event is one line, on stdout and appended to ``CKPT_DIR/progress/<host>.log`` (where a
test, or you, can read what happened on every node after the fact):

    START t=<unix time> host=<node> worker=<id> agent=<id> agent_pid=<n> restart=<n> node_rank=<n>
          rank=<n> world=<n> resume_from=<step of the checkpoint it loaded, -1 for none>     (one line, wrapped here)
    STEP  ... step=<n> loss=<mean loss over ranks>
    CKPT  ... step=<n>          (rank 0, after the checkpoint file is in place)
    DONE  ... step=<last step>

``worker`` is one per worker process (a new one each time torchrun starts the group again),
``agent`` one per torchrun start (``ELASTIC_AGENT_ID``, from task.yaml; ``agent_pid`` is its
pid), ``restart`` torchrun's own count of its restarts after failures
(``TORCHELASTIC_RESTART_COUNT``; a restart because a node joined does not count).  Data is
seeded by (step, rank), so a resumed run computes the same steps an uninterrupted one would.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

# torch's import is most of a worker's start-up; with the cyclic collector paused it is
# about a third cheaper (see examples/torch_ddp/train.py).
gc.disable()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

STEPS = int(os.environ.get("ELASTIC_STEPS", "40"))
CKPT_EVERY = int(os.environ.get("ELASTIC_CKPT_EVERY", "5"))
# Simulated compute per step: the tiny model takes microseconds, a real one seconds.  It is
# what gives a crash a moment mid-training to land in.
STEP_SECONDS = float(os.environ.get("ELASTIC_STEP_SECONDS", "0"))
# A collective whose peer died fails after this long (unless torchrun restarts the group
# first, as it does as soon as the restarted node's agent waits to join).
GLOO_TIMEOUT_S = float(os.environ.get("ELASTIC_GLOO_TIMEOUT_S", "30"))
CKPT_DIR = Path(os.environ.get("CKPT_DIR", "/mnt/shared/torch_elastic"))
BATCH = 32
FEATURES = 16


class Progress:
    """One line per event, to stdout and to this node's progress file in the shared dir.

    Each line is a single ``write`` on an ``O_APPEND`` descriptor: a process killed with its
    node leaves whole lines behind, never half of one.
    """

    def __init__(self, rank: int, world: int) -> None:
        host = socket.gethostname()
        self.fields = {
            "host": host,
            "worker": uuid.uuid4().hex[:12],
            "agent": os.environ.get("ELASTIC_AGENT_ID", "?"),
            "agent_pid": os.getppid(),  # torchrun starts its workers itself
            "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT", "?"),
            "node_rank": os.environ.get("GROUP_RANK", "?"),
            "rank": rank,
            "world": world,
        }
        path = CKPT_DIR / "progress" / f"{host}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, tag: str, **fields: object) -> None:
        values = {"t": f"{time.time():.6f}", **self.fields, **fields}
        line = tag + " " + " ".join(f"{k}={v}" for k, v in values.items()) + "\n"
        os.write(self.fd, line.encode())
        sys.stdout.write(line)  # one write per line: see examples/torch_ddp/train.py
        sys.stdout.flush()


def checkpoint_path(step: int) -> Path:
    return CKPT_DIR / f"step-{step:06d}.pt"


def latest_checkpoint() -> int:
    """The newest complete checkpoint's step, -1 when there is none.  Complete ones only:
    a checkpoint is written under a temporary name and renamed into place."""
    steps = [int(p.stem.split("-")[1]) for p in CKPT_DIR.glob("step-*.pt")]
    return max(steps, default=-1)


def save_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """Written, synced to disk, then renamed: a crash mid-save leaves the previous one whole."""
    tmp = CKPT_DIR / f".step-{step:06d}.pt.tmp"
    with open(tmp, "wb") as f:
        torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, checkpoint_path(step))


def resume_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> int:
    """Every rank loads the checkpoint rank 0 chose (broadcast, so all agree even while an
    old one is being replaced), and returns its step (-1: start afresh)."""
    chosen = torch.tensor([latest_checkpoint() if rank == 0 else -1])
    dist.broadcast(chosen, src=0)
    step = int(chosen.item())
    if step >= 0:
        path = checkpoint_path(step)
        if not path.exists():
            raise SystemExit(
                f"rank {rank}: no checkpoint {path} on {socket.gethostname()}: CKPT_DIR must be a directory "
                "every node shares (launch with shared_dir=..., `--shared-dir`)"
            )
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    return step


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> float:
    """One step on this rank's shard; gradients and loss averaged in one all_reduce."""
    gen = torch.Generator().manual_seed(100_000 * step + rank)
    true_w = torch.linspace(-1.0, 1.0, FEATURES)
    x = torch.randn(BATCH, FEATURES, generator=gen)
    y = (x @ true_w).unsqueeze(1) + 0.1 * torch.randn(BATCH, 1, generator=gen)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    params = list(model.parameters())
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p))
        offset += n
    opt.step()
    return float(flat[-1])


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    CKPT_DIR.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gc.enable()
    progress = Progress(rank, world)
    last = resume_step(model, opt, rank)
    progress.write("START", resume_from=last)
    step = last
    for step in range(last + 1, STEPS):
        loss = train_step(model, opt, step, rank, world)
        progress.write("STEP", step=step, loss=f"{loss:.6f}")
        if rank == 0 and ((step + 1) % CKPT_EVERY == 0 or step == STEPS - 1):
            save_checkpoint(model, opt, step)
            progress.write("CKPT", step=step)
        if STEP_SECONDS:
            time.sleep(STEP_SECONDS)
    progress.write("DONE", step=step)
    # Leave in step, while Python is fully alive (see examples/torch_ddp's README).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
