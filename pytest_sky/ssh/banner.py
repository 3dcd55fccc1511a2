"""Waiting for sshds to answer: the real signal that a node is up is its SSH banner.

One thread dials every address without blocking, so waiting for 64 starting sshds costs
them no CPU they need (a thread each did: 64 threads fighting over the GIL while the sshds
start); an address that refuses (its sshd is not listening yet) is dialled again on a short
back-off.
"""

from __future__ import annotations

import errno
import heapq
import selectors
import socket
import time
from collections.abc import Callable, Sequence

#: Why an address is in the answer when its time ran out (the other reasons name an error).
NO_BANNER = "no banner by the deadline"

#: Not listening yet, or its address not up yet: dial again.
RETRY_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNRESET})


def wait_for_banners(
    addresses: Sequence[tuple[str, int]],
    *,
    deadline: float,
    gone: Callable[[int], str | None] = lambda i: None,
    on_ready: Callable[[int], None] = lambda i: None,
    opener: Callable[[str, int], socket.socket] | None = None,
) -> dict[int, str]:
    """Dial each address until it sends ``SSH-``; returns ``{index: why not}`` for those
    that never did by ``deadline`` (``time.monotonic``), or whose ``gone(index)`` said why
    they never will (the node exited).  ``on_ready(index)`` runs as each answers.
    ``opener(host, port)``, where the host cannot dial the address itself (a rootless
    cluster's door), returns a connected socket or raises OSError with the connect's errno."""
    failed: dict[int, str] = {}
    retry: list[tuple[float, float, int]] = [(0.0, 0.001, i) for i in range(len(addresses))]
    dialling: list[int] = []
    sel = selectors.DefaultSelector()
    try:
        while retry or sel.get_map():
            now = time.monotonic()
            while retry and retry[0][0] <= now:
                _, delay, i = heapq.heappop(retry)
                why = gone(i)
                if why is not None:
                    failed[i] = why
                    continue
                sock, rc = _dial(addresses[i], opener)
                if sock is not None and rc in (0, errno.EINPROGRESS):
                    sel.register(sock, selectors.EVENT_READ, (i, delay))
                    continue
                if sock is not None:
                    sock.close()
                if rc not in RETRY_ERRNOS:
                    failed[i] = f"connect to {addresses[i][0]}:{addresses[i][1]}: {errno.errorcode.get(rc, rc)}"
                    continue
                heapq.heappush(retry, (now + delay, min(delay * 2, 0.02), i))
            if now >= deadline or not (retry or sel.get_map()):
                break  # out of time, or every address has answered or failed: nothing to wait for
            wake = min(retry[0][0] if retry else deadline, deadline)
            for key, _ in sel.select(timeout=max(0.0, wake - time.monotonic())):
                _answered(key, sel, retry, failed, addresses, on_ready)
    finally:
        for key in list(sel.get_map().values()):
            dialling.append(key.data[0])
            key.fileobj.close()  # type: ignore[union-attr]
        sel.close()
    for i in [i for _, _, i in retry] + dialling:
        failed.setdefault(i, NO_BANNER)
    return failed


def _dial(
    address: tuple[str, int], opener: Callable[[str, int], socket.socket] | None
) -> tuple[socket.socket | None, int]:
    """A socket dialling ``address`` (not blocking), and the connect's errno so far."""
    if opener is not None:
        try:
            sock = opener(*address)
        except OSError as exc:
            return None, exc.errno or errno.EIO
        sock.setblocking(False)
        return sock, 0
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock, sock.connect_ex(address)


def _answered(
    key: selectors.SelectorKey,
    sel: selectors.BaseSelector,
    retry: list[tuple[float, float, int]],
    failed: dict[int, str],
    addresses: Sequence[tuple[str, int]],
    on_ready: Callable[[int], None],
) -> None:
    """One dialled socket is readable: a banner, or a refusal to dial again after."""
    sock = key.fileobj
    assert isinstance(sock, socket.socket)
    i, delay = key.data
    sel.unregister(sock)
    try:
        data = sock.recv(64)
        err = 0
    except OSError as exc:
        data, err = b"", exc.errno or 0
    finally:
        sock.close()
    if data.startswith(b"SSH-"):
        on_ready(i)
    elif err and err not in RETRY_ERRNOS:
        failed[i] = f"{addresses[i][0]}:{addresses[i][1]}: {errno.errorcode.get(err, err)}"
    else:  # refused or closed before a banner: not listening yet (or MaxStartups): again
        heapq.heappush(retry, (time.monotonic() + delay, min(delay * 2, 0.02), i))
