"""A node's privileges: what a container runtime gives a pod's container, from its securityContext.

One definition for every node: a local node is started with what a pod of ours would get
(:func:`container_security_context` and :func:`pod_security_context` are the pods'
securityContexts, and :func:`confinement` reads them), and the Kubernetes emulator reads the
same two from each pod it runs.  Why: a node shares this machine's kernel, so whatever a
node's root may do beyond a pod's rights it does to the user's machine (a sysctl, THP, a
raw disk), and a setup script that works only because of it passes here and fails on the
cluster.

What a runtime gives, as containerd 2 (and CRI-O, but for its default sysctls) gives it to a
container that is not privileged:

- capabilities: the runtime's default set less the securityContext's ``drop`` plus its
  ``add``; bounding, permitted and effective alike, so nothing exec'd later regains more;
- ``/proc/sys``, ``/proc/sysrq-trigger``, ``/proc/irq``, ``/proc/bus``, ``/proc/fs`` and
  ``/sys`` read-only, and the kernel's informational files masked;
- a ``/dev`` of its own with the standard devices (and, with GPUs, exactly its GPUs);
- no_new_privs when ``allowPrivilegeEscalation`` is false;
- the pod's namespaced sysctls, set in the pod's own network namespace.

``privileged: true`` lifts all of it but the sysctls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_sky.backends.confine import CAPABILITY_BITS, Confinement
from pytest_sky.errors import TaskError

#: What a container gets without a securityContext: containerd's (and Docker's) default set,
#: which is Pod Security "baseline"'s allowed list plus NET_RAW.
RUNTIME_DEFAULT_CAPABILITIES = (
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "NET_RAW",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
)
#: What sshd and the image's package manager need of root, and no more: the runtime's default
#: set less what neither uses (MKNOD, NET_RAW, SETFCAP, SETPCAP).  Privilege separation chroots
#: (SYS_CHROOT) and drops to its user (SETUID, SETGID), port 22 (NET_BIND_SERVICE), login
#: records (AUDIT_WRITE, fatal without it in sshd built with Linux audit), and apt/dpkg own and
#: chmod files of other users (CHOWN, DAC_OVERRIDE, FOWNER, FSETID, KILL).  Every one is in Pod
#: Security "baseline"'s allowed list; naming them also gives sshd SYS_CHROOT and AUDIT_WRITE
#: where the runtime's default set lacks them (CRI-O).
POD_CAPABILITIES = tuple(c for c in RUNTIME_DEFAULT_CAPABILITIES if c not in {"MKNOD", "NET_RAW", "SETFCAP", "SETPCAP"})
#: The sysctls containerd 2 sets in every pod's network namespace (``enable_unprivileged_ports``
#: and ``enable_unprivileged_icmp``, on by default since 2.0): ports below 1024 and ping
#: without a capability.  Both are "safe" sysctls Pod Security baseline allows, so our pods
#: ask for them and get them on CRI-O too.
NODE_SYSCTLS = (
    ("net.ipv4.ip_unprivileged_port_start", "0"),
    ("net.ipv4.ping_group_range", "0 2147483647"),
)
#: containerd's read-only and masked paths (its default spec), and the read-only ``/sys`` its
#: CRI plugin mounts for a container that is not privileged.
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
MASKED_PATHS = (
    "/proc/acpi",
    "/proc/asound",
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
#: The device files a runtime creates in every container's ``/dev`` (``ptmx``, ``fd`` and
#: ``std*`` are links, ``pts``, ``shm`` and ``mqueue`` file systems of the node's own).
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")


@dataclass(frozen=True)
class Privileges:
    """What a launch asks for beyond a pod's own: capabilities added to
    :data:`POD_CAPABILITIES`, or everything (``privileged``), as a pod's securityContext
    would say it."""

    capabilities: tuple[str, ...] = ()
    privileged: bool = False

    def __bool__(self) -> bool:
        return bool(self.capabilities or self.privileged)

    def describe(self) -> str:
        """For messages: ``privileged`` or ``capabilities NET_ADMIN, SYS_PTRACE``."""
        return "privileged" if self.privileged else "capabilities " + ", ".join(self.capabilities)


#: A launch that asks for nothing beyond a pod's own privileges (the default everywhere).
NONE_ASKED = Privileges()


def check_privileges(capabilities: object = (), privileged: object = False) -> Privileges:
    """The launch's ``capabilities=`` and ``privileged=`` in normal form (names upper case,
    without ``CAP_``, sorted, once each), or a one-line :class:`TaskError`."""
    if not isinstance(privileged, bool):
        raise TaskError(f"privileged must be True or False, got {privileged!r}")
    if isinstance(capabilities, str) or not isinstance(capabilities, Iterable):
        raise TaskError(f"capabilities must be a list of capability names such as ('NET_ADMIN',), got {capabilities!r}")
    names = []
    for raw in capabilities:
        name = _cap_name(raw)
        if name == "ALL":
            raise TaskError("capabilities=('ALL',) is privileged=True: say that instead, on purpose")
        if name not in CAPABILITY_BITS:
            raise TaskError(f"unknown capability {raw!r}: use a Linux capability name such as NET_ADMIN or SYS_PTRACE")
        names.append(name)
    return Privileges(tuple(sorted(set(names) - set(POD_CAPABILITIES))), privileged)


def container_security_context(privileges: Privileges = NONE_ASKED) -> dict[str, Any]:
    """The node container's securityContext.  It passes Pod Security "baseline", not
    "restricted" (sshd runs as root: it logs in as root and its privilege separation chroots
    and changes user), unless the launch asks for more: then the namespace's policy decides."""
    if privileges.privileged:
        return {"runAsUser": 0, "privileged": True}
    return {
        "runAsUser": 0,
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": [*POD_CAPABILITIES, *privileges.capabilities]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_security_context() -> dict[str, Any]:
    """The pod's securityContext: its namespaced sysctls."""
    return {"sysctls": [{"name": name, "value": value} for name, value in NODE_SYSCTLS]}


def _cap_name(raw: object) -> str:
    """A capability as a securityContext may spell it (``net_admin``, ``CAP_NET_ADMIN``)."""
    return str(raw).strip().upper().removeprefix("CAP_")


def _capabilities(container_sc: Mapping[str, Any]) -> list[str]:
    """The capabilities a runtime gives a container with this securityContext: its default
    set, less ``drop``, plus ``add`` (``ALL`` in either); every one when privileged."""
    caps = container_sc.get("capabilities") or {}
    add, drop = ({_cap_name(c) for c in caps.get(key) or []} for key in ("add", "drop"))
    if container_sc.get("privileged") or "ALL" in add:
        return sorted(CAPABILITY_BITS)
    have = set() if "ALL" in drop else set(RUNTIME_DEFAULT_CAPABILITIES) - drop
    return sorted((have | add) & set(CAPABILITY_BITS))


def confinement(
    pod_sc: Mapping[str, Any] | None, container_sc: Mapping[str, Any] | None, devices: Sequence[str] = ()
) -> Confinement:
    """What a runtime makes of a pod's and its container's securityContexts, for a node's
    init to carry out; ``devices`` are the extra device files it is given (its GPUs)."""
    sc = container_sc or {}
    caps = _capabilities(sc)
    sysctls = [(str(s.get("name", "")), str(s.get("value", ""))) for s in (pod_sc or {}).get("sysctls") or []]
    if sc.get("privileged"):
        return Confinement(capabilities=caps, privileged=True, sysctls=sysctls)
    return Confinement(
        capabilities=caps,
        no_new_privs=sc.get("allowPrivilegeEscalation") is False,
        devices=[*DEVICES, *devices],
        readonly_paths=list(READONLY_PATHS),
        masked_paths=list(MASKED_PATHS),
        sysctls=sysctls,
    )


def for_node(privileges: Privileges = NONE_ASKED, devices: Sequence[str] = ()) -> Confinement:
    """A node of ours: what its pod would get on Kubernetes."""
    return confinement(pod_security_context(), container_security_context(privileges), devices)


#: The sysctl whose value names groups, and the one group a rootless cluster's namespaces map
#: (gid 0 there: the user's own group on the host).
PING_GROUP_RANGE = "net.ipv4.ping_group_range"
ROOTLESS_PING_GROUPS = "0 0"


def rootless(confined: Confinement) -> Confinement:
    """``confined`` for a rootless node: the same, but a group range that names only the
    groups its namespaces map (the kernel refuses any other, and the node's processes are in
    that one group)."""
    sysctls = [(n, ROOTLESS_PING_GROUPS if n == PING_GROUP_RANGE else v) for n, v in confined.sysctls]
    return dataclasses.replace(confined, sysctls=sysctls)
