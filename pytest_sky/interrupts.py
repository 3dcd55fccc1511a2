"""A stop signal (SIGTERM under pytest) that is never lost on its way to the code it stops.

The plugin turns SIGTERM into what Ctrl-C is, a ``KeyboardInterrupt`` raised by the signal's
handler wherever the main thread happens to be.  When that is inside a finalizer, the
exception is swallowed: paramiko's ``Channel.__del__`` closes the channel under a bare
``except:``, and the cyclic garbage collector runs finalizers in the main thread at any
allocation.  A run then went on as if no signal had come (a CI job's cancel answered only
when the run ended by itself; the interrupt tests saw it under load).  So the handler also
notes the signal here, and the client's wait for a run raises it again (:func:`check`) until
it has been seen (:func:`seen`).
"""

from __future__ import annotations

from typing import Any

_pending: list[int] = []


def request(signum: int) -> None:
    """Stop the main thread, as Ctrl-C does (a signal handler's whole job)."""
    _pending.append(signum)
    raise _stop(signum)


def check() -> None:
    """Raise again the stop that a finalizer swallowed; nothing when there is none."""
    if _pending:
        signum = _pending[-1]
        _pending.clear()
        raise _stop(signum)


def _stop(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt(f"pytest-sky: signal {signum}: tearing clusters down")


def seen() -> None:
    """The stop reached code that handles it: nothing is left to raise again."""
    _pending.clear()


def reportable(excinfo: Any) -> None:
    """Drop from a pytest ``ExceptionInfo`` the traceback entries that have no line number.

    A signal's handler runs wherever the main thread is; a frame stopped at an instruction
    with no source line gets a traceback entry without a line number, and pytest's own report
    of the interrupt failed on it with a TypeError (``None - 1``): pytest exited 1, not 2,
    and showed neither the interrupt nor where it was (once, in a fresh-clone CI run)."""
    entries = list(excinfo.traceback)
    located = [entry for entry in entries if _has_line(entry)]
    if len(located) < len(entries):
        excinfo.traceback = type(excinfo.traceback)(located)


def _has_line(entry: Any) -> bool:
    try:
        entry.lineno  # noqa: B018 - reading it is what fails
    except TypeError:
        return False
    return True
