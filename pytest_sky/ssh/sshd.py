"""The nodes' ``sshd_config``, built in one place for every backend.

Every node runs OpenSSH ``sshd -D`` as its first process with this configuration: keys only,
one host key of ours, no DNS or PAM on the way in, and room for the hundreds of concurrent
sessions a multi-node run opens.  Backends differ only in where sshd listens, where its
files live and whether the PATH is known when the config is written (see :func:`render`).
"""

from __future__ import annotations

import functools
import re
import subprocess

from pytest_sky import shell
from pytest_sky.ssh.config import KEX


@functools.cache
def daemon_args(sshd: str) -> tuple[str, ...]:
    """How a node runs ``sshd``: in the foreground (``-D``), logging to stderr (``-e``) and,
    where it has the option (OpenSSH before 9.8, which split out ``sshd-session``), without
    re-executing itself for every connection (``-r``).

    Why ``-r``: the re-exec gives each connection a fresh address-space layout, hardening a
    long-lived server; a test node lives for seconds, and the re-exec (a fork, an exec and a
    second read of the config and host key per connection) was a quarter of the time 64
    nodes took to answer their first connection.  What a client sees is the same."""
    try:
        probe = subprocess.run([sshd, "-V"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ("-D", "-e")
    found = re.search(r"OpenSSH_(\d+)\.(\d+)", probe.stdout + probe.stderr)
    old = found is not None and (int(found.group(1)), int(found.group(2))) < (9, 8)
    return ("-D", "-e", "-r") if old else ("-D", "-e")


def render(
    *,
    listen: str | None,
    host_key: str,
    pid_file: str,
    path_env: str | None,
    home: str = "",
    print_last_log: bool = True,
    authorized_keys: str = ".ssh/authorized_keys",
    strict_modes: bool = True,
) -> str:
    """The text of an ``sshd_config``.

    ``listen`` is ``address:port`` (``ListenAddress``: a namespace node answers on its own
    address only) or a bare port (``Port``: a pod answers on every address it has); None
    leaves it out, for a node that picks its port itself and puts its ``Port`` line first
    (a Slurm node, shared with other jobs).  ``path_env`` is the PATH every session gets
    (``SetEnv``, with a ``PYTHONPATH`` naming ``home``'s :data:`~pytest_sky.shell.SITE_DIR`,
    where the ``sitecustomize`` that arms every Python process's stacks lives); None leaves the
    line out, for a caller that appends it where the PATH and home are known (a pod's image).
    ``print_last_log=False`` leaves ``PrintLastLog`` out, for an sshd that may be built without
    lastlog support.  ``authorized_keys`` is relative to the account's home unless absolute;
    ``strict_modes=False`` is for keys in a directory of the user's own below a world-writable
    one (``/tmp``), which sshd's check of every directory up to ``/`` would refuse.
    """
    listen_lines = [] if listen is None else [f"Port {listen}" if listen.isdigit() else f"ListenAddress {listen}"]
    lines = [
        *listen_lines,
        f"HostKey {host_key}",
        f"PidFile {pid_file}",
        f"AuthorizedKeysFile {authorized_keys}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        f"StrictModes {'yes' if strict_modes else 'no'}",
        "UsePAM no",
        "UseDNS no",
        "PrintMotd no",
        *(["PrintLastLog no"] if print_last_log else []),
        # The default 10:30:100 dropped 12 of 200 concurrent connections (DESIGN.md 5).
        "MaxStartups 100:30:200",
        "MaxSessions 100",
        "X11Forwarding no",
        "AllowAgentForwarding no",
        f"KexAlgorithms {KEX}",  # the client's list: names any sshd from 7.4 on accepts
        "ClientAliveInterval 5",
        "ClientAliveCountMax 3",
        # A job's token, which its sessions to other nodes take along (``SendEnv``): their
        # processes are the job's there too.
        f"AcceptEnv {shell.JOB_SCOPE_VAR}",
        # Nodes share the host's filesystem: a run should find the tools pytest runs with.
        # (A pod's PATH is its image's: the pod appends this line itself.)  sshd takes the
        # first SetEnv line only: every variable is on this one.
        *([f"SetEnv PATH={path_env} PYTHONPATH={home}/{shell.SITE_DIR}"] if path_env is not None else []),
        "Subsystem sftp internal-sftp",
        "LogLevel ERROR",
        "",
    ]
    return "\n".join(lines)
