"""A cluster's lifetime is held by the cluster, not by the runner's disk (issue 48).

A CI runner that vanishes mid-test (its pytest SIGKILLed, its state directory gone with its
VM) leaves pods behind.  These tests make that happen for real, on the emulator, in a
namespace of their own (any --kubernetes session reaps the namespace it uses, so other
modules' sessions on the shared emulator must not reap these clusters first):

- ``pytest-sky down --stale --kubernetes`` from a fresh state directory, once the lease has
  expired, removes every object of the vanished runner's cluster, and leaves a live cluster
  of a concurrent session, a kept one and someone else's pod wearing the cluster's labels
  alone; so does any later ``pytest --kubernetes`` session, before its first cluster;
- a pod whose owner never returns ends by its deadline (``--kube-max-lifetime``), Failed
  with reason DeadlineExceeded, even while its lease still stands.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky import bootstrap
from pytest_sky.backends import kube_manifests as manifests
from pytest_sky.backends.kube_journal import KubeRecord
from pytest_sky.backends.kubernetes import KubernetesBackend
from pytest_sky.state import Journal

pytest.importorskip("kubernetes", reason="pip install kubernetes")
pytest.importorskip("aiohttp", reason="the emulator needs aiohttp")

from kubernetes import client

from kube_emulator import Emulator
from tests.leftovers import processes_mentioning

NS = "lease-test"
SCRIPT = str(Path(sys.executable).with_name("pytest-sky"))
#: The test a runner was in when it vanished: it says its cluster's name, then waits.
HOLDING = """
import pathlib, time
import pytest

@pytest.mark.multinode(num_nodes=2)
def test_holds_a_cluster(sky_cluster):
    pathlib.Path({mark!r}).write_text(sky_cluster.name)
    time.sleep(600)
"""


def _until(check: Callable[[], object], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.fixture(scope="module")
def namespace(emu: Emulator) -> Iterator[str]:
    core = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
    core.create_namespace({"metadata": {"name": NS}})
    yield NS
    core.delete_namespace(NS)


def _objects(emu: Emulator, cluster: str) -> list[str]:
    """Every pod, secret, service and lease of ``cluster`` in the test's namespace."""
    core = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
    sel = manifests.selector(cluster)
    found = [f"pod {p.metadata.name}" for p in core.list_namespaced_pod(NS, label_selector=sel).items]
    found += [f"secret {s.metadata.name}" for s in core.list_namespaced_secret(NS, label_selector=sel).items]
    found += [f"service {s.metadata.name}" for s in core.list_namespaced_service(NS, label_selector=sel).items]
    leases = client.CoordinationV1Api(core.api_client).list_namespaced_lease(NS, label_selector=sel).items
    return found + [f"lease {x.metadata.name}" for x in leases]


def _env(emu: Emulator, home: Path, **settings: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTEST_SKY_HOME": str(home),
        "KUBECONFIG": str(emu.kubeconfig_path),
        "PYTEST_SKY_KUBE_NAMESPACE": NS,
        "CI": "1",
        **settings,
    }


def _vanish(tmp_path: Path, emu: Emulator, label: str, **settings: str) -> str:
    """A pytest --kubernetes session that launched a cluster, then was SIGKILLed with its state
    directory deleted, as a CI VM that disappeared: its cluster's name."""
    home, mark = tmp_path / f"{label}-home", tmp_path / f"{label}.name"
    test = tmp_path / f"test_{label}.py"
    test.write_text(HOLDING.format(mark=str(mark)))
    session = subprocess.Popen(
        [sys.executable, "-m", "pytest", "--kubernetes", "-p", "no:cacheprovider", "-q", str(test)],
        env=_env(emu, home, **settings),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _until(lambda: mark.exists() or session.poll() is not None, "the session never held its cluster")
        assert session.poll() is None, "the session ended before it held its cluster"
    finally:
        os.killpg(session.pid, signal.SIGKILL)  # the runner and its ssh masters, at once
        session.wait()
    # Its /tmp goes with the VM: the sockets its journal names (its forwarder's, which died
    # with it), as this machine's reaper would remove them only once they are old.
    for journal in home.glob("clusters/*/backend.json"):
        forwarder = KubeRecord.load(Journal(journal)).forwarder
        if forwarder is not None:
            assert bootstrap.remove_if_stale(forwarder.socket) or not os.path.exists(forwarder.socket)
    shutil.rmtree(home)
    return mark.read_text()


def _sky(emu: Emulator, home: Path, *args: str, **settings: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SCRIPT, *args], capture_output=True, text=True, env=_env(emu, home, **settings), timeout=300, check=False
    )


