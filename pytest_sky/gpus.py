"""Sharing this machine's GPUs between local nodes, as a device plugin shares a machine's between pods.

Whole requests get whole devices, distinct per node (``A100:2`` on 2 nodes takes 4 devices);
fractional requests share one (``V100:0.5`` puts two nodes on each device).  A request the
machine cannot meet is refused before anything is provisioned.  A node sees exactly its own
devices (:func:`device_files`, in a ``/dev`` of its own), numbered from 0 as a pod given
them sees them (:func:`node_view`): the host's indices mean nothing inside it.
"""

from __future__ import annotations

import functools
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


#: What the NVIDIA container toolkit gives a container with GPUs, beside their ``/dev/nvidiaN``.
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")


@functools.cache
def _minor_numbers() -> dict[str, str]:
    """GPU index -> the minor number of its ``/dev/nvidiaN`` (``nvidia-smi``'s own mapping;
    they usually agree, but need not); empty without nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,minor_number", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(re.findall(r"^\s*(\d+)\s*,\s*(\d+)\s*$", out, flags=re.MULTILINE))


def device_files(share: str) -> list[str]:
    """The device files of a node given ``share`` (its ``CUDA_VISIBLE_DEVICES`` on this
    machine): each GPU's ``/dev/nvidiaN`` and the control devices; none without a share."""
    indices = [i for i in share.split(",") if i.strip()]
    if not indices:
        return []
    minors = _minor_numbers()
    return [*(f"/dev/nvidia{minors.get(i, i)}" for i in indices), *CONTROL_DEVICES]


def node_view(share: str) -> str:
    """``CUDA_VISIBLE_DEVICES`` inside a node given ``share``: its GPUs are all it has, so
    they are ``0..k-1`` there, as in a pod given k GPUs; "" without a share."""
    count = len([i for i in share.split(",") if i.strip()])
    return ",".join(str(i) for i in range(count))
