"""The cluster handle: run, submit, queue and job on a cluster that is up.

Creating and removing one is :mod:`pytest_sky.lifecycle`'s; ``launch`` and ``down`` here are
the public API's doors to it, shared by the pytest plugin and the command line.
"""

from __future__ import annotations

import logging
import os
import shlex
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pytest_sky import bootstrap, cluster_names, console, lifecycle, shell
from pytest_sky.backends import clusterns, get_backend
from pytest_sky.backends.base import Backend, LinkDegradation, NetworkFaults
from pytest_sky.backends.privileges import NONE_ASKED, Privileges, check_privileges
from pytest_sky.cluster_info import ClusterInfo, NodeInfo
from pytest_sky.errors import ClusterNotFoundError, NameTakenError, RunError, RunTimeoutError, SkyError, TaskError
from pytest_sky.job import Job
from pytest_sky.protocol import DEFAULT_JOB_CPUS, NodeRef, RunSpec, door_secret
from pytest_sky.resources import Resources
from pytest_sky.runner import AgentClient, Door, RunResult, StoppedRun
from pytest_sky.script_files import ship_long_scripts
from pytest_sky.settings import SESSION_DEADLINE, Deadline, Settings
from pytest_sky.settings import resolve as resolve_settings
from pytest_sky.ssh import client as ssh_client
from pytest_sky.ssh import kube_dial, kube_proxy
from pytest_sky.state import ClusterRecord, Journal, StateStore
from pytest_sky.task import Task, as_task, check_shared_dir, validate_envs

if TYPE_CHECKING:
    import paramiko

log = logging.getLogger(__name__)


