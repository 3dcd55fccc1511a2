"""A node's confinement, as its init applies it: capabilities, no_new_privs, namespaced sysctls,
the system calls a seccomp profile refuses.

Standard library only, importing nothing of pytest-sky: ``nodeinit`` (a node's start) runs as
a program of its own and imports this file from its directory; in the package it is
``pytest_sky.backends.confine``.  What a node is given is decided elsewhere
(``privileges``, from a pod's securityContext); this module only carries it out, with the
system calls a container runtime makes after the container's mounts and before it execs
the container's first process.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from dataclasses import dataclass, field

#: The kernel's capability numbers (``include/uapi/linux/capability.h``), by the names a
#: securityContext uses.
CAPABILITY_BITS = {
    "CHOWN": 0,
    "DAC_OVERRIDE": 1,
    "DAC_READ_SEARCH": 2,
    "FOWNER": 3,
    "FSETID": 4,
    "KILL": 5,
    "SETGID": 6,
    "SETUID": 7,
    "SETPCAP": 8,
    "LINUX_IMMUTABLE": 9,
    "NET_BIND_SERVICE": 10,
    "NET_BROADCAST": 11,
    "NET_ADMIN": 12,
    "NET_RAW": 13,
    "IPC_LOCK": 14,
    "IPC_OWNER": 15,
    "SYS_MODULE": 16,
    "SYS_RAWIO": 17,
    "SYS_CHROOT": 18,
    "SYS_PTRACE": 19,
    "SYS_PACCT": 20,
    "SYS_ADMIN": 21,
    "SYS_BOOT": 22,
    "SYS_NICE": 23,
    "SYS_RESOURCE": 24,
    "SYS_TIME": 25,
    "SYS_TTY_CONFIG": 26,
    "MKNOD": 27,
    "LEASE": 28,
    "AUDIT_WRITE": 29,
    "AUDIT_CONTROL": 30,
    "SETFCAP": 31,
    "MAC_OVERRIDE": 32,
    "MAC_ADMIN": 33,
    "SYSLOG": 34,
    "WAKE_ALARM": 35,
    "BLOCK_SUSPEND": 36,
    "AUDIT_READ": 37,
    "PERFMON": 38,
    "BPF": 39,
    "CHECKPOINT_RESTORE": 40,
}

PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
PR_SET_KEEPCAPS = 8
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2

#: The system calls a profile may refuse here, by name, each with its number and the errno a
#: runtime's profile answers: those whose absence the agent copes with.  An older default
#: profile refuses the pidfd calls (Linux 5.3) with EPERM; today's answers clone3 (5.3) with
#: ENOSYS, so that libc falls back to clone.  Newer calls share one number on every
#: architecture.
REFUSABLE_SYSCALLS = {
    "pidfd_send_signal": (424, errno.EPERM),
    "pidfd_open": (434, errno.EPERM),
    "clone3": (435, errno.ENOSYS),
    "pidfd_getfd": (438, errno.EPERM),
}
#: The audit architecture a filter checks first (``include/uapi/linux/audit.h``): a call made
#: in another ABI has other numbers, and is let through.
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


@dataclass
class Confinement:
    """What a node's processes hold, in the terms a runtime's spec uses (sent as JSON).

    ``privileged``: every capability root has, the host's ``/dev``, ``/sys`` and ``/proc``
    writable; the other fields then only add sysctls."""

    capabilities: list[str] = field(default_factory=list)  # bounding, permitted and effective set
    no_new_privs: bool = False
    privileged: bool = False
    devices: list[str] = field(default_factory=list)  # host device files the node's own /dev gets
    readonly_paths: list[str] = field(default_factory=list)
    masked_paths: list[str] = field(default_factory=list)
    sysctls: list[tuple[str, str]] = field(default_factory=list)  # namespaced ones: net.*, kernel.shm*
    #: System calls its seccomp profile refuses (names in REFUSABLE_SYSCALLS), as a runtime's
    #: default profile refuses some.  Empty by default.
    refused_syscalls: list[str] = field(default_factory=list)
    #: The uid and gid its first process runs as (a pod's runAsUser, runAsGroup); None: root,
    #: as every node of pytest-sky's own runs (the emulator's pods may ask otherwise).
    user: int | None = None
    group: int | None = None
    #: Its root filesystem read-only (readOnlyRootFilesystem): its volumes stay as they are.
    readonly_root: bool = False


class ConfineError(Exception):
    """A step of the confinement failed; the message names it."""


_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int, what: str) -> None:
    if _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        raise ConfineError(f"{what}: {os.strerror(ctypes.get_errno())}")


def set_sysctls(sysctls: list[tuple[str, str]]) -> None:
    """Each sysctl, written while ``/proc/sys`` is still writable: the namespaced ones land in
    the node's own namespaces (a ``/proc/sys/net`` file is the opener's network namespace's),
    as a pod's ``securityContext.sysctls`` do."""
    for name, value in sysctls:
        try:
            with open("/proc/sys/" + name.replace(".", "/"), "w") as f:
                f.write(value)
        except OSError as exc:
            raise ConfineError(f"sysctl {name}={value}: {exc.strerror}") from None


