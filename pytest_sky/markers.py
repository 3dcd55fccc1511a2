"""The ``multinode`` marker: its text for ``--markers``, and what its arguments ask for.

``sky_cluster`` reads the marker; ``sky_cluster_factory`` takes the same arguments (but
``scope``).  Both bind them to one signature (:func:`multinode_shape`), so an unknown or
repeated argument fails the test with the same line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

MARKERS = {
    "multinode": "multinode(num_nodes=2, gpus=None, cpus=None, memory=None, shared_dir=None, capabilities=None, "
    "privileged=None, scope='function'): the test gets a cluster of that shape as `sky_cluster`; "
    "scope='class'/'module'/'session' shares one among that scope's tests of the same shape",
    "kubernetes": "run only with the Kubernetes backend (--kubernetes)",
    "no_kubernetes": "skip with the Kubernetes backend",
    "no_slurm": "no_slurm(reason): skip with the Slurm backend, saying why a Slurm allocation cannot do it",
    "gpu": "needs a GPU; skipped with a reason where the backend has none",
}


SCOPES = ("function", "class", "module", "session")


@dataclass(frozen=True)
class MultinodeRequest:
    """What a ``multinode`` marker asks for: the cluster's shape (``launch``'s keywords) and
    the scope whose tests of that shape share it."""

    shape: dict[str, Any]
    scope: str = "function"


def multinode_shape(
    num_nodes: int = 2,
    *,
    gpus: object = None,
    cpus: object = None,
    memory: object = None,
    shared_dir: str | None = None,
    capabilities: tuple[str, ...] | None = None,
    privileged: bool | None = None,
    scope: str = "function",
) -> MultinodeRequest:
    """The signature of ``@pytest.mark.multinode``: the marker's arguments are bound to it.

    Python's own binding refuses an unknown keyword or a second positional argument;
    :func:`bound` only turns its TypeError into a line that says what to write.
    """
    shape = {
        "num_nodes": num_nodes,
        "gpus": gpus,
        "cpus": cpus,
        "memory": memory,
        "shared_dir": shared_dir,
        "capabilities": capabilities,
        "privileged": privileged,
    }
    return MultinodeRequest({k: v for k, v in shape.items() if v is not None}, scope)


def marker_request(item: pytest.Item) -> MultinodeRequest:
    """What the test's ``multinode`` marker asks for (none: two nodes, its own)."""
    marker = item.get_closest_marker("multinode")
    if marker is None:
        return multinode_shape()
    return bound(marker.args, marker.kwargs, "multinode()", "@pytest.mark.multinode")


def bound(args: tuple[Any, ...], kwargs: Mapping[str, Any], what: str, example: str) -> MultinodeRequest:
    """The arguments of a marker (``what``) or of the factory, bound to :func:`multinode_shape`;
    what cannot be bound fails the test with one line, an example written as ``example``."""
    try:
        request = multinode_shape(*args, **kwargs)
    except TypeError:
        pass  # said below, outside the handler: the user gets one line, not a chain
    else:
        if request.scope in SCOPES:
            return request
        pytest.fail(
            f"pytest-sky: {what} got scope={request.scope!r}; use one of {', '.join(map(repr, SCOPES))} "
            f"(e.g. {example}(num_nodes=2, scope='module'))",
            pytrace=False,
        )
    import inspect

    allowed = sorted(inspect.signature(multinode_shape).parameters)
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        pytest.fail(
            f"pytest-sky: {what} got unknown argument(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}",
            pytrace=False,
        )
    pytest.fail(
        f"pytest-sky: {what} takes num_nodes once, as its only positional argument "
        f"or as num_nodes=N (e.g. {example}(num_nodes=3))",
        pytrace=False,
    )
