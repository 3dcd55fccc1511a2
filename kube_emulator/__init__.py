"""A Kubernetes API emulator for testing the kubernetes backend without a cluster.

It speaks the subset of the REST API the backend uses (pods, secrets, services, nodes,
events, namespaces; get/list/watch/create/delete with selectors; exec; port-forward; logs)
to the official client through a generated kubeconfig, and runs every pod as a namespace
node of the local backend.  Layout:

- ``server.py``: HTTP paths, auth, watches, logs, the admin endpoint; ``EmulatorServer``
  (async core) and ``Emulator`` (in-process, background thread).
- ``cluster.py``: API semantics (defaulting, validation, deletion), events, scheduler loop.
- ``scheduler.py``: resource fit, taints, node selectors, pod anti-affinity.
- ``admission.py``: LimitRanger, Pod Security and ResourceQuota admission of pods.
- ``kubelet.py``: pods as namespace nodes, secret volumes, /etc/hosts and /etc/resolv.conf,
  exec/port-forward plumbing, reaping a SIGKILLed emulator's leftovers.
- ``dns.py``: the cluster's DNS server (what CoreDNS's kubernetes plugin answers).
- ``images.py``: images as views of this machine's tree with named paths absent.
- ``streams.py``: the exec and port-forward WebSocket channel protocols.
- ``store.py``: objects, resourceVersions and watch fan-out.
- ``rbac.py``: Role-shaped rules per token, matched as the real RBAC authorizer matches
  them, with the exec/port-forward websocket verbs of the chosen Kubernetes version.
- ``selectors.py``, ``faults.py``: label/field selectors; injected faults.

- ``product.py``: the one module that imports ``pytest_sky``; what the emulator borrows from
  the plugin (the node primitive, links, a pod's privileges, passwd, its errors) is named there.

Run it as a process with ``python -m kube_emulator --kubeconfig PATH``.

Layers, lowest first; a module imports only from its own layer or lower ones (and never in
a circle), which ``tests/test_layering.py`` checks, as it does for ``pytest_sky``:

0. product, selectors, faults, images, rbac: leaves, importing nothing of the emulator's
1. store, scheduler: objects and watches; where a pod fits
2. admission, dns: what the API server admits and what the cluster's DNS answers
3. kubelet: pods as nodes, below the cluster it serves (``kubelet.PodHost``)
4. cluster: the API semantics
5. streams, server: the wire
6. kube_emulator, __main__: the ways in
"""

from __future__ import annotations

from kube_emulator.cluster import ClusterConfig
from kube_emulator.faults import Faults
from kube_emulator.server import (
    BAD_TOKEN,
    CONTEXT,
    NOBODY_TOKEN,
    READONLY_TOKEN,
    ROLE_CONTEXT,
    ROLE_TOKEN,
    ROLE_USER,
    SHIPPED_ROLE,
    Emulator,
    EmulatorServer,
    default_state_dir,
)

__all__ = [
    "BAD_TOKEN",
    "CONTEXT",
    "NOBODY_TOKEN",
    "READONLY_TOKEN",
    "ROLE_CONTEXT",
    "ROLE_TOKEN",
    "ROLE_USER",
    "SHIPPED_ROLE",
    "ClusterConfig",
    "Emulator",
    "EmulatorServer",
    "Faults",
    "default_state_dir",
]
