"""User-facing progress and messages, kept apart from logging.

Progress is for people watching a launch (the CLI turns it on); the plugin leaves it off and
lets pytest's own reporting speak.  Errors and hints always print: they answer a command the
user typed.  Everything also goes to ``logging``.

Two modes, chosen per message by ``interactive()``:

* On a terminal, output goes through one ``rich`` console on stderr: open counters are a
  transient ``Live`` display that rich redraws in place (messages print above it), and errors
  are red.  We write no escape codes by hand; rich owns the cursor.
* Piped or in CI, every message is a plain ``pytest-sky: ...`` line and a counter prints only
  when it completes, so logs stay readable and free of escape codes.  This path never imports
  rich (about 25 ms), which keeps ``import pytest_sky`` cheap for the plugin.

Counters are reported from several threads (one per node coming up), so all state sits
behind one lock.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.live import Live

__all__ = ["counter", "enable", "error", "hint", "interactive", "note", "progress", "table"]

log = logging.getLogger("pytest_sky")
PREFIX = "pytest-sky:"

_enabled = False
_lock = threading.RLock()
_open: dict[str, tuple[int, int]] = {}  # counters not yet complete, in first-report order
_last = ""  # the last line shown: a counter completing twice in a row shows once
_live: Live | None = None
_rich: Console | None = None  # the stderr console; tests put a forced-terminal one here


def enable(on: bool = True) -> None:
    """Turn progress and counters on (the CLI) or off (the default, for the plugin)."""
    global _enabled
    _enabled = on


def interactive() -> bool:
    """A person is watching stderr: a tty, not CI, and a terminal that understands redraws."""
    return sys.stderr.isatty() and not os.environ.get("CI") and os.environ.get("TERM") != "dumb"


def progress(message: str) -> None:
    """One step of a launch, for people watching; shown only when enabled."""
    log.info(message)
    if _enabled:
        _say(f"{PREFIX} {message}")


def counter(label: str, done: int, total: int) -> None:
    """``label done/total``: redrawn in place on a terminal, one line at the end otherwise.

    The same completion reported twice in a row (a poll loop that sees the last pod again)
    prints once.
    """
    log.debug("%s %d/%d", label, done, total)
    if not _enabled:
        return
    line = f"{PREFIX} {label} {done}/{total}"
    with _lock:
        if done < total:
            if interactive():
                _open[label] = (done, total)
                _redraw()
            return
        _open.pop(label, None)
        if line == _last:
            return
        if interactive() and _open:
            _redraw()  # the others stay live, below the finished line
        elif interactive():
            _stop_live()
        _say(line)


def error(message: str) -> None:
    """A one-line failure; it ends any counter still drawn, so it is the last thing shown."""
    log.info("error: %s", message)  # info: a warning would reach stderr twice (lastResort)
    with _lock:
        _open.clear()
        if not interactive():
            _plain(f"{PREFIX} error: {message}")
            return
        from rich.text import Text

        _stop_live()
        _remember(f"{PREFIX} error: {message}")
        _console().print(Text.assemble((f"{PREFIX} error:", "red"), " ", message), soft_wrap=True)


def hint(message: str) -> None:
    """What to type next; always shown, since it answers the user's own command."""
    log.info("hint: %s", message)
    _say(f"{PREFIX} {message}")


def note(message: str) -> None:
    """Something the user asked for and does not get (a task's cloud, an image locally);
    always shown, once, since a silent difference is the one wrong answer."""
    log.info("note: %s", message)  # info: a warning would reach stderr twice (lastResort)
    _say(f"{PREFIX} note: {message}")


def table(headers: list[str], rows: list[list[str]]) -> None:
    """Rows on stdout: a rich table for a terminal, space-aligned columns for scripts.

    The plain format is a contract (scripts split it on whitespace): columns two spaces
    apart, each as wide as its widest cell, trailing spaces stripped.
    """
    if not interactive():
        for line in _plain_table(headers, rows):
            print(line)
        return
    from rich.console import Console
    from rich.table import Table

    grid = Table(*headers, box=None, header_style="bold")
    for row in rows:
        grid.add_row(*row)
    Console().print(grid)


def _plain_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [headers, *rows]]


def _say(line: str) -> None:
    """One message line, printed above any live counters on a terminal."""
    if not interactive():
        _plain(line)
        return
    from rich.text import Text

    with _lock:
        _remember(line)
        _console().print(Text(line), soft_wrap=True)


def _plain(line: str) -> None:
    with _lock:
        _remember(line)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _remember(line: str) -> None:
    global _last
    _last = line


def _console() -> Console:
    global _rich
    if _rich is None:
        from rich.console import Console

        _rich = Console(stderr=True, highlight=False)
    return _rich


def _redraw() -> None:
    """Show the open counters, one line each, in rich's live display (started on demand)."""
    global _live
    from rich.live import Live
    from rich.text import Text

    lines = Text("\n".join(f"{PREFIX} {label} {d}/{t}" for label, (d, t) in _open.items()))
    if _live is None:
        _live = Live(
            lines,
            console=_console(),
            transient=True,
            auto_refresh=False,  # redraw on each report, not from a thread of rich's own
            redirect_stdout=False,  # stdout may be a pipe; never mix it into stderr
            redirect_stderr=False,
        )
        _live.start(refresh=True)
    else:
        _live.update(lines, refresh=True)


@atexit.register
def _stop_live() -> None:
    """Erase the live display and give the cursor back (also at exit, if a launch died)."""
    global _live
    with _lock:
        if _live is not None:
            _live.stop()
            _live = None
