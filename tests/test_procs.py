"""Process identity and liveness (``pytest_sky.procs``) against real processes of this host."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pytest_sky import procs

SH = "/bin/sh"
SCRIPT = "echo ready; read x"


@contextmanager
def running(path: str = SH) -> Iterator[int]:
    """A child of ours that has finished exec'ing: it says so itself (``posix_spawn`` returns
    once the new image's memory is in place, before the kernel sets its comm and cmdline).
    It waits on a pipe until the end of the test; no Popen holds it: the tests decide who reaps it."""
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    try:
        actions = [(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1)]
        pid = os.posix_spawn(path, [path, "-c", SCRIPT], os.environ, file_actions=actions)
    except BaseException:
        os.close(out_r)
        os.close(in_w)
        raise
    finally:
        os.close(in_r)
        os.close(out_w)
    try:
        with os.fdopen(out_r, "rb") as out:
            assert out.readline() == b"ready\n"
        yield pid
    finally:
        os.close(in_w)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass  # the test reaped it


def exited_unreaped(pid: int) -> None:
    """Kill our child and wait until it has exited, leaving it a zombie (WNOWAIT)."""
    os.kill(pid, signal.SIGKILL)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


@pytest.fixture
def child() -> Iterator[int]:
    with running() as pid:
        yield pid


def test_a_running_child_is_alive_and_known(child: int) -> None:
    start = procs.start_time(child)
    assert start is not None and start > 0
    assert procs.is_alive(child) and procs.is_alive(child, start)
    assert procs.alive_reaping(child, start)
    assert procs.state(child) in ("R", "S")  # running, or already blocked reading its pipe
    assert procs.parent_pid(child) == os.getpid()
    assert child in procs.children(os.getpid())
    assert procs.cmdline(child) == [SH, "-c", SCRIPT]
    assert child in procs.pids() and os.getpid() in procs.pids()
    assert not procs.reap_if_zombie(child)


def test_a_child_that_exited_and_was_reaped_is_gone(child: int) -> None:
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    assert not procs.is_alive(child)
    assert not procs.alive_reaping(child)
    assert procs.stat_fields(child) is None
    assert procs.start_time(child) is None and procs.state(child) is None
    assert procs.parent_pid(child) is None and procs.cmdline(child) is None
    assert child not in procs.children(os.getpid())


def test_a_zombie_is_dead_keeps_its_identity_and_is_reaped(child: int) -> None:
    start = procs.start_time(child)
    exited_unreaped(child)
    assert procs.state(child) == "Z"
    assert procs.start_time(child) == start  # still the identity a record holds
    assert procs.cmdline(child) == []
    assert not procs.is_alive(child) and not procs.is_alive(child, start)
    assert procs.state(child) == "Z"  # is_alive only looks
    assert not procs.alive_reaping(child, start)
    assert procs.stat_fields(child) is None  # reaped: gone from /proc
    with pytest.raises(ChildProcessError):
        os.waitpid(child, os.WNOHANG)


def test_reap_if_zombie_reaps_only_zombies(child: int) -> None:
    assert not procs.reap_if_zombie(child)
    assert procs.is_alive(child)
    exited_unreaped(child)
    assert procs.reap_if_zombie(child)
    assert procs.stat_fields(child) is None
    assert not procs.reap_if_zombie(child)


def test_a_recycled_pid_is_not_the_recorded_process(child: int) -> None:
    start = procs.start_time(child)
    assert start is not None
    assert not procs.is_alive(child, start + 1)
    exited_unreaped(child)
    assert not procs.alive_reaping(child, start + 1)
    assert procs.state(child) == "Z"  # someone else's process now: left alone


def test_a_zombie_not_ours_is_dead_and_left_to_its_parent() -> None:
    # A parent that never reaps: its killed child stays a zombie we cannot reap.
    code = (
        "import os, signal, sys\n"
        "pid = os.posix_spawn('/bin/sh', ['/bin/sh', '-c', 'exit 3'], os.environ)\n"
        "os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)\n"
        "print(pid, flush=True)\n"
        "sys.stdin.read()\n"
        "os.waitpid(pid, 0)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        zombie = int(parent.stdout.readline())
        assert procs.parent_pid(zombie) == parent.pid
        assert not procs.is_alive(zombie) and not procs.alive_reaping(zombie)
        assert procs.reap_if_zombie(zombie)  # it was one...
        assert procs.state(zombie) == "Z"  # ...and only its parent can reap it
    finally:
        parent.communicate("")
    assert procs.stat_fields(zombie) is None  # reaped by its parent, before it exited


def test_a_name_with_parentheses_and_spaces_is_parsed(tmp_path: Path) -> None:
    odd = tmp_path / "a) b (c"  # comm is the executable's name: the stat line gets hard to split
    odd.symlink_to(SH)
    with running(str(odd)) as pid:
        assert Path(f"/proc/{pid}/comm").read_text().strip() == "a) b (c"
        assert procs.state(pid) in ("R", "S")
        assert procs.parent_pid(pid) == os.getpid()
        start = procs.start_time(pid)
        assert start is not None and start >= (procs.start_time(os.getpid()) or 0)
        assert procs.is_alive(pid, start)


def test_pid_1_and_impossible_pids() -> None:
    assert procs.is_alive(1)
    assert procs.parent_pid(1) == 0  # the first process of a PID namespace has no parent there
    assert procs.start_time(1) is not None and procs.start_time(1) <= procs.start_time(os.getpid())
    for pid in (0, -1, 2**22 + 1):
        assert not procs.is_alive(pid) and procs.stat_fields(pid) is None and procs.children(pid) == []


def test_import_is_cheap_for_the_agent() -> None:
    """The agent runs as ``python -I -S`` and imports procs on every run: nothing beyond os."""
    code = (
        "import os, sys; before = set(sys.modules)\n"
        f"sys.path.insert(0, {str(Path(procs.__file__).parent)!r})\n"
        "import procs\n"
        "print(*sorted(set(sys.modules) - before - {'procs', '__future__'}))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == []
