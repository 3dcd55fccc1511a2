"""The ProxyCommand of a Kubernetes cluster's ssh config: a pod's sshd, through the cluster's
forwarder (``kube_forwarder``), in milliseconds (DESIGN.md section 6, "Reaching the head").

``python -I -S -c <import this module> --socket PATH --namespace NS --pod POD [--port N]
[--kubeconfig K] [--context C]``, under ``ProxyUseFdpass yes`` (:func:`command`).

A proxy that loads the kubernetes client costs most of a CPU second, and twenty of them at
once saturate two cores.  This one asks the forwarder, which holds the API server
configuration, for a new port-forward stream to the pod, gets back the stream's socket
(passed over the unix socket, ``SCM_RIGHTS``) once the pod's SSH banner has come through it
(ready by construction; the banner stays unread for ssh), hands that socket to ssh the same
way and exits: nothing relays the session's bytes but the forwarder.  It imports nothing but
``os``, ``sys`` and ``_socket`` and runs without the site packages (``-I -S``): ``socket``
alone would cost it 12 ms (its enums), as much as the interpreter's start; ``-c`` imports the
module, so its bytecode is cached where a script's would be compiled on every connection.

Where no forwarder answers (it died, or the cluster was launched by an older pytest-sky), it
hands ssh one end of a socket pair and leaves the self-contained proxy, ``python -m
pytest_sky.ssh.kube_proxy`` with the same arguments, relaying the other end: slower, never
broken.  A cluster kept across an upgrade keeps what an older pytest-sky made: an ssh config
without ``ProxyUseFdpass`` (ssh gives pipes, not a socket) or a forwarder that read the banner
itself; then this process relays the session, as it always did before.

The request and the reply are the protocol both sides import from here: plain classes and one
text line each, because ``dataclasses`` alone would cost this process 29 ms, and ``json`` and
``argparse`` (with the ``re`` they pull in) another 15.
"""

from __future__ import annotations

import _socket
import os
import sys

TYPE_CHECKING = False  # typing itself costs milliseconds here
if TYPE_CHECKING:
    import argparse
    import socket

#: How long the forwarder may take to open the stream and see the banner before giving up.
BANNER_TIMEOUT = 30.0
_MAX_LINE = 65536
_FD_BYTES = 4  # a descriptor in SCM_RIGHTS is a C int


class DialRequest:
    """What the dialler asks for: one new port-forward stream to ``pod``'s ``port``.

    On the wire, one line: ``<namespace> <pod> <port>`` (Kubernetes names hold no spaces)."""

    __slots__ = ("namespace", "pod", "port")

    def __init__(self, namespace: str, pod: str, port: int = 22) -> None:
        self.namespace = namespace
        self.pod = pod
        self.port = port

    def encode(self) -> bytes:
        return f"{self.namespace} {self.pod} {self.port}\n".encode()

    @classmethod
    def decode(cls, line: bytes) -> DialRequest:
        namespace, pod, port = line.decode().split()
        return cls(namespace, pod, int(port))


class DialReply:
    """The forwarder's answer: the stream is ready (its socket comes with this message, the
    pod's banner unread in it), or why there is none.

    On the wire, one line: ``OK`` or ``ERR <one line>``.  A forwarder of an older pytest-sky
    (a kept cluster's, still running) read the banner itself and sends ``OK <its bytes in
    hex>``: whoever uses the stream must then be given them first (``banner``)."""

    __slots__ = ("banner", "error")

    def __init__(self, error: str | None = None, banner: bytes = b"") -> None:
        self.error = error
        self.banner = banner

    def encode(self) -> bytes:
        if self.error is not None:
            return b"ERR " + " ".join(self.error.split()).encode() + b"\n"
        return b"OK\n"

    @classmethod
    def decode(cls, line: bytes) -> DialReply:
        status, _, rest = line.strip().partition(b" ")
        if status == b"OK":
            return cls(banner=bytes.fromhex(rest.decode()))
        return cls(error=rest.decode(errors="replace") or "the forwarder gave no reason")


def read_line(sock: _socket.socket, timeout: float) -> tuple[bytes, list[int]]:
    """One newline-ended message from ``sock`` and any descriptors that came with it."""
    sock.settimeout(timeout)
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, ancillary, _, _ = sock.recvmsg(_MAX_LINE, _socket.CMSG_SPACE(_FD_BYTES))
        for level, kind, payload in ancillary:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds.append(int.from_bytes(payload[:_FD_BYTES], sys.byteorder))
        if not chunk:
            raise ConnectionError("the other side closed before its message ended")
        data += chunk
        if len(data) > _MAX_LINE:
            raise ConnectionError("a message longer than any of the protocol's")
    return data, fds


