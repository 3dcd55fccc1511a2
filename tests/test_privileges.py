"""A node holds a pod's privileges, never root on the user's machine.

One probe (``tests/privilege_probe.py``: what ML setup scripts do, and what would reach the
machine under a node) runs on a local node and on an emulated pod; both tables must equal
what a pod of ours gets from a container runtime under Pod Security baseline on this
machine's kernel, and the host's own values must be the same afterwards.  Then: a setup
that tunes THP fails as on a cluster, more is given only when asked (``capabilities=``,
``privileged=``), and Pod Security's refusal of it names what was asked.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky import gpus
from pytest_sky.backends import privileges
from pytest_sky.backends.confine import CAPABILITY_BITS
from pytest_sky.errors import ProvisionError, TaskError
from pytest_sky.task import Task

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="nodes are namespaces: needs root")

PROBE = Path(__file__).with_name("privilege_probe.py").read_text()
PROBE_COMMAND = f"python3 - <<'PSKY_PROBE'\n{PROBE}\nPSKY_PROBE"
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
CLI = str(Path(sys.executable).with_name("pytest-sky"))


def in_bit_order(names: list[str] | tuple[str, ...]) -> str:
    return ",".join(sorted(names, key=CAPABILITY_BITS.__getitem__))


def exists_or(path: str, shown: str) -> str:
    return shown if os.path.exists(path) else "absent"


def baseline_pod() -> dict[str, str]:
    """What the probe reports in a pod of ours under Pod Security baseline, as containerd 2
    runs it (its default spec: capabilities, masked and read-only paths, /dev; its CRI
    plugin: a read-only /sys, unprivileged ports and ping) on this machine's kernel: a path
    the kernel lacks is absent there too."""
    caps = in_bit_order(privileges.POD_CAPABILITIES)
    refused = "refused (EPERM)"
    return {
        "capabilities (bounding)": caps,
        "capabilities (effective)": caps,
        "no_new_privs": "1",
        "write /proc/sys/vm/swappiness": "refused (EROFS)",
        "write /proc/sys/net/ipv4/ip_forward": "refused (EROFS)",
        f"write {THP}": exists_or(str(THP), "refused (EROFS)"),
        **{
            f"{p} is": exists_or(p, "read-only") for p in ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus")
        },
        "/sys is": "read-only",
        **{
            f"{p} is": exists_or(p, "masked")
            for p in ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/sys/firmware")
        },
        "/dev holds": "fd full mqueue/ null ptmx pts/ random shm/ stderr stdin stdout tty urandom zero",
        "mount -t tmpfs": refused,
        "mknod a block device of this machine's disk and read it": refused,
        "open a raw disk in /dev": "absent",
        "sethostname": refused,
        "set lo's MTU": refused,
        "bind port 80": "allowed",
        "raw ICMP socket": refused,
        "ICMP datagram socket (ping)": "allowed",
        "chown and write a file of another user": "allowed",
        "write /dev/shm": "allowed",
    }


def tables(cluster: pytest_sky.Cluster) -> list[dict[str, str]]:
    """The probe's table on every node of ``cluster``."""
    res = cluster.run(PROBE_COMMAND, timeout=120)
    assert res.returncode == 0, res.output
    return [dict(line.split("\t", 1) for line in r.stdout.splitlines()) for r in res.ranks]


def host_state() -> dict[str, str]:
    """What a node must never change here: the values the probe and setup scripts touch."""
    state = {"hostname": socket.gethostname(), "lo mtu": Path("/sys/class/net/lo/mtu").read_text()}
    for path in ("/proc/sys/vm/swappiness", "/proc/sys/net/ipv4/ip_forward", str(THP)):
        state[path] = Path(path).read_text() if os.path.exists(path) else "absent"
    state["our mounts"] = "".join(
        line for line in Path("/proc/self/mounts").read_text().splitlines() if "probe" in line
    )
    state["our files"] = " ".join(sorted(p.name for p in Path("/tmp").glob("psky-probe*")))
    return state


