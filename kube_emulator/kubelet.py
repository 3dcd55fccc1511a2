"""The emulated kubelet: every bound pod runs as a namespace node of the local backend.

A pod is a ``pytest_sky.backends.netns`` node (reached through ``product.py``) whose first
process is the container's command: its own network, UTS, mount and PID namespaces, one
veth into the emulator's bridge (``network.py``), a root filesystem of its own (a
copy-on-write layer over this machine's, as a container's writable layer over its image,
reset when the container restarts; the emulator's own state is hidden), a private ``/run``,
and the volumes and ``/etc`` files ``sandbox.py`` makes for it.  This module is the pod's
lifecycle: image pulls, mounts retried, the container started, restarted with back-off
under its restart policy, stopped for deletion; and the injected faults along the way.

Why nodes rather than containers: the emulator's pods must run the backend's real
start-up script and a real sshd, reachable by port-forward, as on a cluster; the local
backend's node primitive already does that in ~0.1 s per pod, with teardown that leaves
nothing (killing a PID namespace's first process ends every process in it).

Everything that blocks (``ip``, ``unshare``, waiting for the node's handshake) runs on a
thread pool; state changes happen on the server's event loop.  What was started is
recorded in the instance directory (``leftovers.py``), so a later emulator can reap the
leftovers of one that was SIGKILLed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kube_emulator import images, podstatus, product, pulling, store, termination
from kube_emulator.leftovers import EmulatorRecord, RecordedNode
from kube_emulator.network import PodNetwork
from kube_emulator.podexec import PodEntry
from kube_emulator.pods import PodHost, PodRuntime
from kube_emulator.product import NodeRecord, ProvisionError
from kube_emulator.sandbox import CreateError, MountError, Sandbox, Volumes
from kube_emulator.termination import Termination

log = logging.getLogger(__name__)


class Kubelet:
    """Runs the pods the scheduler bound, on one bridge for the whole emulated cluster.

    Its collaborators: ``network`` (the bridge and the pods' addresses), ``sandbox`` (what a
    pod's node is made of), ``entry`` (exec and port-forward into a running pod); status
    writes are ``podstatus``'s and the record a later emulator reaps is ``leftovers``'."""

    def __init__(self, cluster: PodHost, instance_dir: Path, mtu: int = 65535) -> None:
        self.cluster = cluster
        self.instance_dir = instance_dir
        self.network = PodNetwork(mtu)
        self.sandbox = Sandbox(cluster, self.network, instance_dir)
        self.entry = PodEntry()
        self.termination = Termination(cluster)
        self.runtimes: dict[str, PodRuntime] = {}  # by pod uid
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kubelet")
        self.kubeconfig: str = ""

    def start(self) -> None:
        """Check this machine can run pods, then lease the cluster's subnet.  The record comes
        first: the bridge's alias names the instance directory, and a reaper judges the bridge
        by the owner that directory's record names (one without a record is never judged)."""
        self.network.check()
        self.instance_dir.mkdir(parents=True, exist_ok=True)
        self.persist()
        self.network.lease(str(self.instance_dir))
        self.persist()

    def _set_container(self, rt: PodRuntime, **state: Any) -> None:
        podstatus.set_container(self.cluster.store, rt, **state)

    def persist(self) -> None:
        """What a later emulator needs to reap this one's leftovers after a SIGKILL."""
        nodes = tuple(
            RecordedNode(f"{rt.namespace}/{rt.name}", rt.node.veth, NodeRecord.of(rt.node))
            for rt in self.runtimes.values()
            if rt.node is not None
        )
        EmulatorRecord.of_this_process(self.network.bridge, self.kubeconfig, nodes).write(self.instance_dir)

    # -- pod lifecycle ----------------------------------------------------------------------

    def bind(self, pod: dict[str, Any]) -> None:
        """The scheduler bound ``pod`` to a node: start running it.  Runtimes are the pods'
        by uid: a pod created again under the same name runs beside its predecessor's
        container until the kubelet has stopped that one, as on a real node."""
        meta = pod["metadata"]
        if meta["uid"] in self.runtimes:
            return
        spec = pod["spec"]
        rt = PodRuntime(
            namespace=meta["namespace"],
            name=meta["name"],
            uid=meta["uid"],
            root=self.pod_root(meta["namespace"], meta["name"], meta["uid"]),
            node_name=spec["nodeName"],
            hostname=spec.get("hostname") or meta["name"][:63],
            subdomain=spec.get("subdomain") or "",
            bound_at=time.monotonic(),
        )
        self.runtimes[rt.uid] = rt
        loop = asyncio.get_running_loop()
        rt.task = loop.create_task(self._run(rt), name=f"pod {rt.key} {rt.uid[:8]}")
        rt.deadline_task = loop.create_task(self.termination.enforce_deadline(rt), name=f"deadline {rt.key}")

    def current(self, namespace: str, name: str) -> PodRuntime | None:
        """The runtime of the pod the API has under that name now (not a deleted predecessor's)."""
        pod = self.cluster.store.get("pods", namespace, name)
        return self.runtimes.get(pod["metadata"]["uid"]) if pod is not None else None

    def kill(self, uid: str, grace: float) -> bool:
        """The API deleted the pod (``grace`` 0: its object is gone already): stop its
        container, as :mod:`kube_emulator.termination` does.  False when the kubelet has
        nothing of it."""
        rt = self.runtimes.get(uid)
        if rt is None:
            return False
        self.termination.delete(rt, grace)
        return True

    async def shutdown(self) -> None:
        """Stop every pod, then remove the bridge and the instance directory."""
        tasks = []
        for rt in list(self.runtimes.values()):
            rt.deleting = rt.stopping = True
            rt.wake.set()
            termination.signal_node(rt)
            for waiting in (rt.stop_task, rt.deadline_task):
                if waiting is not None:
                    waiting.cancel()
            if rt.task is not None:
                tasks.append(rt.task)
        if tasks:
            await asyncio.wait(tasks, timeout=20)
        leftovers = [rt.node for rt in self.runtimes.values() if rt.node is not None]
        loop = asyncio.get_running_loop()
        if leftovers:
            await loop.run_in_executor(self.pool, product.stop_nodes, self.network.tools["ip"], leftovers)
        if self.network.bridge:
            await loop.run_in_executor(self.pool, product.delete_links, self.network.tools["ip"], [self.network.bridge])
            self.network.index = -1
        self.pool.shutdown(wait=False)
        self.entry.shutdown()
        shutil.rmtree(self.instance_dir, ignore_errors=True)

    async def _run(self, rt: PodRuntime) -> None:
        try:
            await self._lifecycle(rt)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("pod %s/%s failed in the emulated kubelet", rt.namespace, rt.name)
            self._set_container(rt, waiting={"reason": "RunContainerError", "message": str(exc)})
        finally:
            await self._after_container(rt)

    async def _after_container(self, rt: PodRuntime) -> None:
        """The pod's container has stopped for good: free what it held; a pod past its
        deadline is Failed; one the API deleted (or whose object is gone) loses its files,
        and its object goes (the kubelet's final delete of a gracefully deleted pod)."""
        if rt.node is not None:
            node, rt.node = rt.node, None
            self._close_pidfd(rt)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self.pool, product.stop_nodes, self.network.tools["ip"], [node])
        if rt.ip is not None:
            self.network.release_ip(rt.ip)
        self.runtimes.pop(rt.uid, None)
        if rt.deadline_task is not None:
            rt.deadline_task.cancel()
        self.persist()
        pod = self._pod(rt)
        if rt.deadline_exceeded and pod is not None and not rt.deleting:
            podstatus.set_failed(self.cluster.store, rt, termination.DEADLINE_REASON, termination.DEADLINE_MESSAGE)
        marked = pod is not None and bool(pod["metadata"].get("deletionTimestamp"))
        if rt.deleting or pod is None or marked:
            await asyncio.get_running_loop().run_in_executor(
                self.pool, lambda: shutil.rmtree(rt.root, ignore_errors=True)
            )
            self.cluster.pod_stopped_for_deletion(rt.namespace, rt.name, rt.uid)
        self.cluster.trigger_scheduler()

    def _pod(self, rt: PodRuntime) -> dict[str, Any] | None:
        return rt.pod_in(self.cluster.store)

    async def _lifecycle(self, rt: PodRuntime) -> None:
        pod = self._pod(rt)
        if pod is None:
            return
        podstatus.set_start_time(self.cluster.store, rt)
        container = pod["spec"]["containers"][0]
        if self.cluster.faults.matches("image_pull", pod):
            await pulling.pull_failure(self.cluster, rt, container)
            if rt.stopping:
                return
        view = images.lookup(container.get("image", ""))
        if view is None:  # the emulated registry has no such image: it never pulls
            await pulling.pull_failure(self.cluster, rt, container, unknown=True)
            return
        rt.view = view
        mounts = await self._mount_volumes(rt, container)
        if rt.stopping or mounts is None or await self._start_fault(rt):
            return
        rt.ip = self.network.allocate_ip()
        podstatus.modify(self.cluster.store, rt, lambda p: podstatus.set_ips(p, rt.ip, self.network.host_ip))
        first = True
        while not rt.stopping:
            code = await self._run_once(rt, container, mounts, first)
            first = False
            if rt.stopping or code is None:
                return
            rt.exits += 1
            pod = self._pod(rt)
            if pod is None:
                return
            policy = pod["spec"].get("restartPolicy") or "Always"
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                podstatus.set_phase_done(self.cluster.store, rt, code)
                return
            if rt.exits >= 2:
                await self._back_off(rt, pod, container["name"])
            with contextlib.suppress(OSError):
                os.replace(rt.log_path, rt.root / "node.log.previous")

    async def _mount_volumes(self, rt: PodRuntime, container: dict[str, Any]) -> Volumes | None:
        """The pod's volumes, retried while they fail, as the kubelet does (a Secret may come
        later); None when the pod is gone or being deleted, or its container cannot be created."""
        while not rt.stopping:
            pod = self._pod(rt)
            if pod is None:
                return None
            try:
                return self.sandbox.prepare_volumes(rt, pod, container)
            except MountError as exc:
                self.cluster.events.record(pod, "Warning", "FailedMount", str(exc), component="kubelet")
                self._set_container(rt, waiting={"reason": "ContainerCreating"})
                await rt.sleep(2.0)
            except CreateError as exc:
                self.cluster.events.record(pod, "Warning", "Failed", f"Error: {exc}", component="kubelet", container=0)
                self._set_container(rt, waiting={"reason": "CreateContainerError", "message": str(exc)})
                while not rt.stopping:
                    await rt.sleep(3600)
                return None
        return None

    async def _back_off(self, rt: PodRuntime, pod: dict[str, Any], cname: str) -> None:
        """CrashLoopBackOff: the kubelet's restart delay, doubling from 10 s to 5 min."""
        delay = min(10 * 2 ** (rt.exits - 2), 300)
        message = f"back-off {delay}s restarting failed container={cname} pod={rt.name}_{rt.namespace}({rt.uid})"
        self._set_container(rt, waiting={"reason": "CrashLoopBackOff", "message": message})
        self.cluster.events.record(
            pod,
            "Warning",
            "BackOff",
            f"Back-off restarting failed container {cname} in pod {rt.name}_{rt.namespace}({rt.uid})",
            component="kubelet",
            container=0,
        )
        await rt.sleep(delay)

    async def _start_fault(self, rt: PodRuntime) -> bool:
        """An injected fault between mounting the volumes and starting the container (see
        faults.py); True when the pod will not start (it waits, as a kubelet's does, until it
        is deleted)."""
        pod = self._pod(rt)
        faults = self.cluster.faults
        if pod is None:
            return True
        if faults.matches("delete_pod", pod):  # someone else's `kubectl delete pod`
            self.cluster.delete("pods", rt.namespace, rt.name)
            return True
        if faults.matches("create_container_config_error", pod):
            reason = "CreateContainerConfigError"
            message = 'secret "team-credentials" not found (injected by the kube emulator)'
            event = f"Error: {message}"
        elif faults.matches("run_container_error", pod):
            reason = "RunContainerError"
            message = (
                "failed to create containerd task: failed to create shim task: OCI runtime create failed: "
                "runc create failed: unable to start container process: error during container init: "
                'error mounting "/run/pytest-sky-secret" to rootfs: permission denied: unknown '
                "(injected by the kube emulator)"
            )
            event = f"Error: {message}"
        else:
            return False
        self.cluster.events.record(pod, "Warning", "Failed", event, component="kubelet", container=0)
        self._set_container(rt, waiting={"reason": reason, "message": message})
        while not rt.stopping:
            await rt.sleep(3600)
        return True

    async def _run_once(self, rt: PodRuntime, container: dict[str, Any], mounts: Volumes, first: bool) -> int | None:
        """Start the container's node and wait for its command to exit; its exit code."""
        pod = self._pod(rt)
        if pod is None:
            return None
        loop = asyncio.get_running_loop()
        if not first:  # a restarted container starts from its image again, as with containerd
            await loop.run_in_executor(self.pool, lambda: shutil.rmtree(rt.root / "layers", ignore_errors=True))
        spec = self.sandbox.node_spec(rt, pod, container, mounts)
        if first:
            image = container.get("image", "")
            self.cluster.events.record(
                pod,
                "Normal",
                "Pulled",
                f'Container image "{image}" already present on machine',
                component="kubelet",
                container=0,
            )
        node = await self._start_node(rt, pod, spec)
        if node is None:
            return 128
        rt.container_id = "containerd://" + hashlib.sha256(f"{rt.uid}/{rt.exits}".encode()).hexdigest()
        rt.started_at = store.now()
        self.cluster.events.record(
            pod, "Normal", "Created", f"Created container: {container['name']}", component="kubelet", container=0
        )
        self.cluster.events.record(
            pod, "Normal", "Started", f"Started container {container['name']}", component="kubelet", container=0
        )
        podstatus.set_running(self.cluster.store, rt, self.network.host_ip)
        code = await self._wait_exit(node)
        rt.node = None
        self._close_pidfd(rt)
        await loop.run_in_executor(self.pool, product.stop_nodes, self.network.tools["ip"], [node])
        self.persist()
        if not rt.deleting:  # a deleted pod's status is never written again
            self._set_container(
                rt,
                terminated={"exitCode": code, "reason": "Completed" if code == 0 else "Error"},
                running=False,
            )
        return code

    async def _start_node(
        self, rt: PodRuntime, pod: dict[str, Any], spec: product.NodeSpec
    ) -> product.NodeProcess | None:
        """The container's node, recorded in ``rt`` and on disk; None (and a StartError) when
        it cannot start, as a runtime that fails to create the task."""
        try:
            started = await asyncio.get_running_loop().run_in_executor(
                self.pool,
                lambda: product.start_nodes(
                    [spec],
                    bridge=self.network.bridge,
                    prefixlen=24,
                    subnet=self.network.subnet,
                    mtu=self.network.mtu,
                    tools=self.network.tools,
                ),
            )
        except ProvisionError as exc:
            message = f"failed to create containerd task: {exc}"
            self.cluster.events.record(pod, "Warning", "Failed", f"Error: {message}", component="kubelet", container=0)
            self._set_container(
                rt,
                terminated={"exitCode": 128, "reason": "StartError", "message": message},
                running=False,
            )
            return None
        node = started[0]
        rt.node = node
        try:
            rt.init_pidfd = os.pidfd_open(node.init_pid) if node.init_pid else None
        except OSError:
            rt.init_pidfd = None
        self.persist()
        if rt.stopping:
            termination.signal_node(rt)
        return node

    def _close_pidfd(self, rt: PodRuntime) -> None:
        if rt.init_pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(rt.init_pidfd)
            rt.init_pidfd = None

    async def _wait_exit(self, node: product.NodeProcess) -> int:
        """The node's exit code, woken by a pidfd on its keeper (no polling), which writes its
        first process's status as it ends: a signal N is 128 + N, as a container runtime
        reports it, and a keeper killed before it could say is a SIGKILL."""
        loop = asyncio.get_running_loop()
        fd = os.pidfd_open(node.pid)
        done = loop.create_future()
        loop.add_reader(fd, lambda: done.done() or done.set_result(None))
        try:
            await done
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        code = node.exit_code()
        if code is None:
            code = -signal.SIGKILL
        return 128 - code if code < 0 else code

    # -- exec, port-forward, logs -----------------------------------------------------------

    def running(self, namespace: str, name: str) -> PodRuntime | None:
        """The current pod of that name, while its container runs and is not being stopped."""
        rt = self.current(namespace, name)
        if rt is None or rt.node is None or rt.stopping:
            return None
        return rt

    def pod_root(self, namespace: str, name: str, uid: str) -> Path:
        """A pod's directory (its node root: etc/, home/, volumes/, node.log); the uid keeps
        a re-created pod of the same name away from its predecessor's files."""
        return self.instance_dir / "pods" / namespace / f"{name}-{uid[:8]}"

    def discard_files(self, namespace: str, name: str, uid: str) -> None:
        """A deleted pod that was not running any more: remove its directory in the background."""
        root = self.pod_root(namespace, name, uid)
        if root.exists():
            asyncio.get_running_loop().run_in_executor(self.pool, lambda: shutil.rmtree(root, ignore_errors=True))

    def log_file(self, namespace: str, name: str, uid: str, previous: bool) -> Path:
        root = self.pod_root(namespace, name, uid)
        return root / ("node.log.previous" if previous else "node.log")
