"""Sharing this machine's GPUs between local nodes through ``CUDA_VISIBLE_DEVICES``.

Whole requests get whole devices, distinct per node (``A100:2`` on 2 nodes takes 4 devices);
fractional requests share one (``V100:0.5`` puts two nodes on each device).  A request the
machine cannot meet is refused before anything is provisioned.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from pathlib import Path

from pytest_sky.errors import ResourcesError
from pytest_sky.resources import Accelerator


def detect_devices() -> list[str]:
    """Indices of this machine's NVIDIA GPUs (``nvidia-smi -L``, else ``/dev/nvidiaN``)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False).stdout
        found = re.findall(r"^GPU (\d+):", out, flags=re.MULTILINE)
        if found:
            return found
    except (OSError, subprocess.TimeoutExpired):
        pass
    return sorted((p.name[len("nvidia") :] for p in Path("/dev").glob("nvidia[0-9]*")), key=int)


def allocate(devices: list[str], num_nodes: int, accelerator: Accelerator | None) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` for each node, in rank order ("" for nodes without GPUs)."""
    if accelerator is None:
        return [""] * num_nodes
    count = accelerator.count
    if count >= 1:
        per_node = math.ceil(count)
        needed = per_node * num_nodes
        if needed > len(devices):
            raise ResourcesError(_too_many(accelerator, num_nodes, needed, devices))
        return [",".join(devices[r * per_node : (r + 1) * per_node]) for r in range(num_nodes)]
    nodes_per_device = max(1, math.floor(1 / count + 1e-9))
    needed = math.ceil(num_nodes / nodes_per_device)
    if needed > len(devices):
        raise ResourcesError(_too_many(accelerator, num_nodes, needed, devices))
    return [devices[r // nodes_per_device] for r in range(num_nodes)]


def _too_many(accelerator: Accelerator, num_nodes: int, needed: int, devices: list[str]) -> str:
    have = f"{len(devices)} GPU{'s' if len(devices) != 1 else ''}" if devices else "no GPU"
    return (
        f"{num_nodes} node(s) x {accelerator} need {needed} GPU(s) but this machine has {have}; "
        "ask for fewer nodes or a fractional share (e.g. V100:0.5)"
    )


def visible_from_env() -> list[str] | None:
    """Respect a CUDA_VISIBLE_DEVICES the test run itself was given."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d for d in value.split(",") if d.strip()]
