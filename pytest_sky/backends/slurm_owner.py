"""Who owns a Slurm allocation of pytest-sky's: a record in the job itself (its ``--comment``).

A session killed with SIGKILL leaves its allocation running until its ``--time`` ends; its
state directory may be gone too (a CI runner's temporary one).  So the job carries its owner:
this machine (hostname and boot), the launching process (pid and start time) and whether the
cluster was kept on purpose.  A later session on this machine, or ``pytest-sky down --stale
--slurm``, cancels the allocations whose owner is gone, finding them by the user, the job name
(``pytest-sky-<cluster>``) and this record; it never judges a job it did not name, one whose
record it cannot read, one of another machine, or a kept one.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from pytest_sky import procs

#: Every job name of ours starts so (``pytest-sky-<cluster>``).
JOB_PREFIX = "pytest-sky-"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_RECORD = re.compile(
    r"^pytest-sky owner=(?P<host>[^\s:]+):(?P<boot>[0-9a-f-]+):(?P<pid>\d+):(?P<start>\d+) "
    r"launch=(?P<launch>[0-9a-f]+) keep=(?P<keep>[01])$"
)


def job_name(cluster: str) -> str:
    return JOB_PREFIX + cluster


def boot_id() -> str:
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return "0"


@dataclass(frozen=True)
class Owner:
    host: str
    boot: str
    pid: int
    start: int
    launch: str  # the launch's token: also in the node directory's name
    keep: bool

    @classmethod
    def this_process(cls, launch: str, keep: bool) -> Owner:
        pid = os.getpid()
        return cls(socket.gethostname(), boot_id(), pid, procs.start_time(pid) or 0, launch, keep)

    def comment(self) -> str:
        return (
            f"pytest-sky owner={self.host}:{self.boot}:{self.pid}:{self.start} "
            f"launch={self.launch} keep={int(self.keep)}"
        )

    @classmethod
    def parse(cls, comment: str) -> Owner | None:
        """The record a comment holds; None for any other comment."""
        found = _RECORD.match(comment.strip())
        if found is None:
            return None
        return cls(
            found["host"], found["boot"], int(found["pid"]), int(found["start"]), found["launch"], found["keep"] == "1"
        )

    def gone(self) -> bool:
        """Whether this owner is certainly gone: a process of this machine that no longer runs
        (or ran before this machine's last boot).  Kept clusters and other machines' are never
        judged gone: their owner may well be alive where this process cannot look."""
        if self.keep or self.host != socket.gethostname():
            return False
        if self.boot != boot_id():
            return True
        return not procs.is_alive(self.pid, self.start or None)
