"""What a Slurm allocation of pytest-sky's is made of, as text and bytes: its ``sbatch``
options, its batch script, the files each node's step receives, and the ``srun`` words that
start a rank as one of its job steps (DESIGN.md section 10).

Pure functions: the backend (``backends.slurm``) sends them through the login node.
"""

from __future__ import annotations

import io
import math
import re
import shlex
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass

from pytest_sky import shell
from pytest_sky.backends.base import HomeFiles
from pytest_sky.errors import ResourcesError
from pytest_sky.resources import Resources
from pytest_sky.settings import SLURM_TIME
from pytest_sky.ssh import sshd
from pytest_sky.ssh.keys import ClusterKeys

#: Where each node keeps the cluster's directory: node-local scratch, the same path on every
#: node (the peers' ssh config names files in it).  Not the user's home, which sites share
#: between nodes and which pytest-sky does not write.
NODE_SCRATCH = "/tmp"
#: Slurm's forms of a time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
TIME_LIMIT = re.compile(r"^(\d+-)?\d+(:\d+){0,2}$")
#: What ``--slurm-time`` is unless set: long enough for a session's clusters, short enough
#: that an allocation nobody cancelled ends within the hour.
DEFAULT_TIME = SLURM_TIME


def node_dir(cluster: str, launch: str) -> str:
    return f"{NODE_SCRATCH}/pytest-sky-{cluster}-{launch}"


def check_time(limit: str) -> str:
    if not TIME_LIMIT.match(limit.strip()):
        raise ResourcesError(
            f"--slurm-time {limit!r} is not a Slurm time limit: give minutes, HH:MM:SS or D-HH:MM:SS (e.g. 1:00:00)"
        )
    return limit.strip()


@dataclass(frozen=True)
class Placement:
    """Where on the site the allocation goes: the settings' partition, account and QOS, and
    the time limit that ends it if nothing else does."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str = DEFAULT_TIME


def gres(resources: Resources, offered: Iterable[str]) -> str | None:
    """``gpu[:TYPE]:N`` for the task's accelerators, in the site's spelling of the type where
    a node offers it in any case (GRES types are case-sensitive: ``A100`` is not ``a100``);
    None without accelerators.  A fractional count needs a whole device."""
    acc = resources.accelerators
    if acc is None:
        return None
    count = math.ceil(acc.count)
    types = {t for g in offered for t in re.findall(r"\bgpu:([^:(,]+):\d+", g, re.IGNORECASE)}
    spelled = next((t for t in sorted(types) if t.lower() == acc.name.lower()), acc.name)
    return f"gpu:{spelled}:{count}"


def sbatch_options(
    name: str, num_nodes: int, resources: Resources, placement: Placement, comment: str, gpus: str | None
) -> list[str]:
    """One task per node holding the resources asked per node; no output file (the batch
    script says nothing), never requeued (a requeued allocation would be a new cluster)."""
    options = [
        f"--job-name={name}",
        f"--nodes={num_nodes}",
        "--ntasks-per-node=1",
        f"--time={placement.time_limit}",
        f"--comment={comment}",
        "--output=/dev/null",
        "--no-requeue",
    ]
    if resources.cpus is not None:
        options.append(f"--cpus-per-task={math.ceil(resources.cpus)}")
    if resources.memory is not None:
        options.append(f"--mem={math.ceil(resources.memory * 1024)}M")
    if gpus is not None:
        options.append(f"--gres={gpus}")
    for flag, value in (("partition", placement.partition), ("account", placement.account), ("qos", placement.qos)):
        if value:
            options.append(f"--{flag}={value}")
    return options


def batch_script(directory: str, shared: str | None = None, hold: float = 0) -> str:
    """The allocation's batch script: the node step's text, its directory and the site's
    shared directory it holds (and how long it may wait for it), then its body."""
    return (
        "#!/bin/bash\n"
        f"node={shlex.quote(shell.script(shell.SLURM_NODE))}\n"
        f"dir={shlex.quote(directory)}\n"
        f"shared={shlex.quote(shared or '')}\n"
        f"hold={int(hold)}\n"
        f"{shell.script(shell.SLURM_BATCH)}"
    )


def node_files(directory: str, keys: ClusterKeys, home_files: HomeFiles) -> bytes:
    """The tar every node's step receives: the home files under ``home/``, each node's host
    key under ``host_keys/<rank>`` (each node keeps its own), and sshd's config, whose
    ``Port`` and ``SetEnv`` the node puts first once it has picked its port."""
    config = sshd.render(
        listen=None,
        host_key=f"{directory}/host_key",
        pid_file="none",
        path_env=None,
        authorized_keys=f"{directory}/home/.ssh/authorized_keys",
        strict_modes=False,
    )
    members: dict[str, tuple[bytes, int]] = {f"home/{path}": entry for path, entry in home_files.items()}
    members.update({f"host_keys/{rank}": (key.private_openssh, 0o600) for rank, key in enumerate(keys.hosts)})
    members["sshd_config"] = (config.encode(), 0o600)
    return tar_of(members)


def tar_of(members: dict[str, tuple[bytes, int]]) -> bytes:
    """A tar of ``path -> (content, mode)``, its directories 0700."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        made: set[str] = set()
        for path in sorted(members):
            parts = path.split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                folder = "/".join(parts[:depth])
                if folder not in made:
                    made.add(folder)
                    entry = tarfile.TarInfo(folder)
                    entry.type, entry.mode = tarfile.DIRTYPE, 0o700
                    tar.addfile(entry)
            data, mode = members[path]
            entry = tarfile.TarInfo(path)
            entry.size, entry.mode = len(data), mode
            tar.addfile(entry, io.BytesIO(data))
    return buf.getvalue()


def step_argv(job_id: str, node: str, resources: Resources) -> tuple[str, ...]:
    """The words that start a command on ``node`` as a job step of the allocation, beside the
    others (``--overlap``): all of the job's CPUs, memory and GRES on that node, unbound,
    its own Slurm variables gone before the command runs (``shell/slurm_step.sh``)."""
    cpus = math.ceil(resources.cpus) if resources.cpus is not None else 1
    return (
        "srun",
        f"--jobid={job_id}",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        f"--cpus-per-task={cpus}",
        "--mem=0",
        "--cpu-bind=none",
        "--quiet",
        "--unbuffered",
        "bash",
        "-c",
        shell.script(shell.SLURM_STEP),
        "slurm-step",
    )
