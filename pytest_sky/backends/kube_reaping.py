"""Reaping the clusters whose owner vanished, from any machine with access to the namespace
(DESIGN.md section 6, "Lifetimes").

A cluster's Lease (``kube_lease``) names its holder and when it last renewed.  One not
renewed for a whole lease length, and not marked kept, belongs to a runner that is gone.
Its reaper first takes the lease (a write conditioned on the very resourceVersion it read,
so an owner that renewed meanwhile wins, and two reapers never both proceed), then removes
what the lease owns exactly as teardown does: each object read by name and deleted by uid
only if it carries the launch's label and names this lease as its owner; the Secret, which
the Role may not read, by the uid the lease records; the pods awaited until gone; the
lease last (its garbage collector takes anything left).  Nothing without a lease of ours is
ever touched: a cluster of an older pytest-sky, with no lease, is left to its own records.
"""

from __future__ import annotations

import datetime
import logging

from pytest_sky.backends import kube_lease
from pytest_sky.backends import kube_manifests as manifests
from pytest_sky.backends.base import ClusterHold
from pytest_sky.backends.kube_client import KubeClient
from pytest_sky.backends.kube_journal import KubeRecord
from pytest_sky.backends.kube_lease import LeaseView
from pytest_sky.backends.kube_ownership import Ownership

log = logging.getLogger(__name__)


def leases(client: KubeClient) -> list[LeaseView]:
    """The leases of pytest-sky's clusters in the client's namespace (by label)."""
    selector = ",".join(f"{k}={v}" for k, v in manifests.MANAGED_BY.items())
    listing = client.coordination().list_namespaced_lease(
        client.namespace, label_selector=selector, _request_timeout=30
    )
    return sorted((LeaseView.of(lease) for lease in listing.items), key=lambda v: v.cluster)


def hold_of(view: LeaseView, where: str) -> ClusterHold:
    now = datetime.datetime.now(datetime.timezone.utc)
    renewed = (now - view.renewed).total_seconds() if view.renewed else None
    return ClusterHold(
        name=view.cluster,
        where=where,
        holder=view.holder,
        age_s=view.age(now),
        renewed_s=renewed,
        lease_s=view.seconds,
        kept=view.kept,
        expired=view.expired(now),
    )


def reap_stale(client: KubeClient, ownership: Ownership) -> list[str]:
    """Remove every cluster whose lease has expired; the names of those removed."""
    reaped = []
    reaper = f"reaping: {kube_lease.holder_identity()}"
    for view in leases(client):
        if view.kept or not view.expired() or not view.launch:
            continue
        if not kube_lease.take(client, view, reaper):
            log.info("cluster %s's lease was renewed or taken meanwhile: left alone", view.cluster)
            continue
        remove(client, ownership, view)
        reaped.append(view.cluster)
    return reaped


def remove(client: KubeClient, ownership: Ownership, view: LeaseView) -> None:
    """Remove what ``view``'s lease owns, and the lease, as teardown removes a cluster from
    its journal: here the journal is made from the lease and the launch's pods by label."""
    api = client.api()
    selector = f"{manifests.LABEL_LAUNCH}={view.launch}"
    pods = api.list_namespaced_pod(client.namespace, label_selector=selector, _request_timeout=30).items
    record = KubeRecord(
        namespace=client.namespace,
        launch=view.launch,
        pods=tuple(sorted(p.metadata.name for p in pods)),
        leased=True,
        lease_uid=view.uid,
        secret_uid=view.secret_uid,
    )
    ownership.remove(view.cluster, record, ownership.owned(view.cluster, record))
    log.info("reaped cluster %s (its lease, held by %s, expired)", view.cluster, view.holder)
