"""The suite's own in-process pytest runs (pytester) leave the process they run in usable:
what a later test imports is the same module an earlier inner run imported."""

from __future__ import annotations

import importlib

import pytest


def test_a_kubernetes_model_first_used_in_an_inner_run_is_the_same_class_afterwards(pytester: pytest.Pytester):
    pytest.importorskip("kubernetes", reason="pip install kubernetes")
    from kubernetes import client

    # A model nothing else in the suite uses, so the inner run is where it is first imported.
    name, module = "V1FlockerVolumeSource", "kubernetes.client.models.v1_flocker_volume_source"
    pytester.makepyfile(
        f"""
        def test_uses_a_model():
            from kubernetes import client
            assert client.{name}(dataset_name="x").dataset_name == "x"
        """
    )
    pytester.runpytest_inprocess("-p", "no:sky").assert_outcomes(passed=1)
    assert getattr(client, name) is getattr(importlib.import_module(module), name)
