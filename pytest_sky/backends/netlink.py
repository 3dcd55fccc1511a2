"""Raw netlink, the little of it our in-node programs need: messages, attributes, acks.

Standard library only, importing nothing of pytest-sky: ``nodeinit`` (a node's start) and
``nfdelay`` (the packet delayer) run as programs of their own inside a node's namespaces,
where this file is imported from their directory; in the package it is
``pytest_sky.backends.netlink`` like any other module.
"""

from __future__ import annotations

import os
import socket
import struct

NLM_F_REQUEST, NLM_F_ACK, NLM_F_REPLACE = 0x1, 0x4, 0x100
NLMSG_ERROR = 2


def attr(kind: int, payload: bytes) -> bytes:
    """One attribute (``struct rtattr`` / ``struct nlattr``), padded to 4 bytes."""
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def message(kind: int, body: bytes, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    """``body`` under a ``struct nlmsghdr``."""
    return struct.pack("=IHHII", 16 + len(body), kind, flags, seq, 0) + body


def check_ack(sock: socket.socket, what: str = "netlink request") -> None:
    """Read the kernel's answer to a request sent with NLM_F_ACK; an error becomes OSError."""
    data = sock.recv(65536)
    _, kind = struct.unpack_from("=IH", data)
    if kind == NLMSG_ERROR:
        (err,) = struct.unpack_from("=i", data, 16)
        if err:
            raise OSError(-err, f"{what}: {os.strerror(-err)}")
