"""The agent's job commands: read and steer the jobs on the head (``job.Job`` calls them).

``jobs``, ``wait``, ``logs`` and ``events`` read a job's files
(:mod:`pytest_sky.agent.records`), ``cancel`` signals a job's agent (which stops every rank),
``forget`` drops the records of ended jobs and ``stacks`` says where a job's processes are
(:mod:`pytest_sky.agent.stacks`).  A job whose agent is gone while its record
still says it is live is marked failed on the way (:func:`~pytest_sky.agent.records.died`).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from pytest_sky.agent.rank import STOP_GRACE_SECONDS
from pytest_sky.agent.records import died, job_dirs, read_status, update
from pytest_sky.protocol import LIVE, TERMINAL, JobRecord, JobStatus, SpecEvent, encode_records


def jobs_main(argv: list[str]) -> int:
    """``jobs all|ID``: the job records as one JSON list (the queue)."""
    out = []
    for d in job_dirs(argv[0] if argv else "all"):
        record = read_status(d)
        if record is None:
            continue
        if _orphaned(record):
            record = died(d)
        out.append(record)
    sys.stdout.write(encode_records(out) + "\n")
    return 0


def _orphaned(record: JobRecord) -> bool:
    """A live job whose agent is gone: sky's FAILED_DRIVER.  A pending job is one as soon as
    it names its agent (a submit returns only once it does), so a job that waited for its
    turn when its cluster was stopped is one too; one that names none yet is still being
    started, unless that began long ago."""
    if record.status not in LIVE:
        return False
    known = record.status == JobStatus.RUNNING or record.pid is not None or time.time() - record.submitted > 30
    return known and not _agent_alive(record)


def _agent_alive(record: JobRecord) -> bool:
    from pytest_sky import procs

    # We are the subreaper of what our jobs left behind: reap it on the way.
    pid = record.pid
    return isinstance(pid, int) and pid > 0 and procs.alive_reaping(pid, record.pid_start)


def wait_main(argv: list[str]) -> int:
    """``wait ID SECONDS``: block until the job ends (exit 0) or the bound passes (exit 3)."""
    job_dir = job_dirs(argv[0])[0]
    deadline = time.monotonic() + float(argv[1])
    while True:
        record = read_status(job_dir)
        if record is None:
            sys.stderr.write(f"no job {argv[0]}\n")
            return 2
        if record.status in TERMINAL:
            sys.stdout.write(record.encode() + "\n")
            return 0
        if _orphaned(record):
            died(job_dir)
            continue
        if time.monotonic() >= deadline:
            sys.stdout.write(record.encode() + "\n")
            return 3
        time.sleep(0.05)


def logs_main(argv: list[str]) -> int:
    """``logs ID [follow]``: the prefixed log so far, or followed until the job ends."""
    job_dir = job_dirs(argv[0])[0]
    follow = len(argv) > 1 and argv[1] == "follow"
    path = os.path.join(job_dir, "run.log")
    out = sys.stdout.buffer
    offset = 0
    while True:
        record = read_status(job_dir)
        ended = record is not None and record.status in TERMINAL
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except OSError:
            chunk = b""
        if chunk:
            offset += len(chunk)
            out.write(chunk)
            out.flush()
        if not follow or (ended and not chunk):
            return 0
        if not chunk:
            time.sleep(0.05)


def events_main(argv: list[str]) -> int:
    """``events ID``: the job's spec, then its events as recorded (to rebuild its RunResult)."""
    job_dir = job_dirs(argv[0])[0]
    try:
        with open(os.path.join(job_dir, "spec.json"), "rb") as f:
            spec = f.read().strip()
        with open(os.path.join(job_dir, "events.jsonl"), "rb") as f:
            events = f.read()
    except OSError:
        return 2
    sys.stdout.buffer.write(SpecEvent.encode_raw(spec) + events)
    return 0


def cancel_main(argv: list[str]) -> int:
    """``cancel ID|all``: SIGTERM each live job's agent (which stops every rank), then wait."""
    targets = []
    for d in job_dirs(argv[0] if argv else "all"):
        record = read_status(d)
        if record and record.status not in TERMINAL:
            if _agent_alive(record):
                os.kill(record.pid, signal.SIGTERM)  # type: ignore[arg-type]
                targets.append(d)
            elif record.status == JobStatus.PENDING:
                update(d, status=JobStatus.CANCELLED, error="cancelled before it started", ended=time.time())
    deadline = time.monotonic() + STOP_GRACE_SECONDS + 10
    while targets and time.monotonic() < deadline:
        targets = [d for d in targets if _still_running(d)]
        time.sleep(0.05)
    sys.stdout.write(encode_records(read_status(d) for d in job_dirs(argv[0] if argv else "all")) + "\n")
    return 0


_ENDED = JobRecord(id=0, status=JobStatus.FAILED)  # a record that vanished: nothing left to wait for


def _still_running(job_dir: str) -> bool:
    """Not ended, or ended on paper while its agent process still lives: a cancel returns only
    once the job's own process is gone too (a cluster shared by tests checks that it is)."""
    record = read_status(job_dir) or _ENDED
    return record.status not in TERMINAL or _agent_alive(record)


def forget_main(argv: list[str]) -> int:
    """``forget``: drop the records of every ended job, so that the next test on a cluster
    shared by several starts with an empty queue, as on a fresh one.  Ids keep counting up."""
    import shutil

    for d in job_dirs("all"):
        record = read_status(d)
        if record is not None and not _still_running(d):
            shutil.rmtree(d, ignore_errors=True)
    return 0


def stacks_main(argv: list[str]) -> int:
    """``stacks``: where every process of a job is, on every node (``agent.stacks``; imported
    here, not at the agent's start: no run pays for it)."""
    from pytest_sky.agent.stacks import main

    return main(argv)


def stacks_node_main(argv: list[str]) -> int:
    """``stacks-node``: one node's part of ``stacks``, asked by the head."""
    from pytest_sky.agent.stacks import node_main

    return node_main(argv)


COMMANDS = {
    "jobs": jobs_main,
    "wait": wait_main,
    "logs": logs_main,
    "events": events_main,
    "cancel": cancel_main,
    "forget": forget_main,
    "stacks": stacks_main,
    "stacks-node": stacks_node_main,
}
