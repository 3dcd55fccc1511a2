"""``python -m bench --peers``, its Kubernetes section: 20 concurrent ssh a round on a 2-node
Kubernetes-backend cluster (through the repository's API emulator), multiplexed and with a full
handshake each, against the same rounds on the local backend measured earlier in the run.
"""

from __future__ import annotations

from bench.peers import PeerPlan
from bench.records import Figure, Target, median, percentile
from bench.sections import DESIGN, Namer, Rounds, progress, ssh_argv


def measure(plan: PeerPlan, namer: Namer, local: list[Figure]) -> list[Figure]:
    """20 x ``kube_rounds`` concurrent ssh on a 2-node Kubernetes-backend cluster (API emulator)."""
    section = "peers: ssh concurrency, kubernetes"
    try:
        import kube_emulator.images  # noqa: F401 - the emulator and its image with sshd, which _rounds uses
    except Exception as exc:  # noqa: BLE001 - any import problem means "not measured"
        return [
            Figure(
                section=section,
                name="(not measured)",
                unit="s",
                value=None,
                note=f"kube_emulator not importable: {type(exc).__name__}: {exc}",
            )
        ]
    k = 20
    mux, raw = _rounds(plan, namer, k)
    return _figures(section, plan, k, mux, raw, local)


def _rounds(plan: PeerPlan, namer: Namer, k: int) -> tuple[Rounds, Rounds]:
    """The rounds on a 2-node cluster of a 3-node emulator: multiplexed, then raw, in turn."""
    import pytest_sky
    from kube_emulator import Emulator
    from kube_emulator.images import READY_IMAGE  # the default image has no sshd there

    mux, raw = Rounds(), Rounds()
    progress(f"peers kube: emulator with 3 nodes, 2-node cluster, {plan.kube_rounds} rounds of {k} ssh, twice")
    with Emulator(nodes=3) as emu:
        c = pytest_sky.launch(
            num_nodes=2,
            name=namer("kube"),
            backend="kubernetes",
            backend_options={"kubeconfig": str(emu.kubeconfig_path), "image": READY_IMAGE},
        )
        try:
            Rounds().run(ssh_argv(c, "echo hi"), 2)  # warm-up
            for _ in range(plan.kube_rounds):
                mux.run(ssh_argv(c, "echo hi"), k)
                raw.run(ssh_argv(c, "echo hi", raw=True), k)
        finally:
            c.down()
    return mux, raw


def _figures(section: str, plan: PeerPlan, k: int, mux: Rounds, raw: Rounds, local: list[Figure]) -> list[Figure]:
    """Each way's count, round time and p95, against the local backend's from the same run."""
    by_name = {f.name: f for f in local if f.section == "ssh concurrency"}
    figures = []
    for rounds, how in ((mux, "via the ssh config (multiplexed)"), (raw, "raw handshakes")):
        local_wall = by_name.get(f"round wall time, {how}, median")
        local_p95 = by_name.get(f"per-connection latency, {how}, p95")
        label = f"local backend, {how}, same run"
        figures += [
            Figure(
                section=section,
                name=f"{k} concurrent ssh x {plan.kube_rounds} rounds, {how}: succeeded",
                unit="count",
                value=rounds.ok,
                total=k * plan.kube_rounds,
                targets=[Target(k * plan.kube_rounds, DESIGN, at_least=True)],
                note=rounds.note,
            ),
            Figure(
                section=section,
                name=f"round wall time, {how}, median",
                unit="s",
                value=median(rounds.walls),
                baseline=local_wall.value if local_wall else None,
                baseline_name=label,
                samples=rounds.walls,
                baseline_samples=local_wall.samples if local_wall else [],
                note=KUBE_NOTE if rounds is mux else KUBE_RAW_NOTE,
            ),
            Figure(
                section=section,
                name=f"per-connection latency, {how}, p95",
                unit="s",
                value=percentile(rounds.per_conn, 95),
                baseline=local_p95.value if local_p95 else None,
                baseline_name=label,
                samples=rounds.per_conn,
                baseline_samples=local_p95.samples if local_p95 else [],
            ),
        ]
    return figures


KUBE_NOTE = (
    "both sides multiplex over one master to the head, opened at launch (Kubernetes: over a stream of the cluster's "
    "forwarder, which its ProxyCommand, kube_dial, handed to ssh; local: a direct TCP connection)"
)
KUBE_RAW_NOTE = (
    "every connection a full handshake: on Kubernetes each starts its own ProxyCommand (kube_dial, standard library "
    "only), which gets a new port-forward stream from the cluster's forwarder, hands its socket to ssh and exits "
    "(20 concurrent streams through the API server a round); on local a direct TCP connection"
)
