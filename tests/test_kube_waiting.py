"""Waiting for pods on Kubernetes: what a real cluster does while a launch waits, injected by
the emulator, ends the launch fast with the reason (or, for an expired watch, not at all).

Each fault used to wait out the whole ready timeout (600 s by default; these tests set 60 s
so that the old behaviour fails them quickly) or, for a 410, escape as a traceback.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky.backends import kube_manifests as manifests
from pytest_sky.backends.kubernetes import KubernetesBackend
from pytest_sky.errors import ProvisionError

pytest.importorskip("kubernetes", reason="pip install kubernetes")
pytest.importorskip("aiohttp", reason="the emulator needs aiohttp")

from kube_emulator import Emulator
from tests.contract import POD_NEVER_RUNS_ENDS_WITHIN_S

FAST = POD_NEVER_RUNS_ENDS_WITHIN_S  # seconds from the fault to the launch's error (the docs' reliability row)


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PYTEST_SKY_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


def launch(emu: Emulator, name: str) -> pytest_sky.Cluster:
    return pytest_sky.launch(
        num_nodes=2,
        name=name,
        backend="kubernetes",
        backend_options={"kubeconfig": str(emu.kubeconfig_path), "ready_timeout": 60},
    )


def ours(emu: Emulator, cluster: str) -> list[str]:
    api = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
    sel = manifests.selector(cluster)
    left = [f"pod {p.metadata.name}" for p in api.list_namespaced_pod("default", label_selector=sel).items]
    left += [f"secret {s.metadata.name}" for s in api.list_namespaced_secret("default", label_selector=sel).items]
    return left


def test_an_expired_watch_is_listed_again_and_the_launch_goes_on(emu: Emulator):
    """Both shapes of 410 Gone: an HTTP 410 answer, and an ERROR event in a 200 stream."""
    emu.set_faults(reset=True, expire_watches=2)
    try:
        with launch(emu, "k8s-w410") as c:
            assert c.run("true").returncode == 0
        assert emu.set_faults()["expire_watches"] == 0  # both expiries were met
    finally:
        emu.set_faults(reset=True)
    assert ours(emu, "k8s-w410") == []


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("delete_pod", ["pod k8s-wait-worker1 was deleted while the cluster was starting"]),
        (
            "create_container_config_error",
            ["pod k8s-wait-worker1: CreateContainerConfigError", 'Error: secret "team-credentials" not found'],
        ),
        ("run_container_error", ["pod k8s-wait-worker1: RunContainerError", "OCI runtime create failed"]),
        (
            "failed_mount",
            [
                "pod k8s-wait-worker1 cannot mount a volume",
                'FailedMount: MountVolume.SetUp failed for volume "ssh-keys"',
            ],
        ),
    ],
)
def test_a_pod_that_will_never_run_ends_the_launch_at_once_with_its_events(
    emu: Emulator, fault: str, expected: list[str]
):
    emu.set_faults(reset=True, **{fault: "k8s-wait-worker1"})
    try:
        start = time.monotonic()
        with pytest.raises(ProvisionError) as err:
            launch(emu, "k8s-wait")
        took = time.monotonic() - start
    finally:
        emu.set_faults(reset=True)
    message = str(err.value)
    print(f"{took:.1f} s: {message}")
    assert "\n" not in message, message
    for part in expected:
        assert part in message, message
    assert took < FAST, f"{took:.1f} s: {message}"
    assert ours(emu, "k8s-wait") == []


def exec_plugin_kubeconfig(emu: Emulator, tmp_path: Path, expires_in: float) -> tuple[Path, Path]:
    """A copy of the emulator's kubeconfig whose user gets its token from an exec plugin (a
    script that counts its runs, like ``aws eks get-token`` without the second it costs)."""
    import datetime
    import json
    import stat

    import yaml

    runs = tmp_path / "plugin-runs"
    expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=expires_in)
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "kind": "ExecCredential",
        "status": {"token": emu.token, "expirationTimestamp": expiry.strftime("%Y-%m-%dT%H:%M:%SZ")},
    }
    plugin = tmp_path / "get-token"
    plugin.write_text(f"#!/bin/sh\necho run >> '{runs}'\necho '{json.dumps(credential)}'\n")
    plugin.chmod(plugin.stat().st_mode | stat.S_IXUSR)
    kc = yaml.safe_load(emu.kubeconfig_path.read_text())
    current = next(c for c in kc["contexts"] if c["name"] == kc["current-context"])
    user = next(u for u in kc["users"] if u["name"] == current["context"]["user"])
    user["user"] = {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": str(plugin)}}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(kc))
    return path, runs


@pytest.mark.parametrize(("expires_in", "runs_expected"), [(3600, 1), (30, None)], ids=["valid", "expiring"])
def test_an_exec_plugins_credential_serves_every_connection_until_it_expires(
    emu: Emulator, home: Path, tmp_path: Path, expires_in: float, runs_expected: int | None
):
    import subprocess

    kubeconfig, runs = exec_plugin_kubeconfig(emu, tmp_path, expires_in)
    connections = 3
    with pytest_sky.launch(
        num_nodes=1, name="k8s-exec", backend="kubernetes", backend_options={"kubeconfig": str(kubeconfig)}
    ) as c:
        for _ in range(connections):  # each a new ssh, so a new ProxyCommand: no shared master
            ssh = ["ssh", "-F", c.ssh_config, "-o", "ControlMaster=no", "-o", "ControlPath=none", c.name, "true"]
            done = subprocess.run(ssh, capture_output=True, text=True, timeout=60, check=False)
            assert done.returncode == 0, done.stderr
    count = len(runs.read_text().splitlines())
    if runs_expected is not None:
        assert count == runs_expected, f"the plugin ran {count} times"
        (cached,) = (home / "kube-credentials").iterdir()
        assert cached.stat().st_mode & 0o777 == 0o600
        assert (home / "kube-credentials").stat().st_mode & 0o777 == 0o700
    else:  # within EXPIRY_MARGIN of its end: never reused
        assert count > connections, f"the plugin ran {count} times"
