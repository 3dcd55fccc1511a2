"""The Slurm backend against a real Slurm (the testbed, ``python -m slurm_testbed``): what a
cluster is there (one allocation, a job step per rank, the SkyPilot environment), what Slurm
refuses and why, what is left after it (nothing), and what a killed session's allocation
becomes (cancelled by the next one).  The smoke suite's own run on Slurm is CI's
(``.ci/run``); these are what only Slurm shows."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_helpers import RunningTestbed, running_testbed, skip_without_slurm

from pytest_sky import launch
from pytest_sky.errors import NotSupportedError, ProvisionError

pytestmark = pytest.mark.long(30)

SHARED = "/mnt/shared"
#: What a rank says of itself: SkyPilot's variables, the Slurm ones it has (not the step's),
#: the job step it runs in (the slurmstepd above it), and from rank 0 a user's own srun.
STEP_PROBE = r"""
echo "rank=$SKYPILOT_NODE_RANK gpus=$SKYPILOT_NUM_GPUS_PER_NODE cvd=$CUDA_VISIBLE_DEVICES \
nodes=$SKYPILOT_NUM_NODES ips=$(echo "$SKYPILOT_NODE_IPS" | paste -sd,) host=$(hostname)"
echo "step=${SLURM_STEP_ID:-none} ntasks=${SLURM_NTASKS:-none} jobid=${SLURM_JOBID:-none}"
p=$$
while [ "$p" != 1 ]; do
  c=$(tr '\0' ' ' <"/proc/$p/cmdline")
  case $c in slurmstepd*) echo "stepd=$c"; break ;; esac
  p=$(awk '/^PPid/{print $2}' "/proc/$p/status")
done
if [ "$SKYPILOT_NODE_RANK" = 0 ]; then
  srun -l hostname | sort
  scontrol show job "$SLURM_JOB_ID" | grep -o "TresPerNode=[^ ]*"
