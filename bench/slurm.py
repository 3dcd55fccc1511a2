"""Slurm against local: the same 2-node launch, ``run("echo hi")`` and teardown, in one run.

The Slurm side is a cluster of the Slurm backend on the repository's testbed (``python -m
slurm_testbed``, started here and stopped at the end, outside every timing): one allocation
of a real Slurm, reached through its login node over SSH.  Each repetition measures the local
backend and then Slurm, so a burst of load lands on both sides of a ratio.  What the Slurm
figures hold that the local ones do not: sbatch and the scheduler's pass, the node step's
files sent through the login node (one srun), an ssh hop through the login node, and every
rank of every run a job step (one srun per rank, where a local run forks on each node).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.records import Figure, median
from bench.sections import Namer, Plan, progress

SECTION = "slurm"
NOTE = (
    "Slurm: one allocation of the repository's testbed (Debian's Slurm 22.05 in local nodes), reached through its "
    "login node over SSH; every rank a job step (srun); local: namespace nodes on this machine"
)


def _cycle(name: str, **launch: object) -> tuple[float, float, float]:
    """(launch until every sshd answers, a warm ``run('echo hi')``, teardown) seconds."""
    import pytest_sky

    t0 = time.perf_counter()
    c = pytest_sky.launch(num_nodes=2, name=name, **launch)  # type: ignore[arg-type]
    try:
        t1 = time.perf_counter()
        for _ in range(2):  # the client's connection, and locally each node's agent server (DESIGN.md 4)
            c.run("echo hi")
        t2 = time.perf_counter()
        c.run("echo hi")
        t3 = time.perf_counter()
    finally:
        c.down()
    return t1 - t0, t3 - t2, time.perf_counter() - t3


def _testbed(directory: Path) -> tuple[subprocess.Popen[str], Path]:
    config = directory / "slurm-config"
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurm_testbed", "--nodes", "2", "--slurm-config", str(config)],
        cwd=Path(__file__).resolve().parent.parent,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:  # its last line before it waits says it wrote the config
        said.append(line.strip())
        if "wrote " in line:
            return proc, config
    proc.wait()
    raise RuntimeError(f"the Slurm testbed did not start: {said[-1] if said else proc.returncode}")


def versus_local(plan: Plan, namer: Namer) -> list[Figure]:
    if shutil.which("slurmctld", path="/usr/sbin:/usr/bin") is None:
        return [Figure(section=SECTION, name="(not measured)", unit="s", value=None, note="Slurm is not installed")]
    reps = max(2, plan.bringup_reps)
    local: list[tuple[float, float, float]] = []
    slurm: list[tuple[float, float, float]] = []
    directory = Path(tempfile.mkdtemp(prefix="psky-bench-slurm-"))
    progress(f"slurm: a 2-node testbed, then {reps} x (local, slurm) launch + run + down")
    proc, config = _testbed(directory)
    try:
        _cycle(namer("slurm-warm"), backend="slurm", backend_options={"config": str(config)})
        for _ in range(reps):
            local.append(_cycle(namer("slurm-local")))
            slurm.append(_cycle(namer("slurm"), backend="slurm", backend_options={"config": str(config)}))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        shutil.rmtree(directory, ignore_errors=True)
    rows = (("2-node launch, until every sshd answers", 0, "s"), ("run('echo hi'), 2 nodes, warm", 1, "ms"))
    rows += (("teardown, 2 nodes (cancelled, gone from squeue)", 2, "s"),)
    figures = []
    for name, index, unit in rows:
        scale = 1000 if unit == "ms" else 1
        ours, base = [s[index] * scale for s in slurm], [s[index] * scale for s in local]
        figures.append(
            Figure(
                section=SECTION,
                name=f"{name}, median",
                unit=unit,
                value=median(ours),
                baseline=median(base),
                baseline_name="local backend, same run",
                samples=ours,
                baseline_samples=base,
                note=NOTE if index == 0 else "",
            )
        )
    return figures
