"""Cluster records on disk: who owns which cluster, so a later run can reap what a killed one left.

One directory per cluster under ``$PYTEST_SKY_HOME/clusters/<name>/`` holds ``record.json``
and the cluster's key material and SSH config.  Writers hold a ``filelock`` on the state
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

HOME_ENV = "PYTEST_SKY_HOME"


def home() -> Path:
    root = Path(os.environ.get(HOME_ENV) or "~/.pytest_sky").expanduser().resolve()
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
    node_names: list[str] = field(default_factory=list)
    node_ips: list[str] = field(default_factory=list)
    head_host: str = ""  # where the client dials the head's sshd
    head_port: int = 22
    head_proxy_command: str | None = None  # set where the head is not directly reachable
    python: str = "python3"  # the nodes' interpreter for the agent
    cluster_info: dict = field(default_factory=dict)
    backend_data: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClusterRecord:
        data = json.loads(text)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


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
