"""The plugin across runs and workers, through pytest runs (``pytester``): a cluster kept
after its run says how to reach it, the next run reaps the clusters of a run that was killed,
and xdist's workers get clusters of distinct names and subnets.  As in ``test_plugin.py``, each
test gets a private ``PYTEST_SKY_HOME`` and checks that nothing of its clusters is left.
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
from tests.leftovers import our_links, processes_mentioning
from tests.plugin_helpers import (
    RECORDER,
    assert_nothing_left,
    link_names,
    needs_local_backend,
    recorded,
)


@pytest.fixture(autouse=True)
def sky_home(inner_sky_home: Path) -> Path:
    return inner_sky_home


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
    links = [journal["bridge"]]  # its link into its namespace (its nodes' links are there)
    assert sorted(links) == sorted(info["links"])
    # The owner is gone; its cluster is not.
    assert set(links) <= link_names()
    assert processes_mentioning(f"{sky_home}/clusters/{name}/")

    # A run that asks for no cluster leaves everything alone (the plugin is silent until asked).
    quiet = pytester.makepyfile(test_quiet="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess(str(quiet))
    result.assert_outcomes(passed=1)
    assert "reaped" not in result.stdout.str()
    assert set(links) <= link_names()
    # The next run that asks for one reaps it first, and says so in its summary.
    after = pytester.makepyfile(
        test_after="import pytest\n\n@pytest.mark.multinode(num_nodes=2)\ndef test_asks(sky_cluster):\n    pass\n"
    )
    result = pytester.runpytest_subprocess(str(after))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"pytest-sky: reaped 1 cluster(s) left by a killed run: {name}"])
    assert_nothing_left(sky_home, [info])


# -------------------------------------------------------------------------------------- xdist


@needs_local_backend
def test_any_run_that_asks_for_a_cluster_removes_a_bridge_a_killed_run_left_elsewhere(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """A run killed with its nodes leaves its bridge, whose alias names a directory of a
    state directory that is gone since (a test's temporary one): the next run that asks for
    a cluster removes it, though its own state directory holds no record."""
    from pytest_sky.backends import clusterns, netns
    from tests.bridges import IP, free_indexes

    gone = tmp_path / "deleted-state" / "clusters" / "killed"  # never made: as if deleted since
    index = free_indexes(1)
    subnet, base = clusterns.subnet_of(index)
    assert netns.create_bridge(IP, clusterns.bridge_name(index), base + "1", 24, subnet, 1500, str(gone))
    try:
        pytester.makepyfile(
            test_asks="import pytest\n\n@pytest.mark.multinode(num_nodes=1)\ndef test_asks(sky_cluster):\n    pass\n"
        )
        result = pytester.runpytest_subprocess()
        result.assert_outcomes(passed=1)
        assert our_links(gone) == []
    finally:
        netns.delete_links(IP, our_links(gone))


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