class Cluster:
    """A running cluster.  ``run`` executes on every rank; ``down`` removes it."""

    def __init__(self, record: ClusterRecord, backend: Backend, store: StateStore) -> None:
        self._record = record
        self._backend = backend
        self._store = store
        self._client: paramiko.SSHClient | None = None
        self._forward: kube_proxy.Forward | kube_dial.Dialled | None = None  # the head's port-forward, if any
        self._door_state: Door | None = None
        self._lock = threading.Lock()
        self.last_result: RunResult | None = None
        self.results: list[RunResult] = []
        #: Runs that timed out (their partial output and timeline), for a failure's artifacts.
        self.timed_out: list[RunTimeoutError] = []
        #: Runs and waits stopped before they ended (a deadline, Ctrl-C): where each rank was.
        self.stopped: list[StoppedRun] = []
        #: A run's timeout when its caller names none (pytest: ``--sky-run-timeout``; None: none).
        self.run_timeout: float | None = None
        self.is_down = False
        #: Set under the plugin's ``--keep-clusters``: :meth:`down` leaves the cluster up.
        self.keep_up = False

    # -- the contract ----------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._record.name

    @property
    def num_nodes(self) -> int:
        return self._record.num_nodes

    @property
    def node_ips(self) -> list[str]:
        return list(self._record.node_ips)

    @property
    def node_names(self) -> list[str]:
        return list(self._record.node_names)

    @property
    def ssh_config(self) -> str:
        return str(self._store.cluster_dir(self.name) / "ssh_config")

    @property
    def backend(self) -> str:
        return self._record.backend

    @property
    def cloud_label(self) -> str:
        """Where the nodes run, as SkyPilot names a cloud ("Local", "Kubernetes")."""
        return self._backend.cloud_label

    @property
    def resources_label(self) -> str:
        return self._record.resources_label

    @property
    def record(self) -> ClusterRecord:
        return self._record

    @property
    def info(self) -> ClusterInfo:
        """What provisioning returned: every node's name, IP, route and environment."""
        if self._record.info is None:
            raise SkyError(f"cluster {self.name} is still {self._record.status}")
        return self._record.info

    @property
    def node_image(self) -> str | None:
        """The container image the nodes run (None: they run this machine's own software)."""
        return self._backend.node_image(self.journal)

    @property
    def journal(self) -> Journal:
        """What the backend made, as it wrote it down to remove it (its pids, links, pods)."""
        return self._store.journal(self.name)

    def run(
        self,
        cmd_or_task: str | Task,
        env: dict[str, str] | None = None,
        timeout: float | Deadline | None = SESSION_DEADLINE,
        *,
        check: bool = False,
        on_line: Callable[[str], None] | None = None,
    ) -> RunResult:
        """Run a command (bash, on every node) or a task (on its first ``num_nodes`` nodes, as
        ``sky exec`` does); waits for every rank.  A rank exiting non-zero is reported through
        the result (``returncode``, ``error``), or with ``check=True`` raised as ``RunFailedError``
        (a :class:`RunError`, naming the rank, its exit code and last lines); problems reaching
        the cluster raise :class:`RunError`.  ``on_line`` gets each prefixed line as it comes.
        Past ``timeout`` seconds (by default :attr:`run_timeout`: under pytest the session's
        ``--sky-run-timeout``, else none; ``None``: no deadline) it raises
        :class:`RunTimeoutError`, whose ``capture`` says where every rank was, then stops them."""
        seconds = self.run_timeout if timeout is SESSION_DEADLINE else timeout
        task = self._prepared(cmd_or_task)
        try:
            result = self._agent.run(self._spec(task, env), timeout=seconds, on_line=on_line)
        except RunTimeoutError as exc:
            self.timed_out.append(exc)
            raise
        self.last_result = result
        self.results.append(result)
        return result.check() if check else result

    def diagnostics(self) -> list[tuple[str, str]]:
        """The backend's account of the nodes beyond their runs, as (file name, text) pairs
        (Kubernetes: each pod's events and container log), for a failed test's artifacts."""
        return self._backend.diagnostics(self.name, self.journal)

    def job_events(self, job_id: int) -> bytes:
        """A job's events as the head recorded them, its run spec first (``agent events``)."""
        _, out = self._agent.call(["events", str(job_id)])
        return out

    def submit(self, cmd_or_task: str | Task, env: dict[str, str] | None = None) -> Job:
        """Start a detached job on the head and return at once; it outlives this client."""
        task = self._prepared(cmd_or_task)
        agent = self._agent
        event = agent.submit(self._spec(task, env))
        return Job(agent, event.id, event.task_id)

    def queue(self) -> list[dict[str, Any]]:
        """Every job of this cluster with its status (oldest first), as the head records it."""
        return [record.as_dict() for record in self._agent.jobs()]  # type: ignore[attr-defined]

    def job(self, job_id: int) -> Job:
        return Job(self._agent, int(job_id))

    def down(self) -> None:
        """Remove every node and the cluster's record; safe to call twice; kept if :attr:`keep_up`."""
        with self._lock:
            if self.is_down or self.keep_up:
                return
            self._close_client()
            lifecycle.teardown(self._record, self._store, self._backend)
            self.is_down = True

    # -- faults ----------------------------------------------------------------------------

    def kill_node(self, rank: int) -> None:
        """Crash node ``rank``: every process on it (its sshd too) dies at once and its
        address goes silent.  A job running on it fails within seconds, naming the rank."""
        rank = self._rank(rank)
        if rank == 0:
            self._drop_connection()  # its peer is gone: the next call connects afresh
        self._backend.kill_node(self.name, self.journal, rank)

    def restart_node(self, rank: int, wipe: bool = False) -> None:
        """Boot node ``rank`` again (a running one is killed first, as a reboot): the same
        name, hostname, IP and host key, so ``StrictHostKeyChecking yes`` still passes;
        returns once its sshd sends its banner.  Its files (home, and what it wrote anywhere
        on its root) survive as a disk does; ``wipe=True`` gives it a fresh disk, holding
        only what provisioning put in its home.  Its partitions and degradations stay.

        On Kubernetes the pod is created again with the same name, labels, Secret (host key)
        and spec, but gets a new IP, which every node's ssh files, the client's and the
        record then name (``node_ips``, SKYPILOT_NODE_IPS); its filesystem, home included,
        is the image's again whatever ``wipe`` says (a recreated pod's is), while the shared
        directory's claim keeps what was written there."""
        rank = self._rank(rank)
        if rank == 0:
            self._drop_connection()
        info = self._backend.restart_node(self.name, self.journal, self.info, rank, wipe)
        if info != self.info:
            self._record = lifecycle.readdress(self._backend, self._store, self._record, info)

    def partition(self, group_a: list[int], group_b: list[int]) -> None:
        """Drop (never reject) every packet between the ranks of ``group_a`` and those of
        ``group_b``, in both directions, inside the nodes' namespaces, as a failed switch.

        Kept: SSH (TCP port 22) and the agent servers' port between the head and each
        worker, which are the harness's control path (the head's agent starts each rank
        over them and collects its output),
        and the client's own connection to the head (over the bridge, not between nodes).
        So ``run`` and ``submit`` still start and collect every rank, while what the ranks
        say to each other (gloo, NCCL, a c10d store, worker-to-worker SSH) is cut.
        Partitions add up; :meth:`heal` removes them all."""
        a, b = self._group(group_a), self._group(group_b)
        if a & b:
            raise TaskError(f"ranks {sorted(a & b)} are in both groups; a partition needs two disjoint groups")
        faults = self.network_faults
        self._set_faults(NetworkFaults((*faults.partitions, (a, b)), dict(faults.degraded)))

    def degrade(
        self,
        rank: int,
        delay_ms: float = 0,
        jitter_ms: float = 0,
        loss_pct: float = 0,
        rate_mbit: float | None = None,
    ) -> None:
        """Give node ``rank``'s link added latency (± a uniform jitter), random loss and a
        bandwidth cap, each in both directions (a round trip through it gains twice the
        delay), inside its namespace; it replaces what that rank had.  netem where the
        kernel has it; else tbf for rate, iptables' statistic match for loss and a delayer
        of the node's own on NFQUEUE for delay (see ``link_shaping``)."""
        rank = self._rank(rank)
        if min(delay_ms, jitter_ms, loss_pct) < 0 or loss_pct > 100 or (rate_mbit is not None and rate_mbit <= 0):
            raise TaskError("degrade needs delay_ms, jitter_ms >= 0, 0 <= loss_pct <= 100 and rate_mbit > 0 (or None)")
        faults = self.network_faults
        degraded = {**faults.degraded, rank: LinkDegradation(delay_ms, jitter_ms, loss_pct, rate_mbit)}
        self._set_faults(NetworkFaults(faults.partitions, degraded))

    def heal(self) -> None:
        """Undo every partition and degradation: the network as it was at launch."""
        self._set_faults(NetworkFaults())

    @property
    def network_faults(self) -> NetworkFaults:
        """The partitions and degraded links applied now."""
        return self._backend.network_faults(self.journal)

    @property
    def link_shaping(self) -> str:
        """How ``degrade`` works on this cluster: "netem", "tbf+iptables+nfqueue" (this
        kernel has no sch_netem) or "none" (a backend without network faults)."""
        return self._backend.link_shaping()

    def _set_faults(self, faults: NetworkFaults) -> None:
        self._backend.set_network_faults(self.name, self.journal, self.info, faults)

    def _rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_nodes:
            raise TaskError(f"no rank {rank!r} in cluster {self.name}: its ranks are 0..{self.num_nodes - 1}")
        return rank

    def _group(self, ranks: list[int]) -> frozenset[int]:
        group = frozenset(self._rank(r) for r in ranks)
        if not group:
            raise TaskError("a partition group needs at least one rank")
        return group

    def _drop_connection(self) -> None:
        with self._lock:
            self._close_client()

    def _close_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._forward is not None:
            self._forward.close()
            self._forward = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def __repr__(self) -> str:
        return f"Cluster({self.name!r}, backend={self.backend!r}, num_nodes={self.num_nodes})"

    # -- helpers ---------------------------------------------------------------------------

    def _prepared(self, cmd_or_task: str | Task) -> Task:
        """The task, checked against this cluster, its notes said and its files on the nodes."""
        task = as_task(cmd_or_task, self.num_nodes)
        self._check_fits(task)
        for note in task.notes:
            console.note(note)
        task, scripts = ship_long_scripts(task)
        self._sync(task, scripts)
        return task

    def _check_fits(self, task: Task) -> None:
        if task.num_nodes > self.num_nodes:
            raise TaskError(
                f"task {task.display_name!r} asks for num_nodes={task.num_nodes} but cluster "
                f"{self.name} has {self.num_nodes}; launch a cluster of that size"
            )
        wanted = task.resources.accelerators
        have = self._record.resources.accelerators
        if wanted is not None and not have:
            raise TaskError(
                f"task {task.display_name!r} asks for {wanted} per node but cluster {self.name} has no GPUs; "
                "launch it with gpus=... (or drop resources.accelerators)"
            )

    @property
    def _agent(self) -> AgentClient:
        """The agent on the head, over this handle's one connection (opened when first used)."""
        return AgentClient(
            self.name, self._connection, self.info.python, bootstrap.AGENT_PATH, self._door(), self.stopped.append
        )

    def _door(self) -> Door | None:
        """The way to the head's agent server (its secret from the cluster key this client
        holds), where its nodes keep one (``ClusterInfo.agent_servers``)."""
        if not self.info.agent_servers:
            return None
        if self._door_state is None:
            try:
                key = (self._store.cluster_dir(self.name) / "id_ed25519").read_bytes()
            except OSError:
                return None
            self._door_state = Door(door_secret(key))
        return self._door_state

    def _spec(self, task: Task, env: dict[str, str] | None) -> RunSpec:
        info = self.info
        given = validate_envs(env)
        # The secrets travel apart, to be masked and kept out of every record; the agent
        # exports them after the envs (env= wins over both).
        secrets = {k: v for k, v in task.secrets.items() if k not in given}
        merged = {"PYTHONUNBUFFERED": "1", **info.env, **task.envs, **given}  # the backend's for every rank
        envs = {k: v for k, v in merged.items() if k not in secrets}
        # As `sky exec`: a task runs on the first num_nodes nodes (a command string on all).
        nodes = [NodeRef(n.rank, n.name, n.ip, n.ip, dict(n.env), list(n.step)) for n in info.nodes[: task.num_nodes]]
        return RunSpec(
            cluster=self.name,
            task_name=task.display_name,
            nodes=nodes,
            run=task.run,
            setup=task.setup,
            env=envs,
            cwd="~/sky_workdir" if task.workdir else None,
            gpus_per_node=self._gpus_per_node(task),
            cluster_info=info.skypilot_info(self.name),
            cpus_per_node=task.resources.cpus if task.resources.cpus is not None else DEFAULT_JOB_CPUS,
            node_cpus=self._record.resources.cpus,
            gpu_share=task.resources.accelerators.count if task.resources.accelerators else 0.0,
            node_gpus=self._record.resources.gpus_per_node,
            secrets=secrets,
        )

    def _gpus_per_node(self, task: Task) -> int:
        if task.resources.accelerators is not None:
            return task.resources.gpus_per_node
        return self._record.resources.gpus_per_node

    def _sync(self, task: Task, scripts: dict[str, bytes]) -> None:
        """Copy the task's workdir, file mounts and long scripts to every node, the same way on
        every backend: one tarball to the head, fanned out from there to every worker over
        head-to-worker SSH."""
        from pytest_sky import task_tarball  # tarfile's import, for the runs that send files

        payload = task_tarball.build(task, scripts)
        if payload is None:
            return
        # Member names start with "~/" or "/": unpack ~-members in $HOME, the rest at /.
        workers = " ".join(shlex.quote(ip) for ip in self._record.node_ips[1:])
        transport = self._connection().get_transport()
        assert transport is not None
        chan = transport.open_session()
        try:
            chan.exec_command(f"bash -c {shlex.quote(shell.script(shell.SYNC_FILES))} sync {workers}")
            chan.sendall(payload)
            chan.shutdown_write()
            code = chan.recv_exit_status()
            err = chan.recv_stderr(65536).decode("utf-8", "replace").strip() if chan.recv_stderr_ready() else ""
        finally:
            chan.close()
        if code != 0:
            raise RunError(f"could not copy the task's files to {self.name}: {err or f'exit {code}'}")

    def _connection(self) -> paramiko.SSHClient:
        with self._lock:
            if self.is_down:
                raise SkyError(f"cluster {self.name} has been torn down")
            transport = self._client.get_transport() if self._client is not None else None
            if transport is None or not transport.is_active():
                self._close_client()
                self._client = self._connect(self.info.head)
            return self._client  # type: ignore[return-value]  # open: just checked, or just made

    def _connect(self, head: NodeInfo) -> paramiko.SSHClient:
        """The client's connection to the head, its key checked under its hostname: direct, through
        its port-forward (asked of the cluster's forwarder or opened in this process: no interpreter
        per connection) or its ProxyCommand (through a Slurm site's login node)."""
        route, d, sock = head.route, self._store.cluster_dir(self.name), None
        if route.port_forward is not None:
            self._forward = kube_proxy.open_head(route.port_forward, route.dial_socket)
            sock = self._forward.socket
        elif route.door is not None:
            sock = clusterns.dial(route.door, route.hostname, route.port)
        keys, proxy = (d / "id_ed25519", d / "known_hosts"), route.proxy_command if sock is None else None
        return ssh_client.connect(
            route.hostname,
            route.port,
            *keys,
            user=route.user,
            sock=sock,  # type: ignore[arg-type]  # a socket or paramiko's own channel, as paramiko takes
            proxy_command=proxy,
            host_key_alias=head.hostname,
        )


