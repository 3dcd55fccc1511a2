from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from pytest_sky.errors import ResourcesError, TaskError
from pytest_sky.resources import Accelerator, Resources
from pytest_sky.task import Task
from pytest_sky.task_file import MAX_TASK_FILE_BYTES
from tests.unprivileged import AS_NOBODY, run_python, world_dir

# A SkyPilot-style multi-node PyTorch example, as it would be written for `sky launch`.
TORCH_TASK = """\
name: torch-ddp

num_nodes: 2

resources:
  accelerators: V100:0.5
  cpus: 2+

workdir: .

envs:
  MASTER_PORT: 8008
  USE_AMP: true
  MODEL: resnet50

setup: |
  pip install torch torchvision

run: |
  MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)
  torchrun --nnodes=$SKYPILOT_NUM_NODES --node_rank=$SKYPILOT_NODE_RANK \\
    --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT train.py --model $MODEL
"""


def assert_one_line(err: pytest.ExceptionInfo[BaseException], *needles: str) -> str:
    """Errors are printed without a traceback, so the line itself must say it all."""
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- valid task files -----------------------------------------------------------------


def test_torch_example_loads(tmp_path: Path) -> None:
    path = write(tmp_path / "task.yaml", TORCH_TASK)
    task = Task.from_yaml(path)
    assert task.name == "torch-ddp"
    assert task.display_name == "torch-ddp"
    assert task.num_nodes == 2
    assert task.resources == Resources(cpus=2, accelerators=Accelerator("V100", 0.5))
    assert task.resources.gpus_per_node == 1
    assert task.envs == {"MASTER_PORT": "8008", "USE_AMP": "true", "MODEL": "resnet50"}
    assert task.setup == "pip install torch torchvision\n"
    assert task.run is not None
    assert task.run.startswith("MASTER_ADDR=")
    assert "--master_port=$MASTER_PORT" in task.run
    assert task.workdir == str(tmp_path)
    assert task.file_mounts == {}
    assert task.source == str(path)
    assert task.resources.describe(task.num_nodes, "Local") == "2x Local(2CPU--V100:0.5)"


def test_minimal_task_has_defaults() -> None:
    task = Task.from_yaml_str("run: echo hi")
    assert task.run == "echo hi"
    assert task.num_nodes == 1
    assert task.resources == Resources()
    assert task.envs == {}
    assert task.setup is None
    assert task.name is None
    assert task.display_name == "task"
    assert task.workdir is None
    assert task.file_mounts == {}
    assert task.source == "<string>"


def test_setup_only_task_is_valid() -> None:
    task = Task.from_yaml_str("setup: pip install -e .")
    assert task.setup == "pip install -e ."
    assert task.run is None


def test_null_values_mean_defaults() -> None:
    text = "num_nodes:\nresources:\nenvs:\nfile_mounts:\nrun: true && echo ok\n"
    task = Task.from_yaml_str(text)
    assert task.num_nodes == 1
    assert task.resources == Resources()
    assert task.envs == {}
    assert task.file_mounts == {}


@pytest.mark.parametrize(
    ("yaml_value", "expected"),
    [
        ("1", "1"),
        ("1.5", "1.5"),
        ("true", "true"),
        ("false", "false"),
        ("yes", "true"),
        ("'007'", "007"),
        ("hello world", "hello world"),
        ("2024-01-31", "2024-01-31"),
        ('""', ""),
    ],
)
def test_env_values_become_strings(yaml_value: str, expected: str) -> None:
    task = Task.from_yaml_str(f"envs:\n  FOO: {yaml_value}\nrun: env")
    assert task.envs == {"FOO": expected}


def test_utf8_bom_and_unicode_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "task.yaml"
    path.write_bytes("\ufeffname: café\nrun: echo ☕\n".encode())
    task = Task.from_yaml(path)
    assert task.name == "café"
    assert task.run == "echo ☕"


