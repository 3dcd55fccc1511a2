"""Every Python process on a node, armed to say where its threads are when asked.

A copy of this file is each node's ``~/.sky/python/sitecustomize.py``
(``bootstrap.home_files``), and that directory is on ``PYTHONPATH`` in every SSH session of
the node (the node's sshd sets it, ``ssh.sshd``) and in every rank's environment
(``agent.fanout`` appends it to a task's own ``PYTHONPATH``): so a rank, a worker that
torchrun or multiprocessing starts, and a rank that mpirun starts over head-to-worker ssh
(whose environment is the session's, not the rank's) all run it at start, and no user code
changes.  It asks faulthandler to dump every thread's stack on :data:`OFFSET` past
``SIGRTMIN`` into a memfd of its own named :data:`NAME` (``agent.stacks`` finds the memfd in
``/proc/<pid>/fd``, sends the signal and reads what was written).  The C handler runs
whatever the threads are doing, a blocking call in C included, and needs no ptrace: a pod
has no ``SYS_PTRACE``.

Why this signal and this destination (DESIGN.md section 4e): a program that never gets
the signal behaves exactly as before.  A real-time signal is one no part of the stack uses
(bash, OpenMPI, torch, gloo and CPython use SIGUSR1/2, SIGTERM, SIGINT, SIGCHLD; glibc keeps
the two below SIGRTMIN), and the dump lands in a file nothing else reads: not the rank's
stdout or stderr, which the test reads, and not a file on disk, which would outlive the
process.  What a program can see: one more descriptor (close-on-exec, like any Python
opens), and this signal no longer ends it.  A signal that is ignored when Python starts is
left ignored; a ``sitecustomize`` this file shadows on ``sys.path`` still runs, after it;
this directory leaves ``sys.path``.

Runs in every interpreter the node starts, before the program: the standard library's
built-in modules only, no f-strings or newer syntax than Python 3.6, and nothing of its own
raises (the shadowed ``sitecustomize`` fails as it would have failed without it).
It does nothing when imported under any other name (as ``pytest_sky.agent.site_hook``).
"""

import os

#: The dumping signal is ``SIGRTMIN + OFFSET``: what it is in a process depends on its libc.
OFFSET = 13
#: The memfd's name, followed by ``:<signal number>``, as ``/proc/<pid>/fd`` shows it.
NAME = "psky-stacks"

_armed = []  # type: list[int]  # the memfd of this process, once armed


def arm():
    """The dump armed in this process."""
    try:
        import _signal  # type: ignore[import-not-found]  # signal's C half: no enum to import
        import faulthandler

        signum = _signal.SIGRTMIN + OFFSET
        if not _armed and _signal.getsignal(signum) not in (_signal.SIG_DFL, None):
            return  # ignored since before Python started (or taken): left as it is
        fd = os.memfd_create("%s:%d" % (NAME, signum), os.MFD_CLOEXEC)  # noqa: UP031 - any Python 3
        faulthandler.register(signum, file=fd, all_threads=True, chain=False)
        _armed[:] = [fd]
    except Exception:  # noqa: BLE001 - an interpreter without it runs as before
        pass


def _forked():
    """A fork's child holds the parent's memfd, where its dump would land among the
    parent's: it gets one of its own, and lets go of the parent's."""
    inherited = list(_armed)
    arm()
    for fd in inherited:
        try:
            os.close(fd)
        except OSError:
            pass


def _hand_over():
    """Leave ``sys.path`` as it would be without this directory, and run the
    ``sitecustomize`` that this one shadows, if any (Debian's, a virtualenv's, the user's)."""
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    me = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401 - the next one on the path runs as it would have
    except ImportError as exc:
        if getattr(exc, "name", None) != "sitecustomize":
            raise
        if me is not None:  # none shadowed: the import under way ends with this module
            sys.modules["sitecustomize"] = me


if __name__ == "sitecustomize":
    arm()
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forked)
    _hand_over()
