"""SPDY/3.1 framing: what kubectl's port-forward speaks inside its websocket.

kubectl (1.31 and later) opens a port-forward as a websocket whose subprotocol is
``SPDY/3.1+portforward.k8s.io`` and runs a SPDY session through it, as older ones ran it
over a raw upgraded connection: every forwarded connection is a pair of streams (``error``
and ``data``) opened by the client with SYN_STREAM frames whose headers name the port and
the request.  Frames, as draft 3 of the SPDY protocol defines them:

- control: the control bit and version 3 (16 bits), type (16), flags (8), length (24), then
  the type's payload; SYN_STREAM and SYN_REPLY carry a header block;
- data: the stream id (31 bits, control bit clear), flags (8; FIN is 1), length (24), data.

A header block is a count of pairs, each a length-prefixed name and value (big-endian
32-bit lengths), compressed with zlib primed with the protocol's dictionary; each direction
of a session keeps one compression context across all its frames, so every block is
flushed with a sync flush, never finished.  A zlib stream names its dictionary by checksum:
a dictionary that is wrong by one byte fails on the first header block, in both directions.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

VERSION = 3
SYN_STREAM, SYN_REPLY, RST_STREAM, SETTINGS, PING, GOAWAY, HEADERS, WINDOW_UPDATE = 1, 2, 3, 4, 6, 7, 8, 9
FLAG_FIN = 0x01
#: RST_STREAM status codes.
PROTOCOL_ERROR, INVALID_STREAM, REFUSED_STREAM, CANCEL = 1, 2, 3, 5
#: The largest payload one frame holds.
MAX_LENGTH = (1 << 24) - 1

# The header compression dictionary of SPDY/3 (draft 3, "Compression"): these names and
# values, each with a 32-bit big-endian length before it, then the tail below as it is.
_WORDS = (
    "options",
    "head",
    "post",
    "put",
    "delete",
    "trace",
    "accept",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "connection",
    "content-base",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-md5",
    "content-range",
    "content-type",
    "date",
    "etag",
    "expect",
    "expires",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "location",
    "max-forwards",
    "pragma",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "retry-after",
    "server",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "user-agent",
    "vary",
    "via",
    "warning",
    "www-authenticate",
    "method",
    "get",
    "status",
    "200 OK",
    "version",
    "HTTP/1.1",
    "url",
    "public",
    "set-cookie",
    "keep-alive",
    "origin",
)
_TAIL = (
    "100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505"
    "203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request"
    "401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented"
    "503 Service Unavailable"
    "Jan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMT"
    "chunked,text/html,image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,"
    "text/plain,text/javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8"
    "charset=iso-8859-1,utf-,*,enq=0."
)
DICTIONARY = b"".join(struct.pack(">I", len(w)) + w.encode() for w in _WORDS) + _TAIL.encode()


class SpdyError(Exception):
    """The peer broke the framing; the session cannot go on."""


@dataclass(frozen=True)
class ControlFrame:
    type: int
    flags: int
    payload: bytes


@dataclass(frozen=True)
class DataFrame:
    stream_id: int
    flags: int
    data: bytes

    @property
    def fin(self) -> bool:
        return bool(self.flags & FLAG_FIN)


Frame = ControlFrame | DataFrame
Headers = dict[str, list[str]]


class FrameReader:
    """Frames out of a byte stream that arrives in pieces of any size (websocket messages)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames: list[Frame] = []
        while len(self._buffer) >= 8:
            first, flags_length = struct.unpack_from(">II", self._buffer)
            length = flags_length & 0xFFFFFF
            if len(self._buffer) < 8 + length:
                break
            payload = bytes(self._buffer[8 : 8 + length])
            del self._buffer[: 8 + length]
            flags = flags_length >> 24
            if first & 0x80000000:
                if (first >> 16) & 0x7FFF != VERSION:
                    raise SpdyError(f"SPDY version {(first >> 16) & 0x7FFF}: only {VERSION} is spoken")
                frames.append(ControlFrame(first & 0xFFFF, flags, payload))
            else:
                frames.append(DataFrame(first & 0x7FFFFFFF, flags, payload))
        return frames


def control(type_: int, flags: int, payload: bytes) -> bytes:
    return struct.pack(">HHI", 0x8000 | VERSION, type_, (flags << 24) | len(payload)) + payload


def data(stream_id: int, payload: bytes, *, fin: bool = False) -> bytes:
    """One DATA frame (``payload`` at most :data:`MAX_LENGTH`)."""
    return struct.pack(">II", stream_id & 0x7FFFFFFF, ((FLAG_FIN if fin else 0) << 24) | len(payload)) + payload


def rst_stream(stream_id: int, status: int) -> bytes:
    return control(RST_STREAM, 0, struct.pack(">II", stream_id & 0x7FFFFFFF, status))


def goaway(last_stream_id: int) -> bytes:
    return control(GOAWAY, 0, struct.pack(">II", last_stream_id & 0x7FFFFFFF, 0))


def stream_id(frame: ControlFrame) -> int:
    """The stream a SYN_STREAM, SYN_REPLY, RST_STREAM, HEADERS or WINDOW_UPDATE is about."""
    if len(frame.payload) < 4:
        raise SpdyError(f"control frame {frame.type} too short for a stream id")
    return struct.unpack_from(">I", frame.payload)[0] & 0x7FFFFFFF


class HeaderCodec:
    """One session's two compression contexts: what it reads, what it writes."""

    def __init__(self) -> None:
        self._inflate = zlib.decompressobj(zdict=DICTIONARY)
        self._deflate = zlib.compressobj(zlib.Z_BEST_COMPRESSION, zdict=DICTIONARY)

    def read(self, block: bytes) -> Headers:
        try:
            raw = self._inflate.decompress(block)
        except zlib.error as exc:
            raise SpdyError(f"a header block does not inflate: {exc}") from None
        headers: Headers = {}
        try:
            (count,) = struct.unpack_from(">I", raw)
            at = 4
            for _ in range(count):
                name, at = _string(raw, at)
                value, at = _string(raw, at)
                headers[name.lower()] = value.split("\0")
        except struct.error:
            raise SpdyError("a header block ends inside a name or value") from None
        return headers

    def write(self, headers: Headers) -> bytes:
        raw = struct.pack(">I", len(headers))
        for name, values in headers.items():
            for text in (name.lower(), "\0".join(values)):
                encoded = text.encode()
                raw += struct.pack(">I", len(encoded)) + encoded
        return self._deflate.compress(raw) + self._deflate.flush(zlib.Z_SYNC_FLUSH)

    def syn_stream(self, frame: ControlFrame) -> tuple[int, Headers]:
        """A SYN_STREAM's stream id and headers (after the associated id, priority and slot)."""
        if len(frame.payload) < 10:
            raise SpdyError("SYN_STREAM too short")
        return stream_id(frame), self.read(frame.payload[10:])

    def syn_reply(self, stream: int, headers: Headers, *, fin: bool = False) -> bytes:
        block = self.write(headers)
        return control(SYN_REPLY, FLAG_FIN if fin else 0, struct.pack(">I", stream & 0x7FFFFFFF) + block)


def _string(raw: bytes, at: int) -> tuple[str, int]:
    (length,) = struct.unpack_from(">I", raw, at)
    end = at + 4 + length
    if end > len(raw):
        raise struct.error("short")
    return raw[at + 4 : end].decode("utf-8", "replace"), end
