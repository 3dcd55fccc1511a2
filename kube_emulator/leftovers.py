"""What an emulator records of itself, so a later one can reap its leftovers after a SIGKILL.

The record (``emulator.json`` in the instance directory) names the emulator's process, its
bridge and each running pod's node with its veth; an emulator starting on the same state
directory removes what a dead one left: its pods' processes and links, its bridge, its
instance directory.  A pod's node is the product's own :class:`~kube_emulator.product.NodeRecord`
(pids checked against start times, so a recycled pid is never killed), its JSON object
extended by the veth.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kube_emulator import product
from kube_emulator.product import NodeRecord

RECORD = "emulator.json"


@dataclass(frozen=True)
class RecordedNode:
    """One running pod's node, and the veth that links it to the bridge."""

    pod: str  # namespace/name
    veth: str
    node: NodeRecord

    def to_json(self) -> dict[str, Any]:
        return {**self.node.to_json(), "veth": self.veth}

    @classmethod
    def from_json(cls, pod: str, data: Mapping[str, Any]) -> RecordedNode:
        return cls(pod=pod, veth=str(data.get("veth") or ""), node=NodeRecord.from_json(data))


@dataclass(frozen=True)
class EmulatorRecord:
    """An emulator process, its bridge and its pods' nodes, as ``emulator.json`` keeps them."""

    pid: int
    start_time: int | None
    bridge: str
    kubeconfig: str
    nodes: tuple[RecordedNode, ...] = ()

    @classmethod
    def of_this_process(cls, bridge: str, kubeconfig: str, nodes: tuple[RecordedNode, ...]) -> EmulatorRecord:
        pid = os.getpid()
        return cls(pid=pid, start_time=product.start_time(pid), bridge=bridge, kubeconfig=kubeconfig, nodes=nodes)

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "start_time": self.start_time,
            "bridge": self.bridge,
            "kubeconfig": self.kubeconfig,
            "nodes": {n.pod: n.to_json() for n in self.nodes},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EmulatorRecord:
        start = data.get("start_time")
        return cls(
            pid=int(data.get("pid") or 0),
            start_time=int(start) if start is not None else None,
            bridge=str(data.get("bridge") or ""),
            kubeconfig=str(data.get("kubeconfig") or ""),
            nodes=tuple(RecordedNode.from_json(pod, n) for pod, n in (data.get("nodes") or {}).items()),
        )

    def write(self, instance_dir: Path) -> None:
        """Replace the record in ``instance_dir`` at once (a reader never sees half of one)."""
        tmp = instance_dir / (RECORD + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(tmp, instance_dir / RECORD)

    @classmethod
    def read(cls, path: Path) -> EmulatorRecord | None:
        """The record at ``path``; None when it is unreadable or not one."""
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None


def reap_leftovers(state_dir: Path, is_alive: Callable[[int, int | None], bool] = product.is_alive) -> list[str]:
    """Remove what emulators that died without tearing down (SIGKILL) left in ``state_dir``:
    their pods' processes and links, their bridge, their instance directories."""
    reaped: list[str] = []
    if not state_dir.is_dir():
        return reaped
    ip = shutil.which("ip", path="/usr/sbin:/sbin:/usr/bin:/bin") or "ip"
    for record_path in state_dir.glob(f"*/{RECORD}"):
        record = EmulatorRecord.read(record_path)
        if record is None or is_alive(record.pid, record.start_time):
            continue
        veths = [n.veth for n in record.nodes if n.veth]
        product.delete_links(ip, veths)
        product.reap_nodes([n.node for n in record.nodes], cgroups=[str(product.node_cgroup(v) or "") for v in veths])
        if record.bridge:
            product.delete_links(ip, [record.bridge])
        shutil.rmtree(record_path.parent, ignore_errors=True)
        reaped.append(str(record_path.parent))
    return reaped
