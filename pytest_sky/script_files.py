"""Long task scripts travel to the nodes as files, not on a command line.

A rank's program reaches bash as one environment variable (``shell.PROGRAM_VAR``; never a
command line, which every user may read), and Linux caps one at 128 KiB (``MAX_ARG_STRLEN``):
a longer ``run`` or ``setup`` (SkyPilot's smoke tests run a 5.5 MB one) would fail with
"Argument list too long".  Such a
script goes with the task's files (``Cluster._sync``: one tarball to the head, fanned out to
every worker) as ``~/.sky/scripts/<sha256>.sh``, and the program sources it: the same shell,
the same environment, and bash's errors name the script's own line numbers.
"""

from __future__ import annotations

import copy
import hashlib

from pytest_sky.task import Task

#: Scripts longer than this travel as files: well under the 128 KiB of one argument, with
#: room for the environment and the prefix the agent puts before the script.
INLINE_SCRIPT_BYTES = 32 * 1024
SCRIPTS_DIR = "~/.sky/scripts"


def ship_long_scripts(task: Task) -> tuple[Task, dict[str, bytes]]:
    """The task with each long script replaced by a line that sources its file, and the
    files (remote path -> content) to put on every node first."""
    files: dict[str, bytes] = {}
    replaced: dict[str, str] = {}
    for phase in ("setup", "run"):
        script = getattr(task, phase)
        data = script.encode("utf-8", "surrogateescape") if script else b""
        if len(data) <= INLINE_SCRIPT_BYTES:
            continue
        remote = f"{SCRIPTS_DIR}/{hashlib.sha256(data).hexdigest()[:32]}.sh"
        files[remote] = data
        replaced[phase] = f". {remote}"
    if not replaced:
        return task, files
    shipped = copy.copy(task)
    for phase, line in replaced.items():
        setattr(shipped, phase, line)
    return shipped, files
