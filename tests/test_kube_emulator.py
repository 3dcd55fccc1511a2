"""The Kubernetes API emulator, driven only through the official client, as the backend drives it.

Pods here run real processes in namespace nodes (root needed, like the local backend's
tests); every test checks through the API what a backend would see, and that what the
emulator started is gone afterwards.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from pytest_sky import procs
from pytest_sky.backends.confine import CAPABILITY_BITS

kubernetes = pytest.importorskip("kubernetes")
pytest.importorskip("aiohttp")

from kubernetes import client, watch  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402
from kubernetes.stream import stream, ws_client  # noqa: E402

from kube_emulator import Emulator  # noqa: E402
from kube_emulator.scheduler import node_view, parse_quantity, schedule  # noqa: E402
from kube_emulator.selectors import SelectorError, parse_label_selector  # noqa: E402
from pytest_sky.backends import netns  # noqa: E402
from pytest_sky.ssh import kube_proxy  # noqa: E402
from tests.kube_helpers import (  # noqa: E402
    api,
    delete_and_wait,
    events,
    leftovers,
    needs_root,
    pod_manifest,
    run,
    running,
    unschedulable,
    wait_for,
    waiting_reason,
)

REPO = Path(__file__).resolve().parent.parent


# A tiny TCP server on port 22 standing in for sshd: a banner, then it echoes upper-cased.
ECHO_SERVER = """
import socket, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 22))
s.listen(64)
def serve(c):
    c.sendall(b"SSH-2.0-echo\\r\\n")
    while True:
        d = c.recv(65536)
        if not d:
            break
        c.sendall(d.upper())
    c.close()
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def forward(v1: client.CoreV1Api, pod: str, port: int = 22) -> socket.socket:
    pf = kube_proxy.open_forward(v1.api_client.configuration, "default", pod, port)  # sturdy when a drop resets it
    sock = pf.socket
    sock.settimeout(10)
    return sock


def banner(v1: client.CoreV1Api, pod: str) -> socket.socket:
    """A port-forward to the pod's port 22 that has seen the banner (the server may still be starting)."""
    deadline = time.monotonic() + 10
    while True:
        sock = forward(v1, pod)
        data = sock.recv(100)
        if data.startswith(b"SSH-2.0-echo"):
            return sock
        sock.close()
        assert time.monotonic() < deadline, "no banner through the port-forward"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def emu(start_emulator: Callable[..., Emulator]) -> Emulator:
    """Nodes with a GPU each, for the scheduling tests."""
    return start_emulator(nodes=3, gpus_per_node=1)


@pytest.fixture(scope="module")
def v1(emu: Emulator) -> client.CoreV1Api:
    return api(emu.kubeconfig_path)


