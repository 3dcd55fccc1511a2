"""A Kubernetes cluster's forwarder and the ProxyCommand that dials it, against the emulator.

What a user notices: ssh through the cluster's config starts no process that loads the
kubernetes client, twenty raw connections at once all get through, the CLI of another
process is served by the same forwarder, and ``down`` (or the reaper) leaves no forwarder,
process or socket behind.  Where the forwarder is gone, a connection still works (the
self-contained proxy).
"""

from __future__ import annotations

import os
import select
import shlex
import socket
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky import doctor, procs
from pytest_sky.backends.kube_journal import KubeRecord
from pytest_sky.ssh import kube_dial, kube_forwarder
from pytest_sky.state import StateStore

pytest.importorskip("kubernetes", reason="pip install kubernetes")
pytest.importorskip("aiohttp", reason="the emulator needs aiohttp")

from kube_emulator import Emulator

# A stream closed with bytes unread kills the kubernetes client's relay thread in the launching
# process with a traceback on the user's terminal: every ending here must be an end of stream.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")

SCRIPT = str(Path(sys.executable).with_name("pytest-sky"))
RAW = ["-o", "ControlMaster=no", "-o", "ControlPath=none"]  # a full handshake, no shared master


def launch(emu: Emulator, name: str, **kwargs: object) -> pytest_sky.Cluster:
    return pytest_sky.launch(
        num_nodes=2, name=name, backend="kubernetes", backend_options={"kubeconfig": str(emu.kubeconfig_path)}, **kwargs
    )


def forwarder_of(name: str) -> kube_forwarder.Handle:
    handle = KubeRecord.load(StateStore().journal(name)).forwarder
    assert handle is not None
    return handle


def processes_running(module: str, cluster: str) -> list[int]:
    """Pids whose command line runs ``module`` (``-m``, the module's file, or ``-c`` code that
    imports it) for ``cluster``'s pods: other tests (xdist workers) have clusters of their own
    on this machine."""
    found, name = [], module.rsplit(".", 1)[-1]
    for pid in procs.pids():
        argv = procs.cmdline(pid) or []
        runs = module in argv or any(a.endswith(f"/{name}.py") or f"import {name}" in a for a in argv)
        if runs and any(cluster in a for a in argv):
            found.append(pid)
    return found


