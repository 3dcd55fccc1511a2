"""``sky_cluster_factory``: clusters for a user's own fixtures, of any scope.

Seen as a user sees it, through pytest runs of inner test files (``pytester``, with
``tests/test_plugin.py``'s private state directory and cleanup): a module-scoped fixture
that holds a cluster in a ``with`` block serves its module's tests with one cluster, which
is gone when the module ends, even when its last test fails; a failing test gets the ranks'
lines of its own runs on it; a cluster nobody takes down goes when the session ends.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests import test_plugin
from tests.plugin_helpers import RECORDER, assert_no_traceback, assert_nothing_left, needs_local_backend, recorded

sky_home = test_plugin.sky_home  # autouse: a private state directory, a clean environment, cleanup

#: The docs' example (docs/writing-tests.md, "Your own fixtures"), and three tests on its
#: cluster; the last one fails after a run.
MODULE = RECORDER + textwrap.dedent(
    """
    import pytest

    @pytest.fixture(scope="module")
    def cluster(sky_cluster_factory):
        with sky_cluster_factory(num_nodes=2) as c:
            yield c

    def test_one(cluster):
        record(cluster, "one")
        assert cluster.run("echo first-test-$SKYPILOT_NODE_RANK").returncode == 0

    def test_two(cluster):
        record(cluster, "two")

    def test_three(cluster):
        record(cluster, "three")
        res = cluster.run("[ $SKYPILOT_NODE_RANK = 0 ] || { echo third-out; echo third-err >&2; exit 3; }")
        assert res.returncode == 0, "the module's last test fails"
    """
)

#: Runs after the module above: its cluster is gone by then.
AFTER = textwrap.dedent(
    """
    import json, os, subprocess
    from pathlib import Path

    def test_after_the_module():
        info = json.loads((Path(os.environ["SKY_TEST_OUT"]) / "three.json").read_text())
        assert not (Path(os.environ["PYTEST_SKY_HOME"]) / "clusters" / info["name"]).exists()
        shown = subprocess.run(["ip", "link", "show", "dev", info["links"][0]], capture_output=True, text=True)
        assert shown.returncode != 0, shown.stdout
    """
)


@needs_local_backend
def test_a_module_fixture_serves_three_tests_with_one_cluster_gone_at_the_module_end(
    pytester: pytest.Pytester, sky_home: Path
) -> None:
    pytester.makepyfile(test_a=MODULE, test_b=AFTER)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=3, failed=1)
    infos = recorded(pytester)
    assert infos["one"]["name"] == infos["two"]["name"] == infos["three"]["name"]
    # The failing test's report: its own run's lines, both streams, and not the first test's.
    result.stdout.fnmatch_lines(
        ["*the module's last test fails*", "*sky sky-* rank 1 (worker1, exit 3)*", "third-out", "third-err"]
    )
    assert "first-test-" not in result.stdout.str()
    assert_nothing_left(sky_home, list(infos.values()))


@needs_local_backend
def test_a_cluster_nobody_takes_down_goes_at_the_session_end(pytester: pytest.Pytester, sky_home: Path) -> None:
    pytester.makepyfile(
        test_inner=RECORDER
        + textwrap.dedent(
            """
            import pytest

            @pytest.fixture(scope="session")
            def big(sky_cluster_factory):
                return sky_cluster_factory(3, cpus=1)

            def test_uses(big):
                record(big, "big")
                assert big.num_nodes == 3

            def test_fails_before_the_end(big):
                assert False, "a failure does not keep it"
            """
        )
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, failed=1)
    assert_nothing_left(sky_home, list(recorded(pytester).values()))


def test_the_factory_refuses_a_scope_and_unknown_arguments_in_one_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner=textwrap.dedent(
            """
            def test_scope(sky_cluster_factory):
                sky_cluster_factory(num_nodes=2, scope="module")

            def test_unknown(sky_cluster_factory):
                sky_cluster_factory(num_nodes=2, gpu="A100")
            """
        )
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*pytest-sky: sky_cluster_factory() takes no scope: *a module-scoped fixture*",
            "*pytest-sky: sky_cluster_factory() got unknown argument(s) gpu; allowed: *",
        ]
    )
    assert_no_traceback(result)
