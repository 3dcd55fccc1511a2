"""One rank on one node, as the head starts it: the rank's program, its supervisor, its output.

Each rank is started through its node's agent server, which supervises it
(:class:`~pytest_sky.agent.remote.Remote`, :mod:`~pytest_sky.agent.supervisor`), the head's
own included when this run is a fork of the head's server; where there is no server to ask
(the head's rank in an exec'd run, a worker over head-to-worker SSH) it runs under the bash
rank supervisor (``shell/rank_supervisor.sh``: a Python one started per rank would cost
~30 ms of interpreter start per node per run).  On a Slurm allocation every rank, the head's
too, is a job step (``srun``, the node's ``NodeRef.step``) running that supervisor, but a
worker's in a run that holds a secret (it goes over ssh).  Either way the first line is the
pid of the rank's process group (``shell.PID_MARK``); every line after it is the rank's output, which
:class:`Rank` masks (the task's secrets: :mod:`~pytest_sky.masking`) and hands to the job's
:class:`~pytest_sky.agent.records.Emitter` as it comes.  Closing a rank's stdin (its
lifeline) stops its whole tree.  A rank's program is in no command line (DESIGN.md section
4d): it reaches its bash in the environment, or over ssh on stdin.
"""

from __future__ import annotations

import itertools
import os
import sys

from pytest_sky import shell
from pytest_sky.agent.child import Child
from pytest_sky.agent.records import Emitter
from pytest_sky.masking import mask
from pytest_sky.naming import line_prefix
from pytest_sky.protocol import STDERR, STDOUT, LineEvent, NodeRef, RunSpec, StartEvent

TYPE_CHECKING = False  # typing's own would cost its import on the agent's every run
if TYPE_CHECKING:
    from collections.abc import Callable

    from pytest_sky.agent.remote import Remote
    from pytest_sky.protocol import Event

#: How long the head waits, past a rank's own grace, for ranks it told to stop.
STOP_GRACE_SECONDS = 2.0

#: The supervisor's text, passed to ``bash -c`` (read once per agent process).
RANK_SUPERVISOR = shell.script(shell.RANK_SUPERVISOR)
PID_MARK = shell.PID_MARK.encode() + b" "
ERR_MARK = shell.STDERR_MARK.encode()

#: What setup must not see unless the task's own envs set it: SkyPilot runs setup outside
#: any GPU allocation (its env_check example fails setup when the variable is set at all).
SETUP_UNSET = ("CUDA_VISIBLE_DEVICES",)


def _sh_quote(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"


def _sh_word(value: str) -> str:
    """``value`` as one shell word on one line: line breaks as ``$'...'`` escapes."""
    if "\n" not in value and "\r" not in value:
        return _sh_quote(value)
    escaped = value.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\r", "\\r")
    return f"$'{escaped}'"


def rank_script(script: str, env: dict, cwd: str | None, *, phase: str = "run") -> str:
    """The rank's whole program, in the order of SkyPilot's generated scripts: ``~/.bashrc``
    (so an ``export`` a setup appended there reaches run), then the job's environment over
    it (a ``PYTHONPATH`` of the task's keeps the node's :data:`~pytest_sky.shell.SITE_DIR` at
    its end), the working directory, and the task's script.  All that comes before the script is on
    its first line, so the line bash names in an error ("line 4: ...: Read-only file
    system") is the task's own line 4."""
    steps = ["[ ! -f ~/.bashrc ] || . ~/.bashrc"]
    if phase == "setup":
        steps += [f"unset {key}" for key in SETUP_UNSET if key not in env]
    steps += [f"export {key}={_sh_word(str(value))}" for key, value in env.items()]
    if "PYTHONPATH" in env:  # the task's own, and still the node's sitecustomize (agent.site_hook)
        steps.append(f'export PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}$HOME/{shell.SITE_DIR}"')
    if cwd:
        target = "~/" + _sh_word(cwd[2:]) if cwd.startswith("~/") else _sh_word(cwd)
        steps.append(f'{{ cd {target} 2>/dev/null || cd "$HOME"; }}')
    else:
        steps.append('cd "$HOME"')
    return "; ".join(steps) + "; " + script + "\n"


def program_env(program: str) -> dict[str, str]:
    """The environment that carries a rank's program to its bash (``shell.PROGRAM_VAR``): a
    command line is every user's to read (``ps``), an environment its owner's only."""
    env = dict(os.environ)
    env[shell.PROGRAM_VAR] = program
    return env


def supervised_here(program: str, cgroup: str, *, capture_stderr: bool) -> Child:
    """The rank under a bash supervisor on this node (the head's own rank, where no server runs
    it), in a cgroup made here (:func:`job_cgroup`), which it removes; "" for one it makes."""
    argv = ["/bin/bash", "-c", RANK_SUPERVISOR, shell.RANK_ARGV0, "", cgroup]
    return Child(argv, capture_stderr=capture_stderr, env=program_env(program))


_CGROUP_ROOT: list[str] = []
_made = itertools.count()


def job_cgroup(name: str) -> str:
    """A new cgroup for a rank's job, made here: a ``mkdir`` process per rank cost every run
    ~1 ms on each node.  ``"-"`` where this node has no writable cgroup2 (a pod's is
    read-only): the supervisor then tells the job's processes by their token, without
    trying."""
    root = cgroup_root()
    if root == "-":
        return "-"
    path = f"{root}/{shell.CGROUP_PREFIX}{name}"
    try:
        os.mkdir(path)
    except OSError:
        return "-"
    return path


def remove_cgroup(path: str) -> None:
    """A rank's job cgroup, once its rank is over; left where a process of the rank is still
    in it (the node's teardown removes it)."""
    try:
        os.rmdir(path)
    except OSError:
        pass


def cgroup_root() -> str:
    """Where this node's cgroup2 is mounted writable (its last such mount, as the
    supervisor reads it); ``"-"`` for none.  Read once per process."""
    if not _CGROUP_ROOT:
        root = "-"
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) > 3 and fields[2] == "cgroup2":
                    root = fields[1] if "rw" in fields[3].split(",") else "-"
        _CGROUP_ROOT.append(root)
    return _CGROUP_ROOT[0]


