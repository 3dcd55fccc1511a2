"""Cluster records: typed fields on disk, and records written by older versions still load."""

from __future__ import annotations

import json

from pytest_sky.resources import Resources
from pytest_sky.state import ClusterRecord, ClusterResources, ClusterStatus


def test_a_record_round_trips_with_typed_resources_and_status() -> None:
    record = ClusterRecord(
        name="c1",
        backend="local",
        num_nodes=2,
        owner_pid=1,
        owner_start_time=None,
        status=ClusterStatus.UP,
        resources=ClusterResources.of(Resources.from_kwargs(gpus="V100:1", cpus="2")),
    )
    on_disk = json.loads(record.to_json())
    assert on_disk["status"] == "UP"
    assert on_disk["resources"]["accelerators"] == "V100:1"
    again = ClusterRecord.from_json(record.to_json())
    assert again == record
    assert again.status is ClusterStatus.UP and again.resources.gpus_per_node == 1


def test_an_older_record_loads_and_unknown_keys_are_ignored() -> None:
    text = json.dumps(
        {
            "name": "old",
            "backend": "kubernetes",
            "num_nodes": 1,
            "owner_pid": 5,
            "owner_start_time": 7,
            "status": "PROVISIONING",
            "resources": {"accelerators": None, "gpus_per_node": 0, "retired_key": 1},
            "a_field_from_the_future": True,
        }
    )
    record = ClusterRecord.from_json(text)
    assert record.status is ClusterStatus.PROVISIONING
    assert record.resources == ClusterResources()
    assert f"{record.status}" == "PROVISIONING"
