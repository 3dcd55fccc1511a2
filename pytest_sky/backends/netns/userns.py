"""The host's side of a cluster's namespace holder, and rootless nodes.

Every local cluster's network lives in a namespace of its own, held by its holder
(``clusterns.py``) and holding the cluster's bridge and gateway; nodes are started inside it
(``nsenter --net``) and killing the holder takes the bridge and every veth with it.  Root's
holder has a link to the host, which routes to the nodes through it.  An ordinary user
cannot put links in the host's network namespace, so a rootless cluster's holder is in a
user namespace of its own where the user is root, which owns its network namespace; nodes
are started inside both (``nsenter --user --net``, keeping the user's credentials: uid 0
there), and the host reaches a node's sshd through the holder's door, which connects inside
and hands back the socket.

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
from pytest_sky.backends.netns.links import routed_networks
from pytest_sky.backends.netns.nodes import abandoned
from pytest_sky.backends.netns.output import Lines, tail
from pytest_sky.backends.netns.preflight import (
    holder_tools,
    holds_root_caps,
    require_privileges,
    require_tools,
    rootless_tools,
)
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
    """A cluster's namespace holder as its journal keeps it."""

    pid: int
    start_time: int | None  # ``procs.start_time``: a recycled pid is never taken for it
    door: str  # its abstract unix socket (``@name``): ``clusterns.dial`` asks it for connections
    index: int  # the cluster's /24 of 198.18.0.0/15
    bridge_index: int  # the bridge's ifindex, in the cluster's network namespace
    #: Its namespaces are a user namespace's (an ordinary user's cluster), or root's, whose
    #: host reaches the nodes by a route of its own (``clusterns.Uplink``).  A journal of an
    #: earlier version, when only rootless clusters had holders, says nothing: rootless.
    rootless: bool = True
    #: Its gateway's dialer, a fork of it (0: none, a holder of an earlier version).
    dialer: int = 0

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
            rootless=bool(data.get("rootless", True)),
            dialer=int(data.get("dialer", 0)),
        )

    def alive(self) -> bool:
        return procs.is_alive(self.pid, self.start_time)

    def enter(self, *spaces: str) -> list[str]:
        """The argv prefix that runs a program in the cluster's network namespace, or in the
        namespaces ``spaces`` name (nsenter's ``--net=FILE`` ...): rootless, as root of the
        cluster's user namespace (the user's own credentials, which are uid 0 there)."""
        if not self.alive():
            raise ProvisionError(f"the cluster's namespace holder (pid {self.pid}) is gone: tear the cluster down")
        user = ["--user", "--preserve-credentials"] if self.rootless else []
        return [rootless_tools()["nsenter"], f"--target={self.pid}", *user, *(spaces or ["--net"]), "--"]


#: Holders started by this process whose gateway has not said it is ready: by pid, the
#: process and its output, read by :func:`await_gateway` while the nodes start.
_STARTING: dict[int, tuple[subprocess.Popen[bytes], Lines]] = {}


def start_holder(cluster_dir: Path, mtu: int, *, rootless: bool = True, timeout: float = 30.0) -> Holder:
    """Start the cluster's holder and wait for its first word: its subnet and bridge (the
    nodes may start), or why not.  Its gateway gets ready meanwhile (:func:`await_gateway`).
    Root's (``rootless=False``) keeps clear of the subnets the host routes elsewhere."""
    door = f"@pytest-sky-door-{secrets.token_hex(8)}"  # an abstract socket: see clusterns
    restore = holder_tools()["iptables-restore"]
    mode = "rootless" if rootless else "root"
    argv = [sys.executable, "-S", "-I", str(CLUSTERNS), "hold", f"{HOLDER_MARKER}{cluster_dir}", door, str(mtu)]
    argv += [mode, restore, ",".join(routed_networks(require_tools()["ip"]))] if not rootless else [mode, restore]
    # A session of its own: Ctrl-C reaches pytest, which tears the cluster down in order.
    with open(cluster_dir / HOLDER_LOG, "ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, start_new_session=True
        )
    lines = Lines(proc)
    words = _said(proc, lines, cluster_dir, timeout, "LEASED", 4)
    _STARTING[proc.pid] = (proc, lines)
    return Holder(proc.pid, procs.start_time(proc.pid), door, int(words[1]), int(words[2]), rootless, int(words[3]))


def await_gateway(holder: Holder, cluster_dir: Path, timeout: float = 30.0) -> None:
    """Wait for the holder's gateway (its rules, its relay): no node may run a task before
    it is in place.  A holder this process did not start was ready when it was recorded."""
    started = _STARTING.pop(holder.pid, None)
    if started is not None:
        _said(*started, cluster_dir, timeout, "READY", 1)


def _said(
    proc: subprocess.Popen[bytes], lines: Lines, cluster_dir: Path, timeout: float, word: str, count: int
) -> list[str]:
    """The holder's next line, which must be ``word`` and ``count`` words long; otherwise it
    is killed and a ProvisionError says why (its FAILED line, or its log's last)."""
    try:
        line = lines.next(time.monotonic() + timeout)
        if line is None and proc.poll() is None:
            raise ProvisionError(f"the cluster's namespace holder said nothing within {timeout:.0f} s")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    words = (line or "").split()
    if word == "READY" and proc.stdout is not None:
        proc.stdout.close()  # its last word
    if proc.poll() is not None or len(words) != count or words[0] != word:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
        detail = " ".join(words[1:]) if words[:1] == ["FAILED"] else tail(cluster_dir / HOLDER_LOG, 1)
        raise ProvisionError(f"could not make the cluster's network namespace: {detail or 'no answer'}")
    return words


def stop_holder(holder: Holder | None, cluster_dir: Path) -> None:
    """Kill the cluster's holder and its gateway's dialer (a fork of it, which carries its
    command line): those recorded, or else any whose command line names ``cluster_dir`` (one
    started by a launch killed before it wrote the record)."""
    marker = f"{HOLDER_MARKER}{cluster_dir}"
    if holder is not None and holder.alive():
        dialer = [holder.dialer] if holder.dialer and marker in (procs.cmdline(holder.dialer) or []) else []
        doomed = [holder.pid, *dialer]
    else:
        doomed = holder_processes(str(cluster_dir))
    started = _STARTING.pop(holder.pid, None) if holder is not None else None
    procs.kill_and_wait(doomed)
    if started is not None:  # its gateway never said it was ready: the launch failed first
        proc, _ = started
        if proc.stdout is not None:
            proc.stdout.close()
        proc.wait()


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
