"""``agent.cgroup_spawn``: a rank's bash started inside its job's cgroup, as ``posix_spawn``
would start it elsewhere (its descriptors, a process group of its own, signals at their
defaults), and nothing started where the kernel refuses or the process has other threads.

Each case runs in a fresh interpreter of one thread, as the agent server is (an xdist
worker has several), against a scratch cgroup of the host's cgroup2 (named after this
test, removed after it); the agent servers do the same inside each node
(``tests/test_process_tree.py`` runs every property of a rank with and without ``clone3``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_sky.backends import netns

# Starts ``bash -c SCRIPT`` in CGROUP with its stdout a pipe (SIGPIPE ignored here, as Python
# ignores it: the child must have it at its default), and prints what came back as JSON.
SPAWN = """
import json, os, signal, sys
from pytest_sky.agent import cgroup_spawn
cgroup, script = sys.argv[1:3]
signal.signal(signal.SIGPIPE, signal.SIG_IGN)
out_r, out_w = os.pipe()
argv = ["/bin/bash", "-c", script] if script else ["/nonexistent/bash"]
born = cgroup_spawn.spawn_into(cgroup, argv, dict(os.environ), [(out_w, 1)], [signal.SIGPIPE])
os.close(out_w)
said = b""
while born and (chunk := os.read(out_r, 65536)):
    said += chunk
said = said.decode()
status = os.waitid(os.P_PIDFD, born[1], os.WEXITED).si_status if born else None
print(json.dumps({"pid": born and born[0], "said": said, "status": status, "refused": cgroup_spawn._refused}))
"""

# What the child says about itself: its cgroup, its process group, its pid, its ignored signals.
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


def _spawn(cgroup: Path | str, script: str, prelude: str = "") -> dict:
    argv = [sys.executable, "-c", prelude + SPAWN, str(cgroup), script]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_child_is_born_in_the_cgroup_leading_its_own_group_with_default_signals(scratch_cgroup: Path) -> None:
    got = _spawn(scratch_cgroup, SELF)
    group, pgrp, own_pid, ignored = got["said"].split("\n")[:4]
    # Its first command already runs there: nothing moved it (there was no gate to wait at).
    assert group == f"0::/{scratch_cgroup.name}", got
    assert pgrp == own_pid == str(got["pid"]), got
    assert not int(ignored.split()[1], 16) & (1 << 12), ignored  # SIGPIPE (13)
    assert got["status"] == 0, got


def test_a_program_that_cannot_be_executed_exits_127(scratch_cgroup: Path) -> None:
    got = _spawn(scratch_cgroup, "")
    assert got["pid"] and got["status"] == 127, got


def test_where_clone3_is_refused_nothing_starts_and_it_is_not_asked_again() -> None:
    """A process whose seccomp profile answers clone3 with ENOSYS (today's runtimes' default):
    None, so the server spawns and moves the bash instead; threads still start (libc falls
    back to clone)."""
    refuse = (
        "from pytest_sky.backends import confine\n"
        "confine._prctl(confine.PR_SET_NO_NEW_PRIVS, 1, 'no_new_privs')\n"
        "confine.refuse_syscalls(['clone3'])\n"
        "import threading; t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
    )
    assert _spawn("/", SELF, refuse) == {"pid": None, "said": "", "status": None, "refused": [38]}


def test_a_process_with_other_threads_is_not_cloned(scratch_cgroup: Path) -> None:
    """A raw clone3 does not reset the locks other threads hold (libc's fork does): a child
    of a threaded process could hang before its exec, so none is made there."""
    thread = "import threading, time; threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
    assert _spawn(scratch_cgroup, SELF, thread) == {"pid": None, "said": "", "status": None, "refused": []}