def send_fd(sock: _socket.socket, message: bytes, fd: int) -> None:
    """``message`` with a copy of ``fd`` alongside (``SCM_RIGHTS``)."""
    sock.sendmsg([message], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fd.to_bytes(_FD_BYTES, sys.byteorder))])


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The arguments that name a pod's port-forward, for the fallback proxy (``kube_proxy``);
    this module reads the same ones by hand (:func:`_options`: argparse costs it 11 ms)."""
    import argparse

    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--namespace", required=True)
    p.add_argument("--pod", required=True)
    p.add_argument("--port", type=int, default=22)
    p.add_argument("--context")
    p.add_argument("--kubeconfig")
    return p


def route_args(namespace: str, pod: str, port: int, kubeconfig: str | None, context: str | None) -> list[str]:
    """The inverse of :func:`parser`: the arguments that name this port-forward."""
    args = ["--namespace", namespace, "--pod", pod]
    if port != 22:
        args += ["--port", str(port)]
    if kubeconfig:
        args += ["--kubeconfig", kubeconfig]
    if context:
        args += ["--context", context]
    return args


def command(socket_path: str, args: list[str]) -> str:
    """The ProxyCommand line (for ``ProxyUseFdpass yes``): this module under the running
    interpreter, isolated and without site packages (nothing to import but the standard
    library), imported from its directory so that its bytecode is cached."""
    import shlex

    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.append({here!r}); import kube_dial; sys.exit(kube_dial.main())"
    return shlex.join([sys.executable, "-I", "-S", "-c", code, "--socket", socket_path, *args])


def fallback(args: list[str]) -> int:
    """No forwarder answers: hand ssh one end of a socket pair, with the self-contained proxy
    on the other end in a session of its own (ssh waits for its ProxyCommand to exit before it
    uses the socket; the proxy ends when ssh closes its end).  The environment is kept, so a
    ``PYTHONPATH`` that made the package importable still does."""
    argv = [sys.executable, "-m", "pytest_sky.ssh.kube_proxy", *args]
    if not _ssh_takes_a_socket():
        os.execv(sys.executable, argv)  # the proxy relays this process's stdin and stdout itself
    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            os.setsid()
            os.dup2(theirs.fileno(), 0)
            os.dup2(theirs.fileno(), 1)
            os.execv(sys.executable, argv)
        finally:
            os._exit(255)
    theirs.close()
    return hand_to_ssh(ours.fileno())


def _ssh_takes_a_socket() -> bool:
    """Whether ssh runs this with ``ProxyUseFdpass yes`` (its stdout is then a unix socket);
    an ssh config written by an older pytest-sky gives pipes, and this process relays."""
    return (os.fstat(1).st_mode & 0o170000) == 0o140000  # S_ISSOCK, without importing stat


def hand_to_ssh(fd: int) -> int:
    """Pass ``fd`` to ssh over this process's stdout, as ``ProxyUseFdpass`` expects."""
    try:
        out = _socket.socket(fileno=os.dup(1))
        try:
            send_fd(out, b"\0", fd)
        finally:
            out.close()
    except OSError as exc:
        sys.stderr.write(f"pytest-sky proxy: cannot hand the connection to ssh: {exc.strerror or exc}\n")
        return 255
    return 0


def relay(sock: _socket.socket, first: bytes = b"") -> int:
    """``first``, then stdin -> ``sock`` and ``sock`` -> stdout until the remote side closes:
    the way to carry a session where ssh passes no socket."""
    import select

    out, inp = sys.stdout.fileno(), sys.stdin.fileno()
    while first:
        first = first[os.write(out, first) :]
    watch: list = [inp, sock]
    while True:
        ready, _, _ = select.select(watch, [], [])
        if inp in ready:
            data = os.read(inp, 65536)
            if data:
                sock.sendall(data)
            else:
                try:
                    sock.shutdown(_socket.SHUT_WR)
                except OSError:
                    pass
                watch.remove(inp)
        if sock in ready:
            data = sock.recv(65536)
            if not data:
                return 0
            while data:
                data = data[os.write(out, data) :]


def _relay_until_told(stream: int, first: bytes) -> int:
    """Relay the stream, and leave through :func:`close_gently` when ssh says to stop (it
    ends a ProxyCommand that relays with SIGHUP), so that the forwarder's side sees an end of
    stream, not a reset."""
    import signal

    sock = _socket.socket(fileno=stream)
    for sig in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, _leave)
    try:
        return relay(sock, first)
    except _Ended:
        return 0
    except OSError as exc:
        sys.stderr.write(f"pytest-sky proxy: port-forward dropped: {exc}\n")
        return 255
    finally:
        close_gently(sock)


