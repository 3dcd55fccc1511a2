"""Security properties a user relies on without checking: host keys verified on every hop,
private keys private, sshd key-only, clusters isolated from each other, and task inputs
passed without shell injection.  (What a node sees of the host's files and what it reaches:
``tests/test_node_view.py``, ``tests/test_node_network.py``.)

Two clusters are shared by the module (A: 2 nodes, B: 1 node) under a private
``PYTEST_SKY_HOME``; tests that tamper with a file restore it in ``finally``.  Traffic only
goes to 127.0.0.1 and the clusters' own 198.18.0.0/15 nodes; the checks of addresses outside
198.18.0.0/15 are route lookups (``ip route get``), which send nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky import Task
from pytest_sky.errors import RunError
from pytest_sky.ssh.keys import generate
from tests.leftovers import host_settings_lock

REPO = Path(__file__).resolve().parent.parent
THIS_FILE = Path(__file__).resolve()
CLI = Path(sys.executable).with_name("pytest-sky")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("sshd") is None, reason="needs root and OpenSSH sshd (namespace nodes)"
)


# ----------------------------------------------------------------------------------- fixtures


class Pair:
    """The two module clusters and where their files are."""

    def __init__(self, home: Path, a: pytest_sky.Cluster, b: pytest_sky.Cluster) -> None:
        self.home = home
        self.a = a
        self.b = b

    def cluster_dir(self, cluster: pytest_sky.Cluster) -> Path:
        return Path(cluster.ssh_config).parent

    def node_home(self, cluster: pytest_sky.Cluster, rank: int) -> Path:
        return self.cluster_dir(cluster) / "nodes" / str(rank) / "home"

    def node_root(self, cluster: pytest_sky.Cluster, rank: int) -> Path:
        return self.cluster_dir(cluster) / "nodes" / str(rank)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    home = tmp_path_factory.mktemp("sec-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTEST_SKY_HOME", str(home))
        tag = os.getpid() % 10000
        a = b = None
        try:
            a = pytest_sky.launch(num_nodes=2, name=f"seca-{tag}")
            b = pytest_sky.launch(num_nodes=1, name=f"secb-{tag}")
            yield Pair(home, a, b)
        finally:
            for cluster in (b, a):
                if cluster is not None:
                    cluster.down()


def head_only(cmd: str, **kwargs: object) -> Task:
    return Task(run=cmd, num_nodes=1, **kwargs)  # type: ignore[arg-type]


def ssh_client_cmd(cfg: str, target: str, *extra: str) -> list[str]:
    """The user's ``ssh -F cluster.ssh_config NAME true``, on a fresh connection (no shared master)."""
    return ["ssh", "-F", cfg, "-o", "ControlMaster=no", "-o", "ControlPath=none", *extra, target, "true"]


def key_body_lines(pem: bytes | str) -> list[str]:
    """The secret part of an OpenSSH private key: its base64 lines."""
    text = pem.decode() if isinstance(pem, bytes) else pem
    return [line for line in text.splitlines() if line and not line.startswith("-----")]


def leaked(text: str, secrets: list[str]) -> list[str]:
    return [s for s in secrets if s in text]


def replace_key_on_line(path: Path, ip: str, new_key: str) -> None:
    """Give the known_hosts entry that names ``ip`` a different host key."""
    lines = path.read_text().splitlines()
    changed = False
    for i, line in enumerate(lines):
        names, _, _ = line.partition(" ")
        if ip in names.split(","):
            lines[i] = f"{names} {new_key}"
            changed = True
    assert changed, f"no known_hosts entry for {ip} in {path}: {lines}"
    path.write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------- host key checking


def _forbidden_patterns() -> list[re.Pattern[str]]:
    # Built from pieces so that this file's own source does not match them.
    shk, ukh = "StrictHost" + "KeyChecking", "UserKnown" + "HostsFile"
    return [
        re.compile(shk + r"\s*[= ]\s*['\"]?(no|off|accept-new)\b", re.IGNORECASE),
        re.compile(ukh + r"\s*[= ]\s*['\"]?/dev/null", re.IGNORECASE),
        re.compile("AutoAdd" + "Policy"),
        re.compile("WarningPolicy" + r"\(\)"),
    ]


