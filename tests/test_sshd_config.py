"""The nodes' sshd_config (``pytest_sky.ssh.sshd``): one renderer, each backend's config as before."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pytest_sky.backends import kube_manifests
from pytest_sky.ssh import sshd

# What the local backend's sshd_config("198.18.0.2", <key>, PATH) wrote before the renderer.
# (KexAlgorithms since: only names OpenSSH 7.4 knows; AcceptEnv and SetEnv's PYTHONPATH since
# every Python process on a node says where it waits: issue 47.)
LOCAL = """\
ListenAddress 198.18.0.2:22
HostKey /state/clusters/c/nodes/0/ssh_host_ed25519_key
PidFile /run/sshd.pid
AuthorizedKeysFile .ssh/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes yes
UsePAM no
UseDNS no
PrintMotd no
PrintLastLog no
MaxStartups 100:30:200
MaxSessions 100
X11Forwarding no
AllowAgentForwarding no
KexAlgorithms curve25519-sha256,curve25519-sha256@libssh.org,ecdh-sha2-nistp256,diffie-hellman-group14-sha256
ClientAliveInterval 5
ClientAliveCountMax 3
AcceptEnv PSKY_JOB_SCOPE
SetEnv PATH=/opt/venv/bin:/usr/bin:/bin PYTHONPATH=/home/sky/.sky/python
Subsystem sftp internal-sftp
LogLevel ERROR
"""

# What a pod's BOOTSTRAP heredoc wrote before (R=/run/pytest-sky, the image's PATH expanded).
POD = """\
Port 22
HostKey /run/pytest-sky/ssh_host_ed25519_key
PidFile /run/pytest-sky/sshd.pid
AuthorizedKeysFile .ssh/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes yes
UsePAM no
UseDNS no
PrintMotd no
MaxStartups 100:30:200
MaxSessions 100
AllowAgentForwarding no
X11Forwarding no
KexAlgorithms curve25519-sha256,curve25519-sha256@libssh.org,ecdh-sha2-nistp256,diffie-hellman-group14-sha256
ClientAliveInterval 5
ClientAliveCountMax 3
AcceptEnv PSKY_JOB_SCOPE
SetEnv PATH=/usr/local/bin:/usr/bin:/bin PYTHONPATH=/root/.sky/python
Subsystem sftp internal-sftp
LogLevel ERROR
"""


def local_config(path_env: str = "/opt/venv/bin:/usr/bin:/bin") -> str:
    """The renderer called as the local backend calls it."""
    key = Path("/state/clusters/c/nodes/0/ssh_host_ed25519_key")
    return sshd.render(
        listen="198.18.0.2:22", host_key=str(key), pid_file="/run/sshd.pid", path_env=path_env, home="/home/sky"
    )


def pod_config(path_env: str = "/usr/local/bin:/usr/bin:/bin") -> str:
    """A pod's effective config: the Secret's file, then the line BOOTSTRAP appends."""
    return kube_manifests.sshd_config_text() + f"SetEnv PATH={path_env} PYTHONPATH=/root/.sky/python\n"


def test_the_local_config_is_what_it_was() -> None:
    assert local_config() == LOCAL


def test_the_pod_config_has_every_setting_it_had() -> None:
    # Only the order of two lines and the place of SetEnv moved; sshd reads them alike.
    assert sorted(pod_config().splitlines()) == sorted(POD.splitlines())
    assert "SetEnv" not in kube_manifests.sshd_config_text()  # the image's PATH is the pod's to add


def test_the_backends_differ_only_where_they_must() -> None:
    local = set(local_config().splitlines())
    pod = set(pod_config().splitlines())
    moved = {line.split()[0] for line in local ^ pod}
    assert moved == {"ListenAddress", "Port", "HostKey", "PidFile", "SetEnv", "PrintLastLog"}


def test_the_pod_takes_its_config_from_the_secret() -> None:
    boot = kube_manifests.BOOTSTRAP
    assert "<<" not in boot  # no heredoc: the config is rendered once, in Python
    assert f'cat "$S/{kube_manifests.SSHD_CONFIG_KEY}"' in boot
    assert 'echo "SetEnv PATH=$PATH PYTHONPATH=$HOME/.sky/python"; } >"$R/sshd_config"' in boot
    assert boot.rstrip().endswith('exec "$SSHD" -D -e -f "$R/sshd_config"')
    assert kube_manifests.SECRET_MOUNT == "/run/pytest-sky-secret" and "S=/run/pytest-sky-secret\n" in boot
    assert kube_manifests.RUNTIME_DIR == "/run/pytest-sky" and "R=/run/pytest-sky\n" in boot
    secret = kube_manifests.secret("c", "default", {kube_manifests.SSHD_CONFIG_KEY: b"x"}, launch="l")
    assert list(secret["data"]) == ["sshd_config"]


def test_a_bare_port_listens_everywhere_and_no_path_leaves_setenv_out() -> None:
    text = sshd.render(listen="2222", host_key="/k", pid_file="/p", path_env=None, print_last_log=False)
    assert text.splitlines()[0] == "Port 2222"
    assert "SetEnv" not in text and "PrintLastLog" not in text and text.endswith("LogLevel ERROR\n")


SSHD = shutil.which("sshd", path=os.pathsep.join(["/usr/sbin", "/sbin", os.environ.get("PATH", "")]))


@pytest.mark.skipif(
    os.geteuid() != 0 or SSHD is None or shutil.which("unshare") is None or shutil.which("ssh-keygen") is None,
    reason="needs root, OpenSSH sshd and ssh-keygen, and unshare",
)
@pytest.mark.parametrize("backend", ["local", "pod"])
def test_sshd_accepts_each_config_as_intended(backend: str, tmp_path: Path) -> None:
    """``sshd -T`` (parse, load the host key, print the effective config) in a mount namespace
    of its own with a private /run: sshd's privilege separation directory and the pod's
    host key path live there, and the host's /run is left alone."""
    key = tmp_path / "ssh_host_ed25519_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    if backend == "local":
        config = local_config("/opt/venv/bin:/usr/bin:/bin").replace("/state/clusters/c/nodes/0", str(tmp_path))
        config = config.replace("ListenAddress 198.18.0.2:22", "ListenAddress 127.0.0.1:22")  # an address it has
    else:
        config = pod_config("/opt/venv/bin:/usr/bin:/bin")
    (tmp_path / "sshd_config").write_text(config)
    script = (
        "mount -t tmpfs psky-test /run && mkdir -m 755 /run/sshd /run/pytest-sky && "
        'cp "$0/ssh_host_ed25519_key" /run/pytest-sky/ssh_host_ed25519_key && exec "$1" -T -f "$0/sshd_config"'
    )
    argv = ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script, str(tmp_path), str(SSHD)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    effective = set(out.stdout.splitlines())
    assert "Unsupported option" not in out.stderr
    expected = {
        "pubkeyauthentication yes",
        "passwordauthentication no",
        "kbdinteractiveauthentication no",
        "permitrootlogin without-password",
        "usepam no",
        "maxstartups 100:30:200",
        "maxsessions 100",
        "clientaliveinterval 5",
        "loglevel ERROR",
        "acceptenv PSKY_JOB_SCOPE",
    }
    assert {"setenv PATH=/opt/venv/bin:/usr/bin:/bin", "setenv PYTHONPATH=/root/.sky/python"} <= effective or {
        "setenv PATH=/opt/venv/bin:/usr/bin:/bin",
        "setenv PYTHONPATH=/home/sky/.sky/python",
    } <= effective, sorted(line for line in effective if line.startswith("setenv"))
    assert expected <= effective, sorted(expected - effective)
    if backend == "local":
        assert "listenaddress 127.0.0.1:22" in effective and "printlastlog no" in effective
    else:
        assert "port 22" in effective and "hostkey /run/pytest-sky/ssh_host_ed25519_key" in effective
        assert "pidfile /run/pytest-sky/sshd.pid" in effective


