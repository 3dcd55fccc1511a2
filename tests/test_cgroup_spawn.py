"""``agent.cgroup_spawn``: a rank's bash started inside its job's cgroup, as ``posix_spawn``
would start it elsewhere (its descriptors, a process group of its own, signals at their
defaults), and nothing started where the kernel refuses.

Run here against a scratch cgroup of the host's cgroup2 (named after this test, removed
after it); the agent servers do the same inside each node (``tests/test_process_tree.py``
runs every property of a rank with and without ``clone3``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_sky.agent import cgroup_spawn
from pytest_sky.backends import netns

# What the child says about itself: its cgroup, its process group, whether SIGPIPE is ignored.
SELF = 'grep "^0::" /proc/self/cgroup; cut -d" " -f5 /proc/self/stat; echo "$$"; grep "^SigIgn" /proc/self/status'


@pytest.fixture
def scratch_cgroup() -> Iterator[Path]:
    root = netns.cgroup2_root()
    if root is None or not os.access(root, os.W_OK):
        pytest.skip("needs a writable cgroup2 hierarchy (root on a host with one)")
    path = root / f"pytest-sky-cgroup-spawn-{os.getpid()}"
    path.mkdir()
    try:
        yield path
    finally:
        path.rmdir()


def _spawn(cgroup: Path, script: str) -> tuple[int, int, int]:
    """``bash -c script`` started in ``cgroup``, its stdout a pipe: (pid, pidfd, read end)."""
    out_r, out_w = os.pipe()
    try:
        born = cgroup_spawn.spawn_into(
            str(cgroup), ["/bin/bash", "-c", script], dict(os.environ), [(out_w, 1)], [signal.SIGPIPE]
        )
    finally:
        os.close(out_w)
    assert born is not None, f"clone3 refused here (errno {cgroup_spawn._refused})"
    return *born, out_r


def test_the_child_is_born_in_the_cgroup_leading_its_own_group_with_default_signals(scratch_cgroup: Path) -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python's own default: the child must not inherit it
    pid, pidfd, out = _spawn(scratch_cgroup, SELF)
    with os.fdopen(out) as f:
        group, pgrp, own_pid, ignored = f.read().split("\n")[:4]
    os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
    os.close(pidfd)
    # Its first command already runs there: nothing moved it (there was no gate to wait at).
    assert group == f"0::/{scratch_cgroup.name}", group
    assert pgrp == own_pid == str(pid)
    assert not int(ignored.split()[1], 16) & (1 << (signal.SIGPIPE - 1)), ignored


def test_a_program_that_cannot_be_executed_exits_127(scratch_cgroup: Path) -> None:
    out_r, out_w = os.pipe()
    try:
        born = cgroup_spawn.spawn_into(str(scratch_cgroup), ["/nonexistent/bash"], {}, [(out_w, 1)], [])
    finally:
        os.close(out_w)
        os.close(out_r)
    assert born is not None
    pid, pidfd = born
    info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
    os.close(pidfd)
    assert info is not None and info.si_pid == pid and info.si_status == 127


def test_where_clone3_is_refused_nothing_starts_and_it_is_not_asked_again() -> None:
    """A process whose seccomp profile answers clone3 with ENOSYS (today's runtimes' default):
    None, so the server spawns and moves the bash instead."""
    code = (
        "import os, sys\n"
        "from pytest_sky.backends import confine\n"
        "from pytest_sky.agent import cgroup_spawn\n"
        "confine._prctl(confine.PR_SET_NO_NEW_PRIVS, 1, 'no_new_privs')\n"
        "confine.refuse_syscalls(['clone3'])\n"
        "args = ('/', ['/bin/true'], {}, [], [])\n"
        "print(cgroup_spawn.spawn_into(*args), cgroup_spawn._refused, cgroup_spawn.spawn_into(*args))\n"
        "import threading; t = threading.Thread(target=print, args=('threads still start',)); t.start(); t.join()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["None [38] None", "threads still start"], proc.stdout