fi
"""


@pytest.fixture(scope="module")
def testbed(tmp_path_factory: pytest.TempPathFactory, module_home: Path) -> Iterator[RunningTestbed]:
    """Two compute nodes with two fake GPUs each and a shared directory; the client's state
    directory is the module's own (``module_home``), the testbed's inside it."""
    skip_without_slurm()
    directory = tmp_path_factory.mktemp("slurm")
    args = ("--nodes", "2", "--gpus-per-node", "2", "--gpu-type", "tesla", "--shared-dir", SHARED)
    with running_testbed(directory, *args) as tb:
        yield tb


@pytest.fixture
def site(testbed: RunningTestbed, monkeypatch: pytest.MonkeyPatch) -> RunningTestbed:
    monkeypatch.setenv("PYTEST_SKY_SLURM_CONFIG", str(testbed.config))
    return testbed


def squeue(tb: RunningTestbed, user: str = "root") -> list[str]:
    done = tb.ssh(f"squeue -h -u {user} -o '%j %T'")
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def on_compute_nodes(tb: RunningTestbed, command: str) -> str:
    """``command`` on every compute node as the testbed's administrator, outside any job:
    its login node's root reaches them over the testbed's own cluster network."""
    names = tb.ssh("sinfo -h -N -o %N").stdout.split()
    script = "; ".join(f"ssh -o BatchMode=yes {name} {command!r}" for name in sorted(set(names)))
    done = tb.ssh(script)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_rank_is_a_job_step_of_the_allocation_with_skypilots_environment_and_its_gres(site) -> None:
    cluster = launch(num_nodes=2, name="steps", backend="slurm", accelerators="TESLA:2")
    try:
        job = cluster.run(STEP_PROBE)
        assert job.returncode == 0, job.output
        # The allocation's GRES, in the site's spelling of the type asked for as TESLA.
        assert "TresPerNode=gres:gpu:tesla:2" in job.ranks[0].stdout, job.ranks[0].stdout
        ips = ",".join(cluster.node_ips)
        for rank in job.ranks:
            lines = rank.stdout.splitlines()
            host = cluster.node_names[rank.rank]
            assert lines[0] == f"rank={rank.rank} gpus=2 cvd=0,1 nodes=2 ips={ips} host={host}"
            assert lines[1] == "step=none ntasks=none jobid=none"
            step = re.fullmatch(r"stepd=slurmstepd: \[(\d+)\.(\d+)\]", lines[2].strip())
            assert step and int(step.group(2)) >= 2, lines  # its own: 0 and 1 are the sshd's and the keys'
        assert job.ranks[0].stdout.splitlines()[3:5] == [f"0: {cluster.node_names[0]}", f"1: {cluster.node_names[1]}"]
    finally:
        cluster.down()
    assert not [line for line in squeue(site) if "pytest-sky-steps" in line]


def test_a_request_no_node_can_satisfy_ends_the_launch_in_one_line_naming_slurms_reason(site, module_home) -> None:
    with pytest.raises(ProvisionError) as info:
        launch(num_nodes=2, name="toomany", backend="slurm", accelerators="tesla:3")
    assert str(info.value) == (
        "Slurm refused the allocation of toomany: Batch job submission failed: Requested node configuration "
        "is not available"
    )
    assert not (module_home / "clusters" / "toomany").exists()
    assert not [line for line in squeue(site) if "toomany" in line]


def test_a_pending_allocation_shows_its_reason_and_ends_at_the_timeout_with_it(site, caplog) -> None:
    """Every CPU of both nodes held by one cluster: the next one waits for Resources."""
    hog = launch(num_nodes=2, name="hog", backend="slurm", cpus=8)
    try:
        caplog.set_level(logging.INFO, logger="pytest_sky")
        with pytest.raises(ProvisionError) as info:
            launch(num_nodes=1, name="waits", backend="slurm", backend_options={"ready_timeout": 3})
        said = str(info.value)
        assert re.fullmatch(
            r"Slurm job \d+ of waits was still pending after 3 s \(Resources\); raise --slurm-timeout or ask for less",
            said,
        ), said
        said = [r.message for r in caplog.records]
        assert any(re.search(r"waits: Slurm job \d+ pending \(Resources\)", m) for m in said), said
        assert not [line for line in squeue(site) if "pytest-sky-waits" in line]  # cancelled, not left pending
    finally:
        hog.down()


def test_a_sigkilled_sessions_allocation_is_cancelled_by_the_next_session_on_a_fresh_state_directory(
    site, tmp_path
) -> None:
    code = (
        "import os, signal, pytest_sky\n"
        "pytest_sky.launch(num_nodes=2, name='killed', backend='slurm')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTEST_SKY_HOME": str(tmp_path / "first")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert "pytest-sky-killed RUNNING" in squeue(site)
    (tmp_path / "test_next.py").write_text(
        "import pytest\n\n@pytest.mark.multinode(num_nodes=1)\ndef test_next(sky_cluster):\n"
        "    assert sky_cluster.run('true').returncode == 0\n"
    )
    env = {**os.environ, "PYTEST_SKY_HOME": str(tmp_path / "second")}
    nxt = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--slurm", str(tmp_path / "test_next.py")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert nxt.returncode == 0, nxt.stdout + nxt.stderr
    assert re.search(r"reaped 1 cluster\(s\) left by a killed run: killed \(Slurm job \d+\)", nxt.stdout), nxt.stdout
    assert squeue(site) == []


def test_down_stale_cancels_only_our_jobs_whose_owner_is_gone(site, tmp_path) -> None:
    from slurm_testbed.config import ORDINARY_USER

    dead = "pytest-sky owner=elsewhere:0:1:1 launch=ab keep=0"  # not this machine's: never judged
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()
    from pytest_sky.backends.slurm_owner import Owner, boot_id

    ours_dead = Owner(__import__("socket").gethostname(), boot_id(), int(gone), 1, "cd", keep=False).comment()
    submit = "sbatch --parsable -N1 -o /dev/null -J {name} --comment={comment!r} --wrap 'sleep 300'"
    for name, comment, user in (
        ("pytest-sky-other-user", ours_dead, ORDINARY_USER),  # another user's: never touched
        ("not-ours", ours_dead, None),  # not named by us
        ("pytest-sky-elsewhere", dead, None),
        ("pytest-sky-a-users-own", "my own comment", None),
        ("pytest-sky-stale", ours_dead, None),
    ):
        done = site.ssh(submit.format(name=name, comment=comment), user=user)
        assert done.returncode == 0, done.stderr
    try:
        env = {**os.environ, "PYTEST_SKY_HOME": str(tmp_path / "fresh")}
        down = subprocess.run(
            [sys.executable, "-m", "pytest_sky.cli", "down", "--stale", "--slurm"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert down.returncode == 0, down.stderr
        assert re.fullmatch(r"stale \(Slurm job \d+\): down \(its owner is gone\)\n", down.stdout), down.stdout
        left = {line.split()[0] for line in squeue(site) + squeue(site, ORDINARY_USER)}
        assert left == {"pytest-sky-other-user", "not-ours", "pytest-sky-elsewhere", "pytest-sky-a-users-own"}
    finally:
        site.ssh("scancel -u root; scancel -u " + ORDINARY_USER)


def test_what_a_slurm_node_cannot_do_is_said_in_one_line(site) -> None:
    cluster = launch(num_nodes=2, name="faults", backend="slurm")
    try:
        faults = (lambda: cluster.kill_node(1), lambda: cluster.restart_node(1), lambda: cluster.partition([0], [1]))
        for fault in faults:
            with pytest.raises(NotSupportedError) as info:
                fault()
            assert "\n" not in str(info.value) and "Slurm" in str(info.value)
        stop = subprocess.run(
            [sys.executable, "-m", "pytest_sky.cli", "stop", "faults"], capture_output=True, text=True, timeout=120
        )
        errors = [line for line in stop.stderr.splitlines() if line.startswith("pytest-sky: error:")]
        assert stop.returncode != 0 and len(errors) == 1, stop.stderr
        assert "a slurm cluster cannot be stopped" in errors[0]
    finally:
        cluster.down()


def test_after_down_nothing_of_the_cluster_is_left_on_any_node(site) -> None:
    cluster = launch(num_nodes=2, name="traces", backend="slurm")
    try:
        job = cluster.submit("sleep 600 & sleep 600; echo never")
        assert [j["status"] for j in cluster.queue()] in (["PENDING"], ["RUNNING"])
        job.cancel()
        assert [j["status"] for j in cluster.queue()] == ["CANCELLED"]
        leftover = cluster.run("pgrep -fa 'slee[p] 600' || echo none")
        assert [r.stdout.strip() for r in leftover.ranks] == ["none", "none"]
        job_id = cluster.run("echo $SLURM_JOB_ID").ranks[0].stdout.strip()
        cluster.submit("sleep 600")  # still running when the cluster goes
    finally:
        cluster.down()
    assert squeue(site) == []
    found = on_compute_nodes(
        site,
        f"grep -lzx SLURM_JOB_ID={job_id} /proc/[0-9]*/environ 2>/dev/null | head -3; "
        "ls -d /tmp/pytest-sky-traces-* 2>/dev/null; true",
    )
    assert found.strip() == ""


def test_an_ordinary_users_cluster_keeps_to_its_own_files_and_reaches_its_workers(testbed, tmp_path, monkeypatch):
    """No root on the site: sshd without privilege separation, keys in node-local scratch,
    the user's own home (on a site, shared between nodes) never written, not by a session
    on a worker either, which starts in the cluster's home as on every backend."""
    from slurm_testbed.config import ORDINARY_USER

    config = tmp_path / "user-config"
    config.write_text(testbed.config.read_text().replace("User root", f"User {ORDINARY_USER}"))
    monkeypatch.setenv("PYTEST_SKY_SLURM_CONFIG", str(config))
    cluster = launch(num_nodes=2, name="plain", backend="slurm")
    try:
        res = cluster.run(
            'echo "$(id -un) $HOME"; ls -A /home/' + ORDINARY_USER + " | paste -sd,\n"
            'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then\n'
            '  ssh "$(echo "$SKYPILOT_NODE_IPS" | tail -1)" "hostname; pwd; echo x >written; ls -A /home/'
            + ORDINARY_USER
            + ' | paste -sd,"\n'
            "fi"
        )
        assert res.returncode == 0, res.output
        for rank in res.ranks:
            user, home = rank.stdout.split()[:2]
            assert user == ORDINARY_USER and home.startswith("/tmp/pytest-sky-plain-"), rank.stdout
            assert rank.stdout.splitlines()[1] == ".ssh"  # what the testbed put there, nothing more
        home = res.ranks[1].stdout.split()[1]
        assert res.ranks[0].stdout.splitlines()[2:] == [cluster.node_names[1], home, ".ssh"], res.ranks[0].stdout
    finally:
        cluster.down()
    assert squeue(testbed, ORDINARY_USER) == []


