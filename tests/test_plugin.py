"""The plugin's own behaviour, seen the way a user sees it: through pytest runs (``pytester``).

Runs that launch clusters go through ``runpytest_subprocess`` (a fresh interpreter, nothing
shared with this session); each test gets a private ``PYTEST_SKY_HOME`` under ``pytester.path``
and checks afterwards that nothing of its clusters is left on the machine: no record, no
``psky*`` link of theirs, no process whose command line names their state directory.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from tests.plugin_helpers import (
    RECORDER,
    assert_no_traceback,
    assert_nothing_left,
    needs_local_backend,
    recorded,
    report_block,
)

HOST_HAS_GPU = any(Path("/dev").glob("nvidia[0-9]*"))


@pytest.fixture(autouse=True)
def sky_home(inner_sky_home: Path) -> Path:
    return inner_sky_home


# ----------------------------------------------------------------------------------- options


def _option_entries(help_text: str) -> dict[str, str]:
    """``--opt`` -> its help entry with argparse's wrapping undone."""
    entries: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        m = re.match(r"^  (?:-\w, )?(--[\w-]+)", line)
        if m:
            current = m.group(1)
            entries[current] = line.strip()
        elif current is not None and line.startswith("   ") and line.strip():
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def test_help_lists_the_sky_options_with_their_env_twins(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["pytest-sky: multi-node clusters*"])
    entries = _option_entries(result.stdout.str())
    for option, env in [
        ("--backend", "PYTEST_SKY_BACKEND"),
        ("--kubernetes", "PYTEST_SKY_KUBERNETES"),
        ("--kube-context", "PYTEST_SKY_KUBE_CONTEXT"),
        ("--kube-namespace", "PYTEST_SKY_KUBE_NAMESPACE"),
        ("--kube-image", "PYTEST_SKY_KUBE_IMAGE"),
        ("--keep-clusters", "PYTEST_SKY_KEEP_CLUSTERS"),
    ]:
        assert option in entries, f"{option} missing from --help"
        assert env in entries[option], entries[option]
    assert "local" in entries["--backend"] and "kubernetes" in entries["--backend"], entries["--backend"]


def test_markers_are_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    assert result.ret == 0
    for line in [
        "@pytest.mark.multinode(num_nodes=2, gpus=None, cpus=None, memory=None, shared_dir=None, capabilities=None,"
        " privileged=None, scope=*):*",
        "@pytest.mark.kubernetes:*--kubernetes*",
        "@pytest.mark.no_kubernetes:*",
        "@pytest.mark.gpu:*",
    ]:
        result.stdout.fnmatch_lines([line])


def test_dash_k_selects_tests_by_the_marker(pytester: pytest.Pytester) -> None:
    # The file's name must not contain the keyword, or -k would select everything in it.
    pytester.makepyfile(
        test_inner="""
        import pytest

        @pytest.mark.multinode
        def test_bare_marker(sky_cluster):
            pass

        @pytest.mark.multinode(num_nodes=3)
        def test_shaped_marker(sky_cluster):
            pass

        def test_unmarked():
            pass
        """
    )
    result = pytester.runpytest("--collect-only", "-q", "-k", "multinode")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        ["test_inner.py::test_bare_marker", "test_inner.py::test_shaped_marker", "2/3 tests collected (1 deselected)*"]
    )
    result.stdout.no_fnmatch_line("*test_unmarked*")


def test_marker_skips_say_why(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner="""
        import pytest

        @pytest.mark.kubernetes
        def test_kube_only():
            pass

        @pytest.mark.gpu
        def test_needs_gpu():
            pass

        @pytest.mark.no_kubernetes
        def test_not_on_kube(sky_backend):
            assert sky_backend == "local"
        """
    )
    result = pytester.runpytest("-rs")
    result.stdout.fnmatch_lines(["SKIPPED *: runs only on the Kubernetes backend (--kubernetes)"])
    if HOST_HAS_GPU:
        result.assert_outcomes(passed=2, skipped=1)
    else:
        result.stdout.fnmatch_lines(["SKIPPED *: needs a GPU*"])
        result.assert_outcomes(passed=1, skipped=2)


def test_marker_skips_point_at_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner="""
        import pytest

        @pytest.mark.kubernetes
        def test_kube_only():
            pass
        """
    )
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED *test_inner.py:*: *--kubernetes*"])


