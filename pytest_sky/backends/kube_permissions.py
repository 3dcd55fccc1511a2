"""The verbs the Kubernetes backend uses, and whether a kube context holds them, asked before
anything is created.

A Role that lacks one verb used to fail a launch half-way: pods made, then the exec of a key
refused, then a teardown.  Now the launch asks first, with a SelfSubjectRulesReview (which
every authenticated user may make on a real cluster, through the ``system:basic-user``
ClusterRole) for the rules that apply to its user in the namespace, matches them as the RBAC
authorizer does, and names everything missing in one line, with the fix, before a single
object exists.  An answer the server marks incomplete (an authorizer that cannot list its
rules, such as a webhook) proves nothing missing: the launch goes on, and a refusal is named
when it comes, as before.

What is needed is what ``examples/kubernetes/rbac.yaml`` grants, and nothing more
(``tests/test_kube_rbac.py`` holds the two together): exec and port-forward are websockets,
authorized as ``get`` before Kubernetes 1.35 and as ``get`` and ``create`` from 1.35 on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pytest_sky.ssh.kube_proxy import RBAC_ROLE_FILE

#: Kubernetes from which a websocket exec or port-forward is also authorized as ``create``.
CREATE_CHECK_SINCE = (1, 35)


#: The API group of Leases, the clusters' owners (``kube_lease``).
COORDINATION = "coordination.k8s.io"


@dataclass(frozen=True)
class Permission:
    """One verb on one resource (``pods/exec`` for a subresource) of one API group ("": core)."""

    verb: str
    resource: str
    group: str = ""

    def __str__(self) -> str:
        return f"{self.verb} {self.resource}" + (f".{self.group}" if self.group else "")


@dataclass(frozen=True)
class Rule:
    """One resource rule of a rules review, as the API server lists it."""

    verbs: tuple[str, ...]
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    resource_names: tuple[str, ...] = ()

    def allows(self, wanted: Permission) -> bool:
        """Whether this rule grants ``wanted`` on every object (the RBAC authorizer's matching:
        ``*`` verbs, groups and resources, ``*/sub`` for a subresource; a rule narrowed to
        names does not cover a create or a list)."""
        sub = wanted.resource.partition("/")[2]
        return (
            ("*" in self.verbs or wanted.verb in self.verbs)
            and ("*" in self.api_groups or wanted.group in self.api_groups)
            and any(r in ("*", wanted.resource) or (sub and r == f"*/{sub}") for r in self.resources)
            and not self.resource_names
        )


def needed(server_version: tuple[int, int] | None, *, shared_claim: bool) -> list[Permission]:
    """Every verb a launch, its runs, its teardown and the reaping of stale clusters use (a
    version not known: the newer rules).  Never a read of Secrets: the cluster's own is
    deleted by the uid its creation returned."""
    wanted = [Permission(v, "pods") for v in ("create", "get", "list", "watch", "delete")]
    wanted += [Permission(v, "secrets") for v in ("create", "delete")]
    wanted += [Permission(v, "services") for v in ("create", "get", "delete")]
    wanted += [Permission(v, "leases", COORDINATION) for v in ("create", "get", "list", "update", "patch", "delete")]
    websocket_verbs = ("get", "create") if (server_version or CREATE_CHECK_SINCE) >= CREATE_CHECK_SINCE else ("get",)
    wanted += [Permission(v, r) for r in ("pods/exec", "pods/portforward") for v in websocket_verbs]
    wanted += [Permission("get", "pods/log"), Permission("list", "events")]
    if shared_claim:
        wanted.append(Permission("get", "persistentvolumeclaims"))
    return wanted


def missing(rules: Iterable[Rule], wanted: Iterable[Permission]) -> list[Permission]:
    rules = list(rules)
    return [p for p in wanted if not any(rule.allows(p) for rule in rules)]


def missing_line(context: str | None, namespace: str, lacking: list[Permission]) -> str:
    """The one line a launch fails with, naming every missing verb and the fix."""
    what = ", ".join(str(p) for p in lacking)
    return (
        f"kube context {context!r} may not {what} in namespace {namespace!r} (its RBAC rules there lack "
        f"{'it' if len(lacking) == 1 else 'them'}; nothing was created): grant the Role pytest-sky needs, "
        f"kubectl apply -n {namespace} -f {RBAC_ROLE_FILE}, and bind it to that user"
    )
