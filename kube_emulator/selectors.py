"""Label and field selectors, parsed the way the API server parses them.

Written here rather than taken from a library: the official client only *builds* selector
strings, and no maintained Python package parses them server-side.  The grammar is small
(``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``, ``a notin (x)``, ``a``, ``!a``), and the
emulator must reject what a real server rejects, so the backend sees the same 400s.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"


class SelectorError(ValueError):
    """A selector string the API server would refuse (HTTP 400)."""


@dataclass(frozen=True)
class Requirement:
    """One clause of a label selector."""

    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op in ("=", "in"):
            return present and value in self.values
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        if self.op == "exists":
            return present
        return not present  # "!"


@dataclass(frozen=True)
class LabelSelector:
    """A parsed label selector; the empty selector matches everything."""

    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside ``( )``."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def _check_key(key: str, whole: str) -> str:
    if not re.fullmatch(_KEY, key):
        raise SelectorError(f"unable to parse requirement: invalid label key {key!r} in selector {whole!r}")
    return key


def _check_value(value: str, whole: str) -> str:
    if len(value) > 63 or not re.fullmatch(_VALUE, value):
        raise SelectorError(f"unable to parse requirement: invalid label value {value!r} in selector {whole!r}")
    return value


def parse_label_selector(text: str | None) -> LabelSelector:
    """Parse ``labelSelector`` as the API server does; raise :class:`SelectorError` when it would 400."""
    if not text or not text.strip():
        return LabelSelector()
    requirements = []
    for raw in _split_top_level(text):
        part = raw.strip()
        if not part:
            raise SelectorError(f"found '', expected: identifier in selector {text!r}")
        m = re.fullmatch(r"(\S+?)\s+(in|notin)\s*\((.*)\)", part)
        if m:
            key = _check_key(m.group(1), text)
            values = tuple(_check_value(v.strip(), text) for v in m.group(3).split(","))
            requirements.append(Requirement(key, m.group(2), values))
            continue
        m = re.fullmatch(r"([^=!\s]+)\s*(==|=|!=)\s*(\S*)", part)
        if m:
            key = _check_key(m.group(1), text)
            op = "!=" if m.group(2) == "!=" else "="
            requirements.append(Requirement(key, op, (_check_value(m.group(3), text),)))
            continue
        if part.startswith("!"):
            requirements.append(Requirement(_check_key(part[1:].strip(), text), "!"))
            continue
        requirements.append(Requirement(_check_key(part, text), "exists"))
    return LabelSelector(tuple(requirements))


def selector_from_object(spec: Mapping[str, Any] | None) -> LabelSelector | None:
    """A ``metav1.LabelSelector`` object (``matchLabels`` + ``matchExpressions``).

    None means "selects nothing" (a nil selector in an affinity term); ``{}`` selects all.
    """
    if spec is None:
        return None
    reqs = [Requirement(k, "=", (str(v),)) for k, v in (spec.get("matchLabels") or {}).items()]
    for expr in spec.get("matchExpressions") or []:
        op = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}.get(expr.get("operator", ""))
        if op is None:
            raise SelectorError(f"{expr.get('operator')!r} is not a valid label selector operator")
        reqs.append(Requirement(expr["key"], op, tuple(expr.get("values") or ())))
    return LabelSelector(tuple(reqs))


@dataclass(frozen=True)
class FieldSelector:
    """A parsed field selector: dotted paths compared for (in)equality as strings."""

    terms: tuple[tuple[str, bool, str], ...] = field(default=())  # (path, equal?, value)

    def matches(self, obj: Mapping[str, Any]) -> bool:
        for path, equal, value in self.terms:
            actual = field_value(obj, path)
            if (actual == value) != equal:
                return False
        return True


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The string a field selector compares ``path`` against; a missing field is ``""``."""
    current: Any = obj
    for part in path.split("."):
        if not isinstance(current, Mapping):
            return ""
        current = current.get(part)
    if current is None:
        return ""
    if isinstance(current, bool):
        return str(current).lower()
    return str(current)


def parse_field_selector(text: str | None, allowed: Callable[[str], bool] | None = None) -> FieldSelector:
    """Parse ``fieldSelector``; ``allowed`` says which paths the resource supports (else 400)."""
    if not text or not text.strip():
        return FieldSelector()
    terms = []
    for raw in text.split(","):
        m = re.fullmatch(r"\s*([^=!\s]+)\s*(==|=|!=)\s*(.*?)\s*", raw)
        if not m:
            raise SelectorError(f"invalid selector: {text!r}; can't understand {raw!r}")
        path = m.group(1)
        if allowed is not None and not allowed(path):
            raise SelectorError(f"field label not supported: {path}")
        terms.append((path, m.group(2) != "!=", m.group(3)))
    return FieldSelector(tuple(terms))
