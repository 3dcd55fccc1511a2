"""A rank that a node's agent server runs itself: the rank supervisor's contract, in Python.

Why: the bash supervisor (``shell/rank_supervisor.sh``) costs every rank an interpreter of
its own, a fork for the rank's process group and another for the lifeline's reader, on top
of the rank's own bash.  Measured on 8 local nodes, bash was half of a run's CPU, and a
run's wall time follows its CPU on two cores.  The server is already running, so it keeps
the same account with no process of its own: it spawns the rank's bash directly and
watches the rank's end, its lifeline and its grace from its one epoll loop.

The contract is the bash supervisor's, which still serves the ranks that reach a node over
ssh (a worker whose server has not started yet) or by an exec (a head's first run):

- the rank's bash leads a process group of its own and enters the job's cgroup (where the
  node has a writable cgroup2) before it runs anything: it waits at a gate on fd 3 until the
  server has moved it, and the pid line is out before the rank can print or be stopped;
- every process of the job carries the job's token in its environment, whatever its parent
  (where cgroups are read-only, as in a pod, the token is how they are told apart);
- the connection is the rank's stdout, and its lifeline: when the head closes it, every
  process of the job gets SIGTERM, a grace of :data:`GRACE_SECONDS` to stop its own
  children, then SIGKILL;
- the rank's stderr is a pipe the server reads: each line goes to the connection behind
  ``shell.STDERR_MARK`` (how the head tells the streams apart), sent as the connection takes
  it, never waited for (the server's one thread serves every rank of its node); until a
  backlog has gone, the pipe is not read, so a rank whose head reads slowly waits in its
  own writes, as it does on stdout;
- whatever the rank leaves running when its bash ends is killed at once;
- the output ends with the mark line and the exit status, once every process of the job is
  gone and what it wrote to stderr has gone before it; the cgroup is removed after the mark.

Stdlib only: it runs inside the agent's bundle.
"""

from __future__ import annotations

import os
import signal
import socket
import time

from pytest_sky import procs, shell
from pytest_sky.agent.rank import ERR_MARK, PID_MARK, remove_cgroup, write_cgroup_file
from pytest_sky.protocol import EXIT_MARK

#: How long a stopped job has to end after SIGTERM (the bash supervisor's 50 ticks).
GRACE_SECONDS = 2.5
#: How long SIGKILL is sent again to what is left (a process forked meanwhile) before the
#: rank is given up as ended (the bash supervisor's 100 ticks).
KILL_SECONDS = 5.0
#: How often a stopping job is looked at again.
TICK_SECONDS = 0.05
#: What the rank's bash is told to run: wait at the gate, close it, then run the program, which
#: comes in its environment (``shell.PROGRAM_VAR``: a command line is every user's to read).
#: The program is evaluated whole, so the line numbers bash names in errors stay the task's.
RANK_BASH = "read -r _ <&3; exec 3<&-; " + shell.RUN_PROGRAM

#: The longest stderr line kept whole; a longer one goes on in pieces.
LINE_LIMIT = 1 << 16
#: What a rank's process starts with at their defaults, as an sshd session's would: the
#: server ignores them (or, SIGPIPE, Python does).
SESSION_DEFAULTS = (signal.SIGPIPE, signal.SIGCHLD, signal.SIGHUP)


