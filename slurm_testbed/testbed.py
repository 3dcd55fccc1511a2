"""A real Slurm on this machine: munge, slurmctld and a slurmd per node, inside pytest-sky nodes.

The nodes are a pytest-sky local cluster of ``nodes + 1``: rank 0 is the controller and the
login node (reached over SSH, as a site's login node is), every other rank a compute node.
Each daemon is a detached job of that cluster running in the foreground, so its log is the
job's and stopping the cluster stops it; the Slurm files are written into each node's own
root, a copy-on-write layer over this machine's (the host's ``/etc`` is never written, its
munge key never read).  The SSH config naming the login node is written once ``sinfo`` lists
every compute node idle, and removed first on the way down.

The cluster lives in a state directory of the testbed's own (``$PYTEST_SKY_HOME/slurm-testbed``),
so neither ``pytest-sky down --all`` nor a test session's reaper takes it while it runs; a
testbed that was killed is reaped by the next one to start there.
"""

from __future__ import annotations

import base64
import contextlib
import grp
import os
import pwd
import secrets
import sys
from pathlib import Path

from slurm_testbed import config
from slurm_testbed.config import Node, Shape
from slurm_testbed.product import Cluster, Job, RunTimeoutError, SkyError, StateStore, Task, launch, reap, state_home

#: What runs on the nodes, one step at a time (``TB_STEP``).
NODE_SCRIPT = (Path(__file__).with_name("node.sh")).read_text()
#: How long the daemons may take to answer, on a loaded machine.
READY_TIMEOUT = 180.0
#: The first uid tried for the ordinary user (one no account of this machine has).
FIRST_UID = 64700


class TestbedError(Exception):
    """The testbed could not start; the message says what failed and what the daemons said."""


def free_id(start: int = FIRST_UID) -> int:
    """A uid that is also a free gid on this machine (every node sees this machine's files)."""
    uid = start
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            try:
                grp.getgrgid(uid)
            except KeyError:
                return uid
        uid += 1


def say(line: str) -> None:
    print(f"slurm testbed: {line}", file=sys.stderr, flush=True)


