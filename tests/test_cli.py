"""The `pytest-sky` console script, run for real against real local clusters."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.leftovers import our_links, processes_mentioning

SCRIPT = str(Path(sys.executable).with_name("pytest-sky"))


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "state"


def sky(
    home: Path, *args: str, timeout: float = 120, check_rc: int | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTEST_SKY_HOME": str(home), "CI": "1", **(env or {})}
    proc = subprocess.run([SCRIPT, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if check_rc is not None:
        assert proc.returncode == check_rc, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture
def dev(home: Path):
    name = f"cli{os.getpid() % 10000}"
    sky(home, "launch", "-c", name, "--num-nodes", "2", check_rc=0)
    yield name
    sky(home, "down", "--all")


def test_launch_streams_prefixed_output_and_reports_progress(home: Path):
    name = f"clil{os.getpid() % 10000}"
    try:
        res = sky(home, "launch", "-c", name, "--num-nodes", "2", "--", "echo rank $SKYPILOT_NODE_RANK", check_rc=0)
        lines = [line for line in res.stdout.splitlines() if line.startswith("(")]
        assert len(lines) == 2 and any(line.endswith(") rank 0") for line in lines), res.stdout
        assert "nodes ready 2/2" in res.stderr and f"{name} is up" in res.stderr
        # Same name, same shape: reused; a failed job exits 100, as sky's does, and says how.
        again = sky(home, "launch", "-c", name, "--num-nodes", "2", "--", "exit 3", check_rc=100)
        assert f"reusing {name}" in again.stderr and "exit code 3" in again.stderr
        other = sky(home, "launch", "-c", name, "--num-nodes", "3", "--", "true", check_rc=2)
        assert other.stderr.count("\n") == 1 and "different resources" in other.stderr
    finally:
        sky(home, "down", name)


def test_status_queue_logs_cancel(home: Path, dev: str):
    status = sky(home, "status", check_rc=0)
    assert status.stdout.split("\n")[0].split() == ["NAME", "BACKEND", "RESOURCES", "NODES", "STATUS", "AGE"]
    assert dev in status.stdout and "2x Local" in status.stdout
    as_json = json.loads(sky(home, "status", "--json", check_rc=0).stdout)
    assert [c["name"] for c in as_json] == [dev] and len(as_json[0]["node_ips"]) == 2

    sky(home, "exec", dev, "--", "echo from-$SKYPILOT_NODE_RANK", check_rc=0)
    detached = sky(home, "exec", dev, "-d", "--", "sleep 60", check_rc=0)
    assert "Job submitted, ID: 2" in detached.stdout
    queue = sky(home, "queue", dev, check_rc=0).stdout
    assert "SUCCEEDED" in queue and "RUNNING" in queue
    logs = sky(home, "logs", dev, "1", check_rc=0).stdout.splitlines()
    assert sorted(line.split(") ")[1] for line in logs if line.startswith("(")) == ["from-0", "from-1"]
    assert logs[-1] == "Job finished (status: SUCCEEDED)."
    assert "Cancelled job ID(s): 2" in sky(home, "cancel", dev, "2", check_rc=0).stdout
    # A command that connects leaves out paramiko's import of invoke (a sixth of its CPU),
    # and one that reads no task file PyYAML.
    profiled = sky(home, "queue", dev, check_rc=0, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert "CANCELLED" in profiled.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in profiled.stderr.splitlines() if "|" in line}
    assert "paramiko.transport" in imported, sorted(imported)
    assert not {"invoke.tasks", "yaml"} & imported, sorted(imported)


def test_ssh_to_head_and_workers(home: Path, dev: str):
    assert sky(home, "ssh", dev, "--", "hostname", check_rc=0).stdout.strip() == f"{dev}-head"
    assert sky(home, "ssh", dev, "worker1", "--", "hostname", check_rc=0).stdout.strip() == f"{dev}-worker1"
    assert sky(home, "ssh", dev, "1", "--", "hostname", check_rc=0).stdout.strip() == f"{dev}-worker1"
    bad = sky(home, "ssh", dev, "worker7", check_rc=2)
    assert bad.stderr.count("\n") == 1 and "worker7" in bad.stderr


def test_stress_ssh(home: Path, dev: str):
    res = sky(home, "stress-ssh", dev, "--parallel", "20", "--rounds", "10", check_rc=0)
    assert res.stdout.startswith("200/200 succeeded")
    assert "p50" in res.stdout and "p95" in res.stdout


def test_ssh_config_install_is_idempotent(home: Path, dev: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    fake_home = tmp_path / "user"
    (fake_home / ".ssh").mkdir(parents=True)
    own = "Host mine\n  HostName 127.0.0.1\n"
    (fake_home / ".ssh" / "config").write_text(own)
    monkeypatch.setenv("HOME", str(fake_home))
    line = sky(home, "ssh-config", check_rc=0).stdout.strip()
    assert line == f"Include {home.resolve()}/clusters/*/ssh_config"
    sky(home, "ssh-config", "--install", check_rc=0)
    again = sky(home, "ssh-config", "--install", check_rc=0)
    assert "already installed" in again.stdout
    text = (fake_home / ".ssh" / "config").read_text()
    assert text.count(line) == 1 and text.endswith(own)  # the user's own entries untouched
    assert (fake_home / ".ssh" / "config.pytest-sky.bak").read_text() == own
    # With the Include in place, plain `ssh <cluster>` works (host keys checked).
    proc = subprocess.run(
        ["ssh", "-F", str(fake_home / ".ssh" / "config"), f"{dev}-worker1", "hostname"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.stdout.strip() == f"{dev}-worker1", proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["launch"],
        ["launch", "-c", "x", "--num-nodes", "0"],
        ["launch", "-c", "x", "--num-nodes", "two"],
        ["launch", "-c", "Bad_Name"],
        ["launch", "-c", "x", "--gpus", "V100:abc"],
        ["launch", "-c", "x", "/nonexistent/task.yaml"],
        ["exec", "no-such-cluster", "--", "true"],
        ["logs", "no-such-cluster"],
        ["logs", "no-such-cluster", "1", "2"],
        ["logs", "no-such-cluster", "first"],
        ["frobnicate"],
        ["exec", "x", "--timeout", "0", "--", "true"],
        ["launch", "-c", "x", "--timeout", "soon", "--", "true"],
        ["launch", "-c", "x", "-d", "--timeout", "5", "--", "true"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(home: Path, args: list[str]):
    res = sky(home, *args, check_rc=2)
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("pytest-sky: error: "), res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert not any((home / "clusters").glob("*/record.json")) if home.exists() else True


def test_help_has_examples():
    for command in ["launch", "exec", "status", "queue", "logs", "cancel", "ssh", "ssh-config", "down", "stress-ssh"]:
        out = subprocess.run([SCRIPT, command, "--help"], capture_output=True, text=True, check=True).stdout
        assert "examples:" in out and f"pytest-sky {command}" in out


def test_a_run_past_its_timeout_says_where_each_rank_waits_then_is_cancelled(home: Path, dev: str):
    """``exec --timeout`` and ``launch --timeout``: a hung run is reported, then stopped (sky's
    exit code for a cancelled job); without --timeout there is no deadline (a CLI job may run long)."""
    hang = "python3 -c 'import time; print(\"up\", flush=True); time.sleep(600)'"
    res = sky(home, "exec", dev, "--timeout", "8", "--", hang, check_rc=103)
    assert f"where every rank of job 1 on {dev} was at the deadline (8 s):" in res.stdout, res.stdout
    assert res.stdout.count("main thread: <string>:1 <module>: import time;") == 2, res.stdout
    assert "waits in time.sleep" in res.stdout and "    | up" in res.stdout
    assert f"job 1 on {dev} did not finish within 8 s: cancelling it" in res.stderr
    assert "Job finished (status: CANCELLED)." in res.stdout
    res = sky(home, "launch", "-c", dev, "--num-nodes", "2", "--timeout", "8", "--", hang, check_rc=103)
    assert f"where every rank of job 2 on {dev} was at the deadline (8 s):" in res.stdout
    queue = sky(home, "queue", dev, check_rc=0).stdout
    assert queue.count("CANCELLED") == 2, queue


def test_ctrl_c_during_a_streamed_run_leaves_the_job_running(home: Path, dev: str):
    env = {**os.environ, "PYTEST_SKY_HOME": str(home), "CI": "1"}
    proc = subprocess.Popen(
        [SCRIPT, "exec", dev, "--", "echo started; sleep 60"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "Job submitted, ID: 1\n"
    # sky's lines, from the job's log: its wait for resources, then its start.
    assert proc.stdout.readline().startswith("├── Waiting for task resources on ")
    assert proc.stdout.readline().startswith("└── Job started. Streaming logs... (Ctrl-C to exit log streaming")
    line = proc.stdout.readline()  # the job is running once a rank has printed
    assert line.endswith(") started\n"), line
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert f"pytest-sky logs {dev} 1 --follow" in err and f"pytest-sky cancel {dev} 1" in err
    assert "RUNNING" in sky(home, "queue", dev, check_rc=0).stdout
    sky(home, "cancel", dev, "--all", check_rc=0)


def test_ctrl_c_during_launch_removes_what_it_created(home: Path):
    env = {**os.environ, "PYTEST_SKY_HOME": str(home), "CI": "1"}
    name = f"clic{os.getpid() % 10000}"
    cluster_dir = home / "clusters" / name
    proc = subprocess.Popen(
        [SCRIPT, "launch", "-c", name, "--num-nodes", "40", "--", "true"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # "launching <name>: ..." once the name is claimed
        assert "launching" in first, first
        # Something exists: the cluster's bridge, named after its directory.
        deadline = time.monotonic() + 30
        while not our_links(str(cluster_dir)):
            assert proc.poll() is None, f"the launch ended before it made anything: {proc.communicate()}"
            assert time.monotonic() < deadline, "the launch made no bridge within 30 s"
            time.sleep(0.005)
        # Hold the launch still while checking it is unfinished, so Ctrl-C surely lands mid-launch.
        proc.send_signal(signal.SIGSTOP)
        record = json.loads((cluster_dir / "record.json").read_text())
        assert record["status"] == "PROVISIONING", "the launch finished before the test could interrupt it"
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if (cluster_dir / "record.json").exists():
            sky(home, "down", name)
    assert proc.returncode != 0, f"the launch ignored Ctrl-C and brought the cluster up:\n{err}"
    assert proc.returncode == 130, err
    assert f"interrupted while launching {name}: removed what was created" in err
    assert not (cluster_dir / "record.json").exists()
    assert our_links(str(home)) == [], subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert processes_mentioning(str(home)) == []


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
def test_interactive_ssh_session_reaches_a_worker_from_the_head(home: Path, dev: str, tmp_path: Path):
    """A person's session: `pytest-sky ssh dev`, then `ssh <worker-ip> hostname` on the head."""
    worker_ip = json.loads(sky(home, "status", "--json", check_rc=0).stdout)[0]["node_ips"][1]
    # A tmux server of the test's own (its socket in tmp_path): never the user's, and nothing
    # left in /tmp/tmux-<uid> afterwards.
    tmux = ["tmux", "-S", str(tmp_path / "tmux.sock")]
    session = f"psky{os.getpid()}"
    env = {**os.environ, "PYTEST_SKY_HOME": str(home)}
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", session, "-x", "200", "-y", "50", f"{SCRIPT} ssh {dev}"],
        env=env,
        check=True,
    )
    try:
        screen = wait_screen(tmux, session, f"{dev}-head")  # the head's prompt shows its hostname
        subprocess.run([*tmux, "send-keys", "-t", session, f"ssh {worker_ip} hostname", "Enter"], check=True)
        screen = wait_screen(tmux, session, f"\n{dev}-worker1")
        assert "password" not in screen.lower() and "yes/no" not in screen
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)


