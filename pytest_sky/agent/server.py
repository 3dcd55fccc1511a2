"""The agent's server: one per node, so that a run costs the head a fork, not an interpreter.

Why: starting ``python -I -S agent.pyz`` costs the head ~20 ms of CPU on every run, and
starting each worker's rank over head-to-worker ssh another ~17 ms per worker (an ssh client
process, its multiplexing, a session on the worker's sshd).  A server that is already running
forks for a run instead (~1 ms), and spawns each rank's bash, which it supervises itself,
without even a fork of itself.

Where it listens: TCP port :data:`~pytest_sky.protocol.AGENT_PORT` on every address of its
node.  The client reaches the head's through its own SSH connection (a ``direct-tcpip``
channel to the head's loopback); the head's run reaches each worker's over the cluster
network (:mod:`~pytest_sky.agent.remote`).  Each connection starts with the door's handshake
(:func:`~pytest_sky.protocol.door_request`): only a holder of the cluster's private key, which
is who may ssh to the node, gets any further.  Then one request:

- ``run``: an attached run, exactly as ``agent.pyz run`` over an exec (the connection is its
  stdin and stdout, and its lifeline);
- ``rank NONCE LENGTH``: a rank, LENGTH bytes of program following (in clear: a run that
  holds a secret reaches its workers over ssh instead, DESIGN.md section 4d), which the rank's
  bash gets in its environment: the connection becomes the rank's stdout (its stderr's lines
  relayed onto it behind ``shell.STDERR_MARK``) and its lifeline, and the output ends with
  ``PSKY-EXIT NONCE <exit code>`` (:data:`~pytest_sky.protocol.EXIT_MARK`).  The server
  supervises the rank itself
  (:mod:`~pytest_sky.agent.supervisor`); where pidfds are refused, it spawns the bash rank
  supervisor, which keeps the same contract.

How it starts: nothing on the node starts it at boot.  The first run on a head that has none
(after a launch, after its restart) goes the old way, an exec, and that agent forks a server
on its way (``run --serve``).  Workers get theirs from the second run on: a served run that
finds none reaches the worker over ssh, which starts one first (``serve``); a cluster that
sees one run (most tests) pays no worker an interpreter for a server it never uses.  So a
server carries the environment of an SSH session on the node, as a rank always did, lives
in the node's own process tree and cgroup, and dies with the node.  The leftover check
tells it from a job's leftovers by its pid file (:data:`PID_FILE`).  A worker whose port
stays silent (a network policy that lets only SSH through) gets its ranks over ssh for good
(:mod:`~pytest_sky.agent.remote`).
"""

from __future__ import annotations

import itertools
import os
import select
import signal
import socket
import sys
import time

from pytest_sky import shell
from pytest_sky.agent import remote
from pytest_sky.agent.remote import secret
from pytest_sky.agent.supervisor import SESSION_DEFAULTS, Supervised
from pytest_sky.protocol import AGENT_PORT, EXIT_MARK, GREETING, door_request, keep_alive

#: Where a server writes its pid, under the node's home (the leftover check reads it).
PID_FILE = shell.AGENT_PID_FILE
#: How long a client has to say who it is and what it wants.
HANDSHAKE_SECONDS = 10.0

TYPE_CHECKING = False  # typing's own would cost its import on the agent's every run
if TYPE_CHECKING:
    from collections.abc import Callable

    #: How the server answers a ``run`` request: the agent's own ``run_main`` (given by the
    #: agent's entry, which imports this module: the agent stays above its server).
    Runner = Callable[[], int]


def start_in_background(run: Runner) -> None:
    """Fork a server off this process, which has the interpreter loaded already.  Where one
    runs already, the new one finds the port taken and leaves.

    Returns once the server has written its pid file, or left: until then the leftover
    check, run at once by the same run's rank (or by the next task on a worker, right after
    ``serve``), could not tell the server from a job's agent process and would kill it."""
    ready, told = os.pipe()
    pid = os.fork()
    if pid:
        os.close(told)
        os.waitpid(pid, 0)
        while os.read(ready, 64):  # end of file: the server closed its end, or is gone
            pass
        os.close(ready)
        return
    try:
        os.close(ready)
        os.setsid()
        if os.fork() == 0:
            _serve(run, told)
    finally:
        os._exit(0)