# ------------------------------------------------------------------------------ shared clusters

# Run on every node between two tests that share a cluster, after every job was cancelled:
# kills what is left of an earlier job and fails on whatever survives (the script says how
# it tells a job's processes apart).
LEFTOVER_CHECK = shell.script(shell.LEFTOVER_CHECK)


def reset_for_next_test(cluster: Cluster) -> None:
    """Make a cluster that several tests share look unused to the next of them.

    The partitions and degraded links an earlier test made are healed; every job it started
    is cancelled (attached runs an interrupted test left included) and its records dropped,
    so ``queue()`` starts empty; on every node, anything of those jobs still alive is killed
    and the check fails if something survives (:data:`LEFTOVER_CHECK`); the handle forgets
    the earlier results, so a failing test's report shows its own ranks' logs only.  Files
    the earlier tests wrote stay, as on a machine.  Raises :class:`SkyError` when the
    cluster could not be made clean, or checked (a node killed and not restarted): the
    plugin then replaces it.
    """
    if cluster.network_faults:
        cluster.heal()  # first: the cancel and the check below then run on the launch's network
    agent = cluster._agent
    agent.cancel("all")
    result = agent.run(cluster._spec(as_task(LEFTOVER_CHECK, cluster.num_nodes), None), timeout=60)
    if result.returncode != 0:
        left = [f"rank {r.rank}: {line}" for r in result.ranks for line in r.stdout.splitlines() if "left: " in line]
        if left:
            raise SkyError(
                f"cluster {cluster.name}: processes of an earlier test survived cancelling: {'; '.join(left)}"
            )
        raise SkyError(f"cluster {cluster.name} could not be checked after an earlier test: {result.error}")
    agent.forget()
    cluster.results.clear()
    cluster.timed_out.clear()
    cluster.stopped.clear()
    cluster.last_result = None


