"""The one protocol between the client and the agent on a cluster's head, typed.

A run goes ``Cluster.run`` -> ``runner.AgentClient`` (client) -> ``agent`` (head) and back:

- client -> agent: a :class:`RunSpec` on the agent's stdin (:func:`encode_spec`: marshal,
  behind an 8-byte length), then nothing: the rest of stdin is the run's lifeline;
- agent -> client: one JSON line per :class:`Event` (:data:`EVENTS`), the same lines the agent
  keeps in the job's ``events.jsonl``, which ``agent events`` replays after a :class:`SpecEvent`;
- job records (:class:`JobRecord`, with its :class:`JobStatus`) as the agent keeps them in
  ``status.json`` and prints them for ``jobs``, ``wait`` and ``cancel``.

Every field's spelling on the wire is written here and nowhere else.  The wire stays compact
(``{"e":"l","r":0,"t":"..."}`` for an output line, the hot path), and a kind this side does
not know decodes to None: an agent may add kinds without breaking an older reader.

Shipped inside the agent's bundle and run as ``python -I -S``: stdlib only, nothing of the
project, and nothing at import time beyond ``enum`` (which ``signal`` imports anyway).  Not
``dataclasses`` (its import, with ``re`` and ``inspect``, costs ~20 ms on every run): the
records are plain classes made by :func:`record`, and JSON is written by :func:`to_json`
and read with ``json`` only on the client and in the agent's job commands.
"""

from __future__ import annotations

from enum import Enum

TYPE_CHECKING = False  # typing's own would cost its import on the agent's every run
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any, TypeVar, dataclass_transform

    R = TypeVar("R")
else:

    def dataclass_transform(**_: object) -> object:
        return lambda f: f


# ------------------------------------------------------------------------------ job status


