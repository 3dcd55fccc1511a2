"""What a pod's node is made of before it starts: its volumes, its ``/etc`` files, its
environment, and the node spec the local backend's primitive starts.

A Secret volume is written into the pod's directory and bind-mounted read-only; an emptyDir
is the pod's own; a claim is one directory of the emulator's shared by every pod that mounts
it.  ``/etc/hosts`` holds only the pod's own name and ``/etc/resolv.conf`` names the cluster
DNS, as a real kubelet writes them: peers are found through DNS.
"""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kube_emulator import dns, product, runtime
from kube_emulator.network import PodNetwork
from kube_emulator.pods import DEFAULT_PATH, PodHost, PodRuntime


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


class Sandbox:
    """Builds each pod's volumes, files and node spec, from the API objects of ``host``."""

    def __init__(self, host: PodHost, network: PodNetwork, instance_dir: Path) -> None:
        self.host = host
        self.network = network
        self.instance_dir = instance_dir

    def prepare_volumes(self, rt: PodRuntime, pod: dict[str, Any], container: dict[str, Any]) -> Volumes:
        """Write each mounted Secret volume into the pod's directory; find each claim's
        directory (shared by every pod that mounts the claim); host dir -> mount path."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        if volumes and self.host.faults.matches("failed_mount", pod):
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
                mounts.rw[str(self.claim_dir(rt, vol, vm.get("subPath") or ""))] = path
                continue
            if vm.get("subPath"):
                raise CreateError(f"the kube emulator supports subPath only on claims ({vm['name']} at {path})")
            if "secret" in vol:  # a pod's root is its own: the mount point is made in it
                mounts.ro[str(self.write_secret_volume(rt, vol))] = path
            elif "projected" in vol:
                mounts.ro[str(self.write_projected_volume(rt, vol))] = path
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

    def claim_dir(self, rt: PodRuntime, vol: dict[str, Any], sub_path: str) -> Path:
        """A bound claim's storage: one directory of the emulator's per claim (a ReadWriteMany
        volume every pod that mounts it shares), ``subPath`` made inside it as a kubelet does."""
        name = vol["persistentVolumeClaim"].get("claimName", "")
        if self.host.store.get("persistentvolumeclaims", rt.namespace, name) is None:
            raise MountError(f'persistentvolumeclaim "{name}" not found')
        if sub_path.startswith("/") or ".." in sub_path.split("/"):
            raise CreateError(f"subPath {sub_path!r} must be a relative path without '..'")
        target = self.instance_dir / "claims" / rt.namespace / name / sub_path
        target.mkdir(parents=True, exist_ok=True)
        return target

    def write_secret_volume(self, rt: PodRuntime, vol: dict[str, Any]) -> Path:
        source = vol["secret"]
        secret_name = source.get("secretName", "")
        secret = self.host.store.get("secrets", rt.namespace, secret_name)
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

    def write_projected_volume(self, rt: PodRuntime, vol: dict[str, Any]) -> Path:
        """The ServiceAccount admission's projected volume: a token (opaque: it authenticates
        as nobody here), the cluster's CA, the namespace; other sources are refused."""
        target = rt.root / "volumes" / vol["name"]
        target.mkdir(parents=True, exist_ok=True)
        mode = int(vol["projected"].get("defaultMode", 0o644)) & 0o777
        for source in vol["projected"].get("sources") or []:
            if "serviceAccountToken" in source:
                files = {source["serviceAccountToken"].get("path", "token"): secrets.token_urlsafe(48).encode()}
            elif (source.get("configMap") or {}).get("name") == "kube-root-ca.crt":
                files = {item["path"]: self.host.ca_pem for item in source["configMap"].get("items") or []}
            elif "downwardAPI" in source:
                files = {item["path"]: rt.namespace.encode() for item in source["downwardAPI"].get("items") or []}
            else:
                raise CreateError(f"the kube emulator supports no projected source of {sorted(source)}")
            for rel, content in files.items():
                (target / rel).write_bytes(content)
                os.chmod(target / rel, mode)
        return target

    def container_env(self, rt: PodRuntime, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        env = {"PATH": image_path(), "HOSTNAME": rt.hostname, "HOME": product.NODE_HOME}
        for source in container.get("envFrom") or []:
            ref = source.get("secretRef")
            if ref:
                secret = self.host.store.get("secrets", rt.namespace, ref.get("name", "")) or {}
                for k, v in (secret.get("data") or {}).items():
                    env[source.get("prefix", "") + k] = base64.b64decode(v).decode(errors="replace")
        fields = {
            "metadata.name": rt.name,
            "metadata.namespace": rt.namespace,
            "metadata.uid": rt.uid,
            "spec.nodeName": rt.node_name,
            "status.podIP": rt.ip or "",
            "status.hostIP": self.network.host_ip,
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
        }
        for item in container.get("env") or []:
            value = item.get("value")
            ref = item.get("valueFrom") or {}
            if "fieldRef" in ref:
                value = fields.get(ref["fieldRef"].get("fieldPath", ""), "")
            elif "secretKeyRef" in ref:
                sref = ref["secretKeyRef"]
                secret = self.host.store.get("secrets", rt.namespace, sref.get("name", "")) or {}
                raw = (secret.get("data") or {}).get(sref.get("key", ""))
                value = base64.b64decode(raw).decode(errors="replace") if raw is not None else ""
            env[item["name"]] = value or ""
        env["HOME"] = product.NODE_HOME  # root's home: the pod's own directory, mounted there
        return env

    def node_spec(
        self, rt: PodRuntime, pod: dict[str, Any], container: dict[str, Any], mounts: Volumes
    ) -> product.NodeSpec:
        (rt.root / "etc").mkdir(parents=True, exist_ok=True, mode=0o755)
        home = rt.root / "home"
        home.mkdir(exist_ok=True, mode=0o700)
        (rt.root / "etc" / "passwd").write_text(product.passwd_with_home())
        hosts = rt.root / "etc" / "hosts"
        hosts.write_text(self.hosts_for(rt))
        (rt.root / "etc" / "resolv.conf").write_text(dns.resolv_conf(self.host.dns.address, rt.namespace))
        for name in ("passwd", "hosts", "resolv.conf"):
            os.chmod(rt.root / "etc" / name, 0o644)
        command = list(container.get("command") or []) + list(container.get("args") or [])
        if not command:
            command = ["sleep", "infinity"]  # no image metadata here: an idle container
        if self.host.faults.matches("crash", pod):
            command = ["/bin/sh", "-c", "echo 'kube emulator: injected crash' >&2; exit 1"]
        rt.workdir = container.get("workingDir") or "/"
        rt.env = self.container_env(rt, pod, container)
        # What the kubelet and containerd make of the pod's securityContexts (``runtime``, by
        # upstream's rules), carried out by the product's node runtime.
        rt.confinement = runtime.confinement(pod["spec"].get("securityContext"), container.get("securityContext"))
        # The node inherits the emulator's cwd; a container starts in its workingDir.
        command = ["/bin/sh", "-c", 'cd -- "$0" && exec "$@"', rt.workdir, *command]
        return product.NodeSpec(
            hostname=rt.hostname,
            ip=rt.ip or "",
            root=rt.root,
            veth=self.network.veth_for(rt.ip),
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

    def hosts_for(self, rt: PodRuntime) -> str:
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
