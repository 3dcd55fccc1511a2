"""The emulator's SPDY/3.1 framing (kubectl's port-forward), apart from kubectl.

``tests/test_kubectl.py`` holds it to kubectl itself; these hold the parts a kubectl run may
not reach: frames split anywhere across websocket messages, several header blocks through one
compression context, and the dictionary (a zlib stream names its dictionary by checksum, so
kubectl refuses every header block of a session whose dictionary is off by one byte).
"""

from __future__ import annotations

import struct
import zlib

import pytest

pytest.importorskip("aiohttp", reason="the emulator needs aiohttp")

from kube_emulator import spdy


def test_the_dictionary_is_the_protocols() -> None:
    assert len(spdy.DICTIONARY) == 1423
    assert zlib.adler32(spdy.DICTIONARY) == 0xE3C6A7C2  # what kubectl's zlib checks for
    assert spdy.DICTIONARY.startswith(b"\x00\x00\x00\x07options\x00\x00\x00\x04head")
    assert spdy.DICTIONARY.endswith(b"charset=iso-8859-1,utf-,*,enq=0.")


def test_frames_split_anywhere_come_out_whole() -> None:
    client, server = spdy.HeaderCodec(), spdy.HeaderCodec()
    headers = {"streamtype": ["data"], "port": ["22"], "requestid": ["7"]}
    block = client.write(headers)
    syn = spdy.control(spdy.SYN_STREAM, 0, struct.pack(">IIH", 3, 0, 0) + block)
    wire = syn + spdy.data(3, b"hello") + spdy.data(3, b"", fin=True) + spdy.control(spdy.PING, 0, b"\0\0\0\1")
    reader = spdy.FrameReader()
    frames = [f for i in range(0, len(wire), 3) for f in reader.feed(wire[i : i + 3])]
    assert [type(f).__name__ for f in frames] == ["ControlFrame", "DataFrame", "DataFrame", "ControlFrame"]
    assert server.syn_stream(frames[0]) == (3, headers)
    assert (frames[1].data, frames[1].fin, frames[2].fin) == (b"hello", False, True)
    # A second block goes through the same context on both sides, as in a session.
    assert server.read(client.write({"streamtype": ["error"]})) == {"streamtype": ["error"]}


def test_a_peer_that_breaks_the_framing_is_told_apart() -> None:
    with pytest.raises(spdy.SpdyError, match="SPDY version 2"):
        spdy.FrameReader().feed(struct.pack(">HHI", 0x8002, spdy.PING, 4) + b"\0\0\0\1")
    with pytest.raises(spdy.SpdyError, match="does not inflate"):
        spdy.HeaderCodec().read(b"not zlib at all")
