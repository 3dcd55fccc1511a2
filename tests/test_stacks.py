"""Every Python process on a node can say where its threads wait (``agent.site_hook``), and
the agent reads it without ptrace and without stopping anything (``agent.stacks``).

These run the node's side on this machine: real interpreters started the way a node starts
them (``PYTHONPATH`` naming the directory of the node's ``sitecustomize``, the job's token in
their environment), signalled and read by the same functions the agent runs on a node.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_sky import bootstrap, shell
from pytest_sky.agent import site_hook, stacks
from pytest_sky.diagnosis import parse_dump, waiting

SCRIPT = """\
import sys, threading, time

def background():
    time.sleep(600)

def main():
    threading.Thread(target=background, name="bg", daemon=True).start()
    print("ready", flush=True)
    time.sleep(600)

main()
"""
MAIN_LINE = 9  # time.sleep(600) in main
NO_SECRETS = stacks.Secrets({})
BACKGROUND_LINE = 4


@pytest.fixture
def site_dir(tmp_path: Path) -> Path:
    """A node's ``~/.sky/python``: the ``sitecustomize`` every node gets, as bootstrap ships it."""
    d = tmp_path / "site"
    d.mkdir()
    (d / "sitecustomize.py").write_bytes(bootstrap.site_hook())
    return d


def _token() -> str:
    return f"{shell.JOB_SCOPE_PREFIX}test-{os.getpid()}-{os.urandom(4).hex()}"


