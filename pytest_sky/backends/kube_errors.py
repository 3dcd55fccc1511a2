"""The API server's refusals, read once into fields, and the project's errors made from them.

The API server answers 403 Forbidden for a missing RBAC verb, a ResourceQuota, a LimitRange
and Pod Security alike (``pods "x" is forbidden: ...``): only its message tells them apart.
:class:`Refusal` reads that message here, in one place, so that the rest of the backend
branches on what it found (``needs_limits``, ``policy``, ``status``), never on the text.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from pytest_sky.backends.kube_ownership import ObjectRef
from pytest_sky.backends.privileges import NONE_ASKED, Privileges
from pytest_sky.errors import BackendUnavailableError, NameTakenError, ProvisionError
from pytest_sky.ssh import kube_proxy

#: What the API server says when a pod needs limits of its own: a ResourceQuota counts them
#: (403 "failed quota: q: must specify limits.cpu ..."), a LimitRange of type Pod caps them
#: (403 "maximum cpu usage per Pod is 2.  No limit is specified"), or a LimitRange's default
#: limit, filled in for us, is below our request (422 "must be less than or equal to cpu
#: limit of 1").  The backend then sends limits equal to the requests.
_NEEDS_LIMITS = {
    403: re.compile(r"failed quota: .*must specify .*limits\.|No limit is specified"),
    422: re.compile(r"must be less than or equal to (cpu|memory) limit"),
}
_LIMIT_RANGE = re.compile(r"(maximum|minimum) \S+ usage per (Container|Pod)|max limit to request ratio")
_POD_SECURITY_LEVEL = re.compile(r'PodSecurity "([^"]+)"')


class Policy(enum.Enum):
    """A namespace policy that refused a pod (rather than RBAC)."""

    QUOTA_USED_UP = "quota used up"  # the ResourceQuota has no room left
    QUOTA_REFUSES = "quota refuses"  # the ResourceQuota wants requests the pods lack
    POD_SECURITY = "pod security"
    LIMIT_RANGE = "limit range"


@dataclass(frozen=True)
class Refusal:
    """One refused request, plain or of a websocket (exec, port-forward), read into fields."""

    status: int | None
    #: The server's own message (its ``Status.message``), else the exception's first line.
    message: str
    #: For an RBAC denial: which verb on which resource is missing and how to grant it.
    rbac: str | None
    #: The namespace demands limits the pod did not send (sending them may succeed).
    needs_limits: bool
    policy: Policy | None
    #: Pod Security's level named in the refusal ("" if none), for a POD_SECURITY policy.
    pod_security_level: str = ""

    @classmethod
    def of(cls, exc: BaseException) -> Refusal:
        status = getattr(exc, "status", None)
        message = kube_proxy.refusal_message(exc)
        limits = _NEEDS_LIMITS.get(status or 0)
        level = _POD_SECURITY_LEVEL.search(message)
        return cls(
            status=status,
            message=message,
            rbac=kube_proxy.rbac_line(message),
            needs_limits=limits is not None and limits.search(message) is not None,
            policy=_policy(status, message),
            pod_security_level=level.group(1) if level else "",
        )

    @property
    def line(self) -> str:
        """The one line for the user: the RBAC advice where it is one, else the server's message."""
        return self.rbac or self.message


def _policy(status: int | None, message: str) -> Policy | None:
    if status != 403:
        return None
    if "exceeded quota:" in message:
        return Policy.QUOTA_USED_UP
    if "failed quota:" in message:
        return Policy.QUOTA_REFUSES
    if "violates PodSecurity" in message:
        return Policy.POD_SECURITY
    if _LIMIT_RANGE.search(message):
        return Policy.LIMIT_RANGE
    return None


def api_message(exc: BaseException) -> str:
    """The one line for an API refusal (see :attr:`Refusal.line`)."""
    return Refusal.of(exc).line