def test_the_site_shared_directory_is_held_by_one_cluster_at_a_time_and_emptied(site) -> None:
    opts = {"shared_dir": SHARED}
    first = launch(num_nodes=2, name="holds", backend="slurm", shared_dir=SHARED, backend_options=opts)
    try:
        assert first.run(f'[ "$SKYPILOT_NODE_RANK" != 0 ] || echo hi > {SHARED}/note').returncode == 0
        wrote = first.run(f"cat {SHARED}/note")
        assert [r.stdout for r in wrote.ranks] == ["hi\n", "hi\n"], wrote.output
        with pytest.raises(ProvisionError) as info:
            waits = {**opts, "ready_timeout": 2}
            launch(num_nodes=1, name="waits2", backend="slurm", shared_dir=SHARED, backend_options=waits)
        assert f"the shared directory {SHARED} stayed held by Slurm job" in str(info.value)
    finally:
        first.down()
    second = launch(num_nodes=1, name="next", backend="slurm", shared_dir=SHARED, backend_options=opts)
    try:
        assert second.run(f"ls -A {SHARED}").ranks[0].stdout == ".pytest-sky-holder\n"  # emptied
    finally:
        second.down()


def test_the_check_between_shared_tests_leaves_other_allocations_and_the_site_alone(site) -> None:
    """A node is the site's: the leftover check of one cluster's shared scope (run between two
    tests) must not take another allocation's job on the same nodes, nor the site's daemons."""
    from pytest_sky.cluster import reset_for_next_test

    ours = launch(num_nodes=2, name="shared-a", backend="slurm")
    other = launch(num_nodes=2, name="shared-b", backend="slurm")
    try:
        job = other.submit("sleep 600")
        ours.submit("sleep 600")
        reset_for_next_test(ours)  # cancels ours, checks every node: raises if something of ours survived
        assert ours.queue() == []
        assert job.status == "RUNNING"
        assert ours.run("echo still").returncode == 0  # slurmd and munged are there
    finally:
        ours.down()
        other.down()


