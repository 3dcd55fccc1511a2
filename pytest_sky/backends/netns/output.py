"""What the helpers print and what a node's log says: read by a deadline, tailed for errors."""

from __future__ import annotations

import os
import select
import subprocess
import time
from pathlib import Path

from pytest_sky.errors import ProvisionError


class Lines:
    """The lines a helper prints on its stdout (the real signals), each read by a deadline."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        assert popen.stdout is not None
        self.fd = popen.stdout.fileno()
        self.buffer = b""

    def next(self, deadline: float) -> str | None:
        """The next line; None at the end of the output or at ``deadline`` (``time.monotonic``)."""
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self.fd, 65536) if ready else b""
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode(errors="replace")


def await_line(popen: subprocess.Popen[bytes], expected: str, failure: str, log_path: Path, timeout: float) -> None:
    """Read the one line a helper prints when it is in place."""
    if Lines(popen).next(time.monotonic() + timeout) != expected:
        raise ProvisionError(f"{failure}: {tail(log_path) or 'no output'}")


def tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])