def policy_line(refusal: Refusal, namespace: str, asked: Privileges = NONE_ASKED) -> str | None:
    """A pod refused by the namespace's policies, in one line with its fix; None for any other
    refusal.  ``asked``: what the launch asked for beyond a pod's own privileges, which Pod
    Security may be refusing.  (Limits the namespace merely demands are sent instead:
    :attr:`Refusal.needs_limits`.)"""
    detail = re.sub(r'^pods "[^"]*" is forbidden: ', "", refusal.message).replace("\n", " ")
    where = f"namespace {namespace!r}"
    if refusal.policy is Policy.QUOTA_USED_UP:
        return (
            f"{where} has used up its ResourceQuota ({detail}): delete pods you no longer need there, ask its "
            "admin for a larger quota, or ask for less (cpus, memory, gpus, num_nodes)"
        )
    if refusal.policy is Policy.QUOTA_REFUSES:
        return f"the ResourceQuota of {where} refuses the pods ({detail}): ask its admin which requests it needs"
    if refusal.policy is Policy.POD_SECURITY:
        level = refusal.pod_security_level
        if asked:
            return (
                f"{where} enforces PodSecurity {level}, which refuses the "
                f"{asked.describe()} the launch asked for ({detail}): launch without them, or use a namespace "
                "labelled pod-security.kubernetes.io/enforce=privileged (--kube-namespace)"
            )
        return (
            f"{where} enforces PodSecurity {level}, which the pods' sshd cannot meet "
            f"({detail}): use a namespace labelled pod-security.kubernetes.io/enforce=baseline (--kube-namespace)"
        )
    if refusal.policy is Policy.LIMIT_RANGE:
        return (
            f"a LimitRange of {where} refuses the pods ({detail}): ask for cpus/memory within its bounds "
            f"(kubectl describe limitrange -n {namespace})"
        )
    return None


def creation_refused(
    exc: BaseException, ref: ObjectRef, namespace: str, context: str | None, asked: Privileges
) -> ProvisionError:
    """The one line for the API server's refusal to create one of the cluster's objects:
    a name taken by an object that is not ours (409), a namespace policy, RBAC, the rest."""
    refusal = Refusal.of(exc)
    where = f"namespace {namespace!r} of kube context {context!r}"
    if refusal.status == 409:
        return NameTakenError(
            f"a {ref.kind} named {ref.name!r} already exists in {where} and is not this launch's "
            f"(left untouched): pick another cluster name (-c NAME), or delete that {ref.kind} if it is yours"
        )
    policy = policy_line(refusal, namespace, asked)
    if policy is not None:
        return ProvisionError(policy)
    if refusal.status == 403:
        return ProvisionError(f"no permission in {where}: {refusal.line}")
    return ProvisionError(f"the API server refused {ref.kind} {ref.name}: {refusal.line}")


def unreachable(exc: BaseException, context: str | None, server: str) -> BackendUnavailableError:
    """A request that never got an answer (refused, timed out, no route, a certificate not
    trusted): the reason, not urllib3's retry story."""
    tls = _certificate_failure(exc)
    if tls is not None:
        return BackendUnavailableError(
            f"cannot verify the API server of kube context {context!r} ({server}): {tls}; the kubeconfig's "
            "certificate-authority-data (or certificate-authority) must be the CA that signed its certificate, "
            "for the address in its server field"
        )
    reason = str(getattr(exc, "reason", None) or exc).splitlines()[0].rsplit(": ", 1)[-1][:200]
    return BackendUnavailableError(f"cannot reach the API server of kube context {context!r} ({server}): {reason}")


def _certificate_failure(exc: BaseException) -> str | None:
    """Why TLS refused the server's certificate, found wherever the client wrapped it
    (urllib3: ``MaxRetryError.reason`` -> ``SSLError(SSLCertVerificationError)``); None when
    the failure was something else."""
    import ssl

    seen: set[int] = set()
    pending: list[object] = [exc]
    while pending:
        err = pending.pop()
        if not isinstance(err, BaseException) or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, ssl.SSLCertVerificationError):
            return err.verify_message or "certificate verify failed"
        pending += [getattr(err, "reason", None), err.__cause__, err.__context__, *err.args]
    return None
