"""Container images, as the emulated kubelet runs them: views of this machine's tree.

A pod's root is already a copy-on-write layer over this machine's ``/`` (``kubelet.py``), so
an image is modelled by what it does *not* have: named paths of this machine that are absent
in the pod.  The pod's node hides them as it hides the emulator's own state (``NodeSpec.hide``):
files are removed in the pod's own layer (overlayfs records a whiteout there; the host's
file is untouched), directories are covered by an empty tmpfs.  Both happen in the pod's
mount namespace while its init assembles its root, before the container's command runs, so
the command, every exec and every ssh session see the same image.

The catalogue (what a registry would have):

- ``pytest-sky-node`` under any registry and tag (what ``examples/kubernetes/Dockerfile``
  builds, e.g. ``pytest-sky-node:torch2.13.0-cpu``): nothing absent.  Python with torch,
  mpi4py and NeMo, OpenSSH server and client, OpenMPI: this machine as the test suite sees it.
- ``python:3.11-slim-bookworm`` (the backend's default; also ``python:3.11-slim``, with or
  without ``docker.io/library/``): no sshd, no ssh client, no ``mpirun``, no Python
  environment with torch (``python3`` is the system's bare interpreter), and no apt package
  lists or cached archives, so ``apt-get install`` cannot install anything (pods have no
  route out either: ``apt-get update`` fails at once rather than waiting out timeouts).

Any other image fails to pull (ErrImagePull, "not found"), as from a registry that does not
have it: an emulator that runs whatever it is given would hide a typo in ``--kube-image``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

#: The repository name of the image ``examples/kubernetes/Dockerfile`` builds.
READY_REPOSITORY = "pytest-sky-node"
#: The tag the docs and CI use for it.
READY_IMAGE = f"{READY_REPOSITORY}:torch2.13.0-cpu"
SLIM_IMAGE = "python:3.11-slim-bookworm"
SLIM_ALIASES = (SLIM_IMAGE, "python:3.11-slim")
KNOWN = f"{READY_REPOSITORY}:<any tag>, {SLIM_IMAGE}"

SEARCH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: What openssh-server and openssh-client install on PATH.
OPENSSH = ("sshd", "ssh", "scp", "sftp", "ssh-keygen", "ssh-keyscan", "ssh-add", "ssh-agent", "ssh-copy-id")
#: OpenMPI's launchers (Debian names them through alternatives as well).
OPENMPI = ("mpirun", "mpiexec", "orterun", "prterun", "mpirun.openmpi", "mpiexec.openmpi")
#: apt's package lists and downloaded archives: without them nothing can be installed offline.
APT_STATE = ("/var/lib/apt/lists", "/var/cache/apt")
#: The modules whose Python environment the slim image lacks.
PYTHON_EXTRAS = ("torch", "mpi4py")


@dataclass(frozen=True)
class ImageView:
    """One image: the paths of this machine that are absent in it."""

    name: str
    absent_files: tuple[str, ...] = ()
    absent_dirs: tuple[str, ...] = ()

    def hides(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` (absolute) is absent in this image."""
        p = Path(os.path.abspath(path))
        if str(p) in self.absent_files:
            return True
        return any(p == Path(d) or p.is_relative_to(d) for d in self.absent_dirs)

    def which(self, command: str, path: str) -> str | None:
        """``shutil.which`` as it would answer inside the image."""
        for directory in path.split(os.pathsep):
            found = shutil.which(command, path=directory) if directory else None
            if found and not self.hides(found) and not self.hides(os.path.realpath(found)):
                return found
        return None


def repository(image: str) -> str:
    """``registry/team/pytest-sky-node:tag@sha256:...`` -> ``pytest-sky-node``."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[0]


def lookup(image: str) -> ImageView | None:
    """The view of ``image``, or None where the emulated registry has no such image."""
    if repository(image) == READY_REPOSITORY:
        return ImageView(name=image)
    if image.removeprefix("docker.io/").removeprefix("library/") in SLIM_ALIASES:
        return _slim()
    return None


@functools.cache
def _slim() -> ImageView:
    """The slim image: this machine less OpenSSH, OpenMPI, the Python environment that has
    torch, and apt's state.  Computed once, from where those are on this machine."""
    files: list[str] = []
    for command in (*OPENSSH, *OPENMPI):
        for directory in SEARCH_PATH.split(":"):
            candidate = os.path.join(directory, command)
            if os.path.lexists(candidate) and candidate not in files:
                files.append(candidate)
    return ImageView(name=SLIM_IMAGE, absent_files=tuple(files), absent_dirs=(*python_environments(), *APT_STATE))


def python_environments() -> tuple[str, ...]:
    """Where this machine's torch lives, as a directory the slim image lacks: the whole
    virtualenv the emulator runs from (its ``bin`` is first on the pods' PATH), else each
    site directory holding one of ``PYTHON_EXTRAS``."""
    if sys.prefix != sys.base_prefix:
        return (sys.prefix,)
    out: list[str] = []
    for module in PYTHON_EXTRAS:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin:
            site = str(Path(spec.origin).resolve().parent.parent)
            if site not in out:
                out.append(site)
    return tuple(out)
