"""A cluster's pods against a namespace's policies and a cluster's GPU node labels.

Each test launches through ``pytest_sky.launch`` against the emulator, whose admission
(``kube_emulator/admission.py``) enforces LimitRange, ResourceQuota and Pod Security
with the real API server's messages, and whose nodes are small and may carry GPU product labels.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import pytest_sky
from pytest_sky.backends import kube_manifests as manifests
from pytest_sky.backends.kubernetes import KubernetesBackend
from pytest_sky.errors import ProvisionError

pytest.importorskip("kubernetes", reason="pip install kubernetes")
pytest.importorskip("aiohttp", reason="the emulator needs aiohttp")

from kube_emulator import Emulator


def api(emu: Emulator):  # the client's CoreV1Api
    return KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()


def namespace(emu: Emulator, name: str, labels: dict[str, str] | None = None, **policies: dict) -> str:
    """A namespace with the given ``limit_range`` / ``quota`` specs (created by the admin)."""
    core = api(emu)
    core.create_namespace({"metadata": {"name": name, "labels": labels or {}}})
    if "limit_range" in policies:
        core.create_namespaced_limit_range(name, {"metadata": {"name": "lr"}, "spec": policies["limit_range"]})
    if "quota" in policies:
        core.create_namespaced_resource_quota(name, {"metadata": {"name": "compute"}, "spec": policies["quota"]})
    return name


def launch(emu: Emulator, name: str, ns: str = "default", num_nodes: int = 2, **kwargs: object) -> pytest_sky.Cluster:
    return pytest_sky.launch(
        num_nodes=num_nodes,
        name=name,
        backend="kubernetes",
        backend_options={"kubeconfig": str(emu.kubeconfig_path), "namespace": ns},
        **kwargs,
    )


def pods(emu: Emulator, cluster: str, ns: str = "default") -> list:
    return api(emu).list_namespaced_pod(ns, label_selector=manifests.selector(cluster)).items


def refused(emu: Emulator, name: str, ns: str, **kwargs: object) -> str:
    """The one-line error of a launch the namespace refuses; nothing of it is left behind."""
    with pytest.raises(ProvisionError) as err:
        launch(emu, name, ns, **kwargs)
    message = str(err.value)
    assert "\n" not in message and "no permission" not in message, message
    assert pods(emu, name, ns) == []
    return message


def test_default_requests_fit_a_laptop_kind_node(home: Path):
    """One 2-CPU / 4 GiB node (kind in a small Docker VM) holds a 3-node cluster."""
    with (
        Emulator(nodes=1, cpus_per_node="2", memory_per_node="4Gi", policies=False) as small,
        launch(small, "pol-kind", num_nodes=3) as c,
    ):
        assert c.run("true").returncode == 0
        (pod, *_) = pods(small, "pol-kind")
        assert pod.spec.containers[0].resources.requests == {"cpu": "500m", "memory": "1024Mi"}
        assert pod.spec.containers[0].resources.limits in (None, {})


def test_task_cpus_and_memory_reach_the_pod_with_limits_where_a_default_is_lower(home: Path, emu: Emulator):
    """A LimitRange whose default limit is below the task's request: the pods say their own."""
    ns = namespace(emu, "pol-low-default", limit_range={"limits": [{"type": "Container", "default": {"cpu": "1"}}]})
    with launch(emu, "pol-cpus", ns, cpus=1.5, memory=2) as c:
        assert c.run("true").returncode == 0
        for pod in pods(emu, "pol-cpus", ns):
            res = pod.spec.containers[0].resources
            assert res.requests == {"cpu": "1500m", "memory": "2048Mi"}, res
            assert res.limits == res.requests, res


def test_a_quota_that_demands_limits_gets_a_launch_that_works(home: Path, emu: Emulator):
    quota = {"hard": {"limits.cpu": "8", "limits.memory": "16Gi", "requests.cpu": "4"}}
    ns = namespace(emu, "pol-quota-limits", quota=quota)
    with launch(emu, "pol-limits", ns) as c:
        assert c.run("true").returncode == 0
        for pod in pods(emu, "pol-limits", ns):
            assert pod.spec.containers[0].resources.limits == {"cpu": "500m", "memory": "1024Mi"}


