"""The ProxyCommand of a Kubernetes cluster's ssh config: a pod's sshd, through the cluster's
forwarder (``kube_forwarder``), in milliseconds (DESIGN.md section 6, "Reaching the head").

``python -I -S kube_dial.py --socket PATH --namespace NS --pod POD [--port N] [--kubeconfig K]
[--context C]``

A proxy that loads the kubernetes client costs most of a CPU second, and twenty of them at
once saturate two cores.  This one imports the standard library only and runs without the
site packages (``-I -S``: about 30 ms), asks the forwarder, which holds the API server
configuration, for a new port-forward stream to the pod, and gets back the stream's socket
(passed over the unix socket, ``SCM_RIGHTS``) with the pod's SSH banner already read through
it: ready by construction.  Then it only relays stdin and stdout.

Where no forwarder answers (it died, or the cluster was launched by an older pytest-sky), it
becomes the self-contained proxy, ``python -m pytest_sky.ssh.kube_proxy`` with the same
arguments: slower, never broken.

The request and the reply are the protocol both sides import from here: plain classes and one
text line each, because ``dataclasses`` alone would cost this process 29 ms, and ``json`` and
``argparse`` (with the ``re`` they pull in) another 15.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys

TYPE_CHECKING = False  # typing itself costs milliseconds here
if TYPE_CHECKING:
    import argparse

#: How long the forwarder may take to open the stream and read the banner before giving up.
BANNER_TIMEOUT = 30.0
_MAX_LINE = 65536


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
    """The forwarder's answer: the banner the pod's sshd sent through the new stream (whose
    socket comes with this message), or why there is no stream.

    On the wire, one line: ``OK <the banner's bytes in hex>`` or ``ERR <one line>``."""

    __slots__ = ("banner", "error")

    def __init__(self, banner: bytes = b"", error: str | None = None) -> None:
        self.banner = banner
        self.error = error

    def encode(self) -> bytes:
        if self.error is not None:
            return b"ERR " + " ".join(self.error.split()).encode() + b"\n"
        return b"OK " + self.banner.hex().encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes) -> DialReply:
        status, _, rest = line.strip().partition(b" ")
        if status == b"OK":
            return cls(banner=bytes.fromhex(rest.decode()))
        return cls(error=rest.decode(errors="replace") or "the forwarder gave no reason")


def read_line(sock: socket.socket, timeout: float) -> tuple[bytes, list[int]]:
    """One newline-ended message from ``sock`` and any descriptors that came with it."""
    sock.settimeout(timeout)
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, got, _, _ = socket.recv_fds(sock, _MAX_LINE, 1)
        fds += got
        if not chunk:
            raise ConnectionError("the other side closed before its message ended")
        data += chunk
        if len(data) > _MAX_LINE:
            raise ConnectionError("a message longer than any of the protocol's")
    return data, fds


def relay(sock: socket.socket, first: bytes = b"") -> int:
    """``first``, then stdin -> ``sock`` and ``sock`` -> stdout until the remote side closes."""
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
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                watch.remove(inp)
        if sock in ready:
            data = sock.recv(65536)
            if not data:
                return 0
            while data:
                data = data[os.write(out, data) :]


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
    """The ProxyCommand line: this file under the running interpreter, isolated and without
    site packages (nothing to import but the standard library)."""
    import shlex

    return shlex.join([sys.executable, "-I", "-S", os.path.abspath(__file__), "--socket", socket_path, *args])


def fallback(args: list[str]) -> None:
    """Become the self-contained proxy (replaces this process; the environment is kept, so a
    ``PYTHONPATH`` that made the package importable still does)."""
    argv = [sys.executable, "-m", "pytest_sky.ssh.kube_proxy", *args]
    os.execv(sys.executable, argv)


def dial(socket_path: str, request: DialRequest) -> tuple[socket.socket | None, DialReply]:
    """Ask the forwarder for a stream: its socket (None where the forwarder refused, with why)
    and the reply.  Raises ``OSError`` where no forwarder listens."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(socket_path)
        conn.sendall(request.encode())
        line, fds = read_line(conn, BANNER_TIMEOUT + 5)
    reply = DialReply.decode(line)
    if not fds:
        return None, reply if reply.error else DialReply(error="the forwarder sent no stream")
    stream = socket.socket(fileno=fds[0])
    for extra in fds[1:]:
        os.close(extra)
    return stream, reply


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
    args = route_args(namespace, pod, port, opts.get("kubeconfig"), opts.get("context"))
    where = f"{namespace}/{pod}:{port}"
    try:
        stream, reply = dial(opts["socket"], DialRequest(namespace, pod, port))
    except (FileNotFoundError, ConnectionRefusedError):
        fallback(args)  # no forwarder here: the proxy that needs none
        return 255
    except OSError as exc:
        sys.stderr.write(f"pytest-sky proxy: cannot reach {where}: the cluster's forwarder: {exc}\n")
        return 255
    if stream is None:
        sys.stderr.write(f"pytest-sky proxy: cannot reach {where}: {reply.error}\n")
        return 255
    # ssh ends its ProxyCommand with SIGHUP (a master told to exit, a client done): leave
    # through close_gently, so that the forwarder's side sees an end of stream, not a reset.
    for sig in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, _leave)
    try:
        return relay(stream, reply.banner)
    except OSError as exc:
        sys.stderr.write(f"pytest-sky proxy: port-forward to {pod} dropped: {exc}\n")
        return 255
    except _Ended:
        return 0
    finally:
        close_gently(stream)


class _BannerFirst:
    """A dialled stream read from its first byte: the pod's banner, which the forwarder read to
    know the stream was ready, comes back first."""

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
    carries the connection, :meth:`close` ends it."""

    def __init__(self, stream: socket.socket, banner: bytes) -> None:
        self._stream = stream
        self.socket = _BannerFirst(stream, banner)

    def close(self) -> None:
        close_gently(self._stream)


def open_stream(socket_path: str, request: DialRequest) -> Dialled:
    """A stream to the pod ``request`` names, from the forwarder at ``socket_path``.  Raises
    ``OSError`` where no forwarder listens, ``ConnectionError`` (with its reason) where it
    refused."""
    stream, reply = dial(socket_path, request)
    if stream is None:
        raise ConnectionError(reply.error)
    return Dialled(stream, reply.banner)


class _Ended(Exception):
    """The dialler was told to stop (SIGHUP, SIGTERM)."""


def _leave(signum: int, frame: object) -> None:
    raise _Ended


def close_gently(sock: socket.socket) -> None:
    """Close so that the far end's relay sees an end of stream, not a reset: say "no more from
    us", read what is still in flight for a moment, then close (closing with unread bytes
    resets the connection, and the relay thread on the other side dies with a traceback)."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(2.0)
        while sock.recv(65536):
            pass
    except OSError:
        pass
    finally:
        sock.close()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.exit(code)
