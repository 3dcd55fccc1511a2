"""The Kubernetes backend owns only what one launch creates (issue 12, item 1).

Every object a launch makes carries its launch id (``pytest-sky/launch``); waiting,
teardown and the cleanup of a failed launch look only at those, one by one by name.  Each
test here stands for a user of a shared namespace: a Service of theirs named like our
cluster, a teammate's same-named cluster, a pod of someone else's wearing our cluster label,
and records whose API server is gone.  All against the emulator, through the backend and the
CLI as a user runs them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky.backends import kube_manifests as manifests
from pytest_sky.backends.kubernetes import KubernetesBackend

pytest.importorskip("kubernetes", reason="pip install kubernetes")
pytest.importorskip("aiohttp", reason="the emulator needs aiohttp")

from kube_emulator import Emulator

SCRIPT = str(Path(sys.executable).with_name("pytest-sky"))
NS = "default"
#: Every (verb, resource) the backend may use: what examples/kubernetes/rbac.yaml grants.
ALLOWED = {
    *{(v, "pods") for v in ("create", "get", "list", "watch", "delete")},
    *{(v, "secrets") for v in ("create", "delete")},
    *{(v, "services") for v in ("create", "get", "delete")},
    *{(v, "leases") for v in ("create", "get", "list", "update", "patch", "delete")},
    *{(v, r) for v in ("create", "get") for r in ("pods/exec", "pods/portforward")},
    ("get", "pods/log"),
    ("list", "events"),
    ("get", "persistentvolumeclaims"),
    ("get", "namespaces"),
}


def api(emu: Emulator):
    return KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()


def sky(home: Path, kubeconfig: Path | str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTEST_SKY_HOME": str(home), "KUBECONFIG": str(kubeconfig), "CI": "1"}
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False)


def launch(emu: Emulator, name: str, num_nodes: int = 2) -> pytest_sky.Cluster:
    options = {"kubeconfig": str(emu.kubeconfig_path), "ready_timeout": 180}
    return pytest_sky.launch(num_nodes=num_nodes, name=name, backend="kubernetes", backend_options=options)


def ours(emu: Emulator, cluster: str) -> list[str]:
    """Every pod, secret and service labelled with the cluster's name."""
    k = api(emu)
    sel = manifests.selector(cluster)
    left = [f"pod {p.metadata.name}" for p in k.list_namespaced_pod(NS, label_selector=sel).items]
    left += [f"secret {s.metadata.name}" for s in k.list_namespaced_secret(NS, label_selector=sel).items]
    left += [f"service {s.metadata.name}" for s in k.list_namespaced_service(NS, label_selector=sel).items]
    from kubernetes import client

    leases = client.CoordinationV1Api(k.api_client).list_namespaced_lease(NS, label_selector=sel).items
    left += [f"lease {lease.metadata.name}" for lease in leases]
    return left


def error_lines(run: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in run.stderr, run.stderr
    return [line for line in run.stderr.splitlines() if " error: " in line]


def foreign_pod(emu: Emulator, name: str, labels: dict[str, str]) -> str:
    """A pod of someone else's (``sleep``), running; returns its uid."""
    from kubernetes import watch

    k = api(emu)
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "app", "image": "python:3.11-slim", "command": ["sleep", "3600"]}],
        },
    }
    uid = k.create_namespaced_pod(NS, body).metadata.uid
    w = watch.Watch()
    for event in w.stream(k.list_namespaced_pod, NS, field_selector=f"metadata.name={name}", timeout_seconds=120):
        if event["object"].status.phase == "Running":
            w.stop()
            return uid
    raise AssertionError(f"the foreign pod {name} never ran")


def test_a_users_service_named_like_the_cluster_survives_the_collision(home: Path, emu: Emulator):
    k = api(emu)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "k8s-api"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]},
    }
    uid = k.create_namespaced_service(NS, service).metadata.uid
    try:
        run = sky(home, emu.kubeconfig_path, "launch", "-c", "k8s-api", "--kubernetes", "--", "true")
        assert run.returncode == 2, run.stdout + run.stderr
        (line,) = error_lines(run)
        assert "a Service named 'k8s-api' already exists in namespace 'default'" in line, line
        assert "pick another cluster name (-c NAME)" in line, line
        # The user's Service is untouched; what the launch made before the 409 is gone.
        assert k.read_namespaced_service("k8s-api", NS).metadata.uid == uid
        assert ours(emu, "k8s-api") == []
        assert not (home / "clusters" / "k8s-api").exists()
    finally:
        k.delete_namespaced_service("k8s-api", NS)


