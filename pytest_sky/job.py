"""Detached jobs: a run that lives on the head, so the client may disconnect and come back.

The agent on the head keeps each job's state in ``~/.sky/jobs/<id>/`` (status, prefixed log,
events); this class reads it through short agent commands over the cluster's connection.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from enum import Enum
from typing import TYPE_CHECKING, overload

from pytest_sky.errors import RunError, RunTimeoutError

if TYPE_CHECKING:
    from typing import Literal

    from pytest_sky.cluster import Cluster
    from pytest_sky.runner import RunResult


class JobStatus(str, Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)

    def __str__(self) -> str:
        return self.value


class Job:
    def __init__(self, cluster: Cluster, job_id: int, task_id: str = "") -> None:
        self.cluster = cluster
        self.id = job_id
        self.task_id = task_id

    def __repr__(self) -> str:
        return f"Job({self.id}, cluster={self.cluster.name!r})"

    def info(self) -> dict:
        """The job's record on the head: status, returncode, error, timestamps."""
        code, out = self.cluster._agent(["jobs", str(self.id)])
        records = json.loads(out or b"[]")
        if code != 0 or not records:
            raise RunError(f"cluster {self.cluster.name} has no job {self.id}")
        return records[0]

    @property
    def status(self) -> JobStatus:
        return JobStatus(self.info()["status"])

    @property
    def error(self) -> str | None:
        return self.info().get("error")

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Block until the job ends; returns its final status, raises on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            chunk = 30.0 if deadline is None else max(0.0, min(30.0, deadline - time.monotonic()))
            code, out = self.cluster._agent(["wait", str(self.id), f"{chunk:.3f}"], timeout=chunk + 30)
            record = json.loads(out or b"{}")
            if code == 0:
                return JobStatus(record["status"])
            if code != 3:
                raise RunError(f"cannot wait for job {self.id} on {self.cluster.name}: agent exit {code}")
            if deadline is not None and time.monotonic() >= deadline:
                raise RunTimeoutError(
                    f"job {self.id} on {self.cluster.name} is still {record.get('status')} after {timeout:g} s"
                )

    @overload
    def logs(self, follow: Literal[False] = ...) -> str: ...

    @overload
    def logs(self, follow: Literal[True]) -> Iterator[str]: ...

    def logs(self, follow: bool = False) -> str | Iterator[str]:
        """The merged, prefixed log so far; with ``follow=True``, its lines until the job ends."""
        if follow:
            return self.cluster._agent_stream(["logs", str(self.id), "follow"])
        _, out = self.cluster._agent(["logs", str(self.id)])
        return out.decode("utf-8", "replace")

    def cancel(self) -> JobStatus:
        """Stop every rank's processes on every node; returns the final status."""
        self.cluster._agent(["cancel", str(self.id)], timeout=60)
        return self.status

    def result(self) -> RunResult | None:
        """The job's RunResult once it has ended (None before)."""
        from pytest_sky.runner import result_from_events

        code, events = self.cluster._agent(["events", str(self.id)])
        if code != 0:
            raise RunError(f"cluster {self.cluster.name} has no record of job {self.id}")
        return result_from_events(events)
