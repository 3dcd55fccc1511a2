"""A node's first moments: its namespaces, its root, its address, then its sshd.

``netns.start_nodes`` runs this file as a program (``python -S -I nodeinit.py
psky-node:<node dir> ...``, standard library only) once per launch, not once per node: one
small process forks every node, and each node makes its namespaces, mounts and address with
system calls before it execs sshd.  Why: the shell script this replaces started about 25
programs per node (``unshare``, ``sh``, ``ip``, one ``mount`` per mount point, ...), which on
2 cores kept 64 nodes from being ready for 2.6 s; a fork and a system call cost a fraction
of a program's start.

Each node is two processes, as ``unshare --fork`` makes them: the *keeper* (outside the
node's PID namespace, inside its network namespace) waits for the node's first process,
writes its exit code and dies with it; the *init* (pid 1 inside) mounts, makes the node's
veth (every node its own, at once: no host step in between), configures it, confines itself
as a container runtime confines a pod (its own ``/dev`` and IPC namespace, ``/proc`` and
``/sys`` read-only where a runtime makes them so, the capabilities ``privileges`` chose, via
``confine``) and becomes sshd, and is killed (``PR_SET_PDEATHSIG``) if its keeper dies.
Every keeper carries this program's command line, so the host finds the nodes of a dead run
by their directories (``netns.node_processes``).

It talks with the host over its stdin and stdout in ``nodeinit_protocol``'s messages: a
Launch in, a Report out for each step of each node.

Rootless (a plan with ``node_uid``), it runs as root of the cluster's user namespace (started
there by the host, ``netns.userns``) and each node differs where the kernel makes it: a root
of one layer per directory (:func:`_layer_tree`), the host's device files bound rather than
made, and last a user namespace of the node's own in which its processes are the host's user
(:func:`_become_node_user`).  DESIGN.md section 5, "Rootless", says why each.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import os
import select
import socket
import sys
from collections.abc import Callable

try:
    from pytest_sky.backends import confine, nodelink
    from pytest_sky.backends.nodeinit_protocol import Launch, NodePlan, Report, Stage, ViewStep
    from pytest_sky.backends.rootpath import within
except ImportError:  # run as the program it is (python -S -I nodeinit.py): from its directory
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import confine  # type: ignore[import-not-found,no-redef]
    import nodelink  # type: ignore[import-not-found,no-redef]
    from nodeinit_protocol import Launch, NodePlan, Report, Stage, ViewStep  # type: ignore[import-not-found,no-redef]
    from rootpath import within  # type: ignore[import-not-found,no-redef]

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME = 32, 1024, 2048
MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 4096, 16384, 1 << 18, 1 << 21, 1 << 24
ST_RELATIME = 4096  # statvfs's bit for relatime (the other per-mount bits match MS_*)
MNT_DETACH, PR_SET_PDEATHSIG = 2, 1
KEEPER_UP = 3  # the node's pipe to the spawner, at a fixed number after the fork

_libc = ctypes.CDLL(None, use_errno=True)


class NodeInitError(Exception):
    """A step of a node's start failed; the message names the step and the path."""


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise NodeInitError(f"{what}: {os.strerror(err)}")


def _b(text: str | None) -> bytes | None:
    return None if text is None else os.fsencode(text)


def mount(source: str | None, target: str, fstype: str | None = None, flags: int = 0, data: str | None = None) -> None:
    _check(
        _libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)),
        f"mount {fstype or 'bind'} {source or ''} on {target}",
    )


def bind(source: str, target: str, *, readonly: bool = False, recursive: bool = False) -> None:
    """``mount --bind`` (``--rbind``), then, read-only, a remount that keeps the source's own
    per-mount flags (nosuid, nodev, ...) as util-linux does: a node never gets more than the
    host's mount allows."""
    mount(source, target, None, MS_BIND | (MS_REC if recursive else 0))
    if readonly:
        remount_readonly(target)


