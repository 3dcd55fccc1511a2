"""Rootless nodes: the host's side of a cluster whose network lives in a user namespace.

An ordinary user cannot put links in the host's network namespace, so each rootless cluster
has a holder (``clusterns.py``), a process in a user namespace of its own where the user is
root, and in a network namespace that namespace owns, holding the cluster's bridge.  Nodes
are started inside it (``nsenter --user --net``, keeping the user's credentials: uid 0
there), and the host reaches a node's sshd through the holder's door, which connects inside
and hands back the socket.  Killing the holder takes the bridge and every veth with it.

Which mode a process runs in is decided once (:func:`local_mode`): root's, where this
process holds CAP_NET_ADMIN and CAP_SYS_ADMIN; rootless where the host lets an ordinary
user make user namespaces; otherwise one line that names the setting that refuses them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import os
import pwd
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_sky import procs
from pytest_sky.backends import clusterns
from pytest_sky.backends.netns.nodes import abandoned
from pytest_sky.backends.netns.output import Lines, tail
from pytest_sky.backends.netns.preflight import holds_root_caps, require_privileges, rootless_tools
from pytest_sky.errors import BackendUnavailableError, ProvisionError

#: The holder's program, run as ``python -S -I`` (standard library only).
CLUSTERNS = Path(clusterns.__file__)
#: Its command line's marker, followed by the cluster's directory: how a later process finds
#: the holder of a cluster whose owner died before it recorded it.
HOLDER_MARKER = "psky-cluster:"
#: In the cluster's directory: what the holder says after its first line (a crash's trace).
HOLDER_LOG = "holder.log"


class LocalMode(enum.Enum):
    ROOT = "root"  # links in the host's network namespace
    ROOTLESS = "rootless"  # links in a user namespace of the user's own


@functools.lru_cache(maxsize=1)
def local_mode() -> LocalMode:
    """Root's mode where this process may make links on the host; else rootless, or a
    BackendUnavailableError whose one line says what refuses it and what to do.  Root with
    its capabilities dropped (a restricted container) is refused: its nodes' sshd would run
    as root in a namespace where root cannot drop to sshd's own user."""
    if holds_root_caps():
        return LocalMode.ROOT
    if os.geteuid() == 0:
        require_privileges()  # raises, naming what was dropped
    problem = userns_problem()
    if problem:
        raise BackendUnavailableError(problem)
    return LocalMode.ROOTLESS


#: Settings that refuse an ordinary user's user namespaces: (sysctl, the value that refuses,
#: the value that allows).  Debian's and Ubuntu's older kernels, every kernel, Ubuntu 24.04's.
REFUSING_SETTINGS = (
    ("kernel.unprivileged_userns_clone", "0", "1"),
    ("user.max_user_namespaces", "0", "15000"),
    ("kernel.apparmor_restrict_unprivileged_userns", "1", "0"),
)


def userns_problem(proc_sys: Path = Path("/proc/sys")) -> str | None:
    """Why this host will not give an ordinary user the namespaces a rootless cluster needs,
    or None.  The settings known to refuse them are named; anything else is found by trying."""
    for name, refuses, allows in REFUSING_SETTINGS:
        try:
            value = (proc_sys / name.replace(".", "/")).read_text().strip()
        except OSError:
            continue
        if value == refuses:
            return (
                f"the local backend runs as an ordinary user in user namespaces, and this host refuses "
                f"them ({name} = {value}): allow them as root with `sysctl -w {name}={allows}`, "
                "or run pytest as root"
            )
    probe = subprocess.run(
        [sys.executable, "-S", "-I", str(CLUSTERNS), "probe"], capture_output=True, text=True, timeout=30, check=False
    )
    if probe.returncode != 0:
        why = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else f"exit {probe.returncode}"
        return (
            f"the local backend runs as an ordinary user in user namespaces, and this host refuses them "
            f"({why}): allow unprivileged user namespaces, or run pytest as root"
        )
    return None


