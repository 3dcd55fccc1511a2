"""The Kubernetes backend's journal: its JSON form, old journals, and what the plugin may ask of it."""

from __future__ import annotations

from pathlib import Path

from pytest_sky.backends.kube_journal import KubeRecord
from pytest_sky.backends.kubernetes import KubernetesBackend
from pytest_sky.backends.local import LocalBackend
from pytest_sky.state import Journal


def test_a_record_round_trips_through_its_json_form(tmp_path: Path) -> None:
    record = KubeRecord(
        context="ctx",
        namespace="ns",
        kubeconfig="/k",
        image="img:1",
        launch="abc",
        pods=("c-head", "c-worker1"),
        shared_dir="/shared",
        pod_specs=({"kind": "Pod"},),
    )
    assert KubeRecord.from_json(record.to_json()) == record
    journal = Journal(tmp_path / "backend.json")
    record.save(journal)
    assert KubeRecord.load(journal) == record


def test_a_journal_from_an_older_pytest_sky_reads() -> None:
    """No launch id and no pod specs: ownership falls back to labels, restart says relaunch."""
    old = {"context": "ctx", "namespace": "ns", "kubeconfig": None, "image": "img", "pods": ["c-head"]}
    record = KubeRecord.from_json(old)
    assert record.launch is None and record.pod_specs == () and record.pods == ("c-head",)
    assert KubeRecord.from_json({}) == KubeRecord()


def test_the_node_image_comes_from_the_backend_not_its_journal_keys(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "backend.json")
    KubeRecord(image="img:2", pods=("c-head",)).save(journal)
    assert KubernetesBackend().node_image(journal) == "img:2"
    assert KubernetesBackend().node_image(Journal(tmp_path / "none.json")) == "(not recorded)"
    assert LocalBackend().node_image(journal) is None
