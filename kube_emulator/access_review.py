"""``authorization.k8s.io/v1``: SelfSubjectAccessReview and SelfSubjectRulesReview, which
``kubectl auth can-i`` (and ``can-i --list``) asks, and a launch asks before it creates anything.

A user checks what their credentials may do before a launch fails half-way on it: the answer
comes from the same authorizer that guards every request (the Role of the token or the client
certificate), with the real API's shape.  Asking is not doing, so the review is not recorded
among the authorizer's decisions.

kubectl sends the review as protobuf (the ``k8s\\0`` envelope around a ``runtime.Unknown``),
as it does every built-in type; the official Python client sends JSON.  Both are read here;
the answer is JSON, which kubectl accepts.
"""

from __future__ import annotations

from typing import Any

from kube_emulator.api import ApiError
from kube_emulator.rbac import Authorizer, Request, Subject

GROUP = "authorization.k8s.io"
GROUP_VERSION = f"{GROUP}/v1"
#: The resources of the group the emulator serves, under ``/apis/authorization.k8s.io/v1/``.
RESOURCE = "selfsubjectaccessreviews"
RULES_RESOURCE = "selfsubjectrulesreviews"


def resource_list() -> dict[str, Any]:
    """``/apis/authorization.k8s.io/v1``."""
    entries = [
        {
            "name": name,
            "singularName": kind.lower(),
            "namespaced": False,
            "kind": kind,
            "verbs": ["create"],
        }
        for name, kind in ((RESOURCE, "SelfSubjectAccessReview"), (RULES_RESOURCE, "SelfSubjectRulesReview"))
    ]
    return {"kind": "APIResourceList", "groupVersion": GROUP_VERSION, "resources": entries}


#: The envelope of a protobuf-encoded object (``runtime.protobufSerializer``'s prefix).
PROTOBUF_MAGIC = b"k8s\x00"
#: Field numbers of ``authorization/v1.ResourceAttributes`` (generated.proto).
_ATTRIBUTE_FIELDS = {1: "namespace", 2: "verb", 3: "group", 4: "version", 5: "resource", 6: "subresource", 7: "name"}


def from_protobuf(data: bytes) -> dict[str, Any]:
    """A protobuf SelfSubjectAccessReview as the JSON body it stands for (its resource attributes)."""
    spec = _review_spec(data)  # SelfSubjectAccessReviewSpec: 1 is resourceAttributes
    if 1 not in spec:
        return {"spec": {}}
    attrs = _fields(_one(spec, 1))
    resource_attributes = {name: _one(attrs, n).decode() for n, name in _ATTRIBUTE_FIELDS.items() if n in attrs}
    return {"spec": {"resourceAttributes": resource_attributes}}


def rules_from_protobuf(data: bytes) -> dict[str, Any]:
    """A protobuf SelfSubjectRulesReview as the JSON body it stands for (its namespace)."""
    spec = _review_spec(data)  # SelfSubjectRulesReviewSpec: 1 is namespace
    return {"spec": {"namespace": _one(spec, 1).decode()}}


def _review_spec(data: bytes) -> dict[int, list[bytes]]:
    """The fields of a protobuf review's spec: both reviews are a ``runtime.Unknown`` whose
    field 2 is the object's bytes, and in the object field 2 is its spec."""
    if not data.startswith(PROTOBUF_MAGIC):
        raise ApiError(415, "UnsupportedMediaType", "protobuf body without the k8s envelope")
    unknown = _fields(data[len(PROTOBUF_MAGIC) :])
    return _fields(_one(_fields(_one(unknown, 2)), 2))


def _one(fields: dict[int, list[bytes]], number: int) -> bytes:
    return fields.get(number, [b""])[-1]


def _fields(data: bytes) -> dict[int, list[bytes]]:
    """The length-delimited fields of one protobuf message (the only kind these carry);
    varints and fixed-width fields are skipped."""
    out: dict[int, list[bytes]] = {}
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, i = _varint(data, i)
        elif wire == 2:
            size, i = _varint(data, i)
            out.setdefault(number, []).append(data[i : i + size])
            i += size
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ApiError(400, "BadRequest", f"protobuf wire type {wire} is not one the API uses")
    return out


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data):
            raise ApiError(400, "BadRequest", "truncated protobuf body")
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            return value, i
        shift += 7


def review(authorizer: Authorizer, subject: Subject, body: dict[str, Any]) -> dict[str, Any]:
    """The review ``body`` asked for, with its ``status`` filled in as the API server does."""
    spec = body.get("spec") if isinstance(body, dict) else None
    attrs = spec.get("resourceAttributes") if isinstance(spec, dict) else None
    if not isinstance(attrs, dict) or not attrs.get("verb") or not attrs.get("resource"):
        raise ApiError(
            422, "Invalid", "SelfSubjectAccessReview: spec.resourceAttributes with verb and resource is required"
        )
    req = Request(
        user=subject.user,
        verb=str(attrs["verb"]),
        resource=str(attrs["resource"]),
        subresource=str(attrs.get("subresource") or ""),
        namespace=str(attrs.get("namespace") or ""),
        name=str(attrs.get("name") or ""),
        api_group=str(attrs.get("group") or ""),
    )
    allowed = authorizer.allows(subject, req)
    status: dict[str, Any] = {"allowed": allowed}
    if allowed and subject.grants is not None:
        status["reason"] = f'RBAC: allowed by the Role bound to "{subject.user}"'
    return {
        "kind": "SelfSubjectAccessReview",
        "apiVersion": GROUP_VERSION,
        "metadata": {"creationTimestamp": None},
        "spec": spec,
        "status": status,
    }


def rules_review(authorizer: Authorizer, subject: Subject, body: dict[str, Any]) -> dict[str, Any]:
    """What ``subject`` may do in the body's namespace, as rules (``kubectl auth can-i --list``,
    and what a launch checks before it creates anything): every rule of every grant that
    applies there, the admin's one rule being everything."""
    spec = body.get("spec") if isinstance(body, dict) else None
    namespace = spec.get("namespace") if isinstance(spec, dict) else None
    if not namespace:
        raise ApiError(422, "Invalid", "SelfSubjectRulesReview: spec.namespace: Required value")
    grants = authorizer.grants(subject)
    if grants is None:
        rules = [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}]
    else:
        rules = [
            {
                "verbs": list(rule.verbs),
                "apiGroups": list(rule.api_groups),
                "resources": list(rule.resources),
                **({"resourceNames": list(rule.resource_names)} if rule.resource_names else {}),
            }
            for grant in grants
            if grant.namespace in (None, namespace)
            for rule in grant.rules
        ]
    return {
        "kind": "SelfSubjectRulesReview",
        "apiVersion": GROUP_VERSION,
        "metadata": {"creationTimestamp": None},
        "spec": {"namespace": namespace},
        "status": {"resourceRules": rules, "nonResourceRules": [], "incomplete": False},
    }
