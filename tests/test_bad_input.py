"""Malformed input of every kind gets one clear line and provisions nothing.

The task YAML corpus lives in ``tests/bad_input/`` (each file's first line says what its
message must contain: ``# expect: ...``); the big, binary and non-UTF-8 cases are made at
test time.  Each case goes through the Python API (our exception class) and through the real
``pytest-sky`` console script (exit 2, one ``pytest-sky: error:`` line, no traceback).
Marker arguments go through pytester.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky.errors import SkyError, TaskError
from pytest_sky.task_file import MAX_TASK_FILE_BYTES
from tests.leftovers import our_links

CORPUS = Path(__file__).resolve().parent / "bad_input"
CLI = Path(sys.executable).with_name("pytest-sky")
CORPUS_FILES = sorted(CORPUS.glob("*.yaml"))


def _expected(path: Path) -> str:
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("# expect:"), f"{path.name}: first line must be '# expect: ...'"
    return first.removeprefix("# expect:").strip()


def _generated(tmp_path: Path, case: str) -> tuple[Path, str]:
    """The cases too big or too odd to commit: (path, what the message must contain)."""
    path = tmp_path / f"{case}.yaml"
    if case == "empty_file":
        path.write_bytes(b"")
        return path, "task file is empty"
    if case == "oversized_file":  # sparse: refused by its size before a byte is read
        with open(path, "wb") as handle:
            handle.write(b"run: echo hi\n")
            handle.truncate(MAX_TASK_FILE_BYTES + 1)
        return path, "larger than"
    if case == "binary_garbage":
        path.write_bytes(bytes(range(256)) * 16)
        return path, "not valid UTF-8"
    if case == "non_utf8_latin1":
        path.write_bytes("run: echo caf\xe9\n".encode("latin-1"))
        return path, "not valid UTF-8 (byte 0xe9"
    if case == "nul_byte":
        path.write_bytes(b"run: echo a\x00b\n")
        return path, "invalid YAML"
    if case == "deeply_nested":
        path.write_text("run: " + "[" * 20000 + "]" * 20000 + "\n")
        return path, "nested too deeply"
    if case == "a_directory":
        path.mkdir()
        return path, "is a directory"
    if case == "missing_file":
        return tmp_path / "no" / "such" / "task.yaml", "task file not found"
    raise AssertionError(case)


GENERATED = [
    "empty_file",
    "oversized_file",
    "binary_garbage",
    "non_utf8_latin1",
    "nul_byte",
    "deeply_nested",
    "a_directory",
    "missing_file",
]


@pytest.fixture
def sky_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "skyhome"
    monkeypatch.setenv("PYTEST_SKY_HOME", str(home))
    return home


def assert_nothing_provisioned(home: Path) -> None:
    clusters = home / "clusters"
    records = sorted(p.name for p in clusters.iterdir()) if clusters.is_dir() else []
    assert records == [], records
    assert our_links(home) == []


def assert_one_line(message: str) -> None:
    assert message.strip(), "empty message"
    assert "\n" not in message.strip(), message
    assert "Traceback" not in message


def run_cli(
    home: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "CI": "1", "PYTEST_SKY_HOME": str(home)}
    full_env.pop("PYTEST_ADDOPTS", None)
    full_env.update(env or {})
    return subprocess.run(
        [str(CLI), *args], capture_output=True, text=True, env=full_env, timeout=60, stdin=subprocess.DEVNULL, cwd=cwd
    )


def assert_cli_error(result: subprocess.CompletedProcess[str], expect: str = "", code: int = 2) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("pytest-sky: error: "), lines
    assert expect in lines[0], (expect, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------ task files


def test_corpus_is_big_enough() -> None:
    assert len(CORPUS_FILES) + len(GENERATED) >= 40


@pytest.mark.parametrize("path", CORPUS_FILES, ids=[p.stem for p in CORPUS_FILES])
def test_corpus_file_api(path: Path, sky_home: Path) -> None:
    expect = _expected(path)
    with pytest.raises(TaskError) as info:
        pytest_sky.Task.from_yaml(path)
    message = str(info.value)
    assert_one_line(message)
    assert message.startswith(str(path)), message
    assert expect in message, (expect, message)
    # and launch() refuses it before provisioning anything
    with pytest.raises(TaskError):
        pytest_sky.launch(path, name="bad-input")
    assert_nothing_provisioned(sky_home)


@pytest.mark.parametrize("path", CORPUS_FILES, ids=[p.stem for p in CORPUS_FILES])
def test_corpus_file_cli(path: Path, sky_home: Path) -> None:
    # From the file's directory: the CLI resolves a task's relative paths from the current one, as sky.
    assert_cli_error(run_cli(sky_home, "launch", "-c", "bad-input", str(path), cwd=path.parent), _expected(path))
    assert_nothing_provisioned(sky_home)


@pytest.mark.parametrize("case", GENERATED)
def test_generated_task_file_api(case: str, tmp_path: Path, sky_home: Path) -> None:
    path, expect = _generated(tmp_path, case)
    with pytest.raises(TaskError) as info:
        pytest_sky.launch(path, name="bad-input")
    message = str(info.value)
    assert_one_line(message)
    assert str(path) in message, message
    assert expect in message, (expect, message)
    assert_nothing_provisioned(sky_home)


@pytest.mark.parametrize("case", GENERATED)
def test_generated_task_file_cli(case: str, tmp_path: Path, sky_home: Path) -> None:
    path, expect = _generated(tmp_path, case)
    assert_cli_error(run_cli(sky_home, "launch", "-c", "bad-input", str(path)), expect)
    assert_nothing_provisioned(sky_home)


# ------------------------------------------------------------------------------ API keywords


API_CASES = {
    "num_nodes_zero": {"num_nodes": 0},
    "num_nodes_string": {"num_nodes": "two"},
    "num_nodes_huge": {"num_nodes": 10_000},
    "gpus_abc": {"gpus": "V100:abc"},
    "cpus_abc": {"cpus": "abc"},
    "memory_negative": {"memory": -5},
    "name_bad_for_dns": {"name": "Bad_Name"},
    "name_64_chars": {"name": "a" * 64},
}


@pytest.mark.parametrize("kwargs", API_CASES.values(), ids=API_CASES.keys())
def test_launch_keywords(kwargs: dict, sky_home: Path) -> None:
    with pytest.raises(SkyError) as info:
        pytest_sky.launch(**kwargs)
    assert isinstance(info.value, TaskError), type(info.value)
    assert_one_line(str(info.value))
    assert_nothing_provisioned(sky_home)


# -------------------------------------------------------------------------- marker arguments


MARKER_CASES = {
    "num_nodes_zero": ("multinode(num_nodes=0)", "num_nodes must be"),
    "num_nodes_string": ('multinode(num_nodes="two")', "num_nodes must be"),
    "unknown_nodes_kwarg": ("multinode(nodes=2)", "unknown argument(s) nodes"),
    "gpus_abc": ('multinode(gpus="V100:abc")', "gpus"),
    "num_nodes_twice": ("multinode(2, num_nodes=2)", "takes num_nodes once"),
    "cpus_abc": ('multinode(cpus="abc")', "cpus must be"),
}


@pytest.mark.parametrize(("marker", "expect"), MARKER_CASES.values(), ids=MARKER_CASES.keys())
def test_marker_arguments(
    marker: str, expect: str, pytester: pytest.Pytester, sky_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in list(os.environ):
        if key.startswith("PYTEST_XDIST_"):
            monkeypatch.delenv(key)
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.{marker}
        def test_case(sky_cluster):
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    text = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in text, text
    assert not [line for line in text.splitlines() if line.startswith(("> ", "E "))], text
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if "ERROR at setup of test_case" in line)
    block = []
    for line in lines[start + 1 :]:
        if line.startswith(("___", "===", "---")):
            break
        if line.strip():
            block.append(line)
    assert len(block) == 1, block
    assert "pytest-sky: " in block[0] and expect in block[0], block
    assert_nothing_provisioned(sky_home)


# ----------------------------------------------------------------------------- CLI arguments


CLI_CASES = {
    "name_underscore_uppercase": (["launch", "-c", "Bad_Name", "--", "true"], "invalid cluster name"),
    "name_is_an_option": (["launch", "-c", "-x", "--", "true"], "-c/--cluster"),
    "name_64_chars": (["launch", "-c", "a" * 64, "--", "true"], "invalid cluster name"),
    "name_trailing_dash": (["launch", "-c", "dev-", "--", "true"], "invalid cluster name"),
    "num_nodes_negative": (["launch", "-c", "bad-input", "--num-nodes", "-1", "--", "true"], "--num-nodes"),
    "num_nodes_zero": (["launch", "-c", "bad-input", "--num-nodes", "0", "--", "true"], "--num-nodes"),
    "num_nodes_huge": (["launch", "-c", "bad-input", "--num-nodes", "10000", "--", "true"], "num_nodes"),
    "num_nodes_word": (
        ["launch", "-c", "bad-input", "--num-nodes", "two", "--", "true"],
        "--num-nodes: expected a whole number >= 1, got 'two'",
    ),
    "gpus_abc": (["launch", "-c", "bad-input", "--gpus", "V100:abc", "--", "true"], "gpus"),
    "cpus_abc": (["launch", "-c", "bad-input", "--cpus", "abc", "--", "true"], "cpus must be"),
    "memory_negative": (["launch", "-c", "bad-input", "--memory", "-5", "--", "true"], "memory must be"),
    "missing_task_file": (["launch", "-c", "bad-input", "/nonexistent/task.yaml"], "task file not found"),
    "missing_cluster_option": (["launch", "--", "true"], "-c/--cluster"),
    "unknown_subcommand": (["lanch", "-c", "x"], "invalid choice"),
    "exec_unknown_cluster": (["exec", "no-such-cluster", "--", "true"], "no cluster named 'no-such-cluster'"),
    "logs_unknown_cluster": (["logs", "no-such-cluster"], "no cluster named 'no-such-cluster'"),
    "queue_unknown_cluster": (["queue", "no-such-cluster"], "no cluster named 'no-such-cluster'"),
    "ssh_unknown_cluster": (["ssh", "no-such-cluster"], "no cluster named 'no-such-cluster'"),
    # The same words as an option's: a job id is checked as --num-nodes is.
    "logs_job_zero": (["logs", "no-such-cluster", "0"], "argument JOB: expected a whole number >= 1, got '0'"),
}


@pytest.mark.parametrize(("args", "expect"), CLI_CASES.values(), ids=CLI_CASES.keys())
def test_cli_arguments(args: list[str], expect: str, sky_home: Path) -> None:
    assert_cli_error(run_cli(sky_home, *args), expect)
    assert_nothing_provisioned(sky_home)


def test_cli_non_utf8_task_file(tmp_path: Path, sky_home: Path) -> None:
    path = tmp_path / "task.yaml"
    path.write_bytes(b"run: echo \xff\xfe\n")
    assert_cli_error(run_cli(sky_home, "launch", "-c", "bad-input", str(path)), "not valid UTF-8")
    assert_nothing_provisioned(sky_home)


def test_cli_kubernetes_without_configuration(tmp_path: Path, sky_home: Path) -> None:
    empty_home = tmp_path / "emptyhome"
    empty_home.mkdir()
    env = {"KUBECONFIG": "/nonexistent", "HOME": str(empty_home)}
    full = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    full.update(env, CI="1", PYTEST_SKY_HOME=str(sky_home))
    full.pop("PYTEST_ADDOPTS", None)
    result = subprocess.run(
        [str(CLI), "launch", "--kubernetes", "-c", "bad-input", "--", "true"],
        capture_output=True,
        text=True,
        env=full,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert_cli_error(result, "no Kubernetes configuration")
    assert_nothing_provisioned(sky_home)


# ------------------------------------------------------------------- run(env=...) on a cluster


@pytest.fixture
def one_node(sky_home: Path):
    if os.geteuid() != 0:
        pytest.skip("needs root (namespace nodes)")
    cluster = pytest_sky.launch(num_nodes=1, name="bad-env")
    try:
        yield cluster
    finally:
        cluster.down()


def test_run_env_with_nul_is_refused_by_name(one_node) -> None:
    with pytest.raises(TaskError, match="NUL"):
        one_node.run("true", env={"BAD": "a\x00b"}, timeout=30)
    assert one_node.run("true", timeout=30).returncode == 0


def test_run_env_none_is_refused(one_node) -> None:
    with pytest.raises(TaskError, match="no value"):
        one_node.run('printf %s "$A"', env={"A": None}, timeout=30)
