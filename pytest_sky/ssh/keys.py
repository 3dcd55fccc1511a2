"""Per-cluster key material, generated on the client.

Generating every host key here (instead of letting each sshd make its own) is what lets us
write every ``known_hosts`` before a node starts, so host key checking stays on everywhere:
client -> head, head -> worker, worker -> worker.  ``cryptography`` makes an ed25519 pair in
microseconds, where forking ``ssh-keygen`` per node would cost milliseconds each.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


@dataclass(frozen=True)
class KeyPair:
    private_openssh: bytes  # OpenSSH PEM, what sshd and ssh read
    public_line: str  # "ssh-ed25519 AAAA... comment"

    @property
    def public_key(self) -> str:
        """The key without its comment, as it appears in known_hosts."""
        return " ".join(self.public_line.split()[:2])


def generate(comment: str) -> KeyPair:
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return KeyPair(private_openssh=private, public_line=f"{public.decode()} {comment}")


def load(private_openssh: bytes, comment: str = "") -> KeyPair:
    """The pair of a private key written earlier (the client's copy of the cluster key)."""
    key = serialization.load_ssh_private_key(private_openssh, password=None)
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return KeyPair(private_openssh=private_openssh, public_line=f"{public.decode()} {comment}".strip())


@dataclass(frozen=True)
class ClusterKeys:
    """The cluster's login key (shared by client and nodes) and one host key per node."""

    cluster: KeyPair
    hosts: tuple[KeyPair, ...]

    @classmethod
    def generate(cls, cluster_name: str, num_nodes: int) -> ClusterKeys:
        return cls(
            cluster=generate(f"pytest-sky:{cluster_name}"),
            hosts=tuple(generate(f"pytest-sky:{cluster_name}:host{r}") for r in range(num_nodes)),
        )


def write_private(path: Path, data: bytes) -> None:
    """Write a private key 0600 from the first byte (never briefly world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, 0o600)


def known_hosts_lines(entries: list[tuple[list[str], KeyPair]]) -> str:
    """known_hosts text: each node's names and addresses, then its host key."""
    return "".join(f"{','.join(names)} {key.public_key}\n" for names, key in entries)


def known_host_keys(text: str) -> dict[str, KeyPair]:
    """Each name of a known_hosts text (as :func:`known_hosts_lines` writes it) -> its host
    key, public only: the private half lives on the node, never in a known_hosts."""
    out: dict[str, KeyPair] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3 and not line.startswith("#"):
            for name in fields[0].split(","):
                out[name] = KeyPair(private_openssh=b"", public_line=" ".join(fields[1:3]))
    return out
