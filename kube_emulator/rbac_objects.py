"""RBAC as API objects: the Roles and bindings a user applies, and the grants they give.

A user sets up permissions with ``kubectl apply -f examples/kubernetes/rbac.yaml``; the
emulator stores those objects (``rbac.authorization.k8s.io/v1``) like any other and its
authorizer asks :func:`grants_for` on every request, so an applied, edited or deleted binding
counts from the next request on, as on a real server.  What a binding grants follows
``plugin/pkg/auth/authorizer/rbac`` (``appliesTo``, ``GetRoleReferenceRules``):

- a RoleBinding grants its Role's rules (a Role of its own namespace) or a ClusterRole's,
  inside the binding's namespace only; a ClusterRoleBinding grants a ClusterRole's rules
  everywhere;
- a binding whose role does not exist grants nothing, and is no error;
- a subject names a ``User`` by name, a ``ServiceAccount`` as the user
  ``system:serviceaccount:NS:NAME`` (NS the binding's own when the subject gives none), or
  a ``Group``: every authenticated user is in ``system:authenticated``, a ServiceAccount also
  in ``system:serviceaccounts`` and ``system:serviceaccounts:NS``.

:func:`prepare` is the registry's validation of a new or replaced object (the real messages,
as ``pkg/apis/rbac/validation`` words them), so a malformed Role fails at ``apply``, not at
the first request it should have allowed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from kube_emulator.api import RBAC_GROUP, invalid
from kube_emulator.rbac import ROLE_FILE_KINDS, Grant, PolicyRule, rule_from
from kube_emulator.store import Obj, Store

SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
#: The RBAC resources and their kinds.
KINDS = {
    "roles": "Role",
    "clusterroles": "ClusterRole",
    "rolebindings": "RoleBinding",
    "clusterrolebindings": "ClusterRoleBinding",
}


def groups_of(user: str) -> set[str]:
    """The groups the API server's authenticators put a user in."""
    groups = {"system:authenticated"}
    if user.startswith(SERVICE_ACCOUNT_PREFIX):
        namespace = user[len(SERVICE_ACCOUNT_PREFIX) :].split(":")[0]
        groups |= {"system:serviceaccounts", f"system:serviceaccounts:{namespace}"}
    return groups


def _applies_to(binding: Obj, user: str, groups: set[str]) -> bool:
    own_namespace = binding["metadata"].get("namespace", "")
    for subject in binding.get("subjects") or []:
        kind, name = subject.get("kind"), subject.get("name")
        if kind == "User" and name == user:
            return True
        if kind == "Group" and name in groups:
            return True
        if kind == "ServiceAccount":
            namespace = subject.get("namespace") or own_namespace
            if user == f"{SERVICE_ACCOUNT_PREFIX}{namespace}:{name}":
                return True
    return False


def _rules(role: Obj) -> tuple[PolicyRule, ...]:
    """The resource rules of a stored role (validated when stored; non-resource URL rules
    grant nothing the emulator serves)."""
    return tuple(rule_from(r) for r in role.get("rules") or [] if not r.get("nonResourceURLs"))


def grants_for(store: Store, user: str) -> Iterator[Grant]:
    """What the cluster's bindings grant ``user``."""
    groups = groups_of(user)
    for binding in store.items("clusterrolebindings"):
        ref = binding.get("roleRef") or {}
        role = store.get("clusterroles", "", ref.get("name", ""))
        if role is not None and _applies_to(binding, user, groups):
            yield Grant(_rules(role), None)
    for binding in store.items("rolebindings"):
        namespace = binding["metadata"]["namespace"]
        ref = binding.get("roleRef") or {}
        if ref.get("kind") == "Role":
            role = store.get("roles", namespace, ref.get("name", ""))
        else:
            role = store.get("clusterroles", "", ref.get("name", ""))
        if role is not None and _applies_to(binding, user, groups):
            yield Grant(_rules(role), namespace)


def prepare(resource: str, obj: Obj, current: Obj | None = None) -> None:
    """Validate a new (or, with ``current``, a replaced) RBAC object: 422 as the real
    registry answers."""
    kind, name = KINDS[resource], obj["metadata"]["name"]
    errors = _role_errors(obj) if resource in ("roles", "clusterroles") else _binding_errors(resource, obj)
    rebound = current is not None and obj.get("roleRef") != current.get("roleRef")
    if rebound and resource in ("rolebindings", "clusterrolebindings"):
        errors.append(("roleRef", f"Invalid value: {_go(obj.get('roleRef'))}: cannot change roleRef"))
    if errors:
        raise invalid(f"{kind}.{RBAC_GROUP}", name, errors)


