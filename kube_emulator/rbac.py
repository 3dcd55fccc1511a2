"""RBAC for the emulator: Role-shaped rules, matched as the real RBAC authorizer does.

A user's grants are the rules of the ``Role`` and ``ClusterRole`` objects that bindings name
them in (``rbac_objects.py`` reads those from the cluster on every request; a few fixed
tokens, the admin's and the read-only one, hold grants of their own).  A Role's rules apply
only inside its namespace, never to cluster-scoped resources such as nodes or namespaces; a
ClusterRole's, bound by a ClusterRoleBinding, everywhere.  A request is allowed when any
rule of any grant matches its
verb, API group, resource (``pods`` or ``pods/exec``: ``*`` matches everything,
``*/exec`` any resource's ``exec``) and name (an empty ``resourceNames`` matches any name;
a non-empty one never matches a request without a name, such as ``create`` or ``list``).
These are the rules of ``k8s.io/kubernetes/plugin/pkg/auth/authorizer/rbac``
(``VerbMatches``, ``APIGroupMatches``, ``ResourceMatches``, ``ResourceNameMatches``).

Verbs come from the request the way the API server's request-info resolver derives them
(the server module does that): GET on one object ``get``, on a collection ``list``, with
``?watch=true`` ``watch``; POST ``create``; PUT ``update``; PATCH ``patch``; DELETE on one
object ``delete``, on a collection ``deletecollection``.

The websocket verbs of ``pods/exec``, ``pods/attach`` and ``pods/portforward``
(:func:`connect_verbs`): the official clients open exec and port-forward as a websocket
upgrade, which is an HTTP GET, so the API server authorizes it as ``get`` on the
subresource (SPDY used POST, hence ``create``).  kubernetes/kubernetes#78741 reported that
``get`` alone thus allows exec.  Kubernetes 1.35 (kubernetes/kubernetes#134577, KEP-4006
"Synthetic RBAC CREATE authorization check", feature gate
``AuthorizePodWebsocketUpgradeCreatePermission``, beta and on by default from 1.35) adds a
second, compound check on the websocket upgrade: the requester must also be allowed to
``create`` the subresource.  So before 1.35 a websocket exec needs ``get`` (a Role with only
``create`` fails with "cannot get resource pods/exec"); from 1.35 it needs ``get`` and then
``create`` ("cannot create resource pods/exec" when only ``get`` is granted).  A Role that
works on both grants both verbs, as ``examples/kubernetes/rbac.yaml`` does.

A denial is a 403 whose message is the real server's (``responsewriters.forbiddenMessage``
wrapped by ``apierrors.NewForbidden``)::

    pods "x" is forbidden: User "system:serviceaccount:default:pytest-sky" cannot create
    resource "pods/exec" in API group "" in the namespace "default"

Every decision is recorded (:attr:`Authorizer.decisions`), so a test can see exactly which
verbs a client asked for.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

#: Subresources whose websocket upgrade 1.35+ also authorizes as ``create``.
CONNECT_SUBRESOURCES = ("exec", "attach", "portforward")
CREATE_CHECK_SINCE = (1, 35)


@dataclass(frozen=True)
class PolicyRule:
    """One entry of a Role's ``rules`` (resource rules only: the emulator serves no other)."""

    verbs: tuple[str, ...]
    api_groups: tuple[str, ...] = ("",)
    resources: tuple[str, ...] = ()
    resource_names: tuple[str, ...] = ()

    def matches(self, req: Request) -> bool:
        return (
            _verb_matches(self, req.verb)
            and _group_matches(self, req.api_group)
            and _resource_matches(self, req.resource, req.subresource)
            and _name_matches(self, req.name)
        )


@dataclass(frozen=True)
class Grant:
    """The rules a binding gives: a Role's (``namespace`` set) or a ClusterRole's (None)."""

    rules: tuple[PolicyRule, ...]
    namespace: str | None = None

    def allows(self, req: Request) -> bool:
        if self.namespace is not None and req.namespace != self.namespace:
            return False
        return any(rule.matches(req) for rule in self.rules)


@dataclass(frozen=True)
class Subject:
    """Who a token is; ``grants`` None means everything (the admin)."""

    user: str
    grants: tuple[Grant, ...] | None = ()


