"""Exec and port-forward over WebSocket, framed as the API server frames them.

Channel protocol (``v4.channel.k8s.io``, ``v5.channel.k8s.io``): every binary message
starts with a channel byte; exec uses 0 stdin, 1 stdout, 2 stderr, 3 error, 4 resize.  The
server's first message is an empty frame on the lowest channel it writes (stdout), and
the last is the exit status on channel 3: a JSON ``Status`` (``Success``, or ``Failure``
with reason ``NonZeroExitCode`` and the code in ``details.causes[0].message``), after
which it closes.  v5 adds a close signal from the client: ``[255, channel]`` half-closes
that channel (stdin EOF).

Port-forward (``portforward.k8s.io`` or ``v4.channel.k8s.io`` over WebSocket): each
requested port ``i`` gets data channel ``2i`` and error channel ``2i+1``; the first frame
the server sends on each of them carries the port number, 2 bytes little-endian; client
data arrives prefixed by its data channel byte; a failure to reach the port is text on the
error channel.  The kubelet dials ``localhost:<port>`` inside the pod.

aiohttp's WebSocket server is the library here; only the framing above is ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import struct
import termios
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import WSMsgType, web
from multidict import MultiDictProxy

from kube_emulator import spdy_portforward
from kube_emulator.api import ApiError
from kube_emulator.faults import DroppableSession
from kube_emulator.spdy_portforward import SpdyPortForward

if TYPE_CHECKING:
    from kube_emulator.cluster import Cluster
    from kube_emulator.pods import PodRuntime

log = logging.getLogger(__name__)

V5 = "v5.channel.k8s.io"
V4 = "v4.channel.k8s.io"
EXEC_PROTOCOLS = (V5, V4, "v3.channel.k8s.io", "v2.channel.k8s.io", "channel.k8s.io")
PORTFORWARD_PROTOCOLS = (V4, "portforward.k8s.io")
STDIN, STDOUT, STDERR, ERROR, RESIZE, CLOSE = 0, 1, 2, 3, 4, 255
MAX_MESSAGE = 64 * 1024 * 1024
DRAIN_TIMEOUT = 30.0


def query_flag(value: str | None) -> bool:
    """A boolean query parameter (``?stdin=true``, ``?watch=1``)."""
    return (value or "").lower() in ("1", "true", "yes")


def _is_websocket(request: web.Request) -> bool:
    return request.headers.get("Upgrade", "").lower() == "websocket"


def container_name(pod: dict[str, Any], wanted: str | None) -> str:
    names = [c["name"] for c in pod["spec"]["containers"]]
    if wanted:
        if wanted not in names:
            raise ApiError(400, "BadRequest", f"container {wanted} is not valid for pod {pod['metadata']['name']}")
        return wanted
    if len(names) > 1:
        raise ApiError(
            400,
            "BadRequest",
            f"a container name must be specified for pod {pod['metadata']['name']}, choose one of: [{' '.join(names)}]",
        )
    return names[0]


def _running(cluster: Cluster, namespace: str, name: str, what: str, container: str | None) -> PodRuntime:
    pod = cluster.get("pods", namespace, name)
    cname = container_name(pod, container)
    phase = (pod.get("status") or {}).get("phase")
    if phase in ("Succeeded", "Failed"):
        raise ApiError(400, "BadRequest", f"cannot {what} a container in a completed pod; current phase is {phase}")
    if not pod["spec"].get("nodeName"):
        raise ApiError(400, "BadRequest", f"pod {name} does not have a host assigned")
    rt = cluster.kubelet.running(namespace, name)
    if rt is None:
        raise ApiError(500, "InternalError", f'unable to upgrade connection: container not found ("{cname}")')
    return rt


def _exit_status(code: int, command: list[str]) -> dict[str, Any]:
    if code == 0:
        return {"metadata": {}, "status": "Success"}
    return {
        "metadata": {},
        "status": "Failure",
        "message": (
            f"command terminated with non-zero exit code: error executing command [{' '.join(command)}], "
            f"exit code {code}"
        ),
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
    }


@dataclass(frozen=True)
class ExecRequest:
    """What the client asked of an exec, from the query string."""

    command: list[str]
    stdin: bool
    stdout: bool
    stderr: bool
    tty: bool
    container: str | None


def _exec_request(query: MultiDictProxy[str]) -> ExecRequest:
    command = query.getall("command", [])
    if not command:
        raise ApiError(400, "BadRequest", "you must specify at least 1 command")
    stdin, stdout, stderr, tty = (query_flag(query.get(k)) for k in ("stdin", "stdout", "stderr", "tty"))
    if not (stdin or stdout or stderr):
        raise ApiError(400, "BadRequest", "you must specify at least one of stdin, stdout, stderr")
    return ExecRequest(command, stdin, stdout, stderr, tty, query.get("container"))


async def _accept(request: web.Request, protocols: tuple[str, ...]) -> web.WebSocketResponse:
    if not _is_websocket(request):
        raise ApiError(
            400, "BadRequest", "Upgrade request required (the kube emulator speaks WebSocket and SPDY over WebSocket)"
        )
    ws = web.WebSocketResponse(protocols=protocols, max_msg_size=MAX_MESSAGE, autoping=True)
    await ws.prepare(request)
    return ws


async def _send(ws: web.WebSocketResponse, channel: int, data: bytes) -> None:
    """One frame; a client that is gone is not an error of the exec (the command still ends)."""
    with contextlib.suppress(ConnectionError, RuntimeError):
        await ws.send_bytes(bytes([channel]) + data)


def _structured(ws: web.WebSocketResponse) -> bool:
    """v4 and later report on the error channel in a JSON ``Status``, earlier ones in text."""
    return (ws.ws_protocol or "channel.k8s.io") in (V4, V5)


async def _refuse_missing_command(ws: web.WebSocketResponse, command: list[str]) -> None:
    """What a container runtime answers for a command not on the image's PATH."""
    message = (
        "OCI runtime exec failed: exec failed: unable to start container process: exec: "
        f'"{command[0]}": executable file not found in $PATH: unknown'
    )
    status = {
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": "InternalError",
        "details": {"causes": [{"message": message}]},
        "code": 500,
    }
    await _send(ws, ERROR, json.dumps(status).encode() if _structured(ws) else message.encode())
    await ws.close()


