"""``python -m slurm_testbed --nodes N --slurm-config FILE [--gpus-per-node K] ...``

Starts a real Slurm on this machine (munge, slurmctld, a slurmd per node, a login node
reached over SSH) inside pytest-sky local nodes, writes FILE (an SSH config whose one Host is
the login node) once ``sinfo`` lists every node idle, and runs until SIGINT or SIGTERM, then
leaves nothing behind.  Needs root (the local backend's nodes as root) and Debian's
slurmctld, slurmd, slurm-client and munge (``scripts/setup.sh`` installs them)::

    python -m slurm_testbed --nodes 3 --slurm-config /tmp/slurm-config &
    while [ ! -e /tmp/slurm-config ]; do sleep 0.1; done
    PYTEST_SKY_SLURM_CONFIG=/tmp/slurm-config pytest smoke --slurm -k multinode
    kill %1
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
from pathlib import Path

from slurm_testbed.config import ORDINARY_USER, Shape
from slurm_testbed.product import SkyError
from slurm_testbed.testbed import Testbed, TestbedError

#: The programs the testbed runs, and the Debian package of each.
NEEDED = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client", "munged": "munge"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m slurm_testbed", description=__doc__.split("\n")[0])
    p.add_argument("--slurm-config", required=True, type=Path, metavar="FILE", help="where to write the SSH config")
    p.add_argument("--nodes", type=int, default=3, help="compute nodes (default 3)")
    p.add_argument("--cpus-per-node", type=int, default=8, help="CPUs each node offers (default 8)")
    p.add_argument("--memory-per-node", type=int, default=8192, metavar="MB", help="memory each offers (default 8192)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="fake GPUs (GRES gpu) of each node (default 0)")
    p.add_argument("--gpu-type", default="fake", help="their GRES type (default fake: gpu:fake:K)")
    p.add_argument("--partition", default="debug", help="the one partition's name (default debug)")
    p.add_argument("--name", default="testbed", help="the Slurm cluster's name and the login node's Host")
    p.add_argument(
        "--shared-dir", metavar="PATH", help="one directory every node mounts at PATH, as a site's NFS (default: none)"
    )
    p.add_argument(
        "--user", default="root", choices=("root", ORDINARY_USER), help="who the SSH config logs in as (default root)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = sorted({pkg for prog, pkg in NEEDED.items() if shutil.which(prog, path="/usr/sbin:/usr/bin") is None})
    if missing:
        needed = " ".join(missing)
        print(f"slurm testbed: Debian packages missing: {needed} (run scripts/setup.sh as root)", file=sys.stderr)
        return 2
    shape = Shape(
        name=args.name,
        nodes=args.nodes,
        cpus_per_node=args.cpus_per_node,
        memory_mb=args.memory_per_node,
        gpus_per_node=args.gpus_per_node,
        gpu_type=args.gpu_type,
        partition=args.partition,
        user=args.user,
        shared_dir=args.shared_dir,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        testbed = Testbed(shape, args.slurm_config.resolve())
        testbed.start()
    except (ValueError, TestbedError, SkyError) as exc:
        print(f"slurm testbed: {exc}", file=sys.stderr)
        return 1
    try:
        stop.wait()
    finally:
        testbed.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
