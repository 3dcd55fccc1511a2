"""``python -m bench --shared-clusters`` (also part of ``--peers``): what ``scope="module"`` saves.

A module of ten multinode tests, each running one command on its 2-node cluster, is run by
pytest on the Kubernetes backend against the repository's API emulator: once with
``@pytest.mark.multinode(num_nodes=2, scope="module")`` (one cluster for the module, reset
between tests) and once with per-test clusters (the default scope), the two interleaved in
the same loop so that load from others sharing the machine lands on both.  Each is a whole
``pytest`` process, as a user runs it: collection, every launch, reset and teardown included.
The emulator's pods are local namespace nodes, so its launches cost far less than a real
cluster's tens of seconds: the saving measured here is a floor.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from bench.records import Figure, median
from bench.sections import progress

SECTION = "shared clusters, kubernetes"
TESTS = 10
INNER = """
import pytest

{marker}
@pytest.mark.parametrize("i", range({tests}))
def test_one_command(sky_cluster, i):
    res = sky_cluster.run("echo $SKYPILOT_NODE_RANK")
    assert [r.stdout for r in res.ranks] == ["0\\n", "1\\n"], res.output
"""
MARKERS = {
    "module": '@pytest.mark.multinode(num_nodes=2, scope="module")',
    "function": "@pytest.mark.multinode(num_nodes=2)",
}


def _pytest_wall(test_file: Path, kubeconfig: Path, home: Path, image: str) -> float:
    """One whole pytest run of ``test_file`` on the Kubernetes backend (pods of ``image``);
    raises if a test failed."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTEST_SKY_HOME": str(home)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--kubernetes", f"--kube-image={image}"]
    argv.append(test_file.name)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=test_file.parent, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"pytest {test_file.name} exited {proc.returncode}: {tail[0]}")
    return wall


def shared_clusters(quick: bool) -> list[Figure]:
    """Ten tests with ``scope="module"`` against the same ten with a cluster each."""
    try:
        from kube_emulator import Emulator
        from kube_emulator.images import READY_IMAGE  # the default image has no sshd there
    except Exception as exc:  # noqa: BLE001 - any import problem means "not measured"
        note = f"kube_emulator not importable: {type(exc).__name__}: {exc}"
        return [Figure(section=SECTION, name="(not measured)", unit="s", value=None, note=note)]
    reps = 1 if quick else 3
    walls: dict[str, list[float]] = {scope: [] for scope in MARKERS}
    progress(f"shared clusters: emulator with 3 nodes, {TESTS} tests x {reps} rep(s), scope=module vs per test")
    with tempfile.TemporaryDirectory(prefix="pytest-sky-bench-shared-") as tmp, Emulator(nodes=3) as emu:
        root = Path(tmp)
        files = {}
        for scope, marker in MARKERS.items():
            files[scope] = root / f"test_{scope}_scope.py"
            files[scope].write_text(textwrap.dedent(INNER.format(marker=marker, tests=TESTS)))
        for _ in range(reps):
            for scope, path in files.items():
                walls[scope].append(_pytest_wall(path, emu.kubeconfig_path, root / "home", READY_IMAGE))
    shared, per_test = walls["module"], walls["function"]
    ratio = median(per_test) / median(shared) if shared and per_test else None
    return [
        Figure(
            section=SECTION,
            name=f'{TESTS} multinode tests, scope="module" (one 2-node cluster): pytest wall',
            unit="s",
            value=median(shared),
            baseline=median(per_test),
            baseline_name="the same tests, a cluster per test",
            samples=shared,
            baseline_samples=per_test,
            note=f"per-test clusters take {ratio:.1f}x as long" if ratio else "",
        ),
        Figure(
            section=SECTION,
            name=f'{TESTS} multinode tests, scope="module": per test',
            unit="s",
            value=median(shared) / TESTS if shared else None,
            baseline=median(per_test) / TESTS if per_test else None,
            baseline_name="a cluster per test",
        ),
    ]
