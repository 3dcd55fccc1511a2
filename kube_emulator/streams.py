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
import json
import logging
import os
import signal
import struct
from typing import TYPE_CHECKING, Any

from aiohttp import WSMsgType, web

from kube_emulator.cluster import ApiError

if TYPE_CHECKING:
    from kube_emulator.cluster import Cluster
    from kube_emulator.kubelet import PodRuntime

log = logging.getLogger(__name__)

V5 = "v5.channel.k8s.io"
V4 = "v4.channel.k8s.io"
EXEC_PROTOCOLS = (V5, V4, "v3.channel.k8s.io", "v2.channel.k8s.io", "channel.k8s.io")
PORTFORWARD_PROTOCOLS = (V4, "portforward.k8s.io")
STDIN, STDOUT, STDERR, ERROR, RESIZE, CLOSE = 0, 1, 2, 3, 4, 255
MAX_MESSAGE = 64 * 1024 * 1024
DRAIN_TIMEOUT = 30.0


def _bool(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true", "yes")


def _is_websocket(request: web.Request) -> bool:
    return request.headers.get("Upgrade", "").lower() == "websocket"


def _container(pod: dict[str, Any], wanted: str | None) -> str:
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
    cname = _container(pod, container)
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


async def handle_exec(request: web.Request, cluster: Cluster, namespace: str, name: str) -> web.StreamResponse:
    query = request.query
    command = query.getall("command", [])
    if not command:
        raise ApiError(400, "BadRequest", "you must specify at least 1 command")
    stdin, stdout, stderr, tty = (_bool(query.get(k)) for k in ("stdin", "stdout", "stderr", "tty"))
    if not (stdin or stdout or stderr):
        raise ApiError(400, "BadRequest", "you must specify at least one of stdin, stdout, stderr")
    rt = _running(cluster, namespace, name, "exec into", query.get("container"))
    if not _is_websocket(request):
        raise ApiError(400, "BadRequest", "Upgrade request required (the kube emulator speaks WebSocket, not SPDY)")
    ws = web.WebSocketResponse(protocols=EXEC_PROTOCOLS, max_msg_size=MAX_MESSAGE, autoping=True)
    await ws.prepare(request)
    protocol = ws.ws_protocol or "channel.k8s.io"
    structured = protocol in (V4, V5)

    async def send(channel: int, data: bytes) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.send_bytes(bytes([channel]) + data)

    if cluster.kubelet.command_missing(rt, command):
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
        await send(ERROR, json.dumps(status).encode() if structured else message.encode())
        await ws.close()
        return ws
    proc, master = await cluster.kubelet.spawn_exec(rt, command, stdin=stdin, tty=tty)
    await send(STDOUT if stdout else STDERR, b"")

    async def pump(reader: asyncio.StreamReader | None, channel: int, wanted: bool) -> None:
        if reader is None:
            return
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                return
            if wanted:
                await send(channel, chunk)

    async def pump_pty(fd: int) -> None:
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
                await send(STDOUT, data)
        finally:
            loop.remove_reader(fd)

    async def from_client() -> None:
        stdin_open = stdin
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                data: bytes = msg.data
            elif msg.type == WSMsgType.TEXT:
                # the official client sends str input as text: chr(channel) + data
                text: str = msg.data or ""
                data = bytes([ord(text[0]) & 0xFF]) + text[1:].encode() if text else b""
            else:
                break
            if not data:
                continue
            channel, payload = data[0], data[1:]
            if channel == STDIN and stdin_open:
                if master is not None:
                    os.write(master, payload)
                elif proc.stdin is not None:
                    try:
                        proc.stdin.write(payload)
                        await proc.stdin.drain()
                    except (ConnectionError, BrokenPipeError):
                        stdin_open = False
            elif channel == RESIZE and master is not None:
                with contextlib.suppress(ValueError, OSError, KeyError):
                    size = json.loads(payload)
                    import fcntl
                    import termios

                    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", size["Height"], size["Width"], 0, 0))
            elif channel == CLOSE and protocol == V5 and payload[:1] == bytes([STDIN]):
                stdin_open = False
                if proc.stdin is not None:
                    proc.stdin.close()
                elif master is not None:
                    os.write(master, b"\x04")

    outputs = (
        [asyncio.ensure_future(pump_pty(master))]
        if master is not None
        else [
            asyncio.ensure_future(pump(proc.stdout, STDOUT, stdout)),
            asyncio.ensure_future(pump(proc.stderr, STDERR, stderr)),
        ]
    )
    client = asyncio.ensure_future(from_client())
    waiter = asyncio.ensure_future(proc.wait())
    try:
        done, _ = await asyncio.wait({waiter, client}, return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            # The client went away first: stop the command and everything in its session.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await waiter
            return ws
        if master is not None:
            # The pty master reads EIO once every holder of the slave is gone; children that
            # keep it open must not hold up the exit status.
            await asyncio.wait(outputs, timeout=0.5)
        else:
            # Like a container runtime, wait until stdout and stderr are closed: a background
            # child that keeps them open holds the exec up (as on a real cluster), but not forever.
            _, pending = await asyncio.wait(outputs, timeout=DRAIN_TIMEOUT)
            if pending:
                log.warning(
                    "exec %s in %s/%s: output still open %.0f s after exit", command, namespace, name, DRAIN_TIMEOUT
                )
        code = proc.returncode if proc.returncode is not None else 0
        code = 128 - code if code < 0 else code
        if structured:
            await send(ERROR, json.dumps(_exit_status(code, command)).encode())
        elif code:
            await send(ERROR, f"command terminated with non-zero exit code: exit code {code}".encode())
        with contextlib.suppress(Exception):
            await ws.close()
        return ws
    finally:
        if proc.returncode is None:  # the handler itself was cancelled (client connection lost)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for task in (client, waiter, *outputs):
            task.cancel()
        if proc.stdin is not None:
            with contextlib.suppress(Exception):
                proc.stdin.close()
        if master is not None:
            with contextlib.suppress(OSError):
                os.close(master)


class PortForwardSession:
    """One port-forward WebSocket; kept in ``cluster.portforwards`` so a fault can drop it."""

    def __init__(self, ws: web.WebSocketResponse, limit: int | None) -> None:
        self.ws = ws
        self.limit = limit
        self.bytes = 0
        self.dropped = asyncio.Event()

    def count(self, n: int) -> None:
        self.bytes += n
        if self.limit is not None and self.bytes >= self.limit:
            self.drop()

    def drop(self) -> None:
        self.dropped.set()


async def handle_portforward(request: web.Request, cluster: Cluster, namespace: str, name: str) -> web.StreamResponse:
    ports: list[int] = []
    for value in request.query.getall("ports", []):
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
    rt = _running(cluster, namespace, name, "port-forward to", None)
    if not _is_websocket(request):
        raise ApiError(400, "BadRequest", "Upgrade request required (the kube emulator speaks WebSocket, not SPDY)")
    ws = web.WebSocketResponse(protocols=PORTFORWARD_PROTOCOLS, max_msg_size=MAX_MESSAGE, autoping=True)
    await ws.prepare(request)
    session = PortForwardSession(ws, cluster.faults.drop_portforward_after_bytes)
    cluster.portforwards.add(session)
    writers: dict[int, asyncio.StreamWriter] = {}
    tasks: list[asyncio.Future[Any]] = []

    async def send(channel: int, data: bytes) -> None:
        await ws.send_bytes(bytes([channel]) + data)

    async def pod_to_client(index: int, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    return
                await send(2 * index, chunk)
                session.count(len(chunk))

    async def client_to_pod() -> None:
        async for msg in ws:
            if msg.type != WSMsgType.BINARY or not msg.data:
                if msg.type in (WSMsgType.CLOSE, WSMsgType.ERROR):
                    return
                continue
            channel, payload = msg.data[0], msg.data[1:]
            writer = writers.get(channel // 2) if channel % 2 == 0 else None
            if writer is None or not payload:
                continue
            try:
                writer.write(payload)
                await writer.drain()
            except ConnectionError:
                return
            session.count(len(payload))

    try:
        for i, port in enumerate(ports):
            prefix = struct.pack("<H", port)
            await send(2 * i, prefix)
            await send(2 * i + 1, prefix)
        for i, port in enumerate(ports):
            try:
                reader, writer = await cluster.kubelet.connect(rt, port)
            except (ConnectionError, OSError) as exc:
                message = (
                    f"error forwarding port {port} to pod {rt.uid}, uid : failed to execute portforward in "
                    f"network namespace of pod {name}: {exc}"
                )
                await send(2 * i + 1, message.encode())
                continue
            writers[i] = writer
            tasks.append(asyncio.ensure_future(pod_to_client(i, reader)))
        if not writers:
            return ws  # nothing to forward: the error frames are out, the stream is over
        if session.limit is not None and session.limit <= 0:
            session.drop()
        # Over when the client closes, every pod side closes, or a fault drops it.
        tasks.append(asyncio.ensure_future(client_to_pod()))
        tasks.append(asyncio.ensure_future(session.dropped.wait()))
        pods_done = asyncio.ensure_future(asyncio.wait(tasks[: len(writers)]))
        tasks.append(pods_done)
        await asyncio.wait(tasks[-3:], return_when=asyncio.FIRST_COMPLETED)
        if session.dropped.is_set():
            log.info("dropping the port-forward to %s/%s after %d bytes", namespace, name, session.bytes)
            transport = request.transport
            if transport is not None:
                transport.abort()
        return ws
    finally:
        cluster.portforwards.discard(session)
        for task in tasks:
            task.cancel()
        for writer in writers.values():
            with contextlib.suppress(Exception):
                writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ws.close(), 1.0)