def remount_readonly(target: str) -> None:
    """Make the mount at ``target`` read-only, keeping its other per-mount flags."""
    st = os.statvfs(target)
    kept = st.f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    kept |= MS_RELATIME if st.f_flag & ST_RELATIME else 0
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def _overlay(layers: str, index: int | str, lower: str, target: str) -> None:
    """A copy-on-write view of ``lower`` whose writes land in layer ``index``."""
    opts = f"lowerdir={lower},upperdir={layers}/{index}/upper,workdir={layers}/{index}/work"
    mount(f"psky-layer{index}", target, "overlay", 0, opts)


def _layer_root(plan: NodePlan, root: str) -> None:
    """The node's ``/``: an overlay over the host's, and over each of its other mounts."""
    layers = plan.layers
    if plan.node_uid >= 0:
        _layer_tree(plan, root)
        return
    try:
        _overlay(layers, 0, "/", root)
    except NodeInitError as exc:
        # The state directory's filesystem cannot hold an upper layer (it is an overlay itself,
        # as in a container): keep the node's writes in memory instead, private all the same.
        print(f"{exc}: the node's writes are kept in memory", file=sys.stderr)
        mount("psky-layers", layers, "tmpfs", 0, "mode=700")
        os.mkdir(root)
        for index, mode, path in [(0, "rw", "/"), *plan.submounts]:
            if mode == "rw":
                upper = f"{layers}/{index}/upper"
                os.makedirs(upper)
                os.makedirs(f"{layers}/{index}/work")
                st = os.stat(path)
                os.chmod(upper, st.st_mode & 0o7777)
                os.chown(upper, st.st_uid, st.st_gid)
        _overlay(layers, 0, "/", root)
    for index, mode, path in plan.submounts:
        if not os.path.exists(root + path):
            continue
        if mode == "rw":
            try:
                _overlay(layers, index, path, root + path)
                continue
            except NodeInitError as exc:
                print(f"{exc}: read-only instead", file=sys.stderr)
        bind(path, root + path, readonly=True)


#: Top-level directories a node mounts for itself (a rootless root does not copy them): the
#: host's ``naming.NODE_OWN_MOUNTS``, which this program, standard library only, cannot import.
NODE_OWN_DIRS = ("dev", "proc", "run", "sys")


def _layer_tree(plan: NodePlan, root: str) -> None:
    """A rootless node's ``/``.  In a user namespace the kernel refuses an overlay whose lower
    directory has mounts below it (they are locked to it), the host's ``/`` first of all; it
    takes one over a directory with none.  So the root is a small tmpfs holding, for each
    directory of the host's, an overlay where it can be one, or else a tmpfs copy of its
    entries, made the same way one level down; then each of the host's other mounts.  (The
    scratch directories are the node's own, empty: :func:`_view`.)"""
    mount("psky-root", root, "tmpfs", 0, "mode=755,size=16m")
    _fill(plan, "/", root)
    for index, mode, path in plan.submounts:
        if os.path.isdir(path) and not os.path.lexists(root + path):
            # Under a scratch directory of the node's own (an empty /tmp): a mount point there
            # harms nothing; under a read-only one it cannot be made, and the mount stays out.
            with contextlib.suppress(OSError):
                os.makedirs(root + path)
        if os.path.isdir(root + path) and not os.path.islink(root + path):
            if mode == "rw":
                _overlay_or_bind(plan.layers, str(index), path, root + path)
            else:
                bind(path, root + path, readonly=True)


