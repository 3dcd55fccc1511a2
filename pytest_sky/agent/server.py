"""The agent's server: one per node, so that a run costs the head a fork, not an interpreter.

Why: starting ``python -I -S agent.pyz`` costs the head ~20 ms of CPU on every run, and
starting each worker's rank over head-to-worker ssh another ~17 ms per worker (an ssh client
process, its multiplexing, a session on the worker's sshd).  A server that is already running
forks for each request instead: ~1 ms.

Where it listens: TCP port :data:`~pytest_sky.protocol.AGENT_PORT` on every address of its
node.  The client reaches the head's through its own SSH connection (a ``direct-tcpip``
channel to the head's loopback); the head's run reaches each worker's over the cluster
network (:mod:`~pytest_sky.agent.remote`).  Each connection starts with the door's handshake
(:func:`~pytest_sky.protocol.door_request`): only a holder of the cluster's private key, which
is who may ssh to the node, gets any further.  Then one request:

- ``run``: an attached run, exactly as ``agent.pyz run`` over an exec (the connection is its
  stdin and stdout, and its lifeline);
- ``rank NONCE LENGTH``: a worker's rank, LENGTH bytes of program following: the connection
  becomes the rank supervisor's stdin (its lifeline) and stdout, and the supervisor ends the
  output with ``PSKY-EXIT NONCE <exit code>`` (:data:`~pytest_sky.protocol.EXIT_MARK`).

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

import os
import signal
import socket
import sys

from pytest_sky import shell
from pytest_sky.agent import remote
from pytest_sky.agent.remote import secret
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
    """Bind, then fork a child for every connection, for as long as the node lives; ``told``
    is closed once the pid file is written (the starter waits for that)."""
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
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reap themselves
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            try:
                code = _answer(conn, door, run)
            except BaseException:  # noqa: BLE001 - a child that fails leaves, and says why in the log
                import traceback

                traceback.print_exc()
                code = 1
            try:
                sys.stdout.flush()
            except OSError:
                pass
            os._exit(code)
        conn.close()


def _preload() -> None:
    """What a request's child would import anyway, imported once here: a fork shares it.
    ``encodings.idna`` (with ``stringprep``, ``unicodedata`` and ``re``) is what the first
    ``socket.create_connection`` imports to encode a host name, even an address: each run's
    connection to a worker's server paid it again, before that rank could start."""
    import encodings.idna  # noqa: F401
    import threading  # noqa: F401

    from pytest_sky.agent import fanout, rank, records  # noqa: F401 - fanout, records: preloaded

    rank.cgroup_root()  # read once here, not by every fork


def _read_line(conn: socket.socket, limit: int = 256) -> bytes:
    """One line, and not a byte more (the request's payload follows it on the stream)."""
    while True:
        seen = conn.recv(limit, socket.MSG_PEEK)
        end = seen.find(b"\n")
        if end >= 0:
            return conn.recv(end + 1)
        if not seen or len(seen) >= limit:
            return b""


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise EOFError("the request was cut short")
        data += chunk
    return data


def _answer(conn: socket.socket, door: bytes, run: Runner) -> int:
    """One connection: the handshake, then its request."""
    nonce = os.urandom(16).hex().encode()
    # Nagle would hold each event back until the last was acknowledged (a delayed ACK, up to
    # 40 ms).  A head that vanishes without closing (its node killed, its link gone) is
    # noticed as sshd's ClientAliveInterval 5 / ClientAliveCountMax 3 noticed it: the rank's
    # lifeline then reads an error, and the rank is stopped.
    keep_alive(conn, every=5, probes=3)
    conn.settimeout(HANDSHAKE_SECONDS)
    conn.sendall(GREETING + nonce + b"\n")
    request = door_request(door, nonce, _read_line(conn))
    if request is None:
        return 1
    words = request.split(" ")
    if words[0] == "rank" and len(words) == 3:
        program = _read_exactly(conn, int(words[2])).decode()
        conn.settimeout(None)
        _exec_rank(conn, program, words[1])
    if words[0] != "run":
        return 2
    conn.settimeout(None)
    for fd in (0, 1):
        os.dup2(conn.fileno(), fd)
    conn.close()
    remote.on_server = True
    return run()


def _exec_rank(conn: socket.socket, program: str, mark: str) -> None:
    """Become the rank's supervisor, the connection its stdin and stdout (never returns); its
    cgroup made here, named by its pid (this process's: it execs), and removed by it."""
    from pytest_sky.agent.rank import RANK_SUPERVISOR, job_cgroup

    for fd in (0, 1):
        os.dup2(conn.fileno(), fd)
    conn.close()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as an sshd session's would be
    cgroup = job_cgroup(str(os.getpid()))
    argv = ["/bin/bash", "-c", RANK_SUPERVISOR, shell.RANK_ARGV0, program, f"{EXIT_MARK} {mark}", cgroup, "1"]
    os.execv("/bin/bash", argv)