@needs_root
def test_pods_with_secret_service_exec_portforward_and_delete(emu: Emulator, v1: client.CoreV1Api) -> None:
    labels = {"app": "pair"}
    v1.create_namespaced_secret(
        "default", {"metadata": {"name": "pair-keys", "labels": labels}, "stringData": {"id_key": "secret-bytes"}}
    )
    v1.create_namespaced_service(
        "default",
        {"metadata": {"name": "pair", "labels": labels}, "spec": {"clusterIP": "None", "selector": labels}},
    )
    command = ["python3", "-c", ECHO_SERVER]
    for name in ("pair-head", "pair-worker1"):
        v1.create_namespaced_pod(
            "default", pod_manifest(name, labels, command=command, subdomain="pair", secret="pair-keys")
        )
    pods = wait_for(v1, "app=pair", running, 2)
    nodes = {p["spec"]["nodeName"] for p in pods.values()}
    assert len(nodes) == 2, "preferred anti-affinity spreads pods over 3 emulated nodes"
    head = v1.read_namespaced_pod("pair-head", "default")
    assert head.status.pod_ip.startswith("198.1")
    assert head.status.container_statuses[0].ready and head.status.container_statuses[0].state.running
    assert {c.type for c in head.status.conditions if c.status == "True"} >= {"PodScheduled", "Ready"}

    assert run(v1, "pair-head", ["hostname"]) == (0, "pair-head\n")
    assert run(v1, "pair-head", ["cat", "/run/sky-keys/id_key"]) == (0, "secret-bytes")
    rc, out = run(v1, "pair-head", ["stat", "-c", "%a", "/run/sky-keys/id_key"])
    assert (rc, out.strip()) == (0, "600")
    assert run(v1, "pair-head", ["sh", "-c", "echo out; echo err >&2; exit 3"]) == (3, "out\nerr\n")
    worker_ip = v1.read_namespaced_pod("pair-worker1", "default").status.pod_ip
    for alias in ("pair-worker1.pair", "pair-worker1.pair.default.svc.cluster.local"):
        rc, out = run(v1, "pair-head", ["getent", "ahostsv4", alias])
        assert rc == 0 and out.split()[0] == worker_ip, (alias, out)
    rc, out = run(v1, "pair-head", ["sh", "-c", 'echo "$HOME"; ls -d ~'])
    assert rc == 0 and out.split()[0] == out.split()[1] and out.split()[0] == netns.NODE_HOME

    sock = banner(v1, "pair-worker1")
    sock.sendall(b"hello through the api server")
    assert sock.recv(100) == b"HELLO THROUGH THE API SERVER"
    sock.close()

    assert "Started container main" in [m for _, m in events(v1, "pair-head")]
    assert [r for r, _ in events(v1, "pair-head")][:1] == ["Scheduled"]
    assert v1.read_namespaced_pod_log("pair-head", "default") == ""
    info = emu.pods_info()
    veths = [info[f"default/{n}"]["veth"] for n in ("pair-head", "pair-worker1")]
    pids = [info[f"default/{n}"]["pid"] for n in ("pair-head", "pair-worker1")]

    delete_and_wait(v1, "app=pair")
    assert not any(netns.link_exists(v) for v in veths)
    assert not any(procs.is_alive(p) for p in pids)
    assert emu.pods_info() == {}
    v1.delete_collection_namespaced_service("default", label_selector="app=pair")
    v1.delete_collection_namespaced_secret("default", label_selector="app=pair")
    assert v1.list_namespaced_secret("default", label_selector="app=pair").items == []
    assert v1.list_namespaced_service("default", label_selector="app=pair").items == []


@needs_root
def test_exec_over_the_v4_protocol_with_stdin(emu: Emulator, v1: client.CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod_manifest("v4-exec", {"app": "v4"}))
    wait_for(v1, "app=v4", running, 1)
    query = "command=sh&command=-c&command=head+-c+5%3B+exit+7&stdin=true&stdout=true&stderr=true"
    url = f"{emu.url.replace('http', 'ws')}/api/v1/namespaces/default/pods/v4-exec/exec?{query}"
    ws = ws_client.WSClient(
        v1.api_client.configuration,
        url,
        {"authorization": f"Bearer {emu.token}", "sec-websocket-protocol": "v4.channel.k8s.io"},
        capture_all=True,
    )
    assert ws.subprotocol == "v4.channel.k8s.io"
    ws.write_stdin("abcdefgh")
    ws.run_forever(timeout=10)
    assert ws.returncode == 7
    assert ws.read_all() == "abcde"
    # v5: the client can close stdin, so a command reading to EOF ends
    resp = stream(
        v1.connect_get_namespaced_pod_exec,
        "v4-exec",
        "default",
        command=["wc", "-c"],
        stdin=True,
        stdout=True,
        stderr=True,
        tty=False,
        _preload_content=False,
    )
    assert resp.subprotocol == "v5.channel.k8s.io"
    resp.write_stdin("12345678")
    resp.close_channel(0)
    resp.run_forever(timeout=10)
    assert resp.returncode == 0 and resp.read_all().strip() == "8"
    delete_and_wait(v1, "app=v4")


