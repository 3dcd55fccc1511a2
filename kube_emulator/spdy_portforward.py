"""kubectl's port-forward: a SPDY/3.1 session tunnelled through a websocket.

What the kubelet's SPDY port-forward handler does, over the framing of :mod:`spdy`: the
client opens two streams per forwarded connection, ``streamtype: error`` and ``streamtype:
data``, both with the ``port`` and the ``requestid`` that pair them; each is answered with
a SYN_REPLY at once (the client waits for it).  Once a pair is complete the pod's port is
dialled; bytes of the data stream go to it, its bytes come back as DATA frames, and its end
is the data stream's FIN and then the error stream's (the client reads the error stream to
its end before it lets the connection go).  A port that cannot be reached is the kubelet's
message on the error stream, and the session goes on for the next connection.

Only the tunnelled form is served: kubectl tries it first (``SPDY/3.1+portforward.k8s.io``
as the websocket subprotocol) and falls back to a raw SPDY upgrade only when it is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSMsgType, web

from kube_emulator import spdy
from kube_emulator.faults import DroppableSession

log = logging.getLogger(__name__)

#: The websocket subprotocol of a tunnelled SPDY port-forward.
TUNNEL_PROTOCOL = "SPDY/3.1+portforward.k8s.io"
CHUNK = 32 * 1024

Connect = Callable[[int], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
Explain = Callable[[int, BaseException], str]


def requested(request: web.Request) -> bool:
    """Whether the client asks for the tunnelled SPDY session."""
    offered = request.headers.get("Sec-WebSocket-Protocol", "")
    return TUNNEL_PROTOCOL in (p.strip() for p in offered.split(","))


@dataclass
class _Pair:
    """One forwarded connection: its two streams and, once dialled, the pod's socket."""

    port: int = 0
    error: int | None = None
    data: int | None = None
    writer: asyncio.StreamWriter | None = None
    pending: list[bytes] = field(default_factory=list)
    client_done: bool = False
    task: asyncio.Future[Any] | None = None


class SpdyPortForward(DroppableSession):
    """One tunnelled session, cut by the emulator's faults as the websocket form is."""

    def __init__(self, ws: web.WebSocketResponse, connect: Connect, explain: Explain, limit: int | None) -> None:
        super().__init__(limit)
        self.ws = ws
        self.connect = connect
        self.explain = explain  # the kubelet's words for a port it cannot reach
        self.codec = spdy.HeaderCodec()
        self.pairs: dict[str, _Pair] = {}
        self.streams: dict[int, str] = {}  # stream id -> request id
        self._send_lock = asyncio.Lock()

    async def forward(self) -> bool:
        """Serve until the client closes or a fault drops the session (True then)."""
        reading = asyncio.ensure_future(self._read())
        dropped = asyncio.ensure_future(self.dropped.wait())
        try:
            await asyncio.wait([reading, dropped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            reading.cancel()
            dropped.cancel()
        return self.dropped.is_set()

    async def close(self) -> None:
        for pair in self.pairs.values():
            if pair.task is not None:
                pair.task.cancel()
            if pair.writer is not None:
                with contextlib.suppress(Exception):
                    pair.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(), 1.0)

    async def _send(self, frame: bytes) -> None:
        async with self._send_lock:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.send_bytes(frame)

    async def _read(self) -> None:
        reader = spdy.FrameReader()
        async for msg in self.ws:
            if msg.type in (WSMsgType.CLOSE, WSMsgType.ERROR):
                return
            if msg.type != WSMsgType.BINARY:
                continue
            try:
                for frame in reader.feed(msg.data):
                    if isinstance(frame, spdy.DataFrame):
                        await self._on_data(frame)
                    elif not await self._on_control(frame):
                        return
            except spdy.SpdyError as exc:
                log.info("a port-forward session broke the SPDY framing: %s", exc)
                await self._send(spdy.goaway(max(self.streams, default=0)))
                return

    async def _on_control(self, frame: spdy.ControlFrame) -> bool:
        """Handle one control frame; False once the client says goodbye."""
        if frame.type == spdy.SYN_STREAM:
            await self._on_syn_stream(frame)
        elif frame.type == spdy.RST_STREAM:
            pair = self.pairs.get(self.streams.get(spdy.stream_id(frame), ""))
            if pair is not None and pair.writer is not None:
                pair.writer.close()
        elif frame.type == spdy.PING:
            await self._send(spdy.control(spdy.PING, 0, frame.payload))
        elif frame.type == spdy.GOAWAY:
            return False
        return True  # SETTINGS, WINDOW_UPDATE, HEADERS: nothing the kubelet acts on either

    async def _on_syn_stream(self, frame: spdy.ControlFrame) -> None:
        stream, headers = self.codec.syn_stream(frame)
        await self._send(self.codec.syn_reply(stream, {}))
        request = (headers.get("requestid") or [""])[0]
        kind = (headers.get("streamtype") or [""])[0]
        pair = self.pairs.setdefault(request, _Pair())
        self.streams[stream] = request
        try:
            pair.port = int((headers.get("port") or ["0"])[0])
        except ValueError:
            pair.port = 0
        if kind == "error":
            pair.error = stream
        elif kind == "data":
            pair.data = stream
        else:
            await self._send(spdy.rst_stream(stream, spdy.PROTOCOL_ERROR))
            return
        if pair.error is not None and pair.data is not None and pair.task is None:
            pair.task = asyncio.ensure_future(self._serve(pair))

    async def _on_data(self, frame: spdy.DataFrame) -> None:
        pair = self.pairs.get(self.streams.get(frame.stream_id, ""))
        if pair is None or frame.stream_id != pair.data:
            return  # the error stream carries nothing from the client
        if pair.writer is None:
            pair.pending.append(frame.data)
            pair.client_done = pair.client_done or frame.fin
            return
        await self._to_pod(pair, frame.data, frame.fin)

    async def _to_pod(self, pair: _Pair, payload: bytes, fin: bool) -> None:
        assert pair.writer is not None
        try:
            if payload:
                pair.writer.write(payload)
                await pair.writer.drain()
                self.count(len(payload))
            if fin and pair.writer.can_write_eof():
                pair.writer.write_eof()
        except (ConnectionError, OSError):
            pair.writer.close()

    async def _serve(self, pair: _Pair) -> None:
        """Dial the pair's port, then copy the pod's bytes to the client until it ends."""
        assert pair.error is not None and pair.data is not None
        try:
            reader, pair.writer = await self.connect(pair.port)
        except (ConnectionError, OSError) as exc:
            await self._send(spdy.data(pair.error, self.explain(pair.port, exc).encode()))
            await self._finish(pair)
            return
        pending, pair.pending = b"".join(pair.pending), []
        await self._to_pod(pair, pending, pair.client_done)
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await reader.read(CHUNK):
                await self._send(spdy.data(pair.data, chunk))
                self.count(len(chunk))
        await self._finish(pair)

    async def _finish(self, pair: _Pair) -> None:
        assert pair.error is not None and pair.data is not None
        await self._send(spdy.data(pair.data, b"", fin=True))
        await self._send(spdy.data(pair.error, b"", fin=True))
        if pair.writer is not None:
            pair.writer.close()
