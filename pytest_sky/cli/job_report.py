"""What the CLI says about a job, in SkyPilot's words: its submission, its end, its exit code.

Scripts and CI written against ``sky`` grep these lines and branch on these codes (SkyPilot's
``exceptions.JobExitCode`` and the lines of its backend and ``log_lib``), so ``pytest-sky``
prints and returns the same: ``Job submitted, ID: 3``, ``Job finished (status: FAILED).``,
exit 100 for a failed job.
"""

from __future__ import annotations

from enum import IntEnum

from pytest_sky import console
from pytest_sky.errors import RunTimeoutError
from pytest_sky.protocol import LIVE, FailedPhase, JobStatus

#: The name of a task made from a command line (SkyPilot's ``sky-cmd``); ``-n`` overrides it.
COMMAND_TASK_NAME = "sky-cmd"

#: What a command interrupted by Ctrl-C exits with (128 + SIGINT), as a shell reports it.
EXIT_INTERRUPTED = 130


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
        return FAILED_WORDS[FailedPhase(failed_phase)]
    return str(status)


def finished(status: JobStatus | str, failed_phase: FailedPhase | str | None = None) -> str:
    return f"Job finished (status: {sky_status(status, failed_phase)})."


def status_line(job_id: int, status: JobStatus | str, failed_phase: FailedPhase | str | None = None) -> str:
    """``logs --status``."""
    return f"Job {job_id}: {sky_status(status, failed_phase)}"


#: Before ``Job submitted`` where the task has a setup: it runs as the job's first phase.
SETUP_DETACHED = "✓ Setup detached."


def useful_commands(cluster: str, job_id: int) -> str:
    """What sky prints after an attached job: its id, then how to cancel, follow and list it."""
    return "\n".join(
        [
            "",
            "📋 Useful Commands",
            f"Job ID: {job_id}",
            f"├── To cancel the job:\t\tpytest-sky cancel {cluster} {job_id}",
            f"├── To stream job logs:\t\tpytest-sky logs {cluster} {job_id}",
            f"└── To view job queue:\t\tpytest-sky queue {cluster}",
        ]
    )


def launching(cloud_label: str) -> str:
    return f"Launching on {cloud_label}."


def is_up(name: str, num_nodes: int, head_ip: str) -> str:
    """The line after :func:`launching` (sky's output has "is up." right below it)."""
    return f"└── Cluster {name} is up. {num_nodes} node(s), head {head_ip}"


def synced(job_id: int, where: object) -> str:
    """``logs --sync-down``: the directory that holds the job's ``run.log``.  In sky's colours
    whatever the output is: scripts cut the directory out up to the closing ``ESC[0m``."""
    return f"\x1b[36mJob {job_id} logs: {where}\x1b[0m"


def cancelled(ids: list[int]) -> str:
    if not ids:
        return "No jobs cancelled. They may be in terminal states."
    return f"Cancelled job ID(s): {', '.join(map(str, ids))}"


def follow(cluster, job, *, tail: int = 0, timeout: float | None = None) -> int:
    """Stream a job's log until it ends (``tail``: from the last lines written so far); its
    exit code as ``sky``'s (100: failed).  Ctrl-C stops following, never the job; past
    ``timeout`` seconds the job is a hung run: where every rank is gets printed, then the
    job is cancelled (exit 103, sky's for a cancelled job)."""
    skip = max(0, len(job.logs().splitlines()) - tail) if tail else 0
    try:
        for number, line in enumerate(job.logs(follow=True, timeout=timeout)):
            if number >= skip:
                print(line, flush=True)
        status = job.wait(60)
    except RunTimeoutError:
        assert timeout is not None
        return _stop_hung(cluster, job, timeout)
    except KeyboardInterrupt:
        console.hint(
            f"job {job.id} keeps running on {cluster.name}; follow it with "
            f"`pytest-sky logs {cluster.name} {job.id} --follow`, stop it with "
            f"`pytest-sky cancel {cluster.name} {job.id}`"
        )
        return EXIT_INTERRUPTED
    print(finished(status, job.info().get("failed_phase")), flush=True)
    if status not in LIVE and status != JobStatus.SUCCEEDED:
        result = job.result()
        if result.error:
            console.error(f"job {job.id}: {result.error}")
    return JobExitCode.of(status)


def _stop_hung(cluster, job, timeout: float) -> int:
    """A job past its ``--timeout``: where every rank is, then cancelled."""
    capture = job.capture(f"at the deadline ({timeout:g} s)")
    if capture is not None:
        print(capture.summary(), end="", flush=True)
    console.error(f"job {job.id} on {cluster.name} did not finish within {timeout:g} s: cancelling it")
    status = job.cancel()
    print(finished(status, job.info().get("failed_phase")), flush=True)
    return JobExitCode.of(status)
