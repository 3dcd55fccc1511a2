"""Kubernetes objects of a cluster, as plain dicts (what the API receives, what tests validate).

Pure functions, no client: the backend sends them, and the unit tests check every one with
``kubernetes-validate`` in strict mode for more than one Kubernetes version.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable
from dataclasses import dataclass

from pytest_sky import naming, shell
from pytest_sky.backends import privileges
from pytest_sky.backends.kube_policy import GpuSelector, node_affinity
from pytest_sky.resources import Resources
from pytest_sky.settings import DEFAULT_KUBE_IMAGE
from pytest_sky.ssh import sshd

LABEL_CLUSTER = "pytest-sky/cluster"
LABEL_ROLE = "pytest-sky/role"
LABEL_RANK = "pytest-sky/rank"
#: One random id per launch, on every object the launch creates: what the backend waits on,
#: tears down and cleans up after a failed launch.  The cluster label alone is not enough:
#: a teammate's or another CI run's same-named cluster in a shared namespace carries it too.
LABEL_LAUNCH = "pytest-sky/launch"
MANAGED_BY = {"app.kubernetes.io/managed-by": "pytest-sky"}
SECRET_MOUNT = "/run/pytest-sky-secret"
RUNTIME_DIR = "/run/pytest-sky"
DEFAULT_IMAGE = DEFAULT_KUBE_IMAGE
#: A pod's requests when the task names no ``cpus``/``memory``: half a CPU and 1 GiB.
#: SkyPilot's Kubernetes default is 2 CPUs and 1 GiB per CPU (4 GiB per CPU with GPUs), sized
#: for one job per pod; our pods are test nodes, several per machine: kind on a laptop is one
#: node of the Docker VM's 2-4 CPUs and 4-8 GiB, of which the control plane and kube-system
#: already request about 1 CPU and 0.5 GiB, so three 2-CPU pods never fit there, let alone two
#: 3-node clusters at ``-n 2``.  Requests are reservations, not caps (no limits unless the
#: namespace demands them, see :func:`container_resources`): a pod still uses idle CPU and
#: memory beyond them, and a task that needs a guaranteed share says ``cpus``/``memory``.
DEFAULT_CPUS = 0.5
DEFAULT_MEMORY_GB = 1.0
#: The Secret's key (and file under SECRET_MOUNT) holding the pods' sshd_config.
SSHD_CONFIG_KEY = "sshd_config"
#: The Secret's key holding the nodes' ``sitecustomize`` (``agent.site_hook``), which the pod's
#: bootstrap copies into ``~/.sky/python``.
SITE_HOOK_KEY = "sitecustomize.py"
#: The Secret's keys every pod mounts; each pod also mounts its own ``host_key_<rank>`` only.
SHARED_SECRET_KEYS = (
    "authorized_keys",
    "id_ed25519",
    "id_ed25519.pub",
    shell.AGENT_BUNDLE,
    SSHD_CONFIG_KEY,
    SITE_HOOK_KEY,
)
HOST_KEY_PREFIX = "host_key_"

#: How long a pod without sshd may spend installing it (apt-get update and install, or apk,
#: or dnf) before it gives up: with egress that takes seconds; without, apt would wait out its
#: own timeouts (minutes), so a launch could not fail within a minute.
INSTALL_TIMEOUT_S = 40
#: The line BOOTSTRAP prints (then exits 1) when the image has no sshd and none could be
#: installed; the backend turns a pod that failed with it into its one-line error.
NO_SSHD_MARKER = "pytest-sky: image-lacks-sshd:"
#: The fix that error names.
NO_SSHD_FIX = "build examples/kubernetes/Dockerfile, push it and pass --kube-image <that image>"

#: The container's first process (``pytest_sky/shell/pod_bootstrap.sh``): sshd from the Secret's keys.
BOOTSTRAP = (
    shell.script(shell.POD_BOOTSTRAP).replace("__T__", str(INSTALL_TIMEOUT_S)).replace("__MARK__", NO_SSHD_MARKER)
)


def sshd_config_text() -> str:
    """The pods' sshd_config, less its ``SetEnv PATH`` (BOOTSTRAP appends the image's own).

    Every address on port 22 (a pod's IPs are its own); no ``PrintLastLog``, which an image's
    sshd may be built without (it would say so in the pod's log at every start).
    """
    return sshd.render(
        listen="22",
        host_key=f"{RUNTIME_DIR}/ssh_host_ed25519_key",
        pid_file=f"{RUNTIME_DIR}/sshd.pid",
        path_env=None,
        print_last_log=False,
    )


def labels(cluster: str, rank: int | None = None, *, launch: str | None = None) -> dict[str, str]:
    out = {**MANAGED_BY, LABEL_CLUSTER: cluster}
    if launch is not None:
        out[LABEL_LAUNCH] = launch
    if rank is not None:
        out[LABEL_ROLE] = naming.role(rank)
        out[LABEL_RANK] = str(rank)
    return out


def selector(cluster: str, launch: str | None = None) -> str:
    """The cluster's objects; with ``launch``, only those one launch created."""
    return f"{LABEL_CLUSTER}={cluster}" + (f",{LABEL_LAUNCH}={launch}" if launch is not None else "")


def members(cluster: str, launch: str) -> dict[str, str]:
    """The match labels of one launch's pods (the Service's selector, the spread's)."""
    return {LABEL_CLUSTER: cluster, LABEL_LAUNCH: launch}


pod_name = naming.node_hostname  # a pod's name is its node's hostname


def secret_name(cluster: str) -> str:
    return f"{cluster}-ssh"


def metadata(name: str, namespace: str, object_labels: dict[str, str], owner: dict | None) -> dict:
    """An object's metadata; ``owner``: its ownerReference (the cluster's Lease, ``kube_lease``)."""
    meta: dict = {"name": name, "namespace": namespace, "labels": object_labels}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta


def secret(cluster: str, namespace: str, files: dict[str, bytes], *, launch: str, owner: dict | None = None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(secret_name(cluster), namespace, labels(cluster, launch=launch), owner),
        "type": "Opaque",
        "data": {key: base64.b64encode(value).decode() for key, value in sorted(files.items())},
    }


def service(cluster: str, namespace: str, *, launch: str, owner: dict | None = None) -> dict:
    """Headless: pod hostname + subdomain resolve (torch's c10d store needs node names).
    Its members are this launch's pods only, never another pod with the cluster's label."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(cluster, namespace, labels(cluster, launch=launch), owner),
        "spec": {
            "clusterIP": "None",
            "selector": members(cluster, launch),
            "ports": [{"name": "ssh", "port": 22, "targetPort": 22, "protocol": "TCP"}],
            "publishNotReadyAddresses": True,
        },
    }


def _quantity(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{int(value * 1000)}m"


def container_resources(resources: Resources, with_limits: bool = False) -> dict:
    """Requests from the task (``cpus``, ``memory``) or the defaults; limits only for GPUs,
    unless ``with_limits``: then CPU and memory limits equal the requests.

    No limits by default: a CPU limit throttles a test at its request even on an idle node,
    and a memory limit turns a small default into an OOM kill.  A namespace whose
    ResourceQuota counts ``limits.cpu``/``limits.memory`` (or a LimitRange of type Pod with a
    ``max``) rejects a pod without them; the backend then sends them equal to the requests
    (the smallest quota charge, and the ratio 1 any ``maxLimitRequestRatio`` allows).
    """
    cpus = resources.cpus if resources.cpus is not None else DEFAULT_CPUS
    memory = resources.memory if resources.memory is not None else DEFAULT_MEMORY_GB
    requests = {"cpu": _quantity(cpus), "memory": f"{math.ceil(memory * 1024)}Mi"}
    limits: dict[str, str] = dict(requests) if with_limits else {}
    if resources.accelerators is not None:
        # Kubernetes hands out whole devices: a share (V100:0.5) asks for one.
        gpus = str(resources.accelerators.per_node_ceiling())
        requests["nvidia.com/gpu"] = gpus
        limits["nvidia.com/gpu"] = gpus
    out: dict = {"requests": requests}
    if limits:
        out["limits"] = limits
    return out


def host_key(rank: int) -> str:
    return f"{HOST_KEY_PREFIX}{rank}"


def secret_items(rank: int, keys: Iterable[str] | None = None) -> list[dict]:
    """The Secret's keys pod ``rank`` mounts: every shared one and its own host key, never a
    peer's (a pod that could read every host key could impersonate any node to the others).
    ``keys`` are the Secret's keys (default: :data:`SHARED_SECRET_KEYS` and the host keys)."""
    keys = SHARED_SECRET_KEYS if keys is None else tuple(keys)
    own = host_key(rank)
    wanted = sorted({k for k in keys if not k.startswith(HOST_KEY_PREFIX)} | {own})
    return [{"key": k, "path": k} for k in wanted]


def secret_volume(cluster: str, rank: int, keys: Iterable[str] | None = None) -> dict:
    items = secret_items(rank, keys)
    return {"name": "ssh-keys", "secret": {"secretName": secret_name(cluster), "defaultMode": 0o400, "items": items}}


@dataclass(frozen=True)
class SharedVolume:
    """The cluster's shared directory on Kubernetes: a directory of its own (``subPath``, the
    cluster's name) in a ReadWriteMany claim, mounted at ``path`` in every pod."""

    claim: str
    path: str


@dataclass(frozen=True)
class Placement:
    """What the namespace and the nodes ask of a pod beyond the task: limits (the namespace
    demands them) and the GPU product's node label (the task names a GPU type)."""

    with_limits: bool = False
    gpu: GpuSelector | None = None


@dataclass(frozen=True)
class Lifetime:
    """What bounds a pod's life without its owner: the cluster's Lease as its owner (its
    ownerReference), and ``activeDeadlineSeconds`` (None: no deadline)."""

    owner: dict | None = None
    deadline: int | None = None


def spread(cluster: str, launch: str) -> dict:
    """Soft anti-affinity among one launch's pods: spread over machines when they fit, share
    one when not.  Another pod with the cluster's label is not a reason to move."""
    term = {"labelSelector": {"matchLabels": members(cluster, launch)}, "topologyKey": "kubernetes.io/hostname"}
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]
        }
    }


