"""GPU shares on the local backend, with an injected device list (this machine has no GPU)."""

from __future__ import annotations

import os

import pytest

import pytest_sky
from pytest_sky.backends.local import LocalBackend
from pytest_sky.errors import ResourcesError
from pytest_sky.gpus import allocate
from pytest_sky.resources import Resources, parse_accelerators


@pytest.mark.parametrize(
    ("devices", "nodes", "spec", "expected"),
    [
        (["0", "1", "2", "3"], 2, "A100:2", ["0,1", "2,3"]),
        (["0", "1"], 2, "V100:1", ["0", "1"]),
        (["0", "1"], 3, "V100:0.5", ["0", "0", "1"]),
        (["0"], 4, "T4:0.25", ["0", "0", "0", "0"]),
        (["0", "1"], 2, "V100:0.3", ["0", "0"]),
        (["4", "7"], 2, "V100", ["4", "7"]),  # indices as the machine (or CUDA_VISIBLE_DEVICES) has them
        ([], 2, None, ["", ""]),
    ],
)
def test_allocation(devices, nodes, spec, expected):
    assert allocate(devices, nodes, parse_accelerators(spec)) == expected


@pytest.mark.parametrize(
    ("devices", "nodes", "spec"),
    [([], 2, "V100:1"), (["0", "1"], 3, "V100:1"), (["0", "1", "2"], 2, "A100:2"), (["0"], 3, "V100:0.5")],
)
def test_more_than_the_machine_has_is_refused(devices, nodes, spec):
    with pytest.raises(ResourcesError) as err:
        allocate(devices, nodes, parse_accelerators(spec))
    message = str(err.value)
    assert "\n" not in message and spec in message and "GPU" in message


def test_refused_before_anything_is_provisioned(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTEST_SKY_HOME", str(tmp_path))
    with pytest.raises(ResourcesError, match="need 3 GPU"):
        LocalBackend(devices=["0", "1"]).plan("g", 3, Resources.from_kwargs(gpus="V100:1"))
    with pytest.raises(ResourcesError):
        pytest_sky.launch(num_nodes=3, name="gpu-refused", gpus="V100:1", backend_options={"devices": ["0"]})
    assert not any((tmp_path / "clusters").glob("*/record.json"))


def test_nodes_see_their_share(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTEST_SKY_HOME", str(tmp_path))
    name = f"gpu-share-{os.getpid() % 10000}"
    with pytest_sky.launch(num_nodes=3, name=name, gpus="V100:0.5", backend_options={"devices": ["0", "1"]}) as c:
        res = c.run('echo "$CUDA_VISIBLE_DEVICES $SKYPILOT_NUM_GPUS_PER_NODE"')
        assert [r.stdout.strip() for r in res.ranks] == ["0 1", "0 1", "1 1"]
        assert c.resources_label == "3x Local(V100:0.5)"
