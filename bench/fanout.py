"""``python -m bench --peers``, its ssh fan-out section: ``hostname`` on 16 nodes through
``cluster.run`` against parallel-ssh and a paramiko thread pool, cold (every connection new, on
both sides) and warm (every connection open), rounds interleaved so each ratio is a same-run one.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bench.peers import INSTALL_HINT, PeerPlan, child, missing
from bench.records import Figure, Target, median
from bench.sections import DESIGN, Namer, cluster, progress, ssh_argv

if TYPE_CHECKING:
    import paramiko

    from pytest_sky import Cluster


def _paramiko_connect(ip: str, pkey: paramiko.PKey, known_hosts: Path) -> paramiko.SSHClient:
    """A paramiko connection to ``ip`` that checks its host key (RejectPolicy)."""
    import paramiko

    client = paramiko.SSHClient()
    client.load_host_keys(str(known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(ip, username="root", pkey=pkey, allow_agent=False, look_for_keys=False, timeout=20)
    return client


def _paramiko_hostname(client: paramiko.SSHClient) -> str:
    _, stdout, _ = client.exec_command("hostname")
    out = stdout.read().decode().strip()
    if stdout.channel.recv_exit_status() != 0:
        raise RuntimeError("hostname failed")
    return out


def _paramiko_round(one: Callable, items: list) -> float:
    """``one`` on every item at once, a thread each; the round's seconds (every name distinct)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        names = list(pool.map(one, items))
    dt = time.perf_counter() - t0
    if len(set(names)) != len(items):
        raise RuntimeError(f"paramiko fan-out got {names}")
    return dt


def _paramiko_fanout(ips: list[str], key_path: Path, known_hosts: Path) -> float:
    import paramiko

    pkey = paramiko.Ed25519Key.from_private_key_file(str(key_path))

    def one(ip: str) -> str:
        client = _paramiko_connect(ip, pkey, known_hosts)
        try:
            return _paramiko_hostname(client)
        finally:
            client.close()

    return _paramiko_round(one, ips)


def _ours_fanout(c: Cluster) -> float:
    t0 = time.perf_counter()
    res = c.run("hostname")
    dt = time.perf_counter() - t0
    names = [r.stdout.strip() for r in res.ranks]
    if res.returncode != 0 or len(set(names)) != c.num_nodes:
        raise RuntimeError(f"cluster.run('hostname') failed: {res.error or res.output[-500:]}")
    return dt


#: On the head: close the agent's head->worker masters (ControlPersist keeps them between runs).
_CLOSE_HEAD_MASTERS = 'for s in /run/psky-cm-*; do [ -S "$s" ] && ssh -S "$s" -O exit x 2>/dev/null; done; true'


def _ours_fanout_cold(c: Cluster) -> float:
    """``cluster.run`` with nothing open: a new client->head connection and a fresh
    head->worker handshake per worker, as paramiko and parallel-ssh pay (closing is untimed)."""
    subprocess.run(ssh_argv(c, _CLOSE_HEAD_MASTERS, raw=True), capture_output=True, check=True, timeout=60)
    c._drop_connection()  # the benchmark measures the cold path on purpose
    return _ours_fanout(c)


def _paramiko_open(ips: list[str], key_path: Path, known_hosts: Path) -> list[paramiko.SSHClient]:
    import paramiko

    pkey = paramiko.Ed25519Key.from_private_key_file(str(key_path))
    return [_paramiko_connect(ip, pkey, known_hosts) for ip in ips]


def _paramiko_warm(clients: list[paramiko.SSHClient]) -> float:
    """``hostname`` on every node over connections opened beforehand, one thread each."""
    return _paramiko_round(_paramiko_hostname, clients)


def _known_hosts_keys(known_hosts: Path, ips: list[str]) -> str:
    """Whether the cluster's known_hosts names the node IPs (what a host-key check would need)."""
    try:
        text = known_hosts.read_text()
    except OSError:
        return "no known_hosts file"
    hit = sum(1 for ip in ips if ip in text)
    return f"{hit}/{len(ips)} node IPs in known_hosts"