@pytest.fixture
def no_kubernetes_client(tmp_path: Path) -> dict[str, str]:
    """An environment in which importing the kubernetes client fails: whatever succeeds in
    it reached the pod through the forwarder, not through a proxy of its own."""
    fake = tmp_path / "blocked" / "kubernetes"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('the kubernetes client is blocked in this test')\n")
    path = os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def ssh(c: pytest_sky.Cluster, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = ["ssh", "-F", c.ssh_config, *args, c.name, "hostname"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=False)


def held_session(c: pytest_sky.Cluster, *args: str) -> subprocess.Popen[str]:
    """An ssh session to the head that stays open until killed, once it is open."""
    held = subprocess.Popen(
        ["ssh", "-F", c.ssh_config, *args, c.name, "echo up; exec sleep 60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert held.stdout is not None and held.stdout.readline() == "up\n", held.stderr
    return held


def end(held: subprocess.Popen[str]) -> None:
    if held.poll() is None:
        held.kill()
    held.wait()


def wait_gone(pid: int, timeout: float = 30.0) -> bool:
    """Whether process ``pid`` (not ours to reap) has ended within ``timeout``: its pidfd
    becomes readable when it exits."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


def test_no_connection_starts_a_process_that_loads_the_kubernetes_client(home: Path, emu: Emulator):
    """The shared master's ProxyCommand, raw connections and a handle in another process:
    none of them starts ``kube_proxy`` (most of a CPU second each)."""
    with launch(emu, "fwd-lean") as c:
        assert processes_running("pytest_sky.ssh.kube_proxy", c.name) == []
        for args in ([], RAW):
            proc = ssh(c, *args)
            assert proc.stdout.strip() == "fwd-lean-head", proc.stderr
        assert processes_running("pytest_sky.ssh.kube_proxy", c.name) == []


def test_an_open_connection_holds_its_stream_itself(home: Path, emu: Emulator):
    """The dialler hands ssh the stream's socket and exits (``ProxyUseFdpass``): no process
    per connection relays its bytes while it is open, the shared master's included."""
    with launch(emu, "fwd-fdpass") as c:
        for args in ([], RAW):
            held = held_session(c, *args)
            try:
                assert processes_running("pytest_sky.ssh.kube_dial", c.name) == []
                assert processes_running("pytest_sky.ssh.kube_proxy", c.name) == []
            finally:
                end(held)


# Opens the head's port-forward as the forwarder does, sees sshd's banner through it, and says
# whether the core API's class was loaded for it.
_OPEN_FORWARD = """
import dataclasses, json, sys
from pytest_sky.cluster_info import PortForward
from pytest_sky.ssh import kube_proxy
forward = kube_proxy.Forward(PortForward(**json.loads(sys.argv[1])))
banner = kube_proxy.peek_banner(forward.socket, 10, "head")
print(banner[:4].decode(), "kubernetes.client.api.core_v1_api" in sys.modules)
"""


def test_a_port_forward_opens_without_the_core_api_class(home: Path, emu: Emulator):
    """A forwarder (one per cluster) or a proxy opens its streams from the configuration
    alone: importing ``CoreV1Api`` was 1.1 of the 1.7 CPU-seconds a forwarder took to start."""
    import dataclasses
    import json

    plain = [sys.executable, "-c", "import sys, kubernetes; print('kubernetes.client.api.core_v1_api' in sys.modules)"]
    if subprocess.run(plain, capture_output=True, text=True, timeout=60, check=True).stdout.strip() == "True":
        import kubernetes

        pytest.skip(f"kubernetes {kubernetes.__version__} imports CoreV1Api with its package: nothing to spare")
    with launch(emu, "fwd-light") as c:
        route = c.info.head.route.port_forward
        assert route is not None
        argv = [sys.executable, "-c", _OPEN_FORWARD, json.dumps(dataclasses.asdict(route))]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert proc.stdout.split() == ["SSH-", "False"], proc.stdout + proc.stderr


def test_an_ssh_config_of_an_older_pytest_sky_still_connects(home: Path, emu: Emulator):
    """A cluster kept across an upgrade keeps its ssh config, whose ProxyCommand ran without
    ``ProxyUseFdpass``: then the dialler relays the session itself, with or without the
    forwarder."""
    older = [*RAW, "-o", "ProxyUseFdpass=no"]  # ssh takes the first value it is given
    with launch(emu, "fwd-older") as c:
        proc = ssh(c, *older)
        assert proc.stdout.strip() == "fwd-older-head", proc.stderr
        kube_forwarder.stop(forwarder_of(c.name))
        proc = ssh(c, *older)
        assert proc.stdout.strip() == "fwd-older-head", proc.stderr


def test_a_banner_an_older_forwarder_read_comes_first():
    """A kept cluster's forwarder of an older pytest-sky reads the pod's banner and sends it
    in its reply: an in-process client still reads the stream from the banner on."""
    reply = kube_dial.DialReply.decode(b"OK " + b"SSH-2.0-x\r\n".hex().encode() + b"\n")
    assert reply.error is None and reply.banner == b"SSH-2.0-x\r\n"
    assert kube_dial.DialReply.decode(kube_dial.DialReply().encode()).banner == b""
    ours, theirs = socket.socketpair()
    with theirs:
        dialled = kube_dial.Dialled(ours, reply.banner)
        theirs.sendall(b"rest")
        assert dialled.socket.recv(4) + dialled.socket.recv(64) + dialled.socket.recv(64) == b"SSH-2.0-x\r\nrest"
        theirs.shutdown(socket.SHUT_WR)
        dialled.close()


def test_twenty_raw_connections_at_once_all_get_through(home: Path, emu: Emulator):
    with launch(emu, "fwd-burst") as c, ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda _: ssh(c, *RAW), range(20)))
    assert [r.stdout.strip() for r in results] == ["fwd-burst-head"] * 20, [r.stderr for r in results]


def test_the_cli_of_another_process_is_served_by_the_launchs_forwarder(
    home: Path, emu: Emulator, no_kubernetes_client: dict[str, str]
):
    with launch(emu, "fwd-cli") as c:
        proc = subprocess.run(
            [SCRIPT, "ssh", c.name, "head", "--", "hostname"], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0 and proc.stdout.strip() == "fwd-cli-head", proc.stderr
        # A raw connection from a process that cannot load the kubernetes client at all.
        raw = ssh(c, *RAW, env=no_kubernetes_client)
        assert raw.stdout.strip() == "fwd-cli-head", raw.stderr
        # The CLI's own connection (exec, logs, queue) is the forwarder's too: no API client here.
        run = subprocess.run(
            [SCRIPT, "exec", c.name, "hostname"], capture_output=True, text=True, timeout=60, env=no_kubernetes_client
        )
        assert run.returncode == 0 and "fwd-cli-head" in run.stdout, run.stdout + run.stderr


def test_without_its_forwarder_a_connection_falls_back_to_the_proxy(home: Path, emu: Emulator):
    with launch(emu, "fwd-gone") as c:
        handle = forwarder_of(c.name)
        kube_forwarder.stop(handle)
        assert not os.path.exists(handle.socket)
        proc = ssh(c, *RAW)
        assert proc.stdout.strip() == "fwd-gone-head", proc.stderr
        # The fallback proxy relays an open session and ends with it: nothing is left behind.
        held = held_session(c, *RAW)
        try:
            (proxy,) = processes_running("pytest_sky.ssh.kube_proxy", c.name)
        finally:
            end(held)
        assert wait_gone(proxy), f"the fallback proxy {proxy} outlived its ssh"
        run = subprocess.run([SCRIPT, "exec", c.name, "hostname"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and "fwd-gone-head" in run.stdout, run.stdout + run.stderr  # opened in-process


def test_a_dropped_stream_leaves_the_forwarder_serving(home: Path, emu: Emulator):
    with launch(emu, "fwd-drop") as c:
        held = held_session(c, *RAW)
        try:
            emu.set_faults(drop_portforwards=True)
            assert held.wait(timeout=30) != 0  # that connection's stream is gone, and ssh says so
        finally:
            end(held)
        proc = ssh(c, *RAW)
        assert proc.stdout.strip() == "fwd-drop-head", proc.stderr


def test_a_pod_that_is_not_there_is_one_line_from_the_dialler(home: Path, emu: Emulator):
    with launch(emu, "fwd-nopod") as c:
        handle = forwarder_of(c.name)
        argv = shlex.split(kube_dial.command(handle.socket, ["--namespace", "default", "--pod", "fwd-nopod-nothere"]))
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 255 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("pytest-sky proxy: cannot reach default/fwd-nopod-nothere:22: "), line


def test_the_socket_is_the_users_alone(home: Path, emu: Emulator):
    with launch(emu, "fwd-mode") as c:
        path = forwarder_of(c.name).socket
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        code = (
            "import os, socket, sys\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    sys.exit(13)\n"
        )
        if os.geteuid() == 0:
            proc = subprocess.run([sys.executable, "-I", "-S", "-c", code, path], timeout=30, check=False)
            assert proc.returncode == 13


def test_a_kept_cluster_has_a_forwarder_process_that_down_stops(
    home: Path, emu: Emulator, no_kubernetes_client: dict[str, str]
):
    c = launch(emu, "fwd-kept", keep=True)
    try:
        handle = forwarder_of(c.name)
        assert handle.pid is not None and procs.is_alive(handle.pid, handle.start_time)
        assert handle.pid != os.getpid()
        raw = ssh(c, *RAW, env=no_kubernetes_client)
        assert raw.stdout.strip() == "fwd-kept-head", raw.stderr
    finally:
        c.down()
    assert not procs.is_alive(handle.pid, handle.start_time)
    assert not os.path.exists(handle.socket)


def test_the_reaper_removes_the_socket_of_a_killed_owners_forwarder(home: Path, emu: Emulator):
    code = (
        "import os, pytest_sky\n"
        "c = pytest_sky.launch(num_nodes=2, name='fwd-orphan', backend='kubernetes', "
        f"backend_options={{'kubeconfig': {str(emu.kubeconfig_path)!r}}})\n"
        "os._exit(0)  # the owner dies without tearing down: its forwarder thread with it\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    handle = forwarder_of("fwd-orphan")
    assert handle.pid is None and os.path.exists(handle.socket)
    assert f"Kubernetes forwarder socket {handle.socket} (its forwarder is gone)" in doctor.leftovers()
    assert "fwd-orphan" in pytest_sky.reap_orphans()
    assert not os.path.exists(handle.socket)