# ------------------------------------------------------------------------------ provisioning


def launch(
    task: Task | str | os.PathLike[str] | None = None,
    *,
    num_nodes: int | None = None,
    name: str | None = None,
    backend: str | None = None,
    backend_options: dict[str, Any] | None = None,
    settings: Settings | None = None,
    keep: bool = False,
    shared_dir: str | None = None,
    capabilities: Sequence[str] = (),
    privileged: bool = False,
    store: StateStore | None = None,
    run_timeout: float | Deadline | None = None,
    on_created: Callable[[Cluster], None] | None = None,
    name_label: str = "",
    **resources: object,
) -> Cluster:
    """Provision a cluster (and, given a task, run it: the result is ``cluster.last_result``).

    ``backend`` (default: ``PYTEST_SKY_BACKEND``, else the task's ``infra``, else local) and
    the environment's other ``PYTEST_SKY_*`` settings apply unless ``settings`` (the plugin's
    resolved ones) is given; ``backend_options`` go to the backend's constructor on top.
    ``shared_dir`` (e.g. ``/mnt/shared``) is one directory shared by every node at that path,
    for code that expects a shared filesystem; without it nodes share nothing.
    Nodes hold what a pod of ours would (a container runtime's confinement under Pod Security
    baseline); ``capabilities=("NET_ADMIN",)`` adds capabilities, ``privileged=True`` lifts
    the confinement altogether (a task can then change this machine), as on a pod.
    ``run_timeout`` bounds the task's run (None: no deadline).  ``on_created`` is handed the
    cluster as soon as it is up, and its caller owns it from then on: a task that fails or
    times out leaves it up for the caller's report, and the caller tears it down (without
    ``on_created``, such a launch tears it down itself, unless ``keep``).
    Without ``name`` the cluster gets a generated one, ``sky-<name_label>-<48 random bits>``
    (``cluster_names``), drawn again if it is taken.
    """
    extra = Resources.from_kwargs(**resources) if resources else Resources()
    cluster, task = bring_up(
        as_task(task) if task is not None else None,
        num_nodes,
        extra,
        name=name,
        name_label=name_label,
        settings=settings or resolve_settings(backend=backend),
        backend_options=backend_options,
        keep=keep,
        shared_dir=shared_dir,
        privileges=check_privileges(capabilities, privileged),
        store=store,
    )
    if on_created is not None:
        on_created(cluster)
    if task is not None and (task.run or task.setup):
        try:
            cluster.run(task, timeout=run_timeout)
        except BaseException:
            if not keep and on_created is None:
                cluster.down()
            raise
    return cluster