@pytest.mark.long(40)
def test_a_vanished_runners_cluster_is_reaped_from_anywhere_and_nothing_else(
    tmp_path: Path, emu: Emulator, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_SKY_HOME", str(tmp_path / "concurrent"))
    # A concurrent session's cluster, its lease renewed all along by this process (a length
    # of its own: a live lease is one renewed in time, however long).
    options = {"kubeconfig": str(emu.kubeconfig_path), "namespace": NS, "lease_seconds": 30}
    live = pytest_sky.launch(num_nodes=1, name="lease-live", backend="kubernetes", backend_options=options)
    kept_home = tmp_path / "kept"
    launched = _sky(emu, kept_home, "launch", "-c", "lease-kept", "--kubernetes", PYTEST_SKY_KUBE_LEASE_SECONDS="3")
    assert launched.returncode == 0, launched.stdout + launched.stderr
    try:
        victim = _vanish(tmp_path, emu, "vanished", PYTEST_SKY_KUBE_LEASE_SECONDS="3")
        assert len(_objects(emu, victim)) == 5  # two pods, its Secret, Service and Lease
        leases = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path), namespace=NS)
        holds = {h.name: h for h in leases.held_clusters()}
        assert re.fullmatch(r".+ pid \d+", holds[victim].holder) and not holds[victim].kept, holds[victim]
        assert holds["lease-kept"].kept and not holds["lease-live"].kept
        _until(lambda: {h.name: h for h in leases.held_clusters()}[victim].expired, "the lease never expired")
        # Someone else's pod wearing the victim's labels, but not owned by its lease: not ours.
        core = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
        head = core.read_namespaced_pod(f"{victim}-head", NS)
        impostor = {
            "metadata": {"name": f"{victim}-impostor", "labels": head.metadata.labels},
            "spec": {
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "app", "image": "python:3.11-slim", "command": ["sleep", "600"]}],
            },
        }
        impostor_uid = core.create_namespaced_pod(NS, impostor).metadata.uid
        fresh = tmp_path / "fresh"  # another machine's, or a later job's, state directory
        status = _sky(emu, fresh, "status", "--kubernetes")
        assert victim in status.stdout and "STALE (owner gone)" in status.stdout, status.stdout
        assert "lease-kept" in status.stdout and "kept" in status.stdout, status.stdout
        doctor = _sky(emu, fresh, "doctor", "--kubernetes")
        assert doctor.returncode == 1 and victim in doctor.stdout, doctor.stdout + doctor.stderr
        assert "`pytest-sky down --stale` with the same flags removes them" in doctor.stderr, doctor.stderr
        reaped = _sky(emu, fresh, "down", "--stale", "--kubernetes", "--kube-namespace", NS)
        assert reaped.returncode == 0, reaped.stdout + reaped.stderr
        assert f"{victim}: down (its owner is gone)" in reaped.stdout, reaped.stdout
        assert _objects(emu, victim) == [f"pod {victim}-impostor"]
        assert core.read_namespaced_pod(f"{victim}-impostor", NS).metadata.uid == impostor_uid
        core.delete_namespaced_pod(f"{victim}-impostor", NS)
        # The concurrent session's cluster, renewed all along, and the kept one, older than
        # its lease and renewed by nobody, are untouched and work.
        assert len(_objects(emu, "lease-live")) == 4 and live.run("hostname").returncode == 0
        assert len(_objects(emu, "lease-kept")) == 4
        assert _sky(emu, kept_home, "exec", "lease-kept", "--", "true").returncode == 0
        again = _sky(emu, fresh, "down", "--stale", "--kubernetes")
        assert "no stale clusters (kubernetes)" in again.stdout, again.stdout
        # Any later --kubernetes session reaps too, before its first cluster.
        second = _vanish(tmp_path, emu, "vanished2", PYTEST_SKY_KUBE_LEASE_SECONDS="3")
        _until(lambda: {h.name: h for h in leases.held_clusters()}[second].expired, "the lease never expired")
        later = tmp_path / "test_later.py"
        later.write_text("import pytest\n\n@pytest.mark.multinode(num_nodes=1)\ndef test_one(sky_cluster):\n    pass\n")
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "--kubernetes", "-p", "no:cacheprovider", "-q", "-rw", str(later)],
            env=_env(emu, tmp_path / "later-home"),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert f"reaped 1 cluster(s) left by a killed run: {second}" in run.stdout, run.stdout
        assert _objects(emu, second) == []
        assert len(_objects(emu, "lease-live")) == 4 and len(_objects(emu, "lease-kept")) == 4
    finally:
        live.down()
        down = _sky(emu, kept_home, "down", "lease-kept")
        assert down.returncode == 0, down.stdout + down.stderr
    assert _objects(emu, "lease-live") == [] and _objects(emu, "lease-kept") == [], down.stdout + down.stderr
    assert processes_mentioning(str(tmp_path)) == []


