"""``logs``: a job's log, its status, a copy of it here, or how its cluster was launched, in
``sky logs``'s forms and with its exit codes (``job_report.JobExitCode``)."""

from __future__ import annotations

import argparse
import sys

from pytest_sky import console
from pytest_sky.cli import job_report
from pytest_sky.cli.commands import UsageError, _cluster, whole_number
from pytest_sky.cli.job_report import JobExitCode
from pytest_sky.protocol import JobStatus


def cmd_logs(args: argparse.Namespace) -> int:
    """A job's log (the latest job's by default), followed until it ends unless
    ``--no-follow``; or, with ``--status``, one line ``Job N: STATUS``.  Exits as ``sky logs``
    does: 0 succeeded, 100 failed, 101 not finished (``--status`` only), 102 no such job,
    103 cancelled."""
    from pytest_sky.errors import RunError

    if args.provision:
        return _provision_log(args.cluster, args.tail)
    if not args.sync_down and len(args.jobs) > 1:
        raise UsageError(f"give one job id to show its log, not {len(args.jobs)} (several go with --sync-down)")
    job_id = _job_id(args.jobs[0]) if args.jobs and not args.sync_down else None
    cluster = _cluster(args.cluster)
    if args.sync_down and args.jobs:
        return _sync_down_each(cluster, args.jobs)
    if job_id is None:
        jobs = cluster.queue()
        if not jobs:
            print(f"No job found on cluster {cluster.name!r}.")
            return JobExitCode.NOT_FOUND
        job_id = jobs[-1]["id"]
    job = cluster.job(job_id)
    try:
        info = job.info()  # one call to the head: the status and how it failed
    except RunError:
        console.error(f"Job {job_id} not found on cluster {cluster.name!r}")
        return JobExitCode.NOT_FOUND
    status = JobStatus(info["status"])
    if args.status:
        print(job_report.status_line(job_id, status, info.get("failed_phase")))
        return JobExitCode.of(status)
    if args.sync_down:
        return _sync_down(cluster, job)
    if args.follow:
        return job_report.follow(cluster, job, tail=args.tail)
    text = job.logs()
    sys.stdout.write(_last_lines(text, args.tail))
    code = JobExitCode.of(status)
    return JobExitCode.SUCCEEDED if code == JobExitCode.NOT_FINISHED else code


def _provision_log(name: str, tail: int) -> int:
    """``logs --provision``: the launch's own account (``lifecycle.PROVISION_LOG``), as sky's
    provision log: which nodes came up where, and how long it took."""
    from pytest_sky.lifecycle import PROVISION_LOG
    from pytest_sky.state import StateStore

    store = StateStore()
    path = store.cluster_dir(name) / PROVISION_LOG
    if store.load(name) is None:  # torn down: the log its teardown kept, as sky's history
        path = store.history_file(name, PROVISION_LOG)
        if not path.exists():
            raise UsageError(f"no cluster named {name!r} (see `pytest-sky status`)")
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        raise UsageError(f"cluster {name} has no launch log (it was launched by an older pytest-sky)") from None
    sys.stdout.write(_last_lines(text, tail))
    return 0


def _last_lines(text: str, tail: int) -> str:
    """The last ``tail`` lines of ``text`` (0: all of it)."""
    if not tail:
        return text
    return "".join(text.splitlines(keepends=True)[-tail:])


def _job_id(word: str) -> int:
    try:
        return whole_number(word)
    except ValueError as exc:
        raise UsageError(f"argument JOB: {exc}") from None


def _sync_down(cluster, job) -> int:
    """``--sync-down``: the job's log into this machine's state directory, and where."""
    from pytest_sky.state import home

    where = home() / "logs" / cluster.name / str(job.id)
    where.mkdir(parents=True, exist_ok=True)
    (where / "run.log").write_text(job.logs(), encoding="utf-8")
    print(job_report.synced(job.id, where))
    return JobExitCode.SUCCEEDED


def _sync_down_each(cluster, words: list[str]) -> int:
    """``--sync-down`` of several jobs, as sky takes them: a word that is no job id (a glob
    the shell left, or expanded to file names) names no job, and is passed over."""
    from pytest_sky.errors import RunError

    for word in words:
        if not word.strip().isdecimal():  # isdigit would take '²', which int() refuses
            console.note(f"{word!r} is no job id of {cluster.name}: skipped")
            continue
        job = cluster.job(int(word))
        try:
            job.info()
        except RunError:
            console.error(f"Job {word} not found on cluster {cluster.name!r}")
            return JobExitCode.NOT_FOUND
        _sync_down(cluster, job)
    return JobExitCode.SUCCEEDED
