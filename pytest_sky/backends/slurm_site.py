"""Where a Slurm cluster is, and the one way its commands are run (DESIGN.md section 10).

A site is reached as SkyPilot reaches it: over SSH to a login node, named by a ``Host`` of an
SSH config file (``~/.slurm/config``, SkyPilot's file, or the path in
``PYTEST_SKY_SLURM_CONFIG`` / ``--slurm-config``), which ``ssh -F`` reads whole: its user,
keys, jump hosts and host key checking are the user's, untouched.  Where no such file exists
and ``sbatch`` is on this machine's PATH, this machine is the login node.

Every command on the login node is ``shell/slurm_login.sh`` with a subcommand.  Over SSH the
script travels as one base64 word inside single quotes, and so does every argument that may
span lines: the remote command then reads the same to any login shell (csh's included,
which refuses a line break inside quotes), and stdin stays free for what a command reads.
"""

from __future__ import annotations

import base64
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pytest_sky import shell
from pytest_sky.errors import BackendUnavailableError
from pytest_sky.settings import SLURM_CONFIG

#: SkyPilot's file of Slurm login nodes.
DEFAULT_CONFIG = SLURM_CONFIG
#: ssh's exit status for its own failure (not the remote command's).
SSH_FAILED = 255


class SlurmUnreachableError(BackendUnavailableError):
    """The login node cannot be reached, or has no Slurm (the message says which, and how)."""


@dataclass(frozen=True)
class Site:
    """One Slurm cluster as this client reaches it."""

    #: The SSH config naming the login node (absolute); None: this machine is the login node.
    config: str | None
    host: str | None  # its Host there

    def describe(self) -> str:
        return "this machine" if self.config is None else f"{self.host} ({self.config})"


def hosts(text: str) -> list[str]:
    """The ``Host`` names of an SSH config, in order, without patterns (``*``, ``?``, ``!``)."""
    names: list[str] = []
    for line in text.splitlines():
        found = re.match(r"\s*host(?:\s*=\s*|\s+)(.+)$", line, re.IGNORECASE)
        if found:
            for name in shlex.split(found.group(1), comments=True):
                if not any(c in name for c in "*?!") and name not in names:
                    names.append(name)
    return names


def locate(config: str | None, cluster: str | None) -> Site:
    """The site ``config`` (the setting; None: ``~/.slurm/config``) and ``cluster`` (a Host;
    None: the file's only one) name; each way it can be wrong is one line saying what to do."""
    path = Path(os.path.expanduser(config or DEFAULT_CONFIG)).absolute()
    if not path.is_file():
        if config:
            raise SlurmUnreachableError(
                f"the Slurm config {config} (PYTEST_SKY_SLURM_CONFIG) does not exist: "
                "name an SSH config whose Host is the login node"
            )
        if cluster is None and shutil.which("sbatch"):
            return Site(None, None)
        raise SlurmUnreachableError(
            f"no Slurm cluster to use: write its login node as a Host in {DEFAULT_CONFIG} (SkyPilot's file), "
            "or point PYTEST_SKY_SLURM_CONFIG at an SSH config that has one"
        )
    try:
        names = hosts(path.read_text())
    except (OSError, ValueError) as exc:
        raise SlurmUnreachableError(f"cannot read the Slurm config {path}: {exc}") from None
    if cluster is not None:
        if cluster not in names:
            known = ", ".join(names) or "none"
            raise SlurmUnreachableError(f"--slurm-cluster {cluster} is not a Host of {path} (its hosts: {known})")
        return Site(str(path), cluster)
    if len(names) == 1:
        return Site(str(path), names[0])
    if not names:
        raise SlurmUnreachableError(f"{path} names no Host: add the login node as one (Host NAME, HostName ...)")
    raise SlurmUnreachableError(f"{path} names {len(names)} hosts ({', '.join(names)}): pick one with --slurm-cluster")


@dataclass(frozen=True)
class Answer:
    code: int
    out: str
    err: str

    def lines(self, word: str) -> list[list[str]]:
        """The words of each line that starts with ``word``, after it."""
        return [line.split()[1:] for line in self.out.splitlines() if line.split()[:1] == [word]]


def encoded(text: str) -> str:
    """``text`` as one word any shell passes through unchanged (the script decodes it)."""
    return base64.b64encode(text.encode()).decode()


class Login:
    """The login node of ``site``: each call one ``slurm_login.sh`` command there."""

    def __init__(self, site: Site) -> None:
        self.site = site

    def argv(self, command: str, *args: str) -> list[str]:
        script = shell.script(shell.SLURM_LOGIN)
        if self.site.config is None:
            return ["bash", "-c", script, "slurm-login", command, *args]
        if any("\n" in a for a in args):
            raise ValueError("an argument of a login command spans lines: pass it encoded()")
        decode = f'eval "$(printf %s {encoded(script)} | base64 -d)"'
        words = ["exec", "bash", "-c", shlex.quote(decode), "slurm-login", *map(shlex.quote, [command, *args])]
        remote = " ".join(words)
        return ["ssh", "-F", self.site.config, "-T", "-o", "BatchMode=yes", "--", str(self.site.host), remote]

    def run(self, command: str, *args: str, stdin: bytes = b"", timeout: float = 120) -> Answer:
        try:
            done = subprocess.run(self.argv(command, *args), input=stdin, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SlurmUnreachableError(
                f"the Slurm login node {self.site.describe()} did not answer {command} within {timeout:g} s"
            ) from None
        except OSError as exc:
            raise SlurmUnreachableError(f"cannot run {self.argv(command)[0]}: {exc}") from None
        answer = Answer(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))
        self.check_reached(answer.code, answer.err)
        return answer

    def start(self, command: str, *args: str) -> subprocess.Popen[bytes]:
        """A command whose output is read as it comes (a launch's progress)."""
        return subprocess.Popen(
            self.argv(command, *args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C reaches the client, which ends this itself
        )

    def check_reached(self, code: int, err: str) -> None:
        """One line where ssh itself failed (exit 255), not the command it ran."""
        if self.site.config is not None and code == SSH_FAILED:
            said = err.strip().splitlines()
            raise SlurmUnreachableError(
                f"cannot reach the Slurm login node {self.site.describe()}: {said[-1] if said else 'ssh failed'}"
            )

    def proxy_command(self, ip: str, port: int) -> str | None:
        """How OpenSSH (and paramiko) reach ``ip:port`` on the site's network: through the
        login node (``ssh -W``), as the site's own file says to reach it; None from a
        machine that is the login node."""
        if self.site.config is None:
            return None
        return shlex.join(
            ["ssh", "-F", self.site.config, "-T", "-o", "BatchMode=yes", "-W", f"{ip}:{port}", str(self.site.host)]
        )
