"""The resource paths: ``/api/v1/[namespaces/NS/]RESOURCE[/NAME[/SUB]]`` to cluster calls.

A path is resolved as the API server's request-info resolver does (namespace, resource,
name, subresource, then the RBAC verb of the method), authorized, and handed to the
:class:`~kube_emulator.cluster.Cluster`; the streaming subresources go to ``feeds.py`` (watch,
log) and ``streams.py`` (exec, port-forward).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

import yaml
from aiohttp import web
from multidict import MultiDictProxy

from kube_emulator import feeds, openapi, tables
from kube_emulator.api import RESOURCES, ApiError, ResourceInfo, field_allowed
from kube_emulator.cluster import Cluster
from kube_emulator.discovery import POD_SUBRESOURCES
from kube_emulator.rbac import Authorizer, Forbidden, Request, Subject, connect_verbs
from kube_emulator.selectors import parse_field_selector, parse_label_selector
from kube_emulator.streams import handle_exec, handle_portforward, query_flag


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=json.dumps(body, separators=(",", ":")).encode(), status=status, content_type="application/json"
    )


def _strip_list_item(obj: dict[str, Any]) -> dict[str, Any]:
    """List items carry no kind/apiVersion on a real server."""
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


@dataclass(frozen=True)
class Deletion:
    """One delete of one object, with the DeleteOptions it came with (``ResourceApi.deletions``):
    which verbs a client used is in the RBAC decisions; how it deleted (grace period,
    preconditions) only here."""

    user: str
    resource: str
    namespace: str
    name: str
    options: dict[str, Any]


@dataclass(frozen=True)
class Target:
    """What a resource path names: a collection (``name`` None) or one object, maybe a
    subresource of it."""

    resource: str
    namespace: str | None
    name: str | None
    sub: str | None


def _target(parts: list[str], group: str) -> Target:
    """``[namespaces, NS,] RESOURCE[, NAME[, SUB]]`` of API group ``group``, or a 404 as the
    API server answers."""
    if len(parts) >= 3 and parts[0] == "namespaces":
        namespace: str | None = parts[1]
        resource, rest = parts[2], parts[3:]
    elif parts[0] == "namespaces":
        namespace, resource, rest = None, "namespaces", parts[1:]
    else:
        namespace, resource, rest = None, parts[0], parts[1:]
    if resource not in RESOURCES or RESOURCES[resource].group != group or len(rest) > 2 or any(not p for p in rest):
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    if not RESOURCES[resource].namespaced and namespace is not None:
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    name = rest[0] if rest else None
    sub = rest[1] if len(rest) > 1 else None
    if sub is not None and not (resource == "pods" and sub in POD_SUBRESOURCES):
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    return Target(resource, namespace, name, sub)


def _verb(method: str, query: MultiDictProxy[str], target: Target) -> str | None:
    """The RBAC verb of ``method`` on ``target``; None: the method means nothing there."""
    if target.name is None:
        return {
            "GET": "watch" if query_flag(query.get("watch")) else "list",
            "POST": "create",
            "DELETE": "deletecollection",
        }.get(method)
    if target.sub in ("exec", "portforward"):
        return "connect" if method in ("GET", "POST") else None
    return {"GET": "get", "DELETE": "delete", "PUT": "update", "PATCH": "patch"}.get(method)


def _paginate(info: ResourceInfo, items: list[dict[str, Any]], rv: int, query: Any) -> dict[str, Any]:
    """``limit``/``continue`` chunking; the token carries the offset (the list is re-read,
    which a real server avoids with an etcd snapshot: good enough for tests)."""
    meta: dict[str, Any] = {"resourceVersion": str(rv)}
    start = 0
    token = query.get("continue")
    if token:
        try:
            state = json.loads(base64.urlsafe_b64decode(token.encode()))
            start, meta["resourceVersion"] = int(state["start"]), str(state["rv"])
        except (ValueError, KeyError, TypeError):
            raise ApiError(
                400, "BadRequest", "continue key is not valid: incorrect encoded start resourceVersion"
            ) from None
    limit = int(query.get("limit") or 0)
    end = start + limit if limit > 0 else len(items)
    if end < len(items):
        state = {"start": end, "rv": meta["resourceVersion"]}
        meta["continue"] = base64.urlsafe_b64encode(json.dumps(state).encode()).decode()
        meta["remainingItemCount"] = len(items) - end
    return {"kind": f"{info.kind}List", "apiVersion": info.api_version, "metadata": meta, "items": items[start:end]}


class ResourceApi:
    """Answers the resource paths of one cluster, authorized by ``authorizer``."""

    def __init__(self, cluster: Cluster, authorizer: Authorizer, kube_version: str) -> None:
        self.cluster = cluster
        self.authorizer = authorizer
        self.kube_version = kube_version
        #: Every single-object delete, in order (the admin endpoint /emulator/deletions serves it).
        self.deletions: list[Deletion] = []

    def authorize(
        self,
        subject: Subject,
        verbs: tuple[str, ...],
        resource: str,
        namespace: str | None,
        name: str | None,
        sub: str | None,
    ) -> None:
        group = RESOURCES[resource].group
        requests = [Request(subject.user, v, resource, sub or "", namespace or "", name or "", group) for v in verbs]
        try:
            self.authorizer.authorize_all(subject, requests)
        except Forbidden as exc:
            raise ApiError(403, "Forbidden", str(exc), exc.details()) from None

    @staticmethod
    def _check_fields(request: web.Request, resource: str, body: Any) -> None:
        """``?fieldValidation=Strict`` (what kubectl asks for once OpenAPI says it may)."""
        if request.query.get("fieldValidation") == "Strict":
            openapi.check_strict(resource, body)

    async def _body(self, request: web.Request) -> Any:
        if not request.can_read_body:
            return None
        raw = await request.read()
        if not raw.strip():
            return None
        try:
            if "yaml" in (request.content_type or ""):
                return yaml.safe_load(raw)
            return json.loads(raw)
        except (ValueError, yaml.YAMLError) as exc:
            raise ApiError(400, "BadRequest", f"the body of the request could not be decoded: {exc}") from None

    async def handle(
        self, request: web.Request, user: Subject, parts: list[str], group: str = ""
    ) -> web.StreamResponse:
        """``/api/v1/PARTS`` (``group`` ""), or ``/apis/GROUP/v1/PARTS``."""
        target = _target(parts, group)
        resource, namespace, name, sub = target.resource, target.namespace, target.name, target.sub
        info = RESOURCES[resource]
        method = request.method
        verb = _verb(method, request.query, target)
        if verb is None or (verb not in info.verbs and sub is None):
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
        if info.namespaced and namespace is None and verb not in ("list", "watch"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        verbs = connect_verbs(method, self.kube_version) if verb == "connect" else (verb,)
        self.authorize(user, verbs, resource, namespace, name, sub)
        options = await self._delete_options(request) if verb in ("delete", "deletecollection") else None
        if verb == "delete" and name is not None:
            self.deletions.append(Deletion(user.user, resource, namespace or "", name, options or {}))
        if verb in ("list", "watch", "deletecollection"):
            return await self._collection(request, verb, target, options)
        if verb == "create" and name is None:
            body = await self._body(request)
            self._check_fields(request, resource, body)
            return json_response(self.cluster.create(resource, namespace or "", body), 201)
        return await self._object(request, verb, target, options)

    async def _delete_options(self, request: web.Request) -> dict[str, Any]:
        """DeleteOptions from the query's parameters (what the Python client sends for
        ``grace_period_seconds=`` and ``propagation_policy=``), then the body's over them."""
        options: dict[str, Any] = {}
        query = request.query
        if "gracePeriodSeconds" in query:
            try:
                options["gracePeriodSeconds"] = int(query["gracePeriodSeconds"])
            except ValueError:
                raise ApiError(
                    400, "BadRequest", f"invalid gracePeriodSeconds {query['gracePeriodSeconds']!r}"
                ) from None
        if "propagationPolicy" in query:
            options["propagationPolicy"] = query["propagationPolicy"]
        body = await self._body(request)
        if isinstance(body, dict):
            options.update(body)
        return options

    async def _collection(
        self, request: web.Request, verb: str, target: Target, options: dict[str, Any] | None
    ) -> web.StreamResponse:
        cluster, resource, namespace, query = self.cluster, target.resource, target.namespace, request.query
        labels = parse_label_selector(query.get("labelSelector"))
        fields = parse_field_selector(query.get("fieldSelector"), field_allowed(resource))
        if verb == "watch":
            return await feeds.watch(request, self.cluster, resource, namespace, labels, fields)
        if verb == "deletecollection":
            return json_response(cluster.delete_collection(resource, namespace, labels, fields, options))
        items = [_strip_list_item(o) for o in cluster.list(resource, namespace, labels, fields)]
        page = _paginate(RESOURCES[resource], items, cluster.store.rv, query)
        if tables.wants_table(request.headers.get("Accept", "")):
            return json_response({**tables.table(resource, page["items"], ""), "metadata": page["metadata"]})
        return json_response(page)

    async def _object(
        self, request: web.Request, verb: str, target: Target, options: dict[str, Any] | None
    ) -> web.StreamResponse:
        cluster, resource, ns, name, sub = (
            self.cluster,
            target.resource,
            target.namespace or "",
            target.name,
            target.sub,
        )
        assert name is not None
        if sub == "exec":
            return await handle_exec(request, cluster, ns, name)
        if sub == "portforward":
            return await handle_portforward(request, cluster, ns, name)
        if sub == "log":
            return await feeds.log(request, cluster, ns, name)
        if verb == "get":
            obj = cluster.get(resource, ns, name)
            if tables.wants_table(request.headers.get("Accept", "")):
                return json_response(tables.table(resource, [obj], obj["metadata"]["resourceVersion"]))
            return json_response(obj)
        if verb == "delete":
            return json_response(cluster.delete(resource, ns, name, options or {}))
        if verb == "update":
            body = await self._body(request)
            self._check_fields(request, resource, body)
            return json_response(cluster.replace(resource, ns, name, body))
        if verb == "patch":
            body = await self._body(request)
            if "json-patch" not in (request.content_type or ""):
                self._check_fields(request, resource, body)
            return json_response(cluster.patch(resource, ns, name, body, request.content_type or ""))
        raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
