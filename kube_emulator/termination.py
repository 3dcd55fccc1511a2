"""How the kubelet stops a pod's container: for its deletion, and at its active deadline.

A real kubelet learns of a deletion through its watch and acts on its own schedule
(``kubelet_delay`` here, a fault the tests set): it records a ``Killing`` event, sends the
container's first process SIGTERM (which reaches a PID namespace's init only if it handles
it) and SIGKILL once the grace period is over, never under ``minimumGracePeriodInSeconds``
(2 s, pkg/kubelet/kuberuntime/kuberuntime_manager.go, Kubernetes 1.31-1.35).  A pod past its
``activeDeadlineSeconds`` is stopped the same way, with its own grace period, by the kubelet's
activeDeadlineHandler (pkg/kubelet/active_deadline.go): a Normal event ``DeadlineExceeded``,
and the pod ends Failed with that reason, never restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

from kube_emulator.pods import PodHost, PodRuntime

MINIMUM_GRACE_SECONDS = 2.0
DEADLINE_REASON = "DeadlineExceeded"
DEADLINE_MESSAGE = "Pod was active on the node longer than the specified deadline"
#: How often a running pod's spec is read again for a deadline set or shortened meanwhile.
DEADLINE_RECHECK_SECONDS = 5.0


def signal_node(rt: PodRuntime, signum: int = signal.SIGKILL) -> None:
    """Signal the pod's first process through its pidfd (never a recycled pid): a SIGKILL
    ends its whole PID namespace."""
    if rt.init_pidfd is not None:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(rt.init_pidfd, signum)


class Termination:
    """Stops the containers of the pods a kubelet runs, when and as a kubelet does."""

    def __init__(self, host: PodHost) -> None:
        self.host = host

    def delete(self, rt: PodRuntime, grace: float) -> None:
        """The API deleted ``rt``'s pod (``grace`` 0: its object is gone already): stop its
        container ``kubelet_delay`` seconds from now; a later, shorter grace period counts."""
        rt.deleting = True
        rt.grace = grace if rt.grace is None else min(grace, rt.grace)
        if rt.stop_task is None:
            delay = self.host.faults.kubelet_delay or 0.0
            rt.stop_task = asyncio.get_running_loop().create_task(self.stop(rt, delay), name=f"stop {rt.key}")

    async def stop(self, rt: PodRuntime, delay: float) -> None:
        """After ``delay``: a ``Killing`` event, SIGTERM, and SIGKILL when the grace period ends."""
        if delay > 0:
            await asyncio.sleep(delay)
        pod = self.host.store.get("pods", rt.namespace, rt.name)
        if pod is not None and pod["metadata"]["uid"] == rt.uid:
            cname = pod["spec"]["containers"][0]["name"]
            self.host.events.record(
                pod, "Normal", "Killing", f"Stopping container {cname}", component="kubelet", container=0
            )
        rt.stopping = True
        rt.wake.set()
        signal_node(rt, signal.SIGTERM)
        if rt.task is None:
            return
        _, running = await asyncio.wait({rt.task}, timeout=max(rt.grace or 0.0, MINIMUM_GRACE_SECONDS))
        if running:
            signal_node(rt)

    async def enforce_deadline(self, rt: PodRuntime) -> None:
        """Stop ``rt``'s container once its pod has been active ``activeDeadlineSeconds``
        since the kubelet took it (its startTime); the spec is read again as time passes."""
        while not rt.stopping:
            pod = self._pod(rt)
            if pod is None:
                return
            deadline = pod["spec"].get("activeDeadlineSeconds")
            left = DEADLINE_RECHECK_SECONDS
            if deadline is not None:
                left = rt.bound_at + float(deadline) - time.monotonic()
                if left <= 0:
                    break
            await asyncio.sleep(min(left, DEADLINE_RECHECK_SECONDS))
        pod = self._pod(rt)
        if rt.stopping or pod is None:
            return
        self.host.events.record(pod, "Normal", DEADLINE_REASON, DEADLINE_MESSAGE, component="kubelet")
        rt.deadline_exceeded = True
        rt.grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
        if rt.stop_task is None:
            rt.stop_task = asyncio.get_running_loop().create_task(self.stop(rt, 0.0), name=f"stop {rt.key}")

    def _pod(self, rt: PodRuntime) -> dict | None:
        return rt.pod_in(self.host.store)
