"""The emulated kubelet: every bound pod runs as a namespace node of the local backend.

A pod is a ``pytest_sky.backends.netns`` node (reached through ``product.py``) whose first
process is the container's command: its own network, UTS, mount and PID namespaces, one
veth into the emulator's bridge (one /24 of 198.18.0.0/15 for the whole emulated cluster,
leased race-free the way the local backend leases its subnets), a root filesystem of its own (a copy-on-write layer
over this machine's, as a container's writable layer over its image, reset when the
container restarts; the emulator's own state is hidden), a private ``/run``, and
bind-mounted ``/etc/passwd``
(root's home is the pod's own directory), ``/etc/hosts`` (the pod's own entry only, as the
kubelet writes it) and ``/etc/resolv.conf`` (the emulator's cluster DNS, ``dns.py``, with
the namespace's search path): peers resolve through DNS, as on a real cluster.  Secret
volumes are written to a host directory and bind-mounted read-only.

Why nodes rather than containers: the emulator's pods must run the backend's real
start-up script and a real sshd, reachable by port-forward, as on a cluster; the local
backend's node primitive already does that in ~0.1 s per pod, with teardown that leaves
nothing (killing a PID namespace's first process ends every process in it).

Everything that blocks (``ip``, ``unshare``, waiting for the node's handshake) runs on a
thread pool; state changes happen on the server's event loop.  What was started is
recorded in ``emulator.json`` in the instance directory, so a later emulator can reap the
leftovers of one that was SIGKILLed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import pty
import random
import shutil
import signal
import socket
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kube_emulator import dns, images, product
from kube_emulator.faults import Faults
from kube_emulator.product import Confinement, ProvisionError
from kube_emulator.store import Obj, Store

log = logging.getLogger(__name__)

NUM_SUBNETS = 512  # 198.18.0.0/15 in /24s, shared with the local backend's leases
RECORD = "emulator.json"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def subnet_of(index: int) -> tuple[str, str]:
    base = f"198.{18 + index // 256}.{index % 256}."
    return base + "0/24", base


def image_path() -> str:
    """The PATH a container starts with: the emulator's own interpreter first, as if the
    image shipped the Python (and torch) this machine's tests run with."""
    bindir = os.path.dirname(sys.executable)
    return f"{bindir}:{DEFAULT_PATH}"


@dataclass
class Volumes:
    """A container's volume mounts, host directory -> path in the pod."""

    ro: dict[str, str] = field(default_factory=dict)  # Secrets
    rw: dict[str, str] = field(default_factory=dict)  # claims, emptyDirs


class MountError(Exception):
    """A volume cannot be set up (FailedMount; retried, as the kubelet does)."""


class CreateError(Exception):
    """The container cannot be created at all (CreateContainerError; not retried)."""


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
    deleting: bool = False
    exits: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    container_id: str = ""
    started_at: str = ""
    view: images.ImageView = field(default_factory=lambda: images.ImageView(name=""))
    #: What the container's processes hold (its securityContext's), exec sessions too.
    confinement: Confinement = field(default_factory=product.for_node)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def log_path(self) -> Path:
        return self.root / "node.log"

    async def sleep(self, seconds: float) -> None:
        """Sleep, but wake at once when the pod is being deleted."""
        self.wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wake.wait(), seconds)


def socket_in_netns(pid: int, family: int) -> socket.socket:
    """A TCP socket created inside the network namespace of ``pid``.

    A socket keeps the namespace it was created in, so the thread may switch back at once;
    connecting it to 127.0.0.1 then reaches the pod's own loopback, which is what a real
    kubelet's port-forward dials.  Runs on a dedicated thread: setns(2) changes only the
    calling thread's namespace.
    """
    host = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    except OSError:
        os.close(host)
        raise
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        finally:
            if _libc.setns(host, CLONE_NEWNET) != 0:  # pragma: no cover - cannot happen for our own ns
                os._exit(70)
        sock.setblocking(False)
        return sock
    finally:
        os.close(target)
        os.close(host)


class PodHost(Protocol):
    """What the kubelet needs of the API side (``cluster.Cluster``): written out here so the
    kubelet sits below the cluster that owns it, as a real kubelet talks to an API server it
    does not import."""

    store: Store
    faults: Faults
    dns: dns.DnsServer

    def now(self) -> str: ...

    def record_event(
        self, obj: Obj, type_: str, reason: str, message: str, *, component: str, container: int | None = None
    ) -> None: ...

    def delete(self, resource: str, namespace: str, name: str, options: dict[str, Any] | None = None) -> Obj: ...

    def pod_stopped_for_deletion(self, namespace: str, name: str, uid: str) -> None: ...

    def trigger_scheduler(self) -> None: ...


