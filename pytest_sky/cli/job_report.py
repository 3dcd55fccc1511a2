"""What the CLI says about a job, in SkyPilot's words: its submission, its end, its exit code.

Scripts and CI written against ``sky`` grep these lines and branch on these codes (SkyPilot's
``exceptions.JobExitCode`` and the lines of its backend and ``log_lib``), so ``pytest-sky``
prints and returns the same: ``Job submitted, ID: 3``, ``Job finished (status: FAILED).``,
exit 100 for a failed job.
"""

from __future__ import annotations

from enum import IntEnum

from pytest_sky.protocol import LIVE, FailedPhase, JobStatus

#: The name of a task made from a command line (SkyPilot's ``sky-cmd``); ``-n`` overrides it.
COMMAND_TASK_NAME = "sky-cmd"


class JobExitCode(IntEnum):
    """How ``launch``, ``exec`` and ``logs`` exit for a job, as ``sky`` does."""

    SUCCEEDED = 0
    FAILED = 100
    NOT_FINISHED = 101
    NOT_FOUND = 102
    CANCELLED = 103

    @classmethod
    def of(cls, status: JobStatus | None) -> JobExitCode:
        if status is None:
            return cls.NOT_FOUND
        if status in LIVE:
            return cls.NOT_FINISHED
        if status == JobStatus.SUCCEEDED:
            return cls.SUCCEEDED
        if status == JobStatus.CANCELLED:
            return cls.CANCELLED
        return cls.FAILED


def submitted(job_id: int) -> str:
    return f"Job submitted, ID: {job_id}"


#: sky's words for how a FAILED job failed (``JobRecord.failed_phase``).
FAILED_WORDS = {FailedPhase.SETUP: "FAILED_SETUP", FailedPhase.DRIVER: "FAILED_DRIVER"}


def sky_status(status: JobStatus | str, failed_phase: FailedPhase | str | None = None) -> str:
    """The status as sky writes it: a job that failed in its setup is ``FAILED_SETUP``, one
    whose agent died (its cluster stopped, say) ``FAILED_DRIVER``."""
    if status == JobStatus.FAILED and failed_phase in FAILED_WORDS:
        return FAILED_WORDS[failed_phase]
    return str(status)


def finished(status: JobStatus | str, failed_phase: FailedPhase | str | None = None) -> str:
    return f"Job finished (status: {sky_status(status, failed_phase)})."


def status_line(job_id: int, status: JobStatus | str, failed_phase: FailedPhase | str | None = None) -> str:
    """``logs --status``."""
    return f"Job {job_id}: {sky_status(status, failed_phase)}"


def launching(cloud_label: str) -> str:
    return f"Launching on {cloud_label}."


def is_up(name: str, num_nodes: int, head_ip: str) -> str:
    """The line after :func:`launching` (sky's output has "is up." right below it)."""
    return f"└── Cluster {name} is up. {num_nodes} node(s), head {head_ip}"


def synced(job_id: int, where: object) -> str:
    """``logs --sync-down``: the directory that holds the job's ``run.log``."""
    return f"Job {job_id} logs: {where}"


def cancelled(ids: list[int]) -> str:
    if not ids:
        return "No jobs cancelled. They may be in terminal states."
    return f"Cancelled job ID(s): {', '.join(map(str, ids))}"
