"""The client side of a run: one exec of the agent on the head, its events turned into results.

The agent (``agent.py``) does the fan-out on the head; this module only sends the spec,
streams the events and builds the :class:`RunResult` of the public contract.  Closing the
channel is the agent's signal to stop every rank, which is how timeouts and Ctrl-C stop
remote work.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pytest_sky.agent import encode_spec, line_prefix
from pytest_sky.errors import RunError, RunTimeoutError

if TYPE_CHECKING:
    import paramiko

log = logging.getLogger(__name__)


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str  # this rank's own lines, no prefix (setup and run)
    name: str = ""
    ip: str = ""
    pid: int = 0


@dataclass
class RunResult:
    returncode: int  # 0 iff every rank returned 0
    output: str  # the prefixed, merged log, in arrival order
    ranks: list[RankResult] = field(default_factory=list)
    job_id: int = 0
    task_id: str = ""
    error: str | None = None  # which rank failed and how, when one did
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def __str__(self) -> str:
        status = "ok" if self.ok else f"failed: {self.error or self.returncode}"
        return f"RunResult(job {self.job_id}, {status})"


class _Collector:
    def __init__(self, spec: dict, on_line: Callable[[str], None] | None) -> None:
        self.spec = spec
        self.on_line = on_line
        self.pids: dict[int, int] = {}
        self.lines: list[str] = []
        self.per_rank: dict[int, list[str]] = {n["rank"]: [] for n in spec["nodes"]}
        self.done: dict | None = None
        self.job_id = 0
        self.task_id = ""

    def feed(self, raw: bytes) -> None:
        event = json.loads(raw)
        kind = event.get("e")
        if kind == "l":
            rank = event["r"]
            node = self.spec["nodes"][rank]
            prefix = line_prefix(
                rank, node["name"], self.pids.get(rank, 0), node["ip"], self.spec["num_nodes"], self.spec["task_name"]
            )
            line = prefix + event["t"]
            self.lines.append(line)
            self.per_rank[rank].append(event["t"])
            if self.on_line is not None:
                self.on_line(line)
        elif kind == "start":
            self.pids[event["rank"]] = event["pid"]
        elif kind == "job":
            self.job_id, self.task_id = event["id"], event["task_id"]
        elif kind == "done":
            self.done = event

    def result(self, seconds: float) -> RunResult:
        assert self.done is not None
        codes = self.done.get("codes") or []
        ranks = []
        for node in self.spec["nodes"]:
            r = node["rank"]
            text = "\n".join(self.per_rank[r])
            ranks.append(
                RankResult(
                    rank=r,
                    returncode=codes[r] if r < len(codes) else 0,
                    stdout=text + ("\n" if text else ""),
                    name=node["name"],
                    ip=node["ip"],
                    pid=self.pids.get(r, 0),
                )
            )
        output = "\n".join(self.lines) + ("\n" if self.lines else "")
        return RunResult(
            returncode=self.done["returncode"],
            output=output,
            ranks=ranks,
            job_id=self.job_id,
            task_id=self.task_id,
            error=self.done.get("error"),
            seconds=seconds,
        )

    def partial(self) -> str:
        return "\n".join(self.lines)


def run(
    client: paramiko.SSHClient,
    spec: dict,
    *,
    python: str,
    agent_path: str,
    timeout: float | None = None,
    on_line: Callable[[str], None] | None = None,
) -> RunResult:
    """Execute ``spec`` through the agent on the head and wait for every rank."""
    transport = client.get_transport()
    if transport is None or not transport.is_active():
        raise RunError("the connection to the head is closed")
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    chan = transport.open_session()
    try:
        chan.exec_command(f"{python} -I -S {agent_path} run")
        chan.sendall(encode_spec(spec))
        collector = _Collector(spec, on_line)
        buf = b""
        while collector.done is None:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RunTimeoutError(
                        f"run on cluster {spec['cluster']} did not finish within {timeout:g} s; every rank was stopped",
                        partial_output=collector.partial(),
                    )
                chan.settimeout(min(left, 1.0))
            else:
                chan.settimeout(1.0)
            try:
                chunk = chan.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line:
                    collector.feed(line)
        if collector.done is None:
            err = _stderr(chan)
            raise RunError(
                f"the agent on the head of {spec['cluster']} ended without a result"
                + (f": {err}" if err else " (connection lost?)")
            )
        return collector.result(time.monotonic() - started)
    finally:
        chan.close()


def _stderr(chan: paramiko.Channel) -> str:
    try:
        chan.settimeout(1.0)
        data = b""
        while chan.recv_stderr_ready():
            data += chan.recv_stderr(65536)
        lines = data.decode("utf-8", "replace").strip().splitlines()
        return lines[-1] if lines else ""
    except Exception:  # noqa: BLE001 - diagnostics only
        return ""


def agent_call(
    client: paramiko.SSHClient,
    args: list[str],
    *,
    python: str,
    agent_path: str,
    stdin: bytes | None = None,
    timeout: float = 60.0,
) -> tuple[int, bytes]:
    """One short agent command on the head (jobs, wait, logs, cancel); returns (exit code, stdout)."""
    import shlex

    transport = client.get_transport()
    if transport is None or not transport.is_active():
        raise RunError("the connection to the head is closed")
    chan = transport.open_session()
    try:
        chan.settimeout(timeout)
        chan.exec_command(" ".join([python, "-I", "-S", agent_path, *(shlex.quote(a) for a in args)]))
        if stdin is not None:
            chan.sendall(stdin)
        chan.shutdown_write()
        out = b""
        try:
            while True:
                chunk = chan.recv(65536)
                if not chunk:
                    break
                out += chunk
        except TimeoutError:
            raise RunTimeoutError(f"agent command {args[0]} on the head did not answer within {timeout:g} s") from None
        return chan.recv_exit_status(), out
    finally:
        chan.close()


def agent_stream(client: paramiko.SSHClient, args: list[str], *, python: str, agent_path: str) -> Iterator[str]:
    """Lines of a long-running agent command (``logs ID follow``), as they come."""
    import shlex

    transport = client.get_transport()
    if transport is None or not transport.is_active():
        raise RunError("the connection to the head is closed")
    chan = transport.open_session()
    try:
        chan.exec_command(" ".join([python, "-I", "-S", agent_path, *(shlex.quote(a) for a in args)]))
        chan.shutdown_write()
        buf = b""
        while True:
            chunk = chan.recv(65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield line.decode("utf-8", "replace")
        if buf:
            yield buf.decode("utf-8", "replace")
    finally:
        chan.close()


def result_from_events(events: bytes, seconds: float = 0.0) -> RunResult | None:
    """Rebuild a job's RunResult from ``agent.py events`` (None while it has not finished)."""
    lines = [line for line in events.splitlines() if line.strip()]
    if not lines:
        return None
    first = json.loads(lines[0])
    if first.get("e") != "spec":
        return None
    collector = _Collector(first["spec"], None)
    for line in lines[1:]:
        collector.feed(line)
    return collector.result(seconds) if collector.done is not None else None
