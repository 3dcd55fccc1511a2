"""The emulated control plane: API semantics over the store, with the scheduler and kubelet it drives.

What a real API server does between the HTTP layer and etcd (generic create, read, update,
patch and delete with the same 422/409/404 answers, graceful pod deletion, namespace
finalization, label-selected collection deletes), calling on its collaborators for the rest:
``validation.py`` (checks and defaults of a new object), ``admission.py`` (pods' admission
plugins), ``events.py``, ``scheduling.py`` (the scheduler's loop), ``nodes.py`` (the Node
objects) and ``kubelet.py`` (running pods).  No HTTP here (``server.py``) and no processes:
everything runs on the event loop thread, so nothing needs a lock.
"""

from __future__ import annotations

import asyncio
import copy
import ipaddress
from pathlib import Path
from typing import Any

from kube_emulator import admission, rbac_objects, store, validation
from kube_emulator.api import RESOURCES, ApiError, already_exists, check_preconditions, invalid, not_found
from kube_emulator.config import ClusterConfig
from kube_emulator.dns import DnsServer
from kube_emulator.events import EventRecorder
from kube_emulator.faults import Faults
from kube_emulator.garbage import POLICIES, GarbageCollector
from kube_emulator.kubelet import Kubelet
from kube_emulator.nodes import node_object
from kube_emulator.patches import json_patch, merge_patch
from kube_emulator.scheduling import SchedulerLoop
from kube_emulator.selectors import FieldSelector, LabelSelector
from kube_emulator.store import Obj, Store, random_suffix


