"""The Slurm backend: a cluster is one allocation of a Slurm site (DESIGN.md section 10).

``create`` submits one job, ``pytest-sky-<cluster>``, of one task per node holding the
resources asked per node, through the site's login node (``slurm_site``); its batch script
keeps one job step on every node, which serves pytest-sky's own sshd on a port of its own
(``shell/slurm_node.sh``).  Rank *i* is the allocation's node *i* (Slurm's node id), its
address the node's ``NodeAddr``; the client reaches the head through the login node
(``ssh -W``), workers through the head.  Every rank of every run is a job step of the
allocation (``srun --overlap``, ``NodeInfo.step``): there is no agent server, whose fixed
port a node shared with other jobs does not give us.  ``destroy`` cancels the job and waits
until ``squeue`` no longer lists it; the job's own ``--time`` ends it if nothing else does,
and its comment names its owner (``slurm_owner``), by which a later session cancels an
allocation whose owner is gone.  What a shared machine cannot give (killing or restarting a
node, partitions, degraded links, stop and start) is refused in one line.
"""

from __future__ import annotations

import logging
import secrets

from pytest_sky import naming
from pytest_sky.backends import slurm_steps
from pytest_sky.backends.base import Backend, HomeFiles, NetworkFaults, ProvisionConfig
from pytest_sky.backends.slurm_journal import SlurmRecord
from pytest_sky.backends.slurm_owner import JOB_PREFIX, Owner, job_name
from pytest_sky.backends.slurm_site import Login, Site, SlurmUnreachableError, locate
from pytest_sky.backends.slurm_steps import DEFAULT_TIME, Placement
from pytest_sky.backends.slurm_submit import Allocation, submit
from pytest_sky.cluster_info import ClusterInfo, NodeInfo, SshRoute
from pytest_sky.errors import BackendUnavailableError, NotSupportedError, ProvisionError
from pytest_sky.resources import Resources
from pytest_sky.settings import SLURM_TIMEOUT
from pytest_sky.state import Journal

log = logging.getLogger(__name__)

#: How long a launch waits for its allocation to run (``--slurm-timeout``).
READY_TIMEOUT = SLURM_TIMEOUT
#: After ``scancel``'s SIGTERM, how long before SIGKILL; then how long for squeue to drop it.
CANCEL_GRACE = 10
CANCEL_LIMIT = 60
_NOT_HERE = "use the local backend, whose nodes are this machine's own"