class Kubelet:
    """Runs the pods the scheduler bound, on one bridge for the whole emulated cluster."""

    def __init__(self, cluster: PodHost, instance_dir: Path, mtu: int = 65535) -> None:
        self.cluster = cluster
        self.instance_dir = instance_dir
        self.mtu = mtu
        self.tools: dict[str, str] = {}
        self.index = -1
        self.bridge = ""
        self.subnet = ""
        self.base = ""
        self.runtimes: dict[tuple[str, str], PodRuntime] = {}
        self.used_ips: set[int] = set()
        self.last_ip = 1  # the last octet handed out (the bridge is .1)
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kubelet")
        self.netns_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kubelet-netns")
        self.nsenter = shutil.which("nsenter", path="/usr/bin:/bin:/usr/sbin:/sbin") or "nsenter"
        self.setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin") or "setpriv"
        self.setsid = shutil.which("setsid", path="/usr/bin:/bin:/usr/sbin:/sbin") or "setsid"
        self.kubeconfig: str = ""

    # -- network ----------------------------------------------------------------------------

    def start(self) -> None:
        """Lease a subnet by creating its bridge (atomic in the kernel), as the local backend does."""
        product.require_privileges()
        self.tools = product.require_tools()
        product.check_forward_policy()
        self.instance_dir.mkdir(parents=True, exist_ok=True)
        start = random.randrange(NUM_SUBNETS)
        for step in range(NUM_SUBNETS):
            index = (start + step) % NUM_SUBNETS
            name = f"{product.LINK_PREFIX}{index}"
            if product.link_exists(name):
                continue
            subnet, base = subnet_of(index)
            if product.create_bridge(self.tools["ip"], name, base + "1", 24, subnet, self.mtu, str(self.instance_dir)):
                self.index, self.bridge, self.subnet, self.base = index, name, subnet, base
                self.persist()
                return
        raise ProvisionError("all 512 subnets of 198.18.0.0/15 are in use (look for psky* links with `ip link`)")

    @property
    def host_ip(self) -> str:
        return self.base + "1"

    def _alloc_ip(self) -> int:
        """The next free address after the last one handed out, as the host-local IPAM of a
        real CNI allocates: a pod deleted and created again (same name) gets a new address,
        never its old one straight back, so nothing may assume a pod keeps its IP."""
        for step in range(1, 254):
            octet = 2 + (self.last_ip - 2 + step) % 253
            if octet not in self.used_ips:
                self.used_ips.add(octet)
                self.last_ip = octet
                return octet
        raise ProvisionError("the emulated cluster's /24 has no free pod address (253 pods at most)")

    def persist(self) -> None:
        """What a later emulator needs to reap this one's leftovers after a SIGKILL."""
        nodes = {}
        for rt in self.runtimes.values():
            if rt.node is not None:
                nodes[f"{rt.namespace}/{rt.name}"] = {
                    "pid": rt.node.pid,
                    "init_pid": rt.node.init_pid,
                    "start_time": product.start_time(rt.node.pid),
                    "veth": rt.node.veth,
                }
        record = {
            "pid": os.getpid(),
            "start_time": product.start_time(os.getpid()),
            "bridge": self.bridge,
            "kubeconfig": self.kubeconfig,
            "nodes": nodes,
        }
        tmp = self.instance_dir / (RECORD + ".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, self.instance_dir / RECORD)

    # -- pod lifecycle ----------------------------------------------------------------------

    def bind(self, pod: dict[str, Any]) -> None:
        """The scheduler bound ``pod`` to a node: start running it."""
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        if key in self.runtimes:
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
        )
        self.runtimes[key] = rt
        rt.task = asyncio.get_running_loop().create_task(self._run(rt), name=f"pod {key}")

    def kill(self, namespace: str, name: str) -> bool:
        """Stop a pod being deleted; False when the kubelet has nothing of it (delete at once)."""
        rt = self.runtimes.get((namespace, name))
        if rt is None:
            return False
        rt.deleting = True
        rt.wake.set()
        self._signal_node(rt)
        return True

    def _signal_node(self, rt: PodRuntime) -> None:
        """SIGKILL the pod's first process (through its pidfd: never a recycled pid), which
        ends its whole PID namespace."""
        if rt.init_pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(rt.init_pidfd, signal.SIGKILL)

    async def shutdown(self) -> None:
        """Stop every pod, then remove the bridge and the instance directory."""
        tasks = []
        for rt in list(self.runtimes.values()):
            rt.deleting = True
            rt.wake.set()
            self._signal_node(rt)
            if rt.task is not None:
                tasks.append(rt.task)
        if tasks:
            await asyncio.wait(tasks, timeout=20)
        leftovers = [rt.node for rt in self.runtimes.values() if rt.node is not None]
        loop = asyncio.get_running_loop()
        if leftovers:
            await loop.run_in_executor(self.pool, product.stop_nodes, self.tools["ip"], leftovers)
        if self.bridge:
            await loop.run_in_executor(self.pool, product.delete_links, self.tools["ip"], [self.bridge])
            self.bridge = ""
        self.pool.shutdown(wait=False)
        self.netns_pool.shutdown(wait=False)
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
            if rt.node is not None:
                node, rt.node = rt.node, None
                self._close_pidfd(rt)
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self.pool, product.stop_nodes, self.tools["ip"], [node])
            if rt.ip is not None:
                self.used_ips.discard(int(rt.ip.rsplit(".", 1)[1]))
            self.runtimes.pop(rt.key, None)
            self.persist()
            if rt.deleting:
                await asyncio.get_running_loop().run_in_executor(
                    self.pool, lambda: shutil.rmtree(rt.root, ignore_errors=True)
                )
                self.cluster.pod_stopped_for_deletion(rt.namespace, rt.name, rt.uid)
            self.cluster.trigger_scheduler()

    def _pod(self, rt: PodRuntime) -> dict[str, Any] | None:
        pod = self.cluster.store.get("pods", rt.namespace, rt.name)
        if pod is None or pod["metadata"]["uid"] != rt.uid:
            return None
        return pod

    async def _lifecycle(self, rt: PodRuntime) -> None:
        pod = self._pod(rt)
        if pod is None:
            return
        container = pod["spec"]["containers"][0]
        if self.cluster.faults.matches("image_pull", pod):
            await self._image_pull_failure(rt, container)
            if rt.deleting:
                return
        view = images.lookup(container.get("image", ""))
        if view is None:  # the emulated registry has no such image: it never pulls
            await self._image_pull_failure(rt, container, unknown=True)
            return
        rt.view = view
        mounts = await self._mount_volumes(rt, container)
        if rt.deleting or mounts is None or await self._start_fault(rt):
            return
        rt.ip = self.base + str(self._alloc_ip())
        self.cluster.store.modify("pods", rt.namespace, rt.name, lambda p: _set_ips(p, rt.ip, self.host_ip))
        first = True
        while not rt.deleting:
            code = await self._run_once(rt, container, mounts, first)
            first = False
            if rt.deleting or code is None:
                return
            rt.exits += 1
            pod = self._pod(rt)
            if pod is None:
                return
            policy = pod["spec"].get("restartPolicy") or "Always"
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                self._set_phase_done(rt, code)
                return
            if rt.exits >= 2:
                await self._back_off(rt, pod, container["name"])
            with contextlib.suppress(OSError):
                os.replace(rt.log_path, rt.root / "node.log.previous")

    async def _mount_volumes(self, rt: PodRuntime, container: dict[str, Any]) -> Volumes | None:
        """The pod's volumes, retried while they fail, as the kubelet does (a Secret may come
        later); None when the pod is gone or being deleted, or its container cannot be created."""
        while not rt.deleting:
            pod = self._pod(rt)
            if pod is None:
                return None
            try:
                return self._prepare_volumes(rt, pod, container)
            except MountError as exc:
                self.cluster.record_event(pod, "Warning", "FailedMount", str(exc), component="kubelet")
                self._set_container(rt, waiting={"reason": "ContainerCreating"})
                await rt.sleep(2.0)
            except CreateError as exc:
                self.cluster.record_event(pod, "Warning", "Failed", f"Error: {exc}", component="kubelet", container=0)
                self._set_container(rt, waiting={"reason": "CreateContainerError", "message": str(exc)})
                while not rt.deleting:
                    await rt.sleep(3600)
                return None
        return None

    async def _back_off(self, rt: PodRuntime, pod: dict[str, Any], cname: str) -> None:
        """CrashLoopBackOff: the kubelet's restart delay, doubling from 10 s to 5 min."""
        delay = min(10 * 2 ** (rt.exits - 2), 300)
        message = f"back-off {delay}s restarting failed container={cname} pod={rt.name}_{rt.namespace}({rt.uid})"
        self._set_container(rt, waiting={"reason": "CrashLoopBackOff", "message": message})
        self.cluster.record_event(
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
        self.cluster.record_event(pod, "Warning", "Failed", event, component="kubelet", container=0)
        self._set_container(rt, waiting={"reason": reason, "message": message})
        while not rt.deleting:
            await rt.sleep(3600)
        return True

    async def _image_pull_failure(self, rt: PodRuntime, container: dict[str, Any], unknown: bool = False) -> None:
        """ErrImagePull, then ImagePullBackOff with growing back-off, while the fault holds
        (for an image the emulated registry does not have: until the pod is deleted)."""
        image = container.get("image", "")
        why = f"the kube emulator has only {images.KNOWN}" if unknown else "injected by the kube emulator"
        delay = 1.0
        while not rt.deleting:
            pod = self._pod(rt)
            if pod is None or not (unknown or self.cluster.faults.matches("image_pull", pod)):
                return
            msg = (
                f'Failed to pull image "{image}": rpc error: code = NotFound desc = failed to pull and unpack '
                f'image "{image}": not found ({why})'
            )
            rec = self.cluster.record_event
            rec(pod, "Normal", "Pulling", f'Pulling image "{image}"', component="kubelet", container=0)
            rec(pod, "Warning", "Failed", msg, component="kubelet", container=0)
            rec(pod, "Warning", "Failed", "Error: ErrImagePull", component="kubelet", container=0)
            self._set_container(rt, waiting={"reason": "ErrImagePull", "message": msg})
            await rt.sleep(min(delay, 1.0))
            if rt.deleting or self._pod(rt) is None:
                return
            rec(pod, "Normal", "BackOff", f'Back-off pulling image "{image}"', component="kubelet", container=0)
            rec(pod, "Warning", "Failed", "Error: ImagePullBackOff", component="kubelet", container=0)
            self._set_container(
                rt, waiting={"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{image}"'}
            )
            await rt.sleep(delay)
            delay = min(delay * 2, 30.0)

    def _prepare_volumes(self, rt: PodRuntime, pod: dict[str, Any], container: dict[str, Any]) -> Volumes:
        """Write each mounted Secret volume into the pod's directory; find each claim's
        directory (shared by every pod that mounts the claim); host dir -> mount path."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        if volumes and self.cluster.faults.matches("failed_mount", pod):
            name, vol = next(iter(volumes.items()))
            kind, missing = ("secret", vol["secret"].get("secretName")) if "secret" in vol else ("volume", name)
            raise MountError(
                f'MountVolume.SetUp failed for volume "{name}" : {kind} "{missing}" not found '
                "(injected by the kube emulator)"
            )
        mounts = Volumes()
        for vm in container.get("volumeMounts") or []:
            vol = volumes.get(vm["name"], {})
            path = vm["mountPath"]
            if "persistentVolumeClaim" in vol:
                mounts.rw[str(self._claim_dir(rt, vol, vm.get("subPath") or ""))] = path
                continue
            if vm.get("subPath"):
                raise CreateError(f"the kube emulator supports subPath only on claims ({vm['name']} at {path})")
            if "secret" in vol:  # a pod's root is its own: the mount point is made in it
                mounts.ro[str(self._write_secret_volume(rt, vol))] = path
            elif "emptyDir" in vol:  # the pod's own, empty at first, gone with the pod
                target = rt.root / "volumes" / vm["name"]
                target.mkdir(parents=True, exist_ok=True)
                mounts.rw[str(target)] = path
            else:
                kinds = sorted(set(vol) - {"name"}) or ["(missing)"]
                raise CreateError(
                    f"volume {vm['name']}: the kube emulator supports secret, emptyDir and persistentVolumeClaim, "
                    f"not {kinds}"
                )
        return mounts

    def _claim_dir(self, rt: PodRuntime, vol: dict[str, Any], sub_path: str) -> Path:
        """A bound claim's storage: one directory of the emulator's per claim (a ReadWriteMany
        volume every pod that mounts it shares), ``subPath`` made inside it as a kubelet does."""
        name = vol["persistentVolumeClaim"].get("claimName", "")
        if self.cluster.store.get("persistentvolumeclaims", rt.namespace, name) is None:
            raise MountError(f'persistentvolumeclaim "{name}" not found')
        if sub_path.startswith("/") or ".." in sub_path.split("/"):
            raise CreateError(f"subPath {sub_path!r} must be a relative path without '..'")
        target = self.instance_dir / "claims" / rt.namespace / name / sub_path
        target.mkdir(parents=True, exist_ok=True)
        return target

    def _write_secret_volume(self, rt: PodRuntime, vol: dict[str, Any]) -> Path:
        source = vol["secret"]
        secret_name = source.get("secretName", "")
        secret = self.cluster.store.get("secrets", rt.namespace, secret_name)
        target = rt.root / "volumes" / vol["name"]
        if secret is None:
            if source.get("optional"):
                target.mkdir(parents=True, exist_ok=True)
                return target
            raise MountError(f'MountVolume.SetUp failed for volume "{vol["name"]}" : secret "{secret_name}" not found')
        data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
        default_mode = int(source.get("defaultMode", 0o644))
        files: list[tuple[str, bytes, int]] = []
        if source.get("items"):
            for item in source["items"]:
                if item["key"] not in data:
                    if source.get("optional"):
                        continue
                    raise MountError(
                        f'MountVolume.SetUp failed for volume "{vol["name"]}" : '
                        f"configmap references non-existent config key: {item['key']}"
                    )
                files.append((item["path"], data[item["key"]], int(item.get("mode", default_mode))))
        else:
            files = [(k, v, default_mode) for k, v in data.items()]
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True, mode=0o755)
        for rel, content, mode in files:
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode & 0o777)
            with os.fdopen(fd, "wb") as fh:
                fh.write(content)
            os.chmod(dest, mode & 0o777)
        return target

    def _container_env(self, rt: PodRuntime, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        env = {"PATH": image_path(), "HOSTNAME": rt.hostname, "HOME": product.NODE_HOME}
        for source in container.get("envFrom") or []:
            ref = source.get("secretRef")
            if ref:
                secret = self.cluster.store.get("secrets", rt.namespace, ref.get("name", "")) or {}
                for k, v in (secret.get("data") or {}).items():
                    env[source.get("prefix", "") + k] = base64.b64decode(v).decode(errors="replace")
        fields = {
            "metadata.name": rt.name,
            "metadata.namespace": rt.namespace,
            "metadata.uid": rt.uid,
            "spec.nodeName": rt.node_name,
            "status.podIP": rt.ip or "",
            "status.hostIP": self.host_ip,
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
        }
        for item in container.get("env") or []:
            value = item.get("value")
            ref = item.get("valueFrom") or {}
            if "fieldRef" in ref:
                value = fields.get(ref["fieldRef"].get("fieldPath", ""), "")
            elif "secretKeyRef" in ref:
                sref = ref["secretKeyRef"]
                secret = self.cluster.store.get("secrets", rt.namespace, sref.get("name", "")) or {}
                raw = (secret.get("data") or {}).get(sref.get("key", ""))
                value = base64.b64decode(raw).decode(errors="replace") if raw is not None else ""
            env[item["name"]] = value or ""
        env["HOME"] = product.NODE_HOME  # root's home: the pod's own directory, mounted there
        return env

    def _node_spec(
        self, rt: PodRuntime, pod: dict[str, Any], container: dict[str, Any], mounts: Volumes
    ) -> product.NodeSpec:
        (rt.root / "etc").mkdir(parents=True, exist_ok=True, mode=0o755)
        home = rt.root / "home"
        home.mkdir(exist_ok=True, mode=0o700)
        (rt.root / "etc" / "passwd").write_text(product.passwd_with_home())
        hosts = rt.root / "etc" / "hosts"
        hosts.write_text(self._hosts_for(rt))
        (rt.root / "etc" / "resolv.conf").write_text(dns.resolv_conf(self.cluster.dns.address, rt.namespace))
        for name in ("passwd", "hosts", "resolv.conf"):
            os.chmod(rt.root / "etc" / name, 0o644)
        command = list(container.get("command") or []) + list(container.get("args") or [])
        if not command:
            command = ["sleep", "infinity"]  # no image metadata here: an idle container
        if self.cluster.faults.matches("crash", pod):
            command = ["/bin/sh", "-c", "echo 'kube emulator: injected crash' >&2; exit 1"]
        rt.workdir = container.get("workingDir") or "/"
        rt.env = self._container_env(rt, pod, container)
        # What a runtime makes of the pod's securityContexts, carried out by the node's init
        # as for a local node (one definition, ``privileges``).
        rt.confinement = product.confinement(pod["spec"].get("securityContext"), container.get("securityContext"))
        # The node inherits the emulator's cwd; a container starts in its workingDir.
        command = ["/bin/sh", "-c", 'cd -- "$0" && exec "$@"', rt.workdir, *command]
        octet = rt.ip.rsplit(".", 1)[1] if rt.ip else "0"
        return product.NodeSpec(
            hostname=rt.hostname,
            ip=rt.ip or "",
            root=rt.root,
            veth=f"{product.LINK_PREFIX}{self.index}p{octet}",
            extra_mounts=mounts.ro,
            shared_mounts=mounts.rw,
            command=command,
            env=rt.env,
            cgroup_mode="ro",  # a pod's cgroupfs is read-only, as containerd mounts it
            # The container's own writable layer over the "image" (this machine's files, less
            # what the image lacks), and none of the emulator's state (other pods' files,
            # their Secrets) in sight.
            layers=rt.root / "layers",
            hide=[self.instance_dir, *map(Path, rt.view.absent_dirs), *map(Path, rt.view.absent_files)],
            confinement=rt.confinement,
        )

    async def _run_once(self, rt: PodRuntime, container: dict[str, Any], mounts: Volumes, first: bool) -> int | None:
        """Start the container's node and wait for its command to exit; its exit code."""
        pod = self._pod(rt)
        if pod is None:
            return None
        loop = asyncio.get_running_loop()
        if not first:  # a restarted container starts from its image again, as with containerd
            await loop.run_in_executor(self.pool, lambda: shutil.rmtree(rt.root / "layers", ignore_errors=True))
        spec = self._node_spec(rt, pod, container, mounts)
        if first:
            image = container.get("image", "")
            self.cluster.record_event(
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
        rt.started_at = self.cluster.now()
        self.cluster.record_event(
            pod, "Normal", "Created", f"Created container: {container['name']}", component="kubelet", container=0
        )
        self.cluster.record_event(
            pod, "Normal", "Started", f"Started container {container['name']}", component="kubelet", container=0
        )
        self._set_running(rt)
        code = await self._wait_exit(node)
        rt.node = None
        self._close_pidfd(rt)
        await loop.run_in_executor(self.pool, product.stop_nodes, self.tools["ip"], [node])
        self.persist()
        if not rt.deleting:
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
                    [spec], bridge=self.bridge, prefixlen=24, subnet=self.subnet, mtu=self.mtu, tools=self.tools
                ),
            )
        except ProvisionError as exc:
            message = f"failed to create containerd task: {exc}"
            self.cluster.record_event(pod, "Warning", "Failed", f"Error: {message}", component="kubelet", container=0)
            self._set_container(
                rt, terminated={"exitCode": 128, "reason": "StartError", "message": message}, running=False
            )
            return None
        node = started[0]
        rt.node = node
        try:
            rt.init_pidfd = os.pidfd_open(node.init_pid) if node.init_pid else None
        except OSError:
            rt.init_pidfd = None
        self.persist()
        if rt.deleting:
            self._signal_node(rt)
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

    # -- status -----------------------------------------------------------------------------

    def _container_status(self, pod: dict[str, Any], rt: PodRuntime, **state: Any) -> dict[str, Any]:
        container = pod["spec"]["containers"][0]
        image = container.get("image", "")
        pulled = bool(rt.container_id)
        return {
            "name": container["name"],
            "image": image,
            "imageID": f"{image}@sha256:{hashlib.sha256(image.encode()).hexdigest()}" if pulled else "",
            **state,
        }

    def _set_container(
        self,
        rt: PodRuntime,
        *,
        waiting: dict[str, Any] | None = None,
        terminated: dict[str, Any] | None = None,
        running: bool = False,
    ) -> None:
        now = self.cluster.now()

        def mutate(pod: dict[str, Any]) -> None:
            status = pod.setdefault("status", {})
            previous = (status.get("containerStatuses") or [{}])[0]
            last_state = previous.get("lastState") or {}
            restarts = previous.get("restartCount", 0)
            if waiting is not None:
                state: dict[str, Any] = {"waiting": waiting}
                if previous.get("state", {}).get("terminated"):
                    last_state = {"terminated": previous["state"]["terminated"]}
            else:
                term = {
                    "startedAt": rt.started_at or None,
                    "finishedAt": now,
                    "containerID": rt.container_id or None,
                    **(terminated or {}),
                }
                state = {"terminated": term}
            cs = self._container_status(
                pod,
                rt,
                ready=False,
                started=False,
                restartCount=restarts,
                state=state,
                lastState=last_state,
            )
            if rt.container_id:
                cs["containerID"] = rt.container_id
            status["containerStatuses"] = [cs]
            _conditions(pod, now, ready=False, reason="ContainersNotReady", containers=[cs["name"]])

        self.cluster.store.modify("pods", rt.namespace, rt.name, mutate)

    def _set_running(self, rt: PodRuntime) -> None:
        now = self.cluster.now()

        def mutate(pod: dict[str, Any]) -> None:
            status = pod.setdefault("status", {})
            previous = (status.get("containerStatuses") or [{}])[0]
            restarts = previous.get("restartCount", 0)
            last_state = previous.get("lastState") or {}
            prev_state = previous.get("state") or {}
            if prev_state.get("terminated"):
                last_state = {"terminated": prev_state["terminated"]}
            if rt.exits:
                restarts = rt.exits
            cs = self._container_status(
                pod,
                rt,
                ready=True,
                started=True,
                restartCount=restarts,
                state={"running": {"startedAt": rt.started_at}},
                lastState=last_state,
                containerID=rt.container_id,
            )
            status["containerStatuses"] = [cs]
            status["phase"] = "Running"
            status.setdefault("startTime", now)
            _set_ips(pod, rt.ip, self.host_ip)
            _conditions(pod, now, ready=True)

        self.cluster.store.modify("pods", rt.namespace, rt.name, mutate)

    def _set_phase_done(self, rt: PodRuntime, code: int) -> None:
        now = self.cluster.now()

        def mutate(pod: dict[str, Any]) -> None:
            status = pod["status"]
            status["phase"] = "Succeeded" if code == 0 else "Failed"
            _conditions(pod, now, ready=False, reason="PodCompleted" if code == 0 else "PodFailed")

        self.cluster.store.modify("pods", rt.namespace, rt.name, mutate)

    # -- /etc/hosts: the pod's own name (peers are in cluster DNS) ----------------------------

    def _hosts_for(self, rt: PodRuntime) -> str:
        """What the kubelet writes (managedHostsFileContent): localhost, and the pod's own IP
        with ``<hostname>.<subdomain>.<ns>.svc.cluster.local`` when it has a subdomain."""
        lines = [
            "# Kubernetes-managed hosts file.",
            "127.0.0.1\tlocalhost",
            "::1\tlocalhost ip6-localhost ip6-loopback",
            "fe00::0\tip6-localnet",
            "fe00::0\tip6-mcastprefix",
            "fe00::1\tip6-allnodes",
            "fe00::2\tip6-allrouters",
        ]
        if rt.ip and rt.subdomain:
            lines.append(f"{rt.ip}\t{rt.hostname}.{rt.subdomain}.{rt.namespace}.svc.{dns.DOMAIN}\t{rt.hostname}")
        elif rt.ip:
            lines.append(f"{rt.ip}\t{rt.hostname}")
        return "\n".join(lines) + "\n"

    # -- exec, port-forward, logs -----------------------------------------------------------

    def running(self, namespace: str, name: str) -> PodRuntime | None:
        rt = self.runtimes.get((namespace, name))
        if rt is None or rt.node is None or rt.deleting:
            return None
        return rt

    async def spawn_exec(
        self, rt: PodRuntime, command: list[str], *, stdin: bool, tty: bool
    ) -> tuple[asyncio.subprocess.Process, int | None]:
        """Start ``command`` in the pod's namespaces with the container's environment.

        Returns the process and, with ``tty``, the pty master's fd (stdout and stderr both go
        there, as with a real terminal).  A session of its own, so a client that goes away
        mid-command can have the whole command stopped (the pod's PID namespace would stop it
        too, with the pod).
        """
        argv = self._exec_argv(rt)
        if tty:
            return await _spawn_on_pty([*argv, self.setsid, "-c", *command], rt.env)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            *command,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=rt.env,
            start_new_session=True,
        )
        return proc, None

    def _exec_argv(self, rt: PodRuntime) -> list[str]:
        """Into the pod's namespaces with the container's privileges, in its working directory."""
        assert rt.node is not None
        return [
            self.nsenter,
            f"--target={rt.node.init_pid}",
            "--net",
            "--uts",
            "--mount",
            "--pid",
            "--ipc",
            "--",
            *exec_privileges(self.setpriv, rt.confinement),
            # Not nsenter's --wd: it opens the directory before entering the mount namespace,
            # which leaves the command in the emulator's tree instead of the pod's own root.
            "/bin/sh",
            "-c",
            'cd -- "$0" && exec "$@"',
            rt.workdir,
        ]

    def command_missing(self, rt: PodRuntime, command: list[str]) -> bool:
        """Whether ``command[0]`` cannot be found (the runtime refuses to exec it at all)."""
        exe = command[0]
        if "/" in exe:
            return not exe.startswith("/run/") and (not os.path.exists(exe) or rt.view.hides(exe))
        return rt.view.which(exe, rt.env.get("PATH", DEFAULT_PATH)) is None

    async def connect(self, rt: PodRuntime, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Dial ``localhost:port`` inside the pod, IPv4 then IPv6, as the kubelet's port-forward does."""
        assert rt.node is not None
        loop = asyncio.get_running_loop()
        errors = []
        for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            try:
                sock = await loop.run_in_executor(self.netns_pool, socket_in_netns, rt.node.init_pid, family)
            except OSError as exc:
                errors.append(f"{address}: {exc.strerror or exc}")
                continue
            try:
                await loop.sock_connect(sock, (address, port))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return await asyncio.open_connection(sock=sock)
            except OSError as exc:
                sock.close()
                label = "IPv4: dial tcp4 127.0.0.1" if family == socket.AF_INET else "IPv6 dial tcp6 [::1]"
                errors.append(f"{label}:{port}: connect: {os.strerror(exc.errno or errno.ECONNREFUSED).lower()}")
        raise ConnectionError(
            f"failed to connect to localhost:{port} inside namespace of pod {rt.name}, " + " ".join(errors)
        )

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


async def _spawn_on_pty(argv: list[str], env: dict[str, str]) -> tuple[asyncio.subprocess.Process, int]:
    """``argv`` on a new pty (stdin, stdout and stderr all), in a session of its own; the
    process and the pty's master side, non-blocking."""
    master, slave = pty.openpty()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    os.set_blocking(master, False)
    return proc, master


def exec_privileges(setpriv: str, confinement: Confinement) -> list[str]:
    """``setpriv`` arguments that give an exec session what the container's own processes
    hold (its bounding set, no inheritable or ambient capabilities, no_new_privs), as a
    runtime execs into a container: an exec may not do what the container could not."""
    if confinement.privileged:
        return []
    caps = ",".join(["-all", *(f"+{c.lower()}" for c in confinement.capabilities)])
    argv = [setpriv, "--bounding-set", caps, "--inh-caps", "-all", "--ambient-caps", "-all"]
    return [*argv, "--no-new-privs", "--"] if confinement.no_new_privs else [*argv, "--"]


def _set_ips(pod: dict[str, Any], ip: str | None, host_ip: str) -> None:
    status = pod.setdefault("status", {})
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    status["hostIP"] = host_ip
    status["hostIPs"] = [{"ip": host_ip}]


def _conditions(
    pod: dict[str, Any],
    now: str,
    *,
    ready: bool,
    reason: str | None = None,
    containers: list[str] | None = None,
) -> None:
    """Set the kubelet's pod conditions, keeping lastTransitionTime when a status is unchanged."""
    status = pod.setdefault("status", {})
    existing = {c["type"]: c for c in status.get("conditions") or []}
    ready_s = "True" if ready else "False"
    wanted: dict[str, tuple[str, str | None, str | None]] = {
        "PodReadyToStartContainers": ("True", None, None),
        "Initialized": ("True", None, None),
        "Ready": (ready_s, reason, None),
        "ContainersReady": (ready_s, reason, None),
        "PodScheduled": ("True", None, None),
    }
    if not ready and reason == "ContainersNotReady" and containers:
        msg = f"containers with unready status: [{' '.join(containers)}]"
        wanted["Ready"] = (ready_s, reason, msg)
        wanted["ContainersReady"] = (ready_s, reason, msg)
    out = []
    for type_, (value, why, message) in wanted.items():
        old = existing.get(type_)
        cond: dict[str, Any] = {"type": type_, "status": value, "lastProbeTime": None}
        cond["lastTransitionTime"] = old["lastTransitionTime"] if old and old.get("status") == value else now
        if why:
            cond["reason"] = why
        if message:
            cond["message"] = message
        out.append(cond)
    status["conditions"] = out


def reap_leftovers(state_dir: Path, is_alive: Callable[[int, int | None], bool] = product.is_alive) -> list[str]:
    """Remove what emulators that died without tearing down (SIGKILL) left in ``state_dir``:
    their pods' processes and links, their bridge, their instance directories."""
    reaped = []
    if not state_dir.is_dir():
        return reaped
    ip = shutil.which("ip", path="/usr/sbin:/sbin:/usr/bin:/bin") or "ip"
    for record_path in state_dir.glob(f"*/{RECORD}"):
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            continue
        if is_alive(int(record.get("pid", 0)), record.get("start_time")):
            continue
        nodes = list((record.get("nodes") or {}).values())
        product.delete_links(ip, [n["veth"] for n in nodes if n.get("veth")])
        product.reap_nodes(nodes, cgroups=[str(product.node_cgroup(n["veth"]) or "") for n in nodes if n.get("veth")])
        if record.get("bridge"):
            product.delete_links(ip, [record["bridge"]])
        shutil.rmtree(record_path.parent, ignore_errors=True)
        reaped.append(str(record_path.parent))
    return reaped
