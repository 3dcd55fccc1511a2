"""Creating a cluster's objects, in their order: the Lease, the Secret, the headless Service,
the pods (DESIGN.md section 6).

The Lease comes first (``kube_lease``): every later object names it as its owner, and its
renewer starts at once, so that a runner that vanishes while its pods are still pulling
leaves a cluster the next session can reap.  The pods carry ``activeDeadlineSeconds``, the
end of a cluster whose owner never returns.  Each object is labelled with the launch; the
uid the API server gave the Lease and the Secret is written to the journal as soon as it is
known (teardown deletes the Secret by it: the Role may not read Secrets).  A refusal is one
line naming the object refused (``kube_errors.creation_refused``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from pytest_sky.backends import kube_client, kube_files, kube_lease, kube_policy, kube_preflight
from pytest_sky.backends import kube_manifests as manifests
from pytest_sky.backends.base import ProvisionConfig
from pytest_sky.backends.kube_client import KubeClient
from pytest_sky.backends.kube_errors import Refusal, creation_refused
from pytest_sky.backends.kube_journal import KubeRecord
from pytest_sky.backends.kube_ownership import ObjectRef
from pytest_sky.backends.kube_waiting import PodWaiter
from pytest_sky.resources import Resources

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ObjectSettings:
    """What the backend's settings say of the objects it creates."""

    image: str
    shared_pvc: str | None = None
    gpu_label: str | None = None
    #: ``--kube-lease-seconds``.
    lease_seconds: float = kube_lease.DEFAULT_LEASE_SECONDS
    #: ``--kube-max-lifetime``; None: the default for a cluster that ends with its launching
    #: process, no deadline for one kept beyond it.
    max_lifetime: float | None = None

    def deadline(self, keep: bool) -> int | None:
        """The pods' ``activeDeadlineSeconds``."""
        if self.max_lifetime is not None:
            return max(1, math.ceil(self.max_lifetime))
        return None if keep else math.ceil(kube_lease.DEFAULT_MAX_LIFETIME)


class Creator:
    """Creates clusters' objects, and renews the leases of those that end with this process."""

    def __init__(self, client: KubeClient, waiter: PodWaiter, settings: ObjectSettings) -> None:
        self.client = client
        self.waiter = waiter
        self.settings = settings
        self.renewers: dict[str, kube_lease.Renewer] = {}

    def stop_renewing(self, cluster: str) -> None:
        renewer = self.renewers.pop(cluster, None)
        if renewer is not None:
            renewer.stop()

    def create(self, config: ProvisionConfig, record: KubeRecord) -> KubeRecord:
        """Every object of the cluster; the journal's record once all are made."""
        api, name, ns, launch = self.client.api(), config.name, self.client.namespace, record.launch or ""
        files = kube_files.secret_files(config)
        ref = ObjectRef("Lease", name)
        try:
            manifest = kube_lease.body(name, ns, launch=launch, seconds=self.settings.lease_seconds, kept=config.keep)
            lease_uid = kube_lease.create(self.client, manifest).metadata.uid
            record = dataclasses.replace(record, lease_uid=lease_uid)
            record.save(config.journal)
            if not config.keep:
                self.renewers[name] = kube_lease.Renewer(self.client, name, self.settings.lease_seconds).start()
            owner = kube_lease.owner_reference(name, lease_uid)
            ref = ObjectRef("Secret", manifests.secret_name(name))
            secret = api.create_namespaced_secret(ns, manifests.secret(name, ns, files, launch=launch, owner=owner))
            record = dataclasses.replace(record, secret_uid=secret.metadata.uid)
            record.save(config.journal)
            kube_lease.note_secret(self.client, name, secret.metadata.uid)
            ref = ObjectRef("Service", name)
            api.create_namespaced_service(ns, manifests.service(name, ns, launch=launch, owner=owner))
        except kube_client.ApiException as exc:
            raise creation_refused(exc, ref, ns, self.client.context, config.privileges) from None
        specs = self._create_pods(config, record, files, owner)
        # What restart_node sends again, as it was accepted.
        record = dataclasses.replace(record, pod_specs=tuple(specs))
        record.save(config.journal)
        return record

    def _create_pods(
        self,
        config: ProvisionConfig,
        record: KubeRecord,
        files: dict[str, bytes],
        owner: dict,
    ) -> list[dict]:
        name, ns = config.name, self.client.namespace
        pvc = self.settings.shared_pvc
        # plan() refused a shared_dir without a claim before anything was made
        shared = manifests.SharedVolume(pvc, config.shared_dir) if config.shared_dir and pvc else None
        placement = manifests.Placement(gpu=self._gpu_selector(config.resources))
        lifetime = manifests.Lifetime(owner=owner, deadline=self.settings.deadline(config.keep))
        specs: list[dict] = []
        for rank in range(config.num_nodes):
            placement, spec = self._create_pod(
                config,
                ObjectRef("Pod", manifests.pod_name(name, rank)),
                lambda p, rank=rank: manifests.pod(  # type: ignore[misc]
                    name,
                    rank,
                    ns,
                    self.settings.image,
                    config.resources,
                    shared,
                    secret_keys=files,
                    placement=p,
                    launch=record.launch or "",
                    asked=config.privileges,
                    lifetime=lifetime,
                ),
                placement,
            )
            specs.append(spec)
        return specs

    def _create_pod(
        self,
        config: ProvisionConfig,
        ref: ObjectRef,
        make: Callable[[manifests.Placement], dict],
        placement: manifests.Placement,
    ) -> tuple[manifests.Placement, dict]:
        """Create the pod ``make`` builds; where the namespace refuses pods without limits, send
        it again with them (and every later pod at once).  The placement the next pod should
        use, and the pod as the API server accepted it.

        Learnt from the refusal rather than by reading the namespace's ResourceQuotas and
        LimitRanges: that needs no Role verbs beyond creating pods, costs one request only
        where limits are demanded, and follows what admission actually enforces (a
        LimitRange default that fills limits in makes them unnecessary).
        """
        ns = self.client.namespace
        spec = make(placement)
        try:
            try:
                self.client.api().create_namespaced_pod(ns, spec)
                return placement, spec
            except kube_client.ApiException as exc:
                if placement.with_limits or not Refusal.of(exc).needs_limits:
                    raise
            log.info("namespace %s demands limits: sending them equal to the requests", ns)
            placement = dataclasses.replace(placement, with_limits=True)
            spec = make(placement)
            self.client.api().create_namespaced_pod(ns, spec)
            return placement, spec
        except kube_client.ApiException as exc:
            raise creation_refused(exc, ref, ns, self.client.context, config.privileges) from None

    def _gpu_selector(self, resources: Resources) -> kube_policy.GpuSelector | None:
        """The node label that keeps the pods on the GPU type asked for, from the nodes' own
        labels where the context may list nodes (a namespaced Role may not: then by convention)."""
        gpu = None
        if resources.accelerators is not None:
            nodes = kube_preflight.node_labels(self.client)
            gpu = kube_policy.gpu_selector(resources.accelerators.name, nodes, self.settings.gpu_label)
        self.waiter.gpu = gpu
        return gpu
