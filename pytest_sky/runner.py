"""The client's side of the agent: :class:`AgentClient`, and the ``RunResult`` its events make.

A run goes ``Cluster.run`` (builds the :class:`~pytest_sky.protocol.RunSpec`) ->
:meth:`AgentClient.run` (over the cluster's SSH connection, asks the head's agent server for
a run, or execs ``agent.pyz run`` where it has none yet; writes the spec, reads the events)
-> ``agent`` on the head (fans out to every rank) and back: each :mod:`~pytest_sky.protocol`
event goes to its handler in :class:`_Collector`, which builds the :class:`RunResult` of the
public contract.  Closing the channel is the agent's signal to stop every rank, which is how
timeouts and Ctrl-C stop remote work.  Detached jobs (``job.Job``) use the client's other
commands: ``submit``, ``jobs``, ``wait``, ``logs``, ``events``, ``cancel``, ``forget``.
"""

from __future__ import annotations

import logging
import shlex
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from pytest_sky import interrupts
from pytest_sky.diagnosis import KEPT_LINES, Capture, RankState, Target, take, why_stopped
from pytest_sky.errors import RunError, RunTimeoutError
from pytest_sky.naming import line_prefix
from pytest_sky.protocol import (
    AGENT_PORT,
    GREETING,
    STDERR,
    STDOUT,
    DoneEvent,
    Event,
    ExitEvent,
    JobEvent,
    JobRecord,
    LineEvent,
    PhaseEvent,
    RunSpec,
    SpecEvent,
    StartEvent,
    decode_event,
    decode_record,
    decode_records,
    door_answer,
    encode_spec,
    read_greeting,
)

if TYPE_CHECKING:
    import paramiko

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class RankResult:
    """One rank's end and its lines (setup's and run's), without the prefix: ``stdout`` and
    ``stderr`` apart, ``output`` both as they arrived."""

    rank: int
    returncode: int
    stdout: str
    name: str = ""
    ip: str = ""
    pid: int = 0
    stderr: str = ""
    output: str = ""

    def tail(self, lines: int = 10) -> str:
        """The rank's last ``lines`` lines, both streams (what a failure names)."""
        return "\n".join(self.output.splitlines()[-lines:])


@dataclass(frozen=True)
class RankSpan:
    """One rank's phase as the client saw it: when its start and its exit arrived (this
    machine's clock, ``time.time()``)."""

    rank: int
    name: str
    ip: str
    phase: str  # "setup" or "run"
    started: float | None  # None: it never started
    ended: float | None  # None: still running when the run ended (a timeout)
    code: int | None = None


@dataclass(frozen=True)
class Timeline:
    """A run's ranks over time: what a failure's timeline file draws (``pytest_sky.timeline``)."""

    cluster: str
    job_id: int
    started: float
    ended: float
    spans: tuple[RankSpan, ...]
    timed_out: bool = False
    #: When the run's deadline passed, or it was stopped otherwise (None: it ended by itself).
    deadline: float | None = None

    def first_failure(self) -> RankSpan | None:
        """The rank whose phase failed first (by when its exit arrived)."""
        failed = [s for s in self.spans if s.ended is not None and s.code not in (0, None)]
        return min(failed, key=lambda s: s.ended or 0.0) if failed else None


@dataclass(frozen=True)
class StoppedRun:
    """A run or wait that did not end by itself (its deadline, Ctrl-C, a test's own timeout):
    where every rank was then, before anything was stopped, and the run's timeline up to then."""

    capture: Capture
    timeline: Timeline | None


@dataclass
class RunResult:
    returncode: int  # 0 iff every rank returned 0
    output: str  # the prefixed, merged log, in arrival order
    ranks: list[RankResult] = field(default_factory=list)
    job_id: int = 0
    task_id: str = ""
    error: str | None = None  # which rank failed and how, when one did
    seconds: float = 0.0
    #: Each rank's phases, start and end (what a failure's timeline file draws).
    timeline: Timeline | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def check(self) -> RunResult:
        """This result, where every rank returned 0; else :class:`RunFailedError`."""
        if not self.ok:
            raise RunFailedError(self)
        return self

    def failed_rank(self) -> RankResult | None:
        """The rank that failed first (by when its exit arrived), else the first that failed."""
        first = self.timeline.first_failure() if self.timeline is not None else None
        failed = [r for r in self.ranks if r.returncode != 0]
        picked = [r for r in failed if first is not None and r.rank == first.rank]
        return picked[0] if picked else failed[0] if failed else None

    def __str__(self) -> str:
        status = "ok" if self.ok else f"failed: {self.error or self.returncode}"
        return f"RunResult(job {self.job_id}, {status})"


