"""All-reduce a small tensor over gloo, again and again, until the network fails it.

What a partition test needs from a training job: it runs fine until the link between its
ranks is cut, then fails within its configured timeout, saying which rank saw what, instead
of hanging.  ``GLOO_TIMEOUT_S`` (default 10) is the process group's timeout, which gloo
applies to every collective; ``MASTER_PORT`` (29502) picks the store's port.  Each rank
prints ``STEP 1`` once its first all_reduce is done (the test waits for that before it cuts
the link), ``FAILED rank=.. after_s=.. error=..`` when a collective fails (and exits 3), or
``DONE`` after ``ALLREDUCE_STEPS`` steps (default: effectively forever).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    rank = int(os.environ["SKYPILOT_NODE_RANK"])
    world = int(os.environ["SKYPILOT_NUM_NODES"])
    head = os.environ["SKYPILOT_NODE_IPS"].split()[0]
    port = os.environ.get("MASTER_PORT", "29502")
    timeout = float(os.environ.get("GLOO_TIMEOUT_S", "10"))
    steps = int(os.environ.get("ALLREDUCE_STEPS", "1000000"))
    dist.init_process_group(
        "gloo", init_method=f"tcp://{head}:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
    )
    tensor = torch.ones(1024)
    for step in range(1, steps + 1):
        start = time.monotonic()
        try:
            dist.all_reduce(tensor)
        except RuntimeError as exc:  # gloo's timeout (or a peer's reset) surfaces here
            error = " ".join(str(exc).split())[:300]
            say(f"FAILED rank={rank} step={step} after_s={time.monotonic() - start:.1f} error={error}")
            os._exit(3)  # no shutdown handshake: the peer is unreachable
        tensor.fill_(1.0)
        if step == 1:
            say("STEP 1")
        time.sleep(0.05)
    say("DONE")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