class _Ended(Exception):
    """The dialler was told to stop (SIGHUP, SIGTERM)."""


def _leave(signum: int, frame: object) -> None:
    raise _Ended


def dial(socket_path: str, request: DialRequest) -> tuple[int | None, DialReply]:
    """Ask the forwarder for a stream: its descriptor (None where the forwarder refused, with
    why) and the reply.  Raises ``OSError`` where no forwarder listens."""
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        conn.connect(socket_path)
        conn.sendall(request.encode())
        line, fds = read_line(conn, BANNER_TIMEOUT + 5)
    finally:
        conn.close()
    reply = DialReply.decode(line)
    for extra in fds[1:]:
        os.close(extra)
    if not fds:
        return None, reply if reply.error else DialReply(error="the forwarder sent no stream")
    return fds[0], reply


def _options(argv: list[str]) -> dict[str, str]:
    """``--flag value`` pairs, as :func:`parser` and ``--socket`` define them."""
    known = ("--socket", "--namespace", "--pod", "--port", "--context", "--kubeconfig")
    options: dict[str, str] = {}
    it = iter(argv)
    for flag in it:
        value = next(it, None)
        if flag not in known or value is None:
            raise ValueError(f"unexpected argument {flag!r}")
        options[flag[2:]] = value
    for needed in ("socket", "namespace", "pod"):
        if needed not in options:
            raise ValueError(f"--{needed} is required")
    return options


def main(argv: list[str] | None = None) -> int:
    try:
        opts = _options(sys.argv[1:] if argv is None else argv)
        port = int(opts.get("port", "22"))
    except ValueError as exc:
        sys.stderr.write(f"pytest-sky proxy: {exc}\n")
        return 2
    namespace, pod = opts["namespace"], opts["pod"]
    where = f"{namespace}/{pod}:{port}"
    try:
        stream, reply = dial(opts["socket"], DialRequest(namespace, pod, port))
    except (FileNotFoundError, ConnectionRefusedError):  # no forwarder here: the proxy that needs none
        return fallback(route_args(namespace, pod, port, opts.get("kubeconfig"), opts.get("context")))
    except OSError as exc:
        sys.stderr.write(f"pytest-sky proxy: cannot reach {where}: the cluster's forwarder: {exc}\n")
        return 255
    if stream is None:
        sys.stderr.write(f"pytest-sky proxy: cannot reach {where}: {reply.error}\n")
        return 255
    if reply.banner or not _ssh_takes_a_socket():  # an older forwarder or ssh config
        return _relay_until_told(stream, reply.banner)
    try:
        return hand_to_ssh(stream)
    finally:
        os.close(stream)  # ssh's copy is the stream's now


class _BannerFirst:
    """A stream whose banner an older forwarder read already: those bytes come back first."""

    def __init__(self, stream: socket.socket, banner: bytes) -> None:
        self._stream = stream
        self._first = banner

    def recv(self, size: int) -> bytes:
        if self._first:
            out, self._first = self._first[:size], self._first[size:]
            return out
        return self._stream.recv(size)

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


class Dialled:
    """A stream the forwarder opened for a client in this process (the CLI's or the plugin's
    connection to the head), as ``kube_proxy.Forward`` is one opened here: its ``socket``
    carries the connection from the pod's banner on, :meth:`close` ends it."""

    def __init__(self, stream: socket.socket, banner: bytes = b"") -> None:
        self._stream = stream
        self.socket = _BannerFirst(stream, banner) if banner else stream

    def close(self) -> None:
        close_gently(self._stream)


def open_stream(socket_path: str, request: DialRequest) -> Dialled:
    """A stream to the pod ``request`` names, from the forwarder at ``socket_path``.  Raises
    ``OSError`` where no forwarder listens, ``ConnectionError`` (with its reason) where it
    refused."""
    import socket

    stream, reply = dial(socket_path, request)
    if stream is None:
        raise ConnectionError(reply.error)
    return Dialled(socket.socket(fileno=stream), reply.banner)


def close_gently(sock: _socket.socket) -> None:
    """Close so that the far end's relay sees an end of stream, not a reset: say "no more from
    us", read what is still in flight for a moment, then close (closing with unread bytes
    resets the connection, and the relay thread on the other side dies with a traceback)."""
    try:
        sock.shutdown(_socket.SHUT_WR)
        sock.settimeout(2.0)
        while sock.recv(65536):
            pass
    except OSError:
        pass
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