@dataclass
class _Fanout:
    """Milliseconds per round, by who and how."""

    cold: list[float] = field(default_factory=list)
    warm: list[float] = field(default_factory=list)
    pssh: list[float] = field(default_factory=list)
    para: list[float] = field(default_factory=list)
    para_warm: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def measure(self, steps: list[tuple[list[float], str, Callable[[], float]]], rounds: int) -> None:
        for i in range(rounds + 1):  # the first is a warm-up
            for sink, label, fn in steps:
                try:
                    dt = fn()
                except Exception as exc:  # noqa: BLE001 - a failing peer must not end the section
                    self.notes.append(f"{label}: {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                if i > 0:
                    sink.append(dt * 1000)


def measure(plan: PeerPlan, namer: Namer) -> list[Figure]:
    """``hostname`` on 16 nodes: cold (every connection new, on both sides) and warm (every
    connection open, on both sides), rounds interleaved."""
    from pytest_sky.state import StateStore

    k = plan.fanout_nodes
    f = _Fanout()
    pssh_missing = missing("pssh")
    with cluster(k, namer(f"fan{k}")) as c:
        d = StateStore().cluster_dir(c.name)
        key, known_hosts = d / "id_ed25519", d / "known_hosts"
        ips = list(c.node_ips)
        clients = _paramiko_open(ips, key, known_hosts)
        try:
            steps: list[tuple[list[float], str, Callable[[], float]]] = [
                (f.cold, "pytest-sky cold", lambda: _ours_fanout_cold(c)),
                (f.para, "paramiko", lambda: _paramiko_fanout(ips, key, known_hosts)),
                (f.warm, "pytest-sky warm", lambda: _ours_fanout(c)),
                (f.para_warm, "paramiko warm", lambda: _paramiko_warm(clients)),
            ]
            if not pssh_missing:

                def pssh_round() -> float:
                    r = child(["pssh", str(key), *ips], timeout=120)
                    if r["failures"] or len(set(r["names"])) != k:
                        raise RuntimeError(f"parallel-ssh: {r['failures'] or r['names']}")
                    return r["seconds"]

                steps.append((f.pssh, "parallel-ssh", pssh_round))
            progress(f"peers fan-out: hostname on {k} nodes, cold and warm, 1 warm-up + {plan.fanout_rounds} rounds")
            f.measure(steps, plan.fanout_rounds)
        finally:
            for client in clients:
                client.close()
        kh = _known_hosts_keys(known_hosts, ips)
    return _fanout_figures(k, f, pssh_missing, kh)


def _fanout_figures(k: int, f: _Fanout, pssh_missing: bool, kh: str) -> list[Figure]:
    pssh_note = (
        f"parallel-ssh not installed ({INSTALL_HINT})"
        if pssh_missing
        else "parallel-ssh (pssh.clients.ParallelSSHClient, libssh2) has no known_hosts option: it connected "
        f"without checking host keys ({kh}); paramiko checked them (RejectPolicy)"
    )
    cold_note = (
        "cold: cluster.run with its client->head connection dropped and the head's head->worker masters "
        f"closed before each round (untimed), so it pays {k} handshakes (1 client->head, {k - 1} head->worker) "
        f"as the baselines pay {k}"
    )
    warm_note = (
        "warm: cluster.run over its open client connection and the head's ControlPersist masters; "
        f"paramiko over {k} connections opened beforehand, one exec each"
    )
    section, unit = "peers: ssh fan-out", "ms"
    cold, warm = f"run('hostname'), {k} nodes, cold", f"run('hostname'), {k} nodes, warm"
    return [
        Figure(
            section=section,
            name=cold,
            unit=unit,
            value=median(f.cold),
            baseline=median(f.pssh),
            baseline_name=f"parallel-ssh, {k} hosts, connect+exec",
            samples=f.cold,
            baseline_samples=f.pssh,
            note="; ".join(dict.fromkeys([cold_note, pssh_note, *f.notes])),
        ),
        Figure(
            section=section,
            name=cold,
            unit=unit,
            value=median(f.cold),
            baseline=median(f.para),
            baseline_name=f"paramiko, {k} threads, connect+exec",
            samples=f.cold,
            baseline_samples=f.para,
        ),
        Figure(
            section=section,
            name=warm,
            unit=unit,
            value=median(f.warm),
            baseline=median(f.para_warm),
            baseline_name=f"paramiko, {k} threads, exec on open connections",
            targets=[Target(150, DESIGN)],
            samples=f.warm,
            baseline_samples=f.para_warm,
            note=warm_note,
        ),
    ]
