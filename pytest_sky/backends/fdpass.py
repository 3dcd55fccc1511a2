"""One request, one socket back: how a program asks another for a connection it cannot make
itself, and gets the connected socket (``SCM_RIGHTS``) rather than a relay of its bytes.

A cluster's door (``clusterns``: the host asks the holder for a connection to a node, inside
the cluster's network) and its gateway's dialer (``gateway``: the relay asks for a connection
to the world, from the host's network) speak it: one request line; one reply line, ``OK``
with the socket passed alongside, or ``ERR <errno> <why>``.  Standard library only, and
little of it: ``clusterns.py dial`` runs it once per ssh connection to a rootless node.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Callable

MAX_LINE = 256


def take_socket(conn: socket.socket, request: str, gone: str) -> socket.socket:
    """Ask on ``conn`` and take the answer's socket; OSError with the answer's errno when it
    says no (``gone``: why, when the other side closed without a word)."""
    conn.sendall(request.encode() + b"\n")
    data, fds, _, _ = socket.recv_fds(conn, MAX_LINE, 1)
    status, _, rest = data.decode(errors="replace").strip().partition(" ")
    if status == "OK" and fds:
        return socket.socket(fileno=fds[0])
    for fd in fds:
        os.close(fd)
    code, _, message = rest.partition(" ")
    raise OSError(int(code) if code.isdigit() else errno.EIO, message or gone)


def give_socket(conn: socket.socket, make: Callable[[bytes], socket.socket], timeout: float) -> None:
    """Answer the one request on ``conn`` with the socket ``make`` makes for its line, or with
    why not (the OSError it raised).  The whole request is read before any answer: an answer
    sent sooner, and the connection closed, would meet a client still sending (EPIPE)
    instead of reading why."""
    with conn, contextlib.suppress(OSError):  # a client gone meanwhile: nothing to tell it
        conn.settimeout(timeout)
        with conn.makefile("rb") as lines:
            line = lines.readline(MAX_LINE)
        try:
            target = make(line)
        except OSError as exc:
            code = exc.errno or errno.EIO
            conn.sendall(f"ERR {code} {exc.strerror or os.strerror(code)}\n".encode())
            return
        with target:
            target.settimeout(None)
            socket.send_fds(conn, [b"OK\n"], [target.fileno()])
