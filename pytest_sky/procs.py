"""Process identity and liveness, read from ``/proc`` in one place.

A pid alone names a process only until it is recycled; the pid with the kernel's start time
names one process for good.  Everything here answers "is that process still there?" the same
way for the host (nodes, owners of clusters) and for the agent on a node (jobs, ranks).

Shipped inside the node agent, which runs as ``python -I -S``: stdlib only, and nothing but
``os`` at import time (every module imported there costs milliseconds on every run).
Linux only, like the rest of the package.
"""

from __future__ import annotations

import os

# Indexes into stat_fields(): proc(5) numbers the fields from 1, with pid and comm as 1 and 2.
STATE = 0  # proc(5) field 3
PPID = 1  # field 4
STARTTIME = 19  # field 22: clock ticks since boot

#: States of a process that has exited: a zombie (Z) waits for its parent to reap it, X is
#: the instant of being reaped.  Either way it runs nothing and never will again.
DEAD_STATES = ("Z", "X")


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after ``comm``, or None when there is no such process.

    ``comm`` is whatever the process called itself, spaces and parentheses included, so the
    line is split after its last ``)``: ``stat_fields(pid)[STATE]`` is the state letter.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (OSError, ValueError):
        return None
    end = raw.rfind(b")")
    if end < 0:
        return None
    return raw[end + 2 :].decode("ascii", "replace").split()


def state(pid: int) -> str | None:
    """The state letter (``R``, ``S``, ``D``, ``Z``, ...), or None when there is no such process."""
    fields = stat_fields(pid)
    return fields[STATE] if fields else None


def start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None when it is gone.

    A zombie still has one: it is the identity to record, and :func:`is_alive` says it is dead.
    """
    fields = stat_fields(pid)
    return int(fields[STARTTIME]) if fields and len(fields) > STARTTIME else None


def parent_pid(pid: int) -> int | None:
    """The parent's pid (0 for the first process of a PID namespace), or None when it is gone."""
    fields = stat_fields(pid)
    return int(fields[PPID]) if fields and len(fields) > PPID else None


def is_alive(pid: int, start_time: int | None = None) -> bool:
    """Whether ``pid`` is a running process (not a zombie) and, given its recorded start time,
    still the same one: a recycled pid is never mistaken for the process it used to name."""
    fields = stat_fields(pid)
    return fields is not None and _same(fields, start_time) and fields[STATE] not in DEAD_STATES


def reap_if_zombie(pid: int) -> bool:
    """Reap ``pid`` if it is a zombie child of ours; True when it was a zombie (ours or not).

    A subreaper (the agent) inherits orphans it never spawned, and no one else will wait for
    them.  Never call it on a pid a ``subprocess.Popen`` still waits for: its status is lost.
    """
    if state(pid) != "Z":
        return False
    _reap(pid)
    return True


def alive_reaping(pid: int, start_time: int | None = None) -> bool:
    """:func:`is_alive`, reaping ``pid`` on the way when it is a zombie child of ours: the
    agent's check of the processes it adopted, which would otherwise stay zombies for good.
    A pid recycled since ``start_time`` is someone else's business and left alone."""
    fields = stat_fields(pid)
    if fields is None or not _same(fields, start_time):
        return False
    if fields[STATE] == "Z":
        _reap(pid)
    return fields[STATE] not in DEAD_STATES


def kill_and_wait(pids: list[int], timeout: float = 10.0) -> list[int]:
    """SIGKILL each pid and wait until it is gone; returns the survivors.

    With pidfds (Linux 5.3+) the wait is a poll on them and a recycled pid is never hit;
    without them (an older kernel, or a seccomp filter that refuses the call), each pid is
    signalled directly and ``/proc`` is polled.
    """
    import errno
    import select
    import signal
    import time

    fds: dict[int, int] = {}
    polled: list[int] = []
    pidfd_open = getattr(os, "pidfd_open", None)
    for pid in pids:
        if pid <= 0:
            continue
        try:
            if pidfd_open is None:
                raise OSError(errno.ENOSYS, "no pidfd_open")
            fds[pid] = pidfd_open(pid)
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                continue  # already gone
            polled.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                polled.pop()
            continue
        try:
            signal.pidfd_send_signal(fds[pid], signal.SIGKILL)
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                raise
    deadline = time.monotonic() + timeout
    poller = select.poll()
    for fd in fds.values():
        poller.register(fd, select.POLLIN)
    pending = dict(fds)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for fd, _ in poller.poll(left * 1000):
            poller.unregister(fd)
            pending = {p: f for p, f in pending.items() if f != fd}
    for fd in fds.values():
        os.close(fd)
    delay = 0.001
    while polled and time.monotonic() < deadline:
        polled = [pid for pid in polled if is_alive(pid)]
        if polled:
            time.sleep(delay)  # no pidfd to wait on: /proc is the only signal there is
            delay = min(delay * 2, 0.05)
    return [pid for pid in pending if is_alive(pid)] + [pid for pid in polled if is_alive(pid)]


def _same(fields: list[str], start_time: int | None) -> bool:
    return start_time is None or (len(fields) > STARTTIME and int(fields[STARTTIME]) == start_time)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: its own parent reaps it


def children(pid: int) -> list[int]:
    """The pids of the children of ``pid``'s main thread, oldest first ([] when it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []


def cmdline(pid: int) -> list[str] | None:
    """The arguments of ``pid``, or None when it is gone ([] for kernel threads and zombies).

    Trailing NULs are dropped: a process that rewrote its title (sshd does) pads it with them.
    """
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read().rstrip(b"\0")
    except (OSError, ValueError):
        return None
    return raw.decode("utf-8", "replace").split("\0") if raw else []


def pids() -> list[int]:
    """Every pid in this PID namespace's ``/proc`` (processes, not threads)."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def carrying(entry: bytes) -> list[int]:
    """Every process whose environment holds ``entry`` (``NAME=value``, a job's token): those
    of other users, and processes gone meanwhile, are passed over."""
    found = []
    for pid in pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if entry in env.split(b"\0"):
            found.append(pid)
    return found


def holds_root_caps() -> bool:
    """This process may make namespaces and links on the host: CAP_NET_ADMIN and CAP_SYS_ADMIN."""
    cap_eff = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    cap_eff = int(line.split()[1], 16)
    except OSError:
        pass
    net_admin, sys_admin = 1 << 12, 1 << 21
    return bool(cap_eff & net_admin and cap_eff & sys_admin)
