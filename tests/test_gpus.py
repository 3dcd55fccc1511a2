"""GPU shares on the local backend, with an injected device list (this machine has no GPU)."""

from __future__ import annotations

import os

import pytest

import pytest_sky
from pytest_sky import gpus
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
    """Each node's GPUs are all it has, numbered from 0 as in a pod given them (its /dev holds
    exactly their device files: :func:`test_a_node_gets_the_device_files_of_its_share_only`)."""
    monkeypatch.setenv("PYTEST_SKY_HOME", str(tmp_path))
    name = f"gpu-share-{os.getpid() % 10000}"
    with pytest_sky.launch(num_nodes=3, name=name, gpus="A100:2", backend_options={"devices": list("012345")}) as c:
        res = c.run('echo "$CUDA_VISIBLE_DEVICES $SKYPILOT_NUM_GPUS_PER_NODE"')
        assert [r.stdout.strip() for r in res.ranks] == ["0,1 2", "0,1 2", "0,1 2"]
        assert c.resources_label == "3x Local(A100:2)"


def test_a_node_gets_the_device_files_of_its_share_only(monkeypatch):
    """A share's ``/dev/nvidiaN`` by nvidia-smi's minor number (which need not be the index),
    with the control devices; nothing for a node without GPUs."""
    monkeypatch.setattr(gpus, "_minor_numbers", lambda: {"0": "0", "1": "3", "3": "1"})
    assert gpus.device_files("1,3") == ["/dev/nvidia3", "/dev/nvidia1", *gpus.CONTROL_DEVICES]
    assert gpus.device_files("2") == ["/dev/nvidia2", *gpus.CONTROL_DEVICES]  # not listed: its index
    assert gpus.device_files("") == []
    assert [gpus.node_view(s) for s in ("4,7", "3", "")] == ["0,1", "0", ""]
