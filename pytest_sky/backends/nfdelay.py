"""A packet delayer for kernels without ``sch_netem``: NFQUEUE over raw netlink.

Run inside a node's network (and PID) namespace as a script of its own (it imports nothing
of pytest-sky, so the node needs no path set up): ``python nfdelay.py QUEUE DELAY_MS
JITTER_MS``.  The node's iptables send every packet it sends or receives to queue ``QUEUE``
(``-j NFQUEUE --queue-bypass``: with no delayer bound, packets pass); this program holds each
for ``DELAY_MS`` (± a uniform ``JITTER_MS``) and then accepts it, which is what netem's
``delay`` does.  It copies no payload (metadata only) and takes GSO packets whole, so the
cost per packet is one read and one verdict.  It prints ``bound`` once the queue is its own
(the host waits for that line) and runs until it is killed, or its node dies with it.

Why raw netlink: no C library (libnetfilter_queue) or Python binding is needed, and the
protocol is four message types (``linux/netfilter/nfnetlink_queue.h``).
"""

from __future__ import annotations

import errno
import heapq
import os
import random
import select
import socket
import struct
import sys
import time

try:
    from pytest_sky.backends import netlink
except ImportError:  # run as a program of its own (python -I nfdelay.py): from its directory
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import netlink  # type: ignore[import-not-found,no-redef]

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 1, 4
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_ACCEPT = 1
_attr = netlink.attr


def _message(kind: int, queue: int, attrs: bytes, flags: int = netlink.NLM_F_REQUEST, seq: int = 0) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return netlink.message((NFNL_SUBSYS_QUEUE << 8) | kind, body, flags, seq)


def bind(queue: int) -> socket.socket:
    """A netlink socket owning ``queue``: metadata only, GSO packets whole, and fail-open
    (a full queue accepts rather than drops: the delayer must never be the one losing)."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    flags = NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO
    steps = [
        _attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_INET)),
        _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
        + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 65536))
        + _attr(NFQA_CFG_FLAGS, struct.pack("!I", flags))
        + _attr(NFQA_CFG_MASK, struct.pack("!I", flags)),
    ]
    for seq, attrs in enumerate(steps, 1):
        sock.send(_message(NFQNL_MSG_CONFIG, queue, attrs, netlink.NLM_F_REQUEST | netlink.NLM_F_ACK, seq))
        netlink.check_ack(sock, f"binding NFQUEUE {queue}")
    return sock


def packet_ids(data: bytes) -> list[int]:
    """The packet ids of every NFQNL_MSG_PACKET in one netlink read."""
    ids = []
    offset = 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 16:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            pos = offset + 20  # nlmsghdr (16) + nfgenmsg (4)
            while pos + 4 <= offset + length:
                alen, atype = struct.unpack_from("=HH", data, pos)
                if alen < 4:
                    break
                if atype & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, pos + 4)[0])
                pos += (alen + 3) & ~3
        offset += (length + 3) & ~3
    return ids


def run(queue: int, delay_s: float, jitter_s: float) -> None:
    sock = bind(queue)
    print("bound", flush=True)
    held: list[tuple[float, int]] = []  # (release time, packet id)
    while True:
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, packet = heapq.heappop(held)
            verdict = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet))
            sock.send(_message(NFQNL_MSG_VERDICT, queue, verdict))
        wait = max(0.0, held[0][0] - now) if held else None
        ready, _, _ = select.select([sock], [], [], wait)
        if ready:
            try:
                data = sock.recv(1 << 20)
            except OSError as exc:  # ENOBUFS: the kernel let packets pass (fail-open); go on
                if exc.errno != errno.ENOBUFS:
                    raise
                continue
            arrived = time.monotonic()
            for packet in packet_ids(data):
                extra = random.uniform(-jitter_s, jitter_s) if jitter_s else 0.0
                heapq.heappush(held, (arrived + max(0.0, delay_s + extra), packet))


if __name__ == "__main__":
    run(int(sys.argv[1]), float(sys.argv[2]) / 1000, float(sys.argv[3]) / 1000)