def _fill(plan: NodePlan, path: str, target: str) -> None:
    """The entries of the host's directory ``path`` in ``target``, a directory of the node's
    own tmpfs: links as they are, files bound read-only, directories as :func:`_layer_tree`
    says (a mount point is left to it)."""
    below = {p for _, _, p in plan.submounts}
    for name in sorted(os.listdir(path)):
        src, dst = os.path.join(path, name), f"{target}/{name}"
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isdir(src):
            os.mkdir(dst)
            if (path == "/" and name in NODE_OWN_DIRS) or src in below:
                continue
            if not any(b.startswith(src + "/") for b in below):
                _overlay_or_bind(plan.layers, "top" + src.replace("/", "-"), src, dst)
            elif _scratch(src):
                mount("psky-scratch", dst, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
            else:
                _fill(plan, src, dst)
        elif os.path.isfile(src):
            open(dst, "w").close()
            bind(src, dst, readonly=True)


def _scratch(path: str) -> bool:
    """Sticky and world-writable: everyone's scratch space, such as /tmp."""
    return os.stat(path).st_mode & 0o1777 == 0o1777


def _overlay_or_bind(layers: str, key: str, lower: str, target: str, *, owner: bool = False) -> None:
    """An overlay whose upper layer (made here, by the node: an ordinary user cannot give it
    another owner from the host) takes ``lower``'s mode (and ``owner``, root's nodes); where the
    kernel refuses it, an empty scratch directory for a scratch directory, else the host's,
    read-only."""
    upper, work = f"{layers}/{key}/upper", f"{layers}/{key}/work"
    try:
        os.makedirs(upper, exist_ok=True)
        os.makedirs(work, exist_ok=True)
        _like(lower, upper, owner=owner)
        _overlay(layers, key, lower, target)
    except (NodeInitError, OSError) as exc:
        if _scratch(lower):
            mount("psky-scratch", target, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
            return
        print(f"{exc}: {lower} read-only instead", file=sys.stderr)
        bind(lower, target, readonly=True, recursive=True)


def _like(model: str, path: str, *, owner: bool) -> None:
    """``path`` takes the mode of the host's ``model`` (and, with ``owner``, its owner)."""
    st = os.stat(model)
    if owner:
        os.chown(path, st.st_uid, st.st_gid)
    os.chmod(path, st.st_mode & 0o7777)


def _view(plan: NodePlan, root: str) -> None:
    """What of the host's files differs on the node (``netns.view`` says why): an emptied
    directory is one of the node's own on its disk (its layers' ``view/``: gone with them, kept
    across a restart), with the host's mode and owner; a file is removed; a kept directory is
    the host's again, copy-on-write, with the directories above it made as the host's."""
    as_root = plan.node_uid < 0
    for index, (step, path) in enumerate(plan.view):
        target = root + path
        if step == ViewStep.KEEP.value:
            if os.path.isdir(path):
                parts = path.strip("/").split("/")
                for above in ("/" + "/".join(parts[:depth]) for depth in range(1, len(parts) + 1)):
                    if not os.path.lexists(root + above):
                        os.mkdir(root + above)
                        _like(above, root + above, owner=as_root)
                _overlay_or_bind(plan.layers, f"keep{index}", path, target, owner=as_root)
        elif os.path.isdir(target) and not os.path.islink(target):
            os.makedirs(f"{plan.layers}/view/{index}", exist_ok=True)
            _like(path, f"{plan.layers}/view/{index}", owner=as_root)
            bind(f"{plan.layers}/view/{index}", target)
        elif os.path.lexists(target):
            os.unlink(target)  # in the node's own layer (a whiteout there)


def _private_root(plan: NodePlan, root: str) -> None:
    """The layers, then what a machine has of its own: devices, /proc, its view of the
    host's files, hidden paths (after the view: a kept directory never shows one), home."""
    _layer_root(plan, root)
    _devices(plan.confinement, root, rootless=plan.node_uid >= 0)
    mount("psky-proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _view(plan, root)
    for hidden in plan.hide:
        target = root + hidden
        if os.path.isdir(target) and not os.path.islink(target):
            mount("psky-hidden", target, "tmpfs", 0, "mode=755,size=1m")
        elif os.path.lexists(target):  # a file: removed in the node's own layer (a whiteout there)
            os.unlink(target)
    # Every node's home is at the same path, as on a real cluster (mpirun starts remote ranks
    # in the head's working directory): the node's own home directory, at NODE_HOME.
    node_dir, home = plan.root, plan.node_home
    os.makedirs(root + node_dir, exist_ok=True)
    os.makedirs(root + home, exist_ok=True)
    bind(node_dir, root + node_dir)
    bind(f"{node_dir}/home", root + home)


#: What a runtime's /dev links to, besides its device files and its pts, shm and mqueue.
DEV_LINKS = (
    ("ptmx", "pts/ptmx"),
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
)


def _devices(confinement: confine.Confinement, root: str, rootless: bool = False) -> None:
    """The node's ``/dev``: a tmpfs of its own with only the devices it is given (made like
    the host's: same type, numbers, mode and owner), a pts instance, shm and mqueue of its
    own, as a container runtime makes it; or, privileged, the host's."""
    dev = f"{root}/dev"
    if confinement.privileged:
        if root:  # without a root of its own the node already sees the host's
            bind("/dev", dev, recursive=True)
    else:
        found = []  # looked at before the tmpfs covers them (it does, without a root of its own)
        for device in confinement.devices:
            with contextlib.suppress(FileNotFoundError):  # this machine has none: neither has the node
                found.append((device, os.stat(device)))
        mount("psky-dev", dev, "tmpfs", MS_NOSUID | MS_STRICTATIME, "mode=755,size=65536k")
        for device, st in found:
            target = root + device
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if rootless:  # no mknod in a user namespace: the host's device file, bound in
                open(target, "w").close()
                bind(device, target)
                continue
            os.mknod(target, st.st_mode, st.st_rdev)
            os.chown(target, st.st_uid, st.st_gid)
            os.chmod(target, st.st_mode & 0o7777)
        for name, points_to in DEV_LINKS:
            os.symlink(points_to, f"{dev}/{name}")
        os.mkdir(f"{dev}/pts")
        tty = "" if rootless else ",gid=5"  # the tty group has no id in a user namespace of one uid
        mount("devpts", f"{dev}/pts", "devpts", MS_NOSUID | MS_NOEXEC, f"newinstance,ptmxmode=0666,mode=0620{tty}")
        os.mkdir(f"{dev}/mqueue")
        mount("mqueue", f"{dev}/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        os.mkdir(f"{dev}/shm")
    mount("psky-shm", f"{dev}/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")


def _restrict(confinement: confine.Confinement, root: str) -> None:
    """What a runtime withholds in ``/proc`` and ``/sys``: read-only paths bound onto
    themselves read-only, masked ones covered (a directory by an empty read-only tmpfs, a
    file by ``/dev/null``).  Paths this kernel lacks are skipped, as runtimes skip them."""
    for path in confinement.readonly_paths:
        if os.path.exists(root + path):
            bind(root + path, root + path, readonly=True, recursive=True)
    for path in confinement.masked_paths:
        target = root + path
        if os.path.isdir(target):
            mount("psky-masked", target, "tmpfs", MS_RDONLY, "size=0")
        elif os.path.exists(target):
            bind(f"{root}/dev/null", target)


def _resolver(plan: NodePlan, root: str) -> None:
    """A resolver of the node's own (a pod's cluster DNS), over whatever the image has there:
    a link (systemd-resolved's stub) is replaced in the node's own layer, never the host's."""
    own = f"{plan.root}/etc/resolv.conf"
    if not (root and os.path.isfile(own)):
        return
    target = f"{root}/etc/resolv.conf"
    if os.path.islink(target) or not os.path.exists(target):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
        open(target, "w").close()
    bind(own, target)


def _mounts(plan: NodePlan) -> None:
    """Every mount of the node, in the order a later one may sit on an earlier one."""
    root = f"{plan.layers}/merged" if plan.layers else ""  # "": the host's own /, shared
    if root:
        _private_root(plan, root)
    else:
        _devices(plan.confinement, root)
        mount("psky-proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace's
    mount("psky-run", f"{root}/run", "tmpfs", 0, "mode=755,size=64m")
    readonly = 0 if plan.confinement.privileged else MS_RDONLY
    mount("psky-sys", f"{root}/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | readonly)
    if plan.cgroup_mode:
        flags = MS_NOSUID | MS_NODEV | MS_NOEXEC | (MS_RDONLY if plan.cgroup_mode == "ro" else 0)
        mount("psky-cgroup", f"{root}/sys/fs/cgroup", "cgroup2", flags)
    os.mkdir(f"{root}/run/sshd")
    os.chmod(f"{root}/run/sshd", 0o755)
    bind(f"{plan.root}/etc/passwd", f"{root}/etc/passwd")
    bind(f"{plan.root}/etc/hosts", f"{root}/etc/hosts")
    if os.path.exists(f"{plan.root}/etc/shadow"):  # a rootless node's own (see local.shadow_entry)
        bind(f"{plan.root}/etc/shadow", f"{root}/etc/shadow")
    _resolver(plan, root)
    for source, target in plan.extra_mounts:
        # Never create directories on the host's disk: only in /run or in a private root.
        where = within(root, target) if root else target
        if root or target.startswith("/run/"):
            os.makedirs(where, exist_ok=True)
        bind(source, where, readonly=True)
    for source, target in plan.shared_mounts if root else []:
        where = within(root, target)
        os.makedirs(where, exist_ok=True)
        bind(source, where)


def _pivot(root: str) -> None:
    """Make ``root`` the node's ``/`` and let go of the host's."""
    os.chdir(root)
    os.mkdir(".psky-old")
    _check(_libc.pivot_root(b".", b".psky-old"), f"pivot_root to {root}")
    os.chdir("/")
    _check(_libc.umount2(b"/.psky-old", MNT_DETACH), "umount the host's root")
    os.rmdir("/.psky-old")


def _readonly_root(plan: NodePlan) -> None:
    """A read-only root filesystem (readOnlyRootFilesystem): ``/`` and what a container's
    image would hold there (``/run``, the home, the node's directory, the /etc files a
    kubelet writes, which a runtime then mounts read-only too); volumes, ``/dev``, ``/proc``
    and ``/sys`` stay as they are."""
    remount_readonly("/")
    for path in ("/run", plan.node_home, plan.root, "/etc/passwd", "/etc/hosts", "/etc/resolv.conf"):
        if path:
            with contextlib.suppress(OSError):  # not a mount of its own here: read-only with /
                remount_readonly(path)


def _say(report: Report) -> None:
    os.write(KEEPER_UP, report.encode())  # one write: the keeper and its init share the pipe


def _init(index: int, plan: NodePlan, host_netns: int, host_sock: socket.socket) -> None:
    """The node's pid 1: mounts, link, address, root, then sshd (or the pod's command)."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl")
    name = plan.hostname.encode()
    _check(_libc.sethostname(name, len(name)), "sethostname")  # /proc/sys is root's, even in a user namespace
    _mounts(plan)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as own:
        nodelink.make_link(plan, host_netns, host_sock, own)
        host_sock.close()
        os.close(host_netns)
        nodelink.configure(plan, own)
    confine.set_sysctls(plan.confinement.sysctls)  # the node's own namespaces' (still writable)
    root = f"{plan.layers}/merged" if plan.layers else ""
    if not plan.confinement.privileged:
        _restrict(plan.confinement, root)
    if root:
        _pivot(root)
        if plan.confinement.readonly_root:
            _readonly_root(plan)
    _say(Report(Stage.CONFIGURED, index))
    os.close(KEEPER_UP)
    if plan.node_uid >= 0:  # first: a process whose capabilities were cut may not map its uid
        _become_node_user(plan)
    confine.drop_privileges(plan.confinement)
    env = {"PATH": plan.path, **plan.env}
    if plan.command:
        os.execve("/bin/sh", ["/bin/sh", "-c", "exec " + plan.command], env)
    os.execve(plan.sshd, [plan.sshd, *plan.sshd_args, "-f", f"{plan.root}/sshd_config"], env)


def _become_node_user(plan: NodePlan) -> None:
    """Rootless: the node's processes are the host's user, in a user namespace of the node's
    own.  Root of the cluster's namespace holds every uid of one (OpenSSH's sshd, run as
    root, drops to its privilege-separation user, whose uid no namespace of one uid has),
    so sshd runs as that user, as an ordinary user's sshd does, and holds nothing over the
    node's namespaces; the host's user and the cluster's root are one uid, so the files of
    the node (its home, its layers) are the user's on the host."""
    _check(_libc.unshare(CLONE_NEWUSER), "unshare(user)")
    maps = (("setgroups", "deny"), ("uid_map", f"{plan.node_uid} 0 1"), ("gid_map", f"{plan.node_gid} 0 1"))
    for name, text in maps:
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError as exc:
            raise NodeInitError(f"write {text!r} to /proc/self/{name}: {exc.strerror}") from None
    # A change of credentials clears the parent-death signal: set it again.
    _check(_libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl")


def _keeper(index: int, plan: NodePlan, up: int) -> None:
    """Runs in the forked child: its own session, cgroup and namespaces, then the init."""
    os.setsid()
    os.dup2(fcntl.fcntl(up, fcntl.F_DUPFD, 10), KEEPER_UP)  # by way of 10 and up: clear of 3
    log = os.open(plan.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.closerange(KEEPER_UP + 1, os.sysconf("SC_OPEN_MAX"))
    sys.stdout = sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - for the process's life
    with contextlib.suppress(FileNotFoundError):
        os.unlink(plan.exit_file)  # an earlier boot's: this one's is written when it ends
    # The host's network namespace and a netlink socket in it, for the node's own veth.
    host_netns = os.open("/proc/self/ns/net", os.O_RDONLY)
    host_sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    if plan.cgroup_dir:  # entered before unshare, so the namespace's root is this cgroup
        with open(f"{plan.cgroup_dir}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    flags = CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC
    _check(_libc.unshare(flags | (CLONE_NEWCGROUP if plan.cgroup_dir else 0)), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    init = os.fork()
    if init == 0:
        _run(functools.partial(_init, index, plan, host_netns, host_sock), index)
    host_sock.close()
    os.close(host_netns)
    _say(Report(Stage.READY, index, keeper_pid=os.getpid(), init_pid=init))
    _, status = os.waitpid(init, 0)
    code = os.waitstatus_to_exitcode(status)  # -N: killed by signal N
    # The node's directory is at its own path in the node's view too (its root is this
    # keeper's since pivot_root), so this lands in the host's node directory either way.
    with open(plan.exit_file, "w") as f:
        f.write(f"{code}\n")
    os._exit(128 - code if code < 0 else code)


def _run(step: Callable[[], None], index: int) -> None:
    """A forked process's whole life (node ``index``'s keeper or init): it never returns
    into the spawner's loop."""
    try:
        step()
    except BaseException as exc:  # noqa: BLE001 - reported, then the process ends
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"node init: {message}", file=sys.stderr)
        try:
            _say(Report(Stage.FAILED, index, message=message))
        except OSError:
            pass
    os._exit(1)


def _start(plans: list[NodePlan]) -> tuple[dict[int, int], list[int]]:
    """Fork every node's keeper; returns ``{read end of its pipe: node index}`` and the
    keepers' pids."""
    pipes, keepers = {}, []
    for index, plan in enumerate(plans):
        up_r, up_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(up_r)
            _run(functools.partial(_keeper, index, plan, up_w), index)
        os.close(up_w)
        pipes[up_r] = index
        keepers.append(pid)
    return pipes, keepers


def _relay(pipes: dict[int, int], keepers: list[int]) -> None:
    """Copy the nodes' reports to stdout until each has said both READY (its keeper) and
    CONFIGURED (its init), in whichever order they ran, or failed, or died; if the host's
    end closes first, no node of this launch may outlive it."""
    pending = {fd: {Stage.READY, Stage.CONFIGURED} for fd in pipes}
    buffers = {fd: b"" for fd in pending}
    while pending:
        for fd in select.select([*pending, 0], [], [])[0]:
            if fd == 0:
                if not os.read(0, 4096):
                    for pid in keepers:
                        os.kill(pid, 9)  # each init dies with its keeper (PR_SET_PDEATHSIG)
                    return
                continue
            chunk = os.read(fd, 4096)
            buffers[fd] += chunk
            while b"\n" in buffers[fd]:
                line, buffers[fd] = buffers[fd].split(b"\n", 1)
                report = Report.decode(line)
                _tell_host(report)
                if report.stage is Stage.FAILED:
                    pending.pop(fd, None)
                elif fd in pending:
                    pending[fd].discard(report.stage)
                    if not pending[fd]:
                        del pending[fd]
            if not chunk and fd in pending:
                del pending[fd]
                _tell_host(Report(Stage.EXITED, pipes[fd]))
            if not chunk:
                os.close(fd)


def _tell_host(report: Report) -> None:
    sys.stdout.buffer.write(report.encode())
    sys.stdout.buffer.flush()


def main() -> None:
    plans = Launch.decode(sys.stdin.buffer.readline()).nodes
    _relay(*_start(plans))
    sys.stdout.flush()
    os._exit(0)  # at once: the host waits for this exit, while 64 sshds want the CPU


if __name__ == "__main__":
    main()