class Cluster:
    """API semantics of one emulated cluster, over its store, scheduler loop and kubelet."""

    def __init__(self, config: ClusterConfig, faults: Faults, instance_dir: Path) -> None:
        self.config = config
        self.faults = faults
        self.store = Store()
        self.events = EventRecorder(self.store)
        self.kubelet = Kubelet(self, instance_dir, mtu=config.mtu)
        self.scheduler = SchedulerLoop(self.store, faults, self.events, self.kubelet.bind)
        self.dns = DnsServer(self.store)
        self.gc = GarbageCollector(self)
        self.instance_dir = instance_dir
        self._service_ips = 10
        self.portforwards: set[Any] = set()  # open port-forward sessions (drop on demand)
        self.ca_pem = b""  # the cluster's CA, in every projected ServiceAccount volume (the server's)

    # -- life -------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.kubelet.start)
        await self.dns.start(self.kubelet.network.host_ip)  # on the bridge: the pods' nameserver
        self.gc.start()
        for ns in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self._create_namespace({"metadata": {"name": ns}})
        if self.config.policies:
            self.default_policies()
        for claim in self.config.shared_claims:
            spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}
            self.create("persistentvolumeclaims", "default", {"metadata": {"name": claim}, "spec": spec})
        for i in range(self.config.nodes):
            self.store.create(
                "nodes", node_object(self.config, i, self.kubelet.network.subnet, self.kubelet.network.host_ip)
            )
        self.scheduler.start()

    async def shutdown(self) -> None:
        self.scheduler.stop()
        self.store.close_watches()
        await self.dns.stop()
        await self.kubelet.shutdown()

    def default_policies(self) -> None:
        """What an administrator commonly sets on a shared namespace (``admission.default_policies``)."""

        def label(ns: Obj) -> None:
            ns["metadata"]["labels"][admission.ENFORCE_LABEL] = "baseline"

        self.store.modify("namespaces", "", "default", label)
        for resource, obj in admission.default_policies(self.config):
            self.create(resource, "default", obj)

    # -- generic API operations -------------------------------------------------------------

    def namespace_active(self, namespace: str) -> None:
        ns = self.store.get("namespaces", "", namespace)
        if ns is None:
            raise not_found("namespaces", namespace)
        if ns.get("status", {}).get("phase") == "Terminating":
            raise ApiError(
                403,
                "Forbidden",
                f"unable to create new content in namespace {namespace} because it is being terminated",
                {"name": namespace, "kind": "namespaces"},
            )

    def get(self, resource: str, namespace: str, name: str) -> Obj:
        obj = self.store.get(resource, namespace, name)
        if obj is None:
            raise not_found(resource, name)
        return obj

    def list(self, resource: str, namespace: str | None, labels: LabelSelector, fields: FieldSelector) -> list[Obj]:
        return [
            o
            for o in self.store.items(resource, namespace)
            if labels.matches(o["metadata"].get("labels")) and fields.matches(o)
        ]

    def create(self, resource: str, namespace: str, body: Any) -> Obj:
        info = RESOURCES[resource]
        if not isinstance(body, dict):
            raise ApiError(
                400,
                "BadRequest",
                "the body of the request was in an unknown format - accepted media types include: "
                "application/json, application/yaml",
            )
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {}) or {}
        obj["metadata"] = meta
        if info.namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on the request",
                )
            meta["namespace"] = namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + random_suffix()
        if not meta.get("name"):
            raise invalid(info.kind, "", [("metadata.name", "Required value: name or generateName is required")])
        for key in ("uid", "resourceVersion", "creationTimestamp", "deletionTimestamp"):
            meta.pop(key, None)
        if resource != "events":
            obj.pop("status", None)
        obj["kind"], obj["apiVersion"] = info.kind, info.api_version
        if resource == "namespaces":
            errors = validation.dns_errors(meta["name"], "metadata.name", "label")
            errors += validation.label_errors(meta.get("labels"), "metadata.labels")
            if errors:
                raise invalid(info.kind, meta["name"], errors)
            if self.store.get("namespaces", "", meta["name"]):
                raise already_exists("namespaces", meta["name"])
            return self._create_namespace(obj)
        self.namespace_active(namespace)
        if self.store.get(resource, namespace, meta["name"]) is not None:
            raise already_exists(resource, meta["name"])
        owner_errors = validation.owner_reference_errors(meta)
        if owner_errors:
            raise invalid(info.kind, meta["name"], owner_errors)
        if resource == "pods":
            admission.limit_ranger_mutate(obj, self.store.items("limitranges", namespace))
            admission.mount_service_account_token(obj, lambda name: self.store.get("serviceaccounts", namespace, name))
        self._prepare(resource, obj)
        if resource == "pods":
            self._admit_pod(obj, namespace)
        created = self.store.create(resource, obj)
        if resource == "pods":
            self.scheduler.enqueue(created)
        return created

    def _prepare(self, resource: str, obj: Obj) -> None:
        """Validate and default a new object of ``resource``, as its registry strategy does."""
        if resource == "pods":
            validation.prepare_pod(obj)
        elif resource == "secrets":
            validation.prepare_secret(obj)
        elif resource == "services":
            validation.prepare_service(obj, self._allocate_service_ip)
        elif resource == "persistentvolumeclaims":
            validation.prepare_claim(obj)
        elif resource == "leases":
            validation.prepare_lease(obj)
        elif resource == "limitranges":
            admission.default_limit_range(obj)
        elif resource in rbac_objects.KINDS:
            rbac_objects.prepare(resource, obj)
        elif resource == "resourcequotas":
            hard = dict((obj.get("spec") or {}).get("hard") or {})
            used = admission.quota_used(obj, self.store.items("pods", obj["metadata"]["namespace"]))
            shown = {k: admission.format_quantity(v, k.endswith("memory")) for k, v in used.items()}
            obj["status"] = {"hard": hard, "used": shown}

    def _allocate_service_ip(self) -> str:
        self._service_ips += 1
        return str(ipaddress.IPv4Address("10.96.0.0") + self._service_ips)

    def _create_namespace(self, obj: Obj) -> Obj:
        meta = obj.setdefault("metadata", {})
        obj["kind"], obj["apiVersion"] = "Namespace", "v1"
        meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
        obj["spec"] = {"finalizers": ["kubernetes"]}
        obj["status"] = {"phase": "Active"}
        return self.store.create("namespaces", obj)

    def delete(self, resource: str, namespace: str, name: str, options: dict[str, Any] | None = None) -> Obj:
        """Delete one object; the answer is what a real server returns for that resource."""
        obj = self.get(resource, namespace, name)
        if resource == "nodes":
            raise ApiError(405, "MethodNotAllowed", "the emulator's nodes cannot be deleted")
        check_preconditions(resource, obj, (options or {}).get("preconditions") or {})
        policy = (options or {}).get("propagationPolicy")
        if policy not in (None, *POLICIES):
            raise invalid(
                "DeleteOptions",
                "",
                [
                    (
                        "propagationPolicy",
                        f'Unsupported value: "{policy}": supported values: "Foreground", "Background", "Orphan", "nil"',
                    )
                ],
            )
        uid = obj["metadata"]["uid"]
        if policy == "Orphan":
            self.gc.orphan(namespace, uid)
        if resource == "pods":
            return self._delete_pod(obj, options or {})
        if resource == "namespaces":
            return self._delete_namespace(obj)
        if policy == "Foreground" and self.gc.blocking(namespace, uid):
            return self.gc.mark_foreground(resource, namespace, name) or obj
        gone = self.store.delete(resource, namespace, name)
        assert gone is not None
        if resource == "services":
            return gone
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": {"name": name, "kind": resource, "uid": gone["metadata"]["uid"]},
        }

    def delete_collection(
        self,
        resource: str,
        namespace: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
        options: dict[str, Any] | None,
    ) -> Obj:
        info = RESOURCES[resource]
        deleted = []
        for obj in self.list(resource, namespace, labels, fields):
            meta = obj["metadata"]
            result = self.delete(resource, meta.get("namespace", ""), meta["name"], options)
            deleted.append(result if result.get("kind") != "Status" else copy.deepcopy(obj))
        for item in deleted:
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return {
            "kind": f"{info.kind}List",
            "apiVersion": info.api_version,
            "metadata": {"resourceVersion": str(self.store.rv)},
            "items": deleted,
        }

    def replace(self, resource: str, namespace: str, name: str, body: Any) -> Obj:
        current = self.get(resource, namespace, name)
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of the request was in an unknown format")
        meta = body.get("metadata") or {}
        if meta.get("name") not in (None, name):
            raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
        rv = meta.get("resourceVersion")
        if rv and rv != current["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {resource} "{name}": the object has been modified; '
                "please apply your changes to the latest version and try again",
                {"name": name, "kind": resource},
            )
        return self._write(resource, current, copy.deepcopy(body))

    def patch(self, resource: str, namespace: str, name: str, patch: Any, content_type: str) -> Obj:
        current = self.get(resource, namespace, name)
        new = copy.deepcopy(current)
        if "json-patch" in content_type:
            if not isinstance(patch, list):
                raise ApiError(400, "BadRequest", "json patch must be a list of operations")
            new = json_patch(new, patch)
        else:
            if not isinstance(patch, dict):
                raise ApiError(400, "BadRequest", "merge patch must be a JSON object")
            new = merge_patch(new, patch)
        return self._write(resource, current, new)

    def _write(self, resource: str, current: Obj, new: Obj) -> Obj:
        info = RESOURCES[resource]
        meta = new.setdefault("metadata", {})
        for key in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp", "resourceVersion"):
            if key in current["metadata"]:
                meta[key] = current["metadata"][key]
        errors = validation.label_errors(meta.get("labels"), "metadata.labels")
        if errors:
            raise invalid(info.kind, meta["name"], errors)
        new["kind"], new["apiVersion"] = info.kind, info.api_version
        if resource in ("pods", "nodes", "namespaces"):
            new["status"] = current.get("status")
        if resource == "pods":
            errors += _deadline_update_errors(current.get("spec") or {}, new.get("spec") or {})
        if resource == "pods" and _without_deadline(new.get("spec")) != _without_deadline(current.get("spec")):
            raise invalid(
                "Pod",
                meta["name"],
                [
                    (
                        "spec",
                        "Forbidden: pod updates may not change fields other than `spec.containers[*].image`, "
                        "`spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, `spec.tolerations` "
                        "(only additions to existing tolerations), `spec.terminationGracePeriodSeconds` (allow it "
                        "to be set to 1 if it was previously negative)",
                    )
                ],
            )
        errors += validation.owner_reference_errors(meta)
        if errors:
            raise invalid(info.kind, meta["name"], errors)
        if resource == "secrets":
            validation.prepare_secret(new)
        if resource == "leases":
            validation.prepare_lease(new)
        if resource in rbac_objects.KINDS:
            rbac_objects.prepare(resource, new, current)
        if resource == "services":
            spec = new.setdefault("spec", {})
            old_ip = (current.get("spec") or {}).get("clusterIP")
            if spec.get("clusterIP") not in (None, "", old_ip):
                raise invalid("Service", meta["name"], [("spec.clusterIP", "Invalid value: field is immutable")])
            spec["clusterIP"] = old_ip
            spec["clusterIPs"] = (current.get("spec") or {}).get("clusterIPs")
        return self.store.update(resource, new)

    # -- pods -------------------------------------------------------------------------------

    def _admit_pod(self, pod: Obj, namespace: str) -> None:
        """The validating admission plugins, in the API server's order: LimitRanger,
        PodSecurity, ResourceQuota (last, so only admitted pods are charged)."""
        errors = admission.limit_ranger_validate(pod, self.store.items("limitranges", namespace))
        if not errors:
            ns = self.store.get("namespaces", "", namespace) or {}
            violation = admission.pod_security(pod, ns)
            errors = [violation] if violation else []
        if not errors:
            pods = list(self.store.items("pods", namespace))
            exceeded = admission.resource_quota(pod, self.store.items("resourcequotas", namespace), pods)
            errors = [exceeded] if exceeded else []
        if errors:
            name = pod["metadata"]["name"]
            text = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
            raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: {text}', {"name": name, "kind": "pods"})

    def _delete_pod(self, pod: Obj, options: dict[str, Any]) -> Obj:
        """Delete a pod as kube-apiserver does (its registry's CheckGracefulDelete, then the
        generic store's graceful deletion): with a grace period it is marked
        (deletionTimestamp) and goes only once its kubelet has stopped its container; with
        none (a force delete, or a pod that never ran or has ended) the object goes at once,
        and its kubelet stops the container later, on its own schedule."""
        meta = pod["metadata"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        self.scheduler.forget(ns, name)
        grace = _grace_period(pod, options)
        running = uid in self.kubelet.runtimes
        current = meta.get("deletionGracePeriodSeconds")
        if meta.get("deletionTimestamp") and grace > 0 and (current is None or grace >= current):
            return pod  # already terminating, at least as soon
        if grace == 0 or not running:
            gone = self.store.delete("pods", ns, name)
            if running:
                self.kubelet.kill(uid, 0)
            else:
                self.kubelet.discard_files(ns, name, uid)
            self.scheduler.trigger()
            self._finish_namespace(ns)
            return gone or pod

        def mark(p: Obj) -> None:
            p["metadata"]["deletionTimestamp"] = store.now()
            p["metadata"]["deletionGracePeriodSeconds"] = grace

        marked = self.store.modify("pods", ns, name, mark)
        self.kubelet.kill(uid, grace)
        return marked or pod

    def pod_stopped_for_deletion(self, namespace: str, name: str, uid: str) -> None:
        """The kubelet stopped a pod being deleted: the object goes (DELETED)."""
        pod = self.store.get("pods", namespace, name)
        if pod is not None and pod["metadata"]["uid"] == uid:
            self.store.delete("pods", namespace, name)
        self._finish_namespace(namespace)

    # -- namespaces -------------------------------------------------------------------------

    def _delete_namespace(self, ns: Obj) -> Obj:
        name = ns["metadata"]["name"]
        if name in ("default", "kube-system", "kube-public"):
            raise ApiError(
                403,
                "Forbidden",
                f'namespaces "{name}" is forbidden: this namespace may not be deleted',
                {"name": name, "kind": "namespaces"},
            )

        def mark(obj: Obj) -> None:
            obj["metadata"]["deletionTimestamp"] = store.now()
            obj["status"]["phase"] = "Terminating"

        marked = self.store.modify("namespaces", "", name, mark)
        for resource in ("services", "secrets", "events", "limitranges", "resourcequotas", "leases"):
            for obj in list(self.store.items(resource, name)):
                self.store.delete(resource, name, obj["metadata"]["name"])
        for pod in list(self.store.items("pods", name)):
            self._delete_pod(pod, {})
        self._finish_namespace(name)
        return marked or ns

    def _finish_namespace(self, name: str) -> None:
        ns = self.store.get("namespaces", "", name)
        if ns is None or ns["status"].get("phase") != "Terminating":
            return
        if next(iter(self.store.items("pods", name)), None) is None:
            self.store.delete("namespaces", "", name)

    def trigger_scheduler(self) -> None:
        self.scheduler.trigger()


def _without_deadline(spec: Any) -> Any:
    return {k: v for k, v in spec.items() if k != "activeDeadlineSeconds"} if isinstance(spec, dict) else spec


def _deadline_update_errors(old: Obj, new: Obj) -> list[tuple[str, str]]:
    """A running pod's ``activeDeadlineSeconds`` may be set or shortened, never lengthened or
    removed (ValidatePodUpdate)."""
    before, after = old.get("activeDeadlineSeconds"), new.get("activeDeadlineSeconds")
    if before is None or (after is not None and after <= before):
        return []
    return [("spec.activeDeadlineSeconds", f"Invalid value: {after}: must be less than or equal to previous value")]


def _grace_period(pod: Obj, options: dict[str, Any]) -> int:
    """A pod's grace period for a delete, as the pod registry's CheckGracefulDelete settles it
    (pkg/registry/core/pod/strategy.go): the request's, else the spec's (default 30); none
    for a pod never scheduled or already ended; a negative one is 1."""
    grace = options.get("gracePeriodSeconds")
    if grace is None:
        grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
    if not pod["spec"].get("nodeName") or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        grace = 0
    return 1 if grace < 0 else int(grace)
