"""Every manifest the Kubernetes backend sends, checked by kubernetes-validate in strict mode."""

from __future__ import annotations

import pytest

from kube_emulator import admission
from pytest_sky.backends import kube_lease, privileges
from pytest_sky.backends import kube_manifests as m
from pytest_sky.resources import Resources

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

VERSIONS = ["1.30.0", "1.37.0"]
LAUNCH = "0123456789abcdef"


OWNER = kube_lease.owner_reference("demo", "5c1b2f0e-0000-4000-8000-000000000000")


def manifests(resources: Resources, nodes: int = 3) -> list[dict]:
    files = {"authorized_keys": b"ssh-ed25519 AAAA x\n", "host_key_0": b"k"}
    lifetime = m.Lifetime(owner=OWNER, deadline=21600)
    out = [
        kube_lease.body("demo", "default", launch=LAUNCH, seconds=120, kept=False),
        m.secret("demo", "default", files, launch=LAUNCH, owner=OWNER),
        m.service("demo", "default", launch=LAUNCH, owner=OWNER),
    ]
    out += [
        m.pod("demo", r, "default", m.DEFAULT_IMAGE, resources, launch=LAUNCH, lifetime=lifetime) for r in range(nodes)
    ]
    return out


def test_every_object_is_owned_by_the_clusters_lease_and_pods_end_by_their_deadline():
    lease, *owned = manifests(Resources(), nodes=2)
    assert lease["apiVersion"] == "coordination.k8s.io/v1" and lease["metadata"]["name"] == "demo"
    assert lease["spec"]["leaseDurationSeconds"] == 120 and " pid " in lease["spec"]["holderIdentity"]
    assert lease["metadata"]["labels"][m.LABEL_LAUNCH] == LAUNCH
    assert [o["metadata"]["ownerReferences"] for o in owned] == [[OWNER]] * 4
    assert {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "name": "demo", "uid": OWNER["uid"]} == OWNER
    for pod in owned[2:]:
        assert pod["spec"]["activeDeadlineSeconds"] == 21600
        assert pod["spec"]["automountServiceAccountToken"] is False  # no API credentials in a node
    kept = kube_lease.body("demo", "default", launch=LAUNCH, seconds=120, kept=True)
    assert kept["metadata"]["annotations"] == {kube_lease.KEPT: "true"}
    assert "activeDeadlineSeconds" not in m.pod("demo", 0, "default", "img", Resources(), launch=LAUNCH)["spec"]


def test_a_deadline_is_the_default_for_clusters_that_end_and_none_for_kept_ones_unless_given():
    from pytest_sky.backends.kube_objects import ObjectSettings

    default = ObjectSettings(image="img")
    assert default.deadline(keep=False) == 6 * 3600 and default.deadline(keep=True) is None
    given = ObjectSettings(image="img", max_lifetime=90.5)
    assert given.deadline(keep=False) == given.deadline(keep=True) == 91


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "resources",
    [Resources(), Resources.from_kwargs(gpus="V100:0.5", cpus="2", memory="8"), Resources.from_kwargs(gpus="A100:8")],
    ids=["plain", "fractional-gpu", "eight-gpus"],
)
def test_strictly_valid(version: str, resources: Resources):
    for manifest in manifests(resources):
        kubernetes_validate.validate(manifest, version, strict=True)


