"""A cluster's life: the launch's one merge of task and options, provisioning, teardown, reaping.

Every way in (``pytest_sky.launch``, the plugin's fixtures, ``Cluster.down``, the CLI's
``launch``/``down``, the reaper of clusters whose owner died) goes through these functions,
so a cluster is created, bootstrapped, saved and removed in exactly one way.
Provisioning is claim -> create -> bootstrap -> save: the backend's ``create`` returns a
:class:`~pytest_sky.cluster_info.ClusterInfo` and the record saved as UP holds it.  Teardown
is stop the client's SSH master -> destroy the nodes (from the backend's journal) -> forget
the record.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time

from pytest_sky import bootstrap, console, procs
from pytest_sky.backends import get_backend
from pytest_sky.backends.base import Backend, ProvisionConfig
from pytest_sky.backends.privileges import NONE_ASKED, Privileges
from pytest_sky.cluster_info import ClusterInfo
from pytest_sky.errors import BackendUnavailableError, NameTakenError, SkyError
from pytest_sky.resources import Resources
from pytest_sky.ssh.keys import ClusterKeys
from pytest_sky.state import ClusterRecord, ClusterResources, ClusterStatus, StateStore
from pytest_sky.task import Task

log = logging.getLogger(__name__)


def plan_launch(task: Task | None, num_nodes: int | None, requested: Resources) -> tuple[Task | None, int, Resources]:
    """The one merge of a launch: options over the task's own ``num_nodes`` and resources.

    Returns the task with the node count it will run on, that count, and the resources to
    provision.  Without a task the count defaults to 1 and is checked with the task's own
    messages, so ``num_nodes=0`` fails the same way from a YAML, the API and the CLI.
    """
    resources = task.resources.merge(requested) if task is not None else requested
    n = num_nodes if num_nodes is not None else (task.num_nodes if task is not None else 1)
    if task is not None:
        task = task.with_overrides(num_nodes=n)
    else:
        Task(num_nodes=n)
    return task, n, resources


def teardown(record: ClusterRecord, store: StateStore, backend: Backend | None = None, *, purge: bool = False) -> str:
    """Remove a cluster: its client-side SSH master, its nodes, then its record.

    The record goes last, so a teardown that fails half-way leaves the cluster listed (and
    reapable) rather than nodes nobody knows of.  With ``purge`` (SkyPilot's ``sky down
    --purge``) a backend that cannot be reached or fails does not keep the record: it is
    forgotten anyway, and the answer says why and what may be left, and where.  The answer
    is empty when the nodes were removed.
    """
    bootstrap.stop_master(store.cluster_dir(record.name) / "ssh_config", record.name)
    journal = store.journal(record.name)
    try:
        backend = backend or get_backend(record.backend)
        backend.destroy(record.name, journal)
    except SkyError as exc:
        if not purge:
            raise
        left = backend.leftovers(record.name, journal) if backend is not None else f"whatever {record.backend} made"
        store.forget(record.name)
        return f"forgotten without its nodes ({exc}); may be left: {left}"
    if record.keep:
        store.keep_history(record.name, PROVISION_LOG)
    store.forget(record.name)
    return ""


def _own_identity() -> tuple[int, int | None]:
    return os.getpid(), procs.start_time(os.getpid())


def _claim(
    backend: Backend, store: StateStore, name: str, num_nodes: int, resources: Resources, keep: bool
) -> ClusterRecord:
    """The cluster's record, saved as PROVISIONING under its name (refused if the name is taken)."""
    owner_pid, owner_start = _own_identity()
    record = ClusterRecord(
        name=name,
        backend=backend.name,
        num_nodes=num_nodes,
        owner_pid=owner_pid,
        owner_start_time=owner_start,
        keep=keep,
        resources=ClusterResources.of(resources),
        resources_label=backend.effective(resources).describe(num_nodes, backend.cloud_label),
    )
    if not store.claim(record):
        raise NameTakenError(
            f"a cluster named {name!r} already exists: pick another name or remove it with `pytest-sky down {name}`"
        )
    return record


def provision(
    backend: Backend,
    store: StateStore,
    name: str,
    num_nodes: int,
    resources: Resources,
    *,
    keep: bool = False,
    shared_dir: str | None = None,
    privileges: Privileges = NONE_ASKED,
) -> ClusterRecord:
    """Claim the name, create the nodes, bootstrap SSH to them and save the record as UP.

    On any failure (Ctrl-C included) whatever was created is destroyed and the name released
    before the error propagates: a failed launch leaves nothing behind.
    """
    record = _claim(backend, store, name, num_nodes, resources, keep)
    cluster_dir = store.cluster_dir(name)
    journal = store.journal(name)
    keys = ClusterKeys.generate(name, num_nodes)
    started = time.monotonic()
    console.progress(f"launching {name}: {num_nodes} node(s) on {backend.name}")
    account = [_stamped(f"launching {name}: {num_nodes} node(s) on {backend.name}, {record.resources_label}")]
    config = ProvisionConfig(
        name=name,
        num_nodes=num_nodes,
        resources=resources,
        keys=keys,
        cluster_dir=cluster_dir,
        journal=journal,
        home_files=bootstrap.home_files(keys),
        shared_dir=shared_dir,
        privileges=privileges,
        keep=keep,
    )
    try:
        info = backend.create(config)
        _write_addresses(backend, store, name, info, keys)
        record = dataclasses.replace(record, status=ClusterStatus.UP, info=info)
        with store.locked():
            store.save(record)
    except BaseException:
        try:
            backend.destroy(name, journal)
        except Exception as exc:  # noqa: BLE001 - the launch's own error is the one to raise
            log.warning("cleanup of %s after a failed launch: %s", name, exc)
        finally:
            store.forget(name)
        raise
    console.progress(f"{name} is up: {num_nodes} node(s) in {time.monotonic() - started:.2f} s")
    account += [_stamped(f"rank {n.rank}: {n.name} {n.hostname} {n.ip}") for n in info.nodes]
    account.append(_stamped(f"{name} is up: {num_nodes} node(s) in {time.monotonic() - started:.2f} s"))
    _write_provision_log(cluster_dir, account)
    return record