def test_no_code_in_the_repository_turns_host_key_checking_off() -> None:
    found = []
    patterns = _forbidden_patterns()
    for top in ("pytest_sky", "tests", "smoke", "examples", "bench", "scripts"):
        root = REPO / top
        if not root.is_dir():
            continue
        for path in root.rglob("*"):
            if not path.is_file() or "__pycache__" in path.parts or path.resolve() == THIS_FILE:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # binary data, not code
            for n, line in enumerate(text.splitlines(), 1):
                if any(p.search(line) for p in patterns):
                    found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, "host key checking disabled in:\n" + "\n".join(found)


def _assert_strict(config_text: str, where: str) -> None:
    settings: dict[str, list[str]] = {}
    for line in config_text.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and not parts[0].startswith("#"):
            settings.setdefault(parts[0].lower(), []).append(parts[1].strip())
    strict = settings.get("stricthostkeychecking", [])
    assert strict and all(v == "yes" for v in strict), f"{where}: StrictHostKeyChecking {strict}"
    known = settings.get("userknownhostsfile", [])
    assert known and not any("/dev/null" in v for v in known), f"{where}: UserKnownHostsFile {known}"


def test_client_and_every_node_check_host_keys(pair: Pair) -> None:
    for cluster in (pair.a, pair.b):
        _assert_strict(Path(cluster.ssh_config).read_text(), cluster.ssh_config)
        for rank in range(cluster.num_nodes):
            cfg = pair.node_home(cluster, rank) / ".ssh" / "config"
            _assert_strict(cfg.read_text(), str(cfg))
    # and the check is effective as written: ssh itself reads it that way
    out = subprocess.run(
        ["ssh", "-G", "-F", pair.a.ssh_config, pair.a.name], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    assert "stricthostkeychecking true" in out, out
    assert "userknownhostsfile /dev/null" not in out, out


def test_head_refuses_a_worker_whose_host_key_changed(pair: Pair) -> None:
    worker_ip = pair.a.node_ips[1]
    cmd = f"ssh {worker_ip} true && echo REACHED-WORKER"
    ok = pair.a.run(head_only(cmd), timeout=60)
    assert ok.returncode == 0 and "REACHED-WORKER" in ok.output, ok.output  # the control

    kh = pair.node_home(pair.a, 0) / ".ssh" / "known_hosts"
    original = kh.read_bytes()
    try:
        replace_key_on_line(kh, worker_ip, generate("impostor").public_key)
        bad = pair.a.run(head_only(cmd), timeout=60)
    finally:
        kh.write_bytes(original)
    assert bad.returncode != 0, bad.output
    assert "REACHED-WORKER" not in bad.output
    assert "Host key verification failed" in bad.output, bad.output


def test_client_ssh_refuses_a_head_whose_host_key_changed(pair: Pair) -> None:
    cfg = pair.a.ssh_config
    ok = subprocess.run(ssh_client_cmd(cfg, pair.a.name), capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr

    kh = pair.cluster_dir(pair.a) / "known_hosts"
    original = kh.read_bytes()
    try:
        replace_key_on_line(kh, pair.a.node_ips[0], generate("impostor").public_key)
        bad = subprocess.run(ssh_client_cmd(cfg, pair.a.name), capture_output=True, text=True, timeout=60)
    finally:
        kh.write_bytes(original)
    assert bad.returncode == 255, (bad.returncode, bad.stderr)
    assert "Host key verification failed" in bad.stderr, bad.stderr


def test_api_connection_refuses_a_head_whose_host_key_changed(pair: Pair) -> None:
    kh = pair.cluster_dir(pair.b) / "known_hosts"
    original = kh.read_bytes()
    try:
        replace_key_on_line(kh, pair.b.node_ips[0], generate("impostor").public_key)
        fresh = pytest_sky.get_cluster(pair.b.name)  # a new client: a new connection
        with pytest.raises(RunError, match="host key") as info:
            fresh.run("echo SHOULD-NOT-RUN", timeout=60)
    finally:
        kh.write_bytes(original)
    assert "\n" not in str(info.value)
    assert pair.b.node_ips[0] in str(info.value)


# ------------------------------------------------------------------------------ private keys


def _private_key_files(pair: Pair, cluster: pytest_sky.Cluster) -> list[Path]:
    files = [pair.cluster_dir(cluster) / "id_ed25519"]
    for rank in range(cluster.num_nodes):
        files.append(pair.node_home(cluster, rank) / ".ssh" / "id_ed25519")
        files.append(pair.node_root(cluster, rank) / "ssh_host_ed25519_key")
    return files


def _secrets(pair: Pair) -> list[str]:
    lines: list[str] = []
    for cluster in (pair.a, pair.b):
        for path in _private_key_files(pair, cluster):
            lines += key_body_lines(path.read_bytes())
    assert lines
    return lines


def test_private_keys_are_0600(pair: Pair) -> None:
    wrong = []
    for cluster in (pair.a, pair.b):
        for path in _private_key_files(pair, cluster):
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode != 0o600:
                wrong.append(f"{path}: {mode:o}")
    assert not wrong, wrong


def test_private_keys_never_appear_in_run_output_status_or_logs(pair: Pair) -> None:
    secrets = _secrets(pair)
    result = pair.a.run("ls -la ~/.ssh; echo done; exit 3", timeout=60)
    assert result.returncode == 3 and "done" in result.output
    assert not leaked(result.output + str(result), secrets)

    env = {**os.environ, "CI": "1", "PYTEST_SKY_HOME": str(pair.home)}
    status = subprocess.run([str(CLI), "status", "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert status.returncode == 0, status.stderr
    assert {row["name"] for row in json.loads(status.stdout)} >= {pair.a.name, pair.b.name}
    assert not leaked(status.stdout + status.stderr, secrets)

    key_names = {"id_ed25519", "ssh_host_ed25519_key"}
    found = []
    for path in pair.home.rglob("*"):
        if path.name in key_names or not path.is_file() or path.is_symlink():
            continue
        try:
            text = path.read_bytes().decode("utf-8", "replace")
        except OSError:
            continue
        if leaked(text, secrets):
            found.append(str(path))
    assert not found, f"private key text in: {found}"


def test_a_failing_test_report_does_not_show_the_key(pytester: pytest.Pytester, monkeypatch, tmp_path) -> None:
    home = tmp_path / "skyhome"
    monkeypatch.setenv("PYTEST_SKY_HOME", str(home))
    for key in list(os.environ):
        if key.startswith(("PYTEST_SKY_", "PYTEST_XDIST_")) and key != "PYTEST_SKY_HOME":
            monkeypatch.delenv(key)
    keep = tmp_path / "key.txt"
    monkeypatch.setenv("SEC_KEY_COPY", str(keep))
    pytester.makepyfile(
        """
        import os
        import shutil
        from pathlib import Path

        import pytest


        def _save_key(cluster):
            shutil.copy(Path(cluster.ssh_config).parent / "id_ed25519", os.environ["SEC_KEY_COPY"])


        @pytest.mark.multinode(num_nodes=2)
        def test_fails(sky_cluster):
            _save_key(sky_cluster)
            result = sky_cluster.run("cat ~/.ssh/id_ed25519.pub; exit 1")
            assert result.returncode == 0, result.output
        """
    )
    try:
        result = pytester.runpytest_subprocess("-l", "-vv", "-rA", timeout=240)
    finally:
        for d in sorted((home / "clusters").iterdir()) if (home / "clusters").is_dir() else []:
            try:
                pytest_sky.get_cluster(d.name).down()
            except pytest_sky.SkyError:
                pass
    result.assert_outcomes(failed=1)
    secrets = key_body_lines(keep.read_bytes())
    text = result.stdout.str() + result.stderr.str()
    assert "ssh-ed25519" in text  # the failure report did show the run's output
    assert not leaked(text, secrets), text


# ---------------------------------------------------------------------------------------- sshd


def test_sshd_refuses_passwords(pair: Pair) -> None:
    res = subprocess.run(
        ssh_client_cmd(
            pair.a.ssh_config,
            pair.a.name,
            "-o",
            "PreferredAuthentications=password",
            "-o",
            "PubkeyAuthentication=no",
            "-o",
            "BatchMode=yes",
            "-o",
            "LogLevel=ERROR",
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 255, (res.returncode, res.stderr)
    assert "Permission denied" in res.stderr, res.stderr


def test_sshd_effective_config_is_key_only(pair: Pair) -> None:
    # `sshd -T` on each node itself (it needs the node's /run/sshd), into the node's home
    sshd = shutil.which("sshd")
    for cluster in (pair.a, pair.b):
        cfgs = pair.cluster_dir(cluster) / "nodes"
        dump = f"{sshd} -T -f {cfgs}/$SKYPILOT_NODE_RANK/sshd_config > ~/sshd-T"
        res = cluster.run(dump, timeout=60)
        assert res.returncode == 0, res.output
        for rank in range(cluster.num_nodes):
            text = (pair.node_home(cluster, rank) / "sshd-T").read_text()
            settings = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
            where = f"{cluster.name} rank {rank}"
            assert settings["permitrootlogin"] in ("without-password", "prohibit-password"), where
            assert settings["passwordauthentication"] == "no", where
            assert settings["kbdinteractiveauthentication"] == "no", where
            assert settings["pubkeyauthentication"] == "yes", where


def test_each_cluster_has_its_own_key(pair: Pair) -> None:
    pub_a = pair.node_home(pair.a, 0) / ".ssh" / "id_ed25519.pub"
    pub_b = pair.node_home(pair.b, 0) / ".ssh" / "id_ed25519.pub"
    key_a, key_b = (p.read_text().split()[1] for p in (pub_a, pub_b))
    assert key_a != key_b
    b_ip = pair.b.node_ips[0]
    common = ["ssh", "-F", "/dev/null", "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes"]
    common += [
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={pair.cluster_dir(pair.b) / 'known_hosts'}",
    ]
    common += ["-o", "GlobalKnownHostsFile=none", "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR"]
    own = subprocess.run(
        [*common, "-i", str(pair.cluster_dir(pair.b) / "id_ed25519"), f"root@{b_ip}", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert own.returncode == 0, own.stderr  # the control: B's key opens B
    other = subprocess.run(
        [*common, "-i", str(pair.cluster_dir(pair.a) / "id_ed25519"), f"root@{b_ip}", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert other.returncode == 255, other.stderr
    assert "Permission denied" in other.stderr, other.stderr


# ----------------------------------------------------------------------------------- isolation


def test_a_node_cannot_reach_another_cluster(pair: Pair) -> None:
    b_ip = pair.b.node_ips[0]
    probe = f"python3 -c 'import socket; socket.create_connection((\"{b_ip}\", 22), 2)'"
    res = pair.a.run(head_only(probe), timeout=60)
    assert res.returncode != 0, res.output
    assert "Network is unreachable" in res.output, res.output


def test_a_node_is_routed_out_only_through_its_clusters_gateway(pair: Pair) -> None:
    """Everything outside its cluster goes to the gateway at .1, which carries only what may
    go out (``tests/test_node_network.py``); a route lookup: nothing is sent."""
    gw = pair.a.node_ips[0].rsplit(".", 1)[0] + ".1"
    res = pair.a.run(head_only("ip route get 203.0.113.1; ip route get 198.19.255.254"), timeout=60)
    assert res.returncode == 0 and res.output.count(f"via {gw} dev eth0") == 2, res.output


# -------------------------------------------------------------------------- no shell injection


def test_envs_and_task_name_arrive_literally(pair: Pair) -> None:
    # Where a rank writes is its own node: the canaries and the dumps go to the node's home,
    # which the host sees at pair.node_home.
    canary = "~/canary"
    out = "~/out"
    values = {
        "V_SUBST": f"$(touch {canary}1)",
        "V_QUOTE": "'; rm -rf ~'; touch " + str(canary) + "2; '",
        "V_BACKTICK": f"`touch {canary}3`",
        "V_NEWLINE": f"line one\n$(touch {canary}4)\nline three\n",
        "V_DQUOTE": f'"; touch {canary}5; echo "',
        "V_BIG": ("0123456789abcdef" * 6400)[: 100 * 1024],
    }
    dump = f"mkdir -p {out}; " + "; ".join(f"printf '%s' \"${name}\" > {out}/{name}" for name in values)
    half = dict(list(values.items())[:3])
    rest = dict(list(values.items())[3:])
    task = Task(run=dump, num_nodes=2, envs=half)
    res = pair.a.run(task, env=rest, timeout=60)
    assert res.returncode == 0, res.output
    for rank in range(2):
        for name, value in values.items():
            got = (pair.node_home(pair.a, rank) / "out" / name).read_text()
            assert got == value, (rank, name, got[:200])
        assert not list(pair.node_home(pair.a, rank).glob("canary*"))
    assert (pair.node_home(pair.a, 0) / ".ssh").is_dir()  # `rm -rf ~` did not run either

    name = 'it\'s "q" $(touch ~/c1) `touch ~/c2`'
    named = pair.a.run(head_only("echo NAMED", name=name), timeout=60)
    assert named.returncode == 0, named.output
    assert f"({name}, pid=" in named.output, named.output
    assert not (pair.node_home(pair.a, 0) / "c1").exists()
    assert not (pair.node_home(pair.a, 0) / "c2").exists()


def test_a_root_task_cannot_route_through_a_forwarding_host_to_another_cluster(tmp_path: Path) -> None:
    """A task given NET_ADMIN (as a pod can be) may change its routes: to another cluster
    through the host's end of its cluster's link (.254), or through its gateway.  On a host
    that forwards IPv4 (Docker and VPN hosts do), the host would route it on; the gateway
    forwards nothing to the host that the host did not start, and has no route to another
    cluster, so it reaches nothing outside its cluster.

    The host's ``ip_forward`` is set to 1 for this test (before the clusters exist, as on such
    a host) and restored after it."""
    flag = Path("/proc/sys/net/ipv4/ip_forward")
    tag = os.getpid() % 10000
    a = b = None
    with pytest.MonkeyPatch.context() as mp, host_settings_lock():
        mp.setenv("PYTEST_SKY_HOME", str(tmp_path / "state"))
        before = flag.read_text().strip()
        try:
            flag.write_text("1")
            a = pytest_sky.launch(num_nodes=2, name=f"fwda-{tag}", capabilities=("NET_ADMIN",))
            b = pytest_sky.launch(num_nodes=1, name=f"fwdb-{tag}", capabilities=("NET_ADMIN",))
            subnet_a, subnet_b = (c.node_ips[0].rsplit(".", 1)[0] for c in (a, b))
            connect = f"timeout 5 python3 -c 'import socket; socket.create_connection((\"{b.node_ips[0]}\", 22), 3)'"
            for via in (f"{subnet_a}.254", f"{subnet_a}.1"):
                probe = f"ip route replace {subnet_b}.0/24 via {via} && {connect}"
                res = a.run(head_only(probe), timeout=60)
                assert res.returncode != 0, f"a node reached another cluster through {via}: {res.output}"
            assert a.run("true").returncode == 0  # its own cluster still works
        finally:
            flag.write_text(before)
            for cluster in (b, a):
                if cluster is not None:
                    cluster.down()
