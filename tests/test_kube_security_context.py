"""What an emulated pod's processes actually hold, for each securityContext, against what a
container runtime is documented to give: a table of cases, each written out here.

The emulator reads a securityContext by upstream's rules (``kube_emulator/runtime.py``) and
has the product's node runtime carry it out.  These expectations come from the runtime's
documented behaviour, not from either: containerd's default capability set (v2.3,
pkg/oci/spec.go), Kubernetes' "Configure a Security Context for a Pod or Container"
(privileged, runAsUser/runAsGroup, readOnlyRootFilesystem, allowPrivilegeEscalation =
no_new_privs) and capabilities(7) (a process that is not root holds no capability after its
exec).  A wrong mapping anywhere then fails here instead of being copied.

The pods run in a namespace that enforces no Pod Security level, so that privileged and
added capabilities are admitted (the default namespace enforces "baseline").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

kubernetes = pytest.importorskip("kubernetes")
pytest.importorskip("aiohttp")

from kubernetes import client  # noqa: E402

from kube_emulator import Emulator  # noqa: E402
from pytest_sky.backends.confine import CAPABILITY_BITS  # noqa: E402
from tests.kube_helpers import api, needs_root, pod_manifest, run, running, wait_for  # noqa: E402

NS = "sc-table"
#: What a pod's first process reports of itself: ids, capability sets, no_new_privs, and
#: which of /, /tmp, $HOME, an emptyDir and /dev/shm it may write; /proc/sys read-only or
#: not; whether the host's devices are there.
PROBE = r"""
grep -E '^(Uid|Gid|CapBnd|CapEff|CapPrm|NoNewPrivs):' /proc/self/status | tr -s '\t' ' '
for d in / /tmp "$HOME" /scratch /dev/shm; do
  if ( : > "$d/.probe" ) 2>/dev/null; then echo "write $d: yes"; rm -f "$d/.probe"; else echo "write $d: no"; fi
done
case "$(awk '$5 == "/proc/sys" { print $6 }' /proc/self/mountinfo)" in
  ro*) echo "procsys: ro" ;;
  *) echo "procsys: rw" ;;
esac
if [ -e /dev/kmsg ]; then echo "host devices: yes"; else echo "host devices: no"; fi
"""
#: containerd's default set (v2.3.4, pkg/oci/spec.go defaultUnixCaps), written out.
DEFAULT = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "NET_RAW",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
ALL = set(CAPABILITY_BITS)  # every capability the kernel names: narrowed to what the runtime holds


def _held() -> set[str]:
    """What a runtime gives for ALL and privileged: what it holds itself (containerd's own
    effective set, pkg/cap Current); the emulator runs in this process."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return _caps(fields["CapEff"].strip(), max(CAPABILITY_BITS.values()))


def _caps(mask: str, last: int) -> set[str]:
    value = int(mask, 16)
    return {name for name, bit in CAPABILITY_BITS.items() if bit <= last and value >> bit & 1}


