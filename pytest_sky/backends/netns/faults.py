"""Network faults inside a node's namespace: iptables chains, tc shaping, the packet delayer."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pytest_sky import procs
from pytest_sky.backends.netns.output import await_line
from pytest_sky.backends.netns.preflight import fault_tools, holds_root_caps
from pytest_sky.backends.netns.reap import child_pid, kill_and_wait
from pytest_sky.backends.netns.userns import Holder
from pytest_sky.errors import SkyError
from pytest_sky.protocol import AGENT_PORT


@functools.lru_cache(maxsize=1)
def netem_available() -> bool:
    """Whether this kernel has ``sch_netem``, tried where it harms nothing: a throwaway
    network namespace's loopback (many kernels, this one's too, are built without it)."""
    tools = fault_tools()
    tc = tools["tc"]
    # An ordinary user's throwaway namespace is a user namespace's, as a rootless node's is.
    user = [] if holds_root_caps() else ["--user", "--map-root-user"]
    proc = subprocess.run(
        [tools["unshare"], *user, "--net", tc, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    return proc.returncode == 0


#: The chains a node's network faults live in: its own, so a task's iptables rules stay.
FAULT_CHAINS = ("PSKY-IN", "PSKY-OUT")
DELAY_CHAIN = "PSKY-DELAY"  # mangle INPUT and OUTPUT: to the delayer
DELAY_QUEUE = 7301  # the node's NFQUEUE number (queues are per network namespace)
_IFB = "psky-ifb"


@dataclass(frozen=True)
class LinkFaults:
    """One node's share of a cluster's network faults, as its namespace applies them."""

    head_ip: str  # SSH between the head and each worker stays up: the harness's control path
    is_head: bool
    blocked: tuple[str, ...] = ()  # peers whose traffic is dropped both ways
    loss_pct: float = 0.0
    rate_mbit: float | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0


#: The harness's control path from the head to each worker, which partitions keep: SSH, and
#: the workers' agent servers (what the head starts and collects each rank through).
CONTROL_PORTS = (22, AGENT_PORT)


def iptables_rules(faults: LinkFaults, *, netem: bool) -> str:
    """``iptables-restore --noflush`` input that makes the node's fault chains ``faults``
    (declaring a chain flushes it: the previous state goes).  Delay without netem sends every
    packet through the node's delayer (mangle, before filter's drops: a packet is delayed,
    then maybe dropped, as on a real path); ``--queue-bypass``: no delayer, no delay."""
    delayed = (faults.delay_ms or faults.jitter_ms) and not netem
    lines = ["*mangle", f":{DELAY_CHAIN} - [0:0]"]
    if delayed:
        lines.append(f"-A {DELAY_CHAIN} -j NFQUEUE --queue-num {DELAY_QUEUE} --queue-bypass")
    lines += ["COMMIT", "*filter", *(f":{chain} - [0:0]" for chain in FAULT_CHAINS)]
    if faults.loss_pct and not netem:  # netem drops in its own queue
        p = f"{faults.loss_pct / 100:.6f}"
        lines += [f"-A {chain} -m statistic --mode random --probability {p} -j DROP" for chain in FAULT_CHAINS]
    for peer in faults.blocked:
        for port in CONTROL_PORTS:
            if faults.is_head:  # the head's SSH and agent connections to its workers
                lines.append(f"-A PSKY-OUT -d {peer} -p tcp --dport {port} -j RETURN")
                lines.append(f"-A PSKY-IN -s {peer} -p tcp --sport {port} -j RETURN")
            elif peer == faults.head_ip:  # the head's SSH and agent connections to this worker
                lines.append(f"-A PSKY-IN -s {peer} -p tcp --dport {port} -j RETURN")
                lines.append(f"-A PSKY-OUT -d {peer} -p tcp --sport {port} -j RETURN")
        lines.append(f"-A PSKY-IN -s {peer} -j DROP")
        lines.append(f"-A PSKY-OUT -d {peer} -j DROP")
    return "\n".join([*lines, "COMMIT", ""])


def shaping_commands(faults: LinkFaults, *, netem: bool, mtu: int) -> list[str]:
    """``tc`` commands (after the old shaping is removed) giving eth0 the degraded link, both
    ways: egress on eth0, ingress redirected through an ifb device and shaped there."""
    if netem:
        args = []
        if faults.delay_ms or faults.jitter_ms:
            args += ["delay", f"{faults.delay_ms:g}ms", f"{faults.jitter_ms:g}ms"]
        if faults.loss_pct:
            args += ["loss", f"{faults.loss_pct:g}%"]
        if faults.rate_mbit:
            args += ["rate", f"{faults.rate_mbit:g}mbit"]
        qdisc = ["netem", "limit", "100000", *args] if args else []
    elif faults.rate_mbit:
        # A burst of 10 ms at the rate, and never less than two packets of the link's MTU.
        burst = max(int(faults.rate_mbit * 1e6 / 8 / 100), 2 * mtu)
        qdisc = ["tbf", "rate", f"{faults.rate_mbit:g}mbit", "burst", str(burst), "latency", "200ms"]
    else:
        qdisc = []
    if not qdisc:
        return []
    q = " ".join(qdisc)
    return [
        f"qdisc add dev eth0 root {q}",
        f"link add {_IFB} type ifb",
        f"link set {_IFB} up",
        f"qdisc add dev {_IFB} root {q}",
        "qdisc add dev eth0 handle ffff: ingress",
        f"filter add dev eth0 parent ffff: protocol all u32 match u32 0 0 action mirred egress redirect dev {_IFB}",
    ]


def enter_node(init_pid: int, holder: Holder | None, *, pid: bool = False) -> list[str]:
    """The argv prefix that runs a program in the node's network namespace (and its PID
    namespace, with ``pid``), with the power to change it: root's, or on a rootless
    cluster that of root of the cluster's user namespace, which owns the node's."""
    nsenter = fault_tools()["nsenter"]
    if holder is None or not holder.rootless:
        return [nsenter, "-t", str(init_pid), "-n", *(["-p"] if pid else [])]
    spaces = [f"--net=/proc/{init_pid}/ns/net", *([f"--pid=/proc/{init_pid}/ns/pid"] if pid else [])]
    return holder.enter(*spaces)


def apply_link_faults(
    init_pid: int, faults: LinkFaults, *, netem: bool, mtu: int, ip: str, holder: Holder | None = None
) -> None:
    """Make ``faults`` the network state of the node whose first process is ``init_pid``,
    inside its network namespace (one shell there: iptables, tc and ip as the host has them)."""
    tools = fault_tools()
    tc, ipt = tools["tc"], tools["iptables"]
    script = "\n".join(
        [
            "set -e",
            f"{tools['iptables-restore']} -w --noflush <<'EOF'\n{iptables_rules(faults, netem=netem)}EOF",
            *(
                f"{ipt} -w -t {table} -C {base} -j {chain} 2>/dev/null || {ipt} -w -t {table} -I {base} 1 -j {chain}"
                for table, base, chain in (
                    ("filter", "INPUT", "PSKY-IN"),
                    ("filter", "OUTPUT", "PSKY-OUT"),
                    ("mangle", "INPUT", DELAY_CHAIN),
                    ("mangle", "OUTPUT", DELAY_CHAIN),
                )
            ),
            f"{tc} qdisc del dev eth0 root 2>/dev/null || true",
            f"{tc} qdisc del dev eth0 ingress 2>/dev/null || true",
            f"{ip} link del {_IFB} 2>/dev/null || true",
            *(
                f"{ip} {c}" if c.startswith("link ") else f"{tc} {c}"
                for c in shaping_commands(faults, netem=netem, mtu=mtu)
            ),
        ]
    )
    proc = subprocess.run(
        [*enter_node(init_pid, holder), "/bin/sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        raise SkyError(f"could not change the network of node pid {init_pid}: {err[-1] if err else proc.returncode}")


@dataclass(frozen=True)
class Delayer:
    """A node's packet delayer (``nfdelay.py``): its pid and that of the ``nsenter`` that
    started it, each with its start time, so a recycled pid is never signalled."""

    pid: int
    start_time: int | None
    parent: int
    parent_start: int | None

    def to_json(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, int | None]) -> Delayer:
        return cls(
            pid=int(data["pid"] or 0),
            start_time=data.get("start_time"),
            parent=int(data["parent"] or 0),
            parent_start=data.get("parent_start"),
        )


def start_delayer(
    init_pid: int, delay_ms: float, jitter_ms: float, log_path: Path, holder: Holder | None = None
) -> Delayer:
    """Start the delayer in the node's network and PID namespaces (it dies with the node)
    and return once it owns the node's queue (it says ``bound``)."""
    script = Path(__file__).parent.parent / "nfdelay.py"
    argv = [*enter_node(init_pid, holder, pid=True), sys.executable, "-I", str(script)]
    with open(log_path, "ab") as log_file:
        popen = subprocess.Popen(
            [*argv, str(DELAY_QUEUE), f"{delay_ms:g}", f"{jitter_ms:g}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_file,
            start_new_session=True,
            close_fds=True,
        )
    try:
        await_line(popen, "bound", "the node's packet delayer did not start", log_path, timeout=30.0)
    except BaseException:
        kill_and_wait([*procs.children(popen.pid), popen.pid])
        popen.wait(5)
        raise
    child = child_pid(popen.pid)
    return Delayer(child, procs.start_time(child), popen.pid, procs.start_time(popen.pid))


def stop_delayer(delayer: Delayer) -> None:
    """Kill a delayer (and its ``nsenter``) if they are still the processes recorded."""
    pids = [
        pid
        for pid, start in ((delayer.pid, delayer.start_time), (delayer.parent, delayer.parent_start))
        if pid and procs.is_alive(pid, start)
    ]
    kill_and_wait(pids)