def test_a_secret_reaches_every_rank_masked_and_a_worker_over_ssh_not_in_a_steps_environment(site) -> None:
    """srun hands a step's environment to the node's slurmd unencrypted: a run that holds a
    secret starts its workers over the cluster's ssh instead, inside the allocation's sshd step,
    and the value is masked in what the ranks print."""
    from pytest_sky import Task

    cluster = launch(num_nodes=2, name="secret", backend="slurm")
    try:
        probe = STEP_PROBE.split("if [")[0]  # the environment and the step above each rank
        res = cluster.run(Task(run=f'echo "key=$API_KEY"\n{probe}', num_nodes=2, secrets={"API_KEY": "s3cr3t-k3y"}))
        assert res.returncode == 0, res.output
        assert "s3cr3t-k3y" not in res.output
        steps = []
        for rank in res.ranks:
            assert rank.stdout.splitlines()[0] == "key=***"
            found = re.search(r"stepd=slurmstepd: \[(\d+)\.(\d+)\]", rank.stdout)
            assert found, rank.stdout
            job, step = found.groups()
            steps.append(step)
        # The sshd step is the one step of the allocation still running once the run ended (the
        # head's rank and the key delivery were steps that ended); its number is whichever srun
        # reached slurmctld first, the batch script's or the delivery's.
        running = site.ssh(f"squeue -h -s -j {job} -o %i")
        assert running.returncode == 0, running.stderr
        (sshd_step,) = [i.split(".")[1] for i in running.stdout.split() if i.split(".")[1].isdigit()]
        assert steps[1] == sshd_step != steps[0]  # the head's rank a step of its own; the worker's in sshd's
    finally:
        cluster.down()