class RunFailedError(RunError):
    """A run whose rank exited non-zero, raised by ``run(..., check=True)``: the message names
    the rank that failed first, its exit code and its last lines; ``result`` is the whole
    :class:`RunResult` (every rank's output)."""

    #: How many of the failed rank's last lines the message carries.
    TAIL_LINES = 10

    def __init__(self, result: RunResult) -> None:
        self.result = result
        cluster = result.timeline.cluster if result.timeline is not None else "the cluster"
        rank = result.failed_rank()
        if rank is None:  # every rank returned 0, yet the run failed: the agent says why
            super().__init__(f"job {result.job_id} on {cluster} failed: {result.error or f'exit {result.returncode}'}")
            return
        where = f"rank {rank.rank} ({rank.name}, {rank.ip})" if rank.name else f"rank {rank.rank}"
        tail = rank.tail(self.TAIL_LINES)
        said = "its last lines:\n" + "\n".join(f"    {line}" for line in tail.splitlines()) if tail else "no output"
        super().__init__(f"job {result.job_id} on {cluster} failed: {where} exited with code {rank.returncode}; {said}")


# ------------------------------------------------------------------------------ events -> result


class _Collector:
    """A run's events, as they come, into its :class:`RunResult`: one handler per kind."""

    def __init__(self, spec: RunSpec, on_line: Callable[[str], None] | None) -> None:
        self.spec = spec
        self.on_line = on_line
        self.pids: dict[int, int] = {}
        self.lines: list[str] = []
        # Each rank's lines: both streams as they came, and each stream's, by its number.
        self.per_rank: dict[int, list[str]] = {n.rank: [] for n in spec.nodes}
        self.streams: dict[tuple[int, int], list[str]] = {
            (n.rank, stream): [] for n in spec.nodes for stream in (STDOUT, STDERR)
        }
        self.done: DoneEvent | None = None
        self.job_id = 0
        self.task_id = ""
        self.started = time.time()
        self.phases: list[str] = []
        # (rank, phase) -> [start, end, code], as the events arrive.
        self._spans: dict[tuple[int, str], list[Any]] = {}
        self._handlers: dict[type[Event | None], Callable[[Any], None]] = {
            LineEvent: self._on_line,
            StartEvent: self._on_start,
            ExitEvent: self._on_exit,
            PhaseEvent: self._on_phase,
            JobEvent: self._on_job,
            DoneEvent: self._on_done,
        }

    def feed(self, raw: bytes) -> None:
        """One line from the agent; a kind this client does not know is skipped."""
        try:
            event = decode_event(raw)
        except ValueError as exc:
            raise RunError(f"the agent on {self.spec.cluster} sent what this client cannot read: {exc}") from None
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)

    def _on_line(self, event: LineEvent) -> None:
        node = self.spec.nodes[event.rank]
        pid = self.pids.get(event.rank, 0)
        setup = self.phases[-1:] == ["setup"]
        prefix = line_prefix(node.rank, node.name, pid, node.ip, self.spec.num_nodes, self.spec.task_name, setup)
        line = prefix + event.text
        self.lines.append(line)
        self.per_rank[event.rank].append(event.text)
        self.streams[event.rank, STDERR if event.stream == STDERR else STDOUT].append(event.text)
        if self.on_line is not None:
            self.on_line(line)

    def _on_start(self, event: StartEvent) -> None:
        self.pids[event.rank] = event.pid
        self._spans[(event.rank, event.phase)] = [time.time(), None, None]

    def _on_exit(self, event: ExitEvent) -> None:
        span = self._spans.setdefault((event.rank, event.phase), [None, None, None])
        span[1], span[2] = time.time(), event.code

    def _on_phase(self, event: PhaseEvent) -> None:
        self.phases.append(event.phase)

    def timeline(self, *, timed_out: bool = False, deadline: float | None = None) -> Timeline:
        """Every rank of every phase that began, started or not, ended or not."""
        spans = []
        for phase in self.phases:
            for node in self.spec.nodes:
                start, end, code = self._spans.get((node.rank, phase), (None, None, None))
                spans.append(RankSpan(node.rank, node.name, node.ip, phase, start, end, code))
        ended = time.time() if deadline is None else deadline
        return Timeline(self.spec.cluster, self.job_id, self.started, ended, tuple(spans), timed_out, deadline)

    def ranks_now(self) -> tuple[list[Target], list[RankState]]:
        """Each rank of the phase under way: where ``agent stacks`` finds it (its node, and its
        process group leader there: 0 if it never started), and its state and last lines."""
        phase = self.phases[-1] if self.phases else ""
        targets, states = [], []
        for n in self.spec.nodes:
            start, end, code = self._spans.get((n.rank, phase), (None, None, None))
            targets.append(Target(n.rank, n.ssh_target, self.pids.get(n.rank, 0) if start is not None else 0))
            lines = tuple(self.per_rank[n.rank][-KEPT_LINES:])
            states.append(RankState(n.rank, n.name, n.ip, phase, start is not None, code if end else None, lines))
        return targets, states

    def _on_job(self, event: JobEvent) -> None:
        self.job_id, self.task_id = event.id, event.task_id

    def _on_done(self, event: DoneEvent) -> None:
        self.done = event

    def result(self, seconds: float) -> RunResult:
        assert self.done is not None
        codes = self.done.codes
        ranks = []
        for node in self.spec.nodes:
            r = node.rank
            ranks.append(
                RankResult(
                    rank=r,
                    returncode=codes[r] if r < len(codes) else 0,
                    stdout=_text(self.streams[r, STDOUT]),
                    name=node.name,
                    ip=node.ip,
                    pid=self.pids.get(r, 0),
                    stderr=_text(self.streams[r, STDERR]),
                    output=_text(self.per_rank[r]),
                )
            )
        return RunResult(
            returncode=self.done.returncode,
            output=_text(self.lines),
            ranks=ranks,
            job_id=self.job_id,
            task_id=self.task_id,
            error=self.done.error,
            seconds=seconds,
            timeline=self.timeline(),
        )

    def partial(self) -> str:
        return "\n".join(self.lines)