def _role_errors(obj: Obj) -> list[tuple[str, str]]:
    rules = obj.get("rules") or []
    if not isinstance(rules, list):
        return [("rules", "Invalid value: must be a list")]
    errors: list[tuple[str, str]] = []
    for where, rule in _entries(rules, "rules", errors):
        if not rule.get("verbs"):
            errors.append((f"{where}.verbs", "Required value: verbs must contain at least one value"))
        if rule.get("nonResourceURLs"):
            if rule.get("resources") or rule.get("apiGroups"):
                errors.append(
                    (
                        f"{where}.nonResourceURLs",
                        "Invalid value: rules cannot apply to both regular resources and non-resource URLs",
                    )
                )
            continue
        if not rule.get("resources"):
            errors.append((f"{where}.resources", "Required value: resource rules must supply at least one resource"))
        if not rule.get("apiGroups"):
            errors.append((f"{where}.apiGroups", "Required value: resource rules must supply at least one api group"))
        try:
            rule_from(rule)
        except ValueError as exc:
            if not any(f == where or f.startswith(f"{where}.") for f, _ in errors):  # one complaint per rule
                errors.append((where, f"Invalid value: {exc}"))
    return errors


def _binding_errors(resource: str, obj: Obj) -> list[tuple[str, str]]:
    ref = obj.get("roleRef")
    errors = []
    kinds = ("ClusterRole",) if resource == "clusterrolebindings" else ("Role", "ClusterRole")
    if not isinstance(ref, dict):
        return [("roleRef", "Required value")]
    if ref.get("apiGroup") != RBAC_GROUP:
        errors.append(
            ("roleRef.apiGroup", f'Unsupported value: "{ref.get("apiGroup", "")}": supported values: "{RBAC_GROUP}"')
        )
    if ref.get("kind") not in kinds:
        supported = ", ".join(f'"{k}"' for k in kinds)
        errors.append(("roleRef.kind", f'Unsupported value: "{ref.get("kind", "")}": supported values: {supported}'))
    if not ref.get("name"):
        errors.append(("roleRef.name", "Required value"))
    for where, subject in _entries(obj.get("subjects"), "subjects", errors):
        if not subject.get("name"):
            errors.append((f"{where}.name", "Required value"))
        kind = subject.get("kind")
        if kind not in ("User", "Group", "ServiceAccount"):
            errors.append(
                (
                    f"{where}.kind",
                    f'Unsupported value: "{kind or ""}": supported values: "ServiceAccount", "User", "Group"',
                )
            )
        elif kind == "ServiceAccount" and resource == "clusterrolebindings" and not subject.get("namespace"):
            errors.append((f"{where}.namespace", "Required value"))
    return errors


def _entries(items: Any, field: str, errors: list[tuple[str, str]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each object of a list field, with the name a field error gives it; an entry that is no
    object is an error of its own."""
    for i, item in enumerate(items or []):
        if isinstance(item, dict):
            yield f"{field}[{i}]", item
        else:
            errors.append((f"{field}[{i}]", "Invalid value: must be an object"))


def _go(value: Any) -> str:
    """A value as the API server prints it in a field error (roughly Go's %v of the struct)."""
    if isinstance(value, dict):
        return "{" + " ".join(str(v) for v in value.values()) + "}"
    return str(value)


def role_objects(docs: list[dict[str, Any]], namespace: str, user: str) -> list[tuple[str, str, Obj]]:
    """The objects a role file stands for, as (resource, namespace, body) to create: its own
    documents (namespaced ones in ``namespace`` unless they name one, as ``kubectl apply -n``
    puts them; a nameless one named by its place), and, where it binds nobody, a binding of
    each of its roles to ``user`` (a ServiceAccount's user name), so that a file with only a
    Role still means "what the role context may do"."""
    out: list[tuple[str, str, Obj]] = []
    for i, doc in enumerate(docs):
        resource = ROLE_FILE_KINDS[doc["kind"]]
        body = copy.deepcopy(doc)
        meta = body.get("metadata") or {}
        body["metadata"] = meta
        meta["name"] = meta.get("name") or f"emulator-role-{i + 1}"
        scoped = resource not in ("clusterroles", "clusterrolebindings")
        out.append((resource, (meta.get("namespace") or namespace) if scoped else "", body))
    if any(resource.endswith("bindings") for resource, _, _ in out):
        return out
    sa_namespace, sa_name = user[len(SERVICE_ACCOUNT_PREFIX) :].split(":", 1)
    subject = {"kind": "ServiceAccount", "name": sa_name, "namespace": sa_namespace}
    for resource, ns, body in list(out):
        if resource in ("roles", "clusterroles"):
            kind = KINDS[resource]
            binding = {
                "metadata": {"name": f"{body['metadata']['name']}-emulator"},
                "roleRef": {"apiGroup": RBAC_GROUP, "kind": kind, "name": body["metadata"]["name"]},
                "subjects": [subject],
            }
            out.append(("rolebindings" if resource == "roles" else "clusterrolebindings", ns, binding))
    return out
