"""The kubelet's side of one pod (:class:`PodRuntime`), and what the kubelet needs of the
API side (:class:`PodHost`), shared by the kubelet and the collaborators it hands a pod to
(its sandbox, its status writer, exec)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kube_emulator import dns, images, product
from kube_emulator.events import EventRecorder
from kube_emulator.faults import Faults
from kube_emulator.product import Confinement
from kube_emulator.store import Obj, Store

#: A container's PATH when nothing sets another (the emulated images carry no metadata).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class PodRuntime:
    """The kubelet's side of one pod."""

    namespace: str
    name: str
    uid: str
    root: Path
    node_name: str
    ip: str | None = None
    node: product.NodeProcess | None = None
    init_pidfd: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    hostname: str = ""
    subdomain: str = ""
    #: The API wants the pod gone: once its container stopped, its files go and so does its
    #: object (if still there: a force-deleted one is gone already).
    deleting: bool = False
    #: Its container must stop and never restart: it is being deleted, or its deadline passed.
    stopping: bool = False
    #: Its ``activeDeadlineSeconds`` passed: it ends Failed, reason DeadlineExceeded.
    deadline_exceeded: bool = False
    #: The grace period its stop was asked with (the shortest of the deletions that came).
    grace: float | None = None
    #: When the kubelet took the pod (monotonic): its status.startTime, what its active
    #: deadline counts from.
    bound_at: float = 0.0
    exits: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    #: The kubelet's stop of its container, once one was asked for.
    stop_task: asyncio.Task[None] | None = None
    #: What enforces its ``activeDeadlineSeconds``.
    deadline_task: asyncio.Task[None] | None = None
    container_id: str = ""
    started_at: str = ""
    view: images.ImageView = field(default_factory=lambda: images.ImageView(name=""))
    #: What the container's processes hold (its securityContext's), exec sessions too.
    confinement: Confinement = field(default_factory=Confinement)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def log_path(self) -> Path:
        return self.root / "node.log"

    def pod_in(self, objects: Store) -> Obj | None:
        """This pod's object, if the object of its name is still this pod (by uid)."""
        pod = objects.get("pods", self.namespace, self.name)
        return pod if pod is not None and pod["metadata"]["uid"] == self.uid else None

    async def sleep(self, seconds: float) -> None:
        """Sleep, but wake at once when the pod's container is to stop."""
        self.wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wake.wait(), seconds)


class PodHost(Protocol):
    """What the kubelet needs of the API side (``cluster.Cluster``): written out here so the
    kubelet sits below the cluster that owns it, as a real kubelet talks to an API server it
    does not import."""

    store: Store
    faults: Faults
    dns: dns.DnsServer
    events: EventRecorder
    ca_pem: bytes

    def delete(self, resource: str, namespace: str, name: str, options: dict[str, Any] | None = None) -> Obj: ...

    def pod_stopped_for_deletion(self, namespace: str, name: str, uid: str) -> None: ...

    def trigger_scheduler(self) -> None: ...