def capability_mask(names: list[str]) -> int:
    return sum(1 << CAPABILITY_BITS[name] for name in names)


def refuse_syscalls(names: list[str]) -> None:
    """A seccomp filter that fails each of ``names`` with its errno (:data:`REFUSABLE_SYSCALLS`)
    and lets every other call through, inherited by all the node runs.  Installed while the
    init still holds CAP_SYS_ADMIN (in its user namespace), as a runtime installs a profile
    before it drops the capabilities, so that no_new_privs stays what the pod asked for."""
    # Classic BPF over struct seccomp_data: the architecture at offset 4, the number at 0.
    ld_abs, jeq, ret = 0x20, 0x15, 0x06
    allow, errno_ret = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO (| errno)
    refused = [REFUSABLE_SYSCALLS[name] for name in names]
    arch = AUDIT_ARCH.get(platform.machine())
    if arch is None:
        raise ConfineError(f"refusing system calls: no seccomp architecture known for {platform.machine()}")
    # Another ABI jumps over the number's load and every pair below, to allow.
    steps = [(ld_abs, 0, 0, 4), (jeq, 0, 2 * len(refused) + 1, arch), (ld_abs, 0, 0, 0)]
    for number, err in refused:  # this number: its errno; else on to the next pair
        steps += [(jeq, 0, 1, number), (ret, 0, 0, errno_ret | err)]
    steps.append((ret, 0, 0, allow))
    code = b"".join(struct.pack("=HBBI", *step) for step in steps)
    filters = ctypes.create_string_buffer(code, len(code))
    prog = struct.pack("@HP", len(steps), ctypes.addressof(filters))  # struct sock_fprog
    if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(prog), 0, 0) != 0:
        raise ConfineError(f"seccomp filter refusing {', '.join(names)}: {os.strerror(ctypes.get_errno())}")


def _become(user: int, group: int) -> None:
    """Take ``user`` and ``group`` (no supplementary groups) keeping the permitted set, as
    runc does before it sets the process's capabilities; the exec that follows then gives a
    process that is not root none (no file capabilities, no ambient set: capabilities(7))."""
    _prctl(PR_SET_KEEPCAPS, 1, "keep capabilities across setuid")
    try:
        os.setgroups([])
        os.setresgid(group, group, group)
        os.setresuid(user, user, user)
    except OSError as exc:
        raise ConfineError(f"run as uid {user}, gid {group}: {exc.strerror}") from None
    _prctl(PR_SET_KEEPCAPS, 0, "stop keeping capabilities across setuid")


def drop_privileges(confinement: Confinement) -> None:
    """The last step before the node's first process is exec'd: the system calls its profile
    refuses, then the bounding set cut to the node's capabilities (so nothing exec'd later,
    root or setuid, regains more), ambient and inheritable cleared, the uid and gid it asks
    for taken, permitted and effective set to them; then no_new_privs if asked."""
    if confinement.refused_syscalls:
        refuse_syscalls(confinement.refused_syscalls)
    ids = (confinement.user or 0, confinement.group or 0)
    if not confinement.privileged:
        keep = capability_mask(confinement.capabilities)
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
        for cap in range(last + 1):
            if not keep >> cap & 1:
                _prctl(PR_CAPBSET_DROP, cap, f"drop capability {cap} from the bounding set")
        _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, "clear the ambient capabilities")
        if ids != (0, 0):
            _become(*ids)
        header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
        low, high = keep & 0xFFFFFFFF, keep >> 32
        data = (ctypes.c_uint32 * 6)(low, low, 0, high, high, 0)  # effective, permitted, inheritable
        if _libc.capset(header, data) != 0:
            raise ConfineError(f"capset: {os.strerror(ctypes.get_errno())}")
    elif ids != (0, 0):
        _become(*ids)
    if confinement.no_new_privs:
        _prctl(PR_SET_NO_NEW_PRIVS, 1, "no_new_privs")