def _env(site: Path | None, token: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", shell.JOB_SCOPE_VAR)}
    env[shell.JOB_SCOPE_VAR] = token
    if site is not None:
        env["PYTHONPATH"] = str(site)
    env.update(extra)
    return env


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts; each is killed afterwards."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _start(
    started: list, tmp_path: Path, env: dict[str, str], script: str = SCRIPT, args: tuple[str, ...] = ()
) -> subprocess.Popen[str]:
    path = tmp_path / "hang.py"
    path.write_text(script)
    proc = subprocess.Popen(
        [sys.executable, str(path), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    started.append(proc)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    _wait_asleep(proc.pid)
    return proc


def _wait_asleep(pid: int) -> None:
    """The script prints "ready" a line before main's sleep: until the kernel says the main thread
    sleeps, a dump may still show the print's line."""
    deadline = time.monotonic() + 30
    while _proc_text(f"/proc/{pid}/task/{pid}/wchan") != "hrtimer_nanosleep" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _proc_text(f"/proc/{pid}/task/{pid}/wchan") == "hrtimer_nanosleep"


def _proc_text(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def test_an_armed_python_says_where_each_thread_waits_and_keeps_waiting(
    site_dir: Path, tmp_path: Path, started: list
) -> None:
    token = _token()
    proc = _start(started, tmp_path, _env(site_dir, token))
    snap = stacks.snapshot(0, [token], NO_SECRETS)[0]
    (found,) = snap["processes"]
    assert found["pid"] == proc.pid and found["python"] and found["note"] == ""
    threads = parse_dump(found["dump"], found["sources"])
    main, background = threads[-1], threads[0]  # faulthandler lists the newest thread first
    script = str(tmp_path / "hang.py")
    frames = [(f.file, f.line, f.function) for f in main.frames]
    assert frames == [(script, MAIN_LINE, "main"), (script, 11, "<module>")]
    assert main.frames[0].source == "time.sleep(600)"
    wait = waiting(main)
    assert wait.user == main.frames[0] and wait.call == "time.sleep"
    assert (background.frames[0].line, background.frames[0].function) == (BACKGROUND_LINE, "background")
    assert waiting(background).call == "time.sleep"  # threading's frames below it are the library's
    # Nothing was stopped, and nothing reached what the program itself writes.
    time.sleep(0.2)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert (out, err) == ("", ""), (out, err)


def test_a_program_that_does_not_hang_behaves_as_it_does_without_the_hook(site_dir: Path, tmp_path: Path) -> None:
    """Same output, same exit status, the same ``sys.path``; a ``sitecustomize`` it shadows
    still runs; a signal ignored before Python started stays ignored."""
    shadowed = tmp_path / "theirs"
    shadowed.mkdir()
    (shadowed / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    program = textwrap.dedent(
        f"""
        import os, signal, sys
        print(os.environ.get("THEIRS_RAN"), [p for p in sys.path if p.endswith("site")], flush=True)
        handler = signal.getsignal(signal.SIGRTMIN + {site_hook.OFFSET})
        print({{signal.SIG_DFL: "default", signal.SIG_IGN: "ignored"}}.get(handler, "handled"), file=sys.stderr)
        sys.exit(7)
        """
    )
    runs = []
    for site in (site_dir, None):
        pythonpath = os.pathsep.join(str(p) for p in (site, shadowed) if p is not None)
        env = _env(None, "-", PYTHONPATH=pythonpath)
        runs.append(subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True))
    armed, plain = runs
    assert (armed.returncode, armed.stdout) == (plain.returncode, plain.stdout) == (7, "1 []\n")
    assert plain.stderr == armed.stderr == "default\n"  # faulthandler's C handler is not Python's
    ignoring = f"import os, signal, sys; signal.signal(signal.SIGRTMIN + {site_hook.OFFSET}, signal.SIG_IGN); "
    ignoring += f"os.execv(sys.executable, [sys.executable, '-c', {program!r}])"
    kept = subprocess.run([sys.executable, "-c", ignoring], env=_env(site_dir, "-"), capture_output=True, text=True)
    assert kept.stderr == "ignored\n", kept.stderr


def test_a_forked_child_dumps_into_a_memfd_of_its_own(site_dir: Path, tmp_path: Path, started: list) -> None:
    script = SCRIPT.replace("main()\n", "import os\nif os.fork() == 0:\n    time.sleep(600)\nmain()\n")
    token = _token()
    parent = _start(started, tmp_path, _env(site_dir, token), script)
    deadline = time.monotonic() + 30

    def child_asleep(snap: dict) -> bool:
        """The parent says "ready" once it forked, not once the child reached its sleep: until
        then the child's dump shows the fork's return or its at-fork hook."""
        dumps = [p["dump"] for p in snap["processes"] if p["pid"] != parent.pid]
        threads = parse_dump(dumps[0]) if len(dumps) == 1 and dumps[0] is not None else []
        return bool(threads) and [f.line for f in threads[-1].frames] == [13]

    snap = stacks.snapshot(parent.pid, [], NO_SECRETS)[0]
    while not child_asleep(snap) and time.monotonic() < deadline:
        snap = stacks.snapshot(parent.pid, [], NO_SECRETS)[0]
    (child,) = [p for p in snap["processes"] if p["pid"] != parent.pid]
    (parent_view,) = [p for p in snap["processes"] if p["pid"] == parent.pid]
    assert [f.line for f in parse_dump(child["dump"])[-1].frames] == [13]  # its own sleep, not main's
    assert parse_dump(parent_view["dump"])[-1].frames[0].line == MAIN_LINE
    assert len([fd for fd in os.listdir(f"/proc/{child['pid']}/fd") if "psky-stacks" in _link(child["pid"], fd)]) == 1


def _link(pid: int, fd: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""


def test_a_python_that_was_not_armed_is_named_and_never_signalled(tmp_path: Path, started: list) -> None:
    """Its default action for the signal would end it: it is left alone, and says why."""
    token = _token()
    proc = _start(started, tmp_path, _env(None, token))
    (found,) = stacks.snapshot(0, [token], NO_SECRETS)[0]["processes"]
    assert found["dump"] is None and "not armed" in found["note"]
    assert proc.poll() is None


def test_the_job_is_its_tokens_and_its_leaders_tree_and_long_arguments_are_elided(
    site_dir: Path, tmp_path: Path, started: list
) -> None:
    """A process that carries the job's token is the job's whoever its parent; the leader's
    descendants are, whatever they carry; a rank's program (the task's environment) is never shown."""
    token = _token()
    program = "export SECRET=hunter2\n" + "sleep 600 & wait\n"
    leader = subprocess.Popen(["/bin/bash", "-c", program], env=_env(site_dir, "-"), start_new_session=True)
    started.append(leader)
    other = _start(started, tmp_path, _env(site_dir, token))
    deadline = time.monotonic() + 30
    while not [p for p in stacks.members(leader.pid, []) if p != leader.pid] and time.monotonic() < deadline:
        time.sleep(0.02)
    snap = stacks.snapshot(leader.pid, [token], NO_SECRETS)[0]
    pids = [p["pid"] for p in snap["processes"]]
    assert pids[0] == leader.pid and other.pid in pids and len(pids) == 3, snap
    bash = snap["processes"][0]
    assert bash["argv"] == ["/bin/bash", "-c", f"<{len(program)} characters>"]
    assert "hunter2" not in repr(snap)
    assert os.getpid() not in pids


def test_a_secrets_value_is_masked_wherever_the_capture_would_show_it(
    site_dir: Path, tmp_path: Path, started: list
) -> None:
    """The task's secrets, by name (the head's records keep no value): the values the job's
    processes hold are masked in command lines and source lines (DESIGN.md section 4d)."""
    canary = "canary-" + os.urandom(6).hex()
    token = _token()
    script = SCRIPT.replace("    time.sleep(600)\n\nmain()", f"    time.sleep(600)  # {canary}\n\nmain()")
    _start(started, tmp_path, _env(site_dir, token, API_TOKEN=canary), script, (f"--token={canary}",))
    answer, values = stacks.snapshot(0, [token], stacks.Secrets({"secrets": ["API_TOKEN"]}))
    assert values == [canary]  # for the head's use only: never in an answer
    assert canary not in repr(answer)
    (found,) = answer["processes"]
    assert found["argv"][-1] == "--token=***"
    (source,) = [text for key, text in found["sources"].items() if key.endswith(f":{MAIN_LINE}")]
    assert source == "time.sleep(600)  # ***"
    given = stacks.snapshot(0, [token], stacks.Secrets({"secrets": ["OTHER"], "values": [canary, "***"]}))[0]
    assert canary not in repr(given)  # a value the client knows, under any name