def test_to_dict_round_trips(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    path = write(
        tmp_path / "task.yaml",
        TORCH_TASK + "file_mounts:\n  /data: data\n" + "  ~/cfg.yaml: task.yaml\n" + "  /unused: ./data/../data\n",
    )
    task = Task.from_yaml(path)
    again = Task.from_yaml_str(yaml.safe_dump(task.to_dict()))
    assert again == task
    assert again.to_dict() == task.to_dict()


def test_to_dict_is_yaml_shaped() -> None:
    task = Task(run="echo", num_nodes=3, envs={"A": 1}, resources={"cpus": "4+"})
    assert task.to_dict() == {
        "num_nodes": 3,
        "resources": {"cpus": 4},
        "envs": {"A": "1"},
        "run": "echo",
    }


# --- paths ----------------------------------------------------------------------------


def test_relative_paths_resolve_against_the_task_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "data.csv").write_text("1,2\n")
    path = write(
        project / "task.yaml",
        "workdir: src\nfile_mounts:\n  /data/in.csv: ./data.csv\nrun: ls\n",
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    task = Task.from_yaml(os.path.relpath(path, elsewhere))
    assert task.workdir == str(project / "src")
    assert task.file_mounts == {"/data/in.csv": str(project / "data.csv")}


def test_constructor_resolves_against_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "src").mkdir()
    monkeypatch.chdir(tmp_path)
    task = Task(run="ls", workdir="src", file_mounts={"~/src": Path("src")})
    assert task.workdir == str(tmp_path / "src")
    assert task.file_mounts == {"~/src": str(tmp_path / "src")}


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("workdir: missing", ("workdir", "'missing'", "does not exist")),
        ("workdir: file.txt", ("workdir", "'file.txt'", "directory")),
        ("workdir: ''", ("workdir",)),
        ("workdir: 3", ("workdir", "3")),
        ("file_mounts: {/data: missing}", ("file_mounts['/data']", "'missing'")),
        ("file_mounts: {data: file.txt}", ("file_mounts", "'data'", "~/")),
        ("file_mounts: {~data: file.txt}", ("file_mounts", "'~data'")),
        ("file_mounts: {/data: 's3://bucket'}", ("file_mounts['/data']", "s3://bucket")),
        ("file_mounts: {/data: {source: x}}", ("file_mounts['/data']",)),
        ("file_mounts: {/data: 5}", ("file_mounts['/data']", "5")),
        ("file_mounts: [a, b]", ("file_mounts", "['a', 'b']")),
    ],
)
def test_bad_paths(tmp_path: Path, text: str, needles: tuple[str, ...]) -> None:
    (tmp_path / "file.txt").write_text("x")
    path = write(tmp_path / "task.yaml", text + "\n")
    with pytest.raises(TaskError) as err:
        Task.from_yaml(path)
    message = assert_one_line(err, *needles)
    assert message.startswith(f"{path}: ")