#: The launch's own account, in the cluster's directory (``pytest-sky`` keeps it with a
#: failed test's artifacts).
PROVISION_LOG = "provision.log"


def _stamped(line: str) -> str:
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime())}Z {line}\n"


def _write_provision_log(cluster_dir: os.PathLike[str] | str, lines: list[str]) -> None:
    """The launch's account, written once it is up (a failed launch leaves no directory to
    keep it in); never fails the launch."""
    try:
        with open(os.path.join(cluster_dir, PROVISION_LOG), "w", encoding="utf-8") as f:
            f.writelines(lines)
    except OSError as exc:
        log.debug("provision log: %s", exc)


def _write_addresses(backend: Backend, store: StateStore, name: str, info: ClusterInfo, keys: ClusterKeys) -> None:
    """What names every node by its address: each node's ``~/.ssh/config`` and
    ``known_hosts``, then the client's; and the client's shared connection, where it has one."""
    nodes = list(info.nodes)
    backend.put_files(name, store.journal(name), info, bootstrap.peer_files(name, nodes, keys, info.home))
    cfg = bootstrap.write_client_files(
        store.cluster_dir(name),
        name,
        nodes,
        keys,
        multiplex=backend.multiplex_client,
        clients_open_master=backend.eager_client_master,
    )
    if backend.multiplex_client:
        bootstrap.start_master(cfg, name, wait=backend.eager_client_master)


def readdress(backend: Backend, store: StateStore, record: ClusterRecord, info: ClusterInfo) -> ClusterRecord:
    """A node came back at a new address (a recreated pod): every ssh file is written again
    as the launch wrote it, and the record saved with ``info``, so every later run (its
    SKYPILOT_NODE_IPS), process and the CLI see the new address.  Returns the record."""
    cluster_dir = store.cluster_dir(record.name)
    keys = bootstrap.client_keys(cluster_dir, list(info.nodes))
    bootstrap.stop_master(cluster_dir / "ssh_config", record.name)  # its ControlPath is rewritten
    _write_addresses(backend, store, record.name, info, keys)
    record = dataclasses.replace(record, info=info)
    with store.locked():
        store.save(record)
    return record


def owner_alive(record: ClusterRecord) -> bool:
    """Where callers found it before records answered it themselves (``cluster.owner_alive``)."""
    return record.owner_alive()


def reap(store: StateStore | None = None) -> list[str]:
    """Tear down clusters whose owner process died (a killed pytest run), then remove what
    nothing owns any more (:func:`reap_strays`); returns what went, clusters by name first.

    Clusters kept on purpose (``--keep-clusters``, the CLI) are left alone.
    """
    store = store or StateStore()
    return reap_clusters(store) + reap_strays(store)


def reap_clusters(store: StateStore) -> list[str]:
    """Tear down this state directory's clusters whose owner died and that were not kept;
    returns their names."""
    reaped = []
    with store.locked():
        records = [r for r in store.records() if r.orphaned]
    for record in records:
        try:
            teardown(record, store)
        except SkyError as exc:
            log.warning("could not reap cluster %s: %s", record.name, exc)
            continue
        reaped.append(record.name)
    return reaped


def reap_strays(store: StateStore) -> list[str]:
    """Remove what no record owns: files a killed process was deleting, local nodes, links
    and cgroups of this state directory's clusters that lost their record (the directory
    deleted while they ran, say), and, machine-wide, bridges of ours whose owner is gone
    (whichever state directory or emulator it was: ``LocalBackend.reap_stray_links``) and
    this user's sockets that nothing answers (``bootstrap.remove_dead_sockets``); what went,
    as the reaper's report names it (a dead socket is nothing a user needs named)."""
    for path in store.stale_trash():  # a process killed while it deleted a cluster's files
        shutil.rmtree(path, ignore_errors=True)
    bootstrap.remove_dead_sockets()
    from pytest_sky.backends.local import LocalBackend

    try:
        return LocalBackend().reap_stray_links(store.root / "clusters")
    except BackendUnavailableError:
        return []  # no local nodes can run here (no `ip`, say): none can be left either
    except (SkyError, OSError) as exc:
        log.warning("could not reap stray links: %s", exc)
        return []
