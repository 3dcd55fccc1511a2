"""Skipping a test whose nodes lack what it needs, asked on the nodes themselves: a
Kubernetes image need not have what this client has, and the skip says which image to
extend and how (``require_on_nodes``, exported by ``pytest_sky``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_sky.cluster import Cluster


#: What the node image of examples/kubernetes/Dockerfile has (a skip for anything else says
#: to add it there).
NODE_IMAGE_HAS = frozenset({"python3", "torch", "mpi4py", "mpirun", "ssh", "sshd"})


def missing_on_nodes(cluster: Cluster, *, commands: Sequence[str] = (), modules: Sequence[str] = ()) -> list[str]:
    """Which of ``commands`` (on PATH) and ``modules`` (importable by ``python3``) some node of
    ``cluster`` lacks, asked on the nodes themselves: they need not have what this client has."""
    import shlex

    from pytest_sky import shell

    args = [*commands, *(f"py:{m}" for m in modules)]
    res = cluster.run(f"set -- {shlex.join(args)}\n{shell.script(shell.PROBE_NODES)}", timeout=120)
    missing: list[str] = []
    mark = shell.MISSING_MARK + " "
    for rank in res.ranks:
        for line in rank.stdout.splitlines():
            name = line.removeprefix(mark).strip()
            if line.startswith(mark) and name not in missing:
                missing.append(name)
    return missing


def require_on_nodes(
    cluster: Cluster, *, commands: Sequence[str] = (), modules: Sequence[str] = (), install: str = ""
) -> None:
    """Skip the test unless every node has ``commands`` and ``modules`` (``missing_on_nodes``),
    naming the image and the fix; ``install`` says how to get what is missing (on the local
    backend the nodes run this machine's software)."""
    missing = missing_on_nodes(cluster, commands=commands, modules=modules)
    if not missing:
        return
    what = ", ".join(missing)
    image = cluster.node_image
    if image is not None:
        extra = "" if NODE_IMAGE_HAS.issuperset(missing) else f" with {install or what} added"
        pytest.skip(
            f"image {image} has no {what} on the nodes: "
            f"build examples/kubernetes/Dockerfile{extra} and pass --kube-image"
        )
    pytest.skip(f"the nodes (this machine's software) have no {what}" + (f": {install}" if install else ""))
