"""The head's job queue: first in, first out, each running job holding its CPUs.

As SkyPilot's: a job asks for ``cpus`` on each of its nodes (0.5 unless its task says more:
``protocol.DEFAULT_JOB_CPUS``), a cluster launched with ``cpus=N`` gives each node N, and a job
starts once every job submitted before it has started and its CPUs are free, so 75 jobs on
an 8-CPU cluster give 16 RUNNING and the rest PENDING, in order.  A cluster launched without
``cpus`` has no count to hold (its local nodes share this machine's cores; a pod's default
request is no promise either), so there only the order holds and every job starts at once.
GPUs are shared by the fractions jobs ask for (``V100:0.5`` holds half of one), against the
node's whole GPUs.

Waiting is event-driven: a job that must wait makes a doorbell (a FIFO in its directory), and
every job that ends, or starts, rings the bell of every job still pending (one that waited
only for its elder to go first may go now); a pending job then looks again, under the queue's
lock.  The bell exists before the look that sends it to wait, so a ring that
comes between that look and the wait stays in the pipe and is never lost.  A cancel (SIGTERM)
or an attached client that goes away rings the job's own bell.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Iterator

from pytest_sky import procs
from pytest_sky.agent.records import jobs_dir, update
from pytest_sky.locks import flocked, rewrite
from pytest_sky.protocol import JobRecord, JobStatus, RunSpec

BELL = "bell"  # the doorbell FIFO's name in a pending job's directory


class Doorbell:
    """A pending job's FIFO, held open for reading and for writing by the job itself: open
    for writing, it never reads end-of-file, and its own handlers can ring it.

    Its descriptors stay open until the job's process exits (one job per process, and not
    inherited by the ranks): closed earlier, a handler in another thread could ring a number
    the process had meanwhile given to another file."""

    def __init__(self, job_dir: str) -> None:
        self.path = os.path.join(job_dir, BELL)
        with contextlib.suppress(FileExistsError):
            os.mkfifo(self.path, 0o600)
        self._read = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._write = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)

    def ring(self) -> None:
        """Safe in a signal handler and from any thread."""
        with contextlib.suppress(OSError):  # a full pipe has rung already
            os.write(self._write, b"!")

    def wait(self) -> None:
        select.select([self._read], [], [])
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 4096):
                pass

    def retire(self) -> None:
        """No longer pending: nobody else rings it."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class Entry:
    """A live job in the queue's ledger: one line ``ID PID START CPUS GPUS R|P`` (running or
    pending).  The process's start time tells it from a later one of the same pid: a node
    that was stopped and started again counts its pids from 1 again."""

    __slots__ = ("cpus", "gpus", "id", "pid", "running", "start")

    def __init__(self, job_id: int, pid: int, start: int, cpus: float, gpus: float, running: bool) -> None:
        self.id, self.pid, self.start, self.running = job_id, pid, start, running
        self.cpus, self.gpus = cpus, gpus

    def line(self) -> str:
        state = "R" if self.running else "P"
        return f"{self.id} {self.pid} {self.start} {self.cpus!r} {self.gpus!r} {state}\n"

    @classmethod
    def parse(cls, line: str) -> Entry:
        job_id, pid, start, cpus, gpus, state = line.split()
        return cls(int(job_id), int(pid), int(start), float(cpus), float(gpus), state == "R")

    def alive(self) -> bool:
        return procs.alive_reaping(self.pid, self.start)


class Cancellation:
    """A job's cancel flag and the doorbell it rings while the job waits in the queue: one
    callable for the signal handlers and the attached run's lifeline."""

    def __init__(self) -> None:
        import threading

        self.event = threading.Event()
        self.bell: list[Doorbell] = []  # filled by take_turn once the job must wait

    def __call__(self, *_: object) -> None:
        self.event.set()
        if self.bell:
            self.bell[0].ring()


class _Ledger:
    """The live jobs, read and written under the queue's lock: a few short lines, where the
    jobs' own records would cost every run a JSON parse of every job the head ever kept."""

    def __init__(self) -> None:
        self.path = os.path.join(jobs_dir(), "queue")

    @contextlib.contextmanager
    def locked(self) -> Iterator[list[Entry]]:
        """The entries whose process lives; what the caller leaves in the list is written back."""
        with flocked(self.path + ".lock"):
            entries = [e for e in self._read() if e.alive()]
            yield entries
            rewrite(self.path, "".join(e.line() for e in entries))

    def _read(self) -> list[Entry]:
        try:
            with open(self.path) as f:
                return [Entry.parse(line) for line in f if line.strip()]
        except (OSError, ValueError):
            return []


def _may_start(me: Entry, others: list[Entry], spec: RunSpec) -> bool:
    """No live job submitted before ``me`` still waits, and ``me``'s CPUs and GPUs are free."""
    if any(not e.running and e.id < me.id for e in others):
        return False
    running = [e for e in others if e.running]
    cpus_free = spec.node_cpus is None or sum(e.cpus for e in running) + me.cpus <= spec.node_cpus + 1e-9
    gpus_free = me.gpus == 0 or sum(e.gpus for e in running) + me.gpus <= spec.node_gpus + 1e-9
    return cpus_free and gpus_free


def take_turn(record: JobRecord, job_dir: str, spec: RunSpec, cancelled, bell: list[Doorbell]) -> bool:
    """Wait for the job's turn and mark it RUNNING (True), or return False once it is
    cancelled while it waits.  ``bell`` receives the doorbell once one is made, for the
    caller's signal handlers to ring."""
    start = procs.start_time(os.getpid()) or 0
    me = Entry(record.id, os.getpid(), start, spec.cpus_per_node, spec.gpu_share, running=False)
    ledger = _Ledger()
    try:
        while True:
            with ledger.locked() as entries:
                entries[:] = [e for e in entries if e.id != me.id]
                if cancelled.is_set():
                    return False
                me.running = _may_start(me, entries, spec)
                entries.append(me)
                if me.running:
                    update(job_dir, status=JobStatus.RUNNING, pid=me.pid, pid_start=me.start, started=time.time())
                    waiting = [e.id for e in entries if not e.running]
                elif not bell:  # made before the next look: no ring between look and wait is lost
                    bell.append(Doorbell(job_dir))
                    continue
            if me.running:  # a later job that waited only for this one to go first may go now
                _ring(waiting)
                return True
            bell[0].wait()
    finally:
        if bell:
            bell[0].retire()


def leave(record: JobRecord) -> None:
    """The job ended (or never started): its CPUs are free, and every pending job looks again."""
    ledger = _Ledger()
    with ledger.locked() as entries:
        entries[:] = [e for e in entries if e.id != record.id]
        pending = [e.id for e in entries if not e.running]
    _ring(pending)


def _ring(job_ids: list[int]) -> None:
    for job_id in job_ids:
        try:
            fd = os.open(os.path.join(jobs_dir(), str(job_id), BELL), os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # not waiting yet (it looks before it waits), or gone
            continue
        with contextlib.suppress(OSError):
            os.write(fd, b"!")
        os.close(fd)
