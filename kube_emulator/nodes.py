"""The emulated cluster's Node objects, as each node's kubelet would register them.

Every node shares the one bridge and subnet of the emulator (a pod's node is a label, not a
machine), so a node's address is the bridge's and its pod CIDR the cluster's.
"""

from __future__ import annotations

import platform

from kube_emulator import scheduler, store
from kube_emulator.config import ClusterConfig
from kube_emulator.store import Obj

GPU_TAINT = {"key": scheduler.GPU, "value": "present", "effect": "NoSchedule"}


def node_object(config: ClusterConfig, i: int, subnet: str, host_ip: str) -> Obj:
    """Node ``i`` as its kubelet registers it: capacity and labels from ``config`` (GPU
    feature discovery's labels on GPU nodes), the cluster's one pod CIDR, Ready."""
    name = f"emu-node-{i}"
    capacity = {
        "cpu": config.cpus_per_node,
        "memory": config.memory_per_node,
        "pods": "110",
        "ephemeral-storage": "100Gi",
    }
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": "emulated",
    }
    taints = []
    if config.gpus_per_node > 0:
        capacity[scheduler.GPU] = str(config.gpus_per_node)
        labels["nvidia.com/gpu.present"] = "true"
        labels["nvidia.com/gpu.count"] = str(config.gpus_per_node)
    if config.gpu_product:
        labels["nvidia.com/gpu.product"] = config.gpu_product
        if config.gpu_taint:
            taints.append(dict(GPU_TAINT))
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {"name": name, "labels": labels, "annotations": {}},
        "spec": {
            "podCIDR": subnet,
            "podCIDRs": [subnet],
            **({"taints": taints} if taints else {}),
        },
        "status": _node_status(config, name, capacity, host_ip),
    }


def _node_status(config: ClusterConfig, name: str, capacity: dict[str, str], host_ip: str) -> Obj:
    """A Ready node's status, as its kubelet posts it."""
    now = store.now()
    return {
        "capacity": capacity,
        "allocatable": dict(capacity),
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "kubelet is posting ready status",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
        ],
        "addresses": [
            {"type": "InternalIP", "address": host_ip},
            {"type": "Hostname", "address": name},
        ],
        "nodeInfo": {
            "architecture": "amd64",
            "bootID": "",
            "containerRuntimeVersion": "pytest-sky-emulator://0.1",
            "kernelVersion": platform.release(),
            "kubeProxyVersion": config.kube_version,
            "kubeletVersion": config.kube_version,
            "machineID": "",
            "operatingSystem": "linux",
            "osImage": "pytest-sky kube emulator",
            "systemUUID": "",
        },
    }