# --- invalid content ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("num_nodes: 0", ("num_nodes", "got 0", "num_nodes: 2")),
        ("num_nodes: -1", ("num_nodes", "-1")),
        ("num_nodes: two", ("num_nodes", "'two'")),
        ("num_nodes: '2'", ("num_nodes", "'2'")),
        ("num_nodes: 2.5", ("num_nodes", "2.5")),
        ("num_nodes: 257", ("num_nodes", "257")),
        ("num_nodes: true", ("num_nodes", "True")),
        ("num_nodes: false", ("num_nodes", "False")),
        ("num_nodes: [2]", ("num_nodes", "[2]")),
        ("envs: {FOO: }", ("envs.FOO", "no value", "env=")),
        ("envs: {FOO: null}", ("envs.FOO", "no value")),
        ("envs: {SKYPILOT_NODE_RANK: 1}", ("envs.SKYPILOT_NODE_RANK", "reserved")),
        ("envs: {1FOO: x}", ("envs", "'1FOO'")),
        ("envs: {MY-VAR: x}", ("envs", "'MY-VAR'")),
        ("envs: {NO: x}", ("envs", "False", "quote")),
        ("envs: {FOO: [1, 2]}", ("envs.FOO", "[1, 2]")),
        ("envs: {FOO: {a: 1}}", ("envs.FOO", "{'a': 1}")),
        ("envs: [FOO, BAR]", ("envs", "['FOO', 'BAR']")),
        ("envs: FOO=1", ("envs", "'FOO=1'")),
        ("run: 42", ("run", "42")),
        ("run: [echo, hi]", ("run", "['echo', 'hi']")),
        ("setup: 1.5", ("setup", "1.5")),
        ("setup: {pip: x}", ("setup",)),
        ("name: ''", ("name", "''")),
        ("name: " + "x" * 64, ("name", "63")),
        ("name: 123", ("name", "123")),
        ("name: [a]", ("name", "['a']")),
        ("nodes: 2", ("unknown key 'nodes' in task", "did you mean 'num_nodes'?")),
        ("env: {A: 1}", ("unknown key 'env'", "did you mean 'envs'?")),
        ("cpus: 2", ("unknown key 'cpus'", "resources")),
        ("service: {}", ("unknown key 'service'", "allowed keys")),
        ("1: x", ("unknown key 1", "allowed keys")),
        ("resources: 4", ("resources", "4")),
        ("resources: {gpus: V100}", ("'gpus'", "resources", "accelerators")),
        ("resources: {accelerators: 'V100:0'}", ("resources.accelerators", "V100:0")),
        ("resources: {accelerators: 'V100:1.5'}", ("resources.accelerators", "1.5")),
        ("resources: {cpus: 0}", ("resources.cpus", "0")),
        ("resources: {memory: -8}", ("resources.memory", "-8")),
        ("resources: {infra: awz}", ("resources.infra", "'awz'", "kubernetes", "did you mean 'aws'?")),
    ],
)
def test_invalid_task_yaml(text: str, needles: tuple[str, ...]) -> None:
    with pytest.raises(TaskError) as err:
        Task.from_yaml_str(text + "\nrun: echo" if not text.startswith("run") else text)
    message = assert_one_line(err, *needles)
    assert message.startswith("<string>: ")


def test_unknown_key_lists_allowed_keys() -> None:
    with pytest.raises(TaskError) as err:
        Task.from_yaml_str("nodes: 2")
    assert_one_line(
        err,
        "unknown key 'nodes' in task; allowed keys: config, envs, file_mounts, name, num_nodes, resources, run, "
        "secrets, setup, workdir",
    )


def test_resource_errors_keep_their_type() -> None:
    with pytest.raises(ResourcesError) as err:
        Task.from_yaml_str("resources: {cpus: 0}", source="t.yaml")
    assert_one_line(err, "t.yaml: resources.cpus")


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("", ("empty",)),
        ("# only a comment\n", ("empty",)),
        ("- run: echo\n", ("mapping", "list")),
        ("just a string\n", ("mapping", "str")),
        ("run: [echo\n", ("invalid YAML", "line 2")),
        ("run: echo\n  num_nodes: 2\nx: : y\n", ("invalid YAML", "line ")),
        ("run: 'unterminated\n", ("invalid YAML", "line ")),
        ("run: a\n---\nrun: b\n", ("invalid YAML", "line 2")),
        ("run: a\nrun: b\n", ("line 2", "duplicate key 'run'")),
        ("envs:\n  A: 1\n  A: 2\nrun: x\n", ("line 3", "duplicate key 'A'")),
        ("run: !!python/object:os.system echo\n", ("invalid YAML", "line 1")),
        ("run: \x00\n", ("invalid YAML",)),
        ("num_nodes: " + "9" * 5000 + "\n", ("invalid YAML",)),
        ("run: " + "[" * 1000 + "\n", ("nested too deeply",)),
    ],
)
def test_malformed_yaml(text: str, needles: tuple[str, ...]) -> None:
    with pytest.raises(TaskError) as err:
        Task.from_yaml_str(text, source="bad.yaml")
    message = assert_one_line(err, *needles)
    assert message.startswith("bad.yaml: ")


