"""The client's one SSH connection to the head (paramiko), host key checked.

paramiko rather than forking ``ssh``: a new connection costs about 25 ms and an exec on an
open one about 3 ms (DESIGN.md 5), and a run needs exactly one exec.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_sky.errors import RunError

if TYPE_CHECKING:
    import paramiko


def connect(
    host: str,
    port: int,
    key_path: Path,
    known_hosts: Path,
    *,
    user: str = "root",
    timeout: float = 20.0,
    sock: socket.socket | None = None,
    proxy_command: str | None = None,
    host_key_alias: str | None = None,
) -> paramiko.SSHClient:
    """``host_key_alias``: check the host key under this name of the known_hosts, whatever
    address and port are dialled (OpenSSH's ``HostKeyAlias``; paramiko has none, and looks a
    port other than 22 up as ``[host]:port``)."""
    import paramiko  # heavy (cryptography): only when a cluster is used

    if proxy_command and sock is None:
        sock = _proxy(proxy_command)  # type: ignore[assignment]

    client = paramiko.SSHClient()
    client.load_host_keys(str(known_hosts))
    known = client.get_host_keys()
    if host_key_alias is not None and host_key_alias in known:
        dialled = host if port == 22 else f"[{host}]:{port}"
        for kind, key in known[host_key_alias].items():
            known.add(dialled, kind, key)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        pkey = paramiko.Ed25519Key.from_private_key_file(str(key_path))
        client.connect(
            host,
            port=port,
            username=user,
            pkey=pkey,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
            allow_agent=False,
            look_for_keys=False,
            sock=sock,
        )
    except paramiko.BadHostKeyException as exc:
        client.close()
        raise RunError(
            f"host key of {host} does not match the cluster's known_hosts: refusing to connect ({exc})"
        ) from None
    except (paramiko.SSHException, OSError) as exc:
        client.close()
        raise RunError(f"cannot connect to the head at {host}:{port}: {exc}") from None
    transport = client.get_transport()
    if transport is not None:
        transport.set_keepalive(5)
    return client


def _proxy(command: str) -> paramiko.ProxyCommand:
    """paramiko's ProxyCommand, whose process is reaped when it closes: paramiko only signals
    it (twice: from its transport's thread and from ``close``), which left a zombie a
    connection until this process exited."""
    import signal
    import subprocess

    import paramiko

    class Reaped(paramiko.ProxyCommand):
        def close(self) -> None:
            if self.process.poll() is None:
                try:
                    self.process.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    return Reaped(command)
