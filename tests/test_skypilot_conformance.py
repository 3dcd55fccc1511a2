"""SkyPilot's script semantics, each point on a real cluster of namespace nodes.

Checked against SkyPilot's own behaviour (``sky/skylet/log_lib.make_task_bash_script``: a
task's script starts with ``source ~/.bashrc``, then the job's variables are exported over
it; setup runs outside any GPU allocation, so ``CUDA_VISIBLE_DEVICES`` is not set there) and
against the checks of its smoke test of these semantics, written here as our own task.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky import Resources, Task

PYTEST_SKY = str(Path(sys.executable).with_name("pytest-sky"))


@pytest.fixture(scope="module")
def home(module_home: Path) -> Path:
    return module_home


@pytest.fixture(scope="module")
def gpu_cluster(home: Path):
    """Two nodes sharing two (pretend) GPUs: run sees each node's share, setup must not."""
    c = pytest_sky.launch(
        num_nodes=2, name=f"conf-{os.getpid() % 10000}", gpus="V100:1", backend_options={"devices": ["0", "1"]}
    )
    yield c
    c.down()


ENV_CHECK = """\
name: env-check
num_nodes: 2
resources:
  infra: aws
  accelerators: V100:1
workdir: {workdir}
envs:
  FROM_TASK: task
setup: |
  echo "export TEST_VAR=from-bashrc" >> ~/.bashrc
  echo "export FROM_TASK=bashrc" >> ~/.bashrc
  if [[ -v CUDA_VISIBLE_DEVICES ]]; then echo "setup sees CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"; exit 1; fi
run: |
  [[ "$TEST_VAR" == from-bashrc ]] || {{ echo "TEST_VAR is '$TEST_VAR'"; exit 1; }}
  [[ -d ~/sky_workdir/pkg ]] || {{ echo "no workdir"; exit 1; }}
  [[ -n "$SKYPILOT_NODE_RANK" ]] || exit 1
  echo "rank=$SKYPILOT_NODE_RANK gpu=$CUDA_VISIBLE_DEVICES from_task=$FROM_TASK"
"""


def test_a_skypilot_env_check_task_runs_unmodified(gpu_cluster, tmp_path: Path):
    """What SkyPilot's own env-check example asserts: setup's export reaches run through
    ``~/.bashrc``, setup has no CUDA_VISIBLE_DEVICES, the workdir arrived; and the task
    names a cloud (``infra: aws``), which runs here with a one-line note."""
    workdir = tmp_path / "work"
    (workdir / "pkg").mkdir(parents=True)
    path = tmp_path / "env_check.yaml"
    path.write_text(ENV_CHECK.format(workdir=workdir))
    task = Task.from_yaml(path)
    assert task.resources.infra == "aws"
    res = gpu_cluster.run(task)
    assert res.returncode == 0, res.output
    # Run sees each node's GPU share (its own GPU, numbered 0 there, as in a pod); the task's
    # envs win over what ~/.bashrc exports.
    assert [r.stdout.strip() for r in res.ranks] == ["rank=0 gpu=0 from_task=task", "rank=1 gpu=0 from_task=task"]


def test_a_task_naming_another_cloud_launches_here_with_a_note(home: Path, capfd: pytest.CaptureFixture[str]):
    task = Task(run="echo ran", resources=Resources(infra="gcp"))
    with pytest_sky.launch(task, name=f"conf-gcp-{os.getpid() % 10000}") as c:
        assert c.backend == "local" and c.last_result.ok, c.last_result.output
    notes = [line for line in capfd.readouterr().err.splitlines() if "note:" in line]
    assert notes == [
        "pytest-sky: note: the task asks for infra gcp, which pytest-sky does not provision; it runs on local"
    ]


def test_setup_has_no_gpu_variable_unless_the_task_sets_it(gpu_cluster):
    probe = 'echo "${CUDA_VISIBLE_DEVICES-unset}"'
    res = gpu_cluster.run(Task(setup=probe, run=probe, num_nodes=2))
    assert [r.stdout.split() for r in res.ranks] == [["unset", "0"], ["unset", "0"]], res.output
    res = gpu_cluster.run(Task(setup=probe, run="true", num_nodes=2, envs={"CUDA_VISIBLE_DEVICES": "7"}))
    assert [r.stdout.split() for r in res.ranks] == [["7"], ["7"]], res.output