#: A test body that holds the interpreter as hard as Python code can, for ``seconds``.
BUSY = """
import pathlib, time
import pytest

@pytest.mark.multinode(num_nodes=1)
def test_busy(sky_cluster):
    pathlib.Path({mark!r}).write_text(sky_cluster.name)
    end = time.monotonic() + {seconds}
    while time.monotonic() < end:
        sum(i * i for i in range(10_000))
    pathlib.Path({mark!r} + ".done").write_text("")
"""


def test_the_owner_renews_its_lease_whatever_the_test_body_does(tmp_path: Path, emu: Emulator, namespace: str) -> None:
    """A 6 s lease outlives a test body that computes for three times as long: renewed by a
    thread of the owning process, four times per lease, it is never once seen expired."""
    mark, test = tmp_path / "busy.name", tmp_path / "test_busy.py"
    test.write_text(BUSY.format(mark=str(mark), seconds=18))
    session = subprocess.Popen(
        [sys.executable, "-m", "pytest", "--kubernetes", "-p", "no:cacheprovider", "-q", str(test)],
        env=_env(emu, tmp_path / "busy-home", PYTEST_SKY_KUBE_LEASE_SECONDS="6"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    leases = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path), namespace=NS)
    _until(lambda: mark.exists() or session.poll() is not None, "the session never held its cluster")
    name, seen = mark.read_text(), 0
    while not Path(str(mark) + ".done").exists() and session.poll() is None:
        (hold,) = [h for h in leases.held_clusters() if h.name == name]
        assert not hold.expired and hold.renewed_s is not None and hold.renewed_s < 6, hold
        seen += 1
        time.sleep(0.2)
    out, _ = session.communicate(timeout=300)
    assert session.returncode == 0, out
    assert seen > 30 and _objects(emu, name) == []


@pytest.mark.long(50)
def test_a_pod_whose_owner_never_returns_ends_by_its_deadline(tmp_path: Path, emu: Emulator, namespace: str) -> None:
    """A lease far too long to expire, and nobody to reap: the pods' own deadline ends them."""
    victim = _vanish(tmp_path, emu, "deadline", PYTEST_SKY_KUBE_LEASE_SECONDS="3600", PYTEST_SKY_KUBE_MAX_LIFETIME="45")
    core = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
    pods = core.list_namespaced_pod(NS, label_selector=manifests.selector(victim)).items
    assert [p.spec.active_deadline_seconds for p in pods] == [45, 45]

    def ended() -> bool:
        pods = core.list_namespaced_pod(NS, label_selector=manifests.selector(victim)).items
        return all(p.status.phase == "Failed" and p.status.reason == "DeadlineExceeded" for p in pods)

    _until(ended, "the pods outlived their deadline", timeout=120)
    assert [p for p in emu.pods_info() if p.startswith(f"{NS}/{victim}")] == []  # no container runs
    # Its lease is the owner of the rest: deleting it lets the garbage collector take them.
    client.CoordinationV1Api(core.api_client).delete_namespaced_lease(victim, NS)
    _until(lambda: _objects(emu, victim) == [], "the lease's dependents were not collected")
    assert processes_mentioning(str(tmp_path)) == []
