"""Every manifest the Kubernetes backend sends, checked by kubernetes-validate in strict mode."""

from __future__ import annotations

import pytest

from pytest_sky.backends import kube_manifests as m
from pytest_sky.resources import Resources

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

VERSIONS = ["1.30.0", "1.37.0"]


def manifests(resources: Resources, nodes: int = 3) -> list[dict]:
    out = [
        m.secret("demo", "default", {"authorized_keys": b"ssh-ed25519 AAAA x\n", "host_key_0": b"k"}),
        m.service("demo", "default"),
    ]
    out += [m.pod("demo", r, "default", m.DEFAULT_IMAGE, resources) for r in range(nodes)]
    return out


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
    pod = m.pod("demo", 1, "default", "img", Resources.from_kwargs(gpus="V100:0.5"))
    res = pod["spec"]["containers"][0]["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    assert "tolerations" not in m.pod("demo", 1, "default", "img", Resources())["spec"]


def test_spread_is_soft_and_names_resolve():
    pod = m.pod("demo", 2, "default", "img", Resources())
    anti = pod["spec"]["affinity"]["podAntiAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti
    (term,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["weight"] == 100
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"] == {"matchLabels": {m.LABEL_CLUSTER: "demo"}}
    assert pod["spec"]["hostname"] == "demo-worker2" and pod["spec"]["subdomain"] == "demo"
    assert pod["metadata"]["labels"][m.LABEL_ROLE] == "worker" and pod["metadata"]["labels"][m.LABEL_RANK] == "2"
    assert m.service("demo", "default")["spec"]["clusterIP"] == "None"


def test_status_shows_the_requested_share_not_the_rounded_one():
    res = Resources.from_kwargs(gpus="V100:0.5", cpus="2", memory="8")
    assert res.describe(3, "Kubernetes") == "3x Kubernetes(2CPU--8GB--V100:0.5)"
