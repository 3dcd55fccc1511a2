"""Exception classes of pytest-sky.

Every error a user can cause or fix is one of these, with a one-line message that says
what is wrong and what to do. The CLI and the plugin print ``str(err)`` and nothing else
(no traceback) for a :class:`SkyError`; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class SkyError(Exception):
    """Base class: a problem the user can act on, described in one line."""


class TaskError(SkyError, ValueError):
    """A task (YAML file, keyword arguments or marker arguments) is invalid."""


class ResourcesError(TaskError):
    """A resource request (cpus, memory, accelerators) is invalid or cannot be met."""


class BackendUnavailableError(SkyError):
    """The selected backend cannot run on this machine (missing privileges or tools)."""


class ProvisionError(SkyError):
    """Nodes could not be brought up; whatever was created has been removed."""


class NameTakenError(ProvisionError):
    """The cluster's name is taken: by a record of this state directory, or by an object of
    someone else's where the backend creates its own.  A name the launch generated is drawn
    again; one the user gave fails with this one line."""


class ClusterNotFoundError(SkyError):
    """No cluster of that name is known to this state directory."""


class RunError(SkyError):
    """A run could not be carried out (connection lost, agent failed), as opposed to a
    task that ran and exited non-zero, which is reported through ``RunResult``."""


class RunTimeoutError(RunError, TimeoutError):
    """A run or a wait went past its bound; the message says what was awaited."""

    def __init__(self, message: str, partial_output: str = "", timeline: object = None, capture: object = None) -> None:
        super().__init__(message)
        self.partial_output = partial_output
        #: A run's ``runner.Timeline`` up to the timeout: which ranks never started or never ended.
        self.timeline = timeline
        #: Where every rank was at the deadline, before they were stopped (a
        #: ``diagnosis.Capture``: ``capture.summary()`` is what a failure report shows).
        self.capture = capture


class NotSupportedError(SkyError):
    """The backend cannot do what was asked (a fault it has no means to inject); the
    message names what would be needed."""


class CommandFailedError(SkyError):
    """A command started by :func:`pytest_sky.run_command_in_parallel` failed."""

    def __init__(self, message: str, result: object | None = None) -> None:
        super().__init__(message)
        self.result = result