def on_kubernetes(emu, name: str, **kwargs: object) -> pytest_sky.Cluster:
    options = {"kubeconfig": str(emu.kubeconfig_path), **kwargs.pop("backend_options", {})}  # type: ignore[dict-item]
    return pytest_sky.launch(num_nodes=2, name=name, backend="kubernetes", backend_options=options, **kwargs)


def exec_in_head(emu, cluster: str, command: str) -> str:
    """``kubectl exec`` into a cluster's head pod: an exec session gets the container's own
    privileges, not the emulator's."""
    from kubernetes.stream import stream

    from pytest_sky.backends import kube_manifests
    from pytest_sky.backends.kubernetes import KubernetesBackend

    api = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
    return stream(
        api.connect_get_namespaced_pod_exec,
        kube_manifests.pod_name(cluster, 0),
        "default",
        command=["/bin/sh", "-c", command],
        stderr=True,
        stdin=False,
        stdout=True,
        tty=False,
    )


def test_a_local_node_and_an_emulated_pod_hold_a_baseline_pods_privileges_and_change_nothing_here(home: Path, emu):
    before = host_state()
    with pytest_sky.launch(num_nodes=2, name=f"priv-local-{os.getpid() % 10000}") as c:
        local = tables(c)
    with on_kubernetes(emu, "priv-pod") as c:
        pod = tables(c)
        exec_caps = exec_in_head(emu, "priv-pod", "grep CapBnd /proc/self/status")
    expected = baseline_pod()
    assert local[0] == pod[0], "a local node and an emulated pod differ"
    for table in (*local, *pod):
        assert table == expected
        assert set(table["capabilities (bounding)"].split(",")) <= set(privileges.RUNTIME_DEFAULT_CAPABILITIES)
    assert int(exec_caps.split()[-1], 16) == sum(1 << CAPABILITY_BITS[n] for n in privileges.POD_CAPABILITIES)
    assert host_state() == before


def test_a_setup_that_tunes_thp_fails_naming_the_line_and_leaves_this_machine_alone(home: Path):
    """As on a cluster, where a pod's /sys is read-only: the run fails and its output names
    the line; the mode written is the host's own, so even a broken harness changes nothing."""
    if not THP.exists():
        pytest.skip(f"this kernel has no {THP}")
    before = THP.read_text()
    setup = f"echo tuning memory\nmode=$(sed 's/.*\\[\\(.*\\)\\].*/\\1/' {THP})\necho \"$mode\" > {THP}\necho tuned\n"
    task = Task(setup="set -e\n" + setup, run="echo ran", num_nodes=2)
    with pytest_sky.launch(num_nodes=2, name=f"priv-thp-{os.getpid() % 10000}") as c:
        res = c.run(task)
    assert res.returncode != 0
    assert f"line 4: {THP}: Read-only file system" in res.output, res.output
    assert "tuned" not in res.output and "ran" not in res.output.split(), res.output
    assert THP.read_text() == before


def test_what_setup_scripts_do_as_root_still_works(home: Path):
    """sudo (as root, and to another user), packages' chown of their own files, a server on
    port 80, head-to-worker ssh: all within a pod's privileges, and in the node's own layer."""
    if not Path("/usr/bin/sudo").exists():
        pytest.skip("sudo is not installed here (scripts/setup.sh installs it)")
    name = f"priv-setup-{os.getpid() % 10000}"
    script = (
        "sudo -n id -u && sudo -n -u nobody id -u && "
        "mkdir -p /opt/psky-tool && chown nobody /opt/psky-tool && stat -c %U /opt/psky-tool && "
        "python3 -c 'import socket; s = socket.socket(); s.bind((\"0.0.0.0\", 80)); s.listen(); print(80)' && "
        f"ssh -o BatchMode=yes {name}-worker1 hostname"
    )
    with pytest_sky.launch(num_nodes=2, name=name) as c:
        res = c.run(script)
    assert res.returncode == 0, res.output
    assert [r.stdout.split() for r in res.ranks] == [["0", "65534", "nobody", "80", f"{name}-worker1"]] * 2
    assert not Path("/opt/psky-tool").exists()


