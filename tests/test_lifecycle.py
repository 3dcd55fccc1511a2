"""The launch's one merge (task, options, defaults) and the one task coercion, shared by API and CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_sky.errors import TaskError
from pytest_sky.lifecycle import plan_launch
from pytest_sky.resources import Resources
from pytest_sky.task import Task, as_task


def test_options_win_over_the_tasks_own_num_nodes_and_resources() -> None:
    task = Task(run="true", num_nodes=3, resources=Resources.from_kwargs(cpus=2))
    merged, n, res = plan_launch(task, 2, Resources.from_kwargs(cpus=4))
    assert n == 2 and merged is not None and merged.num_nodes == 2
    assert res.cpus == Resources.from_kwargs(cpus=4).cpus
    merged, n, res = plan_launch(task, None, Resources())
    assert n == 3 and res.cpus == task.resources.cpus


def test_without_a_task_one_node_and_the_tasks_own_count_check() -> None:
    assert plan_launch(None, None, Resources())[1] == 1
    with pytest.raises(TaskError, match="num_nodes"):
        plan_launch(None, 0, Resources())


def test_as_task_takes_a_task_a_yaml_path_or_a_command(tmp_path: Path) -> None:
    task = Task(run="true")
    assert as_task(task) is task
    path = tmp_path / "t.yaml"
    path.write_text("num_nodes: 2\nrun: echo from-yaml\n")
    for value in (str(path), path):
        loaded = as_task(value)
        assert (loaded.run, loaded.num_nodes) == ("echo from-yaml", 2)
    command = as_task("echo a b.yaml", num_nodes=3)
    assert (command.run, command.num_nodes) == ("echo a b.yaml", 3)
    with pytest.raises(TaskError, match="takes a command string or a Task, got int"):
        as_task(42)


# ------------------------------------------------- the lifecycle on the in-memory backend


def test_a_launch_claims_creates_and_a_down_destroys_and_frees_the_name(memory_backend, home: Path) -> None:
    import pytest_sky
    from pytest_sky.state import ClusterStatus, StateStore

    cluster = pytest_sky.launch(num_nodes=3, name="paper", backend="memory")
    record = StateStore().load("paper")
    assert record is not None and record.status is ClusterStatus.UP and record.backend == "memory"
    assert cluster.node_ips == ["198.19.255.1", "198.19.255.2", "198.19.255.3"]
    assert "Host paper-worker2" in Path(cluster.ssh_config).read_text()
    assert memory_backend.created == ["paper"]
    cluster.down()
    assert memory_backend.destroyed == ["paper"] and StateStore().load("paper") is None
    assert pytest_sky.launch(name="paper", backend="mem").num_nodes == 1  # the name is free again


def test_a_failed_create_destroys_what_it_journaled_and_releases_the_name(memory_backend, home: Path) -> None:
    import pytest_sky
    from pytest_sky.errors import ProvisionError
    from pytest_sky.state import StateStore

    memory_backend.fail_create.add("doomed")
    with pytest.raises(ProvisionError, match="told to fail"):
        pytest_sky.launch(num_nodes=2, name="doomed", backend="memory")
    assert memory_backend.destroyed == ["doomed"]
    assert StateStore().load("doomed") is None and not StateStore().cluster_dir("doomed").exists()


def test_a_taken_name_is_refused_before_anything_is_created(memory_backend, home: Path) -> None:
    import pytest_sky
    from pytest_sky.errors import ProvisionError

    first = pytest_sky.launch(name="taken", backend="memory")
    with pytest.raises(ProvisionError, match="a cluster named 'taken' already exists"):
        pytest_sky.launch(name="taken", backend="memory")
    assert memory_backend.created == ["taken"]
    first.down()


def test_reaping_takes_down_what_a_dead_owner_left_but_never_a_kept_cluster(memory_backend, home: Path) -> None:
    import dataclasses
    import subprocess
    import sys

    import pytest_sky
    from pytest_sky.lifecycle import reap_clusters
    from pytest_sky.state import StateStore

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    store = StateStore()
    for name, keep in (("orphan", False), ("kept", True)):
        pytest_sky.launch(name=name, backend="memory", keep=keep)
        record = store.load(name)
        assert record is not None
        store.save(dataclasses.replace(record, owner_pid=int(dead.stdout), owner_start_time=None))
    assert reap_clusters(store) == ["orphan"]
    assert memory_backend.destroyed == ["orphan"]
    assert [r.name for r in store.records()] == ["kept"]


def test_the_cli_launches_lists_and_downs_on_any_registered_backend(
    memory_backend, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from pytest_sky.cli import main

    assert main(["launch", "-c", "clidev", "--num-nodes", "2", "--backend", "memory"]) == 0
    capsys.readouterr()
    assert main(["status", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["backend"], r["nodes"], r["status"]) for r in rows] == [("clidev", "memory", 2, "UP")]
    assert rows[0]["resources"].startswith("2x Memory"), rows[0]["resources"]
    assert main(["down", "clidev"]) == 0
    assert memory_backend.destroyed == ["clidev"]


def test_the_plugin_gives_each_test_its_own_cluster_and_removes_it(memory_backend, pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner="""
        import pytest

        @pytest.mark.multinode(num_nodes=2)
        def test_one(sky_cluster):
            assert sky_cluster.backend == "memory" and sky_cluster.num_nodes == 2

        @pytest.mark.multinode(num_nodes=3)
        def test_two(sky_cluster):
            assert len(sky_cluster.node_ips) == 3

        @pytest.mark.gpu
        @pytest.mark.multinode(num_nodes=1, gpus="V100:1")
        def test_gpu(sky_cluster):
            pass
        """
    )
    result = pytester.runpytest("--backend", "memory", "-rs")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["*backend=memory (from --backend)*", "*SKIPPED*memory*"])
    assert len(memory_backend.created) == 2 and sorted(memory_backend.destroyed) == sorted(memory_backend.created)