def test_a_generated_name_that_is_taken_is_drawn_again(home: Path, emu: Emulator, monkeypatch):
    """A 409 on a name the launch generated is a new name, not a failed launch; the object
    that took the name is left alone, and nothing of the first attempt stays."""
    from pytest_sky import cluster_names

    real, tokens = cluster_names.token, iter(["000000000000"])
    monkeypatch.setattr(cluster_names, "token", lambda: next(tokens, None) or real())
    taken = "sky-collide-000000000000"
    k = api(emu)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": taken}, "spec": {"ports": [{"port": 80}]}}
    uid = k.create_namespaced_service(NS, service).metadata.uid
    try:
        options = {"kubeconfig": str(emu.kubeconfig_path)}
        with pytest_sky.launch(num_nodes=1, name_label="collide", backend="kubernetes", backend_options=options) as c:
            assert c.name != taken and c.name.startswith("sky-collide-") and len(c.name.rpartition("-")[2]) == 12
            assert c.run("hostname").ranks[0].stdout.strip() == f"{c.name}-head"
            assert ours(emu, taken) == []  # the first attempt's objects went
        assert k.read_namespaced_service(taken, NS).metadata.uid == uid
        assert ours(emu, c.name) == []
    finally:
        k.delete_namespaced_service(taken, NS)


def test_a_same_named_foreign_pod_survives_a_collision_and_the_cleanup(home: Path, emu: Emulator):
    """A leftover worker of a teammate's same-named cluster: it even carries the cluster label."""
    labels = {**manifests.MANAGED_BY, manifests.LABEL_CLUSTER: "k8s-twin"}
    uid = foreign_pod(emu, "k8s-twin-worker1", labels)
    k = api(emu)
    try:
        run = sky(home, emu.kubeconfig_path, "launch", "-c", "k8s-twin", "--kubernetes", "--num-nodes", "2")
        assert run.returncode == 2, run.stdout + run.stderr
        (line,) = error_lines(run)
        assert "a Pod named 'k8s-twin-worker1' already exists in namespace 'default'" in line, line
        pod = k.read_namespaced_pod("k8s-twin-worker1", NS)
        assert pod.metadata.uid == uid and pod.metadata.deletion_timestamp is None
        # This launch's Secret, Service and head went; the foreign pod is all that is left.
        assert ours(emu, "k8s-twin") == ["pod k8s-twin-worker1"]
    finally:
        k.delete_namespaced_pod("k8s-twin-worker1", NS)


def test_a_teammates_cluster_of_the_same_name_is_not_wiped(home: Path, emu: Emulator, tmp_path: Path):
    with launch(emu, "k8s-team") as theirs:
        before = {
            p.metadata.name: p.metadata.uid
            for p in api(emu).list_namespaced_pod(NS, label_selector=manifests.selector("k8s-team")).items
        }
        run = sky(tmp_path / "my-state", emu.kubeconfig_path, "launch", "-c", "k8s-team", "--kubernetes")
        assert run.returncode == 2, run.stdout + run.stderr
        (line,) = error_lines(run)
        assert "a Lease named 'k8s-team' already exists" in line, line  # the first object a launch makes
        after = {
            p.metadata.name: p.metadata.uid
            for p in api(emu).list_namespaced_pod(NS, label_selector=manifests.selector("k8s-team")).items
        }
        assert after == before
        assert theirs.run("hostname").returncode == 0
    assert ours(emu, "k8s-team") == []


def test_a_foreign_pod_with_our_cluster_label_does_not_disturb_a_launch(home: Path, emu: Emulator):
    labels = {**manifests.MANAGED_BY, manifests.LABEL_CLUSTER: "k8s-mixed", manifests.LABEL_ROLE: "worker"}
    uid = foreign_pod(emu, "k8s-mixed-theirs", labels)
    k = api(emu)
    try:
        with launch(emu, "k8s-mixed") as c:
            res = c.run("hostname")
            assert [r.stdout.strip() for r in res.ranks] == ["k8s-mixed-head", "k8s-mixed-worker1"], res.output
            service = k.read_namespaced_service("k8s-mixed", NS)
            assert service.spec.selector[manifests.LABEL_LAUNCH], service.spec.selector
        pod = k.read_namespaced_pod("k8s-mixed-theirs", NS)
        assert pod.metadata.uid == uid and pod.metadata.deletion_timestamp is None
        assert ours(emu, "k8s-mixed") == ["pod k8s-mixed-theirs"]
    finally:
        k.delete_namespaced_pod("k8s-mixed-theirs", NS)


def test_teardown_deletes_each_object_by_name_with_a_grace_period_and_waits(home: Path, emu: Emulator):
    asked, deleted = len(emu.decisions()), len(emu.deletions())
    with launch(emu, "k8s-verbs"):
        pass
    decisions = [d.request for d in emu.decisions()[asked:] if d.request.user == "admin"]
    deletes = [d for d in emu.deletions()[deleted:] if d.user == "admin"]
    assert ours(emu, "k8s-verbs") == []  # gone, not terminating, once down returns
    used = {(r.verb, f"{r.resource}/{r.subresource}" if r.subresource else r.resource) for r in decisions}
    assert not {v for v in used if v[0] == "deletecollection"}, used
    assert used <= ALLOWED, used - ALLOWED
    assert [(d.resource, d.name) for d in deletes] == [  # the Lease, the owner of the rest, last
        ("pods", "k8s-verbs-head"),
        ("pods", "k8s-verbs-worker1"),
        ("secrets", "k8s-verbs-ssh"),
        ("services", "k8s-verbs"),
        ("leases", "k8s-verbs"),
    ]
    for d in deletes:
        assert d.options.get("preconditions", {}).get("uid"), d
        assert d.options.get("gracePeriodSeconds") != 0, d  # 0 is a force delete
    assert not [r for r in decisions if r.resource == "secrets" and r.verb in ("get", "list", "watch")]