@needs_root
def test_required_anti_affinity_and_gpu_fit(v1: client.CoreV1Api) -> None:
    for i in range(4):
        v1.create_namespaced_pod("default", pod_manifest(f"spread-{i}", {"app": "spread"}, anti_affinity="required"))
    pods = wait_for(v1, "app=spread", lambda p: running(p) or unschedulable(p), 4)
    assert len({p["spec"]["nodeName"] for p in pods.values() if running(p)}) == 3
    stuck = [n for n, p in pods.items() if unschedulable(p)]
    assert len(stuck) == 1
    assert ("FailedScheduling", "0/3 nodes are available: 3 node(s) didn't match pod anti-affinity rules.") in events(
        v1, stuck[0]
    )
    delete_and_wait(v1, "app=spread")

    v1.create_namespaced_pod("default", pod_manifest("gpu-ok", {"app": "gpu"}, gpus=1))
    v1.create_namespaced_pod("default", pod_manifest("gpu-big", {"app": "gpu"}, gpus=2))
    pods = wait_for(v1, "app=gpu", lambda p: running(p) or unschedulable(p), 2)
    assert running(pods["gpu-ok"]) and unschedulable(pods["gpu-big"])
    assert pods["gpu-big"]["status"]["phase"] == "Pending" and not pods["gpu-big"]["spec"].get("nodeName")
    assert ("FailedScheduling", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.") in events(v1, "gpu-big")
    node = v1.read_node(pods["gpu-ok"]["spec"]["nodeName"])
    assert node.status.capacity["nvidia.com/gpu"] == "1"
    assert node.metadata.labels["kubernetes.io/hostname"] == node.metadata.name
    delete_and_wait(v1, "app=gpu")


@needs_root
def test_soft_anti_affinity_shares_a_single_node(tmp_path: Path) -> None:
    with Emulator(nodes=1, state_dir=tmp_path) as one:
        v1 = api(one.kubeconfig_path)
        for name in ("solo-head", "solo-worker1"):
            v1.create_namespaced_pod("default", pod_manifest(name, {"app": "solo"}))
        pods = wait_for(v1, "app=solo", running, 2)
        assert {p["spec"]["nodeName"] for p in pods.values()} == {"emu-node-0"}
    assert leftovers(str(tmp_path)) == []


@needs_root
def test_injected_faults(emu: Emulator, v1: client.CoreV1Api) -> None:
    emu.set_faults(pending="f-pending", image_pull="f-pull", crash=["f-crash*"])
    v1.create_namespaced_pod("default", pod_manifest("f-pending", {"app": "faults"}))
    v1.create_namespaced_pod("default", pod_manifest("f-pull", {"app": "faults"}))
    v1.create_namespaced_pod("default", pod_manifest("f-crash", {"app": "faults"}))
    v1.create_namespaced_pod("default", pod_manifest("f-crashloop", {"app": "faults"}, restart="Always"))
    pods = wait_for(
        v1,
        "app=faults",
        lambda p: (
            unschedulable(p)
            or waiting_reason(p) in ("ImagePullBackOff", "CrashLoopBackOff")
            or p["status"].get("phase") == "Failed"
        ),
        4,
    )
    assert unschedulable(pods["f-pending"])
    assert "untolerated taint {emulator.pytest-sky/fault: pending}" in events(v1, "f-pending")[0][1]
    assert waiting_reason(pods["f-pull"]) == "ImagePullBackOff" and pods["f-pull"]["status"]["phase"] == "Pending"
    reasons = [r for r, _ in events(v1, "f-pull")]
    assert "Failed" in reasons and "BackOff" in reasons
    assert any("ErrImagePull" in m for _, m in events(v1, "f-pull"))
    crash = v1.read_namespaced_pod("f-crash", "default")
    assert crash.status.phase == "Failed"
    assert crash.status.container_statuses[0].state.terminated.exit_code == 1
    assert "injected crash" in v1.read_namespaced_pod_log("f-crash", "default")
    loop = v1.read_namespaced_pod("f-crashloop", "default")
    assert loop.status.container_statuses[0].state.waiting.reason == "CrashLoopBackOff"
    assert loop.status.container_statuses[0].restart_count >= 1
    assert loop.status.container_statuses[0].last_state.terminated.exit_code == 1

    # clearing the fault lets the pending pod schedule
    emu.set_faults(reset=True)
    wait_for(v1, "app=faults", lambda p: p["metadata"]["name"] == "f-pending" and running(p), 1)
    delete_and_wait(v1, "app=faults")


@needs_root
def test_portforward_drops(emu: Emulator, v1: client.CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod_manifest("pf-drop", {"app": "pf"}, command=["python3", "-c", ECHO_SERVER]))
    wait_for(v1, "app=pf", running, 1)
    banner(v1, "pf-drop").close()
    emu.set_faults(drop_portforward_after_bytes=20)
    sock = forward(v1, "pf-drop")
    received = sock.recv(100)
    sock.sendall(b"0123456789")
    while chunk := sock.recv(100):
        received += chunk
    assert received.startswith(b"SSH-2.0-echo") and len(received) < 14 + 10 + 1
    emu.set_faults(drop_portforward_after_bytes=None)
    sock = banner(v1, "pf-drop")
    emu.set_faults(drop_portforwards=True)
    assert sock.recv(100) == b""
    delete_and_wait(v1, "app=pf")


@needs_root
def test_api_errors_and_permissions(emu: Emulator, v1: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as err:
        v1.read_namespace("nope")
    assert err.value.status == 404
    assert json.loads(err.value.body) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'namespaces "nope" not found',
        "reason": "NotFound",
        "details": {"name": "nope", "kind": "namespaces"},
        "code": 404,
    }
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_pod("nope", pod_manifest("x", {"app": "x"}))
    assert err.value.status == 404 and json.loads(err.value.body)["reason"] == "NotFound"
    v1.create_namespaced_secret("default", {"metadata": {"name": "dup"}, "data": {}})
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_secret("default", {"metadata": {"name": "dup"}, "data": {}})
    assert err.value.status == 409 and json.loads(err.value.body)["reason"] == "AlreadyExists"
    v1.delete_namespaced_secret("dup", "default")
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_pod("default", pod_manifest("Bad_Name", {"app": "x"}))
    assert err.value.status == 422 and json.loads(err.value.body)["reason"] == "Invalid"
    with pytest.raises(ApiException) as err:
        api(emu.kubeconfig_path, "kube-emulator-badtoken").list_namespaced_pod("default")
    assert err.value.status == 401
    readonly = api(emu.kubeconfig_path, "kube-emulator-readonly")
    assert readonly.read_namespace("default").metadata.name == "default"
    with pytest.raises(ApiException) as err:
        readonly.create_namespaced_secret("default", {"metadata": {"name": "ro"}})
    assert err.value.status == 403 and "cannot create resource" in json.loads(err.value.body)["message"]
    with pytest.raises(ApiException) as err:
        api(emu.kubeconfig_path, "kube-emulator-nobody").read_namespace("default")
    assert err.value.status == 403
    page = v1.list_node(limit=2)
    assert len(page.items) == 2 and page.metadata._continue
    assert [n.metadata.name for n in v1.list_node(limit=2, _continue=page.metadata._continue).items] == ["emu-node-2"]
    v1.create_namespace({"metadata": {"name": "scratch"}})
    v1.create_namespaced_secret("scratch", {"metadata": {"name": "s"}, "stringData": {"a": "b"}})
    assert v1.read_namespaced_secret("s", "scratch").data == {"a": "Yg=="}
    v1.delete_namespace("scratch")
    with pytest.raises(ApiException) as err:
        v1.read_namespace("scratch")
    assert err.value.status == 404


@needs_root
def test_watch_resumes_from_a_resource_version(v1: client.CoreV1Api) -> None:
    listed = v1.list_namespaced_secret("default", label_selector="app=rv")
    v1.create_namespaced_secret("default", {"metadata": {"name": "rv-1", "labels": {"app": "rv"}}})
    v1.delete_namespaced_secret("rv-1", "default")
    w = watch.Watch()
    seen = []
    for event in w.stream(
        v1.list_namespaced_secret,
        "default",
        label_selector="app=rv",
        resource_version=listed.metadata.resource_version,
        timeout_seconds=5,
    ):
        seen.append((event["type"], event["object"].metadata.name))
        if len(seen) == 2:
            w.stop()
            break
    assert seen == [("ADDED", "rv-1"), ("DELETED", "rv-1")]


def _admin(cluster: dict[str, str], token: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """An admin endpoint, over HTTPS verified against the kubeconfig's CA (``cluster``: its entry)."""
    trust = ssl.create_default_context(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
    req = urllib.request.Request(
        cluster["server"] + path,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST" if body is not None else "GET",
    )
    with urllib.request.urlopen(req, timeout=10, context=trust) as resp:
        return json.loads(resp.read())


def _start_process(kubeconfig: Path, state: Path, *extra: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kube_emulator",
            "--kubeconfig",
            str(kubeconfig),
            "--state-dir",
            str(state),
            "--current-context",
            "kube-emulator",  # these tests drive the emulator itself, as its admin
            *extra,
        ],
        cwd=REPO,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while not kubeconfig.exists():
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "the emulator wrote no kubeconfig"
        time.sleep(0.05)
    return proc


@needs_root
def test_process_sigterm_tears_everything_down(tmp_path: Path) -> None:
    kubeconfig, state = tmp_path / "kubeconfig", tmp_path / "state"
    proc = _start_process(kubeconfig, state, "--nodes", "2", "--fault-pending", "never-*")
    try:
        v1 = api(kubeconfig)
        assert [n.metadata.name for n in v1.list_node().items] == ["emu-node-0", "emu-node-1"]
        v1.create_namespaced_pod("default", pod_manifest("proc-0", {"app": "proc"}))
        v1.create_namespaced_pod("default", pod_manifest("never-0", {"app": "proc"}))
        wait_for(v1, "app=proc", lambda p: running(p) or unschedulable(p), 2)
        kc = yaml.safe_load(kubeconfig.read_text())
        token = next(u["user"]["token"] for u in kc["users"] if u["name"] == "emulator-admin")
        cluster = kc["clusters"][0]["cluster"]
        assert cluster["server"].startswith("https://")  # as every real API server: never plain HTTP
        assert _admin(cluster, token, "/emulator/faults")["pending"] == ["never-*"]
        assert _admin(cluster, token, "/emulator/faults", {"pending": None})["pending"] == []
        wait_for(v1, "app=proc", running, 2)
        assert leftovers(str(state))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert leftovers(str(state)) == []
    assert not kubeconfig.exists()
    assert list(state.iterdir()) == []


@needs_root
def test_sigkilled_emulator_is_reaped_by_the_next(tmp_path: Path) -> None:
    kubeconfig, state = tmp_path / "kubeconfig", tmp_path / "state"
    proc = _start_process(kubeconfig, state, "--nodes", "1")
    try:
        v1 = api(kubeconfig)
        v1.create_namespaced_pod("default", pod_manifest("orphan", {"app": "orphan"}))
        wait_for(v1, "app=orphan", running, 1)
    finally:
        proc.kill()
        proc.wait(10)
    (dead,) = state.iterdir()
    assert leftovers(str(dead)), "a SIGKILLed emulator leaves its pods behind"
    with Emulator(nodes=1, state_dir=state):
        assert leftovers(str(dead)) == []
        assert not dead.exists()
    assert leftovers(str(state)) == []
    assert list(state.iterdir()) == []


@needs_root
def test_a_sigkilled_emulators_bridge_goes_when_an_emulator_starts_on_another_state_dir(tmp_path: Path) -> None:
    """An emulator killed with its pods leaves its bridge, whose alias names an instance
    directory nobody uses again (a test's temporary state directory): the next emulator to
    start, on any state directory, removes it, judged by the dead one's record."""
    kubeconfig, state = tmp_path / "kubeconfig", tmp_path / "state"
    proc = _start_process(kubeconfig, state, "--nodes", "1")
    (dead,) = state.iterdir()
    bridges = [link for link in leftovers(str(dead)) if link.startswith("link ")]
    assert len(bridges) == 1, bridges  # seen while it lives: once it is dead, any run's reaper may take it
    proc.kill()
    proc.wait(10)
    with Emulator(nodes=1, state_dir=tmp_path / "other"):
        assert leftovers(str(dead)) == []
    assert leftovers(str(state)) == []


def test_selectors_and_quantities() -> None:
    sel = parse_label_selector("app=sky,role in (head, worker),!gone,rank,tier!=db")
    assert sel.matches({"app": "sky", "role": "head", "rank": "0"})
    assert not sel.matches({"app": "sky", "role": "head", "rank": "0", "gone": ""})
    assert not sel.matches({"app": "sky", "role": "db", "rank": "0"})
    assert parse_label_selector("").matches({})
    with pytest.raises(SelectorError):
        parse_label_selector("app=bad value")
    assert parse_quantity("500m") * 2 == 1
    assert parse_quantity("8Gi") == 8 * 2**30 and parse_quantity("8G") == 8 * 10**9
    assert parse_quantity(2) == 2 and parse_quantity("1.5") * 2 == 3


def test_scheduler_fit_and_anti_affinity_messages() -> None:
    def node(i: int, gpus: int = 0) -> Any:
        alloc = {"cpu": "4", "memory": "16Gi", "pods": "110"}
        if gpus:
            alloc["nvidia.com/gpu"] = str(gpus)
        labels = {"kubernetes.io/hostname": f"n{i}"}
        return node_view({"metadata": {"name": f"n{i}", "labels": labels}, "status": {"allocatable": alloc}})

    def pod(name: str, node_name: str | None = None, **kw: Any) -> dict[str, Any]:
        manifest = pod_manifest(name, {"app": "s"}, **kw)
        manifest["metadata"]["namespace"] = "default"
        if node_name:
            manifest["spec"]["nodeName"] = node_name
        return manifest

    nodes = [node(0), node(1, gpus=1)]
    assert schedule(pod("a"), nodes, []).node == "n0"
    assert schedule(pod("b"), nodes, [pod("a", "n0")]).node == "n1"  # preferred spreads
    assert schedule(pod("b"), nodes[:1], [pod("a", "n0")]).node == "n0"  # ... but is soft
    required = schedule(pod("b", anti_affinity="required"), nodes[:1], [pod("a", "n0")])
    assert required.message == "0/1 nodes are available: 1 node(s) didn't match pod anti-affinity rules."
    assert schedule(pod("g", gpus=1), nodes, []).node == "n1"
    assert schedule(pod("g", gpus=2), nodes, []).message == ("0/2 nodes are available: 2 Insufficient nvidia.com/gpu.")
    big = pod("big")
    big["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "5", "memory": "32Gi"}
    assert schedule(big, nodes, []).message == ("0/2 nodes are available: 2 Insufficient cpu, 2 Insufficient memory.")


def test_a_pods_files_are_its_own_and_an_emptydir_is_per_pod(emu: Emulator, v1: client.CoreV1Api) -> None:
    """As on a real cluster: a pod's writes (its root, its emptyDir) are seen by no other pod
    and not by the machine the emulator runs on."""
    labels = {"app": "own-files"}
    for name in ("own-a", "own-b"):
        manifest = pod_manifest(name, labels)
        manifest["spec"]["volumes"] = [{"name": "scratch", "emptyDir": {}}]
        manifest["spec"]["containers"][0]["volumeMounts"] = [{"name": "scratch", "mountPath": "/scratch"}]
        v1.create_namespaced_pod("default", manifest)
    wait_for(v1, "app=own-files", running, 2)
    try:
        assert run(v1, "own-a", ["sh", "-c", "echo a > /scratch/f; echo a > /opt/psky-own-a"]) == (0, "")
        assert run(v1, "own-b", ["sh", "-c", "ls /scratch | wc -l; ls /opt/psky-own-a 2>&1 | wc -l"]) == (0, "0\n1\n")
        assert run(v1, "own-a", ["cat", "/scratch/f", "/opt/psky-own-a"]) == (0, "a\na\n")
        assert not os.path.exists("/opt/psky-own-a") and not os.path.exists("/scratch")
    finally:
        delete_and_wait(v1, "app=own-files")


def capability_names(mask: int) -> set[str]:
    names = {name for name, bit in CAPABILITY_BITS.items() if mask >> bit & 1}
    assert sum(1 << CAPABILITY_BITS[n] for n in names) == mask, f"{mask:x} has capabilities beyond {sorted(names)}"
    return names


@needs_root
def test_a_containers_capabilities_are_what_a_runtime_gives_it(emu: Emulator, v1: client.CoreV1Api) -> None:
    """The runtime's default set, or the securityContext's drop/add, and no_new_privs: the
    pod's sshd runs with what it would get on a real node, not with all of root's."""
    from pytest_sky.backends import privileges

    show = ["/bin/sh", "-c", "grep -E '^(CapBnd|CapEff|NoNewPrivs)' /proc/self/status"]
    contexts = {
        "caps-default": None,
        "caps-ours": privileges.container_security_context(),
        "caps-chroot-only": {"capabilities": {"drop": ["ALL"], "add": ["SYS_CHROOT"]}},
    }
    for name, sc in contexts.items():
        manifest = pod_manifest(name, {"app": "caps"}, command=show, anti_affinity=None)
        if sc is not None:
            manifest["spec"]["containers"][0]["securityContext"] = sc
        v1.create_namespaced_pod("default", manifest)
    wait_for(v1, "app=caps", lambda p: p["status"].get("phase") == "Succeeded", len(contexts))
    seen = {}
    for name in contexts:
        fields = dict(line.split(":\t") for line in v1.read_namespaced_pod_log(name, "default").splitlines())
        assert fields["CapBnd"] == fields["CapEff"], fields
        seen[name] = (capability_names(int(fields["CapBnd"], 16)), fields["NoNewPrivs"])
    default = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE"}
    default |= {"NET_RAW", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
    assert seen["caps-default"] == (default, "0")
    assert seen["caps-ours"] == (set(privileges.POD_CAPABILITIES), "1")
    assert seen["caps-chroot-only"] == ({"SYS_CHROOT"}, "0")
    delete_and_wait(v1, "app=caps")


def test_the_emulator_takes_no_subnet_a_rootless_clusters_holder_leased(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rootless cluster's /24 lives in its holder's own namespace, leased by an abstract
    socket: the emulator's bridge (on the host, as root's) must not take it either, or an
    address of the holder's network shows on the host (the local backend never took it)."""
    from kube_emulator import network, product
    from pytest_sky.backends import clusterns, netns

    net = network.PodNetwork()
    net.check()
    lease = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for held in range(clusterns.NUM_SUBNETS):  # a free /24, held as a holder holds its own
        if netns.link_exists(f"{netns.LINK_PREFIX}{held}"):
            continue
        try:
            lease.bind(clusterns.subnet_lease_name(held))
            break
        except OSError:
            continue
    monkeypatch.setattr(clusterns.random, "randrange", lambda n: held)  # looked at first
    try:
        net.lease(str(tmp_path))
        assert net.index != held and clusterns.subnet_leased(held)
    finally:
        lease.close()
        if net.bridge:
            product.delete_links(net.tools["ip"], [net.bridge])