async def handle_exec(request: web.Request, cluster: Cluster, namespace: str, name: str) -> web.StreamResponse:
    want = _exec_request(request.query)
    rt = _running(cluster, namespace, name, "exec into", want.container)
    ws = await _accept(request, EXEC_PROTOCOLS)
    if cluster.kubelet.entry.command_missing(rt, want.command):
        await _refuse_missing_command(ws, want.command)
        return ws
    proc, master = await cluster.kubelet.entry.spawn_exec(rt, want.command, stdin=want.stdin, tty=want.tty)
    await _send(ws, STDOUT if want.stdout else STDERR, b"")
    await ExecSession(ws, want, proc, master, f"{namespace}/{name}").run()
    return ws


class ExecSession:
    """One running exec: the command's output to the client, and the client's stdin, resize
    and close frames to the command, until the command exits or the client goes away."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        want: ExecRequest,
        proc: asyncio.subprocess.Process,
        master: int | None,
        where: str,
    ) -> None:
        self.ws = ws
        self.want = want
        self.proc = proc
        self.master = master  # the pty's master side, with ``tty``
        self.where = where
        self.stdin_open = want.stdin

    async def run(self) -> None:
        outputs = (
            [asyncio.ensure_future(self._pump_pty(self.master))]
            if self.master is not None
            else [
                asyncio.ensure_future(self._pump(self.proc.stdout, STDOUT, self.want.stdout)),
                asyncio.ensure_future(self._pump(self.proc.stderr, STDERR, self.want.stderr)),
            ]
        )
        client = asyncio.ensure_future(self._from_client())
        waiter = asyncio.ensure_future(self.proc.wait())
        try:
            done, _ = await asyncio.wait({waiter, client}, return_when=asyncio.FIRST_COMPLETED)
            if waiter not in done:
                # The client went away first: stop the command and everything in its session.
                self._kill()
                await waiter
                return
            await self._drain(outputs)
            await self._report_exit()
        finally:
            self._release([client, waiter, *outputs])

    async def _drain(self, outputs: list[asyncio.Future[None]]) -> None:
        if self.master is not None:
            # The pty master reads EIO once every holder of the slave is gone; children that
            # keep it open must not hold up the exit status.
            await asyncio.wait(outputs, timeout=0.5)
            return
        # Like a container runtime, wait until stdout and stderr are closed: a background
        # child that keeps them open holds the exec up (as on a real cluster), but not forever.
        _, pending = await asyncio.wait(outputs, timeout=DRAIN_TIMEOUT)
        if pending:
            log.warning(
                "exec %s in %s: output still open %.0f s after exit", self.want.command, self.where, DRAIN_TIMEOUT
            )

    async def _report_exit(self) -> None:
        code = self.proc.returncode if self.proc.returncode is not None else 0
        code = 128 - code if code < 0 else code
        if _structured(self.ws):
            await _send(self.ws, ERROR, json.dumps(_exit_status(code, self.want.command)).encode())
        elif code:
            await _send(self.ws, ERROR, f"command terminated with non-zero exit code: exit code {code}".encode())
        with contextlib.suppress(Exception):
            await self.ws.close()

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def _release(self, tasks: list[asyncio.Future[Any]]) -> None:
        if self.proc.returncode is None:  # the handler itself was cancelled (client connection lost)
            self._kill()
        for task in tasks:
            task.cancel()
        if self.proc.stdin is not None:
            with contextlib.suppress(Exception):
                self.proc.stdin.close()
        if self.master is not None:
            with contextlib.suppress(OSError):
                os.close(self.master)

    async def _pump(self, reader: asyncio.StreamReader | None, channel: int, wanted: bool) -> None:
        if reader is None:
            return
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                return
            if wanted:
                await _send(self.ws, channel, chunk)

    async def _pump_pty(self, fd: int) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes] = asyncio.Queue()

        def readable() -> None:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(fd)
            queue.put_nowait(data)

        loop.add_reader(fd, readable)
        try:
            while True:
                data = await queue.get()
                if not data:
                    return
                await _send(self.ws, STDOUT, data)
        finally:
            loop.remove_reader(fd)

    async def _from_client(self) -> None:
        async for msg in self.ws:
            if msg.type == WSMsgType.BINARY:
                data: bytes = msg.data
            elif msg.type == WSMsgType.TEXT:
                # the official client sends str input as text: chr(channel) + data
                text: str = msg.data or ""
                data = bytes([ord(text[0]) & 0xFF]) + text[1:].encode() if text else b""
            else:
                break
            if data:
                await self._frame(data[0], data[1:])

    async def _frame(self, channel: int, payload: bytes) -> None:
        if channel == STDIN and self.stdin_open:
            await self._write_stdin(payload)
        elif channel == RESIZE and self.master is not None:
            with contextlib.suppress(ValueError, OSError, KeyError):
                size = json.loads(payload)
                fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", size["Height"], size["Width"], 0, 0))
        elif channel == CLOSE and self.ws.ws_protocol == V5 and payload[:1] == bytes([STDIN]):
            self.stdin_open = False
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            elif self.master is not None:
                os.write(self.master, b"\x04")

    async def _write_stdin(self, payload: bytes) -> None:
        if self.master is not None:
            os.write(self.master, payload)
        elif self.proc.stdin is not None:
            try:
                self.proc.stdin.write(payload)
                await self.proc.stdin.drain()
            except (ConnectionError, BrokenPipeError):
                self.stdin_open = False


def _ports(query: MultiDictProxy[str]) -> list[int]:
    ports: list[int] = []
    for value in query.getall("ports", []):
        for part in value.split(","):
            try:
                port = int(part)
            except ValueError:
                raise ApiError(400, "BadRequest", f"invalid port {part!r}") from None
            if not 0 < port < 65536:
                raise ApiError(400, "BadRequest", f"port {port} must be between 1 and 65535")
            ports.append(port)
    if not ports:
        raise ApiError(400, "BadRequest", 'query parameter "ports" is required')
    return ports


async def handle_portforward(request: web.Request, cluster: Cluster, namespace: str, name: str) -> web.StreamResponse:
    """The Python client's websocket port-forward (ports in the query), or kubectl's SPDY
    session tunnelled through a websocket (:mod:`~kube_emulator.spdy_portforward`)."""
    limit = cluster.faults.drop_portforward_after_bytes
    spdy_tunnel = spdy_portforward.requested(request)
    ports = [] if spdy_tunnel else _ports(request.query)  # a bad query is a 400 before anything else
    rt = _running(cluster, namespace, name, "port-forward to", None)
    session: PortForwardSession | SpdyPortForward
    if spdy_tunnel:
        ws = await _accept(request, (spdy_portforward.TUNNEL_PROTOCOL,))
        session = SpdyPortForward(
            ws,
            lambda port: cluster.kubelet.entry.connect(rt, port),
            lambda port, exc: _forward_error(rt, port, exc),
            limit,
        )
        forwarding = session.forward()
    else:
        ws = await _accept(request, PORTFORWARD_PROTOCOLS)
        session = PortForwardSession(ws, limit)
        forwarding = session.forward(cluster, rt, ports)
    cluster.portforwards.add(session)
    try:
        if await forwarding and session.dropped.is_set():
            log.info("dropping the port-forward to %s/%s after %d bytes", namespace, name, session.bytes)
            _reset(request.transport)
        return ws
    finally:
        cluster.portforwards.discard(session)
        await session.close()


def _forward_error(rt: PodRuntime, port: int, exc: BaseException) -> str:
    """What the kubelet writes on a port-forward's error stream for a port it cannot reach."""
    return (
        f"error forwarding port {port} to pod {rt.uid}, uid : failed to execute portforward in "
        f"network namespace of pod {rt.name}: {exc}"
    )


