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

_pending: list[int] = []


def request(signum: int) -> None:
    """Stop the main thread, as Ctrl-C does (a signal handler's whole job)."""
    _pending.append(signum)
    raise KeyboardInterrupt(f"pytest-sky: signal {signum}: tearing clusters down")


def check() -> None:
    """Raise again the stop that a finalizer swallowed; nothing when there is none."""
    if _pending:
        signum = _pending[-1]
        _pending.clear()
        raise KeyboardInterrupt(f"pytest-sky: signal {signum}: tearing clusters down")


def seen() -> None:
    """The stop reached code that handles it: nothing is left to raise again."""
    _pending.clear()
