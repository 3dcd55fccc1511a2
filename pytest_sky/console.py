"""User-facing progress, kept apart from logging.

Progress is for people watching a launch (the CLI turns it on); the plugin leaves it off and
lets pytest's own reporting speak.  Everything also goes to ``logging`` for ``--log-cli``.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("pytest_sky")
_enabled = False


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def progress(message: str) -> None:
    log.info(message)
    if _enabled:
        sys.stderr.write(f"pytest-sky: {message}\n")
        sys.stderr.flush()


def error(message: str) -> None:
    sys.stderr.write(f"pytest-sky: error: {message}\n")
    sys.stderr.flush()
