"""What a pod's container holds, as the kubelet and containerd make it from its securityContext.

The emulator judges the pods pytest-sky makes, so it reads a securityContext by upstream's
rules, never by the product's own (``pytest_sky.backends.privileges``): a wrong list there
would otherwise be copied into the judge.  It reuses only the product's node runtime to
carry the result out (``product.Confinement``, applied by a node's init).

- The kubelet merges the pod's securityContext into the container's (runAsUser, runAsGroup:
  the container's wins; pkg/securitycontext/util.go, DetermineEffectiveSecurityContext), asks
  for no_new_privs exactly when ``allowPrivilegeEscalation`` is false (AddNoNewPrivileges), and
  for the default masked and read-only ``/proc`` paths unless ``procMount: Unmasked``
  (defaultMaskedPaths, defaultReadonlyPaths; Kubernetes 1.31-1.35).
- containerd's CRI plugin (v2.3.4, internal/cri/server/container_create.go, buildLinuxSpec)
  starts from its default spec's capabilities (pkg/oci/spec.go, defaultUnixCaps) as bounding,
  permitted and effective set, applies ``capabilities`` (internal/cri/opts/spec_opts.go,
  WithCapabilities: ``ALL`` first, then each name added or dropped; ``ALL`` is what containerd
  holds itself, pkg/cap's ``Current``), clears the ambient set;
  ``privileged`` is every capability, the host's devices and no masked or read-only paths;
  ``readOnlyRootFilesystem`` a read-only root; runAsUser and runAsGroup the process's ids (a
  process that is not root then holds no capability after its exec, by the kernel's rules:
  capabilities(7)).  Every container gets the same device files (runc, libcontainer/specconv,
  AllowedDevices), ``/sys`` read-only unless privileged (pkg/oci/mounts.go, defaultMounts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kube_emulator import product

#: containerd v2.3.4, pkg/oci/spec.go, defaultUnixCaps (CAP_ prefix dropped, as a securityContext
#: names them).
DEFAULT_CAPABILITIES = (
    "CHOWN",
    "DAC_OVERRIDE",
    "FSETID",
    "FOWNER",
    "MKNOD",
    "NET_RAW",
    "SETGID",
    "SETUID",
    "SETFCAP",
    "SETPCAP",
    "NET_BIND_SERVICE",
    "SYS_CHROOT",
    "KILL",
    "AUDIT_WRITE",
)
#: Kubernetes pkg/securitycontext/util.go, defaultMaskedPaths.
MASKED_PATHS = (
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
)
#: Kubernetes pkg/securitycontext/util.go, defaultReadonlyPaths.
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
#: runc, libcontainer/specconv, AllowedDevices: the device files of every container.
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")


def _name(raw: object) -> str:
    return str(raw).strip().upper().removeprefix("CAP_")


def known() -> set[str]:
    """What ``ALL`` and ``privileged`` give: the capabilities the runtime holds itself
    (containerd's ``allCaps`` is pkg/cap's ``Current()``, its own effective set), here the
    emulator's."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    mask = int(fields["CapEff"].strip(), 16)
    return {name for name, bit in product.CAPABILITY_BITS.items() if mask >> bit & 1}


def capabilities(container_sc: Mapping[str, Any]) -> list[str]:
    """WithCapabilities over the default set: ``ALL`` added is every capability this kernel
    knows, ``ALL`` dropped none; then each name added, then each dropped."""
    caps = container_sc.get("capabilities") or {}
    add = [_name(c) for c in caps.get("add") or []]
    drop = [_name(c) for c in caps.get("drop") or []]
    every = known()
    have = set(DEFAULT_CAPABILITIES)
    if "ALL" in add:
        have = set(every)
    if "ALL" in drop:
        have = set()
    have |= {c for c in add if c != "ALL"}
    have -= {c for c in drop if c != "ALL"}
    return sorted(have & every)


def effective(pod_sc: Mapping[str, Any] | None, container_sc: Mapping[str, Any] | None) -> dict[str, Any]:
    """The container's securityContext with what the pod's gives it (DetermineEffectiveSecurityContext)."""
    out = dict(container_sc or {})
    for key in ("runAsUser", "runAsGroup", "runAsNonRoot"):
        if out.get(key) is None and (pod_sc or {}).get(key) is not None:
            out[key] = (pod_sc or {})[key]
    return out


def confinement(pod_sc: Mapping[str, Any] | None, container_sc: Mapping[str, Any] | None) -> product.Confinement:
    """What the container's processes hold, for the node's init to carry out."""
    sc = effective(pod_sc, container_sc)
    sysctls = [(str(s.get("name", "")), str(s.get("value", ""))) for s in (pod_sc or {}).get("sysctls") or []]
    user, group = sc.get("runAsUser"), sc.get("runAsGroup")
    ids = {"user": user, "group": group if group is not None else (0 if user is not None else None)}
    readonly_root = bool(sc.get("readOnlyRootFilesystem"))
    if sc.get("privileged"):
        return product.Confinement(
            capabilities=sorted(known()),
            privileged=True,
            sysctls=sysctls,
            readonly_root=readonly_root,
            **ids,
        )
    unmasked = sc.get("procMount") == "Unmasked"
    return product.Confinement(
        capabilities=capabilities(sc),
        no_new_privs=sc.get("allowPrivilegeEscalation") is False,
        devices=list(DEVICES),
        readonly_paths=[] if unmasked else list(READONLY_PATHS),
        masked_paths=[] if unmasked else list(MASKED_PATHS),
        sysctls=sysctls,
        readonly_root=readonly_root,
        **ids,
    )
