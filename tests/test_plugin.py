"""The plugin's own behaviour, seen the way a user sees it: through pytest runs (``pytester``).

Runs that launch clusters go through ``runpytest_subprocess`` (a fresh interpreter, nothing
shared with this session); each test gets a private ``PYTEST_SKY_HOME`` under ``pytester.path``
and checks afterwards that nothing of its clusters is left on the machine: no record, no
``psky*`` link of theirs, no process whose command line names their state directory.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import pytest_sky
from tests.leftovers import processes_mentioning
from tests.plugin_helpers import (
    RECORDER,
    assert_no_traceback,
    assert_nothing_left,
    link_names,
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


# ----------------------------------------------------------------------------- keep-clusters


@needs_local_backend
def test_keep_clusters_leaves_the_cluster_up_and_says_how_to_reach_it(
    pytester: pytest.Pytester, sky_home: Path
) -> None:
    pytester.makepyfile(
        test_inner=RECORDER
        + textwrap.dedent(
            """
            import pytest

            @pytest.mark.multinode
            def test_kept(sky_cluster):
                record(sky_cluster, "kept")
            """
        )
    )
    result = pytester.runpytest_subprocess("--keep-clusters")
    result.assert_outcomes(passed=1)
    info = recorded(pytester)["kept"]
    name = info["name"]
    try:
        ssh_config = sky_home / "clusters" / name / "ssh_config"
        result.stdout.fnmatch_lines(
            [
                "*pytest-sky: kept clusters*",
                f"{name}: 2 node(s)*ssh -F {ssh_config} {name}*pytest-sky down {name}*",
            ]
        )
        assert (sky_home / "clusters" / name / "record.json").exists()
        assert set(info["links"]) <= link_names()
        # What the summary promises works after the run has ended.
        ssh = subprocess.run(
            ["ssh", "-F", str(ssh_config), name, "hostname"], capture_output=True, text=True, timeout=30, check=False
        )
        assert (ssh.returncode, ssh.stdout.strip()) == (0, f"{name}-head"), ssh.stderr
    finally:
        pytest_sky.get_cluster(name).down()
    assert_nothing_left(sky_home, [info])


@needs_local_backend
def test_keep_clusters_summary_under_xdist(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner="""
        import pytest

        @pytest.mark.multinode
        def test_kept(sky_cluster):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-n", "2", "--keep-clusters")
    result.assert_outcomes(passed=1)  # the kept cluster is removed by the sky_home fixture
    result.stdout.fnmatch_lines(["*pytest-sky: kept clusters*", "sky-kept-*ssh -F *pytest-sky down sky-kept-*"])


# ------------------------------------------------------------------------------------- reaper


@needs_local_backend
def test_next_run_reaps_clusters_of_a_killed_run(pytester: pytest.Pytester, sky_home: Path) -> None:
    out = pytester.path / "out"
    fifo = pytester.path / "never-written"
    os.mkfifo(fifo)
    killed = pytester.makepyfile(
        test_killed=RECORDER
        + textwrap.dedent(
            f"""
            import pytest

            @pytest.mark.multinode(num_nodes=2)
            def test_blocks(sky_cluster):
                record(sky_cluster, "killed")
                with open({str(fifo)!r}) as f:  # blocks: nobody ever opens it for writing
                    f.read()
            """
        )
    )
    log = pytester.path / "killed.log"
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                f"--basetemp={pytester.path / 'tmp-killed'}",
                str(killed),
            ],
            cwd=pytester.path,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while not (out / "killed.json").exists():
            assert proc.poll() is None, f"the inner run ended early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no cluster within 60 s:\n{log.read_text()}"
            time.sleep(0.02)  # polling interval while watching for the file, not a readiness guess
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    info = recorded(pytester)["killed"]
    name = info["name"]
    journal = json.loads((sky_home / "clusters" / name / "backend.json").read_text())
    links = [journal["bridge"], *journal["veths"]]
    assert sorted(links) == sorted(info["links"])
    # The owner is gone; its cluster is not.
    assert set(links) <= link_names()
    assert processes_mentioning(f"{sky_home}/clusters/{name}/")

    after = pytester.makepyfile(test_after="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess(str(after))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"pytest-sky: reaped 1 cluster(s) left by a killed run: {name}"])
    assert_nothing_left(sky_home, [info])


# -------------------------------------------------------------------------------------- xdist


@needs_local_backend
def test_cluster_names_and_subnets_are_unique_under_xdist(pytester: pytest.Pytester, sky_home: Path) -> None:
    pytester.makepyfile(
        test_inner=RECORDER
        + textwrap.dedent(
            """
            import time
            import pytest

            @pytest.mark.multinode
            @pytest.mark.parametrize("i", range(4))
            def test_trivial(sky_cluster, i):
                up = time.time()
                assert sky_cluster.run("hostname").returncode == 0
                # Rendezvous: hold this cluster until the other worker has one up too, so that
                # at least two clusters provably live at the same time.
                me = os.environ["PYTEST_XDIST_WORKER"]
                out = Path(os.environ["SKY_TEST_OUT"])
                (out / f"up-{me}-{i}").touch()
                deadline = time.monotonic() + 30
                while not [p for p in out.glob("up-*") if not p.name.startswith(f"up-{me}-")]:
                    assert time.monotonic() < deadline, "the other xdist worker brought no cluster up"
                    time.sleep(0.01)  # polling interval while watching for the file
                record(sky_cluster, f"t{i}", up=up)
            """
        )
    )
    result = pytester.runpytest_subprocess("-n", "2")
    result.assert_outcomes(passed=4)
    infos = list(recorded(pytester).values())
    assert len(infos) == 4
    names = [i["name"] for i in infos]
    assert len(set(names)) == 4, names
    assert {i["worker"] for i in infos} == {"gw0", "gw1"}, infos
    for info in infos:
        assert re.search(rf"-{info['worker']}-", info["name"]), info
    for a, b in itertools.combinations(infos, 2):
        alive_together = a["up"] <= b["time"] and b["up"] <= a["time"]
        if alive_together:  # a subnet may be reused once its cluster is gone, never while it lives
            assert not set(a["node_ips"]) & set(b["node_ips"]), (a, b)
    assert any(a["up"] <= b["time"] and b["up"] <= a["time"] for a, b in itertools.combinations(infos, 2)), (
        "no two clusters were up at the same time: -n 2 did not run them in parallel"
    )
    assert_nothing_left(sky_home, infos)


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
