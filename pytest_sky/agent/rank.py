"""One rank on one node, as the head starts it: the rank's program, its supervisor, its output.

Each rank runs under the rank supervisor (``shell/rank_supervisor.sh``, bash: a Python one
cost ~30 ms of interpreter start per node per run), locally for the head and over
head-to-worker SSH for a worker.  The supervisor's first line is the pid of the rank's
session (``shell.PID_MARK``); every line after it is the rank's output, which
:class:`Rank` hands to the job's :class:`~pytest_sky.agent.records.Emitter` as it comes.
Closing a rank's stdin (its lifeline) stops its whole tree.
"""

from __future__ import annotations

import os
import signal

from pytest_sky import shell
from pytest_sky.agent.records import Emitter
from pytest_sky.naming import line_prefix
from pytest_sky.protocol import LineEvent, NodeRef, RunSpec, StartEvent

#: How long the head waits, past a rank's own grace, for ranks it told to stop.
STOP_GRACE_SECONDS = 2.0

#: The supervisor's text, passed to ``bash -c`` (read once per agent process).
RANK_SUPERVISOR = shell.script(shell.RANK_SUPERVISOR)
PID_MARK = shell.PID_MARK.encode() + b" "

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
    it, the working directory, and the task's script.  All that comes before the script is on
    its first line, so the line bash names in an error ("line 4: ...: Read-only file
    system") is the task's own line 4."""
    steps = ["[ ! -f ~/.bashrc ] || . ~/.bashrc"]
    if phase == "setup":
        steps += [f"unset {key}" for key in SETUP_UNSET if key not in env]
    steps += [f"export {key}={_sh_word(str(value))}" for key, value in env.items()]
    if cwd:
        target = "~/" + _sh_word(cwd[2:]) if cwd.startswith("~/") else _sh_word(cwd)
        steps.append(f'{{ cd {target} 2>/dev/null || cd "$HOME"; }}')
    else:
        steps.append('cd "$HOME"')
    return "; ".join(steps) + "; " + script + "\n"


class Child:
    """A spawned process with pipes, without the subprocess module (~25 ms to import)."""

    def __init__(self, argv: list[str], *, capture_stderr: bool) -> None:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe() if capture_stderr else (-1, -1)
        actions = [(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1)]
        if capture_stderr:
            actions.append((os.POSIX_SPAWN_DUP2, err_w, 2))
        # Pipes are close-on-exec (PEP 446): the child keeps only what dup2 put on 0, 1, 2.
        self.pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=actions)
        for fd in (in_r, out_w, err_w):
            if fd >= 0:
                os.close(fd)
        self.stdin: int | None = in_w
        self.stdout = out_r
        self.stderr = err_r
        self.returncode: int | None = None

    def close_stdin(self) -> None:
        if self.stdin is not None:
            try:
                os.close(self.stdin)
            except OSError:
                pass
            self.stdin = None

    def write_stdin(self, data: bytes) -> None:
        assert self.stdin is not None
        while data:
            data = data[os.write(self.stdin, data) :]

    def wait(self) -> int:
        while self.returncode is None:
            try:
                _, status = os.waitpid(self.pid, 0)
            except ChildProcessError:  # reaped by a concurrent poll(), which set returncode
                if self.returncode is None:
                    self.returncode = 255
                break
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass


def rank_argv(node: NodeRef, program: str) -> list[str]:
    """The head runs its rank itself; a worker's goes over head-to-worker SSH."""
    if node.rank == 0:
        return ["/bin/bash", "-c", RANK_SUPERVISOR, shell.RANK_ARGV0, program]
    # The agent's own hops share one connection per worker (a user's ssh does not: a racing
    # master prints "ControlSocket ... already exists" into the task's output).  /run is
    # private to the node, so the socket path is short and dies with it.  A worker that
    # vanishes (its node killed, its link gone) fails the run in ~3 s, also when it vanishes
    # while the connection is still being made.
    remote = f"exec /bin/bash -c {_sh_quote(RANK_SUPERVISOR)} {shell.RANK_ARGV0} {_sh_quote(program)}"
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
    return [*argv, node.ssh_target, remote]


class Rank:
    """One phase of one rank, started at once; its output read by threads of its own."""

    def __init__(self, node: NodeRef, spec: RunSpec, phase: str, script: str, env: dict, emitter: Emitter) -> None:
        import threading

        self.rank = node.rank
        self.node = node
        self.spec = spec
        self.phase = phase
        self.emitter = emitter
        self.pid = 0
        self.code: int | None = None
        self.ssh_error = ""
        self.proc = Child(
            rank_argv(node, rank_script(script, env, spec.cwd, phase=phase)), capture_stderr=bool(self.rank)
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        if self.rank:
            self.err_reader = threading.Thread(target=self._read_err, daemon=True)
            self.err_reader.start()

    def _read_err(self) -> None:
        data = b""
        while True:
            try:
                chunk = os.read(self.proc.stderr, 65536)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
        os.close(self.proc.stderr)
        self.ssh_error = data.decode("utf-8", "replace").strip()

    def _read(self) -> None:
        fd = self.proc.stdout
        pending = b""
        prefix: str | None = None
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            pending += chunk
            if prefix is None:
                if b"\n" not in pending:
                    continue
                first, pending = pending.split(b"\n", 1)
                if not first.startswith(PID_MARK):
                    self.ssh_error += first.decode("utf-8", "replace")
                    continue
                self.pid = int(first[len(PID_MARK) :].strip() or 0)
                node = self.node
                prefix = line_prefix(node.rank, node.name, self.pid, node.ip, self.spec.num_nodes, self.spec.task_name)
                self.emitter.event(StartEvent(self.rank, self.pid, self.phase))
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                self._emit(raw, prefix)
        if pending and prefix is not None:
            self._emit(pending, prefix)
        os.close(fd)

    def _emit(self, raw: bytes, prefix: str) -> None:
        text = raw.decode("utf-8", "replace")
        self.emitter.event(LineEvent(self.rank, text))
        self.emitter.log(prefix + text + "\n")

    def stop(self) -> None:
        """Close the lifeline: the rank's supervisor stops its whole tree and exits."""
        self.proc.close_stdin()

    def wait(self) -> int:
        code = self.proc.wait()
        self.reader.join()
        if self.rank:
            self.err_reader.join(2)
        self.code = 128 - code if code < 0 else code
        return self.code

    def describe(self) -> str:
        where = "head" if self.rank == 0 else f"{self.node.name}, {self.node.ip}"
        return f"rank {self.rank} ({where})"

    def failure(self, phase: str) -> tuple[int, str]:
        """The run's exit code and the one line that says that this rank failed, and how."""
        code = self.code if self.code is not None else 1
        reason = self.ssh_error.strip().splitlines()[-1] if self.ssh_error.strip() else "no output from ssh"
        if self.rank and self.code == 255 and not self.pid:
            return code, f"{phase} failed: {self.describe()} could not be reached from the head over SSH: {reason}"
        if self.rank and self.code == 255:
            return code, f"{phase} failed: lost the SSH connection to {self.describe()} ({reason})"
        return code, f"{phase} failed on {self.describe()} with exit code {self.code}"
