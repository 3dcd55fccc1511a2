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

    from pytest_sky.diagnosis import Capture
    from pytest_sky.runner import AgentClient, RunResult, StoppedRun

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
        """Block until the job ends; returns its final status.  Past ``timeout`` it raises
        :class:`RunTimeoutError` whose ``capture`` says where every rank of the job is (the
        job itself goes on: ``cancel`` stops it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                # Bounded waits on the head: a dropped connection is noticed, and reopened.
                chunk = 30.0 if deadline is None else max(0.0, min(30.0, deadline - time.monotonic()))
                ended, record = self._agent.wait(self.id, chunk)
                if ended:
                    return record.status
                if deadline is not None and time.monotonic() >= deadline:
                    assert timeout is not None
                    stopped = self._stopped(f"when Job.wait gave up after {timeout:g} s")
                    raise RunTimeoutError(
                        f"job {self.id} on {self.cluster_name} is still {record.status} after {timeout:g} s",
                        timeline=stopped.timeline if stopped else None,
                        capture=stopped.capture if stopped else None,
                    )
        except RunError:
            raise
        except BaseException as exc:  # Ctrl-C, a test's own timeout: where the ranks were, for its report
            self._look_before(exc)
            raise

    def _stopped(self, why: str) -> StoppedRun | None:
        """Where every rank of this job is (``AgentClient.stopped``), from its recorded events;
        None once it has ended."""
        from pytest_sky.runner import replayed

        code, events = self._agent.call(["events", str(self.id)])
        collector = replayed(events) if code == 0 else None
        if collector is None or collector.done is not None:
            return None
        collector.job_id = collector.job_id or self.id  # a detached job's events name no job
        return self._agent.stopped(collector, why, collector.timeline(timed_out=True, deadline=time.time()))

    def capture(self, why: str = "when asked") -> Capture | None:
        """Where every process of the job is now, on every node (None once it has ended):
        what a stopped run's report shows, without stopping anything."""
        stopped = self._stopped(why)
        return stopped.capture if stopped is not None else None

    def _look_before(self, exc: BaseException) -> None:
        from pytest_sky.diagnosis import why_stopped

        try:
            self._stopped(why_stopped(exc))
        except (Exception, KeyboardInterrupt):  # noqa: BLE001 - the head cannot answer, or a second Ctrl-C
            pass  # what ended the wait goes on

    @overload
    def logs(self, follow: Literal[False] = ..., *, timeout: float | None = ...) -> str: ...

    @overload
    def logs(self, follow: Literal[True], *, timeout: float | None = ...) -> Iterator[str]: ...

    def logs(self, follow: bool = False, *, timeout: float | None = None) -> str | Iterator[str]:
        """The merged, prefixed log so far; with ``follow=True``, its lines until the job ends
        (past ``timeout`` seconds, :class:`RunTimeoutError`; the job goes on)."""
        if follow:
            return self._agent.follow_logs(self.id, None if timeout is None else time.monotonic() + timeout)
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
