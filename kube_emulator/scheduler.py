"""The emulated scheduler: resource fit, taints, node selectors and pod anti-affinity.

A tiny subset of kube-scheduler's filter and score plugins, chosen because the backend
depends on exactly these: requests against allocatable (``NodeResourcesFit``), taints
(``TaintToleration``), ``nodeSelector``/required node affinity (``NodeAffinity``), and
required plus preferred pod anti-affinity on a topology key (``InterPodAffinity``).  Pure
functions over plain dicts, so they are testable without a server; the failure message
has the real scheduler's shape (``0/3 nodes are available: 3 Insufficient nvidia.com/gpu.``)
because the backend quotes it to users.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from kube_emulator.selectors import LabelSelector, SelectorError, selector_from_object

GPU = "nvidia.com/gpu"
HOSTNAME_LABEL = "kubernetes.io/hostname"

_SUFFIX = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
}
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:[eE]([+-]?\d+))?(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


class QuantityError(ValueError):
    """Not a Kubernetes resource quantity (the API server answers 422)."""


def parse_quantity(value: str | float) -> Fraction:
    """``"500m"`` -> 1/2, ``"8Gi"`` -> 8589934592, ``2`` -> 2 (exact, no float rounding)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Fraction(str(value))
    text = str(value).strip()
    m = _QUANTITY.match(text)
    if not m:
        raise QuantityError(
            f"quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$': {value!r}"
        )
    number = Fraction(m.group(1))
    if m.group(2):
        number *= Fraction(10) ** int(m.group(2))
    return number * _SUFFIX[m.group(3) or ""]


def pod_requests(pod: Mapping[str, Any]) -> dict[str, Fraction]:
    """Sum of the containers' requests; a resource with only a limit requests the limit
    (the API server defaults requests from limits)."""
    total: dict[str, Fraction] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        merged = dict(resources.get("limits") or {})
        merged.update(resources.get("requests") or {})
        for name, qty in merged.items():
            total[name] = total.get(name, Fraction(0)) + parse_quantity(qty)
    return total