class SlurmBackend(Backend):
    name = "slurm"
    cloud_label = "Slurm"
    multiplex_client = True
    #: A connection to the head is a jump through the login node: open the shared one first.
    eager_client_master = True

    def __init__(
        self,
        config: str | None = None,
        cluster: str | None = None,
        partition: str | None = None,
        account: str | None = None,
        qos: str | None = None,
        time_limit: str = DEFAULT_TIME,
        ready_timeout: float = READY_TIMEOUT,
        shared_dir: str | None = None,
    ) -> None:
        self.config = config
        #: A directory every node of the site mounts (NFS, Lustre), which a cluster asking for
        #: ``shared_dir`` at that path holds alone while it lives (``shell/slurm_node.sh``).
        self.shared_dir = shared_dir
        self.cluster = cluster
        self.placement = Placement(partition, account, qos, slurm_steps.check_time(time_limit))
        self.ready_timeout = ready_timeout
        self._site: Site | None = None
        self._user = ""

    # -- where ---------------------------------------------------------------------------

    @property
    def site(self) -> Site:
        if self._site is None:
            self._site = locate(self.config, self.cluster)
        return self._site

    def login(self, site: Site | None = None) -> Login:
        return Login(site or self.site)

    def user(self) -> str:
        """Who this client is on the site; the site's commands checked on the way."""
        if not self._user:
            answer = self.login().run("check", timeout=60)
            missing = [words[0] for words in answer.lines("missing")]
            if missing:
                raise SlurmUnreachableError(
                    f"the Slurm login node {self.site.describe()} has no {', '.join(missing)} on its PATH"
                )
            users = answer.lines("user")
            if answer.code != 0 or not users:
                raise SlurmUnreachableError(f"the Slurm login node {self.site.describe()} did not answer: {answer.err}")
            self._user = users[0][0]
        return self._user

    # -- before anything is submitted ----------------------------------------------------

    def plan(self, name: str, num_nodes: int, resources: Resources, shared_dir: str | None = None) -> None:
        site_dir = self.shared_dir
        if shared_dir and not site_dir:
            raise BackendUnavailableError(
                f"shared_dir={shared_dir} on Slurm needs a directory every node of the site mounts there (a job "
                f"cannot mount one): if {shared_dir} is one, pass --slurm-shared-dir {shared_dir}"
            )
        if shared_dir and site_dir and shared_dir.rstrip("/") != site_dir.rstrip("/"):
            raise BackendUnavailableError(
                f"shared_dir={shared_dir}: the Slurm site's shared directory is {site_dir} "
                "(--slurm-shared-dir); ask for that one"
            )
        self.user()

    def has_gpus(self) -> bool:
        return any("gpu:" in line for line in self._gres())

    def gpus_unseen(self) -> str:
        return f"no node of the Slurm partition {self.placement.partition or '(default)'} offers GRES gpu"

    def _gres(self) -> list[str]:
        return self.login().run("gres", self.placement.partition or "", timeout=60).out.split()

    # -- lifecycle -----------------------------------------------------------------------

    def create(self, config: ProvisionConfig) -> ClusterInfo:
        site, user, launch = self.site, self.user(), secrets.token_hex(6)
        record = SlurmRecord(
            site.config, site.host, user, job_name(config.name), launch, None, slurm_steps.node_dir(config.name, launch)
        )
        record.save(config.journal)  # intent: a job of this name and token may exist from here on
        try:
            alloc = self._allocate(config, record)
            return self._cluster_info(config, record, alloc)
        except BaseException:
            try:
                self.destroy(config.name, config.journal)
            except Exception as exc:  # noqa: BLE001 - the launch's own error is the one to show
                log.warning("cleanup of %s after a failed launch: %s", config.name, exc)
            raise

    def _allocate(self, config: ProvisionConfig, record: SlurmRecord) -> Allocation:
        gpus = slurm_steps.gres(config.resources, self._gres()) if config.resources.accelerators else None
        owner = Owner.this_process(record.launch, config.keep)
        options = slurm_steps.sbatch_options(
            record.job_name, config.num_nodes, config.resources, self.placement, owner.comment(), gpus
        )
        files = slurm_steps.node_files(record.node_dir, config.keys, config.home_files)

        def on_job(job_id: str) -> None:
            SlurmRecord(**{**record.to_json(), "job_id": job_id}).save(config.journal)

        shared = self.shared_dir if config.shared_dir else None
        batch = slurm_steps.batch_script(record.node_dir, shared, self.ready_timeout)
        return submit(self.login(), config.name, batch, record.node_dir, files, options, self.ready_timeout, on_job)

    def _cluster_info(self, config: ProvisionConfig, record: SlurmRecord, alloc: Allocation) -> ClusterInfo:
        """Rank i is Slurm's node i; the head through the login node, workers through it."""
        assert alloc.job_id is not None
        login, nodes = self.login(), alloc.nodes()
        if len(nodes) != config.num_nodes:
            raise ProvisionError(f"Slurm job {alloc.job_id} of {config.name} reported {len(nodes)} node(s)")
        infos = []
        for node in nodes:
            if node.rank == 0:
                route = SshRoute(node.addr, node.port, login.proxy_command(node.addr, node.port), user=record.user)
            else:
                route = SshRoute(node.addr, node.port, proxy_jump=config.name, user=record.user)
            step = slurm_steps.step_argv(alloc.job_id, node.name, config.resources)
            infos.append(NodeInfo(node.rank, naming.node_name(node.rank), node.name, node.addr, route, {}, step))
        return ClusterInfo(
            nodes=tuple(infos),
            python="python3",
            # A user's own srun in a rank acts on the whole allocation (slurm_step.sh drops
            # the step's own list and count).
            env={"SLURM_JOB_NODELIST": alloc.nodelist, "SLURM_JOB_NUM_NODES": str(config.num_nodes)},
            cloud="slurm",
            region=self.site.host or "local",
            zone=self.placement.partition,
            home=f"{record.node_dir}/home",
            agent_servers=False,
        )

    def put_files(self, name: str, journal: Journal, info: ClusterInfo, files: HomeFiles) -> None:
        """Into every node's home at once, through one step of the allocation."""
        record = SlurmRecord.load(journal)
        answer = self.login(record.site).run(
            "put", str(record.job_id), str(len(info.nodes)), info.home, stdin=slurm_steps.tar_of(files)
        )
        if answer.code != 0:
            raise ProvisionError(f"could not write {name}'s ssh files on its nodes: {answer.err.strip()}")

    # -- down ----------------------------------------------------------------------------

    def destroy(self, name: str, journal: Journal) -> None:
        """Cancel the allocation (SIGTERM, then SIGKILL) and wait until squeue no longer lists
        it.  A journal without a job id (a launch killed as sbatch answered) finds the job by
        its name, user and the launch's token."""
        record = SlurmRecord.load(journal)
        if not record.job_name:
            return  # nothing was submitted
        login = self.login(record.site)
        job = record.job_id or self._find(login, record)
        if job is not None:
            self._cancel(login, job, name)

    def _find(self, login: Login, record: SlurmRecord) -> str | None:
        for job, job_name_, _, owner in self._jobs(login, record.user):
            if job_name_ == record.job_name and owner is not None and owner.launch == record.launch:
                return job
        return None

    def _jobs(self, login: Login, user: str) -> list[tuple[str, str, str, Owner | None]]:
        """``user``'s jobs named as ours: (id, name, state, owner record or None)."""
        answer = login.run("list", user, timeout=60)
        if answer.code != 0:
            raise ProvisionError(f"could not list {user}'s Slurm jobs: {answer.err.strip()}")
        found = []
        for line in answer.out.splitlines():
            job, name, state, comment = [*line.split("|", 3), "", "", ""][:4]
            if name.startswith(JOB_PREFIX):
                found.append((job, name, state, Owner.parse(comment)))
        return found

    def _cancel(self, login: Login, job: str, name: str) -> None:
        limits = (str(CANCEL_GRACE), str(CANCEL_LIMIT))
        answer = login.run("cancel", job, *limits, timeout=CANCEL_GRACE + CANCEL_LIMIT + 60)
        left = answer.lines("left")
        if left or not answer.lines("gone"):
            state = " ".join(left[0]) if left else answer.err.strip()
            raise ProvisionError(f"Slurm job {job} of {name} is still listed after scancel: {state}")

    def reap_stale(self) -> list[str]:
        """Cancel this user's allocations of ours whose owner is gone (``slurm_owner``); what
        went, as ``<cluster> (Slurm job <id>)``."""
        login, reaped = self.login(), []
        for job, name, _, owner in self._jobs(login, self.user()):
            if owner is not None and owner.gone():
                self._cancel(login, job, name)
                reaped.append(f"{name.removeprefix(JOB_PREFIX)} (Slurm job {job})")
        return reaped

    def diagnostics(self, name: str, journal: Journal) -> list[tuple[str, str]]:
        record = SlurmRecord.load(journal)
        if record.job_id is None:
            return []
        answer = self.login(record.site).run("show", record.job_id, timeout=60)
        return [(f"slurm-job-{record.job_id}.txt", answer.out or answer.err)]

    def leftovers(self, name: str, journal: Journal) -> str:
        record = SlurmRecord.load(journal)
        job = record.job_id or f"named {record.job_name}"
        return f"Slurm job {job} of {record.user} on {record.site.describe()} (scancel it there)"

    # -- what a shared machine cannot do -------------------------------------------------

    def kill_node(self, name: str, journal: Journal, rank: int) -> None:
        raise NotSupportedError(f"the slurm backend cannot kill a node: a Slurm node is the site's; {_NOT_HERE}")

    def restart_node(self, name: str, journal: Journal, info: ClusterInfo, rank: int, wipe: bool) -> ClusterInfo:
        raise NotSupportedError(f"the slurm backend cannot restart a node: a Slurm node is the site's; {_NOT_HERE}")

    def set_network_faults(self, name: str, journal: Journal, info: ClusterInfo, faults: NetworkFaults) -> None:
        if faults:
            raise NotSupportedError(
                "partition and degrade are not supported on Slurm: a job may not change the site's network; "
                + _NOT_HERE
            )