def _reset(transport: asyncio.BaseTransport | None) -> None:
    """Drop the connection with a TCP reset, as a load balancer or a restarting API server
    does: a plain close would let the client see an orderly end and spare its error paths."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class PortForwardSession(DroppableSession):
    """One port-forward WebSocket; kept in ``cluster.portforwards`` so a fault can drop it."""

    def __init__(self, ws: web.WebSocketResponse, limit: int | None) -> None:
        super().__init__(limit)
        self.ws = ws
        self.writers: dict[int, asyncio.StreamWriter] = {}  # by the port's index in the request
        self.tasks: list[asyncio.Future[Any]] = []

    async def forward(self, cluster: Cluster, rt: PodRuntime, ports: list[int]) -> bool:
        """Forward until the client closes, every pod side closes, or a fault drops the
        session; False when no port could be reached (the error frames are all there is)."""
        for i, port in enumerate(ports):
            prefix = struct.pack("<H", port)
            await self._send(2 * i, prefix)
            await self._send(2 * i + 1, prefix)
        for i, port in enumerate(ports):
            await self._connect(cluster, rt, i, port)
        if not self.writers:
            return False
        if self.limit is not None and self.limit <= 0:
            self.drop()
        self.tasks.append(asyncio.ensure_future(self._client_to_pod()))
        self.tasks.append(asyncio.ensure_future(self.dropped.wait()))
        pods_done = asyncio.ensure_future(asyncio.wait(self.tasks[: len(self.writers)]))
        self.tasks.append(pods_done)
        await asyncio.wait(self.tasks[-3:], return_when=asyncio.FIRST_COMPLETED)
        return True

    async def _connect(self, cluster: Cluster, rt: PodRuntime, index: int, port: int) -> None:
        try:
            reader, writer = await cluster.kubelet.entry.connect(rt, port)
        except (ConnectionError, OSError) as exc:
            await self._send(2 * index + 1, _forward_error(rt, port, exc).encode())
            return
        self.writers[index] = writer
        self.tasks.append(asyncio.ensure_future(self._pod_to_client(index, reader)))

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for writer in self.writers.values():
            with contextlib.suppress(Exception):
                writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(), 1.0)

    async def _send(self, channel: int, data: bytes) -> None:
        await self.ws.send_bytes(bytes([channel]) + data)

    async def _pod_to_client(self, index: int, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    return
                await self._send(2 * index, chunk)
                self.count(len(chunk))

    async def _client_to_pod(self) -> None:
        async for msg in self.ws:
            if msg.type != WSMsgType.BINARY or not msg.data:
                if msg.type in (WSMsgType.CLOSE, WSMsgType.ERROR):
                    return
                continue
            channel, payload = msg.data[0], msg.data[1:]
            writer = self.writers.get(channel // 2) if channel % 2 == 0 else None
            if writer is None or not payload:
                continue
            try:
                writer.write(payload)
                await writer.drain()
            except ConnectionError:
                return
            self.count(len(payload))