@dataclass(frozen=True)
class Holder:
    """A rootless cluster's holder as its journal keeps it."""

    pid: int
    start_time: int | None  # ``procs.start_time``: a recycled pid is never taken for it
    door: str  # its abstract unix socket (``@name``): ``clusterns.dial`` asks it for connections
    index: int  # the cluster's /24 of 198.18.0.0/15
    bridge_index: int  # the bridge's ifindex, in the cluster's network namespace

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Holder:
        start = data.get("start_time")
        return cls(
            pid=int(data["pid"]),
            start_time=int(start) if start is not None else None,
            door=str(data["door"]),
            index=int(data["index"]),
            bridge_index=int(data["bridge_index"]),
        )

    def alive(self) -> bool:
        return procs.is_alive(self.pid, self.start_time)

    def enter(self, *spaces: str) -> list[str]:
        """The argv prefix that runs a program as root of the cluster's user namespace (the
        user's own credentials, which are uid 0 there), in its network namespace or in the
        namespaces ``spaces`` name (nsenter's ``--net=FILE`` ...)."""
        if not self.alive():
            raise ProvisionError(f"the cluster's namespace holder (pid {self.pid}) is gone: tear the cluster down")
        nsenter = rootless_tools()["nsenter"]
        return [nsenter, f"--target={self.pid}", "--user", "--preserve-credentials", *(spaces or ["--net"]), "--"]


def start_holder(cluster_dir: Path, mtu: int, timeout: float = 30.0) -> Holder:
    """Start the cluster's holder and wait for its word: its subnet and bridge, or why not."""
    door = f"@pytest-sky-door-{secrets.token_hex(8)}"  # an abstract socket: see clusterns
    argv = [sys.executable, "-S", "-I", str(CLUSTERNS), "hold", f"{HOLDER_MARKER}{cluster_dir}", door, str(mtu)]
    # A session of its own: Ctrl-C reaches pytest, which tears the cluster down in order.
    with open(cluster_dir / HOLDER_LOG, "ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, start_new_session=True
        )
    try:
        assert proc.stdout is not None
        with proc.stdout:
            line = Lines(proc).next(time.monotonic() + timeout)  # its one line
        if line is None:
            raise ProvisionError(f"the cluster's namespace holder said nothing within {timeout:.0f} s")
        words = line.split()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.poll() is not None or len(words) != 3 or words[0] != "READY":
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
        detail = " ".join(words[1:]) if words[:1] == ["FAILED"] else tail(cluster_dir / HOLDER_LOG, 1)
        raise ProvisionError(f"could not make the cluster's network namespace: {detail or 'no answer'}")
    return Holder(proc.pid, procs.start_time(proc.pid), door, int(words[1]), int(words[2]))


def stop_holder(holder: Holder | None, cluster_dir: Path) -> None:
    """Kill the cluster's holder: the one recorded, or else any whose command line names
    ``cluster_dir`` (one started by a launch killed before it wrote the record; the record
    is written the moment the holder has spoken, so there is no other)."""
    alive = holder is not None and holder.alive()
    procs.kill_and_wait([holder.pid] if holder is not None and alive else holder_processes(str(cluster_dir)))


def holder_processes(cluster_dir: str = "") -> list[int]:
    """Pids of living holders (of ``cluster_dir`` only, when given)."""
    found = []
    marker = f"{HOLDER_MARKER}{cluster_dir}"
    for pid in procs.pids():
        args = procs.cmdline(pid)
        ours = args and any(a == marker or (not cluster_dir and a.startswith(HOLDER_MARKER)) for a in args)
        if ours and procs.is_alive(pid):
            found.append(pid)
    return found


def reap_stray_holders(clusters_dir: Path) -> list[str]:
    """Kill the holders of cluster directories under ``clusters_dir`` that have no record left
    (:func:`~pytest_sky.backends.netns.nodes.abandoned`: their launch died before it wrote one,
    or the state directory was deleted); what was killed, for the reaper's report."""
    doomed = []
    for pid in holder_processes():
        marker = next((a for a in procs.cmdline(pid) or [] if a.startswith(HOLDER_MARKER)), None)
        if marker is not None and abandoned(marker.removeprefix(HOLDER_MARKER), clusters_dir):
            procs.kill_and_wait([pid])
            doomed.append(f"namespace holder {pid}")
    return doomed


def node_user() -> tuple[str, int, int]:
    """Who a rootless node's processes are: this user (name, uid, gid), as on the host (by
    uid: ``$USER`` may name someone else, after ``su`` or ``setpriv``)."""
    return pwd.getpwuid(os.getuid()).pw_name, os.getuid(), os.getgid()


def dial_command(door: str, ip: str, port: int = 22) -> str:
    """The ProxyCommand (with ``ProxyUseFdpass yes``) that reaches a rootless node's sshd."""
    return f"{sys.executable} -S -I {CLUSTERNS} dial {door} {ip} {port}"