# ----------------------------------------------------------------------------------- backends


def test_sky_backend_is_local_by_default(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner="""
        def test_backend(sky_backend):
            assert sky_backend == "local"
        """
    )
    pytester.runpytest().assert_outcomes(passed=1)


def test_unknown_backend_in_env_is_a_usage_error(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_inner="def test_nothing():\n    pass\n")
    monkeypatch.setenv("PYTEST_SKY_BACKEND", "bogus")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*PYTEST_SKY_BACKEND*bogus*"])
    assert_no_traceback(result)


def test_kubernetes_env_selects_the_kubernetes_backend(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, sky_home: Path
) -> None:
    pytester.makepyfile(
        test_inner="""
        import pytest

        def test_backend(sky_backend):
            assert sky_backend == "kubernetes"

        @pytest.mark.multinode
        def test_asks_for_a_cluster(sky_cluster):
            pass
        """
    )
    monkeypatch.setenv("PYTEST_SKY_KUBERNETES", "1")
    result = pytester.runpytest_subprocess()
    # The backend is not implemented yet: asking for a cluster errors in setup, saying why.
    result.assert_outcomes(passed=1, errors=1)
    block = report_block(result, "ERROR at setup of test_asks_for_a_cluster")
    assert any(line.startswith("pytest-sky: ") and "kubernetes" in line for line in block), block
    assert_no_traceback(result)
    assert list((sky_home / "clusters").iterdir()) == []


