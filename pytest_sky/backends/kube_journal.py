"""What the Kubernetes backend writes down about a cluster, before it creates anything.

The journal is the only thing a later process (the reaper, ``pytest-sky down``) has to find
and remove a cluster's objects, so its fields are fixed here, once, with their JSON form:
a journal written by an older pytest-sky (no launch id, no pod specs) still reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pytest_sky.ssh.kube_forwarder import Handle
from pytest_sky.state import Journal


@dataclass(frozen=True)
class KubeRecord:
    """One cluster's journal: where it lives and what the launch made there."""

    #: The kube context ("in-cluster" from a pod), kubeconfig and namespace used: a later
    #: process's backend was built without them.
    context: str | None = None
    namespace: str | None = None
    kubeconfig: str | None = None
    image: str | None = None
    #: This launch's id, the ``pytest-sky/launch`` label of everything it made; None in a
    #: journal from before launch ids (ownership is then the cluster and managed-by labels).
    launch: str | None = None
    #: The pods the launch makes, by name, written before any is created; empty: nothing was.
    pods: tuple[str, ...] = ()
    shared_dir: str | None = None
    #: Each pod as the API server accepted it, which ``restart_node`` sends again.
    pod_specs: tuple[dict, ...] = ()
    #: The cluster's forwarder (its socket, written before it starts; its process once it
    #: has one), which the ssh config's ProxyCommand dials; None in an older journal.
    forwarder: Handle | None = None
    #: The launch makes the cluster's Lease (``kube_lease``) before anything else: with no
    #: ``lease_uid`` yet, nothing was made.  False in a journal from before leases.
    leased: bool = False
    #: The uid of the cluster's Lease (named after the cluster), the owner of every other
    #: object; None before it was created, or in an older journal.
    lease_uid: str | None = None
    #: The uid of the cluster's Secret, which teardown deletes by it (the Role may not read it).
    secret_uid: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "namespace": self.namespace,
            "kubeconfig": self.kubeconfig,
            "image": self.image,
            "launch": self.launch,
            "pods": list(self.pods),
            "shared_dir": self.shared_dir,
            "pod_specs": list(self.pod_specs),
            "forwarder": dataclasses.asdict(self.forwarder) if self.forwarder else None,
            "leased": self.leased,
            "lease_uid": self.lease_uid,
            "secret_uid": self.secret_uid,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KubeRecord:
        return cls(
            context=data.get("context") or None,
            namespace=data.get("namespace") or None,
            kubeconfig=data.get("kubeconfig") or None,
            image=data.get("image") or None,
            launch=data.get("launch") or None,
            pods=tuple(data.get("pods") or ()),
            shared_dir=data.get("shared_dir") or None,
            pod_specs=tuple(data.get("pod_specs") or ()),
            forwarder=Handle(**data["forwarder"]) if data.get("forwarder") else None,
            leased=bool(data.get("leased")),
            lease_uid=data.get("lease_uid") or None,
            secret_uid=data.get("secret_uid") or None,
        )

    @classmethod
    def load(cls, journal: Journal) -> KubeRecord:
        return cls.from_json(journal.load())

    def save(self, journal: Journal) -> None:
        """Durable before returning (intent before action)."""
        journal.update(**self.to_json())