def _text(lines: list[str]) -> str:
    """Lines as the text they were: each ended by a line break."""
    return "\n".join(lines) + ("\n" if lines else "")


def replayed(events: bytes) -> _Collector | None:
    """A job's events (``agent events``) fed to a collector, as they happened so far."""
    lines = [line for line in events.splitlines() if line.strip()]
    first = decode_event(lines[0]) if lines else None
    if not isinstance(first, SpecEvent):
        return None
    collector = _Collector(first.spec, None)
    for line in lines[1:]:
        collector.feed(line)
    return collector


def result_from_events(events: bytes, seconds: float = 0.0) -> RunResult | None:
    """Rebuild a job's RunResult from ``agent events`` (None while it has not finished)."""
    collector = replayed(events)
    return collector.result(seconds) if collector is not None and collector.done is not None else None


# ------------------------------------------------------------------------------ the client


@dataclass
class Door:
    """The way to the head's agent server (``agent.server``), as one cluster handle knows it.

    Until a run has gone the old way on this handle (an exec, which starts a server where
    none runs), the head may have none, and asking would only be refused (paramiko logs
    every refused channel as an error); so the first run execs, and later ones knock."""

    secret: bytes  # ``protocol.door_secret`` of the cluster key
    answered: bool = False


@dataclass(frozen=True)
class AgentClient:
    """The agent on one cluster's head, as the client talks to it: every exec over one SSH
    connection, which ``connect`` returns open (and reopens when it dropped)."""

    cluster: str  # its name, for messages
    connect: Callable[[], paramiko.SSHClient]
    python: str  # the head's interpreter
    agent_path: str  # the bundle on the head, e.g. ``~/.sky/agent.pyz``
    #: The way to the head's agent server; None: every run execs the agent, and none starts a
    #: server (the nodes keep none: ``ClusterInfo.agent_servers``).
    door: Door | None = None
    #: Told of every run or wait that did not end by itself, with where its ranks were.
    on_stopped: Callable[[StoppedRun], None] | None = None

    def _served(self, request: str) -> paramiko.Channel | None:
        """A channel to the head's agent server, past its door, asking ``request``; None where
        the head has no server (yet): the caller execs the agent instead, which starts one."""
        import paramiko

        if self.door is None or not self.door.answered:
            return None
        transport = self._transport()
        try:
            chan = transport.open_channel("direct-tcpip", ("127.0.0.1", AGENT_PORT), ("127.0.0.1", 0), timeout=30)
        except paramiko.ChannelException:
            self.door.answered = False  # refused: nothing listens (the head restarted)
            return None
        try:
            chan.settimeout(30)
            greeting = read_greeting(chan.recv)
            if not greeting.startswith(GREETING):
                chan.close()
                return None
            chan.sendall(door_answer(self.door.secret, greeting, request))
        except BaseException:
            chan.close()
            raise
        return chan

    def _transport(self) -> paramiko.Transport:
        """The open connection to the head (``connect`` reopens one that dropped)."""
        transport = self.connect().get_transport()
        if transport is None or not transport.is_active():
            raise RunError(f"the connection to the head of {self.cluster} is closed")
        return transport

    def _channel(self, args: list[str]) -> paramiko.Channel:
        transport = self._transport()
        chan = transport.open_session()
        try:
            chan.exec_command(" ".join([self.python, "-I", "-S", self.agent_path, *(shlex.quote(a) for a in args)]))
        except BaseException:
            chan.close()
            raise
        return chan

    # -- attached runs ---------------------------------------------------------------------

    def run(
        self, spec: RunSpec, *, timeout: float | None = None, on_line: Callable[[str], None] | None = None
    ) -> RunResult:
        """Execute ``spec`` on every rank and wait for all of them (``agent run``).

        Past ``timeout``, and when anything else ends the wait (Ctrl-C, a test's own timeout),
        where every rank is gets captured first (:meth:`stopped`); then the channel closes,
        which stops every rank."""
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        chan = self._served("run")
        if chan is None:
            # Where nodes keep servers, this exec starts the head's, for the next run.
            chan = self._channel(["run", "--serve"] if self.door is not None else ["run"])
            if self.door is not None:
                self.door.answered = True  # that agent started a server, for the next run
        collector = _Collector(spec, on_line)
        try:
            chan.sendall(encode_spec(spec))
            self._read_events(chan, collector, deadline, timeout)
            if collector.done is None:
                err = _stderr(chan)
                raise RunError(
                    f"the agent on the head of {spec.cluster} ended without a result"
                    + (f": {err}" if err else " (connection lost?)")
                )
            return collector.result(time.monotonic() - started)
        except RunError:
            raise  # the run's own end: its deadline (captured there), or a broken agent
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                interrupts.seen()
            if collector.job_id and collector.done is None:
                self.stopped(collector, why_stopped(exc), collector.timeline(timed_out=True, deadline=time.time()))
            raise
        finally:
            chan.close()

    def _read_events(
        self, chan: paramiko.Channel, collector: _Collector, deadline: float | None, timeout: float | None
    ) -> None:
        """Feed the run's events to ``collector`` until its last one, or its deadline."""
        buf = b""
        while collector.done is None:
            interrupts.check()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                assert timeout is not None
                timeline = collector.timeline(timed_out=True, deadline=time.time())
                stopped = self.stopped(collector, f"at the deadline ({timeout:g} s)", timeline)
                raise RunTimeoutError(
                    f"run on cluster {self.cluster} did not finish within {timeout:g} s; every rank was stopped",
                    partial_output=collector.partial(),
                    timeline=timeline,
                    capture=stopped.capture if stopped else None,
                )
            chan.settimeout(1.0 if left is None else min(left, 1.0))
            try:
                chunk = chan.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                return
            *lines, buf = (buf + chunk).split(b"\n")
            for line in lines:
                if line:
                    collector.feed(line)

    # -- where the ranks are ---------------------------------------------------------------

    def stopped(self, collector: _Collector, why: str, timeline: Timeline | None) -> StoppedRun | None:
        """Where every rank of ``collector``'s job is now (``agent stacks``), told to
        :attr:`on_stopped`; None where the job never got an id.  A second Ctrl-C ends the
        looking, not the stop that follows."""
        if not collector.job_id:
            return None
        targets, ranks = collector.ranks_now()
        capture = take(self.call, self.cluster, collector.job_id, targets, ranks, why, collector.spec.secrets)
        stopped = StoppedRun(capture, timeline)
        if self.on_stopped is not None:
            self.on_stopped(stopped)
        return stopped

    # -- commands --------------------------------------------------------------------------

    def call(self, args: list[str], *, stdin: bytes | None = None, timeout: float = 60.0) -> tuple[int, bytes]:
        """One short agent command on the head; returns (exit code, stdout)."""
        chan = self._channel(args)
        try:
            chan.settimeout(timeout)
            if stdin is not None:
                chan.sendall(stdin)
            chan.shutdown_write()
            out = b""
            try:
                while chunk := chan.recv(65536):
                    out += chunk
            except TimeoutError:
                raise RunTimeoutError(
                    f"agent command {args[0]} on the head of {self.cluster} did not answer within {timeout:g} s"
                ) from None
            return chan.recv_exit_status(), out
        finally:
            chan.close()

    def stream(self, args: list[str], deadline: float | None = None) -> Iterator[str]:
        """Lines of a long-running agent command (``logs ID follow``), as they come; past
        ``deadline`` (``time.monotonic()``) it raises :class:`RunTimeoutError`."""
        chan = self._channel(args)
        try:
            chan.shutdown_write()
            buf = b""
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RunTimeoutError(f"agent command {args[0]} on the head of {self.cluster} passed its deadline")
                chan.settimeout(None if left is None else min(left, 1.0))
                try:
                    chunk = chan.recv(65536)
                except TimeoutError:
                    continue
                if not chunk:
                    break
                *lines, buf = (buf + chunk).split(b"\n")
                for line in lines:
                    yield line.decode("utf-8", "replace")
            if buf:
                yield buf.decode("utf-8", "replace")
        finally:
            chan.close()

    # -- detached jobs ---------------------------------------------------------------------

    def submit(self, spec: RunSpec) -> JobEvent:
        """Start ``spec`` as a detached job on the head; its id, at once."""
        code, out = self.call(["submit"], stdin=encode_spec(spec))
        lines = out.splitlines()
        try:
            event = decode_event(lines[-1]) if lines else None
        except ValueError:
            event = None
        if not isinstance(event, JobEvent):
            raise RunError(f"could not submit a job to {self.cluster}: agent exit {code}")
        return event

    def jobs(self, which: int | str = "all") -> list[JobRecord]:
        """The records of every job (``"all"``, oldest first) or of one ([] for no such job)."""
        code, out = self.call(["jobs", str(which)])
        return self._decoded(decode_records, out, "job records") if code == 0 else []

    def job(self, job_id: int) -> JobRecord:
        records = self.jobs(job_id)
        if not records:
            raise RunError(f"cluster {self.cluster} has no job {job_id}")
        return records[0]

    def _decoded(self, decode: Callable[[bytes], T], out: bytes, what: str) -> T:
        try:
            return decode(out)
        except (ValueError, KeyError, TypeError) as exc:
            raise RunError(f"the agent on {self.cluster} sent {what} this client cannot read: {exc}") from None

    def wait(self, job_id: int, seconds: float) -> tuple[bool, JobRecord]:
        """Block on the head for at most ``seconds``: (whether the job ended, its record)."""
        code, out = self.call(["wait", str(job_id), f"{seconds:.3f}"], timeout=seconds + 30)
        if code not in (0, 3):
            raise RunError(f"cannot wait for job {job_id} on {self.cluster}: agent exit {code}")
        return code == 0, self._decoded(decode_record, out, "a job record")

    def logs(self, job_id: int) -> str:
        _, out = self.call(["logs", str(job_id)])
        return out.decode("utf-8", "replace")

    def follow_logs(self, job_id: int, deadline: float | None = None) -> Iterator[str]:
        return self.stream(["logs", str(job_id), "follow"], deadline)

    def result(self, job_id: int) -> RunResult | None:
        """The job's RunResult, rebuilt from its recorded events (None before it ended)."""
        code, events = self.call(["events", str(job_id)])
        if code != 0:
            raise RunError(f"cluster {self.cluster} has no record of job {job_id}")
        return result_from_events(events)

    def cancel(self, which: int | str) -> list[JobRecord]:
        """Stop a job (or ``"all"``) on every node; the records once they have ended."""
        code, out = self.call(["cancel", str(which)], timeout=60)
        return self._decoded(decode_records, out, "job records") if code == 0 else []

    def forget(self) -> None:
        """Drop the head's records of every ended job (``agent forget``)."""
        code, _ = self.call(["forget"])
        if code != 0:
            raise RunError(f"could not clear the job records on {self.cluster}: agent exit {code}")


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
