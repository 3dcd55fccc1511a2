"""The Kubernetes backend: a cluster is pods of the current kube context (DESIGN.md section 6).

Pods ``<cluster>-head`` and ``<cluster>-worker<i>`` run sshd from a Secret holding the keys
generated on the client, behind a headless Service so node names resolve.  The client
reaches the head through a ProxyCommand that port-forwards over the API server's websocket
(``pytest_sky.ssh.kube_proxy``); workers are reached through the head.  Waiting watches pod
phases and events, and any failure deletes everything the launch created.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import secrets
import shlex
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_sky import console, naming
from pytest_sky.backends import kube_manifests as manifests
from pytest_sky.backends import kube_policy
from pytest_sky.backends.base import Backend, HomeFiles, NetworkFaults, ProvisionConfig
from pytest_sky.backends.privileges import NONE_ASKED, Privileges
from pytest_sky.cluster_info import ClusterInfo, NodeInfo, SshRoute
from pytest_sky.errors import BackendUnavailableError, NotSupportedError, ProvisionError
from pytest_sky.resources import Resources
from pytest_sky.ssh import kube_proxy
from pytest_sky.state import Journal

if TYPE_CHECKING:
    from kubernetes import client as kclient

log = logging.getLogger(__name__)

READY_TIMEOUT = 600.0  # seconds; PYTEST_SKY_KUBE_TIMEOUT (pytest_sky.settings) overrides it
#: Waiting reasons that will not clear by themselves: the launch fails at once, quoting events.
FATAL_WAITING = {
    "ErrImagePull",
    "ImagePullBackOff",
    "CrashLoopBackOff",
    "InvalidImageName",
    "CreateContainerError",
    "CreateContainerConfigError",  # e.g. an env var from a Secret or key that does not exist
    "RunContainerError",  # the runtime could not start the container
}
#: Longest watch before the wait looks at the pods' events (FailedMount has no waiting reason).
WATCH_SLICE = 5


@dataclass(frozen=True)
class ObjectRef:
    """One object a launch creates, by kind and name (in the backend's namespace)."""

    kind: str  # "Pod", "Secret", "Service"
    name: str


def _api_message(exc: BaseException) -> str:
    """The one line for an API refusal, plain or of a websocket (exec, port-forward): an RBAC
    denial names the missing verb and resource and how to grant them (the shipped Role),
    anything else is the server's own message.  Refusals of other kinds get their own
    mapping beside this one, on top of it."""
    return kube_proxy.describe_refusal(exc)


def _is_rbac_denial(exc: BaseException) -> bool:
    return kube_proxy.rbac_line(kube_proxy.refusal_message(exc)) is not None


#: What the API server says when a pod needs limits of its own: a ResourceQuota counts them
#: (403 "failed quota: q: must specify limits.cpu ..."), a LimitRange of type Pod caps them
#: (403 "maximum cpu usage per Pod is 2.  No limit is specified"), or a LimitRange's default
#: limit, filled in for us, is below our request (422 "must be less than or equal to cpu
#: limit of 1").  The backend then sends limits equal to the requests.
_NEEDS_LIMITS = {
    403: re.compile(r"failed quota: .*must specify .*limits\.|No limit is specified"),
    422: re.compile(r"must be less than or equal to (cpu|memory) limit"),
}


def _needs_limits(exc: Exception) -> bool:
    pattern = _NEEDS_LIMITS.get(getattr(exc, "status", None) or 0)
    return pattern is not None and pattern.search(_api_message(exc)) is not None


def _policy_rejection(exc: Exception, namespace: str, asked: Privileges = NONE_ASKED) -> str | None:
    """A pod refused by the namespace's policies rather than by RBAC: the policy named, in one
    line with its fix; None for any other refusal.  ``asked``: what the launch asked for
    beyond a pod's own privileges, which Pod Security may be refusing.

    The API server answers 403 Forbidden for ResourceQuota, LimitRange and PodSecurity alike
    (``pods "x" is forbidden: ...``); only the message tells them apart from a missing RBAC
    verb.  (Limits the namespace merely demands are sent instead: :func:`_needs_limits`.)
    """
    status = getattr(exc, "status", None)
    message = _api_message(exc)
    detail = re.sub(r'^pods "[^"]*" is forbidden: ', "", message).replace("\n", " ")
    where = f"namespace {namespace!r}"
    if status == 403 and "exceeded quota:" in message:
        return (
            f"{where} has used up its ResourceQuota ({detail}): delete pods you no longer need there, ask its "
            "admin for a larger quota, or ask for less (cpus, memory, gpus, num_nodes)"
        )
    if status == 403 and "failed quota:" in message:
        return f"the ResourceQuota of {where} refuses the pods ({detail}): ask its admin which requests it needs"
    if status == 403 and "violates PodSecurity" in message:
        level = re.search(r'PodSecurity "([^"]+)"', message)
        if asked:
            return (
                f"{where} enforces PodSecurity {level.group(1) if level else ''}, which refuses the "
                f"{asked.describe()} the launch asked for ({detail}): launch without them, or use a namespace "
                "labelled pod-security.kubernetes.io/enforce=privileged (--kube-namespace)"
            )
        return (
            f"{where} enforces PodSecurity {level.group(1) if level else ''}, which the pods' sshd cannot meet "
            f"({detail}): use a namespace labelled pod-security.kubernetes.io/enforce=baseline (--kube-namespace)"
        )
    limit_range = re.search(r"(maximum|minimum) \S+ usage per (Container|Pod)|max limit to request ratio", message)
    if status == 403 and limit_range:
        return (
            f"a LimitRange of {where} refuses the pods ({detail}): ask for cpus/memory within its bounds "
            f"(kubectl describe limitrange -n {namespace})"
        )
    return None


class KubernetesBackend(Backend):
    name = "kubernetes"
    cloud_label = "Kubernetes"
    multiplex_client = True
    eager_client_master = True

    def __init__(
        self,
        context: str | None = None,
        namespace: str | None = None,
        image: str | None = None,
        kubeconfig: str | None = None,
        ready_timeout: float = READY_TIMEOUT,
        shared_pvc: str | None = None,
        gpu_label: str | None = None,
    ) -> None:
        self.context = context or None
        self.requested_namespace = namespace or None
        self.image = image or manifests.DEFAULT_IMAGE
        # KUBECONFIG is Kubernetes' own convention, read as kubectl reads it.
        self.kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or None
        self.ready_timeout = ready_timeout
        self.shared_pvc = shared_pvc or None
        self.gpu_label = gpu_label or None
        self._gpu: kube_policy.GpuSelector | None = None
        self._api: kclient.CoreV1Api | None = None
        self._cfg: object = None
        self.namespace = self.requested_namespace or "default"
        self.in_cluster = False
        self._gpus_unseen = ""

    # -- connection ------------------------------------------------------------------------

    def api(self) -> kclient.CoreV1Api:
        if self._api is not None:
            return self._api
        from kubernetes import client, config

        cfg = client.Configuration()
        path = self.kubeconfig or os.path.expanduser("~/.kube/config")
        if os.path.exists(path.split(os.pathsep)[0]):
            try:
                contexts, current = config.list_kube_config_contexts(config_file=path)
            except config.ConfigException as exc:
                raise BackendUnavailableError(f"cannot read kubeconfig {path}: {exc}") from None
            names = [c["name"] for c in contexts]
            if self.context and self.context not in names:
                raise BackendUnavailableError(
                    f"kube context {self.context!r} is not in {path} (contexts: {', '.join(names) or 'none'}); "
                    "pass --kube-context with one of them"
                )
            ctx = next(c for c in contexts if c["name"] == (self.context or current["name"]))
            self.context = ctx["name"]
            if not self.requested_namespace:
                self.namespace = ctx.get("context", {}).get("namespace") or "default"
            kube_proxy.load_kube_config(cfg, path, self.context)  # exec plugins' credentials cached
            self.kubeconfig = path
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=cfg)
            self.in_cluster = True
            self.context = "in-cluster"
            if not self.requested_namespace:
                try:
                    with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
                        self.namespace = f.read().strip() or "default"
                except OSError:
                    pass
        else:
            raise BackendUnavailableError(
                f"no Kubernetes configuration: {path} does not exist and this is not a pod; "
                "set KUBECONFIG or run `kubectl config use-context ...`"
            )
        self._cfg = cfg
        self._api = client.CoreV1Api(client.ApiClient(cfg))
        return self._api

    def stream_api(self) -> kclient.CoreV1Api:
        """A client of its own for each exec or port-forward: the client's ``stream`` swaps its
        ApiClient's request function while it runs, which breaks any other call sharing it."""
        from kubernetes import client

        self.api()
        return client.CoreV1Api(client.ApiClient(self._cfg))

    def plan(self, name: str, num_nodes: int, resources: Resources, shared_dir: str | None = None) -> None:
        from kubernetes.client.exceptions import ApiException

        if shared_dir and not self.shared_pvc:
            raise BackendUnavailableError(
                f"shared_dir={shared_dir} on Kubernetes needs a ReadWriteMany PersistentVolumeClaim: "
                "pass --kube-shared-pvc NAME (or set PYTEST_SKY_KUBE_SHARED_PVC)"
            )

        api = self.api()
        try:
            api.read_namespace(self.namespace, _request_timeout=30)
        except ApiException as exc:
            if exc.status == 404:
                raise BackendUnavailableError(
                    f"namespace {self.namespace!r} does not exist in kube context {self.context!r}; "
                    "create it or pass --kube-namespace"
                ) from None
            if exc.status not in (401, 403):  # may not list namespaces, yet run pods: try
                raise BackendUnavailableError(f"kube context {self.context!r}: {_api_message(exc)}") from None
            if exc.status == 401:
                raise BackendUnavailableError(
                    f"kube context {self.context!r} is not authorised (401): check its credentials"
                ) from None
        except Exception as exc:  # noqa: BLE001 - connection errors come as urllib3 exceptions
            raise BackendUnavailableError(
                f"cannot reach the API server of kube context {self.context!r}: {str(exc).splitlines()[0][:200]}"
            ) from None
        if shared_dir:
            self._check_claim(shared_dir)

    def _check_claim(self, shared_dir: str) -> None:
        """The shared directory's claim exists here and many pods may write to it at once."""
        from kubernetes.client.exceptions import ApiException

        try:
            claim = self.api().read_namespaced_persistent_volume_claim(self.shared_pvc, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise BackendUnavailableError(
                    f"shared_dir={shared_dir}: no PersistentVolumeClaim {self.shared_pvc!r} in namespace "
                    f"{self.namespace!r}; create it (ReadWriteMany) or pass another --kube-shared-pvc"
                ) from None
            raise BackendUnavailableError(f"shared_dir={shared_dir}: {_api_message(exc)}") from None
        modes = (claim.status.access_modes if claim.status else None) or claim.spec.access_modes or []
        if "ReadWriteMany" not in modes:
            shown = ", ".join(modes) or "unbound"
            raise BackendUnavailableError(
                f"shared_dir={shared_dir}: PersistentVolumeClaim {self.shared_pvc!r} is {shown}, "
                "not ReadWriteMany: every node must mount it at once"
            )

    def effective(self, resources: Resources) -> Resources:
        import dataclasses

        return dataclasses.replace(
            resources,
            cpus=resources.cpus if resources.cpus is not None else manifests.DEFAULT_CPUS,
            memory=resources.memory if resources.memory is not None else manifests.DEFAULT_MEMORY_GB,
        )

    def has_gpus(self) -> bool:
        """Any node with allocatable nvidia.com/gpu.  A context that may not list nodes (a
        namespaced Role cannot grant it) sees none: GPU tests then skip, saying so, rather
        than fail on a cluster that may have no GPU at all."""
        from kubernetes.client.exceptions import ApiException

        try:
            nodes = self.api().list_node(_request_timeout=30).items
        except ApiException as exc:
            self._gpus_unseen = (
                f"kube context {self.context!r} may not list nodes ({exc.status} {exc.reason}), so no GPU "
                "is visible: grant list on nodes (a ClusterRole) to run GPU tests"
            )
            return False
        return any(int((n.status.allocatable or {}).get("nvidia.com/gpu", "0") or 0) > 0 for n in nodes)

    def gpus_unseen(self) -> str:
        return self._gpus_unseen or super().gpus_unseen()

    # -- lifecycle -------------------------------------------------------------------------

    def create(self, config: ProvisionConfig) -> ClusterInfo:
        from kubernetes.client.exceptions import ApiException

        self.api()  # the context's namespace, before anything is written
        name, ns = config.name, self.namespace
        journal = config.journal
        launch = secrets.token_hex(8)
        journal.update(
            context=self.context,
            namespace=ns,
            kubeconfig=self.kubeconfig,
            image=self.image,
            launch=launch,
            pods=[manifests.pod_name(name, r) for r in range(config.num_nodes)],
            shared_dir=config.shared_dir,
        )
        try:
            self._create_objects(config, launch)
        except BaseException:
            self._cleanup(name, journal)
            raise
        try:
            pods = [manifests.pod_name(name, r) for r in range(config.num_nodes)]
            ips = self._wait_running(manifests.selector(name, launch), pods)
            self._wait_banners(pods)
            return ClusterInfo(
                nodes=tuple(self._node_info(name, r, ip) for r, ip in enumerate(ips)),
                python="python3",
                cloud="kubernetes",
                region=self.context,
                zone=ns,
            )
        except ApiException as exc:  # e.g. no permission to list or watch pods
            self._cleanup(name, journal)
            raise ProvisionError(f"waiting for the pods of {name}: {_api_message(exc)}") from None
        except BaseException:
            self._cleanup(name, journal)
            raise

    def _create_objects(self, config: ProvisionConfig, launch: str) -> None:
        """The Secret, the headless Service and the pods, each labelled with the launch; a
        refusal is one line naming the object refused (see :meth:`_refusal`)."""
        from kubernetes.client.exceptions import ApiException

        api, name, ns = self.api(), config.name, self.namespace
        files = self._secret_files(config)
        shared = manifests.SharedVolume(self.shared_pvc, config.shared_dir) if config.shared_dir else None
        placement = manifests.Placement(gpu=self._gpu_selector(config.resources))
        ref = ObjectRef("Secret", manifests.secret_name(name))
        try:
            api.create_namespaced_secret(ns, manifests.secret(name, ns, files, launch=launch))
            ref = ObjectRef("Service", name)
            api.create_namespaced_service(ns, manifests.service(name, ns, launch=launch))
            specs: list[dict] = []
            for rank in range(config.num_nodes):
                ref = ObjectRef("Pod", manifests.pod_name(name, rank))
                placement, spec = self._create_pod(
                    lambda p, rank=rank: manifests.pod(
                        name,
                        rank,
                        ns,
                        self.image,
                        config.resources,
                        shared,
                        secret_keys=files,
                        placement=p,
                        launch=launch,
                        asked=config.privileges,
                    ),
                    placement,
                )
                specs.append(spec)
            config.journal.update(pod_specs=specs)  # what restart_node sends again, as it was accepted
        except ApiException as exc:
            raise self._refusal(exc, ref, config.privileges) from None

    def _refusal(self, exc: Any, ref: ObjectRef, asked: Privileges) -> ProvisionError:
        """The one line for the API server's refusal to create one of the cluster's objects:
        a name taken by an object that is not ours (409), a namespace policy, RBAC, the rest."""
        where = f"namespace {self.namespace!r} of kube context {self.context!r}"
        if exc.status == 409:
            return ProvisionError(
                f"a {ref.kind} named {ref.name!r} already exists in {where} and is not this launch's "
                f"(left untouched): pick another cluster name (-c NAME), or delete that {ref.kind} if it is yours"
            )
        policy = _policy_rejection(exc, self.namespace, asked)
        if policy is not None:
            return ProvisionError(policy)
        if exc.status == 403:
            return ProvisionError(f"no permission in {where}: {_api_message(exc)}")
        return ProvisionError(f"the API server refused {ref.kind} {ref.name}: {_api_message(exc)}")

    @staticmethod
    def _secret_files(config: ProvisionConfig) -> dict[str, bytes]:
        """Host keys and the cluster key go in the Secret now; files that need pod IPs follow."""
        home = config.home_files
        files = {
            "authorized_keys": home[".ssh/authorized_keys"][0],
            "id_ed25519": home[".ssh/id_ed25519"][0],
            "id_ed25519.pub": home[".ssh/id_ed25519.pub"][0],
            "agent.pyz": home[".sky/agent.pyz"][0],
            manifests.SSHD_CONFIG_KEY: manifests.sshd_config_text().encode(),
        }
        for rank, key in enumerate(config.keys.hosts):
            files[manifests.host_key(rank)] = key.private_openssh
        return files

    def _create_pod(
        self, make: Callable[[manifests.Placement], dict], placement: manifests.Placement
    ) -> tuple[manifests.Placement, dict]:
        """Create the pod ``make`` builds; where the namespace refuses pods without limits, send
        it again with them (and every later pod at once).  The placement the next pod should
        use, and the pod as the API server accepted it.

        Learnt from the refusal rather than by reading the namespace's ResourceQuotas and
        LimitRanges: that needs no Role verbs beyond creating pods, costs one request only
        where limits are demanded, and follows what admission actually enforces (a
        LimitRange default that fills limits in makes them unnecessary).
        """
        import dataclasses

        from kubernetes.client.exceptions import ApiException

        spec = make(placement)
        try:
            self.api().create_namespaced_pod(self.namespace, spec)
            return placement, spec
        except ApiException as exc:
            if placement.with_limits or not _needs_limits(exc):
                raise
        log.info("namespace %s demands limits: sending them equal to the requests", self.namespace)
        placement = dataclasses.replace(placement, with_limits=True)
        spec = make(placement)
        self.api().create_namespaced_pod(self.namespace, spec)
        return placement, spec

    def _gpu_selector(self, resources: Resources) -> kube_policy.GpuSelector | None:
        """The node label that keeps the pods on the GPU type asked for, from the nodes' own
        labels where the context may list nodes (a namespaced Role may not: then by convention)."""
        from kubernetes.client.exceptions import ApiException

        if resources.accelerators is None:
            self._gpu = None
            return None
        try:
            nodes: list | None = [
                dict(n.metadata.labels or {}) for n in self.api().list_node(_request_timeout=30).items
            ]
        except ApiException:
            nodes = None
        self._gpu = kube_policy.gpu_selector(resources.accelerators.name, nodes, self.gpu_label)
        return self._gpu

    def _node_info(self, cluster: str, rank: int, ip: str) -> NodeInfo:
        """The head is reached by port-forward, workers through the head."""
        pod = manifests.pod_name(cluster, rank)
        if rank == 0:
            route = SshRoute(hostname=pod, proxy_command=self.proxy_command(pod))
        else:
            route = SshRoute(hostname=ip, proxy_jump=cluster)
        return NodeInfo(rank=rank, name=naming.node_name(rank), hostname=pod, ip=ip, route=route)

    def put_files(self, name: str, journal: Journal, info: ClusterInfo, files: HomeFiles) -> None:
        """Into every pod at once (a failed launch is removed by its caller, a restart's
        cluster stays as it is for the user to see or take down)."""
        self._install_node_files(list(info.nodes), files)

    def _cleanup(self, name: str, journal: Journal) -> None:
        """Best-effort removal after a failed launch: the launch's own error is the one to show.
        It is ``destroy``: only objects carrying this launch's label go (never one that already
        existed and made the launch fail with a 409)."""
        try:
            self.destroy(name, journal)
        except Exception as exc:  # noqa: BLE001 - e.g. no permission to delete what we could not create
            log.warning("cleanup of %s after a failed launch: %s", name, exc)

    def destroy(self, name: str, journal: Journal) -> None:
        """Delete the launch's own objects, each by name, and wait until its pods are gone.

        Ours means labelled ``pytest-sky/launch=<the journal's id>``; a journal from before
        launch ids (none in it) falls back to the objects named as ours that carry the cluster
        label and ``managed-by: pytest-sky``.  No journal entry of pods: nothing was created.
        """
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        if not journal.load().get("pods"):
            return
        data = self._adopt(journal)
        self.api()
        try:
            owned = self._owned(name, data)
            head = manifests.pod_name(name, 0)
            if data.get("shared_dir") and any(r == ObjectRef("Pod", head) for r, _ in owned):
                self._empty_shared_dir(head, data["shared_dir"])
            pods = {r.name: uid for r, uid in owned if r.kind == "Pod" and self._delete(r, uid)}
            for ref, uid in owned:
                if ref.kind != "Pod":
                    self._delete(ref, uid)
            self._wait_gone(pods, self._ownership_selector(name, data))
        except ApiException as exc:
            raise ProvisionError(f"could not delete {name}'s objects: {_api_message(exc)}") from None
        except HTTPError as exc:  # refused, timed out, no route: the reason, not urllib3's retry story
            reason = str(getattr(exc, "reason", None) or exc).splitlines()[0].rsplit(": ", 1)[-1][:200]
            server = getattr(self._cfg, "host", "")
            raise BackendUnavailableError(
                f"cannot reach the API server of kube context {self.context!r} ({server}): {reason}"
            ) from None

    @staticmethod
    def _ownership_selector(name: str, data: dict) -> str:
        launch = data.get("launch")
        return manifests.selector(name, launch) if launch else manifests.selector(name)

    def _owned(self, name: str, data: dict) -> list[tuple[ObjectRef, str]]:
        """Each object the launch may have made that exists now and is ours, with its uid.

        Read one by one by name (``get``): never a collection, never someone else's object.
        """
        refs = [ObjectRef("Pod", p) for p in data["pods"]]
        refs += [ObjectRef("Secret", manifests.secret_name(name)), ObjectRef("Service", name)]
        owned = ((ref, self._uid_if_ours(ref, name, data)) for ref in refs)
        return [(ref, uid) for ref, uid in owned if uid is not None]

    def _uid_if_ours(self, ref: ObjectRef, name: str, data: dict) -> str | None:
        """The uid of the object ``ref`` names if it exists and this launch made it (its launch
        label; for a record from before launch ids, our cluster and managed-by labels)."""
        from kubernetes.client.exceptions import ApiException

        try:
            obj = self._verbs(ref.kind)[0](ref.name, self.namespace, _request_timeout=30)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        labels = obj.metadata.labels or {}
        launch = data.get("launch")
        if launch:
            mine = labels.get(manifests.LABEL_LAUNCH) == launch
        else:
            mine = labels.get(manifests.LABEL_CLUSTER) == name and all(
                labels.get(k) == v for k, v in manifests.MANAGED_BY.items()
            )
        if not mine:
            log.info("%s %s is not %s's: left alone", ref.kind, ref.name, name)
        return obj.metadata.uid if mine else None

    def _verbs(self, kind: str) -> tuple[Any, Any]:
        api = self.api()
        return {
            "Pod": (api.read_namespaced_pod, api.delete_namespaced_pod),
            "Secret": (api.read_namespaced_secret, api.delete_namespaced_secret),
            "Service": (api.read_namespaced_service, api.delete_namespaced_service),
        }[kind]

    def _delete(self, ref: ObjectRef, uid: str, grace_period: int | None = None) -> bool:
        """Delete one object if it is still the one we read (a uid precondition: a same-named
        replacement made since is never hit).  Pods get their own grace period (the spec's
        ``terminationGracePeriodSeconds``) unless ``grace_period`` is given: 0 is a force
        delete on a real API server, which only a simulated crash asks for.
        False when it was gone or replaced already."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        options = client.V1DeleteOptions(
            grace_period_seconds=grace_period, preconditions=client.V1Preconditions(uid=uid)
        )
        try:
            self._verbs(ref.kind)[1](ref.name, self.namespace, body=options, _request_timeout=30)
        except ApiException as exc:
            if exc.status in (404, 409):  # gone, or a new object of that name: not ours
                return False
            raise
        return True

    def _wait_gone(self, pods: dict[str, str], sel: str, timeout: float = 120) -> list[str]:
        """Deleted pods linger while they terminate: "down" means gone, so list the pods of
        ``sel`` and watch for the DELETED event of each (by uid) until none is left.  Returns
        those still there at the deadline (logged)."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        api = self.api()
        deadline = time.monotonic() + timeout
        while True:
            listing = api.list_namespaced_pod(self.namespace, label_selector=sel, _request_timeout=30)
            present = {p.metadata.uid for p in listing.items}
            pods = {n: u for n, u in pods.items() if u in present}
            left = deadline - time.monotonic()
            if not pods or left <= 0:
                break
            w = watch.Watch()
            try:
                for event in w.stream(
                    api.list_namespaced_pod,
                    self.namespace,
                    label_selector=sel,
                    resource_version=listing.metadata.resource_version,
                    timeout_seconds=max(1, int(min(left, 30))),
                ):
                    if (
                        event["type"] == "DELETED"
                        and pods.get(event["object"].metadata.name) == event["object"].metadata.uid
                    ):
                        del pods[event["object"].metadata.name]
                        if not pods:
                            w.stop()
            except ApiException as exc:
                if exc.status != 410:  # 410 Gone: the list above is re-read
                    raise
        if pods:
            log.warning("pods of %s are still terminating after %.0f s: %s", sel, timeout, ", ".join(sorted(pods)))
        return sorted(pods)

    def leftovers(self, name: str, journal: Journal) -> str:
        """Where this cluster's objects may still be, for a record forgotten without them."""
        data = journal.load()
        if not data.get("pods"):
            return "nothing: no object was created"
        ns = data.get("namespace") or self.namespace
        objects = [f"pod/{p}" for p in data["pods"]] + [f"secret/{manifests.secret_name(name)}", f"service/{name}"]
        launch = data.get("launch")
        sel = f"{manifests.LABEL_LAUNCH}={launch}" if launch else manifests.selector(name)
        return (
            f"kube context {data.get('context')!r}, namespace {ns!r}: {' '.join(objects)} "
            f"(remove them with `kubectl --context {data.get('context')} delete pod,secret,service -n {ns} -l {sel}`)"
        )

    def _empty_shared_dir(self, head: str, path: str) -> None:
        """The cluster's directory in the shared claim goes with the cluster: emptied from the
        head while it still runs (the claim and its other clusters' directories stay)."""
        try:
            code, out = self.exec(head, ["/bin/sh", "-c", f"find {shlex.quote(path)} -mindepth 1 -delete"], timeout=60)
        except Exception as exc:  # noqa: BLE001 - a head already gone has nothing to empty from
            log.warning("could not empty %s's shared directory: %s", head, exc)
            return
        if code != 0:
            log.warning("could not empty %s's shared directory: %s", head, out.strip()[-200:])

    def orphans(self) -> list[str]:
        """Cluster names that have pods here (the reaper compares them with its records)."""
        pods = self.api().list_namespaced_pod(self.namespace, label_selector="app.kubernetes.io/managed-by=pytest-sky")
        return sorted({p.metadata.labels.get(manifests.LABEL_CLUSTER, "") for p in pods.items} - {""})

    def proxy_command(self, pod: str) -> str:
        argv = [sys.executable, "-m", "pytest_sky.ssh.kube_proxy", "--namespace", self.namespace, "--pod", pod]
        if self.kubeconfig:
            argv += ["--kubeconfig", self.kubeconfig]
        if self.context and self.context != "in-cluster":
            argv += ["--context", self.context]
        return shlex.join(argv)

    # -- waiting ---------------------------------------------------------------------------

    def _wait_running(self, sel: str, names: list[str]) -> list[str]:
        """List, then watch the pods of ``sel`` (one launch's: another pod with the cluster's
        label is not ours) until each of ``names`` runs (every pod at a launch, the recreated
        one at a restart), their IPs in order; fail fast on what never will: a fatal waiting
        reason, a volume that cannot mount, a pod deleted under us.

        A watch started with ``timeout_seconds`` gets no 410-Gone retry from the client (an
        expired resourceVersion raises ApiException(410)): the wait re-lists and resumes."""
        from kubernetes.client.exceptions import ApiException

        api = self.api()
        deadline = time.monotonic() + self.ready_timeout
        ips: dict[str, str] = {}
        num_nodes = len(names)
        while True:
            listing = api.list_namespaced_pod(self.namespace, label_selector=sel)
            pods = [p for p in listing.items if p.metadata.name in names]
            listed = {p.metadata.name for p in pods}
            for name in names:
                if name not in listed:
                    raise self._deleted(name)
            for p in pods:
                self._note_pod(p, ips)
            console.counter("pods running", len(ips), num_nodes)
            if len(ips) == num_nodes:
                return [ips[n] for n in names]
            self._check_mounts({p.metadata.name: p.metadata.uid for p in pods if p.metadata.name not in ips})
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = [n for n in names if n not in ips]
                raise ProvisionError(
                    f"pods not running after {self.ready_timeout:.0f} s: {', '.join(waiting)}"
                    f"{self._events_suffix(waiting[0])}"
                )
            try:
                self._watch_pods(sel, listing.metadata.resource_version, min(left, WATCH_SLICE), ips, names)
            except ApiException as exc:
                if exc.status != 410:
                    raise
                log.debug("watch of the pods of %s expired (410): listing again", sel)
            if len(ips) == num_nodes:
                return [ips[n] for n in names]

    def _watch_pods(self, sel: str, version: str, seconds: float, ips: dict[str, str], names: list[str]) -> None:
        """One watch of the pods of ``sel`` from ``version``, for at most ``seconds``, or until
        each of ``names`` runs."""
        from kubernetes import watch

        w = watch.Watch()
        for event in w.stream(
            self.api().list_namespaced_pod,
            self.namespace,
            label_selector=sel,
            resource_version=version,
            timeout_seconds=max(1, int(seconds)),
        ):
            p = event["object"]
            if p.metadata.name not in names:
                continue
            if event["type"] == "DELETED":
                w.stop()
                raise self._deleted(p.metadata.name, p.metadata.uid)
            if self._note_pod(p, ips):
                console.counter("pods running", len(ips), len(names))
            if len(ips) == len(names):
                w.stop()
                return

    def _note_pod(self, pod: Any, ips: dict[str, str]) -> bool:
        """Check ``pod`` (raises on what will never run); True when it is newly running."""
        self._check_pod(pod)
        new = pod.metadata.name not in ips
        if pod.status and pod.status.phase == "Running" and pod.status.pod_ip:
            ips[pod.metadata.name] = pod.status.pod_ip
            return new
        return False

    def _deleted(self, pod: str, uid: str | None = None) -> ProvisionError:
        return ProvisionError(
            f"pod {pod} was deleted while the cluster was starting (by someone or something else: "
            f"a user, a controller, an eviction); launch again{self._events_suffix(pod, uid=uid)}"
        )

    def _check_mounts(self, pods: dict[str, str]) -> None:
        """A volume that cannot mount leaves the pod ContainerCreating with no waiting reason
        of its own: only its FailedMount events say so.  A missing object ("not found": a
        Secret, a claim) will not appear by itself; other mount errors may pass (a kubelet's
        transient 'object ... not registered'), and stay in the timeout's message.  ``pods``
        maps name to uid: events of an earlier pod of the same name do not count."""
        if not pods:
            return
        try:
            events = self.api().list_namespaced_event(self.namespace, field_selector="reason=FailedMount").items
        except Exception:  # noqa: BLE001 - no events to read: the deadline still holds
            return
        for e in events:
            obj = e.involved_object
            name = obj.name if obj else None
            if name in pods and obj.uid in (None, pods[name]) and "not found" in (e.message or ""):
                raise ProvisionError(f"pod {name} cannot mount a volume{self._events_suffix(name, uid=obj.uid)}")

    def _check_pod(self, pod: Any) -> None:
        status = pod.status
        name = pod.metadata.name
        if pod.metadata.deletion_timestamp is not None:
            raise self._deleted(name, pod.metadata.uid)
        if status is None:
            return
        if status.phase in ("Failed", "Succeeded"):
            raise self._lacks_sshd(pod) or ProvisionError(
                f"pod {name} {status.phase.lower()} before sshd came up{self._events_suffix(name, True)}"
            )
        for cond in status.conditions or []:
            if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
                hint = ""
                if self._gpu is not None and "node affinity/selector" in (cond.message or ""):
                    hint = (
                        f"; the pods need {self._gpu.describe()} ({', '.join(self._gpu.values)}): "
                        f"see `kubectl get nodes -L {self._gpu.key}`, or name the key with --kube-gpu-label"
                    )
                raise ProvisionError(f"pod {name} cannot be scheduled: {cond.message}{hint}{self._events_suffix(name)}")
        for cs in status.container_statuses or []:
            waiting = cs.state.waiting if cs.state else None
            if waiting is not None and waiting.reason in FATAL_WAITING:
                raise ProvisionError(
                    f"pod {name}: {waiting.reason}: {waiting.message or ''}".rstrip(": ") + self._events_suffix(name)
                )

    def _lacks_sshd(self, pod: Any) -> ProvisionError | None:
        """A pod whose image has no sshd, and which could not install one, said so in its log
        (BOOTSTRAP's NO_SSHD_MARKER line, with apt's reason): that and the fix are the error."""
        name = pod.metadata.name
        try:
            text = self.api().read_namespaced_pod_log(name, self.namespace, tail_lines=20)
        except Exception:  # noqa: BLE001 - no log to read: the generic error stands
            return None
        lines = [line for line in (text or "").splitlines() if line.startswith(manifests.NO_SSHD_MARKER)]
        if not lines:
            return None
        image = pod.spec.containers[0].image if pod.spec and pod.spec.containers else self.image
        why = lines[-1].removeprefix(manifests.NO_SSHD_MARKER).strip()
        return ProvisionError(
            f"pod {name}: image {image} lacks sshd and openssh-server could not be installed ({why}): "
            + manifests.NO_SSHD_FIX
        )

    def _events_suffix(self, pod: str, logs: bool = False, uid: str | None = None) -> str:
        """The pod's last events (and log): of this pod, by uid, not of an earlier one of its
        name (a cluster keeps events for an hour)."""
        try:
            if uid is None:
                try:
                    uid = self.api().read_namespaced_pod(pod, self.namespace).metadata.uid
                except Exception:  # noqa: BLE001 - gone: every event of the name, then
                    uid = None
            selector = f"involvedObject.name={pod}" + (f",involvedObject.uid={uid}" if uid else "")
            events = self.api().list_namespaced_event(self.namespace, field_selector=selector)
            text = "; ".join(f"{e.reason}: {e.message}" for e in events.items[-3:] if e.message)
        except Exception:  # noqa: BLE001 - the error itself matters more than its garnish
            text = ""
        if logs:
            try:
                tail = self.api().read_namespaced_pod_log(pod, self.namespace, tail_lines=3)
                text = (text + "; " if text else "") + "log: " + " | ".join(tail.strip().splitlines()[-3:])
            except Exception:  # noqa: BLE001
                pass
        return f" (events: {text})" if text else ""

    # -- files that need pod IPs -----------------------------------------------------------

    def _install_node_files(self, nodes: list[NodeInfo], files: HomeFiles) -> None:
        """~/.ssh/config and known_hosts name every pod by IP, so they are written once IPs exist."""
        script = ["set -e", "umask 077", 'mkdir -p "$HOME/.ssh"']
        for rel, (content, mode) in files.items():
            b64 = base64.b64encode(content).decode()
            script.append(f'echo {b64} | base64 -d > "$HOME/{rel}"')
            script.append(f'chmod {mode:o} "$HOME/{rel}"')
        command = ["/bin/sh", "-c", "\n".join(script)]
        errors: dict[str, str] = {}

        def one(node: NodeInfo) -> None:
            try:
                code, out = self.exec(node.hostname, command)
            except Exception as exc:  # noqa: BLE001 - a pod that died under us refuses the exec: say so
                errors[node.hostname] = _api_message(exc)
                return
            if code != 0:
                errors[node.hostname] = out.strip()[-300:] or f"exit {code}"

        threads = [threading.Thread(target=one, args=(n,)) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            name, err = sorted(errors.items())[0]
            self._explain_exec_failure(name)
            raise ProvisionError(f"could not set up SSH on pod {name}: {err}")

    def _explain_exec_failure(self, pod: str, within: float = 3.0) -> None:
        """An exec killed under us (exit 137) is most often a pod that just died: give its own
        error (phase, events, log) once the API server has seen it, rather than the exec's."""
        from kubernetes.client.exceptions import ApiException

        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                self._check_pod(self.api().read_namespaced_pod(pod, self.namespace))
            except ApiException:
                return
            time.sleep(0.1)  # the kubelet reports the container's exit on its own schedule

    def _wait_banners(self, pods: list[str]) -> None:
        """Ready means every pod's sshd has sent its banner through a port-forward."""
        from kubernetes.client.exceptions import ApiException

        deadline = time.monotonic() + self.ready_timeout
        errors: dict[str, str] = {}

        def one(pod: str) -> None:
            last = ""
            while time.monotonic() < deadline:
                try:
                    kube_proxy.read_banner(self.stream_api(), self.namespace, pod, timeout=10)
                    return
                except Exception as exc:  # noqa: BLE001 - sshd still starting: keep asking
                    if _is_rbac_denial(exc):  # asking again will not help
                        errors[pod] = f"pod {pod}: {_api_message(exc)}"
                        return
                    last = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                try:  # a container that died will never answer: say so now, not at the deadline
                    self._check_pod(self.api().read_namespaced_pod(pod, self.namespace))
                except ProvisionError as exc:
                    errors[pod] = str(exc)
                    return
                except ApiException as exc:
                    if exc.status == 404:  # gone: no banner will ever come
                        errors[pod] = str(self._deleted(pod))
                        return
                except Exception:  # noqa: BLE001 - the banner error above is the one to keep
                    pass
                time.sleep(0.2)
            errors[pod] = f"sshd sent no banner within {self.ready_timeout:.0f} s ({last})"

        threads = [threading.Thread(target=one, args=(p,)) for p in pods]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            pod, err = sorted(errors.items())[0]
            if err.startswith("pod "):
                raise ProvisionError(err)
            raise ProvisionError(f"pod {pod}: {err}{self._events_suffix(pod, True)}")

    def exec(self, pod: str, command: list[str], timeout: float = 120) -> tuple[int, str]:
        from kubernetes.stream import stream

        resp = stream(
            self.stream_api().connect_get_namespaced_pod_exec,
            pod,
            self.namespace,
            command=command,
            stderr=True,
            stdin=False,
            stdout=True,
            tty=False,
            _preload_content=False,
        )
        out = []
        deadline = time.monotonic() + timeout
        while resp.is_open() and time.monotonic() < deadline:
            resp.update(timeout=1)
            if resp.peek_stdout():
                out.append(resp.read_stdout())
            if resp.peek_stderr():
                out.append(resp.read_stderr())
        resp.close()
        code = resp.returncode
        return (code if code is not None else 1), "".join(out)

    # -- faults: what a pod cannot do, said plainly ----------------------------------------

    def _adopt(self, journal: Journal) -> dict:
        """Talk to the cluster the journal names (context, kubeconfig, namespace): a later
        process's backend (the reaper's, the CLI's) was built without them."""
        data = journal.load()
        if data.get("context") and data.get("context") != "in-cluster":
            self.context = data["context"]
            self.kubeconfig = data.get("kubeconfig") or self.kubeconfig
        self.namespace = data.get("namespace") or self.namespace
        return data

    def kill_node(self, name: str, journal: Journal, rank: int) -> None:
        """Delete the node's pod with no grace period, as a crashed machine: its container is
        killed, not stopped; returns once the API server no longer has the pod.  Only our own
        pod, by uid, as teardown deletes (a same-named pod of someone else's is left alone)."""
        from kubernetes.client.exceptions import ApiException

        data = self._adopt(journal)
        ref = ObjectRef("Pod", manifests.pod_name(name, rank))
        try:
            uid = self._uid_if_ours(ref, name, data)
            if uid is None:
                return  # gone already, or never ours
            self._delete(ref, uid, grace_period=0)
            if self._wait_gone({ref.name: uid}, self._ownership_selector(name, data), timeout=60):
                raise ProvisionError(f"pod {ref.name} was still there 60 s after its deletion")
        except ApiException as exc:
            raise ProvisionError(f"could not delete pod {ref.name}: {_api_message(exc)}") from None

    def restart_node(self, name: str, journal: Journal, info: ClusterInfo, rank: int, wipe: bool) -> ClusterInfo:
        """Recreate the node's pod (a running one is deleted first) from the very manifest the
        launch sent: same name, labels and Secret, so the same host key; waited for as a
        launch waits (Running, then sshd's banner).  Returns the cluster's info with the
        pod's new IP: a pod created again gets a new address, which the caller writes into
        every node's ssh files.  Its container's filesystem (the home) is the image's again,
        whatever ``wipe`` says, as a real pod's is; the shared directory's claim keeps its data."""
        import dataclasses

        from kubernetes.client.exceptions import ApiException

        data = self._adopt(journal)
        specs = data.get("pod_specs") or []
        if rank >= len(specs):
            raise ProvisionError(
                f"cluster {name} was launched by a pytest-sky that did not record its pods' specs: "
                "relaunch it to restart its nodes"
            )
        self.kill_node(name, journal, rank)
        pod = manifests.pod_name(name, rank)
        try:
            self.api().create_namespaced_pod(self.namespace, specs[rank], _request_timeout=30)
        except ApiException as exc:
            reason = _policy_rejection(exc, self.namespace) or _api_message(exc)
            raise ProvisionError(f"could not create pod {pod} again: {reason}") from None
        try:
            ip = self._wait_running(self._ownership_selector(name, data), [pod])[0]
            self._wait_banners([pod])
        except ApiException as exc:
            raise ProvisionError(f"waiting for pod {pod}: {_api_message(exc)}") from None
        nodes = list(info.nodes)
        nodes[rank] = dataclasses.replace(self._node_info(name, rank, ip), env=nodes[rank].env)
        return dataclasses.replace(info, nodes=tuple(nodes))

    def set_network_faults(self, name: str, journal: Journal, info: ClusterInfo, faults: NetworkFaults) -> None:
        if faults:
            raise NotSupportedError(
                "partition and degrade are not supported on Kubernetes: they would need a CNI that enforces "
                "NetworkPolicy (Calico, Cilium) for partitions and one with bandwidth shaping (or netem in "
                "privileged pods) for degraded links; use the local backend"
            )
