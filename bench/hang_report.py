"""How long a hung run takes to say where every rank waits: from its deadline to a complete
report (issue 47's bound: 5 s for 8 ranks).

Each rank of an 8-node cluster runs a Python program that sleeps in its own function; the
run has a deadline of :data:`DEADLINE` seconds.  What is timed is what a user waits for after
the deadline: the head asking every node where its job's processes are (one ``agent stacks``:
its own node by looking, the seven workers over head-to-worker ssh, every interpreter's
faulthandler dump), the answer parsed, and the summary rendered.  The floor, measured in the
same loop, is a run that starts a Python interpreter on every rank (``python3 -c pass``):
the least a capture that starts one on every worker could cost.
"""

from __future__ import annotations

import time

from bench.records import Figure, Target, median
from bench.sections import ISSUE, Namer, Plan, cluster, progress

SECTION = "hang report"
NODES = 8
#: The hung run's deadline: long enough for every rank to be asleep in its program by then.
DEADLINE = 3.0
#: The issue's bound on deadline -> complete report, in seconds.
BOUND = 5.0
HANG = """cat > ~/bench_hang.py <<'EOF'
import time

def main():
    print("asleep", flush=True)
    time.sleep(600)

main()
EOF
exec python3 ~/bench_hang.py
"""


def _report_after_deadline(c: object) -> float:
    """Seconds from the run's deadline to its complete report (every rank's stack in it)."""
    from pytest_sky import RunTimeoutError

    try:
        c.run(HANG, timeout=DEADLINE)  # type: ignore[attr-defined]
    except RunTimeoutError as exc:
        summary = exc.capture.summary()  # type: ignore[attr-defined]
        done = time.time()
        deadline = exc.timeline.deadline  # type: ignore[attr-defined]
    else:
        raise RuntimeError("the hung run ended by itself")
    if summary.count("waits in time.sleep") != NODES:
        raise RuntimeError(f"the report lacks a rank's stack:\n{summary}")
    return done - deadline


def _floor(c: object) -> float:
    t0 = time.perf_counter()
    res = c.run("python3 -c pass", timeout=60)  # type: ignore[attr-defined]
    if not res.ok:
        raise RuntimeError(f"python3 -c pass failed: {res.error}")
    return time.perf_counter() - t0


def measure(plan: Plan, namer: Namer) -> list[Figure]:
    reps = 2 if plan.run_reps <= 5 else 5
    ours: list[float] = []
    floor: list[float] = []
    with cluster(NODES, namer("hang")) as c:
        progress(f"hang report: {NODES} nodes, {reps} hung runs (deadline {DEADLINE:g} s) and as many floors")
        _floor(c)  # warm-up: the agent servers start on a cluster's first runs
        _floor(c)
        for _ in range(reps):
            ours.append(_report_after_deadline(c))
            floor.append(_floor(c))
    return [
        Figure(
            section=SECTION,
            name=f"deadline -> complete report (every rank's stack), {NODES} ranks",
            unit="s",
            value=median(ours),
            baseline=median(floor),
            baseline_name="run('python3 -c pass'), same cluster",
            targets=[Target(BOUND, ISSUE)],
            samples=ours,
            baseline_samples=floor,
        )
    ]
