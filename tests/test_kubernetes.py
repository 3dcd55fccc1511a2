"""The Kubernetes backend against the API emulator, driven exactly as against a real cluster."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky.backends import kube_manifests as manifests
from pytest_sky.backends.kubernetes import KubernetesBackend
from pytest_sky.errors import BackendUnavailableError, ProvisionError
from tests.contract import JOB_FAILS_WITHIN_S, within_promise

pytest.importorskip("kubernetes", reason="pip install kubernetes")
pytest.importorskip("aiohttp", reason="the emulator needs aiohttp")

from kube_emulator import Emulator, images

# A port-forward that ends badly (closed with bytes unread, reset) must not kill the kubernetes
# client's relay thread in the launching process with a traceback on the user's terminal.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")

SCRIPT = str(Path(sys.executable).with_name("pytest-sky"))


def launch(emu: Emulator, name: str, num_nodes: int = 2, **kwargs: object) -> pytest_sky.Cluster:
    return pytest_sky.launch(
        num_nodes=num_nodes,
        name=name,
        backend="kubernetes",
        backend_options={"kubeconfig": str(emu.kubeconfig_path)},
        **kwargs,
    )


def ours(emu: Emulator, cluster: str) -> list[str]:
    """Every pod, secret and service of a cluster the API server still has."""
    api = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
    sel = manifests.selector(cluster)
    left = [f"pod {p.metadata.name}" for p in api.list_namespaced_pod("default", label_selector=sel).items]
    left += [f"secret {s.metadata.name}" for s in api.list_namespaced_secret("default", label_selector=sel).items]
    left += [f"service {s.metadata.name}" for s in api.list_namespaced_service("default", label_selector=sel).items]
    return left


def node_names(emu: Emulator, cluster: str) -> list[str]:
    api = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
    pods = api.list_namespaced_pod("default", label_selector=manifests.selector(cluster)).items
    return [p.spec.node_name for p in pods]


def test_the_api_server_speaks_https_only_and_a_wrong_ca_fails_the_launch_in_one_line(
    home: Path, emu: Emulator, tmp_path: Path
):
    """As every real API server: HTTPS, its CA in the kubeconfig, so every launch, exec and
    port-forward of these tests verifies a certificate.  A kubeconfig that trusts another CA
    fails the launch before anything is made, in one line that names the CA."""
    import base64

    import yaml
    from cryptography.hazmat.primitives.serialization import Encoding

    from kube_emulator.tls import make_ca

    config = yaml.safe_load(emu.kubeconfig_path.read_text())
    cluster = config["clusters"][0]["cluster"]
    assert cluster["server"].startswith("https://") and cluster["certificate-authority-data"]
    cluster["certificate-authority-data"] = base64.b64encode(make_ca("another")[1].public_bytes(Encoding.PEM)).decode()
    wrong = tmp_path / "kubeconfig"
    wrong.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTEST_SKY_HOME": str(home), "KUBECONFIG": str(wrong), "CI": "1"}
    run = subprocess.run(
        [SCRIPT, "launch", "-c", "k8s-wrong-ca", "--kubernetes"], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 2, run.stdout + run.stderr
    (line,) = run.stderr.splitlines()
    assert line.startswith("pytest-sky: error: cannot verify the API server of kube context 'kube-emulator'"), line
    assert "certificate-authority-data" in line and "self-signed certificate" in line, line
    assert ours(emu, "k8s-wrong-ca") == []
    # The client keeps the CA in a file (ssl reads files): in this process's own directory,
    # which goes when it exits or is reaped after it is killed, never loose in /tmp.
    from pytest_sky import state

    api = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
    ca_file = Path(api.api_client.configuration.ssl_ca_cert)
    assert ca_file.parent == state.process_files(), ca_file
    assert ca_file.parent.parent.name == state.PROCESS_FILES and ca_file.read_bytes().startswith(b"-----BEGIN CERT")


def test_pods_run_tasks_and_answer_ssh(home: Path, emu: Emulator):
    with launch(emu, "k8s-basic") as c:
        res = c.run('echo "$SKYPILOT_NODE_RANK $(hostname)"; echo "$SKYPILOT_CLUSTER_INFO"')
        assert res.returncode == 0, res.output
        assert [r.stdout.splitlines()[0] for r in res.ranks] == ["0 k8s-basic-head", "1 k8s-basic-worker1"]
        info = json.loads(res.ranks[0].stdout.splitlines()[1])
        assert info["cloud"] == "kubernetes" and info["cluster_name"] == "k8s-basic"
        for alias, host in [(c.name, "k8s-basic-head"), (f"{c.name}-worker1", "k8s-basic-worker1")]:
            proc = subprocess.run(
                ["ssh", "-F", c.ssh_config, alias, "hostname"], capture_output=True, text=True, timeout=60, check=False
            )
            assert proc.stdout.strip() == host, proc.stderr
        # Pod IPs are the node IPs, and names resolve between pods (the headless Service).
        res = c.run("getent ahostsv4 k8s-basic-worker1.k8s-basic | head -n1 | cut -d' ' -f1")
        assert {r.stdout.strip() for r in res.ranks} == {c.node_ips[1]}
    assert ours(emu, "k8s-basic") == []


# An ``ssh`` ahead of the real one on PATH that writes down its arguments first.
_SSH_SHIM = """#!{python} -IS
import os, sys
with open({log!r}, "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
os.execv({real!r}, [{real!r}, *sys.argv[1:]])
"""


def test_the_clients_own_connection_starts_no_ssh(home: Path, emu: Emulator, tmp_path: Path, monkeypatch):
    """Runs go over a port-forward stream the client opens in its own process: a run starts
    no ssh, and so no ProxyCommand (a process per connection)."""
    log, shim = tmp_path / "ssh.log", tmp_path / "bin" / "ssh"
    shim.parent.mkdir()
    shim.write_text(_SSH_SHIM.format(python=sys.executable, log=str(log), real=shutil.which("ssh")))
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}{os.pathsep}{os.environ['PATH']}")

    def runs_of_ssh() -> list[str]:  # the launch's shared master and its exit are the launch's own
        lines = log.read_text().splitlines() if log.exists() else []
        return [line for line in lines if "ControlMaster=yes" not in line and "-O exit" not in line]

    with launch(emu, "k8s-noproxy") as c:
        assert c.run("true").returncode == 0
        again = pytest_sky.get_cluster("k8s-noproxy")  # a new handle: a new connection
        assert again.run("hostname").ranks[0].stdout.strip() == "k8s-noproxy-head"
        assert runs_of_ssh() == []
        # The shim does see an ssh run as users run it.
        subprocess.run(["ssh", "-F", c.ssh_config, c.name, "true"], check=True, timeout=60)
        assert len(runs_of_ssh()) == 1


def test_spread_over_nodes_when_they_fit(home: Path, emu: Emulator):
    with launch(emu, "k8s-spread", num_nodes=3):
        assert len(set(node_names(emu, "k8s-spread"))) == 3


def test_one_node_cluster_still_schedules_every_pod(home: Path):
    with Emulator(nodes=1) as emu, launch(emu, "k8s-onenode", num_nodes=3) as c:
        assert set(node_names(emu, "k8s-onenode")) == {"emu-node-0"}
        assert c.run("true").returncode == 0


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ({"pending": "k8s-fault-*"}, "cannot be scheduled"),
        ({"image_pull": "k8s-fault-*"}, "ErrImagePull"),
        ({"crash": "k8s-fault-*"}, "failed before sshd came up"),
    ],
    ids=["unschedulable", "image-pull", "crash"],
)
def test_faults_are_clear_and_leave_nothing(home: Path, fault: dict, expected: str):
    with Emulator(nodes=2, faults=fault) as emu:
        with pytest.raises(ProvisionError) as err:
            launch(emu, "k8s-fault")
        message = str(err.value)
        assert expected in message and "k8s-fault-" in message and "\n" not in message, message
        assert ours(emu, "k8s-fault") == []
        assert not (home / "clusters" / "k8s-fault").exists()


def test_gpus_beyond_capacity_are_unschedulable_with_the_events(home: Path, emu: Emulator):
    with pytest.raises(ProvisionError, match=r"cannot be scheduled.*Insufficient nvidia.com/gpu"):
        launch(emu, "k8s-nogpu", gpus="V100:1")
    assert ours(emu, "k8s-nogpu") == []


def test_status_shows_the_fractional_gpu_request(home: Path):
    with Emulator(nodes=3, gpus_per_node=1) as emu:
        env = {**os.environ, "KUBECONFIG": str(emu.kubeconfig_path), "CI": "1"}
        run = subprocess.run(
            [SCRIPT, "launch", "-c", "k8s-frac", "--kubernetes", "--gpus", "V100:0.5", "--num-nodes", "3"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
        )
        try:
            assert run.returncode == 0, run.stderr
            status = subprocess.run([SCRIPT, "status"], capture_output=True, text=True, env=env, check=True).stdout
            assert "3x Kubernetes(0.5CPU--1GB--V100:0.5)" in status, status
            api = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
            pod = api.read_namespaced_pod("k8s-frac-worker1", "default")
            assert pod.spec.containers[0].resources.requests["nvidia.com/gpu"] == "1"
            stress = subprocess.run(
                [SCRIPT, "stress-ssh", "k8s-frac"], capture_output=True, text=True, env=env, timeout=300, check=False
            )
            assert stress.returncode == 0 and stress.stdout.startswith("200/200"), stress.stdout + stress.stderr
        finally:
            subprocess.run([SCRIPT, "down", "k8s-frac"], env=env, timeout=120, check=False)
        assert ours(emu, "k8s-frac") == []


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"kubeconfig": "/nonexistent/kubeconfig"}, "no Kubernetes configuration"),
        ({"context": "nope"}, "kube context 'nope' is not in"),
        ({"namespace": "missing"}, "namespace 'missing' does not exist"),
        ({"context": "kube-emulator-badtoken"}, "not authorised"),
    ],
)
def test_configuration_problems_are_one_line(
    home: Path, emu: Emulator, options: dict, expected: str, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    opts = {"kubeconfig": str(emu.kubeconfig_path), **options}
    with pytest.raises(BackendUnavailableError) as err:
        pytest_sky.launch(num_nodes=2, name="k8s-bad", backend="kubernetes", backend_options=opts)
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (home / "clusters" / "k8s-bad").exists()


def test_no_permission_to_create_pods(home: Path, emu: Emulator):
    """A read-only context: the launch's own check names every verb missing, before it creates anything."""
    with pytest.raises(
        BackendUnavailableError, match=r"may not create pods, delete pods, create secrets, .*nothing was created"
    ):
        pytest_sky.launch(
            num_nodes=2,
            name="k8s-ro",
            backend="kubernetes",
            backend_options={"kubeconfig": str(emu.kubeconfig_path), "context": "kube-emulator-readonly"},
        )
    assert ours(emu, "k8s-ro") == []


def test_reaper_deletes_pods_of_a_dead_owner(home: Path, emu: Emulator):
    code = (
        "import os, pytest_sky\n"
        f"c = pytest_sky.launch(num_nodes=2, name='k8s-orphan', backend='kubernetes', "
        f"backend_options={{'kubeconfig': {str(emu.kubeconfig_path)!r}}})\n"
        "os._exit(0)  # the owner dies without tearing down\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, env={**os.environ})
    assert ours(emu, "k8s-orphan")
    assert "k8s-orphan" in pytest_sky.reap_orphans()
    assert ours(emu, "k8s-orphan") == []


def test_dropped_port_forward_fails_the_run_clearly_and_the_next_one_reconnects(home: Path, emu: Emulator):
    import threading
    import time

    from pytest_sky.errors import RunError

    with launch(emu, "k8s-drop") as c:
        assert c.run("true").returncode == 0
        outcome: list[BaseException | object] = []
        started = threading.Event()

        def long_run() -> None:
            try:
                outcome.append(c.run("echo started; sleep 60", timeout=120, on_line=lambda line: started.set()))
            except BaseException as exc:  # noqa: BLE001 - asserted below
                outcome.append(exc)

        t = threading.Thread(target=long_run)
        t.start()
        assert started.wait(60), "the run never started"
        start = time.monotonic()
        emu.set_faults(drop_portforwards=True)
        t.join(30)
        assert not t.is_alive() and time.monotonic() - start < 10
        (err,) = outcome
        assert isinstance(err, RunError) and "\n" not in str(err), err
        assert c.run("echo back").returncode == 0  # a new port-forward, a new connection
    assert ours(emu, "k8s-drop") == []


def test_evicted_worker_pod_fails_the_job_naming_the_rank(home: Path, emu: Emulator):
    import time

    from pytest_sky.job import JobStatus

    with launch(emu, "k8s-evict", num_nodes=3) as c:
        job = c.submit("echo started; sleep 90")
        deadline = time.monotonic() + 30
        while job.logs().count("started") < 3:  # every rank is running: the eviction is mid-job
            assert time.monotonic() < deadline, "the job never started"
        api = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
        start = time.monotonic()
        api.delete_namespaced_pod("k8s-evict-worker2", "default", grace_period_seconds=0)
        assert job.wait(30) == JobStatus.FAILED
        took = time.monotonic() - start
        assert took < JOB_FAILS_WITHIN_S, within_promise(took)
        assert "rank 2" in job.error, job.error
    assert ours(emu, "k8s-evict") == []


@pytest.mark.long(6)
def test_four_multinode_tests_at_once_on_the_emulator(pytester: pytest.Pytester, home: Path, emu: Emulator):
    pytester.makepyfile(
        test_inner="""
        import pytest

        @pytest.mark.multinode(num_nodes=2)
        @pytest.mark.parametrize("i", range(4))
        def test_many(sky_cluster, i):
            res = sky_cluster.run("hostname")
            assert res.returncode == 0
            assert res.ranks[1].stdout.strip() == sky_cluster.name + "-worker1"
        """
    )
    os.environ["KUBECONFIG"] = str(emu.kubeconfig_path)
    try:
        result = pytester.runpytest_subprocess("--kubernetes", "-n", "4", "-p", "no:cacheprovider")
    finally:
        del os.environ["KUBECONFIG"]
    result.assert_outcomes(passed=4)
    api = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
    assert api.list_namespaced_pod("default", label_selector="app.kubernetes.io/managed-by=pytest-sky").items == []


def test_files_reach_every_pod_without_touching_the_modes_of_home_or_root(home: Path, emu: Emulator, tmp_path):
    """workdir and file_mounts go over SSH as a tarball, unpacked on each pod.  The staging
    directory's own mode (0700) must not land on the pod's $HOME or on / (the emulator's
    pods share this machine's /: a 0700 / leaves every non-root process unable to load libc)."""
    from pytest_sky import Task

    workdir = tmp_path / "wd"
    workdir.mkdir()
    (workdir / "data.txt").write_text("payload\n")
    extra = tmp_path / "extra.txt"
    extra.write_text("mounted\n")
    root_mode = os.stat("/").st_mode & 0o7777
    with launch(emu, "k8s-files", num_nodes=2) as c:
        before = [r.stdout.strip() for r in c.run("stat -c %a ~").ranks]
        task = Task(
            run="cat data.txt ~/extra.txt; stat -c %a ~",
            num_nodes=2,
            workdir=str(workdir),
            file_mounts={"~/extra.txt": str(extra)},
        )
        res = c.run(task)
        assert res.returncode == 0, res.output
        assert [r.stdout.split() for r in res.ranks] == [["payload", "mounted", b] for b in before]
    assert os.stat("/").st_mode & 0o7777 == root_mode


def test_a_tasks_infra_and_image_id_act(home: Path, emu: Emulator, monkeypatch: pytest.MonkeyPatch):
    """``infra: kubernetes`` in a task runs it on Kubernetes (no backend named anywhere) and
    its ``image_id`` is the pods' image: neither is accepted and then ignored."""
    for name in ("PYTEST_SKY_BACKEND", "PYTEST_SKY_KUBERNETES", "PYTEST_SKY_KUBE_IMAGE"):
        monkeypatch.delenv(name, raising=False)
    image = images.READY_REPOSITORY + ":task"  # a tag of the node image, named by the task
    task = pytest_sky.Task(
        run="hostname", num_nodes=2, resources=pytest_sky.Resources(infra="kubernetes", image_id=f"docker:{image}")
    )
    c = pytest_sky.launch(task, name="k8s-infra", backend_options={"kubeconfig": str(emu.kubeconfig_path)})
    try:
        assert c.backend == "kubernetes"
        assert [r.stdout.strip() for r in c.last_result.ranks] == ["k8s-infra-head", "k8s-infra-worker1"]
        api = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
        pods = api.list_namespaced_pod("default", label_selector=manifests.selector("k8s-infra")).items
        assert {p.spec.containers[0].image for p in pods} == {image}
    finally:
        c.down()
    assert ours(emu, "k8s-infra") == []


def make_claim(emu: Emulator, name: str, mode: str) -> None:
    from kubernetes import client

    api = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
    spec = client.V1PersistentVolumeClaimSpec(access_modes=[mode], resources={"requests": {"storage": "1Gi"}})
    api.create_namespaced_persistent_volume_claim(
        "default", client.V1PersistentVolumeClaim(metadata=client.V1ObjectMeta(name=name), spec=spec)
    )


def test_a_shared_directory_needs_a_readwritemany_claim(home: Path, emu: Emulator):
    """Without a claim, with a missing one or a ReadWriteOnce one: one line, nothing created."""
    make_claim(emu, "rwo-claim", "ReadWriteOnce")
    cases = [
        (
            None,
            r"^shared_dir=/mnt/shared on Kubernetes needs a ReadWriteMany PersistentVolumeClaim: pass --kube",
        ),
        ("no-such-claim", r"^shared_dir=/mnt/shared: no PersistentVolumeClaim 'no-such-claim' in namespace 'default'"),
        (
            "rwo-claim",
            r"^shared_dir=/mnt/shared: PersistentVolumeClaim 'rwo-claim' is ReadWriteOnce, not ReadWriteMany",
        ),
    ]
    for claim, message in cases:
        with pytest.raises(BackendUnavailableError, match=message):
            pytest_sky.launch(
                num_nodes=2,
                name="k8s-shared",
                backend="kubernetes",
                backend_options={"kubeconfig": str(emu.kubeconfig_path), "shared_pvc": claim},
                shared_dir="/mnt/shared",
            )
        assert ours(emu, "k8s-shared") == []
        assert not (home / "clusters" / "k8s-shared").exists()


def test_a_shared_directory_on_a_claim_is_shared_by_every_pod(home: Path, emu: Emulator):
    make_claim(emu, "team-rwx", "ReadWriteMany")
    c = pytest_sky.launch(
        num_nodes=2,
        name="k8s-rwx",
        backend="kubernetes",
        backend_options={"kubeconfig": str(emu.kubeconfig_path), "shared_pvc": "team-rwx"},
        shared_dir="/mnt/shared",
    )
    try:
        assert c.run('[ "$SKYPILOT_NODE_RANK" != 1 ] || hostname > /mnt/shared/who').ok
        res = c.run("cat /mnt/shared/who; echo private > /tmp/mine; ls /tmp/mine")
        assert [r.stdout.splitlines()[0] for r in res.ranks] == ["k8s-rwx-worker1"] * 2, res.output
    finally:
        c.down()
    assert ours(emu, "k8s-rwx") == []
    # Its directory in the claim was emptied before its pods went; the claim itself stays.
    assert list((emu.server.instance_dir / "claims" / "default" / "team-rwx" / "k8s-rwx").iterdir()) == []


def test_each_pod_sees_its_own_host_key_and_no_other(home: Path, emu: Emulator):
    with launch(emu, "k8s-keys", num_nodes=3) as c:
        res = c.run(f"ls {manifests.SECRET_MOUNT}")
        assert res.returncode == 0, res.output
        for rank, r in enumerate(res.ranks):
            files = r.stdout.split()
            assert [f for f in files if f.startswith("host_key_")] == [f"host_key_{rank}"], files
            assert {"authorized_keys", "id_ed25519", "agent.pyz", "sshd_config"} <= set(files), files
    assert ours(emu, "k8s-keys") == []


def test_same_named_clusters_in_two_namespaces_each_reach_their_own_pods(tmp_path: Path, emu: Emulator):
    """Both up at once, each launched from a state directory of its own: each ssh config's
    master reaches its own pods (one ControlPath for both sent B's commands to A's head)."""
    from pytest_sky.state import StateStore

    api = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
    api.create_namespace({"metadata": {"name": "psky-twin"}})
    clusters: list[pytest_sky.Cluster] = []
    try:
        for namespace, state in (("default", "a"), ("psky-twin", "b")):
            clusters.append(
                pytest_sky.launch(
                    num_nodes=2,
                    name="k8s-twin",
                    backend="kubernetes",
                    backend_options={"kubeconfig": str(emu.kubeconfig_path), "namespace": namespace},
                    store=StateStore(tmp_path / state),
                )
            )
        for c in clusters:
            key = Path(c.ssh_config).parent / "id_ed25519"
            pub = subprocess.run(["ssh-keygen", "-y", "-f", str(key)], capture_output=True, text=True, check=True)
            for alias in ("k8s-twin", "k8s-twin-worker1"):
                got = subprocess.run(
                    ["ssh", "-F", c.ssh_config, alias, "cat .ssh/authorized_keys"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=False,
                )
                assert pub.stdout.split()[1] in got.stdout, f"{alias} of {c.ssh_config}: {got.stdout}{got.stderr}"
            assert c.run("true").returncode == 0
    finally:
        for c in reversed(clusters):
            c.down()
        api.delete_namespace("psky-twin")
    assert ours(emu, "k8s-twin") == []
