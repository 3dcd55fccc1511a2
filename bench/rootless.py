"""Rootless against root: bring-up and teardown of the same cluster sizes, in one run.

The root side is this process (the benchmark runs as root); the rootless side is a child
running as an unprivileged user (``nobody``, through ``tests/unprivileged.py``, which makes
this checkout and its interpreter reachable to that user).  Each repetition measures every
size as root and then, in one child, as the user, so a burst of load from other work lands
on both sides of a ratio.  The child warms up first (imports, key generation) and prints its
samples as one JSON line; its start is outside every timing.
"""

from __future__ import annotations

import json
import shutil

from bench.records import Figure, Target, median
from bench.sections import ISSUE, Namer, Plan, _timed_launch_down, progress

#: Rootless bring-up and teardown, each against root's (the issue's bound).
RATIO = 1.5
SECTION = "rootless"

_CHILD = """
import json, time
import pytest_sky
from pytest_sky.state import drain_removals
sizes, prefix = {sizes!r}, {prefix!r}
c = pytest_sky.launch(num_nodes=2, name=prefix + "-warm")
c.down()
out = {{}}
for n in sizes:
    drain_removals()
    t0 = time.perf_counter()
    c = pytest_sky.launch(num_nodes=n, name=f"{{prefix}}-n{{n}}")
    t1 = time.perf_counter()
    c.down()
    out[n] = [t1 - t0, time.perf_counter() - t1]
print(json.dumps(out))
"""


def _rootless_samples(sizes: tuple[int, ...], prefix: str) -> dict[int, tuple[float, float]]:
    """(bring-up, teardown) seconds per size, as an unprivileged user."""
    from tests.unprivileged import AS_NOBODY, run_python, world_dir

    home = world_dir("psky-bench-rootless-")
    try:
        proc = run_python(AS_NOBODY, _CHILD.format(sizes=sizes, prefix=prefix), env={"PYTEST_SKY_HOME": str(home)})
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        raise RuntimeError(f"the rootless side failed: {lines[-1] if lines else proc.returncode}")
    return {int(n): (up, down) for n, (up, down) in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def versus_root(plan: Plan, namer: Namer) -> list[Figure]:
    sizes = plan.rootless_sizes
    root: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
    user: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
    for rep in range(plan.bringup_reps):
        progress(f"rootless: rep {rep + 1}/{plan.bringup_reps}, sizes {', '.join(map(str, sizes))}, root then user")
        for n in sizes:
            root[n].append(_timed_launch_down(n, namer(f"root{n}"))[:2])
        for n, sample in _rootless_samples(sizes, namer("user")).items():
            user[n].append(sample)
    figures = []
    for n in sizes:
        for which, word in ((0, "ready"), (1, "teardown")):
            mine, theirs = [s[which] for s in user[n]], [s[which] for s in root[n]]
            figures.append(
                Figure(
                    section=SECTION,
                    name=f"{word} as an ordinary user (rootless), {n} nodes",
                    unit="s",
                    value=median(mine),
                    baseline=median(theirs),
                    baseline_name=f"{word} as root, {n} nodes",
                    targets=[Target(RATIO, ISSUE, on_ratio=True)],
                    samples=mine,
                    baseline_samples=theirs,
                )
            )
    return figures
