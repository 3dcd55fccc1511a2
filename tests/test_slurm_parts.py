"""The Slurm backend's parts that need no Slurm: where the site is (its SSH config), who owns
an allocation (its job comment), what is asked of sbatch, and how each can be wrong in one
line.  What they do against a real Slurm is tests/test_slurm.py's."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from pytest_sky.backends import slurm_steps
from pytest_sky.backends.slurm_owner import Owner, boot_id
from pytest_sky.backends.slurm_site import Login, Site, SlurmUnreachableError, encoded, hosts, locate
from pytest_sky.errors import ResourcesError
from pytest_sky.resources import Resources
from pytest_sky.settings import SettingsError, resolve

CONFIG = """\
# a site
Host login1 login2
  HostName login.example.org
  User me
Host *.example.org !bastion
  ProxyJump bastion
host = edge
"""


def test_hosts_are_the_config_names_without_patterns() -> None:
    assert hosts(CONFIG) == ["login1", "login2", "edge"]


def test_a_site_is_the_only_host_or_the_one_named(tmp_path: Path) -> None:
    one = tmp_path / "one"
    one.write_text("Host cluster-a\n  HostName 192.0.2.1\n")
    assert locate(str(one), None) == Site(str(one), "cluster-a")
    many = tmp_path / "many"
    many.write_text(CONFIG)
    assert locate(str(many), "edge") == Site(str(many), "edge")


@pytest.mark.parametrize(
    ("text", "cluster", "message"),
    [
        ("Host a b\n", None, "{path} names 2 hosts (a, b): pick one with --slurm-cluster"),
        ("Host a\n", "z", "--slurm-cluster z is not a Host of {path} (its hosts: a)"),
        ("# nothing\n", None, "{path} names no Host: add the login node as one (Host NAME, HostName ...)"),
    ],
)
def test_a_config_that_names_no_one_login_node_is_one_line(tmp_path, text, cluster, message) -> None:
    path = tmp_path / "config"
    path.write_text(text)
    with pytest.raises(SlurmUnreachableError) as info:
        locate(str(path), cluster)
    assert str(info.value) == message.format(path=path)


def test_without_a_config_this_machine_is_the_login_node_only_where_it_has_sbatch(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.slurm/config there
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmUnreachableError) as info:
        locate(None, None)
    assert str(info.value) == (
        "no Slurm cluster to use: write its login node as a Host in ~/.slurm/config (SkyPilot's file), "
        "or point PYTEST_SKY_SLURM_CONFIG at an SSH config that has one"
    )
    (tmp_path / "sbatch").write_text("#!/bin/sh\n")
    (tmp_path / "sbatch").chmod(0o755)
    assert locate(None, None) == Site(None, None)
    with pytest.raises(SlurmUnreachableError) as info:
        locate(str(tmp_path / "missing"), None)
    assert "does not exist" in str(info.value)


def test_the_login_command_reads_the_same_to_any_login_shell() -> None:
    """One line, every multi-line word in base64 inside single quotes: what csh accepts too."""
    argv = Login(Site("/c", "h")).argv("submit", encoded("a\nb"), "it's")
    assert argv[:7] == ["ssh", "-F", "/c", "-T", "-o", "BatchMode=yes", "--"]
    remote = argv[-1]
    assert "\n" not in remote and remote.startswith("exec bash -c 'eval ")
    assert Login(Site(None, None)).argv("check")[:2] == ["bash", "-c"]
    with pytest.raises(ValueError):
        Login(Site("/c", "h")).argv("submit", "a\nb")
    assert Login(Site(None, None)).proxy_command("10.0.0.2", 2222) is None
    proxy = Login(Site("/c", "h")).proxy_command("10.0.0.2", 2222)
    assert proxy == "ssh -F /c -T -o BatchMode=yes -W 10.0.0.2:2222 h"


def test_the_owner_record_round_trips_and_judges_only_this_machines_owners() -> None:
    me = Owner.this_process("ab12", keep=False)
    assert Owner.parse(me.comment()) == me
    assert not me.gone()  # this very process
    assert Owner.parse("something a user wrote") is None
    dead = Owner(socket.gethostname(), boot_id(), 2**22 + 7, 1, "ab12", keep=False)
    assert dead.gone()
    assert not Owner("elsewhere", boot_id(), 2**22 + 7, 1, "ab12", keep=False).gone()  # not ours to judge
    assert not Owner(socket.gethostname(), boot_id(), 2**22 + 7, 1, "ab12", keep=True).gone()  # kept
    assert Owner(socket.gethostname(), "0-before-a-reboot", os.getpid(), 1, "ab12", keep=False).gone()


def test_sbatch_is_asked_for_one_task_per_node_with_the_resources_and_the_site_options() -> None:
    res = Resources.from_kwargs(cpus="3", memory="2.5", accelerators="A100:2")
    placement = slurm_steps.Placement("gpu", "proj", "high", "0:30:00")
    gpus = slurm_steps.gres(res, ["gpu:a100:4(S:0-1)", "gpu:h100:8"])
    assert gpus == "gpu:a100:2"  # the site's spelling: GRES types are case-sensitive
    options = slurm_steps.sbatch_options("pytest-sky-c", 3, res, placement, "pytest-sky owner=...", gpus)
    assert options == [
        "--job-name=pytest-sky-c",
        "--nodes=3",
        "--ntasks-per-node=1",
        "--time=0:30:00",
        "--comment=pytest-sky owner=...",
        "--output=/dev/null",
        "--no-requeue",
        "--cpus-per-task=3",
        "--mem=2560M",
        "--gres=gpu:a100:2",
        "--partition=gpu",
        "--account=proj",
        "--qos=high",
    ]
    assert slurm_steps.gres(Resources.from_kwargs(accelerators="T4:0.5"), []) == "gpu:T4:1"
    assert slurm_steps.gres(Resources(), ["gpu:t4:1"]) is None


@pytest.mark.parametrize("limit", ["60", "1:00:00", "2-00", "1-12:30:00", "45:00"])
def test_time_limits_in_slurms_forms_are_taken(limit: str) -> None:
    assert slurm_steps.check_time(limit) == limit


def test_a_time_limit_slurm_would_refuse_is_one_line() -> None:
    with pytest.raises(ResourcesError) as info:
        slurm_steps.check_time("an hour")
    assert str(info.value) == (
        "--slurm-time 'an hour' is not a Slurm time limit: give minutes, HH:MM:SS or D-HH:MM:SS (e.g. 1:00:00)"
    )


def test_the_slurm_switch_and_settings_reach_the_backend() -> None:
    chosen = resolve(slurm=True, environ={"PYTEST_SKY_SLURM_PARTITION": "debug", "PYTEST_SKY_SLURM_TIME": "10"})
    assert chosen.backend == "slurm" and chosen.sources["backend"] == "--slurm"
    assert chosen.backend_options() == {"partition": "debug", "time_limit": "10"}
    assert "slurm_partition=debug (from PYTEST_SKY_SLURM_PARTITION)" in chosen.describe()
    assert resolve(environ={"PYTEST_SKY_SLURM": "1"}).backend == "slurm"
    assert resolve(backend="local", environ={"PYTEST_SKY_SLURM": "1"}).backend == "local"  # the command line wins
    with pytest.raises(SettingsError) as info:
        resolve(slurm=True, kubernetes=True, environ={})
    assert str(info.value) == "--kubernetes and --slurm choose different backends: give one"


def test_the_node_files_carry_every_host_key_and_an_sshd_config_without_a_port(tmp_path) -> None:
    import io
    import tarfile

    from pytest_sky.ssh.keys import ClusterKeys

    keys = ClusterKeys.generate("c", 2)
    data = slurm_steps.node_files("/tmp/pytest-sky-c-1", keys, {".ssh/authorized_keys": (b"k\n", 0o600)})
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        config = tar.extractfile("sshd_config").read().decode()  # type: ignore[union-attr]
    assert {"home/.ssh/authorized_keys", "host_keys/0", "host_keys/1", "sshd_config"} <= set(members)
    assert members["host_keys/1"].mode == 0o600
    assert "Port" not in config and "ListenAddress" not in config
    assert "AuthorizedKeysFile /tmp/pytest-sky-c-1/home/.ssh/authorized_keys" in config


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_rank_prelude_drops_the_steps_own_slurm_variables(tmp_path) -> None:
    import subprocess

    argv = slurm_steps.step_argv("7", "n1", Resources())
    prelude = argv[argv.index("-c") + 1]
    env = {
        "PATH": os.environ["PATH"],
        "SLURM_JOB_ID": "7",
        "SLURM_JOBID": "7",
        "SLURM_NTASKS": "1",
        "SLURM_NNODES": "1",
        "SLURM_STEP_ID": "3",
        "SLURM_CONF": "/etc/slurm/slurm.conf",
    }
    out = subprocess.run(["bash", "-c", prelude, "slurm-step", "env"], env=env, capture_output=True, text=True).stdout
    kept = sorted(line for line in out.splitlines() if line.startswith("SLURM"))
    assert kept == ["SLURM_CONF=/etc/slurm/slurm.conf", "SLURM_JOB_ID=7"]
