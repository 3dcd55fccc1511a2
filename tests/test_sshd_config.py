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
KexAlgorithms curve25519-sha256,curve25519-sha256@libssh.org,sntrup761x25519-sha512@openssh.com
ClientAliveInterval 5
ClientAliveCountMax 3
SetEnv PATH=/opt/venv/bin:/usr/bin:/bin
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
KexAlgorithms curve25519-sha256,curve25519-sha256@libssh.org,sntrup761x25519-sha512@openssh.com
ClientAliveInterval 5
ClientAliveCountMax 3
SetEnv PATH=/usr/local/bin:/usr/bin:/bin
Subsystem sftp internal-sftp
LogLevel ERROR
"""


def local_config(path_env: str = "/opt/venv/bin:/usr/bin:/bin") -> str:
    """The renderer called as the local backend calls it."""
    key = Path("/state/clusters/c/nodes/0/ssh_host_ed25519_key")
    return sshd.render(listen="198.18.0.2:22", host_key=str(key), pid_file="/run/sshd.pid", path_env=path_env)


def pod_config(path_env: str = "/usr/local/bin:/usr/bin:/bin") -> str:
    """A pod's effective config: the Secret's file, then the line BOOTSTRAP appends."""
    return kube_manifests.sshd_config_text() + f"SetEnv PATH={path_env}\n"


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
    assert 'echo "SetEnv PATH=$PATH"; } > "$R/sshd_config"' in boot
    assert boot.rstrip().endswith('exec "$SSHD" -D -e -f "$R/sshd_config"')
    assert kube_manifests.SECRET_MOUNT == "/run/pytest-sky-secret" and "S=/run/pytest-sky-secret\n" in boot
    assert kube_manifests.RUNTIME_DIR == "/run/pytest-sky" and "R=/run/pytest-sky\n" in boot
    secret = kube_manifests.secret("c", "default", {kube_manifests.SSHD_CONFIG_KEY: b"x"})
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
        "setenv PATH=/opt/venv/bin:/usr/bin:/bin",
    }
    assert expected <= effective, sorted(expected - effective)
    if backend == "local":
        assert "listenaddress 127.0.0.1:22" in effective and "printlastlog no" in effective
    else:
        assert "port 22" in effective and "hostkey /run/pytest-sky/ssh_host_ed25519_key" in effective
        assert "pidfile /run/pytest-sky/sshd.pid" in effective
