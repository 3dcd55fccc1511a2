"""User-facing progress and messages, kept apart from logging.

Progress is for people watching a launch (the CLI turns it on); the plugin leaves it off and
lets pytest's own reporting speak.  On a terminal, counters update one line in place and
errors are coloured; piped or in CI, every message is a plain line and counters print only
when they complete, so logs stay readable.  Everything also goes to ``logging``.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("pytest_sky")
_enabled = False


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def interactive() -> bool:
    return sys.stderr.isatty() and not os.environ.get("CI") and os.environ.get("TERM") != "dumb"


def _write(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


def progress(message: str) -> None:
    log.info(message)
    if _enabled:
        _write(("\r\033[K" if interactive() else "") + f"pytest-sky: {message}\n")


def counter(label: str, done: int, total: int) -> None:
    """``label done/total``: redrawn in place on a terminal, one line at the end otherwise."""
    log.debug("%s %d/%d", label, done, total)
    if not _enabled:
        return
    if interactive():
        _write(f"\r\033[Kpytest-sky: {label} {done}/{total}" + ("\n" if done == total else ""))
    elif done == total:
        _write(f"pytest-sky: {label} {done}/{total}\n")


def error(message: str) -> None:
    prefix = "\033[31mpytest-sky: error:\033[0m" if interactive() else "pytest-sky: error:"
    _write(f"{prefix} {message}\n")


def hint(message: str) -> None:
    _write(f"pytest-sky: {message}\n")
