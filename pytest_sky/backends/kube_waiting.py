"""Waiting for a launch's pods: Running, then sshd's banner; failing fast on what never will.

Ready means every pod runs and its sshd has sent its banner through a port-forward.  Pod
phases are watched, not polled; a pod that will never run (a fatal waiting reason, a volume
that cannot mount, a pod deleted under us, an image without sshd) ends the wait at once with
its own events, rather than at the deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from pytest_sky import console
from pytest_sky.backends import kube_client, kube_policy
from pytest_sky.backends import kube_manifests as manifests
from pytest_sky.backends.kube_client import KubeClient
from pytest_sky.backends.kube_errors import Refusal
from pytest_sky.errors import ProvisionError
from pytest_sky.ssh import kube_proxy

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
class Unready:
    """Why one pod's sshd never answered."""

    message: str
    #: The message names the pod and its cause in full; else it is the last banner error,
    #: and the pod's events and log are added to it.
    whole: bool


def in_parallel(items: list[str], one: Any) -> None:
    """``one(item)`` for every item at once, each in a thread of its own; returns when all have."""
    threads = [threading.Thread(target=one, args=(item,)) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class PodWaiter:
    """Waits for pods of the client's namespace, and says why one never came up."""

    def __init__(self, client: KubeClient, ready_timeout: float, image: str) -> None:
        self.client = client
        self.ready_timeout = ready_timeout
        self.image = image  # the image asked for, named where a pod's own is unknown
        #: The GPU node selector the pods were placed with, for an unschedulable pod's hint.
        self.gpu: kube_policy.GpuSelector | None = None

    # -- Running ---------------------------------------------------------------------------

    def wait_running(self, sel: str, names: list[str]) -> list[str]:
        """List, then watch the pods of ``sel`` (one launch's: another pod with the cluster's
        label is not ours) until each of ``names`` runs (every pod at a launch, the recreated
        one at a restart), their IPs in order; fail fast on what never will.

        A watch started with ``timeout_seconds`` gets no 410-Gone retry from the client (an
        expired resourceVersion raises ApiException(410)): the wait re-lists and resumes."""
        api, ns = self.client.api(), self.client.namespace
        deadline = time.monotonic() + self.ready_timeout
        ips: dict[str, str] = {}
        while True:
            listing = api.list_namespaced_pod(ns, label_selector=sel)
            pods = [p for p in listing.items if p.metadata.name in names]
            listed = {p.metadata.name for p in pods}
            for name in names:
                if name not in listed:
                    raise self.deleted(name)
            for p in pods:
                self._note_pod(p, ips)
            console.counter("pods running", len(ips), len(names))
            if len(ips) == len(names):
                return [ips[n] for n in names]
            self._check_mounts({p.metadata.name: p.metadata.uid for p in pods if p.metadata.name not in ips})
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = [n for n in names if n not in ips]
                raise ProvisionError(
                    f"pods not running after {self.ready_timeout:.0f} s: {', '.join(waiting)}"
                    f"{self.events_suffix(waiting[0])}"
                )
            try:
                self._watch(sel, listing.metadata.resource_version, min(left, WATCH_SLICE), ips, names)
            except kube_client.ApiException as exc:
                if exc.status != 410:
                    raise
                log.debug("watch of the pods of %s expired (410): listing again", sel)
            if len(ips) == len(names):
                return [ips[n] for n in names]

    def _watch(self, sel: str, version: str, seconds: float, ips: dict[str, str], names: list[str]) -> None:
        """One watch of the pods of ``sel`` from ``version``, for at most ``seconds``, or until
        each of ``names`` runs."""
        w, events = self.client.watch_pods(sel, version, seconds)
        for event in events:
            p = event["object"]
            if p.metadata.name not in names:
                continue
            if event["type"] == "DELETED":
                w.stop()
                raise self.deleted(p.metadata.name, p.metadata.uid)
            if self._note_pod(p, ips):
                console.counter("pods running", len(ips), len(names))
            if len(ips) == len(names):
                w.stop()
                return

    def _note_pod(self, pod: Any, ips: dict[str, str]) -> bool:
        """Check ``pod`` (raises on what will never run); True when it is newly running."""
        self.check_pod(pod)
        new = pod.metadata.name not in ips
        if pod.status and pod.status.phase == "Running" and pod.status.pod_ip:
            ips[pod.metadata.name] = pod.status.pod_ip
            return new
        return False

    # -- what will never run ---------------------------------------------------------------

    def deleted(self, pod: str, uid: str | None = None) -> ProvisionError:
        return ProvisionError(
            f"pod {pod} was deleted while the cluster was starting (by someone or something else: "
            f"a user, a controller, an eviction); launch again{self.events_suffix(pod, uid=uid)}"
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
            events = (
                self.client.api()
                .list_namespaced_event(self.client.namespace, field_selector="reason=FailedMount")
                .items
            )
        except Exception:  # noqa: BLE001 - no events to read: the deadline still holds
            return
        for e in events:
            obj = e.involved_object
            name = obj.name if obj else None
            if name in pods and obj.uid in (None, pods[name]) and "not found" in (e.message or ""):
                raise ProvisionError(f"pod {name} cannot mount a volume{self.events_suffix(name, uid=obj.uid)}")

    def check_pod(self, pod: Any) -> None:
        """Raise the pod's own error if it will never run: deleted, ended, unschedulable, or
        waiting for a reason that does not clear by itself."""
        status = pod.status
        name = pod.metadata.name
        if pod.metadata.deletion_timestamp is not None:
            raise self.deleted(name, pod.metadata.uid)
        if status is None:
            return
        if status.phase in ("Failed", "Succeeded"):
            raise self._lacks_sshd(pod) or ProvisionError(
                f"pod {name} {status.phase.lower()} before sshd came up{self.events_suffix(name, True)}"
            )
        for cond in status.conditions or []:
            if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
                raise ProvisionError(
                    f"pod {name} cannot be scheduled: {cond.message}{self._gpu_hint(cond.message)}"
                    f"{self.events_suffix(name)}"
                )
        for cs in status.container_statuses or []:
            waiting = cs.state.waiting if cs.state else None
            if waiting is not None and waiting.reason in FATAL_WAITING:
                raise ProvisionError(
                    f"pod {name}: {waiting.reason}: {waiting.message or ''}".rstrip(": ") + self.events_suffix(name)
                )

    def _gpu_hint(self, unschedulable: str | None) -> str:
        """Where the scheduler found no node matching the GPU selector: which label it was."""
        if self.gpu is None or "node affinity/selector" not in (unschedulable or ""):
            return ""
        return (
            f"; the pods need {self.gpu.describe()} ({', '.join(self.gpu.values)}): "
            f"see `kubectl get nodes -L {self.gpu.key}`, or name the key with --kube-gpu-label"
        )

    def _lacks_sshd(self, pod: Any) -> ProvisionError | None:
        """A pod whose image has no sshd, and which could not install one, said so in its log
        (BOOTSTRAP's NO_SSHD_MARKER line, with apt's reason): that and the fix are the error."""
        name = pod.metadata.name
        try:
            text = self.client.api().read_namespaced_pod_log(name, self.client.namespace, tail_lines=20)
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

    def events_suffix(self, pod: str, logs: bool = False, uid: str | None = None) -> str:
        """The pod's last events (and log): of this pod, by uid, not of an earlier one of its
        name (a cluster keeps events for an hour)."""
        api, ns = self.client.api(), self.client.namespace
        try:
            if uid is None:
                try:
                    uid = api.read_namespaced_pod(pod, ns).metadata.uid
                except Exception:  # noqa: BLE001 - gone: every event of the name, then
                    uid = None
            selector = f"involvedObject.name={pod}" + (f",involvedObject.uid={uid}" if uid else "")
            events = api.list_namespaced_event(ns, field_selector=selector)
            text = "; ".join(f"{e.reason}: {e.message}" for e in events.items[-3:] if e.message)
        except Exception:  # noqa: BLE001 - the error itself matters more than its garnish
            text = ""
        if logs:
            try:
                tail = api.read_namespaced_pod_log(pod, ns, tail_lines=3)
                text = (text + "; " if text else "") + "log: " + " | ".join(tail.strip().splitlines()[-3:])
            except Exception:  # noqa: BLE001
                pass
        return f" (events: {text})" if text else ""

    def explain_exec_failure(self, pod: str, within: float = 3.0) -> None:
        """An exec killed under us (exit 137) is most often a pod that just died: raise its own
        error (phase, events, log) once the API server has seen it, rather than the exec's."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                self.check_pod(self.client.api().read_namespaced_pod(pod, self.client.namespace))
            except kube_client.ApiException:
                return
            time.sleep(0.1)  # the kubelet reports the container's exit on its own schedule

    # -- sshd ------------------------------------------------------------------------------

    def wait_banners(self, pods: list[str]) -> None:
        """Ready means every pod's sshd has sent its banner through a port-forward."""
        deadline = time.monotonic() + self.ready_timeout
        unready: dict[str, Unready] = {}

        def one(pod: str) -> None:
            why = self._await_banner(pod, deadline)
            if why is not None:
                unready[pod] = why

        in_parallel(pods, one)
        if unready:
            pod, why = sorted(unready.items())[0]
            if why.whole:
                raise ProvisionError(why.message)
            raise ProvisionError(f"pod {pod}: {why.message}{self.events_suffix(pod, True)}")

    def _await_banner(self, pod: str, deadline: float) -> Unready | None:
        """Ask ``pod``'s sshd for its banner until ``deadline``; None once it answered."""
        last = ""
        while time.monotonic() < deadline:
            try:
                kube_proxy.read_banner(self.client.configuration(), self.client.namespace, pod, timeout=10)
                return None
            except Exception as exc:  # noqa: BLE001 - sshd still starting: keep asking
                refusal = Refusal.of(exc)
                if refusal.rbac is not None:  # asking again will not help
                    return Unready(f"pod {pod}: {refusal.line}", whole=True)
                last = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            try:  # a container that died will never answer: say so now, not at the deadline
                self.check_pod(self.client.api().read_namespaced_pod(pod, self.client.namespace))
            except ProvisionError as exc:
                return Unready(str(exc), whole=True)
            except kube_client.ApiException as exc:
                if exc.status == 404:  # gone: no banner will ever come
                    return Unready(str(self.deleted(pod)), whole=True)
            except Exception:  # noqa: BLE001 - the banner error above is the one to keep
                pass
            time.sleep(0.2)
        return Unready(f"sshd sent no banner within {self.ready_timeout:.0f} s ({last})", whole=False)
