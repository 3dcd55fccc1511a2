"""An image pull that fails, as the kubelet reports it: ErrImagePull, then ImagePullBackOff.

For an image the emulated registry lacks (``images.py``) until the pod is deleted; for one an
injected ``image_pull`` fault names, while the fault holds.
"""

from __future__ import annotations

from typing import Any

from kube_emulator import images, podstatus
from kube_emulator.pods import PodHost, PodRuntime


async def pull_failure(host: PodHost, rt: PodRuntime, container: dict[str, Any], unknown: bool = False) -> None:
    """ErrImagePull, then ImagePullBackOff with growing back-off, while the fault holds
    (for an image the emulated registry does not have: until the pod is deleted)."""
    image = container.get("image", "")
    why = f"the kube emulator has only {images.KNOWN}" if unknown else "injected by the kube emulator"
    delay = 1.0
    while not rt.stopping:
        pod = rt.pod_in(host.store)
        if pod is None or not (unknown or host.faults.matches("image_pull", pod)):
            return
        msg = (
            f'Failed to pull image "{image}": rpc error: code = NotFound desc = failed to pull and unpack '
            f'image "{image}": not found ({why})'
        )
        rec = host.events.record
        rec(pod, "Normal", "Pulling", f'Pulling image "{image}"', component="kubelet", container=0)
        rec(pod, "Warning", "Failed", msg, component="kubelet", container=0)
        rec(pod, "Warning", "Failed", "Error: ErrImagePull", component="kubelet", container=0)
        podstatus.set_container(host.store, rt, waiting={"reason": "ErrImagePull", "message": msg})
        await rt.sleep(min(delay, 1.0))
        if rt.stopping or rt.pod_in(host.store) is None:
            return
        rec(pod, "Normal", "BackOff", f'Back-off pulling image "{image}"', component="kubelet", container=0)
        rec(pod, "Warning", "Failed", "Error: ImagePullBackOff", component="kubelet", container=0)
        podstatus.set_container(
            host.store,
            rt,
            waiting={"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{image}"'},
        )
        await rt.sleep(delay)
        delay = min(delay * 2, 30.0)
