"""A rank as the head starts it through its node's agent server, else over ssh.

The server (:mod:`~pytest_sky.agent.server`) spawns the rank's bash and supervises it
(:mod:`~pytest_sky.agent.supervisor`), with this connection as its stdout and its lifeline: no
ssh client process on the head, no session on the worker's sshd.  A worker with no server
yet refuses the connection; the rank then goes over ssh as it always did, and, when this run
is itself a fork of the head's server (:data:`on_server`), that session starts the worker's
server for the next run.

A worker that dies or drops off the network while its rank runs is noticed as ssh's
``ServerAliveInterval=1``/``ServerAliveCountMax=3`` noticed it: TCP keepalives every second,
the connection given up after three unanswered (the kernel answers them, however busy the
worker's CPUs are).
"""

from __future__ import annotations

import os
import socket
import threading

from pytest_sky.agent.child import Child
from pytest_sky.protocol import (
    AGENT_PORT,
    EXIT_MARK,
    GREETING,
    NodeRef,
    door_answer,
    door_secret,
    keep_alive,
    read_greeting,
)

TYPE_CHECKING = False  # typing's own would cost its import on the agent's every run
if TYPE_CHECKING:
    from collections.abc import Callable

#: How long a worker's port may stay silent before its ranks go over ssh instead.
CONNECT_SECONDS = 2.0
#: Where the head remembers workers whose port stayed silent (one empty file per address).
_FILTERED = os.path.expanduser("~/.sky/agent-filtered")
#: Data left unacknowledged this long gives up too (a lifeline closed into a dead link).
_USER_TIMEOUT_MS = 4000


_SECRET: list[bytes] = []

#: Whether this process is a fork of its node's agent server (the server sets it).  Only such
#: a run starts a server on a worker that has none: a cluster's first run is an exec, and a
#: cluster that sees one run (most tests) would pay an interpreter start on every worker for
#: a server it never uses.
on_server = False


def secret() -> bytes | None:
    """This node's door secret (every node's server has the same), from the cluster key in
    its home; None where there is none."""
    if not _SECRET:
        try:
            with open(os.path.expanduser("~/.ssh/id_ed25519"), "rb") as f:
                _SECRET.append(door_secret(f.read()))
        except OSError:
            return None
    return _SECRET[0]


class Remote:
    """One rank's process reached through its node's server (or ssh), as
    :class:`~pytest_sky.agent.rank.Rank` drives it: the same calls as a local
    :class:`~pytest_sky.agent.rank.Child`, its output opened by the reader."""

    def __init__(self, node: NodeRef, program: str, secret: bytes | None, fallback: Callable[[], Child]) -> None:
        self.node = node
        self.program = program
        #: The door's secret; None: the rank goes the fallback's way at once.
        self.secret = secret
        #: Starts the rank where the node has no server to ask (over ssh, which starts one):
        #: called only then, as most runs never need it.
        self.fallback = fallback
        #: The line that ends the rank's output when a server started it (None over ssh).
        self.exit_mark: bytes | None = None
        self.returncode: int | None = None
        #: Why the worker could not be reached, or was lost (ssh's own words over ssh).
        self.error = ""
        self.via_ssh: Child | None = None
        self._err_reader: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._stopped = False
        self._ended = threading.Event()
        self._lock = threading.Lock()

    # -- started by the rank's reader thread -------------------------------------------------

    def open(self) -> int:
        """Start the rank; the file descriptor its output comes on (-1: it could not start)."""
        sock = self._dial() if self.secret is not None else None
        if sock is not None:
            with self._lock:
                self._sock = sock
                if self._stopped:
                    self._shutdown(socket.SHUT_WR)
            return sock.fileno()
        if self.error:
            return -1
        child = self.fallback()  # outside the lock: it may wait to hand ssh the program
        with self._lock:
            self.via_ssh = child
            if self._stopped:
                child.close_stdin()
        self._err_reader = threading.Thread(target=self._read_ssh_errors, args=(self.via_ssh.stderr,), daemon=True)
        self._err_reader.start()
        return self.via_ssh.stdout

    def _read_ssh_errors(self, fd: int) -> None:
        data = b""
        while chunk := _read_some(fd):
            data += chunk
        os.close(fd)
        self.error += data.decode("utf-8", "replace").strip()

    def _dial(self) -> socket.socket | None:
        """The rank, started by the worker's server; None where it is to go over ssh (the
        worker has no server of ours, or its port does not answer), ``error`` set where the
        worker cannot be reached at all."""
        filtered = os.path.join(_FILTERED, self.node.ip)
        if os.path.exists(filtered):
            return None
        try:
            sock = socket.create_connection((self.node.ip, AGENT_PORT), timeout=CONNECT_SECONDS)
        except ConnectionRefusedError:
            return None
        except TimeoutError:
            # Silence: a network policy may let only SSH through, or the worker is gone (ssh
            # then says so).  Remembered, so that every later run goes straight to ssh.
            os.makedirs(_FILTERED, exist_ok=True)
            open(filtered, "w").close()
            return None
        except OSError as exc:  # no route to it: the worker is gone
            self.error = f"{self.node.ip}: {exc.strerror or exc}"
            return None
        try:
            _keep_alive(sock)
            greeting = read_greeting(sock.recv)
            if not greeting.startswith(GREETING):
                sock.close()
                return None  # not our server: ssh's way
            nonce = os.urandom(8).hex()
            body = self.program.encode("utf-8", "surrogateescape")
            assert self.secret is not None
            sock.sendall(door_answer(self.secret, greeting, f"rank {nonce} {len(body)}") + body)
            sock.settimeout(None)
        except OSError:
            sock.close()
            return None
        self.exit_mark = f"{EXIT_MARK} {nonce} ".encode()
        return sock

    def ended(self, code: int | None) -> None:
        """The reader is done: with the code the mark carried (None: the output ended without one)."""
        if self.via_ssh is not None:
            self.via_ssh.ended(code)
            assert self._err_reader is not None
            self._err_reader.join(2)
        elif self._sock is not None:
            self.returncode = 255 if code is None else code
            if code is None and not self.error:
                self.error = "the connection to its agent server was lost"
            with self._lock:
                self._sock.close()
        else:
            self.returncode = 255
        self._ended.set()

    # -- as a Child ---------------------------------------------------------------------------

    def close_stdin(self) -> None:
        with self._lock:
            self._stopped = True
            if self._sock is not None:
                self._shutdown(socket.SHUT_WR)
            elif self.via_ssh is not None:
                self.via_ssh.close_stdin()

    def _shutdown(self, how: int) -> None:
        try:
            self._sock.shutdown(how)  # type: ignore[union-attr]
        except OSError:
            pass

    def wait(self) -> int:
        self._ended.wait()
        if self.via_ssh is not None:
            self.returncode = self.via_ssh.wait()
        assert self.returncode is not None
        return self.returncode

    def poll(self) -> int | None:
        if self.via_ssh is not None:
            return self.via_ssh.poll()
        return self.returncode if self._ended.is_set() else None

    def kill(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._shutdown(socket.SHUT_RDWR)
            elif self.via_ssh is not None:
                self.via_ssh.kill()


def _read_some(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""


def _keep_alive(sock: socket.socket) -> None:
    keep_alive(sock, every=1, probes=3)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, _USER_TIMEOUT_MS)
