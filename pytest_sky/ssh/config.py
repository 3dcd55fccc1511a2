"""OpenSSH client configuration files.

Two are written per cluster: the client's (``Cluster.ssh_config``: ``Host <cluster>`` is
the head, ``Host <cluster>-worker<i>`` the workers) and the one every node gets as
``~/.ssh/config`` so that ``ssh <worker-ip>`` or ``ssh <cluster>-worker1`` works from the
head in any context, a detached job or mpirun included, without an agent or a prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Where the client's unix sockets go (ControlPath masters, Kubernetes forwarders): a socket
#: path must fit in 108 bytes (104 on macOS), and the state directory may be anywhere.
SOCKET_DIR = "/tmp"

#: The key exchanges both ends offer, fast one first (the sntrup761 hybrid that newer OpenSSH
#: prefers costs tens of milliseconds per handshake).  Every name is one OpenSSH 7.4 knows
#: (Ubuntu 18.04, RHEL 7): ssh and sshd refuse a config naming one they do not, so the hybrids
#: (sntrup761, 8.5+; mlkem768, 9.9+) cannot be listed "in case".  ECDH P-256 and DH group 14
#: are the fallbacks of a build without curve25519 (FIPS mode).
KEX = "curve25519-sha256,curve25519-sha256@libssh.org,ecdh-sha2-nistp256,diffie-hellman-group14-sha256"


@dataclass(frozen=True)
class HostEntry:
    alias: str  # "<cluster>" for the head, "<cluster>-worker<i>" for workers
    hostname: str  # address the connecting side dials
    port: int = 22
    user: str = "root"
    proxy_command: str | None = None
    proxy_jump: str | None = None
    host_key_alias: str | None = None  # check the host key under this name, whatever we dial
    proxy_fdpass: bool = False  # the ProxyCommand hands ssh a connected socket and exits


def _common(identity_file: str, known_hosts: str, control_path: str | None, control_master: str) -> list[str]:
    lines = [
        f"  IdentityFile {identity_file}",
        "  IdentitiesOnly yes",
        f"  UserKnownHostsFile {known_hosts}",
        "  GlobalKnownHostsFile none",
        "  StrictHostKeyChecking yes",
        "  CheckHostIP no",
        "  BatchMode yes",
        "  PasswordAuthentication no",
        f"  KexAlgorithms {KEX}",
        "  ForwardAgent no",
        "  LogLevel ERROR",
        "  ServerAliveInterval 5",
        "  ServerAliveCountMax 3",
        "  ConnectTimeout 20",
    ]
    if control_path:
        # "auto": several clients racing to become the master is safe (losers connect
        # directly, saying so on stderr).  "no": clients use the master once it is there,
        # and until then connect directly without a word (its opener is pytest-sky's).
        lines += [
            f"  ControlMaster {control_master}",
            f"  ControlPath {control_path}",
            "  ControlPersist 600",
        ]
    return lines


def render(
    entries: Sequence[HostEntry],
    *,
    identity_file: str,
    known_hosts: str,
    control_path: str | None = None,
    control_master: str = "auto",
    extra_patterns: Sequence[str] = (),
    send_env: Sequence[str] = (),
) -> str:
    """One ``Host`` block per node, then the shared settings under ``Host`` patterns.

    ``control_path`` (multiplexing on) must name this launch alone: ssh's ``%C`` hashes only
    the host, port and user, which two same-named clusters share (see
    ``bootstrap.control_path``).  ``extra_patterns`` adds hosts the shared settings apply to (on nodes: ``*``, so a bare
    worker IP picks up the key and known_hosts too).  ``send_env`` names variables each
    session takes along (``SendEnv``; the nodes' sshd accepts them, ``ssh.sshd``).
    """
    out = ["# Written by pytest-sky; regenerated on every launch.", ""]
    for e in entries:
        direct = not e.proxy_command and not e.proxy_jump
        names = [e.alias] + ([e.hostname] if e.hostname != e.alias and direct else [])
        out.append(f"Host {' '.join(names)}")
        out.append(f"  HostName {e.hostname}")
        out.append(f"  Port {e.port}")
        out.append(f"  User {e.user}")
        if e.proxy_command:
            out.append(f"  ProxyCommand {e.proxy_command}")
        if e.proxy_command and e.proxy_fdpass:
            out.append("  ProxyUseFdpass yes")
        if e.proxy_jump:
            out.append(f"  ProxyJump {e.proxy_jump}")
        if e.host_key_alias:
            out.append(f"  HostKeyAlias {e.host_key_alias}")
        out.append("")
    patterns = [e.alias for e in entries] + [e.hostname for e in entries if not e.proxy_command and not e.proxy_jump]
    patterns += list(extra_patterns)
    seen: list[str] = []
    for p in patterns:
        if p not in seen:
            seen.append(p)
    out.append(f"Host {' '.join(seen)}")
    out += _common(identity_file, known_hosts, control_path, control_master)
    out += [f"  SendEnv {name}" for name in send_env]
    out.append("")
    return "\n".join(out)
