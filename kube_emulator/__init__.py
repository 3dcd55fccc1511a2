"""A Kubernetes API emulator for testing the kubernetes backend without a cluster.

It speaks the subset of the REST API the backend uses (pods, secrets, services, nodes,
events, namespaces; get/list/watch/create/delete with selectors; exec; port-forward; logs),
and what a user runs kubectl for while debugging (Roles and bindings, Tables, OpenAPI),
to the official client through a generated kubeconfig, and runs every pod as a namespace
node of the local backend.  Layout:

- ``server.py``: discovery, auth, the admin endpoint; ``EmulatorServer`` (async core) and
  ``Emulator`` (in-process, background thread).  ``rest.py``: resource paths to cluster
  calls; ``feeds.py``: watches and followed logs; ``streams.py``: the exec and port-forward
  WebSocket channel protocols; ``spdy_portforward.py`` over ``spdy.py``: kubectl's
  port-forward, a SPDY/3.1 session inside a websocket.
- ``cluster.py``: API semantics (create, update, patch, graceful deletion, namespaces), over
  ``api.py`` (resources, Status errors), ``validation.py`` (checks and defaults of a new
  object), ``patches.py``, ``admission.py`` (LimitRanger, Pod Security, ResourceQuota),
  ``events.py``, ``nodes.py`` (the Node objects), ``garbage.py`` (the garbage collector:
  ownerReferences and propagation policies) and ``scheduling.py`` (the scheduler's loop;
  ``scheduler.py`` decides where a pod fits: resources, taints, selectors, anti-affinity).
- ``kubelet.py``: pods as namespace nodes, their lifecycle, restarts and back-off, over
  ``pods.py`` (a pod as the kubelet holds it), ``network.py`` (the bridge and pod addresses),
  ``sandbox.py`` (volumes, /etc/hosts, /etc/resolv.conf, the node spec), ``podstatus.py``,
  ``termination.py`` (stopping a container: a deletion, an active deadline),
  ``podexec.py`` (exec and port-forward into a pod) and ``leftovers.py`` (the record a
  SIGKILLed emulator leaves, and reaping it).
- ``dns.py``: the cluster's DNS server (what CoreDNS's kubernetes plugin answers).
- ``images.py``: images as views of this machine's tree with named paths absent.
- ``store.py``: objects, resourceVersions and watch fan-out.
- ``rbac.py``: Role-shaped rules, matched as the real RBAC authorizer matches them, with the
  exec/port-forward websocket verbs of the chosen Kubernetes version; ``rbac_objects.py``: the
  Roles and bindings a user applies, and what they grant whom.
- ``discovery.py``, ``openapi.py``, ``tables.py``: what kubectl reads before and after a
  request (the resource lists, the OpenAPI v3 documents ``apply`` validates with, the
  columns ``get`` prints).
- ``selectors.py``, ``faults.py``, ``config.py``: label/field selectors; injected faults;
  the cluster's shape.

- ``product.py``: the one module that imports ``pytest_sky``; what the emulator borrows from
  the plugin (the node primitive, links, the node runtime's Confinement, passwd, its errors)
  is named there, and never a policy list: ``runtime.py`` reads a securityContext and
  ``admission.py`` judges one by upstream's sources.

Run it as a process with ``python -m kube_emulator --kubeconfig PATH``.

Layers, lowest first; a module imports only from its own layer or lower ones (and never in
a circle), which ``tests/test_layering.py`` checks, as it does for ``pytest_sky``:

0. product, config, selectors, faults, images, rbac, tls, spdy: leaves, importing nothing of the emulator's
1. store, scheduler, network, leftovers, runtime: objects and watches; where a pod fits; the pods'
   bridge and addresses; the record a killed emulator leaves; what a container holds, by the
   kubelet's and containerd's rules
2. api, patches, validation, admission, events, nodes, dns, scheduling, garbage, access_review, rbac_objects,
   discovery, openapi, tables: what the API server checks, admits and records, the Node objects,
   what the cluster's DNS answers, the scheduler's loop, the garbage collector, the grants of
   the RBAC objects, what discovery and OpenAPI describe, the Tables ``kubectl get`` prints
3. pods, podstatus, sandbox, podexec, pulling, termination: one pod as the kubelet holds it
   (``pods.PodHost`` is the cluster it serves), its status, what its node is made of, the ways
   into it, a pull that fails, how its container is stopped
4. kubelet: pods as nodes, below the cluster it serves
5. cluster: the API semantics
6. spdy_portforward, streams, feeds, rest, server: the wire
7. kube_emulator, __main__: the ways in
"""

from __future__ import annotations

from kube_emulator.config import ClusterConfig
from kube_emulator.faults import Faults
from kube_emulator.server import (
    BAD_TOKEN,
    CONTEXT,
    NOBODY_TOKEN,
    READONLY_TOKEN,
    ROLE_CERT_CONTEXT,
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
    "ROLE_CERT_CONTEXT",
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
