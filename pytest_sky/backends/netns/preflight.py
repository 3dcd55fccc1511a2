"""What this host must have before a node starts: programs, privileges, a FORWARD policy
that lets bridged frames pass."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from pytest_sky.backends.netns.links import LINK_PREFIX
from pytest_sky.errors import BackendUnavailableError
from pytest_sky.procs import holds_root_caps


def _find(needed: dict[str, str], who: str, hint: str = "") -> dict[str, str]:
    """Absolute paths of ``needed`` (tool -> its Debian package), or one line saying that
    ``who`` needs the missing packages and how to install them."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"])
    found = {tool: shutil.which(tool, path=search) for tool in needed}
    missing = sorted({needed[t] for t, path in found.items() if path is None})
    if missing:
        raise BackendUnavailableError(f"{who} {', '.join(missing)}: run `apt-get install -y {' '.join(missing)}`{hint}")
    return {t: p for t, p in found.items() if p is not None}


def require_tools() -> dict[str, str]:
    """Absolute paths of the programs a node needs, or a one-line error naming the package."""
    needed = {"ip": "iproute2", "sshd": "openssh-server"}
    return _find(needed, "the local backend needs", " (or `bash scripts/setup.sh`)")


def rootless_tools() -> dict[str, str]:
    """What starting nodes in their cluster's namespaces takes besides :func:`require_tools`."""
    return _find({"nsenter": "util-linux"}, "the local backend needs")


def holder_tools() -> dict[str, str]:
    """What a cluster's namespace holder takes: the gateway's rules (``gateway.rules``)."""
    return _find({"iptables-restore": "iptables"}, "the local backend needs", " (or `bash scripts/setup.sh`)")


def require_privileges() -> None:
    """Namespaces and links need CAP_NET_ADMIN and CAP_SYS_ADMIN; say so before touching anything."""
    if holds_root_caps():
        return
    if os.geteuid() == 0:
        raise BackendUnavailableError(
            "the local backend needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network "
            "namespaces, and this root has had them dropped (a restricted container?): run it "
            "privileged (e.g. `docker run --privileged`) or use --kubernetes"
        )
    raise BackendUnavailableError(
        "the local backend needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network "
        "namespaces: run pytest as root (e.g. `sudo -E env PATH=$PATH pytest ...`) "
        "or use --kubernetes"
    )


def forward_policy_problem(bridge_nf_call_iptables: str | None, iptables_rules: str | None) -> str | None:
    """Why bridged traffic between nodes would be dropped on this host, or None.

    With ``br_netfilter`` loaded and ``bridge-nf-call-iptables`` on, frames crossing a bridge
    go through the iptables FORWARD chain; Docker hosts set its policy to DROP, which silently
    cuts head-to-worker traffic.  Kept pure so it is testable without such a host.
    """
    if (bridge_nf_call_iptables or "").strip() != "1" or not iptables_rules:
        return None
    lines = iptables_rules.splitlines()
    if "-P FORWARD DROP" not in lines and "-P FORWARD REJECT" not in lines:
        return None
    if any(line.startswith("-A FORWARD") and f"-i {LINK_PREFIX}" in line and "ACCEPT" in line for line in lines):
        return None
    return (
        "this host's iptables FORWARD policy drops bridged traffic (br_netfilter is loaded), so "
        "cluster nodes could not reach each other: run `iptables -I FORWARD -i psky+ -o psky+ -j ACCEPT` "
        "or `sysctl -w net.bridge.bridge-nf-call-iptables=0`"
    )


def check_forward_policy() -> None:
    try:
        nf = Path("/proc/sys/net/bridge/bridge-nf-call-iptables").read_text()
    except OSError:
        return  # br_netfilter not loaded: bridged frames never see iptables
    iptables = shutil.which("iptables", path=os.pathsep.join(["/usr/sbin", "/sbin", os.environ.get("PATH", "")]))
    if iptables is None:
        return
    try:
        rules = subprocess.run(
            [iptables, "-S", "FORWARD"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    problem = forward_policy_problem(nf, rules)
    if problem:
        raise BackendUnavailableError(problem)


def fault_tools() -> dict[str, str]:
    """What injecting network faults takes on the host (not needed to run a cluster)."""
    needed = {
        "tc": "iproute2",
        "iptables": "iptables",
        "iptables-restore": "iptables",
        "nsenter": "util-linux",
        "unshare": "util-linux",
    }
    return _find(needed, "network faults need")
