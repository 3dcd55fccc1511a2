"""What a hung multinode test's report says (issue 47): the session's default deadline, a
``sky_launch`` task that times out, and pytest-timeout firing first all end with where every
rank was, in the terminal, the JUnit XML and the artifacts, before the cluster goes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.plugin_helpers import RECORDER, assert_nothing_left, needs_local_backend, recorded, report_block
from tests.test_artifacts import cases_of, page_text, system_out

INNER = (
    RECORDER
    + '''
import pytest
from pytest_sky import Task

HANG = """cat > ~/hang.py <<'EOF'
import time

def main():
    print("ready", flush=True)
    time.sleep(600)

main()
EOF
[ "$SKYPILOT_NODE_RANK" = 0 ] && exec python3 ~/hang.py; echo "worker done"
"""


@pytest.mark.multinode(num_nodes=2)
def test_default_deadline(sky_cluster):
    record(sky_cluster, "default")
    started = time.monotonic()
    try:
        sky_cluster.run(HANG)
    finally:
        record(sky_cluster, "default", elapsed=time.monotonic() - started)


def test_launched_task(sky_launch):
    sky_launch(Task(run=HANG, num_nodes=2), timeout=6)


@pytest.mark.timeout(8)
@pytest.mark.multinode(num_nodes=2)
def test_pytest_timeout_first(sky_cluster):
    record(sky_cluster, "timeout")
    sky_cluster.run(HANG)  # the session's deadline (15 s) is later than pytest-timeout's
'''
)


@needs_local_backend
def test_a_hung_test_reports_where_every_rank_was_then_its_cluster_goes(
    pytester: pytest.Pytester, inner_sky_home: Path
) -> None:
    pytest.importorskip("pytest_timeout", reason="pip install pytest-timeout (the test extra)")
    pytester.makepyfile(test_inner=INNER)
    art = pytester.path / "art"
    args = ("-p", "timeout", "--sky-run-timeout", "15", "--junitxml=r.xml", f"--sky-artifacts={art}")
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(failed=3)
    out = result.stdout.str()
    assert "run_timeout=15.0 (from --sky-run-timeout)" in out

    # The default deadline applies to a run that names none: the bound is 20 s for 15.
    default = recorded(pytester)["default"]
    assert default["elapsed"] < 20, default
    name = default["name"]
    block = "\n".join(report_block(result, f"sky {name} job 1: where every rank was", "-"))
    assert f"where every rank of job 1 on {name} was at the deadline (15 s):" in block
    assert "rank 0 (head, 198.1" in block and "): running" in block
    assert "main thread: hang.py:5 main: time.sleep(600)\n      waits in time.sleep" in block
    assert "rank 1 (worker1, 198.1" in block and "): exited (0)\n  last lines:\n    | worker done" in block
    assert "    | ready" in block
    xml = system_out(cases_of(pytester.path / "r.xml")["test_default_deadline"])
    assert "where every rank was at the deadline (15 s)" in xml and "waits in time.sleep" in xml
    d = art / "test_inner.py_test_default_deadline" / name
    stacks = (d / "job-1-stacks" / "stacks.txt").read_text()
    assert 'hang.py", line 5 in main\n        time.sleep(600)' in stacks
    assert (d / "job-1-timed-out" / "events.jsonl").exists()
    timeline = page_text(art / "test_inner.py_test_default_deadline" / "timeline.html")
    assert "deadline: still running: rank 0" in timeline, timeline
    summary = json.loads((art / "test_inner.py_test_default_deadline" / "summary.json").read_text())
    assert summary["problems"] == [] and any(j.get("stacks") for c in summary["clusters"] for j in c["jobs"])

    # A launch whose task times out leaves its cluster to the fixture: the report still
    # reaches the head (the job's events), and only then is the cluster torn down.
    launched = report_block(result, "test_launched_task")
    assert any("did not finish within 6 s" in line for line in launched), launched
    (launched_dir,) = [p for p in (art / "test_inner.py_test_launched_task").iterdir() if p.is_dir()]
    assert (launched_dir / "job-1-timed-out" / "events.jsonl").exists()
    assert "time.sleep(600)" in (launched_dir / "job-1-stacks" / "stacks.txt").read_text()

    # pytest-timeout fired first: the same capture, before the test was torn down.
    first = recorded(pytester)["timeout"]["name"]
    block = "\n".join(report_block(result, f"sky {first} job 1: where every rank was", "-"))
    assert "when the wait ended with Failed: Timeout" in block
    assert "main thread: hang.py:5 main: time.sleep(600)" in block
    assert_nothing_left(inner_sky_home, [*recorded(pytester).values(), {"name": launched_dir.name}])
