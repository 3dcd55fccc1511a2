"""OpenAPI v3 for the kinds the emulator serves, and the strict field check it promises.

``kubectl apply`` (and ``create``, ``replace``) validates what it sends: it reads
``/openapi/v3``, then the document of the object's group-version, and when the PATCH of that
kind takes a ``fieldValidation`` parameter it leaves the check to the server
(``?fieldValidation=Strict``).  Without the documents it stops with "failed to download
openapi".  So each document here names, for every served resource, its paths and
operations with the ``x-kubernetes-group-version-kind`` and ``x-kubernetes-action``
extensions kubectl looks for, and a schema of each kind's top-level fields; and
:func:`strict_errors` is the server's side of the bargain: an object with a top-level field
its kind does not have is refused in the words of a real server's strict decoding, not
silently stored.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kube_emulator.api import GROUPS, RESOURCES, ApiError, ResourceInfo

_OBJECT = {"type": "object"}
_STRING = {"type": "string"}
_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_OBJECTS = {"type": "array", "items": {"type": "object"}}
_SPEC_STATUS = {"spec": _OBJECT, "status": _OBJECT}
_RULES = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            key: {"type": "array", "items": _STRING}
            for key in ("apiGroups", "resources", "resourceNames", "verbs", "nonResourceURLs")
        },
    },
}
_ROLE_REF = {
    "type": "object",
    "required": ["apiGroup", "kind", "name"],
    "properties": {"apiGroup": _STRING, "kind": _STRING, "name": _STRING},
}
_BINDING = {"subjects": _OBJECTS, "roleRef": _ROLE_REF}

#: Each kind's top-level fields beside apiVersion, kind and metadata (as in its Go type).
KIND_FIELDS: dict[str, dict[str, Any]] = {
    "Pod": _SPEC_STATUS,
    "Secret": {"data": _MAP, "stringData": _MAP, "type": _STRING, "immutable": {"type": "boolean"}},
    "Service": _SPEC_STATUS,
    "LimitRange": {"spec": _OBJECT},
    "ResourceQuota": _SPEC_STATUS,
    "PersistentVolumeClaim": _SPEC_STATUS,
    "Event": {
        key: _OBJECT if key in ("involvedObject", "source", "series", "related") else _STRING
        for key in (
            "involvedObject",
            "reason",
            "message",
            "source",
            "firstTimestamp",
            "lastTimestamp",
            "count",
            "type",
            "eventTime",
            "series",
            "action",
            "related",
            "reportingComponent",
            "reportingInstance",
        )
    },
    "Node": _SPEC_STATUS,
    "Namespace": _SPEC_STATUS,
    "ServiceAccount": {
        "secrets": _OBJECTS,
        "imagePullSecrets": _OBJECTS,
        "automountServiceAccountToken": {"type": "boolean"},
    },
    "Role": {"rules": _RULES},
    "ClusterRole": {"rules": _RULES, "aggregationRule": _OBJECT},
    "RoleBinding": _BINDING,
    "ClusterRoleBinding": _BINDING,
    "Lease": {"spec": _OBJECT},
}
_COMMON = ("apiVersion", "kind", "metadata")
_OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
_META_FIELDS: dict[str, Any] = {
    "annotations": _MAP,
    "labels": _MAP,
    "finalizers": {"type": "array", "items": _STRING},
    "ownerReferences": _OBJECTS,
    "managedFields": _OBJECTS,
    "generation": {"type": "integer"},
    "deletionGracePeriodSeconds": {"type": "integer"},
    **{
        key: _STRING
        for key in (
            "name",
            "generateName",
            "namespace",
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "deletionTimestamp",
            "selfLink",
        )
    },
}


def schema_name(info: ResourceInfo) -> str:
    """The definition's name, as the real document names it (``io.k8s.api.core.v1.Pod``)."""
    package = "core" if not info.group else info.group.split(".")[0]
    return f"io.k8s.api.{package}.v1.{info.kind}"


