"""What of the host's files a node sees: the host's software, not the host's people.

A pod built from this machine's software would hold its system directories, its Python
(the interpreter pytest runs, its virtualenv) and the test's own tree; it would not hold the
home directories of the machine's users, with their credentials (``~/.ssh``, ``~/.kube``,
``~/.aws``, ``~/.config/gcloud``, ``~/.netrc``), nor what other programs left in the
machine's scratch directories (``/tmp``, ``/var/tmp``: other clusters' ControlMaster sockets,
the user's ssh-agent socket).  A node's root is a copy-on-write layer over the host's
(``nodeinit``); this module says, as a list of steps its init carries out in order, what
differs from the host's (DESIGN.md section 5):

- ``EMPTY``: a directory of the node's own, empty and on its disk, with the host's
  mode and owner, in place of each scratch directory and each home; a file is removed;
- ``KEEP``: the host's directory again, copy-on-write, where one the node must have
  lies in an emptied one (an interpreter under ``~/.pyenv``, a virtualenv or a rootdir under
  ``/tmp`` or a home);
- then the credentials of any home a kept directory shows are emptied again.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterable, Sequence
from pathlib import Path

from pytest_sky import naming
from pytest_sky.backends.nodeinit_protocol import ViewStep as Step

#: Where a home keeps what lets its user into other machines and services: never on a node,
#: even in a home a kept directory shows (a rootdir that is the home itself).
CREDENTIALS = (
    ".ssh",
    ".kube",
    ".aws",
    ".config/gcloud",
    ".azure",
    ".docker",
    ".gnupg",
    ".netrc",
    ".git-credentials",
    ".pypirc",
)
#: Accounts of people (login.defs' UID_MIN), whose homes no node sees; ``nobody`` is none.
FIRST_USER_UID = 1000
NOBODY_UID = 65534
#: The system's own directories: a "home" in one is a daemon's (``/usr/sbin``, ``/bin``), and
#: the system's software, never emptied.
SYSTEM = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    "/run",
    "/sbin",
    "/sys",
    "/usr",
)


def node_view(keep: Iterable[str | os.PathLike[str]]) -> list[tuple[Step, str]]:
    """The steps that make a node's view of the host's files; ``keep``: the directories it
    must see wherever they live (its interpreter, virtualenv, the test's rootdir)."""
    emptied = _outermost([*scratch_dirs(), *homes()])
    kept = _outermost(
        sorted(
            {
                os.path.realpath(k)
                for k in keep
                if os.path.isdir(k) and any(_within(os.path.realpath(k), e) for e in emptied)
            }
        )
    )
    steps = [(Step.EMPTY, e) for e in emptied] + [(Step.KEEP, k) for k in kept]
    for home in homes(every=True):
        for name in CREDENTIALS:
            path = os.path.join(home, name)
            if os.path.lexists(path) and any(_within(path, k) for k in kept):
                steps.append((Step.EMPTY, path))
    return steps


def homes(*, every: bool = False) -> list[str]:
    """The directories of people's homes: ``/root``, ``/home`` (every: each home in it), and
    the home of each account of a person, and of this process's user, wherever it is (not
    ``/``, a top-level directory or one of the system's: a daemon's "home" is often ``/``,
    ``/bin`` or ``/usr/sbin``)."""
    found = [os.path.realpath("/root")]
    if every:
        found += [os.path.realpath(p) for p in _children("/home")]
    else:
        found.append(os.path.realpath("/home"))
    entries = list(pwd.getpwall())
    with_uid = [e.pw_dir for e in entries if e.pw_uid >= FIRST_USER_UID and e.pw_uid != NOBODY_UID]
    own = [os.environ.get("HOME", ""), *(e.pw_dir for e in entries if e.pw_uid == os.getuid())]
    for home in [*with_uid, *own]:
        path = os.path.realpath(home) if home else ""
        person = path.count("/") >= 2 and not any(_within(path, d) for d in SYSTEM)
        if person and os.path.isdir(path) and (every or not any(_within(path, f) for f in found)):
            found.append(path)
    return sorted(set(found) if every else [p for p in found if os.path.isdir(p)])


def scratch_dirs(depth: int = 2) -> list[str]:
    """The host's scratch directories (sticky and world-writable: /tmp, /var/tmp) down to
    ``depth`` levels, outside the directories a node mounts for itself (``/run``, ``/dev``:
    its own already) and below none (a scratch directory's own are its users')."""
    found, level = [], ["/"]
    for _ in range(depth):
        below = []
        for parent in level:
            try:
                entries = list(os.scandir(parent))
            except OSError:
                continue
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False) or entry.path in naming.NODE_OWN_MOUNTS:
                    continue
                if entry.stat(follow_symlinks=False).st_mode & 0o1777 == 0o1777:
                    found.append(entry.path)
                else:
                    below.append(entry.path)
        level = below
    return sorted(found)


def _children(path: str) -> list[Path]:
    try:
        return sorted(p for p in Path(path).iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _outermost(paths: Sequence[str]) -> list[str]:
    """``paths`` less those inside another of them."""
    unique = sorted(set(paths))
    return [p for p in unique if not any(p != q and _within(p, q) for q in unique)]
