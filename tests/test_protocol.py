"""The typed protocol between the client and the agent, and the agent's bundle.

Every event and the run spec survive their wire forms; a kind this side does not know is
skipped, a line that is no event is an error; the bundle is the same bytes for the same
code, runs under ``python -I -S`` (also on a python that cannot read its bytecode), and its
attached run never imports ``json``.  ``job`` and ``runner`` talk to the agent without
knowing ``cluster``.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pytest_sky import bootstrap, protocol
from pytest_sky.errors import RunError
from pytest_sky.protocol import JobStatus, NodeRef, RunSpec, decode_event, encode_spec
from pytest_sky.runner import _Collector, result_from_events

PACKAGE = Path(protocol.__file__).parent
AWKWARD = 'quote " backslash \\ tab \t bell \x07 nul \x00 del \x7f é 日本 🚀 </script>'


def spec() -> RunSpec:
    return RunSpec(
        cluster="dev",
        task_name="train",
        nodes=[
            NodeRef(0, "head", "10.0.0.1", "10.0.0.1", env={"CUDA_VISIBLE_DEVICES": "0"}),
            NodeRef(1, "worker1", "10.0.0.2", "10.0.0.2"),
        ],
        run="echo run",
        setup="echo setup",
        env={"A": AWKWARD, "PYTHONUNBUFFERED": "1"},
        cwd="~/sky_workdir",
        gpus_per_node=1,
        cluster_info={"cluster_name": "dev", "cloud": "local", "region": "local", "zone": None},
    )


EVENTS = [
    protocol.JobEvent(7, "sky-2025-01-01-00-00-00-000000_dev_7"),
    protocol.PhaseEvent("setup"),
    protocol.StartEvent(1, 4242, "run"),
    protocol.LineEvent(0, AWKWARD),
    protocol.LineEvent(1, ""),
    protocol.ExitEvent(1, 137, "run", 1735689600.123),
    protocol.DoneEvent(1, JobStatus.FAILED, "run failed on rank 1 (worker1, 10.0.0.2) with exit code 137", [0, 137]),
    protocol.DoneEvent(0, JobStatus.SUCCEEDED),
    protocol.SpecEvent(spec()),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_survives_its_wire_form(event: protocol.Event) -> None:
    raw = event.encode()
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1  # one line, whatever the text holds
    assert json.loads(raw)["e"] == event.KIND
    assert decode_event(raw) == event


def test_every_kind_of_event_is_known_and_tested() -> None:
    assert (
        set(protocol.EVENTS) == {type(e).KIND for e in EVENTS} == {"job", "phase", "start", "l", "exit", "done", "spec"}
    )


def test_an_output_line_stays_compact_on_the_wire() -> None:
    assert protocol.LineEvent(2, "hi").encode() == b'{"e":"l","r":2,"t":"hi"}\n'


def test_the_run_spec_survives_marshal_and_json() -> None:
    original = spec()
    assert protocol.decode_spec(encode_spec(original)) == original
    # Detached jobs: the agent writes spec.json with protocol.to_json, ``events`` splices it unparsed.
    line = protocol.SpecEvent.encode_raw(protocol.to_json(original.to_wire()).encode())
    assert decode_event(line) == protocol.SpecEvent(original)
    assert original.num_nodes == 2


def test_the_spec_carries_only_what_the_agent_reads() -> None:
    assert set(spec().to_wire()) == {
        "cluster",
        "task_name",
        "nodes",
        "run",
        "setup",
        "env",
        "cwd",
        "gpus_per_node",
        "cluster_info",
        "cpus_per_node",  # the job queue's
        "node_cpus",
        "gpu_share",
        "node_gpus",
        "secrets",  # to the agent only: see the next test
    }
    # A spec.json with keys this side does not know (an older agent's) still reads.
    wire = {**spec().to_wire(), "python": "python3", "agent_path": "~/.sky/agent.py", "num_nodes": 2}
    assert RunSpec.from_wire(wire) == spec()


def test_a_secret_reaches_the_agent_and_no_record_or_repr() -> None:
    canary = "canary-" + "x" * 20
    with_secret = RunSpec.from_wire({**spec().to_wire(), "secrets": {"TOKEN": canary}})
    assert protocol.decode_spec(encode_spec(with_secret)).secrets == {"TOKEN": canary}
    kept = protocol.to_json(with_secret.to_record())
    assert canary not in kept and json.loads(kept)["secrets"] == {"TOKEN": "***"}
    assert canary not in protocol.SpecEvent(with_secret).encode().decode()
    assert canary not in repr(with_secret) and "TOKEN" in repr(with_secret)
    assert repr(spec()).startswith("RunSpec(cluster='dev', task_name='train', nodes=[NodeRef(rank=0")


def test_a_cut_spec_is_an_error() -> None:
    with pytest.raises(EOFError):
        protocol.decode_spec(encode_spec(spec())[:-3])


def test_job_records_survive_their_wire_form() -> None:
    records = [
        protocol.JobRecord(1, JobStatus.SUCCEEDED, task_id="t1", name="train", pid=9, returncode=0, ended=2.5),
        protocol.JobRecord(2, JobStatus.PENDING, submitted=1.0),
    ]
    raw = protocol.encode_records([*records, None]).encode()
    assert protocol.decode_records(raw) == records
    assert all(isinstance(r.status, JobStatus) for r in protocol.decode_records(raw))
    assert json.loads(records[0].encode())["status"] == "SUCCEEDED"


def test_an_unknown_kind_is_skipped_and_garbage_is_an_error() -> None:
    assert decode_event(b'{"e":"progress","pct":50}') is None  # a newer agent's kind
    for garbage in (b"not json", b"[1, 2]", b'{"no":"kind"}', b'{"e":"l","r":0}'):
        with pytest.raises(ValueError):
            decode_event(garbage)


def test_the_collector_skips_unknown_kinds_and_names_garbage() -> None:
    events = b"".join(
        [
            protocol.SpecEvent(spec()).encode(),
            protocol.JobEvent(3, "task-3").encode(),
            b'{"e":"progress","pct":50}\n',
            protocol.StartEvent(1, 77, "run").encode(),
            protocol.LineEvent(1, "hello").encode(),
            protocol.DoneEvent(0, JobStatus.SUCCEEDED, None, [0, 0]).encode(),
        ]
    )
    result = result_from_events(events)
    assert result is not None and result.job_id == 3 and result.returncode == 0
    assert result.output == "(worker1, rank=1, pid=77, ip=10.0.0.2) hello\n"
    assert [r.stdout for r in result.ranks] == ["", "hello\n"]
    with pytest.raises(RunError, match="cannot read"):
        _Collector(spec(), None).feed(b"Traceback (most recent call last):")


def test_to_json_writes_what_json_reads() -> None:
    value = {"a": [1, 2.5, None, True, False], "b": AWKWARD, "c": {"d": JobStatus.RUNNING}}
    assert json.loads(protocol.to_json(value)) == json.loads(json.dumps(value))


def test_job_status_is_one_enum_everywhere() -> None:
    from pytest_sky import job

    assert job.JobStatus is JobStatus
    assert str(JobStatus.CANCELLED) == "CANCELLED" and JobStatus("RUNNING") == "RUNNING"
    assert [s for s in JobStatus if s.is_terminal] == [JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED]
    assert "FAILED" in protocol.TERMINAL and "PENDING" in protocol.LIVE  # records' plain strings too


# ---------------------------------------------------------------------------- imports


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (TYPE_CHECKING blocks and functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module == "pytest_sky":
                found |= {f"pytest_sky.{a.name}" for a in node.names}
    return found


def test_job_and_runner_do_not_know_the_cluster() -> None:
    """``Job`` talks to the agent through ``runner.AgentClient``: no circle through ``cluster``."""
    assert "pytest_sky.cluster" not in _imports(PACKAGE / "job.py")
    assert not {"pytest_sky.cluster", "pytest_sky.job"} & _imports(PACKAGE / "runner.py")


def test_the_bundle_holds_every_project_module_the_agent_imports() -> None:
    bundled = {f"pytest_sky.{m}" for m in bootstrap.AGENT_MODULES}
    for module in bootstrap.AGENT_MODULES:
        imported = {m for m in _imports(PACKAGE / bootstrap.module_path(module)) if m.startswith("pytest_sky")}
        assert imported <= bundled | {"pytest_sky"}, module
    assert {m for m in _imports(PACKAGE / "protocol.py") if m.startswith("pytest_sky")} == set()


def _imported(importtime_report: bytes) -> set[str]:
    """The modules a ``python -X importtime`` run imported, from its report on stderr."""
    return {line.rsplit("|", 1)[-1].strip() for line in importtime_report.decode().splitlines()}


def test_protocol_imports_only_enum() -> None:
    """Run as ``python -I -S`` inside the agent: no json, re, typing or dataclasses on import."""
    code = f"import sys; sys.path.insert(0, {str(PACKAGE)!r}); import protocol"
    out = subprocess.run([sys.executable, "-I", "-S", "-X", "importtime", "-c", code], capture_output=True, check=True)
    imported = _imported(out.stderr)
    assert not imported & {"json", "re", "typing", "dataclasses", "inspect"}, imported
    assert "protocol" in imported and "enum" in imported


# ---------------------------------------------------------------------------- the bundle


def test_the_bundle_is_the_same_bytes_for_the_same_code() -> None:
    code = (
        "import hashlib; from pytest_sky import bootstrap; print(hashlib.sha256(bootstrap.agent_bundle()).hexdigest())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert digests == {hashlib.sha256(bootstrap.agent_bundle()).hexdigest()}
    assert bootstrap.agent_bundle() is bootstrap.agent_bundle()  # built once a process
    names = zipfile.ZipFile(io.BytesIO(bootstrap.agent_bundle())).namelist()
    assert names == sorted(names) and "__main__.py" in names
    assert zipfile.ZipFile(io.BytesIO(bootstrap.agent_bundle())).read("pytest_sky/__init__.py") == b""


def _bundle(tmp_path: Path, *, foreign_bytecode: bool = False) -> Path:
    """The bundle on disk; with ``foreign_bytecode``, as a python of another version sees it."""
    data = bootstrap.agent_bundle()
    if foreign_bytecode:
        src = zipfile.ZipFile(io.BytesIO(data))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as dst:
            for info in src.infolist():
                member = src.read(info)
                dst.writestr(info, b"\x00\x00\r\n" + member[4:] if info.filename.endswith(".pyc") else member)
        data = out.getvalue()
    path = tmp_path / "agent.pyz"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("foreign_bytecode", [False, True], ids=["same-python", "other-python"])
def test_the_bundle_runs_isolated(tmp_path: Path, foreign_bytecode: bool) -> None:
    path = _bundle(tmp_path, foreign_bytecode=foreign_bytecode)
    out = subprocess.run([sys.executable, "-I", "-S", str(path), "nonsense"], capture_output=True, text=True, cwd="/")
    assert out.returncode == 2
    assert out.stderr.startswith("usage: agent.pyz run|submit|serve|jobs"), out.stderr


def test_the_attached_run_imports_no_json(tmp_path: Path) -> None:
    """``run`` on this host's bash as the head of a one-node run, under ``-X importtime``."""
    path = _bundle(tmp_path)
    one = RunSpec(cluster="solo", task_name="t", nodes=[NodeRef(0, "head", "127.0.0.1", "127.0.0.1")], run="echo hi")
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-X", "importtime", str(path), "run"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(encode_spec(one))
    proc.stdin.flush()
    events = []
    for line in proc.stdout:  # the lifeline stays open until the run is done
        events.append(decode_event(line))
        if isinstance(events[-1], protocol.DoneEvent):
            break
    proc.stdin.close()
    imported = _imported(proc.stderr.read())
    assert proc.wait(30) == 0
    assert events[-1] == protocol.DoneEvent(0, JobStatus.SUCCEEDED, None, [0])
    assert protocol.LineEvent(0, "hi") in events
    assert "threading" in imported  # the report is real: the run mode's own imports are in it
    assert not imported & {"json", "json.decoder", "re", "dataclasses", "subprocess"}, sorted(imported)


def test_the_bundle_cache_keeps_the_newest_bundles_and_no_orphaned_half_written_one(tmp_path: Path) -> None:
    """Each version of pytest-sky builds a bundle of its own; the cache must not grow forever."""
    import time

    now = time.time()
    old = [tmp_path / f"agent-{i:016x}.pyz" for i in range(7)]
    for i, path in enumerate(old):
        path.write_bytes(b"x")
        os.utime(path, (now - 1000 + i, now - 1000 + i))
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f"agent-{0:016x}.pyz.{dead.pid}.tmp"
    writing = tmp_path / f"agent-{1:016x}.pyz.{os.getpid()}.tmp"
    orphan.write_bytes(b"half")
    writing.write_bytes(b"half")
    bootstrap.prune_bundles(tmp_path)
    assert sorted(tmp_path.iterdir()) == sorted([*old[-bootstrap.KEPT_BUNDLES :], writing])