def test_net_admin_is_given_when_asked_and_changes_only_that_nodes_link(home: Path):
    set_mtu = 'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then ip link set lo mtu 1500 || exit 7; fi; cat /sys/class/net/lo/mtu'
    host_mtu = Path("/sys/class/net/lo/mtu").read_text()
    tag = os.getpid() % 10000
    with pytest_sky.launch(num_nodes=2, name=f"priv-net-{tag}", capabilities=("net_admin",)) as c:
        res = c.run(set_mtu)
        assert res.returncode == 0, res.output
        assert [r.stdout.strip() for r in res.ranks] == ["1500", "65536"]
        bounding = tables(c)[0]["capabilities (bounding)"]
        assert bounding == in_bit_order([*privileges.POD_CAPABILITIES, "NET_ADMIN"])
    with pytest_sky.launch(num_nodes=2, name=f"priv-plain-{tag}") as c:
        res = c.run(set_mtu)
        assert res.ranks[0].returncode == 7 and "Operation not permitted" in res.output, res.output
    assert Path("/sys/class/net/lo/mtu").read_text() == host_mtu


def test_a_privileged_node_is_an_escape_hatch_said_out_loud(home: Path, capfd: pytest.CaptureFixture[str]):
    name = f"priv-all-{os.getpid() % 10000}"
    with pytest_sky.launch(num_nodes=1, name=name, privileged=True) as c:
        table = tables(c)[0]
    notes = [line for line in capfd.readouterr().err.splitlines() if "note:" in line]
    assert len(notes) == 1 and "privileged" in notes[0] and "can change the machine" in notes[0], notes
    with open("/proc/self/status") as f:
        mask = int(next(line.split()[1] for line in f if line.startswith("CapBnd:")), 16)
    assert table["capabilities (bounding)"] == in_bit_order([n for n, b in CAPABILITY_BITS.items() if mask >> b & 1])
    assert table["/proc/sys is"] == "writable" and table["no_new_privs"] == "0"


def test_pod_security_refuses_what_was_asked_and_says_so(home: Path, emu):
    """The emulator's default namespace enforces baseline: NET_ADMIN is refused in one line
    that names it and the fix; in a namespace that allows it, the pod holds it."""
    with pytest.raises(ProvisionError) as err:
        on_kubernetes(emu, "priv-refused", capabilities=("NET_ADMIN",))
    message = str(err.value)
    assert "\n" not in message and "NET_ADMIN" in message and "enforce=privileged" in message, message
    from pytest_sky.backends.kubernetes import KubernetesBackend

    KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api().create_namespace({"metadata": {"name": "priv-ns"}})
    opts = {"namespace": "priv-ns"}
    with on_kubernetes(emu, "priv-allowed", capabilities=("NET_ADMIN",), backend_options=opts) as c:
        res = c.run("ip link set lo mtu 1500 && cat /sys/class/net/lo/mtu")
        assert [r.stdout.strip() for r in res.ranks] == ["1500", "1500"], res.output


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"capabilities": ("NET_ADMINN",)}, "unknown capability 'NET_ADMINN'"),
        ({"capabilities": "NET_ADMIN"}, "capabilities must be a list"),
        ({"capabilities": ("ALL",)}, "privileged=True"),
        ({"privileged": "yes"}, "privileged must be True or False"),
    ],
)
def test_bad_privileges_are_one_line_and_provision_nothing(home: Path, kwargs: dict, words: str):
    with pytest.raises(TaskError) as err:
        pytest_sky.launch(num_nodes=1, name="priv-bad", **kwargs)
    assert "\n" not in str(err.value) and words in str(err.value)
    assert not list((home / "clusters").glob("*/record.json"))