# Every key exchange OpenSSH 7.4 (the oldest we support: Ubuntu 18.04, RHEL 7) knows: its
# kex.c ``kexalgs`` table.  ssh and sshd refuse a whole config ("Bad SSH2 KexAlgorithms") that
# names one outside it, so a newer name (sntrup761x25519-sha512@openssh.com is 8.5+) would
# stop every node with an older image's sshd, and every client with an older ssh.
OPENSSH_7_4_KEX = {
    "diffie-hellman-group1-sha1",
    "diffie-hellman-group14-sha1",
    "diffie-hellman-group14-sha256",
    "diffie-hellman-group16-sha512",
    "diffie-hellman-group18-sha512",
    "diffie-hellman-group-exchange-sha1",
    "diffie-hellman-group-exchange-sha256",
    "ecdh-sha2-nistp256",
    "ecdh-sha2-nistp384",
    "ecdh-sha2-nistp521",
    "curve25519-sha256",
    "curve25519-sha256@libssh.org",
}
# Options that name algorithms; a new one needs its 7.4 set here before a config may use it.
ALGORITHM_OPTIONS = {"kexalgorithms": OPENSSH_7_4_KEX}
ALGORITHM_WORDS = ("algorithms", "ciphers", "macs", "keytypes")


def every_rendered_config() -> dict[str, str]:
    """Each config we write: both sshds, the client's and the nodes' own."""
    from pytest_sky import bootstrap
    from pytest_sky.cluster_info import NodeInfo, SshRoute
    from pytest_sky.ssh import config as ssh_config
    from pytest_sky.ssh.keys import ClusterKeys

    nodes = [
        NodeInfo(rank=r, name=f"n{r}", hostname=f"c-n{r}", ip=f"198.18.0.{r + 2}", route=SshRoute(f"198.18.0.{r + 2}"))
        for r in range(2)
    ]
    keys = ClusterKeys.generate("c", 2)
    client = ssh_config.render(
        [ssh_config.HostEntry(alias="c", hostname="c-n0", proxy_command="proxy")],
        identity_file="/k",
        known_hosts="/kh",
    )
    return {
        "local sshd": local_config(),
        "pod sshd": pod_config(),
        "client": client,
        "node": bootstrap.peer_files("c", nodes, keys)[".ssh/config"][0].decode(),
    }