def test_gpus_are_whole_devices_and_tolerated():
    pod = m.pod("demo", 1, "default", "img", Resources.from_kwargs(gpus="V100:0.5"), launch=LAUNCH)
    res = pod["spec"]["containers"][0]["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    assert "tolerations" not in m.pod("demo", 1, "default", "img", Resources(), launch=LAUNCH)["spec"]


def test_spread_is_soft_and_names_resolve():
    pod = m.pod("demo", 2, "default", "img", Resources(), launch=LAUNCH)
    anti = pod["spec"]["affinity"]["podAntiAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti
    (term,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["weight"] == 100
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"] == {
        "matchLabels": {m.LABEL_CLUSTER: "demo", m.LABEL_LAUNCH: LAUNCH}
    }
    assert pod["spec"]["hostname"] == "demo-worker2" and pod["spec"]["subdomain"] == "demo"
    assert pod["metadata"]["labels"][m.LABEL_ROLE] == "worker" and pod["metadata"]["labels"][m.LABEL_RANK] == "2"
    service = m.service("demo", "default", launch=LAUNCH)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {m.LABEL_CLUSTER: "demo", m.LABEL_LAUNCH: LAUNCH}
    assert pod["metadata"]["labels"][m.LABEL_LAUNCH] == LAUNCH


def test_status_shows_the_requested_share_not_the_rounded_one():
    res = Resources.from_kwargs(gpus="V100:0.5", cpus="2", memory="8")
    assert res.describe(3, "Kubernetes") == "3x Kubernetes(2CPU--8GB--V100:0.5)"


def test_each_pod_mounts_its_own_host_key_only():
    keys = [*m.SHARED_SECRET_KEYS, "host_key_0", "host_key_1", "host_key_2"]
    for rank in range(3):
        pod = m.pod("demo", rank, "default", "img", Resources(), secret_keys=keys, launch=LAUNCH)
        (volume,) = [v for v in pod["spec"]["volumes"] if "secret" in v]
        items = volume["secret"]["items"]
        mounted = {i["key"] for i in items}
        assert mounted == {*m.SHARED_SECRET_KEYS, f"host_key_{rank}"}, mounted
        assert all(i["path"] == i["key"] for i in items)  # BOOTSTRAP reads each file by its key


def baseline_violations(pod: dict) -> list[str]:
    """The emulator's PodSecurity admission at level baseline: one check for CI and this test."""
    containers = [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]
    return [check for check, _ in admission.baseline_violations(pod["spec"], containers)]


@pytest.mark.parametrize("resources", [Resources(), Resources.from_kwargs(gpus="A100:8")], ids=["plain", "gpus"])
def test_pods_pass_podsecurity_baseline_with_only_what_sshd_needs(resources: Resources):
    shared = m.SharedVolume("claim", "/shared")
    for rank in range(2):
        pod = m.pod("demo", rank, "default", "img", resources, shared, launch=LAUNCH)
        assert baseline_violations(pod) == []
        sc = pod["spec"]["containers"][0]["securityContext"]
        # Nothing the runtime happens to grant by default: exactly the named set.
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert set(sc["capabilities"]["add"]) == set(privileges.POD_CAPABILITIES) <= admission.BASELINE_CAPABILITIES
        assert {"SYS_CHROOT", "SETUID", "SETGID", "NET_BIND_SERVICE"} <= set(sc["capabilities"]["add"])
        assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}


def test_the_baseline_check_catches_what_baseline_forbids():
    pod = m.pod("demo", 0, "default", "img", Resources(), launch=LAUNCH)
    pod["spec"]["hostNetwork"] = True
    pod["spec"]["volumes"].append({"name": "root", "hostPath": {"path": "/"}})
    pod["spec"]["containers"][0]["securityContext"]["capabilities"]["add"].append("SYS_ADMIN")
    pod["spec"]["containers"][0]["securityContext"]["privileged"] = True
    assert baseline_violations(pod) == ["capabilities_baseline", "hostNamespaces", "hostPathVolumes", "privileged"]


def test_default_requests_fit_three_pods_on_a_laptop_kind_node():
    """kind in a 4-CPU / 8 GiB Docker VM, less about 1 CPU and 0.5 GiB for the control plane."""
    from kube_emulator.scheduler import parse_quantity

    requests = m.container_resources(Resources())["requests"]
    assert 3 * parse_quantity(requests["cpu"]) <= 3 and 3 * parse_quantity(requests["memory"]) <= 7.5 * 2**30
    assert "limits" not in m.container_resources(Resources())


@pytest.mark.parametrize("version", VERSIONS)
def test_limits_and_the_gpu_node_affinity_are_strictly_valid(version: str):
    from pytest_sky.backends.kube_policy import gpu_selector

    resources = Resources.from_kwargs(gpus="A100:2", cpus="3", memory="6")
    labels = [{"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}, {"nvidia.com/gpu.product": "Tesla-T4"}]
    placement = m.Placement(with_limits=True, gpu=gpu_selector("A100", labels, None))
    pod = m.pod("demo", 0, "default", "img", resources, placement=placement, launch=LAUNCH)
    kubernetes_validate.validate(pod, version, strict=True)
    res = pod["spec"]["containers"][0]["resources"]
    assert res["limits"] == {"cpu": "3", "memory": "6144Mi", "nvidia.com/gpu": "2"} and res["requests"] == res["limits"]
    (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    (expr,) = term["matchExpressions"]
    assert expr["key"] == "nvidia.com/gpu.product" and expr["operator"] == "In"
    assert "NVIDIA-A100-SXM4-80GB" in expr["values"] and "Tesla-T4" not in expr["values"]


@pytest.mark.parametrize(
    ("requested", "value", "expected"),
    [
        ("A100", "NVIDIA-A100-SXM4-80GB", True),
        ("A100", "nvidia-tesla-a100", True),
        ("A100", "a100", True),
        ("A100", "A100_NVLINK_80GB", True),
        ("A100-80GB", "nvidia-a100-80gb", True),
        ("A100-80GB", "NVIDIA-A100-SXM4-40GB", False),
        ("A100", "Tesla-T4", False),
        ("A10", "NVIDIA-A100-SXM4-80GB", False),
        ("A10G", "NVIDIA-A10G", True),
        ("T4", "Tesla-T4", True),
        ("H100", "NVIDIA-H100-80GB-HBM3", True),
        ("RTXA6000", "NVIDIA-RTX-A6000", True),
    ],
)
def test_gpu_label_values_match_skypilot_names(requested: str, value: str, expected: bool):
    from pytest_sky.backends.kube_policy import matches

    assert matches(requested, value) is expected


def test_the_gpu_label_key_comes_from_the_setting_then_the_nodes_then_gpu_feature_discovery():
    from pytest_sky.backends.kube_policy import gpu_selector

    gke = [{"cloud.google.com/gke-accelerator": "nvidia-tesla-t4"}, {"cloud.google.com/gke-accelerator": "nvidia-l4"}]
    sel = gpu_selector("A100", gke, None)
    assert sel is not None and sel.key == "cloud.google.com/gke-accelerator"
    assert sel.values == ("nvidia-tesla-a100",)  # no such node yet: GKE's own spelling (an autoscaler adds it)
    unlisted = gpu_selector("T4", None, None)  # a namespaced Role may not list nodes
    assert unlisted is not None and unlisted.key == "nvidia.com/gpu.product" and "Tesla-T4" in unlisted.values
    custom = gpu_selector("A100", gke, "example.com/gpu")
    assert custom is not None and custom.key == "example.com/gpu" and "A100" in custom.values
    assert gpu_selector("A100", [{"kubernetes.io/hostname": "n1"}], None) is None  # nothing names GPU types