@dataclass(frozen=True)
class Request:
    """The authorizer's view of a request (``authorizer.Attributes`` in the real server)."""

    user: str
    verb: str
    resource: str
    subresource: str = ""
    namespace: str = ""
    name: str = ""
    api_group: str = ""

    @property
    def combined(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource

    def forbidden_message(self) -> str:
        scope = f"in the namespace {_q(self.namespace)}" if self.namespace else "at the cluster scope"
        reason = (
            f"User {_q(self.user)} cannot {self.verb} resource {_q(self.combined)} in API group {_q(self.api_group)} "
            f"{scope}"
        )
        qualified = f"{self.resource}.{self.api_group}" if self.api_group else self.resource
        return (
            f"{qualified} {_q(self.name)} is forbidden: {reason}"
            if self.name
            else f"{qualified} is forbidden: {reason}"
        )


@dataclass(frozen=True)
class Decision:
    """One authorization decision, as recorded."""

    request: Request
    allowed: bool


class Forbidden(Exception):
    """A denied request; the server answers it with a 403 Status."""

    def __init__(self, request: Request) -> None:
        super().__init__(request.forbidden_message())
        self.request = request

    def details(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.request.resource}
        if self.request.api_group:
            out["group"] = self.request.api_group
        if self.request.name:
            out["name"] = self.request.name
        return out


def _q(text: str) -> str:
    """Go's %q for the plain strings that appear here."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _verb_matches(rule: PolicyRule, verb: str) -> bool:
    return "*" in rule.verbs or verb in rule.verbs


def _group_matches(rule: PolicyRule, group: str) -> bool:
    return "*" in rule.api_groups or group in rule.api_groups


def _resource_matches(rule: PolicyRule, resource: str, subresource: str) -> bool:
    combined = f"{resource}/{subresource}" if subresource else resource
    for r in rule.resources:
        if r == "*" or r == combined:
            return True
        if subresource and r == f"*/{subresource}":
            return True
    return False


def _name_matches(rule: PolicyRule, name: str) -> bool:
    return not rule.resource_names or name in rule.resource_names


def parse_version(version: str) -> tuple[int, int]:
    """``"1.34"``, ``"v1.35.0"`` -> (1, 34); anything else is a ValueError naming the form."""
    m = re.fullmatch(r"v?(\d+)\.(\d+)(\.\d+)?", version.strip())
    if not m:
        raise ValueError(f"--kube-version {version!r}: expected MAJOR.MINOR, e.g. 1.34 or v1.35.0")
    return int(m.group(1)), int(m.group(2))


def connect_verbs(method: str, kube_version: str) -> tuple[str, ...]:
    """The verbs an exec/attach/port-forward request is authorized for, in order (see the
    module docstring): POST (SPDY) ``create``; GET (websocket) ``get``, and from 1.35 also
    ``create``."""
    if method == "POST":
        return ("create",)
    if parse_version(kube_version) >= CREATE_CHECK_SINCE:
        return ("get", "create")
    return ("get",)


def rule_from(doc: dict[str, Any]) -> PolicyRule:
    """One rule of a Role document; a ValueError saying what is wrong when it is malformed."""

    def strings(key: str) -> tuple[str, ...]:
        value = doc.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{key} must be a list of strings")
        return tuple(value)

    verbs = strings("verbs")
    if not verbs:
        raise ValueError("verbs must not be empty")
    return PolicyRule(
        verbs=verbs,
        api_groups=strings("apiGroups"),
        resources=strings("resources"),
        resource_names=strings("resourceNames"),
    )


#: The kinds a role file may hold, and the resource each is stored as.
ROLE_FILE_KINDS = {
    "Role": "roles",
    "ClusterRole": "clusterroles",
    "RoleBinding": "rolebindings",
    "ClusterRoleBinding": "clusterrolebindings",
    "ServiceAccount": "serviceaccounts",
}


def role_documents(text: str, source: str) -> list[dict[str, Any]]:
    """The documents of a role file (``--role``, ``Emulator.set_role``): what ``kubectl apply
    -f`` of it would create; a ValueError naming ``source`` when it holds no Role."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not YAML: {str(exc).splitlines()[0]}") from None
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict) or doc.get("kind") not in ROLE_FILE_KINDS:
            kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"{source}: document {i + 1} is a {kind}; expected one of {', '.join(ROLE_FILE_KINDS)}")
    if not any(d["kind"] in ("Role", "ClusterRole") for d in docs):
        raise ValueError(f"{source}: no Role or ClusterRole in it")
    return docs


def read_role_file(path: Path | str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--role {path}: {exc.strerror}") from None


@dataclass
class Authorizer:
    """Tokens to subjects, and the decision for each request (with a record of them)."""

    kube_version: str
    subjects: dict[str, Subject] = field(default_factory=dict)
    decisions: deque[Decision] = field(default_factory=lambda: deque(maxlen=100_000))
    #: The grants the cluster's RoleBindings and ClusterRoleBindings give a user, looked up on
    #: every request (so an applied or deleted binding counts at once, as on a real server).
    bound: Callable[[str], Iterable[Grant]] = lambda user: ()

    def __post_init__(self) -> None:
        parse_version(self.kube_version)  # refuse a malformed version at start, not per request

    def bind(self, token: str, user: str, grants: Iterable[Grant] | None) -> None:
        self.subjects[token] = Subject(user, None if grants is None else tuple(grants))

    def authenticate(self, token: str) -> Subject | None:
        return self.subjects.get(token)

    def authenticate_user(self, user: str) -> Subject:
        """A user the CA vouched for (a client certificate): the grants bound to that name,
        or none (authenticated, allowed nothing), as RBAC treats a user no binding names."""
        return next((s for s in self.subjects.values() if s.user == user), Subject(user))

    def grants(self, subject: Subject) -> list[Grant] | None:
        """Every grant of ``subject``, its own and its bindings' (None: the admin's, everything)."""
        return None if subject.grants is None else [*subject.grants, *self.bound(subject.user)]

    def allows(self, subject: Subject, req: Request) -> bool:
        """Whether some grant of ``subject``, its own or its bindings', allows ``req``
        (asked, not recorded)."""
        grants = self.grants(subject)
        return grants is None or any(g.allows(req) for g in grants)

    def authorize(self, subject: Subject, req: Request) -> None:
        """Raise :class:`Forbidden` unless some grant of ``subject`` allows ``req``."""
        allowed = self.allows(subject, req)
        self.decisions.append(Decision(req, allowed))
        if not allowed:
            raise Forbidden(req)

    def authorize_all(self, subject: Subject, reqs: Iterable[Request]) -> None:
        """Each in turn: the first one denied is the one the 403 names (the real order)."""
        for req in reqs:
            self.authorize(subject, req)
