"""Run Python code as an unprivileged user (or as root without capabilities), on any root
machine: the tests that check what a user without privileges sees must run in CI too.

A fresh clone may live under a directory only root can enter (``/root`` is 0700), where
``nobody`` could reach neither the interpreter nor the code.  So the code runs in a private
mount namespace in which the repository (and the virtualenv, if it lives elsewhere) are
bind-mounted under a world-traversable temporary directory; those mounts die with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]
AS_ROOT_WITHOUT_CAPS = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]


def world_dir(prefix: str) -> Path:
    """A fresh directory any user may enter and write (for files the code must reach)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(path, 0o777)
    return path


def run_python(how: list[str], code: str, *, env: dict[str, str] | None = None, timeout: float = 60):
    """``code`` run by this test's interpreter, dropped to ``how``; a CompletedProcess (text)."""
    mnt = world_dir("psky-unpriv-")
    os.chmod(mnt, 0o755)
    (mnt / "repo").mkdir()
    binds = [(str(REPO), str(mnt / "repo"))]
    exe, prefix = Path(sys.executable), Path(sys.prefix)
    if exe.is_relative_to(REPO):
        python = mnt / "repo" / exe.relative_to(REPO)
    elif exe.is_relative_to(prefix):  # a virtualenv outside the repository
        (mnt / "venv").mkdir()
        binds.append((str(prefix), str(mnt / "venv")))
        python = mnt / "venv" / exe.relative_to(prefix)
    else:
        python = exe
    mounts = " && ".join(f"mount --bind {src!r} {dst!r}" for src, dst in binds)
    script = f'{mounts} && exec "$@"'
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *how, str(python), "-c", code]
    child_env = {**os.environ, **(env or {}), "PYTHONPATH": str(mnt / "repo")}
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, env=child_env, cwd="/", timeout=timeout, check=False
        )
    finally:
        for sub in ("repo", "venv"):
            try:
                (mnt / sub).rmdir()
            except OSError:
                pass
        mnt.rmdir()
