"""The patches clients send: JSON merge patch (RFC 7386) and JSON patch (RFC 6902)."""

from __future__ import annotations

import copy
from typing import Any

from kube_emulator.api import ApiError


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (strategic merge patches are applied the same way: enough
    for labels, annotations and maps, which is what clients patch on these resources)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if not isinstance(target, dict):
        target = {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            target.pop(key, None)
        else:
            target[key] = merge_patch(target.get(key), value)
    return target


def json_patch(doc: Any, ops: list[Any]) -> Any:
    """RFC 6902 add/remove/replace/test (what ``kubectl patch --type=json`` sends)."""

    def parts(pointer: str) -> list[str]:
        return [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]

    for op in ops:
        path = parts(op.get("path", ""))
        if not path:
            raise ApiError(422, "Invalid", "json patch: empty path")
        parent = doc
        for p in path[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent.setdefault(p, {})
        last = path[-1]
        kind = op.get("op")
        try:
            if kind in ("add", "replace"):
                if isinstance(parent, list):
                    idx = len(parent) if last == "-" else int(last)
                    if kind == "add":
                        parent.insert(idx, op.get("value"))
                    else:
                        parent[idx] = op.get("value")
                else:
                    parent[last] = op.get("value")
            elif kind == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            elif kind == "test":
                actual = parent[int(last)] if isinstance(parent, list) else parent.get(last)
                if actual != op.get("value"):
                    raise ApiError(422, "Invalid", f"json patch test failed at {op.get('path')}")
            else:
                raise ApiError(422, "Invalid", f"json patch: unsupported op {kind!r}")
        except (KeyError, IndexError, ValueError) as exc:
            raise ApiError(422, "Invalid", f"json patch {kind} {op.get('path')}: {exc}") from None
    return doc