def bring_up(
    task: Task | None,
    num_nodes: int | None,
    requested: Resources,
    *,
    name: str | None,
    name_label: str = "",
    settings: Settings,
    backend_options: dict[str, Any] | None = None,
    keep: bool = False,
    shared_dir: str | None = None,
    privileges: Privileges = NONE_ASKED,
    store: StateStore | None = None,
) -> tuple[Cluster, Task | None]:
    """The cluster a launch asks for, up; and the task with the node count it will run on.

    Shared by :func:`launch` and the CLI (which runs the task itself, perhaps detached).
    """
    task, n, res = lifecycle.plan_launch(task, num_nodes, requested)
    placed, notes = settings.for_task(res)
    for note in notes:
        console.note(note)
    given = name is not None
    name = cluster_names.validate(name if name is not None else cluster_names.generate(name_label))
    shared = check_shared_dir(shared_dir)
    be = get_backend(placed.backend, **{**placed.backend_options(), **(backend_options or {})})
    be.plan(name, n, res, shared)  # before touching any state: refuse what can never work
    if privileges.privileged:
        console.note(
            f"{name}'s nodes are privileged: every capability of root, and the host's /dev, /proc/sys "
            "and /sys; a task can change the machine it runs on"
        )
    store = store or StateStore()
    for attempt in range(1, NAME_ATTEMPTS + 1):
        try:
            record = lifecycle.provision(be, store, name, n, res, keep=keep, shared_dir=shared, privileges=privileges)
            return Cluster(record, be, store), task
        except NameTakenError as exc:
            if given or attempt == NAME_ATTEMPTS:
                raise
            console.note(f"{exc}; launching under another generated name")
            name = cluster_names.generate(name_label)
    raise AssertionError("unreachable")  # the loop returns or raises


#: Generated names a launch draws before it gives up: one collision in 2^48 is a fluke, two
#: in a row something else (an object that takes every name?), said as it is.
NAME_ATTEMPTS = 3


def get_cluster(name: str, store: StateStore | None = None) -> Cluster:
    store = store or StateStore()
    record = store.load(name)
    if record is None:
        raise ClusterNotFoundError(f"no cluster named {name!r} (see `pytest-sky status`)")
    return Cluster(record, get_backend(record.backend), store)


# The reaper and the owner check (lifecycle's), where callers of the public API found them.
reap_orphans = lifecycle.reap
owner_alive = lifecycle.owner_alive