def test_quota_exceeded_is_named_with_its_numbers(home: Path, emu: Emulator):
    ns = namespace(emu, "pol-quota-small", quota={"hard": {"requests.cpu": "1"}})
    message = refused(emu, "pol-over", ns, num_nodes=3)
    assert message.startswith("namespace 'pol-quota-small' has used up its ResourceQuota"), message
    assert "requested: requests.cpu=500m, used: requests.cpu=1, limited: requests.cpu=1" in message, message
    assert "ask for less" in message


def test_a_limitrange_violation_is_named_with_its_bound(home: Path, emu: Emulator):
    ns = namespace(emu, "pol-lr-min", limit_range={"limits": [{"type": "Container", "min": {"cpu": "1"}}]})
    message = refused(emu, "pol-min", ns)
    assert message.startswith("a LimitRange of namespace 'pol-lr-min' refuses the pods"), message
    assert "minimum cpu usage per Container is 1, but request is 500m" in message, message
    assert "kubectl describe limitrange -n pol-lr-min" in message


def test_a_restricted_namespace_is_named_as_pod_security(home: Path, emu: Emulator):
    ns = namespace(emu, "pol-restricted", labels={"pod-security.kubernetes.io/enforce": "restricted"})
    message = refused(emu, "pol-psa", ns)
    assert message.startswith("namespace 'pol-restricted' enforces PodSecurity restricted:latest"), message
    assert "runAsNonRoot != true" in message and "pod-security.kubernetes.io/enforce=baseline" in message, message


def test_a_gpu_type_never_lands_on_another_gpu(home: Path):
    with Emulator(nodes=2, gpus_per_node=1, gpu_product="Tesla-T4") as t4:
        message = refused(t4, "pol-a100", "default", gpus="A100:1")
        assert "cannot be scheduled" in message and "didn't match Pod's node affinity/selector" in message, message
        assert "nvidia.com/gpu.product matching A100" in message and "--kube-gpu-label" in message, message


def test_a_gpu_type_lands_on_its_own_nodes(home: Path):
    with (
        Emulator(nodes=2, gpus_per_node=1, gpu_product="NVIDIA-A100-SXM4-80GB") as a100,
        launch(a100, "pol-a100ok", gpus="A100:1") as c,
    ):
        assert c.run("true").returncode == 0
        affinity = pods(a100, "pol-a100ok")[0].spec.affinity.node_affinity
        (term,) = affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
        (expr,) = term.match_expressions
        assert expr.key == "nvidia.com/gpu.product" and "NVIDIA-A100-SXM4-80GB" in expr.values


def raw_pod(name: str, resources: dict | None = None, security: dict | None = None) -> dict:
    container = {"name": "c", "image": "img", "command": ["/bin/sh", "-c", "true"], "resources": resources or {}}
    if security:
        container["securityContext"] = security
    return {"metadata": {"name": name}, "spec": {"restartPolicy": "Never", "containers": [container]}}


def test_the_emulator_admits_pods_as_the_api_server_does(emu: Emulator):
    """LimitRange defaulting (a max is the default limit), "must specify" of a quota on limits,
    and Pod Security baseline in the default namespace, with the real messages."""
    from kubernetes.client.exceptions import ApiException

    core = api(emu)
    ns = namespace(emu, "pol-admission", limit_range={"limits": [{"type": "Container", "max": {"cpu": "2"}}]})
    created = core.create_namespaced_pod(ns, raw_pod("capped", {"requests": {"cpu": "100m"}}))
    try:
        assert created.spec.containers[0].resources.limits == {"cpu": "2"}
    finally:
        core.delete_namespaced_pod("capped", ns)
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod(ns, raw_pod("greedy", {"requests": {"cpu": "1"}, "limits": {"cpu": "3"}}))
    assert err.value.status == 403 and "maximum cpu usage per Container is 2, but limit is 3" in err.value.body
    quota = namespace(emu, "pol-admission-q", quota={"hard": {"limits.memory": "1Gi"}})
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod(quota, raw_pod("nolimit"))
    assert err.value.status == 403 and "failed quota: compute: must specify limits.memory for: c" in err.value.body
    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod("default", raw_pod("root", security={"privileged": True}))
    assert err.value.status == 403
    assert (
        'violates PodSecurity \\"baseline:latest\\": privileged (container \\"c\\" must not set '
        "securityContext.privileged=true)" in err.value.body
    )
