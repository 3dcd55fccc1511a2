"""Locks on files, between processes and between threads: ``flock``, which the kernel drops
when its holder dies (a SIGKILLed run leaves no stale lock behind).

One way to take one, for the client (cluster records, bridges) and for the node agent, which
bundles this module: stdlib only, and only ``os`` and ``contextlib`` at import time.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

TYPE_CHECKING = False  # typing's own would cost its import on the agent's every run
if TYPE_CHECKING:
    from collections.abc import Iterator


def _acquire(path: str | os.PathLike, exclusive: bool) -> int:
    import fcntl

    # A directory is locked as it is (flock takes one): a lock that leaves no file behind.
    flags = os.O_RDONLY | os.O_DIRECTORY if os.path.isdir(path) else os.O_RDWR | os.O_CREAT
    fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def flocked(path: str | os.PathLike, *, exclusive: bool = True) -> Iterator[None]:
    """Hold ``path``'s lock (a file, made if missing, or a directory) for the block: exclusive,
    or shared with other shared holders."""
    fd = _acquire(path, exclusive)
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


class ReentrantFlock:
    """An exclusive :func:`flocked` lock that the thread holding it may take again (a locked
    step may call another).  Each thread opens the file itself: two open files of one
    process exclude each other as two processes do."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = path
        self._held = threading.local()

    def __enter__(self) -> None:
        depth = getattr(self._held, "depth", 0)
        if depth == 0:
            self._held.fd = _acquire(self.path, exclusive=True)
        self._held.depth = depth + 1

    def __exit__(self, *exc: object) -> None:
        self._held.depth -= 1
        if self._held.depth == 0:
            os.close(self._held.fd)  # releases the lock


def rewrite(path: str, text: str) -> None:
    """Replace the text of ``path``, a file only ever read and written under its lock (held
    by the caller), in place: no reader can see it half written, and a new file per write
    (the usual write-then-rename) cost every run on this machine's ext4 (no journal) inode
    allocations that scan past each recently freed inode."""
    data = text.encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)
