"""Where every rank was when a run was stopped: the account a hung multinode test prints.

In CI, distributed training fails most often by hanging: a rank never joins a collective, a
rendezvous never completes.  So when a run reaches its deadline, is interrupted, or a test's
own timeout fires while it waits, the client first asks the head's agent where every process
of the job is, on every node (``agent.stacks``: process tree, kernel wait, and every Python
thread's stack through the faulthandler that each node's ``sitecustomize`` armed), and only
then lets the ranks be stopped.  :func:`take` turns the answer into a :class:`Capture`:

- :meth:`Capture.summary`, read in ten seconds: per rank, running or exited (with its code);
  per Python thread, its innermost frame in the user's own files (``file:line function`` and
  the source line) and the library call it waits in (``torch.distributed.all_reduce``,
  ``comm.Barrier``, the c10d rendezvous); its last lines;
- :meth:`Capture.full`, for the artifacts: every process, thread and frame.

A frame is the user's unless its file is the interpreter's (its standard library,
``site-packages``, a console script beside the interpreter) or frozen.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from pytest_sky import interrupts
from pytest_sky.errors import SkyError

#: How long the whole capture may take (the agent bounds each node's answer lower).
CAPTURE_SECONDS = 20.0
#: What the summary shows of each rank, at most: its last lines, processes, threads.
SUMMARY_LINES = 5
SUMMARY_PROCESSES = 6
SUMMARY_THREADS = 4
#: Output lines of each rank a capture keeps (the full account shows them all).
KEPT_LINES = 30

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[(.*)\])?.*\(most recent call first\):\s*$")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*)$')
_STDLIB = re.compile(r"/lib/python\d+(?:\.\d+)?t?/(.*)$")
#: Functions that only pass a call on (decorators, ``Module.__call__``): the library call a
#: thread waits in is named by the first frame below them.
_PASSING_ON = frozenset(
    {"wrapper", "inner", "wrapped", "decorated", "_fn", "decorate_context", "__call__", "_call_impl",
     "_wrapped_call_impl", "wrapper_func", "func_wrapper", "_wrapper", "fn"}
)  # fmt: skip
#: Modules whose public functions users know under the package's name.
_ALIASES = {
    "torch.distributed.distributed_c10d": "torch.distributed",
    "torch.distributed.c10d_logger": "torch.distributed",
}


class CaptureError(SkyError):
    """The nodes could not be looked at (the message says why); the run is stopped anyway."""


# ------------------------------------------------------------------------------ frames


@dataclass(frozen=True)
class Frame:
    file: str
    line: int | None
    function: str
    source: str = ""

    def where(self) -> str:
        """``file:line function``, the file by its name only (the full path is in the full account)."""
        return f"{os.path.basename(self.file)}:{self.line if self.line is not None else '?'} {self.function}"


@dataclass(frozen=True)
class ThreadStack:
    """One Python thread as faulthandler wrote it; ``frames`` innermost first."""

    ident: str
    current: bool  # the thread that ran the handler
    frames: tuple[Frame, ...]
    name: str = ""


def parse_dump(text: str, sources: dict[str, str] | None = None) -> tuple[ThreadStack, ...]:
    """faulthandler's ``dump_traceback(all_threads=True)`` text, as threads."""
    sources = sources or {}
    threads: list[ThreadStack] = []
    head: tuple[str, bool, str] | None = None
    frames: list[Frame] = []
    for raw in text.splitlines():
        top = _THREAD.match(raw)
        if top:
            if head is not None:
                threads.append(ThreadStack(head[0], head[1], tuple(frames), head[2]))
            head, frames = (top.group(2), top.group(1) == "Current thread", top.group(3) or ""), []
            continue
        frame = _FRAME.match(raw)
        if frame and head is not None:
            path, line = frame.group(1), frame.group(2)
            number = int(line) if line.isdigit() else None
            frames.append(Frame(path, number, frame.group(3), sources.get(f"{path}:{line}", "")))
    if head is not None:
        threads.append(ThreadStack(head[0], head[1], tuple(frames), head[2]))
    return tuple(threads)


