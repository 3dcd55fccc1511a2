"""kubectl against the emulator: what a user runs while debugging a launch, and every kubectl
command the docs print (docs/kubernetes.md).

A real client holds the emulator to the real API's shape: discovery, HTTPS with the CA of the
kubeconfig, the Tables ``get`` prints, the OpenAPI documents ``apply`` validates with, RBAC
objects the authorizer enforces, and watches (``wait``, ``delete``).  The Python client alone
would pass where kubectl fails: it never asks for a Table or OpenAPI, and it does not
validate what it sends.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import pytest_sky

pytest.importorskip("kubernetes", reason="pip install kubernetes")
pytest.importorskip("aiohttp", reason="the emulator needs aiohttp")

from kube_emulator import ROLE_CONTEXT, Emulator
from pytest_sky.backends import kube_manifests as manifests
from tests.kube_helpers import KUBECTL, NO_KUBECTL, kubectl_command, run_kubectl

REPO = Path(__file__).resolve().parent.parent
RBAC = REPO / "examples" / "kubernetes" / "rbac.yaml"


def _client_minor() -> int:
    """kubectl's minor version (0 where it cannot say)."""
    import json
    import re

    assert KUBECTL is not None
    run = subprocess.run([KUBECTL, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
    try:
        return int(re.match(r"\d*", json.loads(run.stdout)["clientVersion"]["minor"])[0] or 0)
    except (ValueError, KeyError, TypeError):
        return 0


pytestmark = [
    pytest.mark.skipif(KUBECTL is None, reason=NO_KUBECTL),
    pytest.mark.skipif(
        KUBECTL is not None and _client_minor() < 31,
        reason="kubectl before 1.31 speaks raw SPDY and OpenAPI v2, which the emulator does not serve",
    ),
]


def kubectl(emu: Emulator, *args: str, context: str = "kube-emulator", check: bool = True) -> str:
    """kubectl's output (stdout and stderr); a failure fails the test unless ``check`` is off."""
    run = run_kubectl(emu.kubeconfig_path, *args, context=context)
    out = (run.stdout + run.stderr).decode()
    if check:
        assert run.returncode == 0, f"kubectl {' '.join(args)}: {out}"
    return out


def test_kubectl_keeps_its_caches_out_of_the_users_home(emu: Emulator, tmp_path: Path) -> None:
    """kubectl caches discovery under ``~/.kube/cache`` by default: every emulator's port had
    left a directory in the home of whoever ran the suite.  The tests' kubectl caches beside
    the emulator's kubeconfig, which goes with the emulator."""
    argv, env = kubectl_command(emu.kubeconfig_path, "get", "pods")
    env["HOME"] = str(tmp_path)
    run = subprocess.run(argv, capture_output=True, env=env, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert not (tmp_path / ".kube").exists()
    assert (emu.kubeconfig_path.parent / "kubectl-cache").is_dir()


def table(out: str) -> list[list[str]]:
    """kubectl's columns, split on runs of two or more spaces."""
    import re

    return [re.split(r"\s{2,}", line.strip()) for line in out.strip().splitlines()]


@pytest.fixture(scope="module")
def cluster(emu: Emulator, module_home: Path) -> Iterator[pytest_sky.Cluster]:
    options = {"kubeconfig": str(emu.kubeconfig_path), "ready_timeout": 180}
    with pytest_sky.launch(num_nodes=2, name="kubectl", backend="kubernetes", backend_options=options) as c:
        yield c


def test_get_prints_the_columns_a_real_server_gives(emu: Emulator, cluster: pytest_sky.Cluster) -> None:
    sel = f"-l{manifests.selector(cluster.name)}"
    pods = table(kubectl(emu, "get", "pods", sel, "-o", "wide"))
    assert pods[0] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP", "NODE", "NOMINATED NODE", "READINESS GATES"]
    assert sorted(row[0] for row in pods[1:]) == ["kubectl-head", "kubectl-worker1"]
    assert all(row[1:4] == ["1/1", "Running", "0"] and row[5] in cluster.node_ips for row in pods[1:]), pods
    nodes = table(kubectl(emu, "get", "nodes"))
    assert nodes[0] == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    assert {row[1] for row in nodes[1:]} == {"Ready"}
    services = table(kubectl(emu, "get", "service", cluster.name))
    assert services[0] == ["NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP", "PORT(S)", "AGE"]
    assert services[1][:2] == [cluster.name, "ClusterIP"]


def test_describe_exec_logs_and_wait_work_on_a_launched_node(emu: Emulator, cluster: pytest_sky.Cluster) -> None:
    described = kubectl(emu, "describe", "pod", "kubectl-head")
    assert "Status:           Running" in described and "Events:" in described, described
    assert "Ready" in kubectl(emu, "describe", "node", "emu-node-0")
    assert kubectl(emu, "exec", "kubectl-worker1", "--", "hostname").strip() == "kubectl-worker1"
    kubectl(emu, "logs", "kubectl-head")
    out = kubectl(emu, "wait", "--for=condition=Ready", "pod", f"-l{manifests.selector(cluster.name)}", "--timeout=30s")
    assert out.count("condition met") == 2, out


def test_exec_with_a_terminal_and_stdin(emu: Emulator, cluster: pytest_sky.Cluster) -> None:
    """``kubectl exec -it``: a shell on a terminal (kubectl's own stdin a terminal too), and
    ``-i`` with piped input."""
    import fcntl
    import pty
    import re
    import struct
    import termios

    argv, env = kubectl_command(emu.kubeconfig_path, "exec", "-it", f"{cluster.name}-head", "--", "bash")
    pid, fd = pty.fork()
    if pid == 0:  # the terminal's size first: kubectl sends it
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 37, 101, 0, 0))
        os.execvpe(argv[0], argv, env)
    try:
        os.write(fd, b"tty; echo rows=$(stty size | cut -d' ' -f1); exit 7\n")
        out = b""
        while True:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the terminal closed: kubectl is gone
                break
            if not chunk:
                break
            out += chunk
    finally:
        _, status = os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    assert re.search(r"\n/dev/pts/\d+\r?\n", text) and "rows=37" in text, text  # a terminal of the pod's
    assert os.waitstatus_to_exitcode(status) == 7, text
    piped = run_kubectl(
        emu.kubeconfig_path, "exec", "-i", f"{cluster.name}-worker1", "--", "wc", "-c", input=b"x" * 100_000
    )
    assert piped.stdout.strip() == b"100000", piped


def test_the_kubectl_commands_error_lines_print_work(emu: Emulator) -> None:
    """What the backend's one-line errors tell a user to run."""
    assert "Type        Resource" in kubectl(emu, "describe", "limitrange", "-n", "default")
    nodes = table(kubectl(emu, "get", "nodes", "-L", "nvidia.com/gpu.product"))
    assert nodes[0][-1] == "GPU.PRODUCT", nodes


def test_the_readme_can_i_questions_answer_from_the_shipped_role(emu: Emulator) -> None:
    for question in (["create", "pods"], ["create", "pods/exec"], ["create", "pods/portforward"], ["delete", "pods"]):
        assert kubectl(emu, "auth", "can-i", *question, "-n", "default", context=ROLE_CONTEXT).strip() == "yes"
    out = kubectl(emu, "auth", "can-i", "deletecollection", "pods", "-n", "default", context=ROLE_CONTEXT, check=False)
    assert out.strip() == "no"
    listed = table(kubectl(emu, "auth", "can-i", "--list", "-n", "default", context=ROLE_CONTEXT))
    assert ["pods/exec", "[]", "[]", "[get create]"] in listed, listed


def test_applying_the_shipped_rbac_yaml_is_what_the_role_context_may_do(emu: Emulator) -> None:
    """The docs' ``kubectl apply -n NS -f examples/kubernetes/rbac.yaml``: the objects are
    created, validated against the server's OpenAPI, and the authorizer enforces them (the
    role context's user is the ServiceAccount the file binds, in ``default``)."""
    ns = "kubectl-rbac"
    kubectl(emu, "create", "namespace", ns)
    try:
        out = kubectl(emu, "apply", "-n", ns, "-f", str(RBAC))
        assert out.splitlines() == [
            "role.rbac.authorization.k8s.io/pytest-sky created",
            "serviceaccount/pytest-sky created",
            "rolebinding.rbac.authorization.k8s.io/pytest-sky created",
        ], out
        assert "unchanged" in kubectl(emu, "apply", "-n", ns, "-f", str(RBAC)), "a second apply changes nothing"
        # Bound to the ServiceAccount of that namespace: not the role context's user.
        can_i = ["auth", "can-i", "create", "pods", "-n", ns]
        assert kubectl(emu, *can_i, context=ROLE_CONTEXT, check=False).strip() == "no"
        # In default, the binding is what grants: without it, nothing; applied again, all of it.
        kubectl(emu, "delete", "rolebinding", "pytest-sky", "-n", "default")
        try:
            assert kubectl(emu, "auth", "can-i", "create", "pods", context=ROLE_CONTEXT, check=False).strip() == "no"
        finally:
            kubectl(emu, "apply", "-n", "default", "-f", str(RBAC))
        assert kubectl(emu, "auth", "can-i", "create", "pods", context=ROLE_CONTEXT).strip() == "yes"
    finally:
        kubectl(emu, "delete", "namespace", ns, "--wait=false")


def test_apply_refuses_what_a_real_server_refuses(emu: Emulator, tmp_path: Path) -> None:
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(RBAC.read_text().replace("\nrules:\n", "\nrulez: []\nrules:\n", 1))
    out = kubectl(emu, "apply", "-n", "default", "-f", str(unknown), check=False)
    assert 'strict decoding error: unknown field "rulez"' in out, out
    malformed = tmp_path / "malformed.yaml"
    malformed.write_text(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {name: kubectl-bad}\n"
        "rules: [{apiGroups: [''], resources: [pods]}]\n"
    )
    out = kubectl(emu, "apply", "-n", "default", "-f", str(malformed), check=False)
    assert 'The Role.rbac.authorization.k8s.io "kubectl-bad" is invalid' in out, out
    assert "rules[0].verbs: Required value: verbs must contain at least one value" in out, out
    assert "kubectl-bad" not in kubectl(emu, "get", "roles", "-n", "default")


def test_port_forward_in_kubectls_protocol_carries_an_ssh_session(
    emu: Emulator, cluster: pytest_sky.Cluster, module_home: Path
) -> None:
    """``kubectl port-forward`` speaks SPDY/3.1 inside a websocket (the Python client's form is
    another): an ssh session through it, with the cluster's key and known host key, moves
    megabytes both ways; a second connection through the same session works too."""
    import re

    argv, env = kubectl_command(emu.kubeconfig_path, "port-forward", f"pod/{cluster.name}-head", ":22")
    forward = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert forward.stdout is not None
        line = forward.stdout.readline()
        found = re.search(r"127\.0\.0\.1:(\d+) -> 22", line)
        assert found, line
        config = module_home / "clusters" / cluster.name / "ssh_config"
        ssh = ["ssh", "-F", str(config), "-o", "ProxyCommand=none", "-o", "HostName=127.0.0.1"]
        ssh += ["-p", found.group(1), cluster.name]
        down = subprocess.run([*ssh, "hostname; head -c 3000000 /dev/zero | wc -c"], capture_output=True, timeout=60)
        assert down.stdout.split() == [f"{cluster.name}-head".encode(), b"3000000"], down
        up = subprocess.run([*ssh, "wc -c"], input=os.urandom(2_000_000), capture_output=True, timeout=60)
        assert up.stdout.strip() == b"2000000", up
    finally:
        forward.terminate()
        forward.wait(10)