@pytest.mark.long(8)
def test_down_purge_forgets_records_whose_api_server_is_gone(home: Path, tmp_path: Path):
    """One record's kubeconfig is gone with its API server, the other's still names the dead
    server: ``down`` says ``--purge`` exists; ``down --purge`` forgets and says what is left."""
    kept = tmp_path / "kubeconfig"
    with Emulator(nodes=1) as gone:
        shutil.copy(gone.kubeconfig_path, kept)
        for name, config in (("k8s-gone-a", kept), ("k8s-gone-b", gone.kubeconfig_path)):
            # Launched here, not by the CLI: what is tested is the CLI's down, and a CLI
            # process with the Kubernetes client to import cost this test seconds of CPU.
            options = {"kubeconfig": str(config), "ready_timeout": 180}
            pytest_sky.launch(num_nodes=1, name=name, backend="kubernetes", backend_options=options)
        missing_config = gone.kubeconfig_path
    assert not missing_config.exists()

    run = sky(home, kept, "down", "--all")
    assert run.returncode == 2, run.stdout + run.stderr
    lines = error_lines(run)
    assert any(line.split(" error: ")[1].startswith("k8s-gone-a: cannot reach the API server") for line in lines), lines
    assert any("k8s-gone-b: no Kubernetes configuration" in line for line in lines), lines
    assert "pytest-sky down --purge k8s-gone-a k8s-gone-b" in lines[-1], lines
    status = sky(home, kept, "status").stdout
    assert "k8s-gone-a" in status and "k8s-gone-b" in status

    run = sky(home, kept, "down", "--purge", "k8s-gone-a")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "k8s-gone-a: purged" in run.stdout
    (line,) = error_lines(run)
    assert "kube context 'kube-emulator', namespace 'default'" in line, line
    assert "lease/k8s-gone-a pod/k8s-gone-a-head secret/k8s-gone-a-ssh service/k8s-gone-a" in line, line
    assert f"-l {manifests.LABEL_LAUNCH}=" in line, line

    run = sky(home, kept, "down", "--all", "--purge")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "k8s-gone-b: purged" in run.stdout and "no Kubernetes configuration" in run.stderr
    assert sky(home, kept, "status").stdout.strip() == "No existing clusters."


def test_a_record_from_before_launch_ids_is_torn_down_by_name_and_label(home: Path, emu: Emulator):
    """A journal without a launch id (written by an older pytest-sky): teardown takes the
    objects named as the cluster's that carry its label, and nothing else of that name."""
    import json

    k = api(emu)
    c = launch(emu, "k8s-legacy")
    journal = home / "clusters" / "k8s-legacy" / "backend.json"
    data = json.loads(journal.read_text())
    data.pop("launch", None)
    journal.write_text(json.dumps(data))
    # The Service of that name is now someone else's (unlabelled), made after ours went.
    k.delete_namespaced_service("k8s-legacy", NS)
    body = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "k8s-legacy"},
        "spec": {"ports": [{"port": 80}]},
    }
    uid = k.create_namespaced_service(NS, body).metadata.uid
    try:
        c.down()
        assert ours(emu, "k8s-legacy") == []
        assert k.read_namespaced_service("k8s-legacy", NS).metadata.uid == uid
    finally:
        k.delete_namespaced_service("k8s-legacy", NS)


def test_the_purge_hints_kubectl_command_removes_what_was_left(home: Path, emu: Emulator, tmp_path: Path):
    """``down --purge`` of a cluster whose kubeconfig is gone prints the kubectl command that
    removes its objects; run as printed (with the kubeconfig back), it removes exactly them."""
    from tests.kube_helpers import KUBECTL, NO_KUBECTL, run_kubectl

    if KUBECTL is None:
        pytest.skip(NO_KUBECTL)
    config = tmp_path / "kubeconfig"
    shutil.copy(emu.kubeconfig_path, config)
    run = sky(home, config, "launch", "-c", "k8s-hint", "--kubernetes", "--num-nodes", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    config.unlink()
    run = sky(home, config, "down", "--purge", "k8s-hint")
    assert run.returncode == 0, run.stdout + run.stderr
    (line,) = error_lines(run)
    command = line.split("`")[-2]  # the last one: the earlier names the missing kubeconfig's fix
    assert command.startswith("kubectl --context kube-emulator delete lease,pod,secret,service -n default -l "), line
    assert len(ours(emu, "k8s-hint")) == 5  # two pods, the secret, the service, the lease
    done = run_kubectl(emu.kubeconfig_path, *command.split()[1:], context=None)  # the context is in it
    assert done.returncode == 0, done.stdout + done.stderr
    assert ours(emu, "k8s-hint") == []