@pytest.mark.parametrize(
    "text",
    [
        # the "billion laughs": nine levels of nine aliases each
        "a: &a ['lol','lol','lol','lol','lol','lol','lol','lol','lol']\n"
        + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))
        + "run: echo\n",
        "base: &base {A: 1}\nenvs: *base\n",
        "envs: &e {A: 1}\nrun: echo\n",
        "envs:\n  <<: *undefined\n",
    ],
)
def test_yaml_aliases_are_refused_quickly(text: str) -> None:
    start = time.monotonic()
    with pytest.raises(TaskError) as err:
        Task.from_yaml_str(text)
    assert time.monotonic() - start < 1
    assert_one_line(err, "YAML aliases (&/*) are not supported in task files")


# --- reading files --------------------------------------------------------------------


def test_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TaskError) as err:
        Task.from_yaml("nope/task.yaml")
    assert_one_line(
        err,
        "task file not found: nope/task.yaml",
        f"resolved against the current directory {os.getcwd()}",
    )


def test_directory_is_not_a_task_file(tmp_path: Path) -> None:
    with pytest.raises(TaskError) as err:
        Task.from_yaml(tmp_path)
    assert_one_line(err, str(tmp_path), "directory")


def test_a_file_over_the_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    with open(path, "w") as handle:
        handle.write("run: echo\n# ")
        handle.truncate(MAX_TASK_FILE_BYTES + 1)
    with pytest.raises(TaskError) as err:
        Task.from_yaml(path)
    assert_one_line(err, str(path), "64 MiB")


def test_text_over_the_limit_is_refused() -> None:
    with pytest.raises(TaskError) as err:
        Task.from_yaml_str("run: echo\n# " + "x" * MAX_TASK_FILE_BYTES)
    assert_one_line(err, "64 MiB")


def test_non_utf8_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\nrun: echo\n".encode("latin-1"))
    with pytest.raises(TaskError) as err:
        Task.from_yaml(path)
    assert_one_line(err, str(path), "UTF-8", "0xe9")


def test_syntax_error_in_file_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path / "task.yaml", "run: echo\nenvs:\n  A: [1\n")
    with pytest.raises(TaskError) as err:
        Task.from_yaml(path)
    message = assert_one_line(err, "line 4", "invalid YAML")
    assert message.startswith(f"{path}: ")


def test_content_error_in_file_is_prefixed_with_path(tmp_path: Path) -> None:
    path = write(tmp_path / "task.yaml", "num_nodes: 0\nrun: echo\n")
    with pytest.raises(TaskError) as err:
        Task.from_yaml(path)
    assert_one_line(err, f"{path}: num_nodes must be a whole number between 1 and 256")


def test_unreadable_file_is_a_task_error() -> None:
    """As a user who may not read the file (root reads everything, so run as ``nobody``)."""
    where = world_dir("psky-unreadable-")
    path = write(where / "task.yaml", "run: echo\n")
    path.chmod(0)
    code = (
        "import sys\n"
        "from pytest_sky.errors import TaskError\n"
        "from pytest_sky.task import Task\n"
        "try:\n"
        f"    Task.from_yaml({str(path)!r})\n"
        "except TaskError as e:\n"
        "    print(e)\n"
        "    sys.exit(3)\n"
    )
    try:
        proc = run_python(AS_NOBODY, code)
    finally:
        path.unlink()
        where.rmdir()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 3, f"{path} (mode 000) read as nobody: no TaskError, rc={proc.returncode}\n{output}"
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0], proc.stdout
    assert "Traceback" not in output