def _detach() -> None:
    """No terminal, no pipe of the session that started it (sshd would wait on them), no
    variable of that session (a rank would read a stale SSH_CONNECTION), home as its cwd."""
    devnull = os.open(os.devnull, os.O_RDWR)
    log = os.open(os.path.expanduser("~/.sky/agent-server.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for fd, target in ((0, devnull), (1, devnull), (2, log)):
        os.dup2(target, fd)
    os.close(devnull)
    os.close(log)
    for key in [k for k in os.environ if k.startswith("SSH_")]:
        del os.environ[key]
    os.chdir(os.path.expanduser("~"))


def _serve(run: Runner, told: int) -> None:
    """Bind, then answer every connection, for as long as the node lives; ``told`` is closed
    once the pid file is written (the starter waits for that)."""
    door = secret()
    if door is None:
        return
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("0.0.0.0", AGENT_PORT))
        listener.listen(256)
    except OSError:
        return  # a server answers already (or the port is taken: runs keep going the old way)
    _detach()
    pid_file = os.path.expanduser("~/" + PID_FILE)
    with open(pid_file + ".tmp", "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(pid_file + ".tmp", pid_file)
    os.close(told)
    _preload()
    # Children reap themselves, unless the server supervises ranks: it needs their status.
    pidfds = _pidfds_work()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL if pidfds else signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _Doorman(listener, door, run, pidfds).forever()


def _preload() -> None:
    """What a request's child would import anyway, imported once here: a fork shares it.
    ``encodings.idna`` (with ``stringprep``, ``unicodedata`` and ``re``) is what the first
    ``socket.create_connection`` imports to encode a host name, even an address: each run's
    connection to a worker's server paid it again, before that rank could start."""
    import encodings.idna  # noqa: F401
    import fcntl  # noqa: F401 - the job records' locks: an extension module each run loaded anew
    import threading  # noqa: F401

    from pytest_sky.agent import fanout, rank, records  # noqa: F401 - fanout, records: preloaded

    rank.cgroup_root()  # read once here, not by every fork


class _Caller:
    """A connection still in its handshake, and what it has said so far."""

    __slots__ = ("conn", "deadline", "mark", "need", "nonce", "program")

    def __init__(self, conn: socket.socket, nonce: bytes) -> None:
        self.conn = conn
        self.nonce = nonce
        self.deadline = time.monotonic() + HANDSHAKE_SECONDS
        self.mark = ""  # a rank's: the nonce its exit line carries ("": its request is not in yet)
        self.need = 0  # a rank's: the length of its program
        self.program = b""


class _Doorman:
    """The server's one thread.  Each connection's handshake is read as its bytes come (a
    client that stalls holds up nobody); then a rank's bash is spawned, with no fork of this
    interpreter, and supervised from here (its end, its lifeline, its grace: no process of
    a supervisor's own), or a run's child is forked.  Measured with perf on 8 nodes, the
    forked interpreters (their copy-on-write faults, then their exec) had been over a third
    of a run's CPU, and then the bash supervisors half of what was left."""

    def __init__(self, listener: socket.socket, door: bytes, run: Runner, pidfds: bool) -> None:
        self.listener = listener
        self.door = door
        self.run = run
        self.epoll = select.epoll()
        self.callers: dict[int, _Caller] = {}
        #: Where this kernel (and a pod's seccomp profile) lets the server watch its children
        #: by pidfd, it supervises each rank itself; elsewhere each rank has its bash supervisor.
        self.pidfds = pidfds
        #: The ranks it supervises, by their bash's pidfd, by their connection and by the
        #: read end of their stderr.
        self.ranks: dict[int, Supervised] = {}
        self.lifelines: dict[int, Supervised] = {}
        self.stderrs: dict[int, Supervised] = {}
        #: The pidfds of its forked runs, reaped here once readable.
        self.forks: set[int] = set()
        self.made = itertools.count()
        listener.setblocking(False)
        self.epoll.register(listener.fileno(), select.EPOLLIN)

    def forever(self) -> None:
        while True:
            for fd, mask in self.epoll.poll(self._timeout()):
                try:
                    self._event(fd, mask)
                except Exception:  # noqa: BLE001 - a failure ends that connection only, said in the log
                    import traceback

                    traceback.print_exc()
                    if fd in self.callers:
                        self._drop(self.callers[fd])
            now = time.monotonic()
            for caller in [c for c in self.callers.values() if c.deadline <= now]:
                self._drop(caller)
            for rank in [r for r in self.ranks.values() if r.next_tick is not None and r.next_tick <= now]:
                rank.tick(now)
                self._settle(rank)

    def _timeout(self) -> float:
        due = [c.deadline for c in self.callers.values()]
        due += [r.next_tick for r in self.ranks.values() if r.next_tick is not None]
        if not due:
            return -1
        return max(0.0, min(due) - time.monotonic())

    def _event(self, fd: int, mask: int) -> None:
        if fd == self.listener.fileno():
            self._admit()
        elif fd in self.ranks:
            rank = self.ranks[fd]
            rank.ended()
            self._settle(rank)
        elif fd in self.stderrs:
            rank = self.stderrs[fd]
            if rank.stderr():
                self._unwatch_stderr(rank)
            self._settle(rank)
        elif fd in self.lifelines:
            rank = self.lifelines[fd]
            if mask & select.EPOLLOUT:
                rank.push()
            if mask & ~select.EPOLLOUT:
                rank.lifeline()
            self._settle(rank)
        elif fd in self.forks:
            self.epoll.unregister(fd)
            self.forks.discard(fd)
            _reap(fd)
        elif fd in self.callers:
            self._hear(self.callers[fd])

    def _settle(self, rank: Supervised) -> None:
        """After an event of a rank: watch again what may say more (the pidfd and the
        connection are one-shot: a reaped bash's pidfd and a closed connection stay
        readable); the connection for room while a backlog waits, and the stderr pipe only
        while none does; let it all go once done."""
        if rank.done:
            self._unwatch_stderr(rank)
            self.epoll.unregister(rank.pidfd)
            self.epoll.unregister(rank.conn.fileno())
            del self.ranks[rank.pidfd]
            del self.lifelines[rank.conn.fileno()]
            rank.release()
            return
        if rank.code is None:
            self.epoll.modify(rank.pidfd, select.EPOLLIN | select.EPOLLONESHOT)
        events = select.EPOLLOUT if rank.backlog else 0
        if not rank.stopping and not rank.finished:
            events |= select.EPOLLIN | select.EPOLLRDHUP
        if events:
            self.epoll.modify(rank.conn.fileno(), events | select.EPOLLONESHOT)
        if rank.err in self.stderrs:
            self.epoll.modify(rank.err, 0 if rank.backlog else select.EPOLLIN)

    def _unwatch_stderr(self, rank: Supervised) -> None:
        if rank.err in self.stderrs:
            self.epoll.unregister(rank.err)
            del self.stderrs[rank.err]
            rank.close_stderr()

    def _admit(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, ConnectionError):
            return
        nonce = os.urandom(16).hex().encode()
        # Nagle would hold each event back until the last was acknowledged (a delayed ACK, up
        # to 40 ms).  A head that vanishes without closing (its node killed, its link gone) is
        # noticed as sshd's ClientAliveInterval 5 / ClientAliveCountMax 3 noticed it: the
        # rank's lifeline then reads an error, and the rank is stopped.
        keep_alive(conn, every=5, probes=3)
        conn.setblocking(True)  # a new connection's buffer takes the greeting whole
        try:
            conn.sendall(GREETING + nonce + b"\n")
        except OSError:
            conn.close()
            return
        conn.setblocking(False)
        self.callers[conn.fileno()] = _Caller(conn, nonce)
        # Edge-triggered: a request line that came in part is looked at again when more comes,
        # not in a loop meanwhile (it is peeked at, not read: a run's stdin follows it).
        self.epoll.register(conn.fileno(), select.EPOLLIN | select.EPOLLET)

    def _hear(self, caller: _Caller) -> None:
        conn = caller.conn
        if not caller.mark:
            try:
                seen = conn.recv(256, socket.MSG_PEEK)
            except BlockingIOError:
                return
            end = seen.find(b"\n")
            if end < 0:
                if not seen or len(seen) >= 256:
                    self._drop(caller)
                return
            request = door_request(self.door, caller.nonce, seen[: end + 1])
            words = request.split(" ") if request is not None else []
            conn.recv(end + 1)
            if words == ["run"]:
                self._fork_run(caller)
                return
            if len(words) != 3 or words[0] != "rank" or not words[2].isdigit() or not words[1]:
                self._drop(caller)
                return
            caller.mark, caller.need = words[1], int(words[2])
        while len(caller.program) < caller.need:
            try:
                chunk = conn.recv(min(caller.need - len(caller.program), 1 << 20))
            except BlockingIOError:
                return
            if not chunk:
                self._drop(caller)
                return
            caller.program += chunk
        self._spawn_rank(caller)

    def _forget(self, caller: _Caller) -> socket.socket:
        fd = caller.conn.fileno()
        self.epoll.unregister(fd)
        del self.callers[fd]
        caller.conn.setblocking(True)
        return caller.conn

    def _drop(self, caller: _Caller) -> None:
        self._forget(caller).close()

    def _spawn_rank(self, caller: _Caller) -> None:
        """The rank, in a cgroup made here and named by this server and a count: supervised
        here (:class:`~pytest_sky.agent.supervisor.Supervised`) where pidfds work, else by
        its bash supervisor, with the connection its stdin (its lifeline) and stdout."""
        from pytest_sky.agent.rank import RANK_SUPERVISOR, job_cgroup, program_env, remove_cgroup

        conn = self._forget(caller)
        cgroup = job_cgroup(f"{os.getpid()}-{next(self.made)}")
        if self.pidfds:
            try:
                rank = Supervised(conn, caller.program, caller.mark, cgroup)
            except OSError:
                conn.close()
                remove_cgroup(cgroup)
                return
            self.ranks[rank.pidfd] = rank
            self.lifelines[conn.fileno()] = rank
            self.stderrs[rank.err] = rank
            self.epoll.register(rank.pidfd, select.EPOLLIN | select.EPOLLONESHOT)
            self.epoll.register(conn.fileno(), select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLONESHOT)
            self.epoll.register(rank.err, select.EPOLLIN)
            return
        env = program_env(caller.program.decode("utf-8", "surrogateescape"))
        mark = f"{EXIT_MARK} {caller.mark}"
        argv = ["/bin/bash", "-c", RANK_SUPERVISOR, shell.RANK_ARGV0, mark, cgroup, "1"]
        actions = [(os.POSIX_SPAWN_DUP2, conn.fileno(), 0), (os.POSIX_SPAWN_DUP2, conn.fileno(), 1)]
        try:
            os.posix_spawn("/bin/bash", argv, env, file_actions=actions, setsigdef=SESSION_DEFAULTS)
        except OSError:
            remove_cgroup(cgroup)
        finally:
            conn.close()

    def _fork_run(self, caller: _Caller) -> None:
        """An attached run, exactly as ``agent.pyz run`` over an exec: a fork, the connection
        its stdin and stdout (and its lifeline)."""
        conn = self._forget(caller)
        pid = os.fork()
        if pid:
            conn.close()
            self._reap_later(pid)
            return
        code = 1
        try:
            # Nothing of the server's stays open in the run: another client's connection held
            # here would never see its end.
            self.epoll.close()
            self.listener.close()
            for fd in [*self.ranks, *self.lifelines, *self.stderrs, *self.forks, *self.callers]:
                os.close(fd)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            for fd in (0, 1):
                os.dup2(conn.fileno(), fd)
            conn.close()
            remote.on_server = True
            code = self.run()
        except BaseException:  # noqa: BLE001 - a run that fails leaves, and says why in the log
            import traceback

            traceback.print_exc()
        try:
            sys.stdout.flush()
        except OSError:
            pass
        os._exit(code)

    def _reap_later(self, pid: int) -> None:
        """A forked run is reaped here once it ends (where pidfds work: SIGCHLD is not
        ignored there, so that a supervised rank's exit status can be had)."""
        if not self.pidfds:
            return
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # cannot be, for a child of ours: pidfds work here
            return
        self.forks.add(pidfd)
        self.epoll.register(pidfd, select.EPOLLIN)


def _reap(pidfd: int) -> None:
    try:
        os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
    except ChildProcessError:
        pass
    os.close(pidfd)


def _pidfds_work() -> bool:
    """Whether this kernel (and a pod's seccomp profile) lets the server watch its children
    by pidfd (Linux 5.3); where not, each supervisor removes its own cgroup."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True