def pod(
    cluster: str,
    rank: int,
    namespace: str,
    image: str,
    resources: Resources,
    shared: SharedVolume | None = None,
    secret_keys: Iterable[str] | None = None,
    placement: Placement | None = None,
    *,
    launch: str,
    asked: privileges.Privileges = privileges.NONE_ASKED,
    lifetime: Lifetime | None = None,
) -> dict:
    """Pod ``rank``; ``secret_keys`` are the keys of the cluster's Secret (see :func:`secret_items`).

    No ServiceAccount token is mounted (``automountServiceAccountToken: false``): nothing in
    a node talks to the API server, so a task never holds credentials it was not given."""
    placement = placement or Placement()
    lifetime = lifetime or Lifetime()
    spec: dict = {
        "hostname": pod_name(cluster, rank),
        "subdomain": cluster,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 5,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": privileges.pod_security_context(),
        "affinity": spread(cluster, launch),
        "containers": [
            {
                "name": "node",
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", BOOTSTRAP],
                "env": [{"name": shell.POD_RANK_VAR, "value": str(rank)}],
                "ports": [{"name": "ssh", "containerPort": 22, "protocol": "TCP"}],
                "resources": container_resources(resources, placement.with_limits),
                "securityContext": privileges.container_security_context(asked),
                "volumeMounts": [{"name": "ssh-keys", "mountPath": SECRET_MOUNT, "readOnly": True}],
            }
        ],
        "volumes": [secret_volume(cluster, rank, secret_keys)],
    }
    if placement.gpu is not None:
        spec["affinity"]["nodeAffinity"] = node_affinity(placement.gpu)
    if resources.accelerators is not None:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    if shared is not None:
        spec["volumes"].append({"name": "shared", "persistentVolumeClaim": {"claimName": shared.claim}})
        spec["containers"][0]["volumeMounts"].append({"name": "shared", "mountPath": shared.path, "subPath": cluster})
    if lifetime.deadline is not None:
        spec["activeDeadlineSeconds"] = lifetime.deadline
    meta = metadata(pod_name(cluster, rank), namespace, labels(cluster, rank, launch=launch), lifetime.owner)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