def wait_screen(tmux: list[str], session: str, text: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while True:
        screen = subprocess.run(
            [*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True, check=False
        ).stdout
        if text in screen:
            return screen
        if time.monotonic() > deadline:
            pytest.fail(f"{text!r} never appeared on the screen:\n{screen}")
        time.sleep(0.05)


def test_a_tasks_infra_yields_to_the_command_line_with_a_note(home: Path, tmp_path: Path):
    """``--backend local`` beats a task's ``infra: kubernetes``, and the user is told so."""
    name = f"clinfra{os.getpid() % 10000}"
    task = tmp_path / "task.yaml"
    task.write_text("resources:\n  infra: kubernetes\n  image_id: docker:python:3.11-slim\nrun: echo ran here\n")
    try:
        res = sky(home, "launch", "-c", name, "--backend", "local", str(task), check_rc=0)
        finished = ") ran here\nJob finished (status: SUCCEEDED).\n\n📋 Useful Commands\nJob ID: 1\n"
        assert finished in res.stdout, res.stdout
        notes = [line for line in res.stderr.splitlines() if "note:" in line]
        assert notes == [
            "pytest-sky: note: the task asks for infra kubernetes; it runs on local, as --backend says",
            "pytest-sky: note: image_id docker:python:3.11-slim has no effect on the local backend: "
            "nodes run this machine's software",
        ], res.stderr
        assert "1x Local" in sky(home, "status", check_rc=0).stdout
    finally:
        sky(home, "down", name)


def test_env_env_file_and_secret_options_reach_the_task(home: Path, tmp_path: Path):
    name = f"clienv{os.getpid() % 10000}"
    env_file = tmp_path / "vars.env"
    env_file.write_text("# a dotenv file\nexport FROM_FILE='file'\nBOTH=file\n")
    os.environ["PSKY_FROM_SHELL"] = "shell"
    try:
        res = sky(
            home,
            "launch",
            "-c",
            name,
            "--env-file",
            str(env_file),
            "--env",
            "BOTH=option",
            "--env",
            "PSKY_FROM_SHELL",
            "--secret",
            "TOKEN=t0ps3cret",
            "--secret",
            "PSKY_SHELL_SECRET",  # the safe form: the value from this shell, in no command line
            "--",
            'echo "$FROM_FILE $BOTH $PSKY_FROM_SHELL ${#TOKEN} $TOKEN $PSKY_SHELL_SECRET"',
            check_rc=0,
            env={"PSKY_SHELL_SECRET": "sh3ll-s3cret"},
        )
        assert ") file option shell 9 *** ***\nJob finished (status: SUCCEEDED).\n" in res.stdout, res.stdout
        assert "t0ps3cret" not in res.stdout + res.stderr and "sh3ll-s3cret" not in res.stdout + res.stderr
        missing = sky(home, "exec", name, "--env", "PSKY_NOT_SET_ANYWHERE", "--", "true", check_rc=2)
        assert missing.stderr.strip() == (
            "pytest-sky: error: --env PSKY_NOT_SET_ANYWHERE: PSKY_NOT_SET_ANYWHERE is not set in this shell; "
            "give PSKY_NOT_SET_ANYWHERE=VALUE"
        )
    finally:
        os.environ.pop("PSKY_FROM_SHELL", None)
        sky(home, "down", name)


@pytest.mark.parametrize(
    ("argv", "field", "expected"),
    [
        (["exec", "dev", "-d", "sleep 5"], "task", ["sleep 5"]),
        (["exec", "dev", "--env", "A=1", "echo $A"], "task", ["echo $A"]),
        (["exec", "dev", "-n", "job", "-d", "echo", "hi"], "task", ["echo", "hi"]),
        (["logs", "dev", "-f", "3"], "jobs", ["3"]),
        (["logs", "dev", "--status", "2"], "jobs", ["2"]),
        (["logs", "dev", "3", "--sync-down", "4"], "jobs", ["3", "4"]),
        (["cancel", "-y", "dev", "1", "2"], "jobs", [1, 2]),
        (["cancel", "dev", "-y", "1", "2"], "jobs", [1, 2]),
        (["status", "-r", "a", "b"], "names", ["a", "b"]),
    ],
)
def test_options_may_come_between_a_commands_words(argv: list[str], field: str, expected: object) -> None:
    """As sky takes them: argparse alone calls the words after the option unrecognized."""
    from pytest_sky.cli import _parse, build_parser

    assert getattr(_parse(build_parser(), argv), field) == expected


@pytest.mark.parametrize(
    "argv", [["logs", "dev", "1", "-x", "2"], ["status", "--ip", "a", "-z"], ["queue", "dev", "-u", "extra"]]
)
def test_words_with_nowhere_to_go_are_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from pytest_sky.cli import _parse, build_parser

    with pytest.raises(SystemExit) as exit_:
        _parse(build_parser(), argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_kubernetes_cluster_is_not_stopped_and_the_line_says_how_to_end_it(home: Path) -> None:
    """As sky: a pod has no stopped state; the refusal comes before any node is touched."""
    from pytest_sky.cli.power import stop_cluster
    from pytest_sky.errors import NotSupportedError
    from pytest_sky.state import ClusterRecord, ClusterStatus, StateStore

    record = ClusterRecord("k8s-c", "kubernetes", 1, owner_pid=1, owner_start_time=None, status=ClusterStatus.UP)
    with pytest.raises(NotSupportedError) as info:
        stop_cluster(StateStore(), record)
    assert str(info.value) == (
        "k8s-c: a kubernetes cluster cannot be stopped (a pod has no stopped state; SkyPilot refuses too): "
        "tear it down with `pytest-sky down k8s-c`"
    )
