"""How long things live on the emulator, held to kube-apiserver, the kubelet and the garbage
collector: graceful and forced pod deletion, ``activeDeadlineSeconds``, Leases, and
``ownerReferences`` with their propagation policies.

Each test checks what a client observes through the API and, for pods, what runs on this
machine: a container must outlive a force-deleted pod's object until its kubelet acts, and
must be gone once a gracefully deleted pod's object is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

kubernetes = pytest.importorskip("kubernetes")
pytest.importorskip("aiohttp")

from kubernetes import client, watch  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402

from kube_emulator import Emulator  # noqa: E402
from tests.kube_helpers import alive, api, needs_root, pod_manifest, pod_processes, wait_for  # noqa: E402

NS = "default"
#: A first process that ends on SIGTERM, as sshd does (a shell without a trap ignores it).
ENDS_ON_TERM = ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep infinity & wait"]


@pytest.fixture(scope="module")
def v1(emu: Emulator) -> client.CoreV1Api:
    return api(emu.kubeconfig_path)


@pytest.fixture(scope="module")
def leases(v1: client.CoreV1Api) -> client.CoordinationV1Api:
    return client.CoordinationV1Api(v1.api_client)


@pytest.fixture
def kubelet_delay(emu: Emulator) -> Iterator[Callable[[float], None]]:
    yield lambda seconds: emu.set_faults(kubelet_delay=seconds)
    emu.set_faults(kubelet_delay=None)


def _until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _gone(read: Callable[[], object]) -> bool:
    try:
        read()
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def _start(v1: client.CoreV1Api, name: str, command: list[str] | None = None, **spec: object) -> str:
    manifest = pod_manifest(name, {"life": name}, command=command)
    manifest["spec"].update(spec)
    v1.create_namespaced_pod(NS, manifest)
    wait_for(v1, f"life={name}", lambda o: o.get("status", {}).get("phase") == "Running", 1)
    return v1.read_namespaced_pod(name, NS).metadata.uid


@needs_root
def test_a_force_deleted_pods_container_outlives_its_object_beside_a_new_pod_of_its_name(
    emu: Emulator, v1: client.CoreV1Api, kubelet_delay: Callable[[float], None]
) -> None:
    kubelet_delay(8)
    first = _start(v1, "life-force")
    old = pod_processes(emu, "life-force")
    v1.delete_namespaced_pod("life-force", NS, grace_period_seconds=0)
    assert _gone(lambda: v1.read_namespaced_pod("life-force", NS))  # the object at once
    assert alive(old) != []  # its container: not yet
    kubelet_delay(0)
    second = _start(v1, "life-force")  # the name is free: a new pod beside the old container
    assert second != first and emu.pods_info()[f"{NS}/life-force"]["uid"] == second
    _until(lambda: alive(old) == [], "the old container was never stopped")
    assert alive(pod_processes(emu, "life-force")) != []  # the new one runs on
    v1.delete_namespaced_pod("life-force", NS)
    _until(lambda: _gone(lambda: v1.read_namespaced_pod("life-force", NS)), "the new pod was not deleted")


@needs_root
def test_a_gracefully_deleted_pod_goes_once_its_container_has_stopped(
    emu: Emulator, v1: client.CoreV1Api, kubelet_delay: Callable[[float], None]
) -> None:
    kubelet_delay(2)
    uid = _start(v1, "life-grace", ENDS_ON_TERM, terminationGracePeriodSeconds=30)
    old = pod_processes(emu, "life-grace")
    listing = v1.list_namespaced_pod(NS, label_selector="life=life-grace")
    v1.delete_namespaced_pod("life-grace", NS)
    marked = v1.read_namespaced_pod("life-grace", NS)  # Terminating until the kubelet is done
    assert marked.metadata.deletion_timestamp is not None and marked.metadata.deletion_grace_period_seconds == 30
    w = watch.Watch()
    for event in w.stream(
        v1.list_namespaced_pod,
        NS,
        label_selector="life=life-grace",
        resource_version=listing.metadata.resource_version,
        timeout_seconds=60,
    ):
        if event["type"] == "DELETED" and event["object"].metadata.uid == uid:
            assert alive(old) == []  # the DELETED event means nothing of it runs
            w.stop()
            break
    else:
        pytest.fail("the pod was never deleted")
    reasons = [e.reason for e in v1.list_namespaced_event(NS, field_selector=f"involvedObject.uid={uid}").items]
    assert "Killing" in reasons


@needs_root
def test_a_pod_past_its_active_deadline_fails_as_the_kubelet_fails_it(emu: Emulator, v1: client.CoreV1Api) -> None:
    manifest = pod_manifest("life-deadline", {"life": "life-deadline"}, restart="Always")
    manifest["spec"]["activeDeadlineSeconds"] = 2
    v1.create_namespaced_pod(NS, manifest)
    wait_for(v1, "life=life-deadline", lambda o: o.get("status", {}).get("phase") == "Running", 1)
    old = pod_processes(emu, "life-deadline")
    with pytest.raises(ApiException) as longer:  # a deadline may be shortened, never lengthened
        v1.patch_namespaced_pod("life-deadline", NS, {"spec": {"activeDeadlineSeconds": 60}})
    assert longer.value.status == 422 and "must be less than or equal to previous value" in longer.value.body
    wait_for(v1, "life=life-deadline", lambda o: o.get("status", {}).get("phase") == "Failed", 1)
    pod = v1.read_namespaced_pod("life-deadline", NS)
    assert (pod.status.reason, pod.status.message) == (
        "DeadlineExceeded",
        "Pod was active on the node longer than the specified deadline",
    )
    uid = pod.metadata.uid
    events = v1.list_namespaced_event(NS, field_selector=f"involvedObject.uid={uid}").items
    assert [(e.type, e.message) for e in events if e.reason == "DeadlineExceeded"] == [
        ("Normal", "Pod was active on the node longer than the specified deadline")
    ]
    _until(lambda: alive(old) == [], "the pod's container outlived its deadline")
    assert pod.status.container_statuses[0].restart_count == 0  # never restarted, whatever its policy
    v1.delete_namespaced_pod("life-deadline", NS)  # ended: deleted at once
    assert _gone(lambda: v1.read_namespaced_pod("life-deadline", NS))
    with pytest.raises(ApiException) as zero:
        bad = pod_manifest("life-zero", {"life": "life-zero"})
        bad["spec"]["activeDeadlineSeconds"] = 0
        v1.create_namespaced_pod(NS, bad)
    assert zero.value.status == 422 and "must be between 1 and 2147483647" in zero.value.body


def _lease(name: str, **spec: object) -> client.V1Lease:
    body = {"holder_identity": "tester", "lease_duration_seconds": 30, **spec}
    return client.V1Lease(metadata=client.V1ObjectMeta(name=name), spec=client.V1LeaseSpec(**body))


def _owned(lease: client.V1Lease, block: bool = False) -> list[client.V1OwnerReference]:
    return [
        client.V1OwnerReference(
            api_version="coordination.k8s.io/v1",
            kind="Lease",
            name=lease.metadata.name,
            uid=lease.metadata.uid,
            block_owner_deletion=block or None,
        )
    ]


def _secret(name: str, owners: list[client.V1OwnerReference]) -> client.V1Secret:
    return client.V1Secret(metadata=client.V1ObjectMeta(name=name, owner_references=owners), string_data={"k": "v"})


def test_leases_are_coordination_objects_validated_as_upstream_validates_them(
    leases: client.CoordinationV1Api,
) -> None:
    now = "2026-01-02T03:04:05.123456Z"
    made = leases.create_namespaced_lease(NS, _lease("life-lease", acquire_time=now, renew_time=now))
    assert made.spec.holder_identity == "tester" and made.spec.lease_duration_seconds == 30
    assert made.api_version == "coordination.k8s.io/v1" and made.kind == "Lease"
    made.spec.renew_time = "2026-01-02T03:04:25.000001Z"
    renewed = leases.replace_namespaced_lease("life-lease", NS, made)
    assert renewed.metadata.resource_version != made.metadata.resource_version
    stale = made  # an update from an older version of it is a conflict
    stale.metadata.resource_version = made.metadata.resource_version
    with pytest.raises(ApiException) as conflict:
        leases.replace_namespaced_lease("life-lease", NS, stale)
    assert conflict.value.status == 409
    assert [x.metadata.name for x in leases.list_namespaced_lease(NS).items if x.metadata.name == "life-lease"] == [
        "life-lease"
    ]
    with pytest.raises(ApiException) as bad:
        leases.create_namespaced_lease(NS, _lease("life-bad", lease_duration_seconds=0))
    assert bad.value.status == 422 and "spec.leaseDurationSeconds" in bad.value.body
    leases.delete_namespaced_lease("life-lease", NS)


def test_the_garbage_collector_takes_what_a_deleted_owner_leaves(
    v1: client.CoreV1Api, leases: client.CoordinationV1Api
) -> None:
    owner = leases.create_namespaced_lease(NS, _lease("life-owner"))
    v1.create_namespaced_secret(NS, _secret("life-dep-secret", _owned(owner)))
    svc = client.V1Service(
        metadata=client.V1ObjectMeta(name="life-dep-svc", owner_references=_owned(owner)),
        spec=client.V1ServiceSpec(cluster_ip="None", ports=[client.V1ServicePort(port=22)]),
    )
    v1.create_namespaced_service(NS, svc)
    leases.delete_namespaced_lease("life-owner", NS)  # Background, the default
    _until(lambda: _gone(lambda: v1.read_namespaced_secret("life-dep-secret", NS)), "the Secret was not collected")
    _until(lambda: _gone(lambda: v1.read_namespaced_service("life-dep-svc", NS)), "the Service was not collected")
    # An object naming an owner that does not exist (that uid) goes too.
    ghost = client.V1OwnerReference(api_version="coordination.k8s.io/v1", kind="Lease", name="life-none", uid="nope")
    v1.create_namespaced_secret(NS, _secret("life-dangling", [ghost]))
    _until(lambda: _gone(lambda: v1.read_namespaced_secret("life-dangling", NS)), "a dangling dependent stayed")
    with pytest.raises(ApiException) as bad:
        v1.create_namespaced_secret(
            NS, _secret("life-bad-ref", [client.V1OwnerReference(api_version="v1", kind="Lease", name="x", uid="")])
        )
    assert bad.value.status == 422 and "uid must not be empty" in bad.value.body


def test_orphan_and_foreground_propagation(v1: client.CoreV1Api, leases: client.CoordinationV1Api) -> None:
    owner = leases.create_namespaced_lease(NS, _lease("life-orphaner"))
    v1.create_namespaced_secret(NS, _secret("life-orphan", _owned(owner)))
    leases.delete_namespaced_lease("life-orphaner", NS, propagation_policy="Orphan")
    assert _gone(lambda: leases.read_namespaced_lease("life-orphaner", NS))
    assert v1.read_namespaced_secret("life-orphan", NS).metadata.owner_references is None
    v1.delete_namespaced_secret("life-orphan", NS)

    owner = leases.create_namespaced_lease(NS, _lease("life-fg"))
    v1.create_namespaced_secret(NS, _secret("life-fg-dep", _owned(owner, block=True)))
    leases.delete_namespaced_lease("life-fg", NS, propagation_policy="Foreground")
    _until(lambda: _gone(lambda: v1.read_namespaced_secret("life-fg-dep", NS)), "the blocking dependent stayed")
    _until(lambda: _gone(lambda: leases.read_namespaced_lease("life-fg", NS)), "the foreground owner stayed")