#: (name, pod securityContext, container securityContext, expected): expected holds only
#: what the case is about; "bounding" and "effective" are capability names.
CASES: list[tuple[str, dict | None, dict | None, dict[str, Any]]] = [
    ("plain", None, None, {"uid": 0, "bounding": DEFAULT, "effective": DEFAULT, "nnp": 0, "write /": "yes"}),
    (
        "drop-all-add-one",
        None,
        {"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}},
        {"bounding": {"NET_BIND_SERVICE"}, "effective": {"NET_BIND_SERVICE"}},
    ),
    ("add-one", None, {"capabilities": {"add": ["NET_ADMIN"]}}, {"effective": DEFAULT | {"NET_ADMIN"}}),
    ("drop-two", None, {"capabilities": {"drop": ["NET_RAW", "MKNOD"]}}, {"effective": DEFAULT - {"NET_RAW", "MKNOD"}}),
    ("add-all", None, {"capabilities": {"add": ["ALL"]}}, {"effective": ALL, "procsys": "ro"}),
    (
        "privileged",
        None,
        {"privileged": True},
        {"effective": ALL, "bounding": ALL, "procsys": "rw", "host devices": "yes"},
    ),
    (
        "run-as-user",
        None,
        {"runAsUser": 1000, "runAsGroup": 3000},
        {"uid": 1000, "gid": 3000, "bounding": DEFAULT, "effective": set(), "permitted": set(), "write /": "no"},
    ),
    ("run-as-user-from-the-pod", {"runAsUser": 1001}, None, {"uid": 1001, "gid": 0, "effective": set()}),
    (
        "read-only-root",
        None,
        {"readOnlyRootFilesystem": True},
        {
            "write /": "no",
            "write /tmp": "no",
            "write /home/sky": "no",
            "write /scratch": "yes",  # a volume stays writable
            "write /dev/shm": "yes",
            "uid": 0,
        },
    ),
    ("no-escalation", None, {"allowPrivilegeEscalation": False}, {"nnp": 1, "effective": DEFAULT}),
    ("escalation", None, {"allowPrivilegeEscalation": True}, {"nnp": 0}),
    ("not-privileged", None, {"privileged": False}, {"procsys": "ro", "host devices": "no", "effective": DEFAULT}),
]


@pytest.fixture(scope="module")
def v1(emu: Emulator) -> Iterator[client.CoreV1Api]:
    core = api(emu.kubeconfig_path)
    core.create_namespace({"metadata": {"name": NS}})
    yield core
    core.delete_namespace(NS)


@pytest.fixture(scope="module")
def observed(v1: client.CoreV1Api) -> dict[str, dict[str, Any]]:
    """Every case's pod, run to its end: what its process said of itself."""
    for name, pod_sc, container_sc, _ in CASES:
        manifest = pod_manifest(f"sc-{name}", {"app": "sc-table"}, command=["/bin/sh", "-c", PROBE])
        spec, container = manifest["spec"], manifest["spec"]["containers"][0]
        spec["volumes"] = [{"name": "scratch", "emptyDir": {}}]
        container["volumeMounts"] = [{"name": "scratch", "mountPath": "/scratch"}]
        if pod_sc is not None:
            spec["securityContext"] = pod_sc
        if container_sc is not None:
            container["securityContext"] = container_sc
        v1.create_namespaced_pod(NS, manifest)
    wait_for(
        v1,
        "app=sc-table",
        lambda p: p["status"].get("phase") in ("Succeeded", "Failed"),
        len(CASES),
        timeout=120,
        ns=NS,
    )
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    seen = {}
    for name, *_ in CASES:
        log = v1.read_namespaced_pod_log(f"sc-{name}", NS)
        fields = dict(line.split(": ", 1) for line in log.splitlines() if ": " in line)
        assert "Uid" in fields, f"{name}: {log!r} {v1.read_namespaced_pod(f'sc-{name}', NS).status}"
        seen[name] = {
            "uid": int(fields["Uid"].split()[0]),
            "gid": int(fields["Gid"].split()[0]),
            "bounding": _caps(fields["CapBnd"], last),
            "effective": _caps(fields["CapEff"], last),
            "permitted": _caps(fields["CapPrm"], last),
            "nnp": int(fields["NoNewPrivs"]),
            **{k: v for k, v in fields.items() if k.startswith("write ") or k in ("procsys", "host devices")},
        }
    return seen


@needs_root
@pytest.mark.parametrize(("name", "expected"), [(c[0], c[3]) for c in CASES], ids=[c[0] for c in CASES])
def test_a_pods_process_holds_what_the_runtime_gives(
    observed: dict[str, dict[str, Any]], name: str, expected: dict[str, Any]
) -> None:
    got = observed[name]
    for key, want in expected.items():
        if isinstance(want, set):
            want = want & _held()
        assert got[key] == want, f"{name}: {key} is {got[key]!r}, not {want!r} ({got})"


@needs_root
def test_an_exec_into_a_container_runs_as_its_user_with_what_it_holds(v1: client.CoreV1Api) -> None:
    """A runtime execs with the container's own process user and capabilities."""
    manifest = pod_manifest("sc-exec", {"app": "sc-exec"})
    manifest["spec"]["containers"][0]["securityContext"] = {"runAsUser": 1000, "allowPrivilegeEscalation": False}
    v1.create_namespaced_pod(NS, manifest)
    wait_for(v1, "app=sc-exec", running, 1, ns=NS)
    code, out = run(v1, "sc-exec", ["/bin/sh", "-c", "id -u; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status"], ns=NS)
    assert code == 0, out
    uid, cap_eff, nnp = out.split("\n")[:3]
    assert (uid, cap_eff.split()[-1], nnp.split()[-1]) == ("1000", "0000000000000000", "1"), out


@needs_root
def test_a_pod_gets_a_serviceaccount_token_unless_it_or_its_account_says_not(v1: client.CoreV1Api) -> None:
    """The ServiceAccount admission plugin mounts the pod's API credentials unless
    ``automountServiceAccountToken: false`` (the pod's, else its account's): what pytest-sky's
    pods set, since nothing in a node talks to the API server."""
    host_secrets = os.path.exists("/run/secrets/kubernetes.io")  # /var/run is /run, on the host too
    v1.create_namespaced_service_account(NS, {"metadata": {"name": "quiet"}, "automountServiceAccountToken": False})
    where = "/var/run/secrets/kubernetes.io/serviceaccount"
    show = ["/bin/sh", "-c", f"ls {where} 2>&1; cat {where}/namespace 2>/dev/null; true"]
    for name, spec in (
        ("token-default", {}),
        ("token-off", {"automountServiceAccountToken": False}),
        ("token-quiet-account", {"serviceAccountName": "quiet"}),
    ):
        manifest = pod_manifest(f"sc-{name}", {"app": "sc-token"}, command=show)
        manifest["spec"].update(spec)
        made = v1.create_namespaced_pod(NS, manifest)
        mounted = [v.name for v in made.spec.volumes or [] if v.projected]
        assert bool(mounted) == (name == "token-default"), (name, mounted)
    wait_for(v1, "app=sc-token", lambda p: p["status"].get("phase") == "Succeeded", 3, timeout=60, ns=NS)
    logs = {name: v1.read_namespaced_pod_log(f"sc-{name}", NS) for name in ("token-default", "token-off")}
    assert logs["token-default"].split() == ["ca.crt", "namespace", "token", NS], logs
    assert "No such file or directory" in logs["token-off"], logs
    assert "No such file or directory" in v1.read_namespaced_pod_log("sc-token-quiet-account", NS)
    assert os.path.exists("/run/secrets/kubernetes.io") == host_secrets  # mounted in the pod's root only
