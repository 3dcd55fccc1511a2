"""Reliability under the conditions CI really has: parallel workers, crashes, lost agents, churn."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky.job import JobStatus
from tests.contract import JOB_FAILS_WITHIN_S, within_promise
from tests.leftovers import our_links, processes_mentioning

SCRIPT = str(Path(sys.executable).with_name("pytest-sky"))


def test_killed_head_agent_fails_the_job_and_stops_every_rank(home: Path):
    with pytest_sky.launch(num_nodes=2, name="rel-agent") as c:
        job = c.submit("sleep 93")
        deadline = time.monotonic() + 15
        while job.status != JobStatus.RUNNING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        agent_pid = job.info()["pid"]  # in the head's PID namespace
        start = time.monotonic()
        c.run(f'[ "$SKYPILOT_NODE_RANK" = 0 ] && kill -9 {agent_pid}; true')
        assert job.wait(15) == JobStatus.FAILED
        took = time.monotonic() - start
        assert took < JOB_FAILS_WITHIN_S, within_promise(took)
        assert "agent died" in job.error
        deadline = time.monotonic() + 10
        while True:  # its ranks lose their lifeline and stop
            left = c.run("pgrep -f '^sleep 93' | wc -l")
            if [r.stdout.strip() for r in left.ranks] == ["0", "0"] or time.monotonic() > deadline:
                break
        assert [r.stdout.strip() for r in left.ranks] == ["0", "0"]


def test_doctor_lists_what_is_left_and_down_all_removes_it(home: Path):
    env = {**os.environ, "PYTEST_SKY_HOME": str(home), "CI": "1"}
    code = (
        "import os, pytest_sky\n"
        "pytest_sky.launch(num_nodes=2, name='rel-doctor')\n"
        "os._exit(0)  # the owner dies without tearing down\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    doctor = subprocess.run([SCRIPT, "doctor"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert doctor.returncode == 1
    assert "record rel-doctor (owner pid" in doctor.stdout and "link psky" in doctor.stdout
    subprocess.run([SCRIPT, "down", "--all"], env=env, check=True, timeout=120)
    assert our_links(home) == []
    doctor = subprocess.run([SCRIPT, "doctor"], env=env, capture_output=True, text=True, timeout=60, check=False)
    # Ours only: another session's cluster of the same name (this test in a concurrent run) is
    # listed by a path outside this home.
    ours = [line for line in doctor.stdout.splitlines() if str(home) in line or line.startswith("record rel-doctor")]
    assert ours == []


def test_nodes_whose_state_directory_was_deleted_are_removed_by_down_all(home: Path, tmp_path: Path):
    """A user deletes the state directory while a cluster runs: no record is left to tear it
    down.  ``doctor`` lists its nodes and says what to run; ``down --all`` with that state
    directory removes them (and only its own: another's are not its to judge)."""
    lost = tmp_path / "lost-home"
    code = "import os, pytest_sky\npytest_sky.launch(num_nodes=2, name='rel-lost')\nos._exit(0)\n"
    lost_env = {**os.environ, "PYTEST_SKY_HOME": str(lost)}
    subprocess.run([sys.executable, "-c", code], env=lost_env, check=True, timeout=120)
    shutil.rmtree(lost)
    try:
        _down_all_removes_what_lost_its_state(home, lost)
    finally:  # should it not: by the nodes' markers and the links' aliases, as the leak check tells them
        from pytest_sky.backends import netns

        netns.reap_nodes([], node_dirs=str(lost))
        links = our_links(lost)
        netns.kill_cgroups([netns.node_cgroup(n) for n in links])
        netns.delete_links(netns.require_tools()["ip"], links)


def _down_all_removes_what_lost_its_state(home: Path, lost: Path) -> None:
    assert our_links(lost) and processes_mentioning(str(lost))
    env = {**os.environ, "PYTEST_SKY_HOME": str(home), "CI": "1"}
    doctor = subprocess.run([SCRIPT, "doctor"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert doctor.returncode == 1 and f"{lost}/clusters/rel-lost" in doctor.stdout, doctor.stdout
    assert "pytest-sky down --all" in doctor.stderr and "PYTEST_SKY_HOME" in doctor.stderr, doctor.stderr
    elsewhere = subprocess.run([SCRIPT, "down", "--all"], env=env, capture_output=True, text=True, timeout=120)
    assert elsewhere.stdout == "no clusters\n" and our_links(lost), elsewhere.stdout
    env["PYTEST_SKY_HOME"] = str(lost)
    down = subprocess.run([SCRIPT, "down", "--all"], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert down.returncode == 0, down.stderr
    assert "node process" in down.stdout and "removed (nothing alive owned it)" in down.stdout, down.stdout
    assert our_links(lost) == [] and processes_mentioning(str(lost)) == []
    doctor = subprocess.run([SCRIPT, "doctor"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert str(lost) not in doctor.stdout, doctor.stdout


def test_xdist_worker_crash_is_cleaned_up_by_the_next_run(pytester: pytest.Pytester, home: Path):
    pytester.makepyfile(
        test_inner="""
        import os, pytest

        @pytest.mark.multinode
        def test_crash(sky_cluster):
            os._exit(3)  # the xdist worker dies with a cluster up

        @pytest.mark.multinode
        def test_fine(sky_cluster):
            assert sky_cluster.run("true").returncode == 0
        """
    )
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*crashed*"])
    # The crashed worker's cluster is recorded (unless a replacement worker reaped it already).
    left = [json.loads(p.read_text())["name"] for p in (home / "clusters").glob("*/record.json")]
    assert all("crash" in name for name in left)
    # The next run that asks for a cluster reaps it first (one that asks for none touches nothing).
    pytester.makepyfile(test_second="import pytest\n\n@pytest.mark.multinode\ndef test_asks(sky_cluster):\n    pass\n")
    again = pytester.runpytest_subprocess("test_second.py", "-p", "no:cacheprovider")
    if left:
        again.stdout.fnmatch_lines([f"*reaped 1 cluster(s) left by a killed run: {left[0]}*"])
    assert list((home / "clusters").glob("*/record.json")) == []
    assert our_links(home) == []


def test_eight_multinode_tests_on_four_workers(pytester: pytest.Pytester, home: Path, tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    pytester.makepyfile(
        test_inner=f"""
        import json, pathlib, pytest

        @pytest.mark.multinode(num_nodes=2)
        @pytest.mark.parametrize("i", range(8))
        def test_many(sky_cluster, i):
            res = sky_cluster.run("hostname")
            assert res.returncode == 0
            pathlib.Path({str(out)!r}, str(i)).write_text(json.dumps([sky_cluster.name, sky_cluster.node_ips]))
        """
    )
    result = pytester.runpytest_subprocess("-n", "4", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=8)
    seen = [json.loads(p.read_text()) for p in out.iterdir()]
    assert len({name for name, _ in seen}) == 8
    assert our_links(home) == []


@pytest.mark.long(7)
def test_two_hundred_launch_teardown_cycles_leave_nothing(home: Path):
    """50 cycles in every run (CI included), all 200 with PYTEST_SKY_SLOW=1."""
    for i in range(200 if os.environ.get("PYTEST_SKY_SLOW") == "1" else 50):
        with pytest_sky.launch(num_nodes=2, name=f"cycle-{i}") as c:
            assert len(c.node_ips) == 2
    assert our_links(home) == []
    assert list((home / "clusters").glob("*/record.json")) == []


def test_a_job_that_ended_while_its_dead_agent_was_looked_for_keeps_its_own_error(tmp_path: Path, monkeypatch):
    """``wait`` reads a RUNNING record, then finds the agent's pid gone: the agent may have
    written its last record (why the job failed: a rank) and exited in between.  That record
    stays; only a job still RUNNING becomes "the job's agent died" (under load an evicted
    worker's job once said the agent died instead of naming rank 2)."""
    from pytest_sky.agent import records
    from pytest_sky.protocol import JobRecord

    monkeypatch.setattr(records, "_RECORDS", {})
    job_dir = tmp_path / "7"
    job_dir.mkdir()
    ended = JobRecord(id=7, status=JobStatus.FAILED, error="rank 2 (worker2) exited 137")
    (job_dir / "status.json").write_text(ended.encode())
    assert records.died(str(job_dir)).error == "rank 2 (worker2) exited 137"
    assert "rank 2" in (job_dir / "status.json").read_text()

    (job_dir / "status.json").write_text(JobRecord(id=7, status=JobStatus.RUNNING, pid=999999).encode())
    assert records.died(str(job_dir)).error == "the job's agent died"


def test_the_reaper_removes_this_users_dead_sockets_that_no_record_names(tmp_path: Path) -> None:
    """A run SIGKILLed with its state directory deleted (a CI job's, a test's) leaves its
    masters' and forwarder's sockets in /tmp with no record naming them: any later run's reaper
    removes those nothing answers, once they are older than a bind's instant; never a fresh
    one (bound, not yet listening), one that answers, nor another user's."""
    import secrets
    import socket

    from pytest_sky import bootstrap
    from pytest_sky.lifecycle import reap_strays
    from pytest_sky.state import StateStore

    prefix = f"{bootstrap.CONTROL_DIR}/psky-test{secrets.token_hex(4)}"
    old_dead, fresh_dead, old_live, others = (f"{prefix}-{n}" for n in ("old", "fresh", "live", "others"))
    then = time.time() - bootstrap.DEAD_SOCKET_AGE - 1
    with contextlib.ExitStack() as stack:
        paths = (old_dead, fresh_dead, old_live, others)
        socks = {p: stack.enter_context(socket.socket(socket.AF_UNIX)) for p in paths}
        for path, sock in socks.items():
            sock.bind(path)
        socks[old_live].listen()
        for path in (old_dead, fresh_dead, others):
            socks[path].close()  # what a SIGKILLed master or forwarder leaves
        for path in (old_dead, old_live, others):
            os.utime(path, (then, then))
        if os.geteuid() == 0:
            os.chown(others, 65534, 65534)
        else:
            os.unlink(others)  # an ordinary user cannot give one away
        try:
            reap_strays(StateStore(tmp_path / "state"))
            assert not os.path.exists(old_dead)
            assert os.path.exists(fresh_dead) and os.path.exists(old_live)
            assert os.path.exists(others) == (os.geteuid() == 0)
        finally:
            for path in socks:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


def test_a_killed_masters_control_socket_is_reported_and_teardown_removes_it(tmp_path: Path) -> None:
    """ssh removes its ControlPath socket only when the master exits of its own accord; one
    killed leaves the socket in /tmp.  doctor names it, and a teardown's stop_master removes
    its cluster's, but never the socket of a master that still answers."""
    import secrets
    import socket

    from pytest_sky import bootstrap
    from pytest_sky.doctor import leftovers

    prefix = f"{bootstrap.CONTROL_DIR}/psky-test{secrets.token_hex(4)}"
    dead, live = f"{prefix}-dead", f"{prefix}x-live"  # only the dead one is the config's
    with socket.socket(socket.AF_UNIX) as gone, socket.socket(socket.AF_UNIX) as master:
        gone.bind(dead)  # bound, then closed: what a SIGKILLed master leaves
        master.bind(live)
        master.listen()
        gone.close()
        try:
            assert f"ssh control socket {dead} (its master is gone)" in leftovers(tmp_path / "state")
            assert not any(live in line for line in leftovers(tmp_path / "state"))
            config = tmp_path / "ssh_config"
            config.write_text(f"Host c\n  HostName 127.0.0.1\n  ControlPath {prefix}-%C\n")
            bootstrap.stop_master(config, "c")
            assert not os.path.exists(dead)
            assert not bootstrap.remove_if_stale(live) and os.path.exists(live)
        finally:
            for path in (dead, live):
                if os.path.exists(path):
                    os.unlink(path)


def test_a_killed_test_runs_state_directory_goes_with_the_next_run(tmp_path: Path) -> None:
    """This repository's runs each make a state directory of their own (conftest.py), which a
    SIGKILLed run cannot remove: the next run reaps what it left and removes it; never that
    of a run still going, nor a directory without an owner it can read."""
    import tempfile

    from pytest_sky.procs import start_time

    repo = Path(__file__).resolve().parent.parent
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    identity = f"{killed.pid} {start_time(killed.pid)}\n"
    killed.kill()
    killed.wait()
    dead, alive, unknown = (Path(tempfile.mkdtemp(prefix=f"pytest-sky-tests-{n}-")) for n in ("x", "y", "z"))
    try:
        (dead / "tests-owner").write_text(identity)
        (dead / "clusters").mkdir()
        (alive / "tests-owner").write_text(f"{os.getpid()} {start_time(os.getpid())}\n")
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_SKY_HOME"}
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_naming.py"],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert not dead.exists() and alive.exists() and unknown.exists()
    finally:
        for path in (dead, alive, unknown):
            shutil.rmtree(path, ignore_errors=True)
