"""Images on Kubernetes: the emulator's image views, the default image without sshd and without
egress (a one-line error within a minute, not apt's timeouts), and the node image that
``examples/kubernetes/Dockerfile`` builds (everything the smoke suite needs, on the nodes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky.backends import kube_manifests as manifests
from pytest_sky.backends.kubernetes import KubernetesBackend
from pytest_sky.plugin import missing_on_nodes

pytest.importorskip("kubernetes", reason="pip install kubernetes")
pytest.importorskip("aiohttp", reason="the emulator needs aiohttp")

from kubernetes import client
from kubernetes.stream import stream

from kube_emulator import Emulator, images
from tests.contract import NO_SSHD_IMAGE_FAILS_WITHIN_S, within_promise

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the emulator's pods are namespace nodes: needs root")

CLI = str(Path(sys.executable).with_name("pytest-sky"))
# What the slim image lacks and the node image has, as a node sees it.
PROBE = (
    "for c in sshd ssh mpirun; do command -v $c >/dev/null && echo has-$c; done; "
    "python3 -c 'import torch' 2>/dev/null && echo has-torch; "
    "ls /var/lib/apt/lists | grep -q . && echo has-apt-lists; true"
)
EVERYTHING = ["has-sshd", "has-ssh", "has-mpirun", "has-torch", "has-apt-lists"]


def v1(emu: Emulator) -> client.CoreV1Api:
    return KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()


def pod_sees(emu: Emulator, name: str, image: str) -> list[str]:
    """Start a bare pod of ``image`` and say what it has (by exec, as kubectl would)."""
    api = v1(emu)
    container = {"name": "main", "image": image, "command": ["sleep", "infinity"]}
    api.create_namespaced_pod("default", {"metadata": {"name": name}, "spec": {"containers": [container]}})
    try:
        deadline = time.monotonic() + 60
        while api.read_namespaced_pod(name, "default").status.phase != "Running":
            assert time.monotonic() < deadline, f"pod {name} did not start"
            time.sleep(0.1)  # polling the API, as kubectl wait does
        out = stream(
            api.connect_get_namespaced_pod_exec,
            name,
            "default",
            command=["/bin/sh", "-c", PROBE],
            stderr=True,
            stdin=False,
            stdout=True,
            tty=False,
        )
        return out.split()
    finally:
        api.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def test_the_slim_image_lacks_what_the_node_image_has(emu: Emulator):
    """An image is this machine's tree with named paths absent, in the pod only."""
    assert pod_sees(emu, "img-ready", images.READY_IMAGE) == EVERYTHING
    assert pod_sees(emu, "img-slim", images.SLIM_IMAGE) == []
    # The slim pod removed sshd in its own layer: this machine still has it.
    assert os.path.exists(images.lookup(images.SLIM_IMAGE).absent_files[0])
    assert images.lookup(f"registry.example/team/{images.READY_REPOSITORY}:v1") == images.ImageView(
        name=f"registry.example/team/{images.READY_REPOSITORY}:v1"
    )
    assert images.lookup("ubuntu:22.04") is None


def test_an_image_the_registry_lacks_fails_to_pull(home: Path, emu: Emulator):
    start = time.monotonic()
    with pytest.raises(pytest_sky.ProvisionError) as err:
        pytest_sky.launch(
            num_nodes=1,
            name="img-typo",
            backend="kubernetes",
            backend_options={"kubeconfig": str(emu.kubeconfig_path), "image": "pytest-sky-nod:latest"},
        )
    assert "ErrImagePull" in str(err.value) and '"pytest-sky-nod:latest": not found' in str(err.value)
    assert time.monotonic() - start < 30


def test_the_default_image_without_sshd_or_egress_fails_within_a_minute_in_one_line(
    home: Path, emu: Emulator, monkeypatch: pytest.MonkeyPatch
):
    """``pytest-sky launch --kubernetes`` with the default image, on a cluster that cannot
    install sshd: one line saying so and what to do, well within 60 s; nothing left."""
    monkeypatch.delenv("PYTEST_SKY_KUBE_IMAGE")
    env = {**os.environ, "KUBECONFIG": str(emu.kubeconfig_path), "CI": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    start = time.monotonic()
    proc = subprocess.run(
        [CLI, "launch", "--kubernetes", "-c", "img-slim", "--num-nodes", "2", "--", "true"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    elapsed = time.monotonic() - start
    assert elapsed < NO_SSHD_IMAGE_FAILS_WITHIN_S, within_promise(elapsed, NO_SSHD_IMAGE_FAILS_WITHIN_S)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pytest-sky: error: ")]
    assert len(errors) == 1, proc.stderr
    (line,) = errors
    assert f"image {manifests.DEFAULT_IMAGE} lacks sshd" in line, line
    assert "examples/kubernetes/Dockerfile" in line and "--kube-image" in line, line
    assert "(events:" not in line, line  # the reason is the pod's own line, not the event log
    sel = manifests.selector("img-slim")
    assert v1(emu).list_namespaced_pod("default", label_selector=sel).items == []


def test_the_node_image_launches_with_what_the_smoke_suite_needs(home: Path, emu: Emulator):
    with pytest_sky.launch(
        num_nodes=2,
        name="img-ready",
        backend="kubernetes",
        backend_options={"kubeconfig": str(emu.kubeconfig_path), "image": images.READY_IMAGE},
    ) as cluster:
        assert cluster.journal.load()["image"] == images.READY_IMAGE
        assert missing_on_nodes(cluster, commands=["mpirun", "ssh"], modules=["torch", "mpi4py"]) == []
        assert missing_on_nodes(cluster, commands=["no-such-tool"], modules=["no_such_module"]) == [
            "no-such-tool",
            "no_such_module",
        ]
        log = v1(emu).read_namespaced_pod_log(manifests.pod_name("img-ready", 0), "default")
        assert "installing openssh-server" not in log, log


def test_a_smoke_requirement_missing_on_the_nodes_skips_naming_the_image(
    pytester: pytest.Pytester, home: Path, emu: Emulator
):
    """What a test needs is asked of the nodes (this client has the module; the image does not),
    and the skip names the image and the fix."""
    pytester.makepyfile(
        test_inner="""
        import pytest
        from pytest_sky.plugin import require_on_nodes

        @pytest.mark.multinode(num_nodes=2)
        def test_needs(sky_cluster):
            require_on_nodes(sky_cluster, commands=["mpirun"], modules=["pytest_sky_not_on_nodes"], install="pip x")
        """
    )
    pytester.makepyfile(pytest_sky_not_on_nodes="")  # importable here, on the client only
    os.environ["KUBECONFIG"] = str(emu.kubeconfig_path)
    try:
        result = pytester.runpytest_subprocess("--kubernetes", "-rs", "-p", "no:cacheprovider")
    finally:
        del os.environ["KUBECONFIG"]
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        [
            f"SKIPPED * image {images.READY_IMAGE} has no pytest_sky_not_on_nodes on the nodes: "
            "build examples/kubernetes/Dockerfile with pip x added and pass --kube-image"
        ]
    )
