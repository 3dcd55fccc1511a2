"""A job's files on the head, in ``~/.sky/jobs/<id>``: its record, its log, its events.

``status.json`` is the job's :class:`~pytest_sky.protocol.JobRecord` (written whole and
renamed into place: the agent and a ``wait`` that finds it dead may both write it),
``run.log`` the ranks' output with each line's prefix, ``events.jsonl`` what an attached
client was sent, and ``spec.json`` the run spec: enough for ``logs`` and ``events`` to serve a
job long after its agent is gone.  None holds a secret's value: the output is masked where
it is read (``agent.rank``), and the spec keeps the secrets' names only.  Ids count up under a
lock, per node.
"""

from __future__ import annotations

import os
import sys
import time

from pytest_sky import procs
from pytest_sky.locks import flocked, rewrite
from pytest_sky.protocol import TERMINAL, Event, FailedPhase, JobRecord, JobStatus, RunSpec, decode_record, to_json


def jobs_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".sky", "jobs")


def job_dirs(which: str) -> list[str]:
    """The directory of job ``which`` (an id), or of every job for ``all``, in id order."""
    root = jobs_dir()
    if which == "all":
        try:
            ids = sorted(int(d) for d in os.listdir(root) if d.isdigit())
        except OSError:
            ids = []
        return [os.path.join(root, str(i)) for i in ids]
    return [os.path.join(root, str(int(which)))]


def _allocate_job(home: str, cluster: str) -> tuple[int, str, str]:
    jobs = os.path.join(home, ".sky", "jobs")
    os.makedirs(jobs, exist_ok=True)
    with flocked(os.path.join(jobs, ".lock")):
        counter = os.path.join(jobs, "last_id")
        try:
            with open(counter) as f:
                last = int(f.read().strip() or 0)
        except (OSError, ValueError):
            last = 0
        job_id = last + 1
        rewrite(counter, str(job_id))
    job_dir = os.path.join(jobs, str(job_id))
    os.makedirs(job_dir, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d-%H-%M-%S", time.gmtime()) + f"-{int(time.time() * 1e6) % 1_000_000:06d}"
    return job_id, f"sky-{stamp}_{cluster}_{job_id}", job_dir


def new_job(spec: RunSpec, detached: bool, pid: int | None = None) -> tuple[JobRecord, str]:
    """A new job's id, directory, spec and first (pending) record; ``pid``: the process that
    will run it, when that is already this one (a pending job whose process is gone is
    passed over by the queue)."""
    job_id, task_id, job_dir = _allocate_job(os.path.expanduser("~"), spec.cluster)
    with open(os.path.join(job_dir, "spec.json"), "w") as f:
        f.write(to_json(spec.to_record()))  # the secrets' names, not their values
    record = JobRecord(
        id=job_id,
        status=JobStatus.PENDING,
        task_id=task_id,
        name=spec.task_name,
        num_nodes=spec.num_nodes,
        detached=detached,
        submitted=time.time(),
        pid=pid,
        pid_start=procs.start_time(pid) if pid else None,
    )
    return _save(job_dir, record), job_dir


_RECORDS: dict[str, JobRecord] = {}  # what this process wrote: never read back (nor json imported)


def _save(job_dir: str, record: JobRecord) -> JobRecord:
    path = os.path.join(job_dir, "status.json")
    tmp = f"{path}.{os.getpid()}.tmp"  # the agent and a `wait` marking it dead may both write
    with open(tmp, "w") as f:
        f.write(record.encode())
    os.replace(tmp, path)
    _RECORDS[job_dir] = record
    return record


def update(job_dir: str, **changes: object) -> JobRecord:
    """Change some fields of the job's record (its id taken from its directory if it has none)."""
    record = _RECORDS.get(job_dir) or read_status(job_dir)
    if record is None:
        record = JobRecord(id=int(os.path.basename(job_dir)), status=JobStatus.PENDING)
    for key, value in changes.items():
        if key not in JobRecord.fields:  # type: ignore[attr-defined]
            raise AttributeError(f"a job record has no field {key!r}")
        setattr(record, key, value)
    return _save(job_dir, record)


def read_status(job_dir: str) -> JobRecord | None:
    try:
        with open(os.path.join(job_dir, "status.json"), "rb") as f:
            return decode_record(f.read())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def died(job_dir: str) -> JobRecord:
    """Mark a live job whose agent is gone as failed, unless it has ended meanwhile: the agent
    writes its last record and exits between a caller's read of the record and its look at
    the agent's pid, and that record (a rank's failure, say) is the one that tells why."""
    record = read_status(job_dir)
    if record is not None and record.status in TERMINAL:
        _RECORDS[job_dir] = record
        return record
    # sky's FAILED_DRIVER: what a job on a stopped cluster becomes (``cli.job_report``).
    return update(
        job_dir,
        status=JobStatus.FAILED,
        error="the job's agent died",
        failed_phase=FailedPhase.DRIVER,
        ended=time.time(),
    )


class Emitter:
    """Writes events to the client (attached runs) and to the job's files, one writer at a time."""

    def __init__(self, job_dir: str, *, to_stdout: bool) -> None:
        import threading

        self._lock = threading.Lock()
        self._out = sys.stdout.buffer if to_stdout else None
        self._log = open(os.path.join(job_dir, "run.log"), "ab")  # noqa: SIM115 - lives as long as the job
        self._events = open(os.path.join(job_dir, "events.jsonl"), "ab")  # noqa: SIM115
        self.client_gone = not to_stdout

    def event(self, event: Event) -> None:
        self.emit([event])

    def log(self, text: str) -> None:
        self.emit([], text)

    def emit(self, events: list[Event], text: str = "") -> None:
        """``events`` and ``text`` (lines of the prefixed log), each file and the client
        written once."""
        data = b"".join(e.encode() for e in events)
        with self._lock:
            if text:
                self._log.write(text.encode("utf-8", "replace"))
                self._log.flush()
            if not data:
                return
            self._events.write(data)
            self._events.flush()
            if self.client_gone or self._out is None:
                return
            try:
                self._out.write(data)
                self._out.flush()
            except (BrokenPipeError, OSError):
                self.client_gone = True