@pytest.mark.parametrize(
    ("env", "marker"),
    [
        pytest.param(
            {"PYTEST_SKY_KUBERNETES": "1"},
            "multinode",
            id="kubernetes",
        ),
        pytest.param({}, "multinode(num_nodes=0)", id="zero-nodes"),
        pytest.param({}, "multinode(nodes=3)", id="unknown-argument"),
        pytest.param(
            {},
            "multinode(3, num_nodes=3)",
            id="count-given-twice",
        ),
    ],
)
def test_cluster_request_errors_are_one_line(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], marker: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    pytester.makepyfile(
        test_inner=f"""
        import pytest

        @pytest.mark.{marker}
        def test_asks(sky_cluster):
            pass
        """
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(errors=1)
    block = report_block(result, "ERROR at setup of test_asks")
    assert len(block) == 1 and block[0].startswith("pytest-sky: "), block
    assert_no_traceback(result)


def test_command_line_backend_wins_over_the_environment(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(
        test_inner="""
        def test_backend(sky_backend):
            assert sky_backend == "local"
        """
    )
    monkeypatch.setenv("PYTEST_SKY_KUBERNETES", "1")
    pytester.runpytest("--backend", "local").assert_outcomes(passed=1)


# ----------------------------------------------------------------------------- failure reports


@needs_local_backend
def test_failure_report_has_each_ranks_log(pytester: pytest.Pytester, sky_home: Path) -> None:
    pytester.makepyfile(
        test_inner=RECORDER
        + textwrap.dedent(
            """
            import pytest

            @pytest.mark.multinode
            def test_fails(sky_cluster):
                record(sky_cluster, "fails")
                res = sky_cluster.run("echo from-rank-$SKYPILOT_NODE_RANK")
                assert res.returncode == 0
                assert False, "the test's own failure"
            """
        )
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*the test's own failure*",
            "*sky sky-* rank 0 (head*",
            "from-rank-0",
            "*sky sky-* rank 1 (worker1*",
            "from-rank-1",
        ]
    )
    assert_nothing_left(sky_home, list(recorded(pytester).values()))


# ----------------------------------------------------------------------------------- teardown


@needs_local_backend
def test_clusters_are_torn_down_after_pass_fail_and_error(pytester: pytest.Pytester, sky_home: Path) -> None:
    pytester.makepyfile(
        test_inner=RECORDER
        + textwrap.dedent(
            """
            import pytest

            @pytest.fixture
            def broken(sky_cluster):
                record(sky_cluster, "error")
                raise RuntimeError("fixture broke after the cluster came up")

            @pytest.mark.multinode
            def test_passes(sky_cluster):
                record(sky_cluster, "pass")

            @pytest.mark.multinode
            def test_fails(sky_cluster):
                record(sky_cluster, "fail")
                assert False

            @pytest.mark.multinode
            def test_errors(broken):
                pass
            """
        )
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, failed=1, errors=1)
    infos = recorded(pytester)
    assert sorted(infos) == ["error", "fail", "pass"]
    assert_nothing_left(sky_home, list(infos.values()))


@needs_local_backend
def test_cluster_is_torn_down_on_ctrl_c(pytester: pytest.Pytester, sky_home: Path) -> None:
    pytester.makepyfile(
        test_inner=RECORDER
        + textwrap.dedent(
            """
            import os, signal
            import pytest

            @pytest.mark.multinode
            def test_interrupted(sky_cluster):
                record(sky_cluster, "interrupted")
                os.kill(os.getpid(), signal.SIGINT)
            """
        )
    )
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*KeyboardInterrupt*"])
    assert_nothing_left(sky_home, list(recorded(pytester).values()))


# ------------------------------------------------------------------------------- marker shape


@needs_local_backend
def test_marker_shapes_the_cluster(pytester: pytest.Pytester, sky_home: Path) -> None:
    pytester.makepyfile(
        test_inner=RECORDER
        + textwrap.dedent(
            """
            import pytest

            @pytest.mark.multinode(num_nodes=3)
            def test_keyword(sky_cluster):
                record(sky_cluster, "keyword")
                res = sky_cluster.run("echo $SKYPILOT_NUM_NODES")
                assert [r.stdout for r in res.ranks] == ["3\\n"] * 3

            @pytest.mark.multinode(3)
            def test_positional(sky_cluster):
                record(sky_cluster, "positional")

            @pytest.mark.multinode(num_nodes=2, shared_dir="/mnt/team")
            def test_shared_dir(sky_cluster):
                sky_cluster.run('[ "$SKYPILOT_NODE_RANK" != 1 ] || echo from-worker > /mnt/team/f')
                assert [r.stdout for r in sky_cluster.run("cat /mnt/team/f").ranks] == ["from-worker\\n"] * 2

            @pytest.mark.multinode(num_nodes=2, capabilities=("NET_ADMIN",))
            def test_capabilities(sky_cluster):
                res = sky_cluster.run("ip link set lo mtu 1500 && cat /sys/class/net/lo/mtu")
                assert [r.stdout for r in res.ranks] == ["1500\\n"] * 2, res.output

            @pytest.mark.multinode(nodes=3)
            def test_unknown_argument(sky_cluster):
                pass

            @pytest.mark.multinode(num_nodes=0)
            def test_zero_nodes(sky_cluster):
                pass
            """
        )
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=4, errors=2)
    assert report_block(result, "ERROR at setup of test_unknown_argument") == [
        "pytest-sky: multinode() got unknown argument(s) nodes; "
        "allowed: capabilities, cpus, gpus, memory, num_nodes, privileged, scope, shared_dir"
    ]
    block = report_block(result, "ERROR at setup of test_zero_nodes")
    assert any(line.startswith("pytest-sky: ") and "num_nodes" in line for line in block), block
    assert_no_traceback(result)
    infos = recorded(pytester)
    assert sorted(infos) == ["keyword", "positional"]
    for info in infos.values():
        assert info["num_nodes"] == 3 and len(info["node_ips"]) == 3, info
    assert_nothing_left(sky_home, list(infos.values()))


# ----------------------------------------------------------------------------- public contract


@needs_local_backend
def test_public_contract_examples_pass_outside_the_repo(pytester: pytest.Pytester, sky_home: Path) -> None:
    task = pytester.path / "task.yaml"
    task.write_text(
        textwrap.dedent(
            """\
            name: contract
            num_nodes: 2
            run: |
              echo "rank $SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES"
            """
        )
    )
    pytester.makepyfile(
        test_contract=f"""
        import pytest

        @pytest.mark.multinode(num_nodes=2)
        def test_node_ips(sky_cluster):
            res = sky_cluster.run('echo "$SKYPILOT_NODE_IPS" | wc -l')
            assert res.returncode == 0
            assert [r.stdout.strip() for r in res.ranks] == ["2", "2"]

        def test_task(sky_launch):
            cluster = sky_launch({str(task)!r}, num_nodes=2)
            assert cluster.last_result.returncode == 0
            assert [r.stdout for r in cluster.last_result.ranks] == ["rank 0 of 2\\n", "rank 1 of 2\\n"]
        """
    )
    assert not list(pytester.path.glob("**/conftest.py"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert list((sky_home / "clusters").iterdir()) == []
