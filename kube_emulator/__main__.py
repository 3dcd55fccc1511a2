"""``python -m kube_emulator --kubeconfig PATH [--nodes 3] [--gpus-per-node N] ...``

Serves until SIGTERM/SIGINT/SIGHUP, then stops every pod it runs and removes its bridge,
its instance directory and the kubeconfig it wrote.  The kubeconfig appears (atomically)
only once the server answers, so a script can wait for the file::

    python -m kube_emulator --kubeconfig /tmp/kc --nodes 3 &
    while [ ! -e /tmp/kc ]; do sleep 0.1; done
    KUBECONFIG=/tmp/kc pytest smoke --kubernetes -k multinode
    kill %1

The kubeconfig's current context is ``kube-emulator-role``: the ServiceAccount that holds
exactly the shipped Role, as on a real cluster set up with ``examples/kubernetes/rbac.yaml``
(``--current-context kube-emulator`` for the admin; its token is in the file either way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

from kube_emulator.config import KUBERNETES_VERSION, ClusterConfig
from kube_emulator.faults import Faults
from kube_emulator.product import SkyError
from kube_emulator.server import CONTEXTS, ROLE_CONTEXT, SHIPPED_ROLE, EmulatorServer, default_state_dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kube_emulator", description=__doc__.split("\n")[0])
    p.add_argument("--kubeconfig", required=True, type=Path, help="where to write the kubeconfig once ready")
    p.add_argument("--nodes", type=int, default=3, help="emulated nodes (default 3)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="nvidia.com/gpu capacity of each node (default 0)")
    p.add_argument("--cpus-per-node", default="4", help="cpu capacity of each node (default 4)")
    p.add_argument("--memory-per-node", default="8Gi", help="memory capacity of each node (default 8Gi)")
    p.add_argument(
        "--gpu-product",
        default=None,
        metavar="PRODUCT",
        help="label nodes nvidia.com/gpu.product=PRODUCT (e.g. NVIDIA-A100-SXM4-80GB, Tesla-T4)",
    )
    p.add_argument(
        "--no-policies",
        dest="policies",
        action="store_false",
        help="no Pod Security, LimitRange or ResourceQuota in the default namespace",
    )
    p.add_argument(
        "--gpu-taint", action="store_true", help="taint GPU nodes nvidia.com/gpu=present:NoSchedule (as GKE does)"
    )
    p.add_argument("--mtu", type=int, default=65535, help="MTU of the pods' veths (default 65535)")
    p.add_argument(
        "--shared-pvc",
        action="append",
        default=[],
        metavar="NAME",
        help="a ReadWriteMany PersistentVolumeClaim in the default namespace, as an admin provisions one "
        "(for pytest-sky's --kube-shared-pvc; repeatable)",
    )
    p.add_argument(
        "--kube-version",
        default=KUBERNETES_VERSION,
        help=f"the Kubernetes version served (default {KUBERNETES_VERSION}); from 1.35 exec and port-forward "
        "websockets need create as well as get",
    )
    p.add_argument(
        "--role", type=Path, default=None, metavar="FILE", help=f"the Role of the role context (default {SHIPPED_ROLE})"
    )
    p.add_argument(
        "--current-context",
        default=ROLE_CONTEXT,
        choices=CONTEXTS,
        help=f"the kubeconfig's current context (default {ROLE_CONTEXT}: the Role's ServiceAccount, as CI runs; "
        "kube-emulator is the admin)",
    )
    p.add_argument("--state-dir", type=Path, default=None, help=f"default: {default_state_dir()}")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="default: a free port")
    p.add_argument("--fault-pending", action="append", default=[], metavar="GLOB", help="pods that stay Pending")
    p.add_argument(
        "--fault-image-pull", action="append", default=[], metavar="GLOB", help="pods/images that fail to pull"
    )
    p.add_argument("--fault-crash", action="append", default=[], metavar="GLOB", help="pods whose container exits 1")
    p.add_argument("--fault-drop-portforward-after-bytes", type=int, default=None, metavar="N")
    p.add_argument("--faults", default=None, metavar="JSON", help="faults as the admin endpoint takes them")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    faults = Faults()
    if args.faults:
        faults.update(json.loads(args.faults))
    faults.update(
        {
            k: v
            for k, v in {
                "pending": args.fault_pending,
                "image_pull": args.fault_image_pull,
                "crash": args.fault_crash,
                "drop_portforward_after_bytes": args.fault_drop_portforward_after_bytes,
            }.items()
            if v not in (None, [])
        }
    )
    config = ClusterConfig(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        cpus_per_node=args.cpus_per_node,
        memory_per_node=args.memory_per_node,
        gpu_taint=args.gpu_taint,
        mtu=args.mtu,
        kube_version=args.kube_version,
        gpu_product=args.gpu_product,
        policies=args.policies,
        shared_claims=tuple(args.shared_pvc),
    )
    server = EmulatorServer(
        config,
        faults=faults,
        state_dir=args.state_dir,
        kubeconfig_path=args.kubeconfig.absolute(),
        host=args.host,
        port=args.port,
        role=args.role,
        current_context=args.current_context,
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        bridge = server.cluster.kubelet.network.bridge
        print(
            f"kube emulator ready at {server.url} ({args.nodes} nodes, bridge {bridge}); "
            f"kubeconfig {server.kubeconfig_path}",
            file=sys.stderr,
            flush=True,
        )
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="kube-emulator %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(args))
    except (SkyError, ValueError) as exc:
        print(f"kube emulator: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
