"""Run Python code as an unprivileged user (or as root without capabilities), on any root
machine: the tests that check what a user without privileges sees must run in CI too.

A fresh clone may live under a directory only root can enter (``/root`` is 0700), and so may
the interpreter (pyenv's ``~/.pyenv``); ``nobody`` could reach neither.  So the code runs in a
private mount namespace in which the repository, the virtualenv (if it lives elsewhere) and
the base interpreter's installation are bind-mounted under a world-traversable temporary
directory, and this test's own interpreter runs from there with the virtualenv's
site-packages on its path.  Nothing is copied; the mounts die with the namespace.
"""

from __future__ import annotations

import os
import shlex
import site
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]
AS_ROOT_WITHOUT_CAPS = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]


def world_dir(prefix: str) -> Path:
    """A fresh directory any user may enter and write (for files the code must reach)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(path, 0o777)
    return path


def run_python(how: list[str], code: str, *, env: dict[str, str] | None = None, timeout: float = 60):
    """``code`` run by this test's interpreter, dropped to ``how``; a CompletedProcess (text)."""
    mnt = Path(tempfile.mkdtemp(prefix="psky-unpriv-", dir="/tmp"))
    os.chmod(mnt, 0o755)
    base = Path(sys.base_prefix).resolve()
    venv = Path(sys.prefix).resolve()
    binds = {REPO: mnt / "repo", base: mnt / "base"}
    if venv != base and not venv.is_relative_to(REPO):
        binds[venv] = mnt / "venv"

    def seen_as(path: Path) -> Path:
        """Where ``path`` is inside the namespace (the most specific bind wins)."""
        path = path.resolve()
        for src in sorted(binds, key=lambda p: len(p.parts), reverse=True):
            if path.is_relative_to(src):
                return binds[src] / path.relative_to(src)
        return path

    # The base interpreter itself (a venv's bin/python is a symlink to it, by absolute path).
    python = seen_as(Path(getattr(sys, "_base_executable", sys.executable)))
    path = [str(mnt / "repo"), *(str(seen_as(Path(p))) for p in site.getsitepackages() if Path(p).is_dir())]
    child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")}
    child_env.update(env or {})
    child_env["PYTHONPATH"] = os.pathsep.join(path)
    if any((base / "lib").glob("libpython*.so*")):  # a shared build finds libpython by RPATH
        child_env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(mnt / "base" / "lib"), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
        )
    for dst in binds.values():
        dst.mkdir()
    mounts = " && ".join(f"mount --bind {shlex.quote(str(s))} {shlex.quote(str(d))}" for s, d in binds.items())
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh", *how]
    # Some builds find their shared libpython only under their own (unreachable) prefix; the
    # system's interpreter of the same version then runs the same code and site-packages.
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [str(python), f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    try:
        for candidate in candidates:
            probe = subprocess.run(
                [*argv, candidate, "-s", "-c", "import yaml"],
                capture_output=True,
                env=child_env,
                cwd="/",
                timeout=timeout,
                check=False,
            )
            if probe.returncode == 0:
                break
        return subprocess.run(
            [*argv, candidate, "-s", "-c", code],
            capture_output=True,
            text=True,
            env=child_env,
            cwd="/",
            timeout=timeout,
            check=False,
        )
    finally:
        for dst in binds.values():
            dst.rmdir()
        mnt.rmdir()
