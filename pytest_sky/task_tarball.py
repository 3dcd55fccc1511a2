"""A task's files as the one tarball its cluster's head unpacks and fans out to every worker.

Every backend syncs the same way (``Cluster._sync``): the workdir, the file mounts and the
long scripts (:mod:`~pytest_sky.script_files`) go to the head as one gzipped tarball over the
client's connection, and from there to the workers over head-to-worker SSH.  Member names
start with ``~/`` (unpacked in the node's home) or ``/``.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile

from pytest_sky.task import Task


def build(task: Task, scripts: dict[str, bytes]) -> bytes | None:
    """The tarball of the task's workdir (as ``~/sky_workdir``), file mounts and ``scripts``
    (remote path -> content); None when there is nothing to send."""
    if not task.workdir and not task.file_mounts and not scripts:
        return None
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        if task.workdir:
            _add_workdir(tar, task.workdir)
        for remote, local in task.file_mounts.items():
            tar.add(local, arcname=remote if remote.startswith("~/") else "/" + remote.lstrip("/"))
        for remote, data in scripts.items():
            member = tarfile.TarInfo(remote)
            member.size, member.mode = len(data), 0o600
            tar.addfile(member, io.BytesIO(data))
    return buf.getvalue()


def _add_workdir(tar: tarfile.TarFile, workdir: str) -> None:
    """The workdir as ``~/sky_workdir``; in a git work tree only what git would keep (tracked
    and untracked files, not ignored ones), as sky leaves out what ``.gitignore`` names: a
    virtualenv or build tree in it would otherwise travel to every node."""
    try:
        listed = subprocess.run(
            ["git", "-C", workdir, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):  # not a git work tree, or no git: all of it
        tar.add(workdir, arcname="~/sky_workdir")
        return
    tar.add(workdir, arcname="~/sky_workdir", recursive=False)
    for name in sorted(set(filter(None, listed.decode("utf-8", "surrogateescape").split("\0")))):
        path = os.path.join(workdir, name)
        if os.path.lexists(path):  # a tracked file deleted in the work tree is not sent
            tar.add(path, arcname=f"~/sky_workdir/{name}", recursive=False)
