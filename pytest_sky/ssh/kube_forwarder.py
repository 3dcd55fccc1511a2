"""A Kubernetes cluster's forwarder: one process that holds the API server configuration and
opens a new port-forward stream for each ssh connection (DESIGN.md section 6, "Reaching the
head").

The ProxyCommand of the cluster's ssh config (``kube_dial``, standard library only) connects
to the forwarder's unix socket and asks for a pod's port; the forwarder opens the stream with
the kubernetes client it has already loaded, reads the pod's SSH banner through it (ready by
construction) and passes the stream's socket back (``SCM_RIGHTS``).  The kubernetes client's
own relay thread then carries the bytes until the dialler closes its copy.

It lives as long as its cluster.  A cluster that ends with the process that launched it (a
test's) is served by a thread of that process, which has the client loaded already; one kept
beyond it (``--keep-clusters``, ``pytest-sky launch``) by a process of its own, which also
ends by itself once the cluster's directory is gone.  ``down`` and the reaper stop either and
remove the socket; a forwarder killed with its process leaves a socket that nothing answers,
which they remove too.  The socket is the user's alone (mode 0600, and the peer's uid is
checked): whoever can use it can reach the pods with the user's credentials.

``python -m pytest_sky.ssh.kube_forwarder --socket PATH --watch DIR`` and the head's
port-forward arguments (``kube_proxy``'s) runs one in the foreground.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_sky import procs
from pytest_sky.cluster_info import PortForward
from pytest_sky.ssh import kube_dial, kube_proxy
from pytest_sky.ssh.config import SOCKET_DIR

log = logging.getLogger(__name__)

#: A forwarder's socket is ``<SOCKET_DIR>/psky-<random>.fwd``: unguessable to other users.
SUFFIX = ".fwd"
#: How long a forwarder process may take to load the configuration and listen.
START_TIMEOUT = 60.0
_REQUEST_TIMEOUT = 10.0
_POLL = 1.0


def socket_path() -> str:
    """A new forwarder socket's path: ``/tmp/psky-<random>.fwd``."""
    return f"{SOCKET_DIR}/psky-{secrets.token_hex(5)}{SUFFIX}"


@dataclass(frozen=True)
class Handle:
    """A running forwarder, as a cluster's journal keeps it: its socket, and its process where
    it has one of its own (None: a thread of the launching process)."""

    socket: str
    pid: int | None = None
    start_time: int | None = None


class ForwarderError(Exception):
    """The forwarder could not start (its one line says why)."""


