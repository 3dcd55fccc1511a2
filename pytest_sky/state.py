"""Cluster records on disk: who owns which cluster, so a later run can reap what a killed one left.

One directory per cluster under ``$PYTEST_SKY_HOME/clusters/<name>/`` holds ``record.json``
(who owns the cluster and, once it is up, its :class:`~pytest_sky.cluster_info.ClusterInfo`),
the backend's journal (``backend.json``: what it made, written before it makes it) and the
cluster's key material and SSH config.  Writers hold a ``filelock`` on the state
directory: pytest-xdist workers, the CLI and a reaping run may all touch records at once.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from filelock import FileLock

from pytest_sky.cluster_info import ClusterInfo
from pytest_sky.settings import state_home


def home() -> Path:
    root = state_home()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return root


@dataclass
class ClusterRecord:
    name: str
    backend: str
    num_nodes: int
    owner_pid: int
    owner_start_time: int | None
    created: float = field(default_factory=time.time)
    keep: bool = False  # --keep-clusters / CLI: never reaped when the owner exits
    status: str = "PROVISIONING"  # PROVISIONING, UP
    resources: dict = field(default_factory=dict)
    resources_label: str = ""
    info: ClusterInfo | None = None  # what provisioning returned; None while PROVISIONING

    @property
    def node_ips(self) -> list[str]:
        return self.info.ips if self.info is not None else []

    @property
    def node_names(self) -> list[str]:
        return self.info.hostnames if self.info is not None else []

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClusterRecord:
        data = json.loads(text)
        known = {f for f in cls.__dataclass_fields__}
        fields = {k: v for k, v in data.items() if k in known}
        if fields.get("info") is not None:
            fields["info"] = ClusterInfo.from_dict(fields["info"])
        return cls(**fields)


class Journal:
    """A backend's own record of what it made, kept beside the cluster's record.

    Written before each step that creates something (intent before action), so that from it
    alone ``destroy`` removes a cluster whose launch was killed half-way, in a later process.
    Its content is the backend's private business: only the backend that writes it reads it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._written: dict | None = None  # what this object last wrote: no re-read per step

    @property
    def cluster_dir(self) -> Path:
        return self.path.parent

    def load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def update(self, **fields: object) -> dict:
        """Merge ``fields`` into the journal and make it durable before returning."""
        data = {**(self._written if self._written is not None else self.load()), **fields}
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)
        self._written = data
        return data


class StateStore:
    def __init__(self, root: Path | None = None) -> None:
        self.root = root or home()
        (self.root / "clusters").mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = FileLock(str(self.root / "state.lock"))

    @contextmanager
    def locked(self) -> Iterator[None]:
        with self._lock:
            yield

    def cluster_dir(self, name: str) -> Path:
        return self.root / "clusters" / name

    def journal(self, name: str) -> Journal:
        return Journal(self.cluster_dir(name) / "backend.json")

    def save(self, record: ClusterRecord) -> None:
        d = self.cluster_dir(record.name)
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = d / "record.json.tmp"
        tmp.write_text(record.to_json())
        os.replace(tmp, d / "record.json")

    def load(self, name: str) -> ClusterRecord | None:
        try:
            return ClusterRecord.from_json((self.cluster_dir(name) / "record.json").read_text())
        except (OSError, ValueError, TypeError):
            return None

    def records(self) -> list[ClusterRecord]:
        out = []
        for d in sorted((self.root / "clusters").iterdir()):
            rec = self.load(d.name)
            if rec is not None:
                out.append(rec)
        return out

    def claim(self, record: ClusterRecord) -> bool:
        """Create the record unless the name is taken; False if another cluster has it."""
        with self.locked():
            if (self.cluster_dir(record.name) / "record.json").exists():
                return False
            self.save(record)
            return True

    def forget(self, name: str) -> None:
        shutil.rmtree(self.cluster_dir(name), ignore_errors=True)
