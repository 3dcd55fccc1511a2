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
    tolerations = (pod.get("spec") or {}).get("tolerations") or []
    live = [p for p in bound if not is_terminated(p) and (p.get("spec") or {}).get("nodeName")]
    by_node: dict[str, list[Mapping[str, Any]]] = {}
    for p in live:
        by_node.setdefault(p["spec"]["nodeName"], []).append(p)
    node_labels = {n.name: n.labels for n in nodes}

    def domain_pods(node: NodeView, key: str) -> list[Mapping[str, Any]]:
        if key not in node.labels:
            return []
        value = node.labels[key]
        return [p for name, ps in by_node.items() if node_labels.get(name, {}).get(key) == value for p in ps]

    reasons: Counter[str] = Counter()
    feasible: list[tuple[float, float, int, NodeView]] = []
    for index, node in enumerate(nodes):
        # One list per filter plugin, in kube-scheduler's order; a node is reported with the
        # reasons of the first plugin that rejects it (a plugin may give several).
        plugins: list[list[str]] = [[], [], [], []]
        if extra_taint is not None:
            plugins[0].append(f"node(s) had untolerated taint {_taint_text(extra_taint)}")
        for taint in node.taints:
            if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
                plugins[0].append(f"node(s) had untolerated taint {_taint_text(taint)}")
                break
        if not _node_selector_ok(pod, node):
            plugins[1].append("node(s) didn't match Pod's node affinity/selector")
        used: dict[str, Fraction] = {}
        for p in by_node.get(node.name, []):
            for k, v in pod_requests(p).items():
                used[k] = used.get(k, Fraction(0)) + v
        if len(by_node.get(node.name, [])) + 1 > node.allocatable.get("pods", Fraction(110)):
            plugins[2].append("Too many pods")
        for resource in sorted(requests):
            if requests[resource] <= 0:
                continue
            if used.get(resource, Fraction(0)) + requests[resource] > node.allocatable.get(resource, Fraction(0)):
                plugins[2].append(f"Insufficient {resource}")
        if any(_term_matches(t, p) for t in required for p in domain_pods(node, t.topology_key)):
            plugins[3].append("node(s) didn't match pod anti-affinity rules")
        elif _excluded_by_existing(pod, node, live, nodes):
            plugins[3].append("node(s) didn't satisfy existing pods anti-affinity rules")
        failed = next((reasons_ for reasons_ in plugins if reasons_), None)
        if failed:
            for reason in failed:
                reasons[reason] += 1
            continue
        anti = -sum(
            term.weight * sum(1 for p in domain_pods(node, term.topology_key) if _term_matches(term, p))
            for term in preferred
        )
        load = 0.0
        for resource in ("cpu", "memory"):
            cap = node.allocatable.get(resource)
            if cap:
                load += float((used.get(resource, Fraction(0)) + requests.get(resource, Fraction(0))) / cap)
        feasible.append((anti, -load - 0.001 * len(by_node.get(node.name, [])), -index, node))
    if feasible:
        feasible.sort(key=lambda item: item[:3], reverse=True)
        return Decision(feasible[0][3].name)
    parts = sorted(f"{count} {reason}" for reason, count in reasons.items())
    return Decision(None, f"0/{len(nodes)} nodes are available: {', '.join(parts)}.")