class Forwarder:
    """Serves :class:`kube_dial.DialRequest` on a unix socket, a thread per connection."""

    def __init__(self, path: str, route: PortForward) -> None:
        """``route``: the head's port-forward; it names the API server, the credentials and
        the namespace, and each request names the pod and port it wants there."""
        self.path = path
        self.route = route
        self._cfg: Any = None
        self._listener: socket.socket | None = None
        self._stopped = threading.Event()

    def listen(self) -> None:
        """Load the configuration (its failures are the caller's), then bind and listen."""
        self._cfg = kube_proxy.configuration(self.route)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket of the same random name cannot be anyone else's
        listener.bind(self.path)
        os.chmod(self.path, 0o600)
        listener.listen(128)
        self._listener = listener

    def serve(self, until: Callable[[], bool] = lambda: False) -> None:
        """Answer connections until :meth:`stop`, or ``until()`` says so (checked each second)."""
        assert self._listener is not None, "listen() first"
        while not self._stopped.is_set() and not until():
            try:
                ready, _, _ = select.select([self._listener], [], [], _POLL)
                if not ready:
                    continue
                conn, _ = self._listener.accept()
            except (OSError, ValueError):  # the listener was shut down by stop()
                break
            threading.Thread(target=self._answer, args=(conn,), name="pytest-sky forwarder", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                if not _same_user(conn):
                    raise PermissionError("the forwarder serves only the user who launched the cluster")
                line, _ = kube_dial.read_line(conn, _REQUEST_TIMEOUT)
                request = kube_dial.DialRequest.decode(line)
                self._open(conn, request)
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the dialler, one line
                with contextlib.suppress(OSError):
                    conn.sendall(kube_dial.DialReply(error=kube_proxy.describe_refusal(exc)).encode())

    def _open(self, conn: socket.socket, request: kube_dial.DialRequest) -> None:
        """Open the stream, see the banner come through it, and hand the stream over."""
        if request.namespace != self.route.namespace:
            raise ValueError(f"this forwarder serves namespace {self.route.namespace}, not {request.namespace}")
        route = dataclasses.replace(self.route, pod=request.pod, port=request.port)
        forward = kube_proxy.Forward(route, self._cfg)
        try:
            kube_proxy.peek_banner(forward.socket, kube_dial.BANNER_TIMEOUT, f"{route.pod}:{route.port}")
        except BaseException:
            forward.close()
            raise
        fd = forward.hand_over()
        try:
            kube_dial.send_fd(conn, kube_dial.DialReply().encode(), fd)
        finally:
            os.close(fd)  # the dialler's copy is the stream's now


def _same_user(conn: socket.socket) -> bool:
    """Whether the peer runs as this process's user (or as root, who could read the socket anyway)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return uid in (os.getuid(), 0)


#: The forwarders served by this process's threads, and the processes it started, by socket.
_THREADS: dict[str, Forwarder] = {}
_SPAWNED: dict[str, subprocess.Popen[bytes]] = {}


def start(path: str, route: PortForward, *, own_process: bool, watch: Path) -> Handle:
    """A forwarder for a new cluster at ``path`` (from :func:`socket_path`): a thread of this
    process, or (``own_process``, for a cluster that outlives it) a process of its own that
    ends once ``watch`` is gone.  Raises :class:`ForwarderError` where it cannot start."""
    if not own_process:
        fwd = Forwarder(path, route)
        try:
            fwd.listen()
        except Exception as exc:  # noqa: BLE001 - the configuration's own problem, in one line
            raise ForwarderError(kube_proxy.describe_refusal(exc)) from None
        _THREADS[path] = fwd
        threading.Thread(target=fwd.serve, name="pytest-sky forwarder accept", daemon=True).start()
        return Handle(path)
    argv = [sys.executable, "-m", "pytest_sky.ssh.kube_forwarder", "--socket", path, "--watch", str(watch)]
    proc = subprocess.Popen(
        argv + kube_proxy.args_of(route),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    _SPAWNED[path] = proc
    assert proc.stdout is not None and proc.stderr is not None
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT)
    said = proc.stdout.readline() if ready else b""
    proc.stdout.close()
    if said != READY:
        stop(Handle(path, proc.pid, procs.start_time(proc.pid)))
        why = proc.stderr.read().decode(errors="replace").strip().splitlines()
        proc.stderr.close()
        raise ForwarderError(why[-1] if why else f"the forwarder did not start in {START_TIMEOUT:.0f} s")
    proc.stderr.close()
    return Handle(path, proc.pid, procs.start_time(proc.pid))


def stop(handle: Handle) -> None:
    """Stop the forwarder wherever it runs and remove its socket; tolerates "already gone"."""
    fwd = _THREADS.pop(handle.socket, None)
    if fwd is not None:
        fwd.stop()
    proc = _SPAWNED.pop(handle.socket, None)
    if handle.pid is not None and procs.is_alive(handle.pid, handle.start_time):
        procs.kill_and_wait([handle.pid])  # holds nothing that needs a goodbye: its streams die with it
    if proc is not None:
        proc.wait()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(handle.socket)


#: What a forwarder process writes on its stdout once it listens: the start's one signal.
READY = b"ready\n"


def main(argv: list[str] | None = None) -> int:
    p = kube_dial.parser("python -m pytest_sky.ssh.kube_forwarder", __doc__.split("\n")[0])
    p.add_argument("--socket", required=True)
    p.add_argument("--watch", required=True, type=Path, help="end once this directory is gone")
    ns = p.parse_args(argv)
    fwd = Forwarder(ns.socket, PortForward(ns.namespace, ns.pod, ns.port, ns.kubeconfig, ns.context))
    signal.signal(signal.SIGTERM, lambda *_: fwd.stop())
    try:
        fwd.listen()
    except Exception as exc:  # noqa: BLE001 - the launching process shows this line
        sys.stderr.write(f"pytest-sky forwarder: {kube_proxy.describe_refusal(exc)}\n")
        return 1
    os.write(1, READY)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # the launcher has stopped reading; nothing more goes there
    os.dup2(devnull, 2)
    try:
        fwd.serve(until=lambda: not ns.watch.is_dir())
    finally:
        fwd.stop()
    return 0


if __name__ == "__main__":
    code = main()
    os._exit(code)  # stream threads of open connections must not keep a stopped forwarder alive
