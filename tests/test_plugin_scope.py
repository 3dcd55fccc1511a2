"""Clusters shared by a scope: ``@pytest.mark.multinode(..., scope="module")`` and its kin.

Seen as a user sees them, through pytest runs of inner test files (``pytester``, as in
``tests/test_plugin.py``, whose helpers and private-state-directory fixture this reuses):
tests of one scope and one shape get one cluster, the next test sees nothing of the previous
one's processes or jobs, the cluster goes when the scope ends, pass, fail or Ctrl-C, and a
failing test's report shows its own ranks' logs only.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests import test_plugin
from tests.plugin_helpers import (
    RECORDER,
    assert_no_traceback,
    assert_nothing_left,
    needs_local_backend,
    recorded,
    report_block,
)

sky_home = test_plugin.sky_home  # autouse: a private state directory, a clean environment, cleanup

# The first test leaves two processes behind on every node: a detached job's `sleep` (what
# `submit` leaves running until cancelled) and a `sleep` that moved itself out of its job's
# cgroup (which the job's own stopping does not see).  It waits for both pid files: a real
# signal that they run.  The second test looks for them on every node.
LEAKER = RECORDER + textwrap.dedent(
    """
    import pytest

    @pytest.mark.multinode(num_nodes=2, scope="module")
    def test_first(sky_cluster):
        record(sky_cluster, "first")
        sky_cluster.submit("sleep 4242 & echo $! > ~/job.pid; wait")
        # A node without cgroups (rootless: none are the user's to give) has none to leave.
        cgroups = sky_cluster.run("[ -w /sys/fs/cgroup/cgroup.procs ] && echo yes || echo no").ranks[0].stdout
        res = sky_cluster.run(
            "[ ! -w /sys/fs/cgroup/cgroup.procs ] || echo $BASHPID > /sys/fs/cgroup/cgroup.procs; "
            "setsid sleep 4343 </dev/null >/dev/null 2>&1 & echo $! > ~/escaped.pid; "
            "while [ ! -s ~/job.pid ]; do sleep 0.05; done",
            timeout=30,
        )
        assert res.returncode == 0, res.output
        alive = sky_cluster.run('for f in job escaped; do [ -e /proc/$(cat ~/$f.pid) ] && echo $f; done')
        escaped = ["escaped"] if cgroups.strip() == "yes" else []
        assert [r.stdout.split() for r in alive.ranks] == [["job", *escaped]] * 2, alive.output

    @pytest.mark.multinode(num_nodes=2, scope="module")
    def test_second(sky_cluster):
        assert sky_cluster.results == [] and sky_cluster.last_result is None
        assert sky_cluster.queue() == []
        res = sky_cluster.run(
            "for f in job escaped; do p=$(cat ~/$f.pid); "
            '[ -e /proc/$p ] && echo "$f $p alive: $(cat /proc/$p/cmdline)"; done; '
            "ps -eo args | grep -c '^sleep 4[23]4[23]$'; true"
        )
        record(sky_cluster, "second", seen=[r.stdout for r in res.ranks])
    """
)


@needs_local_backend
def test_module_scope_shares_one_cluster_and_the_next_test_sees_no_process_of_the_previous(
    pytester: pytest.Pytester, sky_home: Path
) -> None:
    pytester.makepyfile(test_inner=LEAKER)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=2)
    infos = recorded(pytester)
    assert infos["first"]["name"] == infos["second"]["name"]
    # Nothing alive from either pid file, and no `sleep 4242`/`sleep 4343` in any node's process list.
    assert infos["second"]["seen"] == ["0\n", "0\n"], infos["second"]["seen"]
    assert_nothing_left(sky_home, [infos["first"]])


@pytest.mark.long(10)
@needs_local_backend
def test_the_next_test_gets_a_healed_network_and_a_killed_node_means_a_fresh_cluster(
    pytester: pytest.Pytester, sky_home: Path
) -> None:
    pytester.makepyfile(
        test_inner=RECORDER
        + textwrap.dedent(
            """
            import pytest

            shared = pytest.mark.multinode(num_nodes=3, scope="module")

            def probe(cluster, src, dst):
                ip = cluster.node_ips[dst]
                res = cluster.run(
                    f'[ "$SKYPILOT_NODE_RANK" = {src} ] || exit 0; '
                    f"timeout 2 bash -c 'exec 3<>/dev/tcp/{ip}/22' 2>/dev/null && echo open || echo cut",
                    timeout=30,
                )
                return res.ranks[src].stdout.strip()

            @shared
            def test_partitions(sky_cluster):
                record(sky_cluster, "partitioned")
                sky_cluster.partition([0, 1], [2])
                sky_cluster.degrade(1, rate_mbit=10)
                assert probe(sky_cluster, 2, 1) == "cut"

            @shared
            def test_healed(sky_cluster):
                record(sky_cluster, "healed", faults=bool(sky_cluster.network_faults), reach=probe(sky_cluster, 2, 1))

            @shared
            def test_kills_a_node(sky_cluster):
                sky_cluster.kill_node(1)

            @shared
            def test_after_the_kill(sky_cluster):
                record(sky_cluster, "after_kill")
                assert sky_cluster.run("hostname").returncode == 0
            """
        )
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=4)
    infos = recorded(pytester)
    assert infos["partitioned"]["name"] == infos["healed"]["name"]
    assert (infos["healed"]["faults"], infos["healed"]["reach"]) == (False, "open")
    assert infos["after_kill"]["name"] != infos["healed"]["name"]
    result.stdout.fnmatch_lines(["*could not be checked after an earlier test*this test gets a fresh cluster*"])
    assert_nothing_left(sky_home, list(infos.values()))


@needs_local_backend
def test_module_cluster_goes_at_the_module_end_even_when_its_last_test_fails(
    pytester: pytest.Pytester, sky_home: Path
) -> None:
    pytester.makepyfile(
        test_a=RECORDER
        + textwrap.dedent(
            """
            import pytest

            @pytest.mark.multinode(num_nodes=2, scope="module")
            def test_passes(sky_cluster):
                record(sky_cluster, "a_passes")
                sky_cluster.submit("sleep 600")

            @pytest.mark.multinode(num_nodes=2, scope="module")
            def test_fails(sky_cluster):
                record(sky_cluster, "a_fails")
                assert False, "the module's last test fails"
            """
        ),
        test_b=textwrap.dedent(
            """
            import json, os, subprocess
            from pathlib import Path

            def test_after_the_module():
                name = json.loads((Path(os.environ["SKY_TEST_OUT"]) / "a_fails.json").read_text())["name"]
                home = Path(os.environ["PYTEST_SKY_HOME"])
                assert not (home / "clusters" / name).exists()
                bridge = json.loads((Path(os.environ["SKY_TEST_OUT"]) / "a_fails.json").read_text())["links"][0]
                # Asked by exact name: another worker's psky366 must not read as our psky36.
                shown = subprocess.run(["ip", "link", "show", "dev", bridge], capture_output=True, text=True)
                assert shown.returncode != 0, shown.stdout
            """
        ),
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=2, failed=1)
    infos = recorded(pytester)
    assert infos["a_passes"]["name"] == infos["a_fails"]["name"]
    assert_nothing_left(sky_home, list(infos.values()))


@needs_local_backend
def test_module_cluster_goes_on_ctrl_c(pytester: pytest.Pytester, sky_home: Path) -> None:
    pytester.makepyfile(
        test_inner=RECORDER
        + textwrap.dedent(
            """
            import os, signal
            import pytest

            @pytest.mark.multinode(num_nodes=2, scope="module")
            def test_interrupted(sky_cluster):
                record(sky_cluster, "interrupted")
                sky_cluster.submit("sleep 600")
                os.kill(os.getpid(), signal.SIGINT)

            @pytest.mark.multinode(num_nodes=2, scope="module")
            def test_never_runs(sky_cluster):
                pass
            """
        )
    )
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert_nothing_left(sky_home, list(recorded(pytester).values()))


@needs_local_backend
def test_function_scope_is_one_cluster_per_test_as_before(pytester: pytest.Pytester, sky_home: Path) -> None:
    pytester.makepyfile(
        test_inner=RECORDER
        + textwrap.dedent(
            """
            import os
            from pathlib import Path
            import pytest

            @pytest.mark.multinode(num_nodes=2)
            def test_default(sky_cluster):
                record(sky_cluster, "default")

            @pytest.mark.multinode(num_nodes=2, scope="function")
            def test_explicit(sky_cluster):
                record(sky_cluster, "explicit")
                clusters = Path(os.environ["PYTEST_SKY_HOME"]) / "clusters"
                assert sorted(p.name for p in clusters.iterdir()) == [sky_cluster.name]
            """
        )
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=2)
    infos = recorded(pytester)
    assert infos["default"]["name"] != infos["explicit"]["name"]
    assert_nothing_left(sky_home, list(infos.values()))


@needs_local_backend
def test_each_shape_and_scope_gets_its_own_cluster(pytester: pytest.Pytester, sky_home: Path) -> None:
    body = """
        import pytest

        @pytest.mark.multinode(num_nodes=2, scope="module")
        def test_two_nodes(sky_cluster):
            record(sky_cluster, "{m}_two")

        @pytest.mark.multinode(num_nodes=3, scope="module")
        def test_three_nodes(sky_cluster):
            record(sky_cluster, "{m}_three")

        @pytest.mark.multinode(2, scope="module")
        def test_two_nodes_again(sky_cluster):
            record(sky_cluster, "{m}_two_again")

        @pytest.mark.multinode(num_nodes=2, scope="session")
        def test_session(sky_cluster):
            record(sky_cluster, "{m}_session")

        class TestOne:
            @pytest.mark.multinode(num_nodes=2, scope="class")
            def test_a(self, sky_cluster):
                record(sky_cluster, "{m}_one_a")

            @pytest.mark.multinode(num_nodes=2, scope="class")
            def test_b(self, sky_cluster):
                record(sky_cluster, "{m}_one_b")

        class TestTwo:
            @pytest.mark.multinode(num_nodes=2, scope="class")
            def test_a(self, sky_cluster):
                record(sky_cluster, "{m}_two_a")
        """
    pytester.makepyfile(
        test_m1=RECORDER + textwrap.dedent(body).replace("{m}", "m1"),
        test_m2=RECORDER + textwrap.dedent(body).replace("{m}", "m2"),
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=14)
    names = {tag: info["name"] for tag, info in recorded(pytester).items()}
    assert names["m1_session"] == names["m2_session"]
    for m in ("m1", "m2"):
        assert names[f"{m}_two"] == names[f"{m}_two_again"]
        assert names[f"{m}_one_a"] == names[f"{m}_one_b"]
    distinct = {names[f"{m}_{t}"] for m in ("m1", "m2") for t in ("two", "three", "one_a", "two_a")}
    assert len(distinct) == 8 and names["m1_session"] not in distinct, names
    assert recorded(pytester)["m1_three"]["num_nodes"] == 3
    assert_nothing_left(sky_home, list(recorded(pytester).values()))


@needs_local_backend
def test_under_xdist_each_worker_shares_a_cluster_of_its_own(pytester: pytest.Pytester, sky_home: Path) -> None:
    pytester.makepyfile(
        test_inner=RECORDER
        + textwrap.dedent(
            """
            import time
            import pytest

            @pytest.mark.multinode(num_nodes=2, scope="module")
            @pytest.mark.parametrize("i", range(6))
            def test_shared(sky_cluster, i):
                record(sky_cluster, f"t{i}")
                # Rendezvous: wait until the other worker has run a test too, so both provably do.
                me = os.environ["PYTEST_XDIST_WORKER"]
                out = Path(os.environ["SKY_TEST_OUT"])
                (out / f"up-{me}-{i}").touch()
                deadline = time.monotonic() + 60
                while not [p for p in out.glob("up-*") if not p.name.startswith(f"up-{me}-")]:
                    assert time.monotonic() < deadline, "the other xdist worker ran no test"
                    time.sleep(0.01)  # polling interval while watching for the file
            """
        )
    )
    result = pytester.runpytest_subprocess("-n", "2")
    result.assert_outcomes(passed=6)
    infos = list(recorded(pytester).values())
    by_worker: dict[str, set[str]] = {}
    for info in infos:
        by_worker.setdefault(info["worker"], set()).add(info["name"])
    assert sorted(by_worker) == ["gw0", "gw1"], by_worker
    assert all(len(names) == 1 for names in by_worker.values()), by_worker
    assert by_worker["gw0"] != by_worker["gw1"]
    for worker, (name,) in by_worker.items():
        assert f"-{worker}-" in name, name
    assert_nothing_left(sky_home, infos)


@needs_local_backend
def test_failing_test_on_a_shared_cluster_reports_its_own_logs_only(pytester: pytest.Pytester, sky_home: Path) -> None:
    pytester.makepyfile(
        test_inner=RECORDER
        + textwrap.dedent(
            """
            import pytest

            @pytest.mark.multinode(num_nodes=2, scope="module")
            def test_first(sky_cluster):
                record(sky_cluster, "first")
                assert sky_cluster.run("echo first-test-rank-$SKYPILOT_NODE_RANK").returncode == 0

            @pytest.mark.multinode(num_nodes=2, scope="module")
            def test_second(sky_cluster):
                record(sky_cluster, "second")
                assert sky_cluster.run("echo second-test-rank-$SKYPILOT_NODE_RANK").returncode == 0
                assert False, "the second test's own failure"
            """
        )
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*the second test's own failure*",
            "*sky sky-inner-* rank 0 (head*",
            "second-test-rank-0",
            "*sky sky-inner-* rank 1 (worker1*",
            "second-test-rank-1",
        ]
    )
    assert "first-test-rank" not in result.stdout.str()
    infos = recorded(pytester)
    assert infos["first"]["name"] == infos["second"]["name"]
    assert_nothing_left(sky_home, list(infos.values()))


def test_a_bad_scope_is_one_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner="""
        import pytest

        @pytest.mark.multinode(num_nodes=2, scope="modul")
        def test_asks(sky_cluster):
            pass
        """
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(errors=1)
    assert report_block(result, "ERROR at setup of test_asks") == [
        "pytest-sky: multinode() got scope='modul'; use one of 'function', 'class', 'module', 'session' "
        "(e.g. @pytest.mark.multinode(num_nodes=2, scope='module'))"
    ]
    assert_no_traceback(result)