def test_every_algorithm_named_is_one_openssh_7_4_knows_fast_one_first() -> None:
    for where, text in every_rendered_config().items():
        named = {}
        for line in text.splitlines():
            word, _, value = line.strip().partition(" ")
            if any(w in word.lower() for w in ALGORITHM_WORDS):
                assert word.lower() in ALGORITHM_OPTIONS, f"{where}: {word} has no OpenSSH 7.4 set to check against"
                named[word.lower()] = value.split(",")
        assert named["kexalgorithms"][0] == "curve25519-sha256", where
        for option, names in named.items():
            unknown = set(names) - ALGORITHM_OPTIONS[option]
            assert not unknown, f"{where}: {option} names {sorted(unknown)}, which OpenSSH 7.4 rejects"


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client")
def test_two_launches_of_one_name_never_share_an_ssh_master(tmp_path: Path) -> None:
    """Two clusters of one name (two namespaces or contexts, two state directories) have the
    same head name and port: ssh's ``%C`` alone gave them one ControlPath, so the second
    cluster's commands ran on the first one's head through its master."""
    from pytest_sky import bootstrap
    from pytest_sky.cluster_info import NodeInfo, SshRoute
    from pytest_sky.ssh.keys import ClusterKeys

    route = SshRoute(hostname="twin-head", proxy_command="python -m pytest_sky.ssh.kube_proxy --pod twin-head")
    nodes = [NodeInfo(rank=0, name="head", hostname="twin-head", ip="10.0.0.5", route=route)]
    paths = []
    for launch in ("a", "b"):
        (tmp_path / launch).mkdir()
        cfg = bootstrap.write_client_files(
            tmp_path / launch, "twin", nodes, ClusterKeys.generate("twin", 1), multiplex=True
        )
        out = subprocess.run(["ssh", "-G", "-F", str(cfg), "twin"], capture_output=True, text=True, check=True)
        (path,) = [line.split(" ", 1)[1] for line in out.stdout.splitlines() if line.startswith("controlpath ")]
        paths.append(path)
        # ssh binds "<path>.<16 random chars>" first; macOS allows 104 bytes, Linux 108.
        assert len(path.encode()) + 17 < 104, path
    assert paths[0] != paths[1], paths


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("OpenSSH_9.2p1 Debian-2+deb12u10, OpenSSL 3.0.19", ("-D", "-e", "-r")),
        ("OpenSSH_7.4p1, OpenSSL 1.0.2k-fips", ("-D", "-e", "-r")),
        ("OpenSSH_9.8p1, OpenSSL 3.3.1", ("-D", "-e")),  # sshd-session: no -r any more
        ("OpenSSH_10.0p2", ("-D", "-e")),
        ("sshd: illegal option -- V", ("-D", "-e")),  # no version known: nothing it may lack
    ],
)
def test_nodes_run_sshd_without_a_re_exec_only_where_sshd_has_the_option(tmp_path: Path, version, expected) -> None:
    fake = tmp_path / "sshd"
    fake.write_text(f"#!/bin/sh\necho '{version}' >&2\nexit 1\n")
    fake.chmod(0o755)
    assert sshd.daemon_args(str(fake)) == expected
