"""What the tests that drive the Kubernetes API emulator through the official client share.

A module, not a test module, so that test modules share these without importing each other.
Import it after ``pytest.importorskip("kubernetes")``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.stream import stream

from kube_emulator import images
from pytest_sky import procs
from pytest_sky.doctor import link_owners, node_processes

#: kubectl, the independent client the emulator is held to; None where it is not installed.
KUBECTL = shutil.which("kubectl")
NO_KUBECTL = "kubectl is not on PATH: apt-get install kubernetes-client"


def kubectl_command(
    kubeconfig: Path | str, *args: str, context: str | None = "kube-emulator"
) -> tuple[list[str], dict[str, str]]:
    """kubectl's argv and environment for ``kubeconfig`` (and ``context``: None leaves it to
    ``args``), as a user runs it, but with its discovery and HTTP caches beside the kubeconfig:
    its default, ``~/.kube/cache``, is the user's, and every emulator's port added a directory."""
    assert KUBECTL is not None, NO_KUBECTL
    cache = Path(kubeconfig).parent / "kubectl-cache"
    argv = [KUBECTL, "--cache-dir", str(cache), *(["--context", context] if context else []), *args]
    return argv, {**os.environ, "KUBECONFIG": str(kubeconfig)}


def run_kubectl(
    kubeconfig: Path | str, *args: str, context: str | None = "kube-emulator", input: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    """kubectl run to its end (:func:`kubectl_command`)."""
    argv, env = kubectl_command(kubeconfig, *args, context=context)
    return subprocess.run(argv, input=input, capture_output=True, env=env, timeout=120, check=False)


def pod_processes(emulator: Any, pod: str, namespace: str = "default") -> list[tuple[int, int | None]]:
    """Every process of ``pod``'s container as the emulator runs it now (its node's keeper and
    each process of its PID namespace), with its start time: alive later means the same one."""
    info = emulator.pods_info()[f"{namespace}/{pod}"]
    ns = os.readlink(f"/proc/{info['init_pid']}/ns/pid")
    found = [info["pid"]]
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.readlink(f"/proc/{entry}/ns/pid") == ns:
                found.append(int(entry))
        except OSError:
            continue  # gone meanwhile
    return [(pid, procs.start_time(pid)) for pid in found]


def alive(processes: list[tuple[int, int | None]]) -> list[int]:
    """Those of ``processes`` (from :func:`pod_processes`) that still run."""
    return [pid for pid, start in processes if procs.is_alive(pid, start)]


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the emulator's pods are namespace nodes: needs root")


def leftovers(scope: str) -> list[str]:
    """Links and node processes that belong to ``scope`` (a state directory)."""
    left = [f"link {n}" for n, owner in link_owners().items() if scope in owner]
    left += [f"process {pid}: {cmd}" for pid, cmd in node_processes() if scope in cmd]
    return left


def api_client(kubeconfig: Path, context: str | None = None) -> client.ApiClient:
    """A client as the product makes one (its loader): the client remembers the files it
    wrote a kubeconfig's inline certificates to, by their content, for the life of the
    process, so a test that loaded it another way would change where the product's go."""
    from pytest_sky.ssh.kube_credentials import load_kube_config

    cfg = client.Configuration()
    load_kube_config(cfg, str(kubeconfig), context)
    return client.ApiClient(cfg)


def api(kubeconfig: Path, context: str | None = None) -> client.CoreV1Api:
    return client.CoreV1Api(api_client(kubeconfig, context))


def pod_manifest(
    name: str,
    labels: dict[str, str],
    *,
    command: list[str] | None = None,
    anti_affinity: str | None = "preferred",
    gpus: int = 0,
    restart: str = "Never",
    subdomain: str | None = None,
    secret: str | None = None,
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": images.SLIM_IMAGE,  # python3 (the echo server needs it), no sshd
        "command": command or ["sleep", "infinity"],
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
    }
    # The commands here (sleep, a Python server) handle no SIGTERM: a kubelet waits out a
    # deleted pod's grace period (30 s unless set) before it SIGKILLs them, the emulator's too.
    spec: dict[str, Any] = {"containers": [container], "restartPolicy": restart, "terminationGracePeriodSeconds": 1}
    if gpus:
        container["resources"]["limits"] = {"nvidia.com/gpu": str(gpus)}
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    if subdomain:
        spec["hostname"] = name
        spec["subdomain"] = subdomain
    if secret:
        container["volumeMounts"] = [{"name": "keys", "mountPath": "/run/sky-keys", "readOnly": True}]
        spec["volumes"] = [{"name": "keys", "secret": {"secretName": secret, "defaultMode": 0o600}}]
    term = {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}
    if anti_affinity == "preferred":
        spec["affinity"] = {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]
            }
        }
    elif anti_affinity == "required":
        spec["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}


def wait_for(
    v1: client.CoreV1Api,
    selector: str,
    done: Callable[[dict[str, Any]], bool],
    count: int,
    timeout: float = 20,
    ns: str = "default",
) -> dict[str, Any]:
    """Watch pods matching ``selector`` until ``count`` of them satisfy ``done`` (by raw object)."""
    seen: dict[str, Any] = {}
    w = watch.Watch()
    deadline = time.monotonic() + timeout
    for event in w.stream(v1.list_namespaced_pod, ns, label_selector=selector, timeout_seconds=int(timeout)):
        obj = event["raw_object"]
        seen[obj["metadata"]["name"]] = obj
        if event["type"] == "DELETED":
            seen.pop(obj["metadata"]["name"])
        if sum(1 for o in seen.values() if done(o)) >= count or time.monotonic() > deadline:
            w.stop()
            break
    assert sum(1 for o in seen.values() if done(o)) >= count, json.dumps(
        {n: o.get("status") for n, o in seen.items()}, indent=1
    )
    return seen


def running(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running"


def waiting_reason(pod: dict[str, Any]) -> str:
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    return ((statuses[0].get("state") or {}).get("waiting") or {}).get("reason", "")


def unschedulable(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def run(v1: client.CoreV1Api, pod: str, command: list[str], ns: str = "default") -> tuple[int, str]:
    resp = stream(
        v1.connect_get_namespaced_pod_exec,
        pod,
        ns,
        command=command,
        stderr=True,
        stdin=False,
        stdout=True,
        tty=False,
        _preload_content=False,
    )
    resp.run_forever(timeout=20)
    code = resp.returncode  # first: read_all() empties every channel, the error channel too
    return code, resp.read_all()


def events(v1: client.CoreV1Api, pod: str) -> list[tuple[str, str]]:
    items = v1.list_namespaced_event("default", field_selector=f"involvedObject.name={pod}").items
    return [(e.reason, e.message) for e in items]


def delete_and_wait(v1: client.CoreV1Api, selector: str, timeout: float = 20) -> None:
    v1.delete_collection_namespaced_pod("default", label_selector=selector)
    deadline = time.monotonic() + timeout
    while v1.list_namespaced_pod("default", label_selector=selector).items:
        assert time.monotonic() < deadline, "pods were not deleted"
        time.sleep(0.05)
