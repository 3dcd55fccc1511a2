"""The Kubernetes backend: a cluster is pods of the current kube context (DESIGN.md section 6).

Pods ``<cluster>-head`` and ``<cluster>-worker<i>`` run sshd from a Secret holding the keys
generated on the client, behind a headless Service so node names resolve.  The client
reaches the head by port-forwards over the API server's websocket, which the cluster's
forwarder opens for ssh (``pytest_sky.ssh.kube_forwarder``, dialled by ``kube_dial``);
workers are reached through the head.  Waiting watches pod
phases and events, and any failure deletes everything the launch created.

This module orders the steps; each concern has a module of its own: the connection
(``kube_client``), the journal (``kube_journal``), what is checked first
(``kube_preflight``), refusals (``kube_errors``), waiting (``kube_waiting``), which objects
are ours and deleting them (``kube_ownership``), and files in the pods (``kube_files``).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from pytest_sky import naming
from pytest_sky.backends import kube_client, kube_files, kube_lease, kube_preflight, kube_reaping
from pytest_sky.backends import kube_manifests as manifests
from pytest_sky.backends.base import Backend, ClusterHold, HomeFiles, NetworkFaults, ProvisionConfig
from pytest_sky.backends.kube_client import KubeClient
from pytest_sky.backends.kube_errors import Refusal, api_message, policy_line, unreachable
from pytest_sky.backends.kube_journal import KubeRecord
from pytest_sky.backends.kube_objects import Creator, ObjectSettings
from pytest_sky.backends.kube_ownership import ObjectRef, Ownership, leftovers, ownership_selector
from pytest_sky.backends.kube_waiting import READY_TIMEOUT, PodWaiter
from pytest_sky.cluster_info import ClusterInfo, NodeInfo, SshRoute
from pytest_sky.errors import BackendUnavailableError, NotSupportedError, ProvisionError
from pytest_sky.resources import Resources
from pytest_sky.ssh import kube_dial, kube_forwarder, kube_proxy
from pytest_sky.ssh.kube_forwarder import Handle
from pytest_sky.state import Journal

if TYPE_CHECKING:
    from kubernetes.client import CoreV1Api

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["READY_TIMEOUT", "KubernetesBackend", "ObjectRef"]

#: How long ``kill_node`` waits for the pod's kubelet to have stopped its container: the pods'
#: grace period (5 s) and the kubelet's reaction, many times over.
KILL_TIMEOUT = 60.0


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
        lease_seconds: float | None = None,
        max_lifetime: float | None = None,
    ) -> None:
        self.client = KubeClient(context, namespace, kubeconfig)
        self.image = image or manifests.DEFAULT_IMAGE
        self.shared_pvc = shared_pvc or None
        self.waiter = PodWaiter(self.client, ready_timeout, self.image)
        self.ownership = Ownership(self.client)
        settings = ObjectSettings(
            self.image,
            self.shared_pvc,
            gpu_label or None,
            lease_seconds or kube_lease.DEFAULT_LEASE_SECONDS,
            max_lifetime,
        )
        self.creator = Creator(self.client, self.waiter, settings)
        self._gpus_unseen = ""

    # -- connection ------------------------------------------------------------------------

    @property
    def context(self) -> str | None:
        return self.client.context

    @property
    def namespace(self) -> str:
        return self.client.namespace

    @property
    def kubeconfig(self) -> str | None:
        return self.client.kubeconfig

    @property
    def ready_timeout(self) -> float:
        return self.waiter.ready_timeout

    def api(self) -> CoreV1Api:
        return self.client.api()

    def exec(self, pod: str, command: list[str], timeout: float = 120) -> tuple[int, str]:
        return self.client.exec(pod, command, timeout)

    # -- before anything is created --------------------------------------------------------

    def plan(self, name: str, num_nodes: int, resources: Resources, shared_dir: str | None = None) -> None:
        if shared_dir and not self.shared_pvc:
            raise BackendUnavailableError(
                f"shared_dir={shared_dir} on Kubernetes needs a ReadWriteMany PersistentVolumeClaim: "
                "pass --kube-shared-pvc NAME (or set PYTEST_SKY_KUBE_SHARED_PVC)"
            )
        kube_preflight.check_namespace(self.client)
        kube_preflight.check_permissions(self.client, shared_claim=bool(shared_dir))
        if shared_dir:
            kube_preflight.check_claim(self.client, self.shared_pvc, shared_dir)

    def effective(self, resources: Resources) -> Resources:
        return dataclasses.replace(
            resources,
            cpus=resources.cpus if resources.cpus is not None else manifests.DEFAULT_CPUS,
            memory=resources.memory if resources.memory is not None else manifests.DEFAULT_MEMORY_GB,
        )

    def has_gpus(self) -> bool:
        """Any node with allocatable nvidia.com/gpu (see :func:`kube_preflight.visible_gpus`)."""
        seen, why = kube_preflight.visible_gpus(self.client)
        if why:
            self._gpus_unseen = why
        return seen

    def gpus_unseen(self) -> str:
        return self._gpus_unseen or super().gpus_unseen()

    def node_image(self, journal: Journal) -> str | None:
        return KubeRecord.load(journal).image or "(not recorded)"  # pods run an image, named or not

    # -- lifecycle -------------------------------------------------------------------------

    def create(self, config: ProvisionConfig) -> ClusterInfo:
        self.client.api()  # the context's namespace, before anything is written
        name = config.name
        pods = [manifests.pod_name(name, r) for r in range(config.num_nodes)]
        record = KubeRecord(
            context=self.context,
            namespace=self.namespace,
            kubeconfig=self.kubeconfig,
            image=self.image,
            launch=secrets.token_hex(8),
            leased=True,
            pods=tuple(pods),
            shared_dir=config.shared_dir,
            forwarder=Handle(kube_forwarder.socket_path()),
        )
        record.save(config.journal)
        try:
            record = self.creator.create(config, record)
            ips = self.waiter.wait_running(manifests.selector(name, record.launch), pods)
            self.waiter.wait_banners(pods)
            self._start_forwarder(config, record)
        except kube_client.ApiException as exc:  # e.g. no permission to list or watch pods
            self._cleanup(name, config.journal)
            raise ProvisionError(f"waiting for the pods of {name}: {api_message(exc)}") from None
        except BaseException:
            self._cleanup(name, config.journal)
            raise
        return ClusterInfo(
            nodes=tuple(self._node_info(name, r, ip, record.forwarder) for r, ip in enumerate(ips)),
            python="python3",
            cloud="kubernetes",
            region=self.context,
            zone=self.namespace,
        )

    def _start_forwarder(self, config: ProvisionConfig, record: KubeRecord) -> None:
        """The cluster's forwarder, which every ssh connection through its config dials: a
        thread of this process, or a process of its own for a cluster kept beyond this one."""
        assert record.forwarder is not None
        head = self.client.port_forward(manifests.pod_name(config.name, 0))
        try:
            handle = kube_forwarder.start(
                record.forwarder.socket, head, own_process=config.keep, watch=config.cluster_dir
            )
        except kube_forwarder.ForwarderError as exc:
            raise ProvisionError(f"the forwarder of {config.name}'s ssh connections did not start: {exc}") from None
        dataclasses.replace(KubeRecord.load(config.journal), forwarder=handle).save(config.journal)

    def _node_info(self, cluster: str, rank: int, ip: str, forwarder: Handle | None) -> NodeInfo:
        """The head is reached by port-forward (through the cluster's forwarder, where the
        journal has one), workers through the head."""
        pod = manifests.pod_name(cluster, rank)
        if rank == 0:
            pf = self.client.port_forward(pod)
            proxy = kube_dial.command(forwarder.socket, kube_proxy.args_of(pf)) if forwarder else kube_proxy.command(pf)
            socket = forwarder.socket if forwarder else None
            route = SshRoute(hostname=pod, proxy_command=proxy, port_forward=pf, dial_socket=socket)
        else:
            route = SshRoute(hostname=ip, proxy_jump=cluster)
        return NodeInfo(rank=rank, name=naming.node_name(rank), hostname=pod, ip=ip, route=route)

    def put_files(self, name: str, journal: Journal, info: ClusterInfo, files: HomeFiles) -> None:
        """Into every pod at once (a failed launch is removed by its caller, a restart's
        cluster stays as it is for the user to see or take down)."""
        kube_files.install_node_files(self.client, self.waiter, list(info.nodes), files)

    # -- down ------------------------------------------------------------------------------

    def _adopt(self, journal: Journal) -> KubeRecord:
        """Talk to the cluster the journal names: a later process's backend (the reaper's,
        the CLI's) was built without its context, kubeconfig and namespace."""
        record = KubeRecord.load(journal)
        self.client.adopt(record)
        return record

    def _cleanup(self, name: str, journal: Journal) -> None:
        """Best-effort removal after a failed launch: the launch's own error is the one to show.
        It is ``destroy``: only objects carrying this launch's label go (never one that already
        existed and made the launch fail with a 409)."""
        try:
            self.destroy(name, journal)
        except Exception as exc:  # noqa: BLE001 - e.g. no permission to delete what we could not create
            log.warning("cleanup of %s after a failed launch: %s", name, exc)

    def destroy(self, name: str, journal: Journal) -> None:
        """Delete the launch's own objects, each by name, and wait until its pods are gone;
        the Lease goes last (``Ownership.remove``).

        Ours means labelled ``pytest-sky/launch=<the journal's id>`` and owned by the launch's
        Lease; a journal from before launch ids (none in it) falls back to the objects named
        as ours that carry the cluster label and ``managed-by: pytest-sky``.  No journal entry
        of pods: nothing was created.
        """
        from urllib3.exceptions import HTTPError

        record = KubeRecord.load(journal)
        self.creator.stop_renewing(name)
        if record.forwarder is not None:
            kube_forwarder.stop(record.forwarder)
        if not record.pods:
            return
        self.client.adopt(record)
        self.client.api()
        try:
            owned = self.ownership.owned(name, record)
            head = ObjectRef("Pod", manifests.pod_name(name, 0))
            if record.shared_dir and any(ref == head for ref, _ in owned):
                kube_files.empty_shared_dir(self.client, head.name, record.shared_dir)
            self.ownership.remove(name, record, owned)
        except kube_client.ApiException as exc:
            raise ProvisionError(f"could not delete {name}'s objects: {api_message(exc)}") from None
        except HTTPError as exc:
            raise unreachable(exc, self.context, self.client.server) from None

    def reap_stale(self) -> list[str]:
        """Remove the clusters of this namespace whose owner's lease has expired, never a
        kept one, never a live one, never an object not ours (``kube_reaping``)."""
        return self._namespace_call("reap stale clusters", lambda: kube_reaping.reap_stale(self.client, self.ownership))

    def held_clusters(self) -> list[ClusterHold]:
        """Every cluster of this namespace, as its lease shows it."""
        views = self._namespace_call("list the leases", lambda: kube_reaping.leases(self.client))
        where = f"kube context {self.context}, namespace {self.namespace}"
        return [kube_reaping.hold_of(view, where) for view in views]

    def _namespace_call(self, what: str, call: Callable[[], T]) -> T:
        """``call``, its refusal one line saying what could not be done in which namespace."""
        from urllib3.exceptions import HTTPError

        try:
            return call()
        except kube_client.ApiException as exc:
            raise ProvisionError(f"could not {what} in namespace {self.namespace!r}: {api_message(exc)}") from None
        except HTTPError as exc:
            raise unreachable(exc, self.context, self.client.server) from None

    def diagnostics(self, name: str, journal: Journal) -> list[tuple[str, str]]:
        """Each pod's events (this pod's, by uid) and its container's log."""
        record = self._adopt(journal)
        api, ns, found = self.client.api(), self.namespace, []
        for pod in record.pods:
            try:
                uid = api.read_namespaced_pod(pod, ns).metadata.uid
                events = api.list_namespaced_event(
                    ns, field_selector=f"involvedObject.name={pod},involvedObject.uid={uid}"
                )
                lines = [
                    f"{e.last_timestamp or e.event_time or ''} {e.type} {e.reason}: {e.message}" for e in events.items
                ]
                found.append((f"{pod}.events.txt", "\n".join(lines) + "\n"))
                found.append((f"{pod}.log", api.read_namespaced_pod_log(pod, ns, tail_lines=5000)))
            except kube_client.ApiException as exc:
                found.append((f"{pod}.error.txt", f"could not read {pod}: {api_message(exc)}\n"))
        return found

    def leftovers(self, name: str, journal: Journal) -> str:
        """Where this cluster's objects may still be, for a record forgotten without them."""
        return leftovers(name, KubeRecord.load(journal), self.namespace)

    # -- faults: what a pod cannot do, said plainly ----------------------------------------

    def kill_node(self, name: str, journal: Journal, rank: int) -> None:
        """Crash the node's pod and have Kubernetes remove it; returns once its container has
        stopped (DESIGN.md section 6, "Faults").

        Every process of the container but its first is SIGKILLed at once, by an exec of
        ``kill -KILL -1`` (a crash: no handler runs); then the pod is deleted with its grace
        period, and awaited until its object is gone.  A real API server removes a pod
        deleted gracefully only once its kubelet reports its containers stopped (a forced
        delete removes the object at once and leaves the container to the kubelet's own
        schedule), so that DELETED event is the one signal a client sees that nothing of the
        old pod runs any more.  Only our own pod, by uid, as teardown deletes."""
        record = self._adopt(journal)
        ref = ObjectRef("Pod", manifests.pod_name(name, rank))
        try:
            uid = self.ownership.uid_if_ours(ref, name, record)
            if uid is None:
                return  # gone already, or never ours
            self._crash(ref.name)
            self.ownership.delete(ref, uid)
            if self.ownership.wait_gone({ref.name: uid}, ownership_selector(name, record), timeout=KILL_TIMEOUT):
                raise ProvisionError(
                    f"pod {ref.name} was still terminating {KILL_TIMEOUT:.0f} s after its deletion: its kubelet "
                    f"has not stopped its container (is its node down? kubectl describe pod {ref.name} -n "
                    f"{self.namespace})"
                )
        except kube_client.ApiException as exc:
            raise ProvisionError(f"could not delete pod {ref.name}: {api_message(exc)}") from None

    def _crash(self, pod: str) -> None:
        """SIGKILL every process of ``pod``'s container that its first process is not (which no
        process of its PID namespace may signal), as a crash kills them: at once, no handler.
        Best effort: a pod whose container has already stopped answers no exec."""
        try:
            code, out = self.client.exec(pod, ["/bin/sh", "-c", "kill -KILL -1"], timeout=30)
        except Exception as exc:  # noqa: BLE001 - the deletion that follows stops it anyway
            log.info("could not crash pod %s before deleting it: %s", pod, exc)
            return
        if code != 0:
            log.info("crashing pod %s: kill exited %s: %s", pod, code, out.strip()[:200])

    def restart_node(self, name: str, journal: Journal, info: ClusterInfo, rank: int, wipe: bool) -> ClusterInfo:
        """Recreate the node's pod (a running one is deleted first) from the very manifest the
        launch sent: same name, labels and Secret, so the same host key; waited for as a
        launch waits (Running, then sshd's banner).  Returns the cluster's info with the
        pod's new IP: a pod created again gets a new address, which the caller writes into
        every node's ssh files.  Its container's filesystem (the home) is the image's again,
        whatever ``wipe`` says, as a real pod's is; the shared directory's claim keeps its data."""
        record = self._adopt(journal)
        if rank >= len(record.pod_specs):
            raise ProvisionError(
                f"cluster {name} was launched by a pytest-sky that did not record its pods' specs: "
                "relaunch it to restart its nodes"
            )
        self.kill_node(name, journal, rank)
        pod = manifests.pod_name(name, rank)
        try:
            self.client.api().create_namespaced_pod(self.namespace, record.pod_specs[rank], _request_timeout=30)
        except kube_client.ApiException as exc:
            reason = policy_line(Refusal.of(exc), self.namespace) or api_message(exc)
            raise ProvisionError(f"could not create pod {pod} again: {reason}") from None
        try:
            ip = self.waiter.wait_running(ownership_selector(name, record), [pod])[0]
            self.waiter.wait_banners([pod])
        except kube_client.ApiException as exc:
            raise ProvisionError(f"waiting for pod {pod}: {api_message(exc)}") from None
        nodes = list(info.nodes)
        nodes[rank] = dataclasses.replace(self._node_info(name, rank, ip, record.forwarder), env=nodes[rank].env)
        return dataclasses.replace(info, nodes=tuple(nodes))

    def set_network_faults(self, name: str, journal: Journal, info: ClusterInfo, faults: NetworkFaults) -> None:
        if faults:
            raise NotSupportedError(
                "partition and degrade are not supported on Kubernetes: they would need a CNI that enforces "
                "NetworkPolicy (Calico, Cilium) for partitions and one with bandwidth shaping (or netem in "
                "privileged pods) for degraded links; use the local backend"
            )
