"""The Slurm testbed as the tests run it: ``python -m slurm_testbed`` in a process of its own,
as CI and a user run it, stopped with SIGTERM as they stop it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: The programs a testbed needs (``scripts/setup.sh`` installs their Debian packages).
PROGRAMS = ("slurmctld", "slurmd", "sbatch", "munged")


def skip_without_slurm() -> None:
    missing = [p for p in PROGRAMS if shutil.which(p, path="/usr/sbin:/usr/bin") is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): run scripts/setup.sh as root")
    if os.geteuid() != 0:
        pytest.skip("the Slurm testbed runs its daemons in root's local nodes")


@dataclass(frozen=True)
class RunningTestbed:
    config: Path  # the SSH config whose one Host is the login node
    host: str
    process: subprocess.Popen[str]

    def ssh(self, command: str, *, user: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A command on the login node, over SSH through the config, as a user of it would."""
        argv = ["ssh", "-F", str(self.config), *(["-l", user] if user else []), self.host, command]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@contextmanager
def running_testbed(directory: Path, *args: str, host: str = "testbed") -> Iterator[RunningTestbed]:
    """A running testbed until the block ends; its config is ``directory/slurm-config``.

    Ready is the testbed's own word: its last line before it waits says it wrote the config,
    which it does once ``sinfo`` lists every node idle (a testbed that fails says why and
    exits, and the test fails with what it said)."""
    config = directory / "slurm-config"
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurm_testbed", "--slurm-config", str(config), "--name", host, *args],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    said = []
    assert proc.stderr is not None
    for line in proc.stderr:
        said.append(line)
        if "wrote " in line:
            break
    else:
        proc.wait(timeout=60)
        pytest.fail(f"the Slurm testbed did not start (exit {proc.returncode}): {''.join(said)}")
    try:
        yield RunningTestbed(config, host, proc)
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM, as CI stops it; what it said on the way down."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err or ""
