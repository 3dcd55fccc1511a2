"""``pytest-sky down --stale`` and the clusters a backend holds beyond this machine's records,
as ``status`` and ``doctor`` list them.

A cluster's owner may be a process on a machine that is gone (a CI runner): this machine's
state directory knows nothing of it.  What knows is the backend's own record of ownership
(on Kubernetes, the cluster's Lease: its holder, its age, whether it is kept; on Slurm, the
allocation's job name and owner record), read through
``Backend.held_clusters`` and reaped through ``Backend.reap_stale``; which backend is chosen
as for a launch (``--kubernetes``, ``--kube-context``, ``--kube-namespace``, ``--slurm``,
``--slurm-config``, ``--slurm-cluster``, their ``PYTEST_SKY_*`` twins).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pytest_sky import console
from pytest_sky.backends.base import Backend, ClusterHold

if TYPE_CHECKING:
    from pytest_sky.settings import Settings

#: The settings rows that choose a backend and where it looks (the rest shape a launch).
WHERE = ("backend", "kubernetes", "kube_context", "kube_namespace", "slurm", "slurm_config", "slurm_cluster")


def add_where_options(p: argparse.ArgumentParser) -> None:
    """The flags that choose the backend and where it looks, as the settings table has them."""
    from pytest_sky import settings

    for option in settings.OPTIONS:
        if option.name in WHERE:
            p.add_argument(option.flag, dest=option.dest, **option.argparse_kwargs(option.env))


def _settings(args: argparse.Namespace) -> Settings:
    from pytest_sky import settings

    return settings.resolve(
        **{o.name: getattr(args, o.dest, None) or None for o in settings.OPTIONS if o.name in WHERE}
    )


def chosen_backend(args: argparse.Namespace) -> Backend:
    from pytest_sky.backends import get_backend

    chosen = _settings(args)
    return get_backend(chosen.backend, **chosen.backend_options())


def backend_chosen(args: argparse.Namespace) -> bool:
    """Whether a flag or the environment chose a backend (``status`` and ``doctor`` then look
    at what it holds too; by default they read this machine's records alone)."""
    return _settings(args).given("backend")


def down_stale(args: argparse.Namespace) -> int:
    """This state directory's clusters whose owner process died, then the chosen backend's
    clusters whose owner is gone wherever it ran (an expired lease, an allocation whose owner
    record names a dead process); each named as it goes."""
    from pytest_sky.lifecycle import reap
    from pytest_sky.state import StateStore

    local = reap(StateStore())
    for name in local:
        print(f"{name}: down (its owner process is gone)")
    backend = chosen_backend(args)
    remote = backend.reap_stale()
    for name in remote:
        print(f"{name}: down (its owner is gone)")
    if not local and not remote:
        print(f"no stale clusters ({backend.name})")
    return 0


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def state_of(hold: ClusterHold) -> str:
    if hold.kept:
        return "kept"
    if hold.expired:
        return "STALE (owner gone)"
    return "live"


def held(args: argparse.Namespace) -> list[ClusterHold]:
    """The chosen backend's clusters, where its flags say (none for a backend that keeps no
    record of ownership of its own)."""
    return chosen_backend(args).held_clusters()


def print_held(holds: list[ClusterHold]) -> None:
    """A table of ``holds``: name, holder, age, last renewal of length, kept, state."""
    if not holds:
        return
    print(f"Clusters in {holds[0].where}:")
    headers = ["NAME", "HOLDER", "AGE", "RENEWED", "KEPT", "STATE"]
    rows = [
        [
            h.name,
            h.holder,
            _duration(h.age_s),
            f"{_duration(h.renewed_s)} ago (lease {_duration(h.lease_s)})",
            "yes" if h.kept else "no",
            state_of(h),
        ]
        for h in holds
    ]
    console.table(headers, rows)


def as_json(hold: ClusterHold) -> dict[str, object]:
    return {
        "name": hold.name,
        "where": hold.where,
        "holder": hold.holder,
        "age_s": hold.age_s,
        "renewed_s": hold.renewed_s,
        "lease_s": hold.lease_s,
        "kept": hold.kept,
        "expired": hold.expired,
    }