def test_the_cli_adds_capabilities_and_refuses_unknown_ones(home: Path):
    bad = subprocess.run(
        [CLI, "launch", "-c", "priv-cli-bad", "--cap-add", "BOGUS", "--", "true"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "unknown capability 'BOGUS'" in bad.stderr
    name = f"priv-cli-{os.getpid() % 10000}"
    good = subprocess.run(
        [CLI, "launch", "-c", name, "--cap-add", "NET_ADMIN", "--", "grep CapBnd /proc/self/status"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert good.returncode == 0, good.stderr
        mask = int(next(line for line in good.stdout.splitlines() if "CapBnd" in line).split()[-1], 16)
        assert mask >> CAPABILITY_BITS["NET_ADMIN"] & 1 and not mask >> CAPABILITY_BITS["SYS_ADMIN"] & 1
    finally:
        subprocess.run([CLI, "down", name], capture_output=True, timeout=120)


# -- the one definition, read from a securityContext -----------------------------------------


def test_a_runtime_gives_its_default_set_less_drop_plus_add() -> None:
    default = privileges.confinement(None, None)
    assert default.capabilities == sorted(privileges.RUNTIME_DEFAULT_CAPABILITIES)
    assert not default.no_new_privs and not default.privileged and default.sysctls == []
    ours = privileges.for_node()
    assert ours.capabilities == sorted(privileges.POD_CAPABILITIES) and ours.no_new_privs
    assert ours.sysctls == list(privileges.NODE_SYSCTLS)
    assert ours.readonly_paths == list(privileges.READONLY_PATHS) and "/proc/kcore" in ours.masked_paths
    assert ours.devices == list(privileges.DEVICES)
    dropped = privileges.confinement(None, {"capabilities": {"drop": ["NET_RAW", "cap_mknod"]}})
    assert set(privileges.RUNTIME_DEFAULT_CAPABILITIES) - set(dropped.capabilities) == {"NET_RAW", "MKNOD"}
    everything = privileges.confinement(None, {"capabilities": {"add": ["ALL"]}})
    assert everything.capabilities == sorted(CAPABILITY_BITS) and not everything.privileged
    privileged = privileges.for_node(privileges.check_privileges(privileged=True))
    assert privileged.privileged and privileged.masked_paths == [] and privileged.devices == []
    asked = privileges.check_privileges(["cap_net_admin", "CHOWN", "NET_ADMIN"])
    assert asked.capabilities == ("NET_ADMIN",)  # CHOWN a pod holds already
    assert "NET_ADMIN" in privileges.for_node(asked).capabilities


def test_a_node_given_gpus_gets_their_device_files_and_no_other(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device files of a node's GPU share appear in its /dev with the host's numbers, and
    on no node without a share.  This machine has no GPU: a harmless device it has stands in
    for the share's control device."""
    device = Path("/dev/cpu_dma_latency")
    if not device.exists():
        pytest.skip(f"this machine has no {device} to stand in for a GPU's device file")
    monkeypatch.setattr(gpus, "CONTROL_DEVICES", (str(device),))
    show = f"stat -c '%t:%T' {device}"
    tag = os.getpid() % 10000
    with pytest_sky.launch(
        num_nodes=2, name=f"priv-gpu-{tag}", gpus="T4:1", backend_options={"devices": ["0", "1"]}
    ) as c:
        res = c.run(show)
    st = device.stat()
    assert [r.stdout.strip() for r in res.ranks] == [f"{os.major(st.st_rdev):x}:{os.minor(st.st_rdev):x}"] * 2
    with pytest_sky.launch(num_nodes=1, name=f"priv-nogpu-{tag}") as c:
        assert "No such file" in c.run(show).output
