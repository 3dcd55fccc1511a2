"""``stop`` and ``start``: a cluster's nodes powered off and on again, as ``sky stop``/``sky start``.

A stopped cluster keeps its nodes' disks (homes, what a job wrote, the head's job records),
names, addresses and host keys, and runs no process: every node is killed as a machine is
powered off, and started again as after a reboot (``Cluster.restart_node`` without a wipe).
A job that was running is then ``FAILED_DRIVER``, as on sky: its agent died with the node.
Only the local backend stops: a pod has no stopped state, a Slurm allocation is not its user's
to suspend, and SkyPilot refuses to stop either too (the registry's ``cannot_stop`` says why).
"""

from __future__ import annotations

import argparse
import dataclasses

from pytest_sky import console
from pytest_sky.errors import ClusterNotFoundError, NotSupportedError, SkyError
from pytest_sky.registry import lookup
from pytest_sky.state import ClusterRecord, ClusterStatus, StateStore


def stopped_line(name: str) -> str:
    """What a command that needs a running cluster says of a stopped one."""
    return f"cluster {name} is stopped: start it with `pytest-sky start {name}`"


def _records(store: StateStore, args: argparse.Namespace, verb: str) -> list[ClusterRecord]:
    names = [r.name for r in store.records()] if args.all else args.names
    if not names and not args.all:
        raise SkyError(f"name the clusters to {verb}, or pass --all")
    records = []
    for name in names:
        record = store.load(name)
        if record is None:
            raise ClusterNotFoundError(f"no cluster named {name!r} (see `pytest-sky status`)")
        records.append(record)
    return records


def _set_status(store: StateStore, name: str, status: ClusterStatus) -> None:
    with store.locked():
        record = store.load(name)
        if record is not None:
            store.save(dataclasses.replace(record, status=status))


def stop_cluster(store: StateStore, record: ClusterRecord) -> None:
    from pytest_sky.cluster import get_cluster

    entry = lookup(record.backend)
    if not entry.can_stop:
        raise NotSupportedError(
            f"{record.name}: a {record.backend} cluster cannot be stopped ({entry.cannot_stop}): "
            f"tear it down with `pytest-sky down {record.name}`"
        )
    cluster = get_cluster(record.name, store)
    # The head first: a job's agent dies with it before any worker goes, so the job is
    # FAILED_DRIVER, as on sky; a worker gone first let a loaded head's agent record the job
    # FAILED, naming that worker, in the moment before its own node went.
    for rank in range(cluster.num_nodes):
        cluster.kill_node(rank)
    _set_status(store, record.name, ClusterStatus.STOPPED)


def start_cluster(store: StateStore, record: ClusterRecord) -> None:
    """Every node booted again, each ready by its sshd's banner."""
    from pytest_sky.cluster import get_cluster

    cluster = get_cluster(record.name, store)
    for rank in range(cluster.num_nodes):
        cluster.restart_node(rank)
    _set_status(store, record.name, ClusterStatus.UP)


def start_if_stopped(store: StateStore, record: ClusterRecord) -> None:
    if record.status is ClusterStatus.STOPPED:
        console.progress(f"starting {record.name}")
        start_cluster(store, record)


def cmd_stop(args: argparse.Namespace) -> int:
    store = StateStore()
    for record in _records(store, args, "stop"):
        if record.status is ClusterStatus.STOPPED:
            print(f"Cluster {record.name} is already stopped.")
            continue
        console.progress(f"stopping {record.name}")
        stop_cluster(store, record)
        print(f"Cluster {record.name} stopped.")
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    store = StateStore()
    for record in _records(store, args, "start"):
        if record.status is not ClusterStatus.STOPPED:
            print(f"Cluster {record.name} is already up.")
            continue
        start_if_stopped(store, record)
        print(f"Cluster {record.name} started.")
    return 0
