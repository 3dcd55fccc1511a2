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