class Testbed:
    """One running Slurm: :meth:`start` brings it up and writes the SSH config, :meth:`stop`
    removes the config, then every node (and with them every daemon and job step)."""

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(self, shape: Shape, slurm_config: Path, state_dir: Path | None = None) -> None:
        shape.check()
        self.shape = shape
        self.slurm_config = slurm_config
        self.state_dir = state_dir or state_home() / "slurm-testbed"
        self.cluster: Cluster | None = None
        self.daemons: dict[str, Job] = {}

    # -- what the testbed offers ------------------------------------------------------------

    @property
    def login(self) -> Node:
        assert self.cluster is not None
        return Node(self.cluster.node_names[0], self.cluster.node_ips[0])

    @property
    def computes(self) -> list[Node]:
        assert self.cluster is not None
        return [Node(n, ip) for n, ip in zip(self.cluster.node_names[1:], self.cluster.node_ips[1:], strict=True)]

    def login_entry(self, user: str | None = None, host: str | None = None) -> str:
        """The login node as a ``Host`` of an SSH config, for ``user`` (the shape's by default)."""
        assert self.cluster is not None
        cluster_dir = Path(self.cluster.ssh_config).parent
        return config.login_entry(
            host or self.shape.name,
            self.login.addr,
            user or self.shape.user,
            str(cluster_dir / "id_ed25519"),
            str(cluster_dir / "known_hosts"),
        )

    def run_on_login(self, command: str, timeout: float = 60) -> str:
        """A command on the login node as root (the testbed's administrator); its output."""
        assert self.cluster is not None
        result = self.cluster.run(Task(run=command, num_nodes=1), timeout=timeout)
        if result.returncode != 0:
            raise TestbedError(f"{command!r} on the login node: {result.error}: {result.ranks[0].stdout.strip()}")
        return result.ranks[0].stdout

    # -- up and down ------------------------------------------------------------------------

    def start(self) -> None:
        store = StateStore(self.state_dir)
        reap(store)  # what a killed testbed left here
        say(f"starting {self.shape.nodes} compute node(s) and a login node")
        self.cluster = launch(
            num_nodes=self.shape.nodes + 1,
            name=f"slurm-tb-{secrets.token_hex(3)}",
            backend="local",
            store=store,
            shared_dir=self.shape.shared_dir,
        )
        try:
            self._bring_up()
        except BaseException:
            self.stop()
            raise
        say(
            f"{self.shape.name}: {self.shape.nodes} node(s) idle in partition {self.shape.partition}; "
            f"login node {self.login.addr} as {self.shape.user}; wrote {self.slurm_config}"
        )

    def _bring_up(self) -> None:
        assert self.cluster is not None
        files, key = self._files()
        everyone = self.shape.nodes + 1
        self._step("prepare", everyone, files, key)
        self.daemons["munged"] = self._daemon("munged", everyone)
        self._step("munge-ready", everyone)
        self.daemons["slurmctld"] = self._daemon("slurmctld", 1)
        self.daemons["slurmd"] = self._daemon("slurmd", everyone)
        self._step("idle", 1, {"TB_NODES": str(self.shape.nodes)})
        self._write_config()

    def _files(self) -> tuple[dict[str, str], dict[str, str]]:
        """What ``prepare`` writes, as its task's envs, and the munge key, as its secret."""
        shape = self.shape
        envs = {
            "TB_SLURM_CONF": config.slurm_conf(shape, self.login, self.computes),
            "TB_CGROUP_CONF": config.cgroup_conf(),
            "TB_GRES_CONF": config.gres_conf(shape),
            "TB_USER": config.ORDINARY_USER,
            "TB_UID": str(free_id()),
            "TB_GPU_LINKS": " ".join(f"{dev}={target}" for dev, target in config.fake_gpu_links(shape)),
            "TB_SHARED_DIR": shape.shared_dir or "",
        }
        return envs, {"TB_MUNGE_KEY": base64.b64encode(os.urandom(1024)).decode()}

    def _task(self, step: str, num_nodes: int, envs: dict[str, str], hidden: dict[str, str]) -> Task:
        return Task(
            name=f"slurm-testbed-{step}",
            run=NODE_SCRIPT,
            num_nodes=num_nodes,
            envs={**envs, "TB_STEP": step, "TB_MUNGE_KEY_PATH": config.MUNGE_KEY},
            secrets=hidden,
        )

    def _step(self, step: str, num_nodes: int, envs: dict[str, str] | None = None, hidden: dict | None = None) -> None:
        """A step every one of the first ``num_nodes`` nodes runs to its end."""
        assert self.cluster is not None
        try:
            result = self.cluster.run(self._task(step, num_nodes, envs or {}, hidden or {}), timeout=READY_TIMEOUT)
        except RunTimeoutError:
            raise TestbedError(f"{step} did not finish within {READY_TIMEOUT:g} s; {self._daemon_logs()}") from None
        if result.returncode != 0:
            raise TestbedError(f"{step} failed: {result.error}; {result.output.strip()[-2000:]}")

    def _daemon(self, step: str, num_nodes: int) -> Job:
        """A daemon on each of the first ``num_nodes`` nodes, in the foreground: a detached job."""
        assert self.cluster is not None
        return self.cluster.submit(self._task(step, num_nodes, {}, {}))

    def _daemon_logs(self) -> str:
        """The daemons' last words, for a testbed that did not come up."""
        said = []
        for name, job in self.daemons.items():
            with contextlib.suppress(SkyError):
                tail = job.logs().strip().splitlines()[-15:]
                said.append(f"{name} ({job.status}): " + " | ".join(tail))
        return "; ".join(said) or "no daemon had started"

    def _write_config(self) -> None:
        """The login node's entry, written whole (a reader never sees half of it)."""
        self.slurm_config.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.slurm_config.with_name(f".{self.slurm_config.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.login_entry())
        os.replace(tmp, self.slurm_config)

    def stop(self) -> None:
        """The config first (nothing should reach a Slurm that is going), then every node."""
        with contextlib.suppress(FileNotFoundError):
            if self.cluster is not None and self.slurm_config.read_text() == self.login_entry():
                self.slurm_config.unlink()
        if self.cluster is not None:
            self.cluster.down()
            say(f"{self.shape.name} stopped")