def is_terminated(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


@dataclass
class NodeView:
    """What the scheduler needs of an emulated node."""

    name: str
    labels: dict[str, str]
    allocatable: dict[str, Fraction]
    taints: list[dict[str, str]] = field(default_factory=list)


def node_view(node: Mapping[str, Any]) -> NodeView:
    meta = node.get("metadata") or {}
    alloc = {k: parse_quantity(v) for k, v in ((node.get("status") or {}).get("allocatable") or {}).items()}
    return NodeView(
        name=meta["name"],
        labels=dict(meta.get("labels") or {}),
        allocatable=alloc,
        taints=list((node.get("spec") or {}).get("taints") or []),
    )


def tolerates(tolerations: Iterable[Mapping[str, Any]], taint: Mapping[str, str]) -> bool:
    for tol in tolerations:
        if tol.get("effect") and tol.get("effect") != taint.get("effect"):
            continue
        op = tol.get("operator") or "Equal"
        if op == "Exists":
            if not tol.get("key") or tol.get("key") == taint.get("key"):
                return True
        elif tol.get("key") == taint.get("key") and (tol.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _taint_text(taint: Mapping[str, str]) -> str:
    return f"{{{taint['key']}: {taint['value']}}}" if taint.get("value") else f"{{{taint['key']}: }}"


@dataclass
class _Term:
    selector: LabelSelector | None
    namespaces: set[str] | None  # None: every namespace
    topology_key: str
    weight: int = 0


def _terms(pod: Mapping[str, Any], kind: str, mode: str) -> list[_Term]:
    """``kind`` is podAntiAffinity; ``mode`` required/preferred."""
    affinity = ((pod.get("spec") or {}).get("affinity") or {}).get(kind) or {}
    key = f"{mode}DuringSchedulingIgnoredDuringExecution"
    out = []
    for raw in affinity.get(key) or []:
        weight = 0
        term = raw
        if mode == "preferred":
            weight = int(raw.get("weight") or 0)
            term = raw.get("podAffinityTerm") or {}
        namespaces: set[str] | None = set(term.get("namespaces") or []) or {pod["metadata"]["namespace"]}
        if term.get("namespaceSelector") == {}:
            namespaces = None
        out.append(
            _Term(
                selector=selector_from_object(term.get("labelSelector")),
                namespaces=namespaces,
                topology_key=term.get("topologyKey") or HOSTNAME_LABEL,
                weight=weight,
            )
        )
    return out


def _term_matches(term: _Term, other: Mapping[str, Any]) -> bool:
    meta = other.get("metadata") or {}
    if term.selector is None:
        return False
    if term.namespaces is not None and meta.get("namespace") not in term.namespaces:
        return False
    return term.selector.matches(meta.get("labels") or {})


def _node_selector_ok(pod: Mapping[str, Any], node: NodeView) -> bool:
    spec = pod.get("spec") or {}
    for k, v in (spec.get("nodeSelector") or {}).items():
        if node.labels.get(k) != v:
            return False
    node_aff = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if node_aff:
        terms = node_aff.get("nodeSelectorTerms") or []
        if terms and not any(
            (selector_from_object({"matchExpressions": t.get("matchExpressions") or []}) or LabelSelector()).matches(
                node.labels
            )
            for t in terms
        ):
            return False
    return True


def _excluded_by_existing(
    pod: Mapping[str, Any], node: NodeView, live: list[Mapping[str, Any]], nodes: list[NodeView]
) -> bool:
    """Symmetry: an already bound pod's required anti-affinity may exclude this pod."""
    labels = {n.name: n.labels for n in nodes}
    for other in live:
        other_labels = labels.get(other["spec"]["nodeName"])
        if other_labels is None:
            continue
        for term in _terms(other, "podAntiAffinity", "required"):
            key = term.topology_key
            if key in node.labels and other_labels.get(key) == node.labels[key] and _term_matches(term, pod):
                return True
    return False


@dataclass
class Decision:
    """The node chosen, or why none fits (the FailedScheduling message)."""

    node: str | None
    message: str = ""


def schedule(
    pod: Mapping[str, Any],
    nodes: list[NodeView],
    bound: list[Mapping[str, Any]],
    *,
    extra_taint: Mapping[str, str] | None = None,
) -> Decision:
    """Pick a node for ``pod`` among ``nodes``, given the pods already ``bound`` to nodes.

    ``extra_taint``: a taint every node carries for this pod only (the emulator's injected
    "stuck Pending" fault), so the message reads like a real untolerated taint.
    """
    try:
        requests = pod_requests(pod)
        required = _terms(pod, "podAntiAffinity", "required")
        preferred = _terms(pod, "podAntiAffinity", "preferred")
    except (QuantityError, SelectorError, KeyError) as exc:
        return Decision(None, f"0/{len(nodes)} nodes are available: {exc}.")
    live = [p for p in bound if not is_terminated(p) and (p.get("spec") or {}).get("nodeName")]
    placement = _Placement(pod, nodes, live, requests, required, preferred, extra_taint)
    reasons: Counter[str] = Counter()
    feasible: list[tuple[float, float, int, NodeView]] = []
    for index, node in enumerate(nodes):
        failed = placement.rejections(node)
        if failed:
            for reason in failed:
                reasons[reason] += 1
            continue
        feasible.append(placement.score(index, node))
    if feasible:
        feasible.sort(key=lambda item: item[:3], reverse=True)
        return Decision(feasible[0][3].name)
    parts = sorted(f"{count} {reason}" for reason, count in reasons.items())
    return Decision(None, f"0/{len(nodes)} nodes are available: {', '.join(parts)}.")


class _Placement:
    """One pod being placed: the filters that reject a node and the score of one that fits."""

    def __init__(
        self,
        pod: Mapping[str, Any],
        nodes: list[NodeView],
        live: list[Mapping[str, Any]],
        requests: dict[str, Fraction],
        required: list[_Term],
        preferred: list[_Term],
        extra_taint: Mapping[str, str] | None,
    ) -> None:
        self.pod, self.nodes, self.live = pod, nodes, live
        self.requests, self.required, self.preferred = requests, required, preferred
        self.extra_taint = extra_taint
        self.tolerations = (pod.get("spec") or {}).get("tolerations") or []
        self.by_node: dict[str, list[Mapping[str, Any]]] = {}
        for p in live:
            self.by_node.setdefault(p["spec"]["nodeName"], []).append(p)
        self.node_labels = {n.name: n.labels for n in nodes}

    def domain_pods(self, node: NodeView, key: str) -> list[Mapping[str, Any]]:
        """The live pods in ``node``'s topology domain for label ``key``."""
        if key not in node.labels:
            return []
        value = node.labels[key]
        return [p for name, ps in self.by_node.items() if self.node_labels.get(name, {}).get(key) == value for p in ps]

    def used(self, node: NodeView) -> dict[str, Fraction]:
        used: dict[str, Fraction] = {}
        for p in self.by_node.get(node.name, []):
            for k, v in pod_requests(p).items():
                used[k] = used.get(k, Fraction(0)) + v
        return used

    def rejections(self, node: NodeView) -> list[str]:
        """Why ``node`` cannot take the pod (empty: it can)."""
        # One list per filter plugin, in kube-scheduler's order; a node is reported with the
        # reasons of the first plugin that rejects it (a plugin may give several).
        plugins: list[list[str]] = [[], [], [], []]
        if self.extra_taint is not None:
            plugins[0].append(f"node(s) had untolerated taint {_taint_text(self.extra_taint)}")
        for taint in node.taints:
            if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(self.tolerations, taint):
                plugins[0].append(f"node(s) had untolerated taint {_taint_text(taint)}")
                break
        if not _node_selector_ok(self.pod, node):
            plugins[1].append("node(s) didn't match Pod's node affinity/selector")
        used = self.used(node)
        if len(self.by_node.get(node.name, [])) + 1 > node.allocatable.get("pods", Fraction(110)):
            plugins[2].append("Too many pods")
        for resource in sorted(self.requests):
            if self.requests[resource] <= 0:
                continue
            if used.get(resource, Fraction(0)) + self.requests[resource] > node.allocatable.get(resource, Fraction(0)):
                plugins[2].append(f"Insufficient {resource}")
        if any(_term_matches(t, p) for t in self.required for p in self.domain_pods(node, t.topology_key)):
            plugins[3].append("node(s) didn't match pod anti-affinity rules")
        elif _excluded_by_existing(self.pod, node, self.live, self.nodes):
            plugins[3].append("node(s) didn't satisfy existing pods anti-affinity rules")
        return next((reasons for reasons in plugins if reasons), [])

    def score(self, index: int, node: NodeView) -> tuple[float, float, int, NodeView]:
        """Higher is better: fewest preferred anti-affinity matches, then least loaded, then first."""
        anti = -sum(
            term.weight * sum(1 for p in self.domain_pods(node, term.topology_key) if _term_matches(term, p))
            for term in self.preferred
        )
        used = self.used(node)
        load = 0.0
        for resource in ("cpu", "memory"):
            cap = node.allocatable.get(resource)
            if cap:
                load += float((used.get(resource, Fraction(0)) + self.requests.get(resource, Fraction(0))) / cap)
        return (anti, -load - 0.001 * len(self.by_node.get(node.name, [])), -index, node)
