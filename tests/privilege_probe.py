"""What a node's root may do to the machine under it: one line per check, ``check<TAB>result``.

Run on a node (standard library only, ``python3 - < this file``), as the ML setup scripts
whose steps it copies would run.  Every write it tries writes the value already there, so
even where a write is allowed nothing changes; every check prints a result that a local
node, an emulated pod and a real pod under Pod Security baseline can be compared on.
"""

import ctypes
import errno
import os
import socket
import stat
import struct

libc = ctypes.CDLL(None, use_errno=True)
CAP_NAMES = {
    0: "CHOWN", 1: "DAC_OVERRIDE", 2: "DAC_READ_SEARCH", 3: "FOWNER", 4: "FSETID", 5: "KILL", 6: "SETGID",
    7: "SETUID", 8: "SETPCAP", 9: "LINUX_IMMUTABLE", 10: "NET_BIND_SERVICE", 11: "NET_BROADCAST",
    12: "NET_ADMIN", 13: "NET_RAW", 14: "IPC_LOCK", 15: "IPC_OWNER", 16: "SYS_MODULE", 17: "SYS_RAWIO",
    18: "SYS_CHROOT", 19: "SYS_PTRACE", 20: "SYS_PACCT", 21: "SYS_ADMIN", 22: "SYS_BOOT", 23: "SYS_NICE",
    24: "SYS_RESOURCE", 25: "SYS_TIME", 26: "SYS_TTY_CONFIG", 27: "MKNOD", 28: "LEASE", 29: "AUDIT_WRITE",
    30: "AUDIT_CONTROL", 31: "SETFCAP", 32: "MAC_OVERRIDE", 33: "MAC_ADMIN", 34: "SYSLOG", 35: "WAKE_ALARM",
    36: "BLOCK_SUSPEND", 37: "AUDIT_READ", 38: "PERFMON", 39: "BPF", 40: "CHECKPOINT_RESTORE",
}  # fmt: skip


def say(check, result):
    print(f"{check}\t{result}", flush=True)


def outcome(action):
    """``allowed``, ``refused (EPERM)``, ``absent``: what a user would see of ``action``."""
    try:
        action()
    except FileNotFoundError:
        return "absent"
    except OSError as exc:
        return f"refused ({errno.errorcode.get(exc.errno, exc.errno)})"
    return "allowed"


def rewrite(path):
    """Write a file's own value back to it (a bracketed choice such as THP's mode: the chosen one)."""
    with open(path) as f:
        value = f.read().strip()
    if "[" in value:
        value = value.split("[", 1)[1].split("]", 1)[0]
    with open(path, "w") as f:
        f.write(value + "\n")


def status(field):
    with open("/proc/self/status") as f:
        return next(line.split()[1] for line in f if line.startswith(field + ":"))


def status_caps(field):
    mask = int(status(field), 16)
    return ",".join(n for b, n in sorted(CAP_NAMES.items()) if mask >> b & 1) or "-"


def syscall_check(result):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def disks():
    """This machine's block devices (not loop or ram), as (name, major, minor) from /sys."""
    out = []
    for name in sorted(os.listdir("/sys/class/block")):
        if name.startswith(("loop", "ram")):
            continue
        try:
            with open(f"/sys/class/block/{name}/dev") as f:
                major, minor = f.read().strip().split(":")
        except OSError:
            continue
        out.append((name, int(major), int(minor)))
    return out


def mknod_disk():
    _, major, minor = disks()[0]
    path = "/tmp/psky-probe-disk"
    os.mknod(path, stat.S_IFBLK | 0o600, os.makedev(major, minor))
    try:
        with open(path, "rb") as f:
            f.read(512)
    finally:
        os.unlink(path)


def open_raw_disks():
    found = [n for n, _, _ in disks() if os.path.exists(f"/dev/{n}")]
    if not found:
        raise FileNotFoundError("no disk in /dev")
    with open(f"/dev/{found[0]}", "rb") as f:
        f.read(512)


def masked(path):
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "absent"
    if stat.S_ISDIR(st.st_mode):
        return "masked" if not os.listdir(path) else "visible"
    null = os.stat("/dev/null")
    return "masked" if stat.S_ISCHR(st.st_mode) and st.st_rdev == null.st_rdev else "visible"


def writable(path):
    """Whether the mount ``path`` is on is read-only (procfs's own permissions refuse some
    writes even to the host's root: the mount is what a runtime changes)."""
    if not os.path.exists(path):
        return "absent"
    return "read-only" if os.statvfs(path).f_flag & os.ST_RDONLY else "writable"


def set_lo_mtu():
    with socket.socket() as s, open("/sys/class/net/lo/mtu") as f:
        mtu = int(f.read())
        import fcntl

        fcntl.ioctl(s, 0x8922, struct.pack("16si12x", b"lo", mtu))  # SIOCSIFMTU, the same value


def same_hostname():
    name = socket.gethostname().encode()
    syscall_check(libc.sethostname(name, len(name)))


def mount_tmpfs():
    os.makedirs("/tmp/psky-probe-mnt", exist_ok=True)
    try:
        syscall_check(libc.mount(b"psky-probe", b"/tmp/psky-probe-mnt", b"tmpfs", 0, None))
        libc.umount2(b"/tmp/psky-probe-mnt", 2)
    finally:
        os.rmdir("/tmp/psky-probe-mnt")


def bind_port_80():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 80))


def icmp(kind):
    socket.socket(socket.AF_INET, kind, socket.IPPROTO_ICMP).close()


def dac_override():
    path = "/tmp/psky-probe-owned"
    with open(path, "w") as f:
        f.write("x")
    try:
        os.chown(path, 65534, 65534)
        os.chmod(path, 0o600)
        with open(path, "a") as f:
            f.write("y")
    finally:
        os.unlink(path)


say("capabilities (bounding)", status_caps("CapBnd"))
say("capabilities (effective)", status_caps("CapEff"))
say("no_new_privs", status("NoNewPrivs"))
say("write /proc/sys/vm/swappiness", outcome(lambda: rewrite("/proc/sys/vm/swappiness")))
say("write /proc/sys/net/ipv4/ip_forward", outcome(lambda: rewrite("/proc/sys/net/ipv4/ip_forward")))
say(
    "write /sys/kernel/mm/transparent_hugepage/enabled",
    outcome(lambda: rewrite("/sys/kernel/mm/transparent_hugepage/enabled")),
)
for path in ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/sys"):
    say(f"{path} is", writable(path))
for path in ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/sys/firmware"):
    say(f"{path} is", masked(path))
say("/dev holds", " ".join(sorted(n + ("/" if os.path.isdir(f"/dev/{n}") and not os.path.islink(f"/dev/{n}") else "")
                                  for n in os.listdir("/dev"))))  # fmt: skip
say("mount -t tmpfs", outcome(mount_tmpfs))
say("mknod a block device of this machine's disk and read it", outcome(mknod_disk))
say("open a raw disk in /dev", outcome(open_raw_disks))
say("sethostname", outcome(same_hostname))
say("set lo's MTU", outcome(set_lo_mtu))
say("bind port 80", outcome(bind_port_80))
say("raw ICMP socket", outcome(lambda: icmp(socket.SOCK_RAW)))
say("ICMP datagram socket (ping)", outcome(lambda: icmp(socket.SOCK_DGRAM)))
say("chown and write a file of another user", outcome(dac_override))
say("write /dev/shm", outcome(lambda: open("/dev/shm/psky-probe", "w").close() or os.unlink("/dev/shm/psky-probe")))
