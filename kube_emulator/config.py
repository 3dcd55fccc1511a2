"""The emulated cluster's shape: what the CLI flags and :class:`~kube_emulator.Emulator`'s
keywords set, read by the cluster, its nodes and the server."""

from __future__ import annotations

from dataclasses import dataclass

KUBERNETES_VERSION = "v1.31.0"


@dataclass
class ClusterConfig:
    """The emulated cluster's shape (CLI flags and :class:`Emulator` keywords)."""

    nodes: int = 3
    gpus_per_node: int = 0
    #: Small nodes, as kind on a laptop or a small node pool: CI's smoke suite (3-node clusters,
    #: two at a time under ``-n 2``) fits at the backend's default requests, and no more.
    cpus_per_node: str = "4"
    memory_per_node: str = "8Gi"
    gpu_taint: bool = False
    mtu: int = 65535
    #: What ``/version`` and the nodes report, and which RBAC rules of streams apply (rbac.py).
    kube_version: str = KUBERNETES_VERSION
    #: The GPU product label value of GPU nodes (GPU feature discovery's ``nvidia.com/gpu.product``,
    #: e.g. ``NVIDIA-A100-SXM4-80GB`` or ``Tesla-T4``); None: no product label.
    gpu_product: str | None = None
    #: The ``default`` namespace enforces policies as a real cluster's often does: Pod Security
    #: "baseline", a LimitRange that defaults limits, and a ResourceQuota on requests and limits
    #: (:meth:`Cluster.default_policies`).
    policies: bool = True
    #: ReadWriteMany claims in the ``default`` namespace, as an administrator provisions one
    #: for a team's shared directories (``--kube-shared-pvc``).
    shared_claims: tuple[str, ...] = ()
