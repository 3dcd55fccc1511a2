"""Starting a rank's bash inside its job's cgroup, instead of moving it there once started.

Why: moving a process into a cgroup (a write to ``cgroup.procs``) takes the kernel's one
``cgroup_threadgroup_rwsem`` for writing, and that waits out an RCU grace period unless
another move happened within the last one.  Measured here (the move alone): 0.2 ms back to
back, 5-7 ms (up to 24 ms) after 50 ms of quiet.  Every run moved one bash per node, so a
run on a quiet machine waited out one grace period before any rank could start: with
cgroups left out (``node_cgroups="ro"``), 2 local nodes took 16 instead of 25-29 ms a run,
8 nodes 32 instead of 44-48 ms.  Linux 5.7's ``clone3(CLONE_INTO_CGROUP)`` starts the child
in the cgroup: nothing is moved and nothing waits.

Python has no ``clone3``, so the system call is made through ctypes, as a fork: the call
keeps the interpreter's lock (``PyDLL``), and the child only sets up its descriptors, its
process group and its signals, then execs.  Only in a process of one thread, as the agent
server is: libc's ``fork`` resets the locks its other threads held (malloc's among them), a
raw ``clone3`` does not, and a child that needs one of them waits forever before its exec
(seen: a test that called this inside an xdist worker hung).
Where the kernel or a seccomp profile refuses ``clone3`` (a container runtime's default
profile answers ENOSYS, so that libc falls back to ``clone``), the caller spawns the bash and
moves it, as before.

Stdlib only: it runs inside the agent's bundle.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Sequence

#: ``clone3``'s number: the generic system call table's, which x86_64 and aarch64 share.
SYS_CLONE3 = 435
CLONE_PIDFD = 0x1000
CLONE_INTO_CGROUP = 0x200000000


class _CloneArgs(ctypes.Structure):
    """``struct clone_args`` of ``linux/sched.h`` (version 2, with ``cgroup``)."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "flags",
            "pidfd",
            "child_tid",
            "parent_tid",
            "exit_signal",
            "stack",
            "stack_size",
            "tls",
            "set_tid",
            "set_tid_size",
            "cgroup",
        )
    ]


#: Set once ``clone3`` was refused in this process: it is not asked again.
_refused: list[int] = []
#: The process's own symbols (libc's ``syscall``), looked up once: every rank's spawn calls it.
#: ``PyDLL`` keeps the interpreter's lock across the call, so the child holds it too.
_LIBC = ctypes.PyDLL(None, use_errno=True)


def spawn_into(
    cgroup: str,
    argv: Sequence[str],
    env: dict[str, str],
    dups: Sequence[tuple[int, int]],
    defaults: Sequence[signal.Signals],
) -> tuple[int, int] | None:
    """``argv`` started in ``cgroup``, leading a process group of its own, with ``dups``
    (``(fd, target)``, in order) done and the ``defaults`` signals at their defaults, as
    ``os.posix_spawn`` would: its pid and a pidfd of it; None where this kernel or profile
    cannot, or this process has other threads (the caller then spawns it and moves it)."""
    if _refused or len(os.listdir("/proc/self/task")) != 1:  # see the module's docstring
        return None
    try:
        group = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    pidfd = ctypes.c_int(-1)
    args = _CloneArgs(
        flags=CLONE_PIDFD | CLONE_INTO_CGROUP,
        pidfd=ctypes.addressof(pidfd),
        exit_signal=signal.SIGCHLD,
        cgroup=group,
    )
    try:
        pid = _LIBC.syscall(ctypes.c_long(SYS_CLONE3), ctypes.byref(args), ctypes.c_size_t(ctypes.sizeof(args)))
        if pid == 0:
            _become(argv, env, dups, defaults)
        if pid < 0:
            _refused.append(ctypes.get_errno())
            return None
    finally:
        os.close(group)
    return pid, pidfd.value


def _become(
    argv: Sequence[str], env: dict[str, str], dups: Sequence[tuple[int, int]], defaults: Sequence[signal.Signals]
) -> None:
    """The child: its descriptors, its own process group, its signals, then the program.
    It never returns: a failure before the exec ends it with 127, as a shell's would."""
    try:
        for fd, target in dups:
            os.dup2(fd, target)
        os.setpgid(0, 0)
        for sig in defaults:
            signal.signal(sig, signal.SIG_DFL)
        os.execve(argv[0], list(argv), env)
    finally:
        os._exit(127)
