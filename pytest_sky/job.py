"""Detached jobs: a run that lives on the head, so the client may disconnect and come back.

The agent on the head keeps each job's state in ``~/.sky/jobs/<id>/`` (status, prefixed log,
events); a :class:`Job` reads and steers it through the cluster's
:class:`~pytest_sky.runner.AgentClient`, one short agent command at a time.  It knows its
cluster by name only: a job outlives the ``Cluster`` object that submitted it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, overload

from pytest_sky.errors import RunError, RunTimeoutError
from pytest_sky.protocol import JobStatus

if TYPE_CHECKING:
    from typing import Literal

    from pytest_sky.runner import AgentClient, RunResult

__all__ = ["Job", "JobStatus"]


class Job:
    def __init__(self, agent: AgentClient, job_id: int, task_id: str = "") -> None:
        self._agent = agent
        self.id = job_id
        self.task_id = task_id

    @property
    def cluster_name(self) -> str:
        return self._agent.cluster

    def __repr__(self) -> str:
        return f"Job({self.id}, cluster={self.cluster_name!r})"

    def info(self) -> dict[str, Any]:
        """The job's record on the head: status, returncode, error, timestamps, its agent's pid."""
        info: dict[str, Any] = self._agent.job(self.id).as_dict()  # type: ignore[attr-defined]
        return info

    @property
    def status(self) -> JobStatus:
        """The job's status now, asked of the head on each read: one agent command over the
        cluster's connection (an exec on the head, a few tens of milliseconds; more on a busy
        machine).  To wait for the end, :meth:`wait` blocks on the head instead of polling."""
        return self._agent.job(self.id).status

    @property
    def error(self) -> str | None:
        """Why the job failed (None while it has not), asked of the head as :attr:`status` is."""
        return self._agent.job(self.id).error

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Block until the job ends; returns its final status, raises on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # Bounded waits on the head: a dropped connection is noticed, and reopened.
            chunk = 30.0 if deadline is None else max(0.0, min(30.0, deadline - time.monotonic()))
            ended, record = self._agent.wait(self.id, chunk)
            if ended:
                return record.status
            if deadline is not None and time.monotonic() >= deadline:
                raise RunTimeoutError(
                    f"job {self.id} on {self.cluster_name} is still {record.status} after {timeout:g} s"
                )

    @overload
    def logs(self, follow: Literal[False] = ...) -> str: ...

    @overload
    def logs(self, follow: Literal[True]) -> Iterator[str]: ...

    def logs(self, follow: bool = False) -> str | Iterator[str]:
        """The merged, prefixed log so far; with ``follow=True``, its lines until the job ends."""
        if follow:
            return self._agent.follow_logs(self.id)
        return self._agent.logs(self.id)

    def cancel(self) -> JobStatus:
        """Stop every rank's processes on every node; returns the final status."""
        self._agent.cancel(self.id)
        return self.status

    def result(self, timeout: float | None = None) -> RunResult:
        """Wait for the job to end (:meth:`wait`: at most ``timeout`` seconds, else
        :class:`~pytest_sky.errors.RunTimeoutError`), then its :class:`RunResult`: every
        rank's exit code and output, as an attached run returns it."""
        self.wait(timeout)
        result = self._agent.result(self.id)
        if result is None:  # ended, yet its events do not say how: its agent died mid-record
            raise RunError(f"job {self.id} on {self.cluster_name} ended without a result ({self.error or 'no record'})")
        return result