def _gvk(info: ResourceInfo) -> dict[str, str]:
    return {"group": info.group, "version": "v1", "kind": info.kind}


def _documents() -> dict[str, dict[str, Any]]:
    """Every group-version's document, by its path under ``/openapi/v3/``."""
    docs: dict[str, dict[str, Any]] = {}
    for group in ("", *GROUPS):
        infos = [info for info in RESOURCES.values() if info.group == group]
        prefix = f"apis/{group}/v1" if group else "api/v1"
        paths: dict[str, Any] = {}
        schemas: dict[str, Any] = {_OBJECT_META: {"type": "object", "properties": _META_FIELDS}}
        for info in infos:
            paths.update(_paths(prefix, info))
            schemas[schema_name(info)] = _schema(info)
        docs[prefix] = {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": "unversioned"},
            "paths": paths,
            "components": {"schemas": schemas},
        }
    return docs


def _schema(info: ResourceInfo) -> dict[str, Any]:
    properties: dict[str, Any] = {
        "apiVersion": _STRING,
        "kind": _STRING,
        "metadata": {"$ref": f"#/components/schemas/{_OBJECT_META}"},
    }
    properties.update(KIND_FIELDS[info.kind])
    return {"type": "object", "properties": properties, "x-kubernetes-group-version-kind": [_gvk(info)]}


def _paths(prefix: str, info: ResourceInfo) -> dict[str, Any]:
    collection = f"/{prefix}/namespaces/{{namespace}}/{info.name}" if info.namespaced else f"/{prefix}/{info.name}"
    ref = {"$ref": f"#/components/schemas/{schema_name(info)}"}

    def op(action: str, writes: bool = False, patch: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "operationId": f"{action}{info.kind}",
            "x-kubernetes-action": action,
            "x-kubernetes-group-version-kind": _gvk(info),
            "responses": {"200": {"content": {"application/json": {"schema": ref}}}},
        }
        if writes:
            out["parameters"] = [
                {"name": name, "in": "query", "schema": _STRING}
                for name in ("dryRun", "fieldManager", "fieldValidation")
            ]
            types = (
                (
                    "application/json-patch+json",
                    "application/merge-patch+json",
                    "application/strategic-merge-patch+json",
                    "application/apply-patch+yaml",
                )
                if patch
                else ("application/json",)
            )
            out["requestBody"] = {"content": {t: {"schema": ref if not patch else _OBJECT} for t in types}}
        return out

    listed = {"get": op("list"), "post": op("post", writes=True)}
    one = {"get": op("get"), "put": op("put", writes=True), "patch": op("patch", writes=True, patch=True)}
    one["delete"] = op("delete")
    return {collection: listed, f"{collection}/{{name}}": one}


_DOCUMENTS = _documents()
_HASHES = {
    path: hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest().upper()[:128]
    for path, doc in _DOCUMENTS.items()
}


def root() -> dict[str, Any]:
    """``/openapi/v3``: where each group-version's document is."""
    return {
        "paths": {path: {"serverRelativeURL": f"/openapi/v3/{path}?hash={digest}"} for path, digest in _HASHES.items()}
    }


def document(path: str) -> dict[str, Any] | None:
    """``/openapi/v3/PATH`` (``api/v1``, ``apis/GROUP/v1``); None for one not served."""
    return _DOCUMENTS.get(path)


def check_strict(resource: str, obj: Any) -> None:
    """``?fieldValidation=Strict``: refuse a top-level field the kind does not have, in the
    words of the real server's strict decoding (400 BadRequest)."""
    if not isinstance(obj, dict):
        return
    info = RESOURCES[resource]
    unknown = sorted(k for k in obj if k not in _COMMON and k not in KIND_FIELDS[info.kind])
    if unknown:
        fields = ", ".join(f'unknown field "{k}"' for k in unknown)
        raise ApiError(
            400,
            "BadRequest",
            f'{info.kind} in version "v1" cannot be handled as a {info.kind}: strict decoding error: {fields}',
        )
