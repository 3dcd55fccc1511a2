"""What an emulator records of itself, so a later one can reap its leftovers after a SIGKILL.

The record (``emulator.json`` in the instance directory) names the emulator's process, its
bridge and each running pod's node with its veth; an emulator starting on the same state
directory removes what a dead one left: its pods' processes and links, its bridge, its
instance directory.  The emulator's process is the product's own
:class:`~kube_emulator.product.OwnerProcess` and a pod's node its
:class:`~kube_emulator.product.NodeRecord` (pids checked against start times, so a recycled
pid is never killed), their JSON objects extended by the bridge and the veth: the product's
reaper reads whose a bridge is from the same record, so a dead emulator's bridge goes at the
next reaper pass of any process on the machine, whatever state directory it used.  That pass
runs here too, at an emulator's start (``product.reap_stray_bridges``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kube_emulator import product
from kube_emulator.product import NodeRecord, OwnerProcess

RECORD = product.EMULATOR_RECORD

log = logging.getLogger(__name__)


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

    owner: OwnerProcess
    bridge: str
    kubeconfig: str
    nodes: tuple[RecordedNode, ...] = ()

    @classmethod
    def of_this_process(cls, bridge: str, kubeconfig: str, nodes: tuple[RecordedNode, ...]) -> EmulatorRecord:
        return cls(owner=OwnerProcess.of_this_process(), bridge=bridge, kubeconfig=kubeconfig, nodes=nodes)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.owner.to_json(),
            "bridge": self.bridge,
            "kubeconfig": self.kubeconfig,
            "nodes": {n.pod: n.to_json() for n in self.nodes},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EmulatorRecord:
        return cls(
            owner=OwnerProcess.from_json(data),
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


def reap_leftovers(state_dir: Path) -> list[str]:
    """Remove what emulators that died without tearing down (SIGKILL) left in ``state_dir``:
    their pods' processes and links, their bridge, their instance directories; then, on the
    whole machine, the bridges of ours whose owner is gone (the product's one rule: another
    state directory's emulator, a killed test run's cluster)."""
    ip = shutil.which("ip", path="/usr/sbin:/sbin:/usr/bin:/bin") or "ip"
    reaped = _reap_dead_instances(state_dir, ip) if state_dir.is_dir() else []
    try:
        with product.link_lock(exclusive=True):
            reaped += product.reap_stray_bridges(ip)
    except (product.SkyError, OSError) as exc:  # another's leftover never stops this emulator
        log.warning("could not reap stray bridges: %s", exc)
    return reaped


def _reap_dead_instances(state_dir: Path, ip: str) -> list[str]:
    reaped: list[str] = []
    for record_path in state_dir.glob(f"*/{RECORD}"):
        record = EmulatorRecord.read(record_path)
        if record is None or record.owner.alive():
            continue
        veths = [n.veth for n in record.nodes if n.veth]
        product.delete_links(ip, veths)
        product.reap_nodes([n.node for n in record.nodes], cgroups=[str(product.node_cgroup(v) or "") for v in veths])
        if record.bridge:
            product.delete_links(ip, [record.bridge])
        shutil.rmtree(record_path.parent, ignore_errors=True)
        reaped.append(str(record_path.parent))
    return reaped
