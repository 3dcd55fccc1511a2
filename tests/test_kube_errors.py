"""Refusals of the API server read into fields: the backend branches on them, not on text."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException

from pytest_sky.backends.kube_errors import Policy, Refusal, creation_refused, policy_line
from pytest_sky.backends.kube_ownership import ObjectRef
from pytest_sky.backends.privileges import NONE_ASKED


def refused(status: int, message: str) -> ApiException:
    exc = ApiException(status=status, reason="Forbidden" if status == 403 else "Refused")
    exc.body = json.dumps({"kind": "Status", "message": message})
    return exc


@pytest.mark.parametrize(
    ("status", "message", "needs_limits", "policy"),
    [
        (403, 'pods "c-head" is forbidden: exceeded quota: q, requested: cpu=1', False, Policy.QUOTA_USED_UP),
        (403, 'pods "c-head" is forbidden: failed quota: q: must specify limits.cpu', True, Policy.QUOTA_REFUSES),
        (403, 'pods "c-head" is forbidden: violates PodSecurity "restricted:latest": x', False, Policy.POD_SECURITY),
        (
            403,
            'pods "c-head" is forbidden: maximum cpu usage per Pod is 2.  No limit is specified',
            True,
            Policy.LIMIT_RANGE,
        ),
        (422, "spec.containers[0].resources.requests: must be less than or equal to cpu limit of 1", True, None),
        (500, "etcd is down", False, None),
    ],
)
def test_a_refusal_is_read_into_fields(status: int, message: str, needs_limits: bool, policy: Policy | None) -> None:
    refusal = Refusal.of(refused(status, message))
    assert (refusal.status, refusal.needs_limits, refusal.policy, refusal.rbac) == (status, needs_limits, policy, None)
    assert (policy_line(refusal, "ns") is None) == (policy is None)


def test_an_rbac_denial_names_the_missing_verb_and_the_role() -> None:
    message = 'pods is forbidden: User "bob" cannot create resource "pods" in API group "" in the namespace "ns"'
    refusal = Refusal.of(refused(403, message))
    assert refusal.rbac is not None and refusal.line == refusal.rbac and "may not create pods" in refusal.line
    error = creation_refused(refused(403, message), ObjectRef("Pod", "c-head"), "ns", "ctx", NONE_ASKED)
    assert str(error).startswith("no permission in namespace 'ns' of kube context 'ctx': ")


def test_a_name_taken_by_someone_else_is_left_untouched() -> None:
    error = creation_refused(refused(409, "already exists"), ObjectRef("Service", "c"), "ns", "ctx", NONE_ASKED)
    assert "a Service named 'c' already exists" in str(error) and "left untouched" in str(error)
