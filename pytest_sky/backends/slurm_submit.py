"""A launch's one conversation with the login node: submit, wait for the allocation, deliver
each node's files, learn where every node's sshd listens (``slurm_login.sh submit``).

One SSH session for all of it: a connection through a site's login node costs a handshake
(or several, through jump hosts), and the wait is a loop on the login node that prints a line
only when the job's state or pending reason changes, which the launch shows as it comes.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pytest_sky import console
from pytest_sky.backends.slurm_site import Login, encoded
from pytest_sky.errors import ProvisionError
from pytest_sky.shell import SLURM_NODE, script

#: How long the files' delivery and the sshds' start may take once the allocation runs.
DELIVERY_SECONDS = 120.0


@dataclass(frozen=True)
class SlurmNode:
    rank: int  # Slurm's node id in the allocation
    name: str  # its NodeName (and hostname)
    addr: str  # its NodeAddr: what SKYPILOT_NODE_IPS lists
    port: int  # where pytest-sky's sshd listens on it


@dataclass
class Allocation:
    """What the conversation learnt, as it learnt it."""

    job_id: str | None = None
    state: str = ""
    reason: str = ""
    nodelist: str = ""
    ports: dict[int, tuple[str, int]] = field(default_factory=dict)  # node id -> (name, port)
    addrs: dict[str, str] = field(default_factory=dict)  # name -> NodeAddr
    ready: bool = False
    refused: str = ""
    errors: list[str] = field(default_factory=list)

    def nodes(self) -> list[SlurmNode]:
        return [
            SlurmNode(rank, name, self.addrs.get(name, name), port) for rank, (name, port) in sorted(self.ports.items())
        ]

    def take(self, line: str, cluster: str, on_job: Callable[[str], None]) -> None:
        word, _, rest = line.partition(" ")
        if word == "job":
            self.job_id = rest.strip()
            on_job(self.job_id)
        elif word == "state":
            state, _, reason = rest.partition(" ")
            if (state, reason) != (self.state, self.reason):
                self.state, self.reason = state, reason.strip()
                why = f" ({self.reason})" if self.reason and self.reason != "None" else ""
                console.progress(f"{cluster}: Slurm job {self.job_id} {state.lower()}{why}")
        elif word == "node":
            rank, name, port = rest.split()
            self.ports[int(rank)] = (name, int(port))
        elif word == "addr":
            name, addr = rest.split()
            self.addrs[name] = addr
        elif word == "nodelist":
            self.nodelist = rest.strip()
        elif word == "ready":
            self.ready = True
        elif word == "refused":
            self.refused = rest.strip().removeprefix("sbatch: error: ")
        elif word == "error":
            self.errors.append(rest.strip())


def submit(
    login: Login,
    cluster: str,
    batch: str,
    directory: str,
    files: bytes,
    options: list[str],
    timeout: float,
    on_job: Callable[[str], None],
) -> Allocation:
    """Run the conversation; the allocation once every node's sshd answers, else one
    :class:`ProvisionError` saying why (Slurm's refusal, its pending reason at the timeout,
    a node that could not start)."""
    digest = hashlib.sha256(files).hexdigest()
    args = [encoded(batch), encoded(script(SLURM_NODE)), directory, str(int(timeout)), digest, *options]
    proc = login.start("submit", *args)
    alloc = Allocation()
    killer = threading.Timer(timeout + DELIVERY_SECONDS, proc.kill)  # the login node's loop has its own
    killer.start()
    try:
        feeder = threading.Thread(target=_feed, args=(proc.stdin, files), daemon=True)
        feeder.start()
        assert proc.stdout is not None
        for raw in proc.stdout:
            alloc.take(raw.decode(errors="replace").rstrip("\n"), cluster, on_job)
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        code = proc.wait()
    finally:
        killer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    login.check_reached(code, err)
    if not alloc.ready:
        raise ProvisionError(_why_not(alloc, cluster, timeout, err))
    return alloc


def _feed(stdin, data: bytes) -> None:
    """The files, to the node steps (srun passes its stdin to every task); a login command
    that ended before reading them all is not this thread's to report."""
    try:
        stdin.write(data)
        stdin.close()
    except (BrokenPipeError, OSError):
        pass


def _why_not(alloc: Allocation, cluster: str, timeout: float, err: str) -> str:
    said = err.strip().splitlines()[-1] if err.strip() else ""
    if alloc.refused:
        return f"Slurm refused the allocation of {cluster}: {alloc.refused}"
    if alloc.job_id is None:
        return f"could not submit the allocation of {cluster}: {said or 'sbatch said nothing'}"
    job = f"Slurm job {alloc.job_id} of {cluster}"
    if alloc.state == "PENDING":
        return f"{job} was still pending after {timeout:g} s ({alloc.reason}); raise --slurm-timeout or ask for less"
    if alloc.state != "RUNNING":
        return f"{job} ended ({alloc.state or 'gone'}) before it ran: {said or 'see sacct -j ' + alloc.job_id}"
    if alloc.errors:
        return f"{job}: a node could not start: {alloc.errors[0]}"
    return f"{job}: its nodes' sshd did not start: {said or 'the node step ended without a word'}"