class Supervised:
    """One rank on this node: its bash, its job's account, its connection.

    The server calls :meth:`ended` when the bash's pidfd is readable, :meth:`lifeline`
    when the connection is, :meth:`stderr` when :attr:`err` is, :meth:`push` when the
    connection takes more while :attr:`backlog` waits, and :meth:`tick` at :attr:`next_tick`;
    :attr:`done` says when it has sent its mark and let everything go."""

    def __init__(self, conn: socket.socket, program: bytes, nonce: str, cgroup: str) -> None:
        self.conn = conn
        self.nonce = nonce
        self.cgroup = cgroup if cgroup != "-" else ""
        self.token = f"{shell.JOB_SCOPE_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
        self.code: int | None = None  # the bash's exit status, once reaped
        self.stopping = False  # the lifeline closed
        self.killing = 0.0  # when SIGKILL was first sent (0: not yet)
        self.stop_at = 0.0  # when the lifeline closed
        self.next_tick: float | None = None
        self.finished = False  # the mark is in the backlog
        self.done = False  # ... and sent
        self.pid = self.pidfd = 0
        self.err = -1  # the read end of the rank's stderr, until it ended
        self.backlog = b""  # marked stderr lines (and at last the mark) the connection has not taken
        self._part = b""  # a stderr line not ended yet
        self._spawn(program)

    def _spawn(self, program: bytes) -> None:
        gate_r, gate_w = os.pipe()
        self.err, err_w = os.pipe()
        os.set_blocking(self.err, False)
        try:
            devnull = os.open(os.devnull, os.O_RDONLY)
            fd = self.conn.fileno()
            pairs = ((devnull, 0), (fd, 1), (err_w, 2), (gate_r, 3))
            actions = [(os.POSIX_SPAWN_DUP2, src, dst) for src, dst in pairs]
            env = dict(os.environ)
            env[shell.JOB_SCOPE_VAR] = self.token
            env[shell.PROGRAM_VAR] = program.decode("utf-8", "surrogateescape")
            argv = ["/bin/bash", "-c", RANK_BASH]
            try:
                self.pid = os.posix_spawn(
                    "/bin/bash", argv, env, file_actions=actions, setsigdef=SESSION_DEFAULTS, setpgroup=0
                )
            finally:
                os.close(devnull)
            self._watch_and_move()
            try:
                self.conn.sendall(PID_MARK + str(self.pid).encode() + b"\n")
            except OSError:
                self.stopping = True  # the head is gone already: stopped as a closed lifeline would
        except BaseException:
            self.close_stderr()  # no rank to read it of: the server drops the connection
            raise
        finally:
            os.close(err_w)
            os.close(gate_r)
            os.close(gate_w)  # the gate opens: the rank runs
        if self.stopping:
            self._stop(time.monotonic())

    def _watch_and_move(self) -> None:
        """The bash, spawned in the server's cgroup: a pidfd to watch it by, then the move into
        the job's (the run that asked for it warmed the kernel for that move: ``rank.warm_cgroup_moves``)."""
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except OSError:  # nothing to watch it by: it never gets past the gate
            os.killpg(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            raise
        if self.cgroup:
            try:
                write_cgroup_file(f"{self.cgroup}/cgroup.procs", str(self.pid))
            except OSError:  # the cgroup is gone: the job's token tells its processes
                self.cgroup = ""

    # -- events ---------------------------------------------------------------------------

    def ended(self) -> None:
        """The rank's bash is gone: reap it, then see to what it left.  Once only: an event
        of another of its files, handled in the same wakeup, re-arms the pidfd it fired on."""
        if self.code is not None:
            return
        try:
            info = os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:  # reaped by someone else: its status is lost
            self.code = 255
        else:
            if info is None:
                return  # not yet: the pidfd said so early
            status = info.si_status
            self.code = status if info.si_code == os.CLD_EXITED else 128 + status
        now = time.monotonic()
        if self.stopping or self.killing:
            self.tick(now)
            return
        left = self._members()
        if not left:
            self._finish()
            return
        self._send(signal.SIGKILL, left)  # whatever it left running dies with it
        self.killing = now
        self.next_tick = now + TICK_SECONDS

    def lifeline(self) -> None:
        """The connection is readable: the head closed it (nothing else ever comes)."""
        try:
            data = self.conn.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data and not self.stopping and not self.finished:
            self._stop(time.monotonic())

    def stderr(self) -> bool:
        """The rank's stderr is readable: its lines, marked, to the connection.  Whether it
        has ended (the server then stops watching it, and :meth:`close_stderr`)."""
        try:
            chunk = os.read(self.err, LINE_LIMIT)
        except BlockingIOError:
            return False
        except OSError:
            chunk = b""
        self._mark(chunk)
        self.push()
        return not chunk

    def _mark(self, chunk: bytes) -> None:
        """``chunk`` of stderr into the backlog, line by line, each behind the mark; an empty
        chunk is the end, which ends a last line left open."""
        lines = (self._part + chunk).split(b"\n")
        self._part = lines.pop() if chunk else b""
        if not chunk and lines and not lines[-1]:
            lines.pop()
        if len(self._part) >= LINE_LIMIT:
            lines.append(self._part)
            self._part = b""
        if lines:
            self.backlog += b"".join(ERR_MARK + line + b"\n" for line in lines)

    def push(self) -> None:
        """Send what the connection takes now of the backlog (never wait for it)."""
        while self.backlog:
            try:
                sent = self.conn.send(self.backlog, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:  # the head is gone: nobody would read it
                self.backlog = b""
                break
            self.backlog = self.backlog[sent:]
        self.done = self.finished

    def close_stderr(self) -> None:
        if self.err >= 0:
            os.close(self.err)
            self.err = -1

    def _stop(self, now: float) -> None:
        self.stopping = True
        self.stop_at = now
        self._send(signal.SIGTERM)
        self.next_tick = now + TICK_SECONDS

    def tick(self, now: float) -> None:
        """Look again: finish once nothing of the job is left (or SIGKILL has had its time),
        else send what is due."""
        left = self._members()
        if self.code is not None and (not left or (self.killing and now - self.killing >= KILL_SECONDS)):
            self._finish()  # what might be left is the node's teardown's
            return
        if self.killing:
            self._send(signal.SIGKILL, left)
        elif self.stopping and now - self.stop_at >= GRACE_SECONDS:
            self._send(signal.SIGKILL, left)
            self.killing = now
        self.next_tick = now + TICK_SECONDS

    def _finish(self) -> None:
        """Every process of the job is gone (or given up): what is left of its stderr, then
        the mark, with the status."""
        self.next_tick = None
        code = 255 if self.code is None else self.code & 255
        while self.err >= 0:
            try:
                chunk = os.read(self.err, LINE_LIMIT)
            except OSError:  # empty, its writers gone (or given up): the end
                chunk = b""
            self._mark(chunk)
            if not chunk:
                break
        self.backlog += f"\n{EXIT_MARK} {self.nonce} {code}\n".encode()
        self.finished = True
        self.push()

    def release(self) -> None:
        """Once the server has stopped watching them: the connection, the pidfd, the stderr
        pipe, the cgroup."""
        self.conn.close()
        os.close(self.pidfd)
        self.close_stderr()
        if self.cgroup:
            remove_cgroup(self.cgroup)

    # -- the job's account ----------------------------------------------------------------

    def _members(self) -> list[int]:
        """The job's live processes: its cgroup's, else those carrying its token; its bash
        until reaped."""
        found: list[int] = []
        if self.cgroup:
            try:
                with open(f"{self.cgroup}/cgroup.procs") as f:
                    found = [int(p) for p in f.read().split()]
            except OSError:
                pass
        else:
            found = procs.carrying(f"{shell.JOB_SCOPE_VAR}={self.token}".encode())
        if self.code is None and self.pid not in found:
            found.append(self.pid)
        return found

    def _send(self, sig: int, members: list[int] | None = None) -> None:
        """``sig`` to every process of the job, each once."""
        if sig == signal.SIGKILL and self.cgroup:
            try:
                write_cgroup_file(f"{self.cgroup}/cgroup.kill", "1")
                return
            except OSError:
                pass
        for pid in self._members() if members is None else members:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        if sig == signal.SIGKILL and self.code is None:
            try:
                os.killpg(self.pid, sig)
            except OSError:
                pass
