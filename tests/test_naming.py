"""Node names (``pytest_sky.naming``): SkyPilot's, which users type and grep for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pytest_sky import cluster_names, naming
from pytest_sky.backends import kube_manifests
from pytest_sky.errors import TaskError


def test_names_roles_and_hostnames() -> None:
    assert [naming.node_name(r) for r in range(3)] == ["head", "worker1", "worker2"]
    assert [naming.role(r) for r in range(3)] == ["head", "worker", "worker"]
    assert naming.node_hostname("c", 0) == "c-head"
    assert naming.node_hostname("my-cluster", 12) == "my-cluster-worker12"


def test_generated_cluster_names_are_distinct_and_keep_their_whole_token() -> None:
    """Two pipelines in one namespace must not meet: 48 random bits in every generated name,
    whole even where a long label has to be cut for the pods' DNS-label names."""
    long_label = cluster_names.slug("test_a_very_long_test_name_that_goes_on_and_on[param-1-2-3]", 18)
    names = [cluster_names.generate(long_label, "gw12", "7") for _ in range(10_000)]
    assert len(set(names)) == 10_000
    tokens = set()
    for name in names:
        prefix, _, token = name.rpartition("-")
        assert len(token) == 2 * cluster_names.TOKEN_BYTES == 12 and int(token, 16) >= 0, name
        assert prefix.startswith("sky-a-very-long") and cluster_names.validate(name) == name
        assert len(kube_manifests.pod_name(name, 99)) <= 63  # a DNS label, as a pod's hostname is
        tokens.add(token)
    assert len(tokens) == 10_000
    assert cluster_names.generate().startswith("sky-") and len(cluster_names.generate()) == 16


@pytest.mark.parametrize("bad", ["", "Sky", "-a", "a-", "a" * 41, "a_b", "1abc"])
def test_a_name_the_user_gives_is_held_to_what_hostnames_and_objects_take(bad: str) -> None:
    with pytest.raises(TaskError, match="invalid cluster name"):
        cluster_names.validate(bad)


def test_pods_are_named_and_labelled_from_it() -> None:
    assert kube_manifests.pod_name("demo", 0) == "demo-head"
    assert kube_manifests.pod_name("demo", 3) == "demo-worker3"
    assert kube_manifests.labels("demo", 0)[kube_manifests.LABEL_ROLE] == "head"
    assert kube_manifests.labels("demo", 3)[kube_manifests.LABEL_ROLE] == "worker"


@pytest.mark.parametrize(
    ("text", "rank"),
    [
        (None, 0),
        ("", 0),
        ("head", 0),
        ("0", 0),
        ("1", 1),
        ("3", 3),
        ("worker3", 3),
        ("worker1", 1),
        ("4", None),  # beyond the cluster
        ("worker4", None),
        ("worker0", None),  # the head is not a worker
        ("00", None),
        ("worker", None),
        ("-1", None),
        ("+2", None),
        ("²", None),  # a digit to str.isdigit, not to int()
        ("head1", None),
        ("Worker2", None),
        (" 2", None),
    ],
)
def test_parse_node(text: str | None, rank: int | None) -> None:
    assert naming.parse_node(text, 4) == rank


def test_a_one_node_cluster_has_only_the_head() -> None:
    assert naming.parse_node("head", 1) == 0
    assert naming.parse_node("1", 1) is None and naming.parse_node("worker1", 1) is None


def test_line_prefixes_are_skypilots() -> None:
    assert naming.line_prefix(0, "head", 41, "10.0.0.1", 1, "train") == "(train, pid=41) "
    assert naming.line_prefix(0, "head", 41, "10.0.0.1", 3, "train") == "(head, rank=0, pid=41) "
    assert naming.line_prefix(2, "worker2", 7, "10.0.0.3", 3, "train") == "(worker2, rank=2, pid=7, ip=10.0.0.3) "
    # Setup's lines, as sky's: the head's without an address, a worker's with it.
    assert naming.line_prefix(0, "head", 41, "10.0.0.1", 3, "train", setup=True) == "(setup pid=41) "
    assert naming.line_prefix(2, "worker2", 7, "10.0.0.3", 3, "train", setup=True) == "(setup pid=7, ip=10.0.0.3) "
    assert naming.line_prefix(0, "head", 41, "10.0.0.1", 1, "train", setup=True) == "(setup pid=41) "


def test_import_costs_nothing_for_the_agent() -> None:
    """Shipped in the agent, run as ``python -I -S``: no imports at all."""
    code = (
        "import sys; before = set(sys.modules)\n"
        f"sys.path.insert(0, {str(Path(naming.__file__).parent)!r})\n"
        "import naming\n"
        "print(*sorted(set(sys.modules) - before - {'naming', '__future__'}))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == []
