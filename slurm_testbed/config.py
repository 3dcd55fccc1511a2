"""What the testbed's Slurm is made of, as text: ``slurm.conf``, ``cgroup.conf``, ``gres.conf``
and the login node's entry of an SSH config (the file ``--slurm-config`` names).

Pure functions of a :class:`Shape` and the nodes' names and addresses, so each file can be
read and checked without starting anything.  The settings are the smallest that make a
working Slurm 22.05 (Debian 12's) inside pytest-sky's local nodes, which share this machine's
kernel:

- ``proctrack/linuxproc`` and ``task/none``: a node's cgroup is its own namespace's, not a
  machine's, and Slurm's cgroup plugins want the machine's hierarchy;
- ``cgroup.conf`` naming ``cgroup/v1``: slurmd loads a cgroup plugin even without cgroup
  tracking, and on a host that mounts both hierarchies (this one) the automatic choice stops
  slurmd with "Hybrid mode is not supported";
- ``SlurmdParameters=config_overrides``: every node says the CPUs and memory it is given here,
  not this machine's two cores, so several allocations share a node as on a real one;
- ``select/cons_tres`` with ``CR_CPU_Memory`` and a default memory per CPU, as sites set it:
  a job that names no memory takes a share, not the whole node.

Fake GPUs are what Slurm's own test suite uses: ``gres.conf`` files that are character
devices of the node but no GPU's (:data:`FAKE_GPU_TARGETS`), typed ``gpu:<type>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Where the testbed's own munge key lives on each node (the host's ``/etc/munge`` is not read).
MUNGE_KEY = "/etc/slurm-testbed/munge.key"
#: Each fake GPU's device file on a compute node: ``/dev/fake-gpu<i>``, a link to a character
#: device every node has (``gres.conf`` wants a character or block device).
FAKE_GPU_PREFIX = "/dev/fake-gpu"
FAKE_GPU_TARGETS = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
#: The ordinary (non-root) user every testbed node knows, with a home of its own on each.
ORDINARY_USER = "slurm-user"


@dataclass(frozen=True)
class Shape:
    """What the testbed's Slurm looks like: its name, compute nodes and what each offers."""

    name: str = "testbed"  # ClusterName, and the Host of the login node in the SSH config
    nodes: int = 3
    cpus_per_node: int = 8
    memory_mb: int = 8192
    gpus_per_node: int = 0
    gpu_type: str = "fake"
    partition: str = "debug"
    #: Who logs in to the login node (root, or :data:`ORDINARY_USER`).
    user: str = "root"
    #: Where every node mounts one shared directory, as a site's NFS (None: nodes share none).
    shared_dir: str | None = None

    def check(self) -> None:
        """Refuse a shape the testbed cannot make, in one line each."""
        if not 1 <= self.nodes <= 64:
            raise ValueError(f"--nodes must be between 1 and 64, got {self.nodes}")
        if not 0 <= self.gpus_per_node <= len(FAKE_GPU_TARGETS):
            raise ValueError(f"--gpus-per-node must be between 0 and {len(FAKE_GPU_TARGETS)}, got {self.gpus_per_node}")
        if self.cpus_per_node < 1 or self.memory_mb < 256:
            raise ValueError("each node needs at least 1 CPU and 256 MB")
        if self.shared_dir is not None and not self.shared_dir.startswith("/"):
            raise ValueError(f"--shared-dir must be an absolute path, got {self.shared_dir!r}")
        if self.user not in ("root", ORDINARY_USER):
            raise ValueError(f"--user must be root or {ORDINARY_USER}, got {self.user!r}")
        for word, what in ((self.name, "--name"), (self.gpu_type, "--gpu-type"), (self.partition, "--partition")):
            if not word or not all(c.isalnum() or c in "-_" for c in word):
                raise ValueError(f"{what} must be letters, digits, '-' or '_', got {word!r}")


@dataclass(frozen=True)
class Node:
    name: str  # its hostname: Slurm's NodeName
    addr: str  # its address on the testbed's network: Slurm's NodeAddr


def slurm_conf(shape: Shape, controller: Node, computes: Sequence[Node]) -> str:
    gres = f" Gres=gpu:{shape.gpu_type}:{shape.gpus_per_node}" if shape.gpus_per_node else ""
    lines = [
        f"ClusterName={shape.name}",
        f"SlurmctldHost={controller.name}({controller.addr})",
        "SlurmUser=slurm",
        "AuthType=auth/munge",
        "MpiDefault=none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU_Memory",
        "DefMemPerCPU=512",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "SchedulerType=sched/backfill",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "StateSaveLocation=/var/spool/slurmctld",
        "SlurmdSpoolDir=/var/spool/slurmd",
        "SlurmctldPidFile=/run/slurmctld.pid",
        "SlurmdPidFile=/run/slurmd.pid",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        *(["GresTypes=gpu"] if shape.gpus_per_node else []),
        *(
            f"NodeName={n.name} NodeAddr={n.addr} CPUs={shape.cpus_per_node} RealMemory={shape.memory_mb}{gres}"
            " State=UNKNOWN"
            for n in computes
        ),
        f"PartitionName={shape.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def cgroup_conf() -> str:
    return "CgroupPlugin=cgroup/v1\n"


def gres_conf(shape: Shape) -> str:
    """Every compute node's fake GPUs, in index order (CUDA_VISIBLE_DEVICES counts them)."""
    return "".join(f"Name=gpu Type={shape.gpu_type} File={FAKE_GPU_PREFIX}{i}\n" for i in range(shape.gpus_per_node))


def fake_gpu_links(shape: Shape) -> list[tuple[str, str]]:
    """(device file, the character device it links to), one per fake GPU."""
    return [(f"{FAKE_GPU_PREFIX}{i}", FAKE_GPU_TARGETS[i]) for i in range(shape.gpus_per_node)]


def login_entry(host: str, address: str, user: str, identity: str, known_hosts: str) -> str:
    """The login node as an SSH config's ``Host`` (SkyPilot's ``~/.slurm/config`` format):
    keys only, its host key checked against the testbed's known_hosts."""
    return "\n".join(
        [
            "# Written by python -m slurm_testbed; removed when it stops.",
            f"Host {host}",
            f"  HostName {address}",
            f"  User {user}",
            f"  IdentityFile {identity}",
            "  IdentitiesOnly yes",
            f"  UserKnownHostsFile {known_hosts}",
            "  StrictHostKeyChecking yes",
            "  BatchMode yes",
            "",
        ]
    )