# --- constructor and overrides --------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"num_nodes": 0}, "num_nodes"),
        ({"num_nodes": True}, "num_nodes"),
        ({"num_nodes": "2"}, "num_nodes"),
        ({"envs": {"FOO": None}}, "envs.FOO"),
        ({"envs": {"SKYPILOT_X": "1"}}, "envs.SKYPILOT_X"),
        ({"envs": {"A B": "1"}}, "envs"),
        ({"envs": {"A": "x\x00y"}}, "envs.A"),
        ({"run": 1}, "run"),
        ({"setup": b"pip install"}, "setup"),
        ({"name": "x" * 64}, "name"),
        ({"name": "two\nlines"}, "name"),
        ({"resources": "V100"}, "resources"),
        ({"resources": {"cpus": -1}}, "resources.cpus"),
        ({"workdir": "/definitely/not/here"}, "workdir"),
        ({"workdir": "bad\x00path"}, "workdir"),
        ({"file_mounts": {"/x": "/definitely/not/here"}}, "file_mounts['/x']"),
    ],
)
def test_constructor_validates(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(TaskError) as err:
        Task(**kwargs)  # type: ignore[arg-type]
    assert_one_line(err, key)


def test_constructor_accepts_resources_objects_and_dicts() -> None:
    resources = Resources(cpus=2, accelerators=Accelerator("V100", 0.5))
    from_object = Task(run="x", resources=resources)
    from_dict = Task(run="x", resources={"cpus": "2+", "accelerators": "V100:0.5"})
    assert from_object.resources == resources
    assert from_dict == from_object
    assert Task(run="x", num_nodes=None).num_nodes == 1  # type: ignore[arg-type]


def test_equality_ignores_where_the_task_came_from() -> None:
    assert Task.from_yaml_str("run: x", source="a.yaml") == Task(run="x")
    assert Task(run="x") != Task(run="y")
    assert Task(run="x") != Task(run="x", num_nodes=2)


def test_with_overrides_returns_a_new_checked_task() -> None:
    task = Task.from_yaml_str(
        "num_nodes: 2\nenvs: {A: '1', B: '2'}\nresources: {cpus: 2, memory: 8, accelerators: V100:0.5}\nrun: echo\n",
        source="t.yaml",
    )
    changed = task.with_overrides(
        num_nodes=3,
        envs={"B": 20, "C": True},
        resources=Resources(accelerators=Accelerator("A100", 1)),
    )
    assert changed.num_nodes == 3
    assert changed.envs == {"A": "1", "B": "20", "C": "true"}
    assert changed.resources == Resources(cpus=2, memory=8, accelerators=Accelerator("A100", 1))
    assert changed.run == task.run
    assert changed.source == "t.yaml"
    assert changed.resources.describe(3, "Kubernetes") == ("3x Kubernetes(2CPU--8GB--A100:1)")
    # the original is unchanged
    assert task.num_nodes == 2
    assert task.envs == {"A": "1", "B": "2"}
    assert task.resources.accelerators == Accelerator("V100", 0.5)
    assert task.with_overrides() == task


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"num_nodes": 0}, "num_nodes"),
        ({"envs": {"SKYPILOT_X": "1"}}, "envs.SKYPILOT_X"),
        ({"envs": {"FOO": None}}, "envs.FOO"),
        ({"envs": "A=1"}, "envs"),
    ],
)
def test_with_overrides_validates(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(TaskError) as err:
        Task(run="x").with_overrides(**kwargs)  # type: ignore[arg-type]
    assert_one_line(err, key)


def test_secrets_are_envs_whose_values_are_never_shown() -> None:
    task = Task.from_yaml_str("secrets: {HF_TOKEN: hf_s3cr3t}\nrun: echo hi\nconfig: {kubernetes: {}}\n")
    assert task.secrets == {"HF_TOKEN": "hf_s3cr3t"} and task.envs == {}
    assert "hf_s3cr3t" not in repr(task) and "HF_TOKEN" in repr(task)
    assert task.notes == ["task 'task': config has no effect on a pytest-sky cluster"]
    with pytest.raises(TaskError) as err:
        Task.from_yaml_str("secrets: {TOKEN: [hf_s3cr3t]}\nrun: echo hi\n")
    assert_one_line(err, "secrets.TOKEN must be a string, number or boolean, got <hidden>")
    assert "hf_s3cr3t" not in str(err.value)
    merged = task.with_overrides(secrets={"OTHER": "x"})
    assert merged.secrets == {"HF_TOKEN": "hf_s3cr3t", "OTHER": "x"}