def is_library(frame: Frame, interpreter_dirs: Sequence[str] = ()) -> bool:
    """Not the user's own file: the interpreter's, an installed package's, frozen, or a
    console script beside the interpreter (``torchrun``)."""
    path = frame.file
    if path.startswith("<"):  # <frozen ...> is the interpreter's; <string> is python -c's, the user's
        return path.startswith("<frozen")
    if "/site-packages/" in path or "/dist-packages/" in path or _STDLIB.search(path):
        return True
    return os.path.dirname(path) in interpreter_dirs


def module_of(path: str) -> str:
    """The dotted module a library file is (``torch.distributed.distributed_c10d``)."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            rel = path.split(marker, 1)[1]
            break
    else:
        stdlib = _STDLIB.search(path)
        rel = stdlib.group(1) if stdlib else os.path.basename(path)
    rel = rel.removesuffix(".py").removesuffix("/__init__")
    return rel.replace("/", ".")


def _named(frame: Frame) -> str:
    module = module_of(frame.file)
    return f"{_ALIASES.get(module, module)}.{frame.function}"


def called_on(source: str) -> str:
    """The call a line makes last (its last statement's outermost: arguments are evaluated
    first), as written: ``time.sleep(600)`` -> ``time.sleep``; "" where the line makes none
    that can be read.  (faulthandler names a line, not a column: a guess where it has several.)"""
    import ast

    try:
        tree = ast.parse(source.strip())
    except SyntaxError:  # one line of a longer statement: its first call, by its look
        found = re.search(r"([A-Za-z_][\w.]*)\s*\(", source)
        return found.group(1) if found else ""
    for statement in reversed(tree.body):
        calls = [node for node in ast.walk(statement) if isinstance(node, ast.Call)]
        if calls:
            return ast.unparse(calls[0].func)[:80]
    return ""


def _rdzv_backend(argv: Sequence[str]) -> str:
    """The rendezvous backend a torchrun command line names (``--rdzv_backend=c10d``)."""
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag.lstrip("-").replace("-", "_") == "rdzv_backend":
            return value or (argv[i + 1] if i + 1 < len(argv) else "")
    return ""


@dataclass(frozen=True)
class Waiting:
    """Where a thread waits: its innermost frame in the user's files (None: it has none, a
    library's own process such as torchrun's agent) and the library call it is in."""

    user: Frame | None
    call: str


def waiting(stack: ThreadStack, interpreter_dirs: Sequence[str] = (), argv: Sequence[str] = ()) -> Waiting:
    """Where ``stack`` waits; ``argv`` is its process's command line (torchrun's names its
    rendezvous backend)."""
    frames = stack.frames
    user_at = next((i for i, f in enumerate(frames) if not is_library(f, interpreter_dirs)), None)
    library = frames if user_at is None else frames[:user_at]
    user = None if user_at is None else frames[user_at]
    if not library:  # the user's own line calls into C (time.sleep, mpi4py's Barrier)
        return Waiting(user, called_on(user.source) if user is not None else "")
    modules = [module_of(f.file) for f in library]
    rendezvous = [f for f, m in zip(library, modules, strict=True) if ".rendezvous." in f".{m}."]
    if rendezvous:
        c10d = any(m.endswith("c10d_rendezvous_backend") for m in modules) or _rdzv_backend(argv) == "c10d"
        return Waiting(user, f"the {'c10d ' if c10d else ''}rendezvous ({_named(rendezvous[-1])})")
    entry = len(library) - 1
    while entry > 0 and library[entry].function in _PASSING_ON:
        entry -= 1
    return Waiting(user, _named(library[entry]))


# ------------------------------------------------------------------------------ the capture


@dataclass(frozen=True)
class KernelThread:
    tid: int
    name: str
    state: str
    wchan: str


@dataclass(frozen=True)
class ProcessView:
    pid: int
    ppid: int
    state: str
    wchan: str  # the kernel function it sleeps in ("" when running)
    argv: tuple[str, ...]
    threads: tuple[KernelThread, ...] = ()
    python: bool = False
    stacks: tuple[ThreadStack, ...] = ()
    note: str = ""  # why a Python process has no stacks

    @property
    def command(self) -> str:
        return " ".join(self.argv)[:160] or "?"

    def interpreter_dirs(self) -> tuple[str, ...]:
        first = self.argv[0] if self.argv else ""
        return (os.path.dirname(first),) if first.startswith("/") else ()


@dataclass(frozen=True)
class NodeView:
    rank: int
    processes: tuple[ProcessView, ...] = ()
    error: str | None = None  # the node could not be looked at


@dataclass(frozen=True)
class RankState:
    rank: int
    name: str
    ip: str
    phase: str  # "setup" or "run" ("" before either)
    started: bool
    code: int | None  # its exit code, None while it runs
    last_lines: tuple[str, ...] = ()

    @property
    def state(self) -> str:
        if not self.started:
            return "never started"
        return "running" if self.code is None else f"exited ({self.code})"


@dataclass(frozen=True)
class Capture:
    """Every rank of one job at one moment (``taken``, this machine's clock)."""

    cluster: str
    job_id: int
    why: str  # "at the deadline (20 s)", "when interrupted", ...
    taken: float
    seconds: float  # how long looking took
    ranks: tuple[RankState, ...]
    nodes: tuple[NodeView, ...] = field(default=())
    error: str | None = None

    def summary(self) -> str:
        """What the failure report shows."""
        out = [f"where every rank of job {self.job_id} on {self.cluster} was {self.why}:"]
        if self.error:
            out.append(f"  (the nodes could not be looked at: {self.error})")
        views = {n.rank: n for n in self.nodes}
        for rank in self.ranks:
            out.append(f"rank {rank.rank} ({rank.name}, {rank.ip}): {rank.state}" + _phase(rank))
            out += _node_summary(views.get(rank.rank))
            if rank.last_lines:
                out.append("  last lines:")
                out += [f"    | {line}" for line in rank.last_lines[-SUMMARY_LINES:]]
        return "\n".join(out) + "\n"

    def full(self) -> str:
        """Every process, kernel thread, Python thread and frame: the artifacts' account."""
        out = [self.summary(), "=" * 78]
        views = {n.rank: n for n in self.nodes}
        for rank in self.ranks:
            node = views.get(rank.rank)
            out.append(f"rank {rank.rank} ({rank.name}, {rank.ip}): {rank.state}" + _phase(rank))
            if node is not None and node.error:
                out.append(f"  could not look: {node.error}")
            for proc in node.processes if node is not None else ():
                out += _process_full(proc)
            out.append("  output, last lines:")
            out += [f"    | {line}" for line in rank.last_lines]
            out.append("")
        return "\n".join(out)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"


def _phase(rank: RankState) -> str:
    return f" in {rank.phase}" if rank.phase == "setup" else ""


def _node_summary(node: NodeView | None) -> list[str]:
    if node is None:
        return []
    if node.error:
        return [f"  could not look at its node: {node.error}"]
    parents = {p.ppid for p in node.processes}
    shown = [p for p in node.processes if p.python or p.pid not in parents]
    out = []
    for proc in shown[:SUMMARY_PROCESSES]:
        wait = f", in {proc.wchan}" if proc.wchan else ""
        out.append(f"  pid {proc.pid} {proc.command} [{proc.state}{wait}]")
        out += _threads_summary(proc)
    if len(shown) > SUMMARY_PROCESSES:
        out.append(f"  ... {len(shown) - SUMMARY_PROCESSES} more processes (the full account has them)")
    return out


def _thread_label(proc: ProcessView, i: int, stack: ThreadStack) -> str:
    # faulthandler lists the newest thread first: the main thread is the last.
    label = "main thread" if i == len(proc.stacks) - 1 else f"thread {stack.ident}"
    return f"{label} ({stack.name})" if stack.name else label


def _threads_summary(proc: ProcessView) -> list[str]:
    if proc.note:
        return [f"    {proc.note}"]
    out: list[str] = []
    for i, stack in reversed(list(enumerate(proc.stacks))):
        if len(out) >= SUMMARY_THREADS:
            out.append(f"    ... {len(proc.stacks) - SUMMARY_THREADS} more threads (the full account has them)")
            break
        wait = waiting(stack, proc.interpreter_dirs(), proc.argv)
        label = _thread_label(proc, i, stack)
        if not stack.frames:
            out.append(f"    {label}: no Python frame (in native code)")
            continue
        where = wait.user or stack.frames[0]
        source = f": {where.source}" if where.source else ""
        mine = "" if wait.user is not None else " (no frame of the user's own files)"
        call = f"\n      waits in {wait.call}" if wait.call else ""
        out.append(f"    {label}: {where.where()}{mine}{source}{call}")
    return out


def _process_full(proc: ProcessView) -> list[str]:
    out = [f"  pid {proc.pid} (parent {proc.ppid}) [{proc.state}{', in ' + proc.wchan if proc.wchan else ''}]"]
    out.append(f"    command: {' '.join(proc.argv) or '?'}")
    for t in proc.threads:
        out.append(f"    task {t.tid} {t.name!r} [{t.state}{', in ' + t.wchan if t.wchan else ''}]")
    if proc.note:
        out.append(f"    {proc.note}")
    for i, stack in reversed(list(enumerate(proc.stacks))):
        out.append(f"    {_thread_label(proc, i, stack)}{' (ran the dump)' if stack.current else ''}, innermost first:")
        for frame in stack.frames or (Frame("<no Python frame>", None, ""),):
            out.append(f'      File "{frame.file}", line {frame.line} in {frame.function}')
            if frame.source:
                out.append(f"        {frame.source}")
    return out


# ------------------------------------------------------------------------------ asking


Call = Callable[..., tuple[int, bytes]]


@dataclass(frozen=True)
class Target:
    """One rank of the job, as the head's agent needs it to look."""

    rank: int
    ssh_target: str
    pid: int  # its process group leader on its node (0: it never started)


def take(
    call: Call,
    cluster: str,
    job_id: int,
    targets: Sequence[Target],
    ranks: Sequence[RankState],
    why: str,
    secrets: Mapping[str, str] | None = None,
) -> Capture:
    """Ask the head (``call``: ``AgentClient.call``) where every process of the job is, the
    task's ``secrets`` masked in the answer (their values, where this client knows them; the
    nodes find the others in the ranks' environments).  Never raises: what cannot be looked at
    is the capture's ``error``, for a look must not replace what ended the run; a second Ctrl-C
    ends the looking, not the stop that follows."""
    started = time.monotonic()
    nodes: tuple[NodeView, ...] = ()
    error = None
    if any(t.pid for t in targets):
        try:
            nodes = _ask(call, targets, secrets or {})
        except SkyError as exc:
            error = str(exc)
        except KeyboardInterrupt:
            interrupts.seen()
            error = "interrupted while looking"
        except Exception as exc:  # noqa: BLE001 - see above: the connection broke under the look
            error = f"{type(exc).__name__}: {exc}"
    return Capture(cluster, job_id, why, time.time(), round(time.monotonic() - started, 3), tuple(ranks), nodes, error)


def why_stopped(exc: BaseException) -> str:
    """How a capture names what ended a wait that was not its own deadline."""
    if isinstance(exc, KeyboardInterrupt):
        return "when the run was interrupted (Ctrl-C or SIGTERM)"
    said = str(exc).strip().splitlines()
    return f"when the wait ended with {type(exc).__name__}{': ' + said[0] if said else ''}"


def _ask(call: Call, targets: Sequence[Target], secrets: Mapping[str, str]) -> tuple[NodeView, ...]:
    request = {
        "nodes": [{"rank": t.rank, "target": t.ssh_target, "pid": t.pid} for t in targets],
        "secrets": sorted(secrets),  # on the head's stdin, inside the SSH connection, as the run spec
        "values": sorted(set(secrets.values())),
    }
    code, out = call(["stacks"], stdin=json.dumps(request).encode(), timeout=CAPTURE_SECONDS)
    if code != 0:
        raise CaptureError(f"the head's agent could not look (exit {code}; a pytest-sky older than this one?)")
    try:
        answer = json.loads(out)
        return tuple(_node(n) for n in answer["nodes"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CaptureError(f"the head's agent answered what this client cannot read: {exc}") from None


def _node(wire: dict) -> NodeView:
    processes = []
    for p in wire.get("processes") or []:
        threads = tuple(KernelThread(t["tid"], t["name"], t["state"], t["wchan"]) for t in p.get("threads") or [])
        processes.append(
            ProcessView(
                pid=p["pid"],
                ppid=p["ppid"],
                state=p["state"],
                wchan=p["wchan"],
                argv=tuple(p["argv"]),
                threads=threads,
                python=bool(p.get("python")),
                stacks=parse_dump(p.get("dump") or "", p.get("sources") or {}),
                note=p.get("note") or "",
            )
        )
    return NodeView(int(wire["rank"]), tuple(processes), wire.get("error"))