def warm_cgroup_moves() -> None:
    """Have the kernel ready, while this run starts, for the moves that put each rank into its
    job's cgroup: a thread moves this process into the cgroup it is in already.

    Why: every move (a write to ``cgroup.procs``) takes one kernel-wide lock, and the first
    move after ~20 ms without one waits out an RCU grace period first (measured here: 0.15 ms
    within 10 ms of another move, 5-10 ms after 25-50 ms without).  A run's ranks are moved
    by their nodes' servers a few milliseconds after it starts; this starts that wait at
    once, off the run's path, and the ranks' moves then find it paid.  Nothing moves, and
    where cgroups are read-only (a pod) it does nothing."""
    if cgroup_root() == "-":
        return
    import threading

    threading.Thread(target=move_into_own_cgroup, daemon=True).start()


def move_into_own_cgroup() -> bool:
    """Move this process into the cgroup it is in (see :func:`warm_cgroup_moves`); whether
    the kernel took the move."""
    try:
        with open("/proc/self/cgroup") as f:
            own = next(line[3:].strip() for line in f if line.startswith("0::"))
        write_cgroup_file(f"{cgroup_root()}{own.rstrip('/')}/cgroup.procs", str(os.getpid()))
    except (OSError, StopIteration):
        return False
    return True


def write_cgroup_file(path: str, text: str) -> None:
    """One write to a cgroup's control file (``cgroup.procs``, ``cgroup.kill``): the kernel
    acts on each write whole, so no buffering and no truncation."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def head_cgroup() -> str:
    """The head's rank's cgroup: named by this agent process and a count, as its supervisor's
    pid is not known before it starts."""
    return job_cgroup(f"{os.getpid()}-{next(_made)}")


def in_step(node: NodeRef, program: str) -> Child:
    """The rank as a job step of the node's allocation (Slurm): srun starts its supervisor
    there, the program in the environment srun passes on, in no cgroup of ours (``"-"``: the
    step's processes are Slurm's to account and to kill)."""
    argv = [*node.step, "/bin/bash", "-c", RANK_SUPERVISOR, shell.RANK_ARGV0, "", "-"]
    return Child(argv, capture_stderr=True, env=program_env(program))


def over_ssh(node: NodeRef, program: str, *, start_server: str | None = None) -> Child:
    """A worker's rank over head-to-worker SSH, its program first on ssh's stdin (sshd passes
    no variable of ours; the supervisor reads it up to a NUL, which no program holds), so that
    it is in no command line on either node.  Called in the rank's own thread: the write may
    wait for ssh to connect."""
    child = Child(worker_ssh_argv(node, start_server=start_server), capture_stderr=True)
    try:
        child.write_stdin(program.encode("utf-8", "surrogateescape") + b"\0")
    except OSError:  # ssh is gone already: its own words on stderr say why
        pass
    return child


def worker_ssh_argv(node: NodeRef, *, start_server: str | None = None) -> list[str]:
    """A worker's rank over head-to-worker SSH: the way when its node has no agent server
    yet, or when the run holds a secret (the agent servers talk plain TCP); ``start_server``
    (the node's python) starts one there first, for the next run."""
    remote = f"exec /bin/bash -c {_sh_quote(RANK_SUPERVISOR)} {shell.RANK_ARGV0}"
    if start_server is not None:
        remote = f"{_sh_quote(start_server)} -I -S ~/.sky/{shell.AGENT_BUNDLE} serve </dev/null; {remote}"
    return ssh_argv(node.ssh_target, remote)


def ssh_argv(target: str, remote: str) -> list[str]:
    """The agent's own ssh to a worker (a rank, a capture of its stacks), over the one
    connection the agent keeps to that worker."""
    # The agent's own hops share one connection per worker (a user's ssh does not: a racing
    # master prints "ControlSocket ... already exists" into the task's output).  /run is
    # private to the node, so the socket path is short and dies with it.  A worker that
    # vanishes (its node killed, its link gone) fails the run in ~3 s, also when it vanishes
    # while the connection is still being made.
    options = {
        "ControlMaster": "auto",
        "ControlPath": "/run/psky-cm-%C",
        "ControlPersist": "120",
        "ConnectTimeout": "4",
        "ServerAliveInterval": "1",
        "ServerAliveCountMax": "3",
    }
    argv = ["ssh", "-T", "-F", os.path.expanduser("~/.ssh/config")]
    for key, value in options.items():
        argv += ["-o", f"{key}={value}"]
    return [*argv, target, remote]


class Rank:
    """One phase of one rank: its process started at once (the head's) or its connection
    made by :meth:`start`'s thread (a worker's), which then reads its output and reports its
    end."""

    def __init__(
        self,
        node: NodeRef,
        spec: RunSpec,
        phase: str,
        script: str,
        env: dict,
        emitter: Emitter,
        door: bytes | None = None,
        masks: list[str] | None = None,
    ) -> None:
        self.rank = node.rank
        self.node = node
        self.spec = spec
        self.phase = phase
        self.emitter = emitter
        #: The secrets' values to mask in what the rank prints (``masking.masked_values``).
        self.masks = masks or []
        self.pid = 0
        self.code: int | None = None
        self._events: list[Event] = []  # of the output read so far, not yet written
        self._logged: list[str] = []
        program = rank_script(script, env, spec.cwd, phase=phase)
        self.cgroup = "-"
        from pytest_sky.agent import remote

        if node.step and (self.rank == 0 or not spec.secrets):
            # A job step (Slurm).  Not a worker's in a run that holds a secret: srun hands a
            # step's environment to the node's slurmd unencrypted, and ssh below encrypts it.
            self.proc: Child | Remote = remote.Remote(node, program, None, lambda: in_step(node, program))
        elif self.rank == 0 and remote.on_server:
            # This run is a fork of the head's server: the server runs the head's rank too,
            # as it runs a worker's (its supervisor's bash would cost the rank ~3 processes),
            # over the head's loopback.  Should it not answer, the rank's supervisor runs here
            # (it makes its own cgroup).
            self.proc = remote.Remote(node, program, door, lambda: supervised_here(program, "", capture_stderr=True))
        elif self.rank == 0:
            self.cgroup = head_cgroup()
            self.proc = supervised_here(program, self.cgroup, capture_stderr=False)
        else:
            # A worker's server talks plain TCP over the cluster network: a run that holds a
            # secret reaches the worker over ssh, program and output encrypted, and starts no
            # server on its way (the next run without one will).
            in_clear = not spec.secrets
            server = sys.executable if remote.on_server and in_clear else None
            self.proc = remote.Remote(
                node, program, door if in_clear else None, lambda: over_ssh(node, program, start_server=server)
            )

    def start(self, ended: Callable[[Rank], None]) -> None:
        """One thread per rank, which reads its output, waits for it, then calls ``ended``
        with it.  A bare thread: ``threading.Thread.start`` waits until the thread runs
        (measured on idle cores: 16 such starts 2 ms, 16 bare ones 0.5 ms; more when busy)."""
        import _thread

        _thread.start_new_thread(self._life, (ended,))

    def _life(self, ended: Callable[[Rank], None]) -> None:
        try:
            fd = self.proc.open()
            self.proc.ended(self._lines(fd, self.proc.exit_mark) if fd >= 0 else None)
            self._wait()
        finally:
            ended(self)

    def _lines(self, fd: int, mark: bytes | None) -> int | None:
        """The rank's output, line by line, from its first (the pid) to its end; the exit code
        that a mark line carried (a worker's server ends the output with one)."""
        pending = b""
        prefix: str | None = None
        held_blank = False  # a blank line may be the one the mark's line starts with
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError as exc:
                self.proc.error = self.proc.error or f"connection lost: {exc.strerror or exc}"
                chunk = b""
            if not chunk:
                break
            pending += chunk
            if prefix is None:
                if b"\n" not in pending:
                    continue
                first, pending = pending.split(b"\n", 1)
                if not first.startswith(PID_MARK):
                    self.proc.error += first.decode("utf-8", "replace")
                    continue
                prefix = self._started(int(first[len(PID_MARK) :].strip() or 0))
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                if mark is not None and raw.startswith(mark):
                    self._flush()
                    return int(raw[len(mark) :] or 255)
                if held_blank:
                    self._emit(b"", prefix)
                held_blank = mark is not None and not raw
                if not held_blank:
                    self._emit(raw, prefix)
            self._flush()
        if prefix is not None:
            for raw in [b""] * held_blank + [pending] * bool(pending):
                self._emit(raw, prefix)
        self._flush()
        return None

    def _started(self, pid: int) -> str:
        """The rank's supervisor said its pid: the prefix of its lines from now on."""
        self.pid = pid
        node = self.node
        self._events.append(StartEvent(self.rank, self.pid, self.phase))
        setup = self.phase == "setup"
        return line_prefix(node.rank, node.name, pid, node.ip, self.spec.num_nodes, self.spec.task_name, setup)

    def _emit(self, raw: bytes, prefix: str) -> None:
        """One line of the rank's: stderr's carry the supervisor's mark (where a stdout line
        had not ended when a stderr line came, the mark is inside it: the part before it is
        stdout's).  Both go to the merged log with the same prefix."""
        stream = STDOUT
        cut = raw.find(ERR_MARK)
        if cut >= 0:
            if cut:
                self._emit(raw[:cut], prefix)
            raw, stream = raw[cut + len(ERR_MARK) :], STDERR
        text = raw.decode("utf-8", "replace")
        if self.masks:  # here, where the output is first read: every record of it is masked
            text = mask(text, self.masks)
        self._events.append(LineEvent(self.rank, text, stream))
        self._logged.append(prefix + text + "\n")

    def _flush(self) -> None:
        """What one read of the rank's output said, as one write to each of the job's files
        and to the client: an event per write had cost the client and the head's sshd a
        packet each."""
        if self._events:
            self.emitter.emit(self._events, "".join(self._logged))
            self._events, self._logged = [], []

    def stop(self) -> None:
        """Close the lifeline: the rank's supervisor stops its whole tree and exits."""
        self.proc.close_stdin()

    def _wait(self) -> None:
        code = self.proc.wait()
        self.code = 128 - code if code < 0 else code
        if self.cgroup != "-":
            remove_cgroup(self.cgroup)  # empty: its supervisor killed what was left before it ended

    def describe(self) -> str:
        where = "head" if self.rank == 0 else f"{self.node.name}, {self.node.ip}"
        return f"rank {self.rank} ({where})"

    def failure(self, phase: str) -> tuple[int, str]:
        """The run's exit code and the one line that says that this rank failed, and how."""
        code = self.code if self.code is not None else 1
        said = mask(self.proc.error, self.masks).strip()
        reason = said.splitlines()[-1] if said else "no output from ssh"
        if self.rank and self.code == 255 and not self.pid:
            return code, f"{phase} failed: {self.describe()} could not be reached from the head: {reason}"
        if self.rank and self.code == 255:
            return code, f"{phase} failed: lost the connection to {self.describe()} ({reason})"
        if not self.pid and said:  # its supervisor never said its pid: srun refused the step, say
            return code, f"{phase} failed: {self.describe()} did not start: {reason}"
        return code, f"{phase} failed on {self.describe()} with exit code {self.code}"