class JobStatus(str, Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL

    def __str__(self) -> str:
        return self.value


#: The statuses a job never leaves.  Plain strings read from a record are found here too.
TERMINAL = frozenset((JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED))
#: The statuses of a job that may still run, which ``cancel --all`` stops.
LIVE = frozenset((JobStatus.PENDING, JobStatus.RUNNING))


class FailedPhase(str, Enum):
    """Where a FAILED job failed: its setup (sky's FAILED_SETUP), its run, or its agent died
    (FAILED_DRIVER: its cluster was stopped, say).  ``JobRecord.status`` stays one of the
    public contract's five; the CLI writes sky's word from this (``cli.job_report``)."""

    SETUP = "setup"
    RUN = "run"
    DRIVER = "driver"

    def __str__(self) -> str:
        return self.value


# ------------------------------------------------------------------------------ records


class _Factory:
    __slots__ = ("make",)

    def __init__(self, make: Callable[[], object]) -> None:
        self.make = make


def field(*, default_factory: Callable[[], Any]) -> Any:
    """A mutable default, made afresh for each record (as ``dataclasses.field``)."""
    return _Factory(default_factory)


@dataclass_transform(field_specifiers=(field,))
def record(cls: type[R]) -> type[R]:
    """The part of ``@dataclass`` the protocol needs: ``__init__`` (positional or keyword,
    defaults), ``==``, ``repr`` and :meth:`as_dict`, from the class's annotated fields."""
    # The class's own annotations, as strings: inspect.get_annotations would import inspect.
    names = tuple(cls.__dict__.get("__annotations__", ()))  # noqa: RUF063
    defaults = {n: cls.__dict__[n] for n in names if n in cls.__dict__}

    def __init__(self: object, *args: object, **kwargs: object) -> None:
        if len(args) > len(names):
            raise TypeError(f"{cls.__name__} takes {len(names)} fields, got {len(args)}")
        values = self.__dict__
        for i, value in enumerate(args):  # (zip's strict= is not in every node's python)
            values[names[i]] = value
        for key, value in kwargs.items():
            if key not in names or key in values:
                raise TypeError(f"{cls.__name__}: unexpected or repeated field {key!r}")
            values[key] = value
        for name in names if len(values) < len(names) else ():
            if name not in values:
                if name not in defaults:
                    raise TypeError(f"{cls.__name__}: missing field {name!r}")
                value = defaults[name]
                values[name] = value.make() if isinstance(value, _Factory) else value

    def __eq__(self: object, other: object) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def __repr__(self: object) -> str:
        return f"{cls.__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"

    cls.__init__ = __init__  # type: ignore[method-assign,misc]
    cls.__eq__ = __eq__  # type: ignore[method-assign,assignment]
    cls.__hash__ = None  # type: ignore[assignment]
    if "__repr__" not in cls.__dict__:  # a record's own (RunSpec's hides its secrets)
        cls.__repr__ = __repr__  # type: ignore[method-assign,assignment]
    cls.as_dict = lambda self: dict(self.__dict__)  # type: ignore[attr-defined]
    cls.fields = names  # type: ignore[attr-defined]
    return cls


# ------------------------------------------------------------------------------ JSON


_JSON_ESCAPES = {i: f"\\u{i:04x}" for i in range(32)}
_JSON_ESCAPES.update({ord('"'): '\\"', ord("\\"): "\\\\", ord("\n"): "\\n", ord("\t"): "\\t"})


def json_str(text: str) -> str:
    """One JSON string: the hot path of every output line."""
    return '"' + text.translate(_JSON_ESCAPES) + '"'


def to_json(value: object, sep: str = ",", colon: str = ":") -> str:
    """JSON of str, int, float, bool, None, lists and dicts, without the ``json`` module.

    The agent writes JSON on every run and reads it only in its job commands: importing
    ``json`` (and ``re`` with it) would cost ~15 ms on the run path.
    """
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return json_str(value)
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + sep.join(json_str(str(k)) + colon + to_json(v, sep, colon) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + sep.join(to_json(v, sep, colon) for v in value) + "]"
    return json_str(str(value))


def _loads(raw: bytes | str) -> Any:
    import json

    return json.loads(raw)


# ------------------------------------------------------------------------------ the run spec


@record
class NodeRef:
    """One rank of a run, as the agent needs it."""

    rank: int
    name: str  # "head", "worker1", ...: in the output prefixes
    ip: str  # the internal address: SKYPILOT_NODE_IPS, the worker prefixes
    ssh_target: str  # what the head's ssh dials for this rank (an alias of its ~/.ssh/config, or the IP)
    #: The backend's values for this node (its CUDA_VISIBLE_DEVICES); the task's envs win.
    env: dict[str, str] = field(default_factory=dict)
    #: The words that start the rank as a job step of the node's allocation (``srun ...``),
    #: where ranks must be job steps (Slurm); empty: its agent server, or ssh.
    step: list[str] = field(default_factory=list)


#: What stands in place of a secret's value: in a record (``spec.json``), a repr, and where a
#: rank printed it (``masking``).
SECRET_SHOWN = "***"

#: The CPUs a job holds on each of its nodes unless its task asks for more: SkyPilot's default,
#: by which 16 jobs run at once on an 8-CPU node (``agent.queue``).
DEFAULT_JOB_CPUS = 0.5


@record
class RunSpec:
    """Everything the agent reads to run a task, setup then run, on every rank."""

    cluster: str  # the cluster's name: in SKYPILOT_TASK_ID
    task_name: str  # the single-node prefix, ``(<task name>, pid=N)``
    nodes: list[NodeRef]  # rank order, head first; a task may use fewer than the cluster has
    run: str | None = None
    setup: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # every rank's, the task's envs included
    cwd: str | None = None  # the task's workdir on every node, when it has one
    gpus_per_node: int = 0
    cluster_info: dict[str, str | None] = field(default_factory=dict)  # SKYPILOT_CLUSTER_INFO
    cpus_per_node: float = DEFAULT_JOB_CPUS  # what the job holds on each node while it runs
    node_cpus: float | None = None  # what each node has for jobs (the launch's cpus); None: no count
    gpu_share: float = 0.0  # the GPUs the job holds on each node (0.5: half of one, as sky's V100:0.5)
    node_gpus: int = 0  # each node's GPUs, which jobs share by their gpu_share
    #: The task's secrets: exported on every rank after ``env``, masked in what the ranks print
    #: (``masking``), and never written down: :meth:`to_record` keeps their names only.
    secrets: dict[str, str] = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def to_wire(self) -> dict:
        """What the client sends the agent: everything, secrets included."""
        wire = self.as_dict()  # type: ignore[attr-defined]
        wire["nodes"] = [n.as_dict() for n in self.nodes]  # type: ignore[attr-defined]
        return wire

    def to_record(self) -> dict:
        """What is kept of it (the job's ``spec.json``, replayed by ``agent events``): each
        secret's value is the mask."""
        wire = self.to_wire()
        wire["secrets"] = {name: SECRET_SHOWN for name in self.secrets}
        return wire

    def __repr__(self) -> str:
        shown = dict(self.__dict__, secrets={name: SECRET_SHOWN for name in self.secrets})
        return f"RunSpec({', '.join(f'{k}={shown[k]!r}' for k in self.fields)})"  # type: ignore[attr-defined]

    @classmethod
    def from_wire(cls, wire: dict) -> RunSpec:
        """Also what ``spec.json`` holds; keys this side does not know are left out."""
        known = {k: v for k, v in wire.items() if k in cls.fields}  # type: ignore[attr-defined]
        known["nodes"] = [NodeRef(**{k: v for k, v in n.items() if k in NodeRef.fields}) for n in wire["nodes"]]  # type: ignore[attr-defined]
        return cls(**known)


SPEC_LENGTH_BYTES = 8


def encode_spec(spec: RunSpec) -> bytes:
    """Client -> agent: marshal (built into every python; no import at all) behind its length."""
    import marshal

    body = marshal.dumps(spec.to_wire(), 4)
    return len(body).to_bytes(SPEC_LENGTH_BYTES, "big") + body


def read_spec(read_exactly: Callable[[int], bytes]) -> RunSpec:
    """The spec from a stream, given a reader of exactly n bytes (the agent's stdin)."""
    import marshal

    length = int.from_bytes(read_exactly(SPEC_LENGTH_BYTES), "big")
    return RunSpec.from_wire(marshal.loads(read_exactly(length)))


def decode_spec(frame: bytes) -> RunSpec:
    """The spec of one whole :func:`encode_spec` frame."""
    view = memoryview(frame)
    offset = [0]

    def read_exactly(n: int) -> bytes:
        chunk = bytes(view[offset[0] : offset[0] + n])
        if len(chunk) < n:
            raise EOFError("the run spec is cut short")
        offset[0] += n
        return chunk

    return read_spec(read_exactly)


# ------------------------------------------------------------------------------ the agent's door

#: The TCP port of the agent's server on every node (``agent serve``, :mod:`pytest_sky.agent.server`).
#: The client reaches the head's through its SSH connection (a ``direct-tcpip`` channel to the
#: head's loopback); the head reaches each worker's over the cluster network, as the ranks of a
#: training job reach each other.
AGENT_PORT = 7022
#: What a server says first, followed by a fresh nonce and a line break.
GREETING = b"PSKY-AGENT1 "
#: How a rank that a worker's server started ends its output: ``<mark> <nonce> <exit code>``
#: on a line of its own (the nonce, which the rank's program never sees, keeps the program
#: from ending its own rank early by printing the mark).
EXIT_MARK = "PSKY-EXIT"


def read_greeting(recv: Callable[[int], bytes]) -> bytes:
    """A server's first line, given its connection's ``recv`` (a socket's, a paramiko
    channel's): the server says nothing more until it has the client's answer."""
    data = b""
    while b"\n" not in data and len(data) < 256:
        chunk = recv(256)
        if not chunk:
            break
        data += chunk
    return data


def keep_alive(sock: Any, every: int, probes: int) -> None:
    """Give up a connection whose peer stays silent: a TCP keepalive after ``every`` seconds
    of silence, then every ``every`` seconds, ``probes`` unanswered ending it (the kernel
    answers them, however busy the peer's CPUs).  Also no Nagle: events and lines are small
    writes, each wanted at once."""
    import socket

    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", every), ("TCP_KEEPINTVL", every), ("TCP_KEEPCNT", probes)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def door_secret(cluster_key: bytes) -> bytes:
    """Who may ask a node's server for anything: whoever holds the cluster's private key,
    which is who may ssh to the node (every node and the client hold it)."""
    import hashlib
    import hmac

    return hmac.new(cluster_key, b"pytest-sky agent door", hashlib.sha256).digest()


def _proof(secret: bytes, nonce: bytes) -> bytes:
    import hashlib
    import hmac

    return hmac.new(secret, nonce, hashlib.sha256).hexdigest().encode()


def door_answer(secret: bytes, greeting: bytes, request: str) -> bytes:
    """The client's first line to a server that sent ``greeting``: the proof that it holds
    the secret (for this greeting's nonce only, so a line overheard is worth nothing), then
    what it asks for."""
    return _proof(secret, greeting[len(GREETING) :].strip()) + b" " + request.encode() + b"\n"


def door_request(secret: bytes, nonce: bytes, line: bytes) -> str | None:
    """What a client's first line asks for; None when its proof is wrong."""
    import hmac

    proof, _, request = line.rstrip(b"\n").partition(b" ")
    return request.decode() if hmac.compare_digest(proof, _proof(secret, nonce)) else None


# ------------------------------------------------------------------------------ job records


@record
class JobRecord:
    """A job as the agent keeps it in ``~/.sky/jobs/<id>/status.json``."""

    id: int
    status: JobStatus
    task_id: str = ""
    name: str | None = None  # the task's display name
    num_nodes: int = 0
    detached: bool = False
    pid: int | None = None  # the job's agent, in the head's PID namespace
    #: That process's start time (``procs.start_time``): a node stopped and started again
    #: counts its pids from 1, and a new process with the old pid is not the job's agent.
    pid_start: int | None = None
    returncode: int | None = None
    error: str | None = None  # which rank failed and how, or why the job was stopped
    submitted: float = 0.0
    started: float | None = None
    ended: float | None = None
    failed_phase: FailedPhase | None = None  # set when FAILED

    def encode(self) -> str:
        return to_json(self.as_dict())  # type: ignore[attr-defined]

    @classmethod
    def from_wire(cls, wire: dict) -> JobRecord:
        known = {k: v for k, v in wire.items() if k in cls.fields}  # type: ignore[attr-defined]
        known["status"] = JobStatus(wire["status"])
        if wire.get("failed_phase") is not None:
            known["failed_phase"] = FailedPhase(wire["failed_phase"])
        return cls(**known)


def decode_records(raw: bytes) -> list[JobRecord]:
    """The JSON list that ``jobs``, ``cancel`` print (``wait`` prints one record: see below)."""
    return [JobRecord.from_wire(r) for r in _loads(raw or b"[]") if r is not None]


def decode_record(raw: bytes) -> JobRecord:
    return JobRecord.from_wire(_loads(raw))


def encode_records(records: Iterable[JobRecord | None]) -> str:
    return "[" + ",".join("null" if r is None else r.encode() for r in records) + "]"


# ------------------------------------------------------------------------------ events


class Event:
    """One thing the agent tells the client about a run, as one JSON line.

    ``KIND`` is the line's ``"e"``; ``WIRE`` names the fields whose key on the wire is not
    their own name (the shorter keys of the hot path).
    """

    KIND = ""
    WIRE: dict[str, str] = {}
    fields: tuple[str, ...] = ()  # set by @record

    def encode(self) -> bytes:
        wire = {"e": self.KIND}
        for name in self.fields:
            wire[self.WIRE.get(name, name)] = getattr(self, name)
        return to_json(wire).encode() + b"\n"

    @classmethod
    def from_wire(cls, wire: dict) -> Event:
        keys = {name: cls.WIRE.get(name, name) for name in cls.fields}
        return cls(**{name: wire[key] for name, key in keys.items() if key in wire})


@record
class JobEvent(Event):
    """The run has a job id (first of an attached run's events; ``submit``'s one line)."""

    KIND = "job"
    id: int
    task_id: str


@record
class PhaseEvent(Event):
    """A phase (``setup``, ``run``) starts on every rank."""

    KIND = "phase"
    phase: str


@record
class StartEvent(Event):
    """A rank's script started: its pid, for the output prefix."""

    KIND = "start"
    rank: int
    pid: int
    phase: str


#: Which of a rank's streams a line came on (``LineEvent.stream``): its file descriptor.
STDOUT, STDERR = 1, 2


@record
class LineEvent(Event):
    """One line of a rank's output, without its prefix, and the stream it came on (stdout's
    lines carry no ``"s"`` on the wire: the hot path's line stays as short as it was)."""

    KIND = "l"
    WIRE = {"rank": "r", "text": "t", "stream": "s"}
    rank: int
    text: str
    stream: int = STDOUT

    def encode(self) -> bytes:
        if self.stream == STDOUT:
            return b'{"e":"l","r":%d,"t":%s}\n' % (self.rank, json_str(self.text).encode())
        return b'{"e":"l","r":%d,"s":%d,"t":%s}\n' % (self.rank, self.stream, json_str(self.text).encode())

    @classmethod
    def from_wire(cls, wire: dict) -> LineEvent:
        return cls(wire["r"], wire["t"], wire.get("s", STDOUT))


@record
class ExitEvent(Event):
    """A rank's script ended."""

    KIND = "exit"
    WIRE = {"time": "t"}
    rank: int
    code: int
    phase: str
    time: float  # when, in the head's clock


@record
class DoneEvent(Event):
    """The run ended (the last event): how, and each rank's exit code."""

    KIND = "done"
    returncode: int
    status: JobStatus
    error: str | None = None
    codes: list[int] = field(default_factory=list)

    @classmethod
    def from_wire(cls, wire: dict) -> DoneEvent:
        return cls(wire["returncode"], JobStatus(wire["status"]), wire.get("error"), wire.get("codes") or [])


@record
class SpecEvent(Event):
    """First line of ``agent events``: the job's spec, to rebuild its result from the rest."""

    KIND = "spec"
    spec: RunSpec

    def encode(self) -> bytes:
        return self.encode_raw(to_json(self.spec.to_record()).encode())

    @staticmethod
    def encode_raw(spec_json: bytes) -> bytes:
        """The line around a ``spec.json`` as the agent wrote it: no need to parse it first."""
        return b'{"e":"spec","spec":' + spec_json + b"}\n"

    @classmethod
    def from_wire(cls, wire: dict) -> SpecEvent:
        return cls(RunSpec.from_wire(wire["spec"]))


#: Every kind of event by its ``"e"``.
EVENTS: dict[str, type[Event]] = {
    cls.KIND: cls for cls in (JobEvent, PhaseEvent, StartEvent, LineEvent, ExitEvent, DoneEvent, SpecEvent)
}


def decode_event(raw: bytes | str) -> Event | None:
    """One event line; None for a kind this side does not know (a newer agent's).

    A line that is not an event at all (not JSON, or a known kind without its fields)
    raises ``ValueError``.
    """
    wire = _loads(raw)
    kind = EVENTS.get(wire.get("e")) if isinstance(wire, dict) else None  # type: ignore[arg-type]
    if kind is None:
        if isinstance(wire, dict) and isinstance(wire.get("e"), str):
            return None
        raise ValueError(f"not an agent event: {raw[:200]!r}")
    try:
        return kind.from_wire(wire)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed {kind.KIND!r} event ({exc}): {raw[:200]!r}") from None