def test_bashrc_comes_first_and_the_jobs_variables_over_it(gpu_cluster):
    """A ``~/.bashrc`` that sets PATH or a SkyPilot variable does not win over the job's."""
    gpu_cluster.run("echo 'export SKYPILOT_NODE_RANK=99; export PSKY_BASHRC=seen' >> ~/.bashrc")
    res = gpu_cluster.run('echo "$SKYPILOT_NODE_RANK $PSKY_BASHRC"')
    assert [r.stdout.strip() for r in res.ranks] == ["0 seen", "1 seen"]


def test_secrets_reach_every_rank_masked_and_inert_keys_are_noted(gpu_cluster, capfd: pytest.CaptureFixture[str]):
    """A secret's value reaches every rank and is masked where the rank prints it; one too
    short to mask (``PIN``) is printed as is, and the run says so in one line."""
    task = Task.from_yaml_str(
        "num_nodes: 2\nsecrets: {API_KEY: s3cr3t-value, PIN: 42}\nresources: {use_spot: true, ports: 8080}\n"
        'run: echo "${#API_KEY} ${API_KEY:0:3} $API_KEY $PIN"\n'
    )
    res = gpu_cluster.run(task)
    assert [r.stdout for r in res.ranks] == ["12 s3c *** 42\n"] * 2, res.output
    err = capfd.readouterr().err
    assert "s3cr3t-value" not in err + res.output
    assert [line for line in err.splitlines() if "note:" in line] == [
        "pytest-sky: note: task 'task': resources.ports has no effect on a pytest-sky cluster",
        "pytest-sky: note: task 'task': resources.use_spot has no effect on a pytest-sky cluster",
        "pytest-sky: note: task 'task': secrets.PIN: a value (or a line of one) shorter than 4 characters "
        "is not masked in output",
    ]


def _cli(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([PYTEST_SKY, *args], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"pytest-sky {' '.join(args)}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_skypilots_cancel_reliability_sequence_counts_three_processes(home: Path, tmp_path: Path):
    """SkyPilot's ``test_cancel_job_reliability`` (its smoke tests, ``test_basic.py``): a
    detached ``sleep 10000`` job, then ``ssh <cluster> "ps aux | grep 'sleep 10000'"`` must
    print 3 lines (the sleep, the grep, the shell ssh runs them in), then ``cancel`` ends it.
    A rank's program travels in no command line (DESIGN.md section 4), so the supervisor
    and the rank's own bash do not match; before, they did, and the count was 6.  SkyPilot
    repeats it 9 times; 3 here."""
    name = f"conf-ps-{os.getpid() % 10000}"
    task = tmp_path / "sleep.yaml"
    task.write_text("run: sleep 10000\n")
    _cli("launch", "-c", name, "--num-nodes", "2", "--", "echo hi")  # job 1, as sky launch's
    try:
        ssh = ["ssh", "-F", str(home / "clusters" / name / "ssh_config"), name, "ps aux | grep 'sleep 10000'"]

        def lines() -> list[str]:
            return subprocess.run(ssh, capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()

        for job_id in range(2, 5):
            out = _cli("exec", name, str(task), "-d").stdout
            assert f"Job submitted, ID: {job_id}" in out, out
            deadline = time.monotonic() + 30  # SkyPilot's own bound for the job to be running
            while len(found := lines()) == 2 and time.monotonic() < deadline:
                time.sleep(0.1)  # the detached job starts its sleep in its own time
            assert len(found) == 3, "\n".join(found)
            _cli("cancel", "-y", name, str(job_id))
            assert len(found := lines()) == 2, "\n".join(found)  # the grep and its shell only
    finally:
        subprocess.run([PYTEST_SKY, "down", "-y", name], capture_output=True, timeout=120, check=False)
