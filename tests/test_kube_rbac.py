"""Least privilege, proven: the shipped Role (examples/kubernetes/rbac.yaml) against the
emulator's RBAC, which matches rules as the real authorizer does and derives the verbs of
exec and port-forward websockets as a real API server of the chosen version does.

The first tests need nothing but Python (the rule matching, the verbs, the 403 text); the
rest launch clusters as the Role's ServiceAccount (root, like the other emulator tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

import pytest_sky
from pytest_sky.backends import kube_manifests as manifests
from pytest_sky.backends.kubernetes import KubernetesBackend
from pytest_sky.errors import BackendUnavailableError, ProvisionError
from pytest_sky.ssh import kube_proxy

pytest.importorskip("kubernetes", reason="pip install kubernetes")
pytest.importorskip("aiohttp", reason="the emulator needs aiohttp")

from kube_emulator import ROLE_CERT_CONTEXT, ROLE_CONTEXT, ROLE_USER, Emulator
from kube_emulator.api import ApiError
from kube_emulator.rbac import (
    Authorizer,
    Forbidden,
    Grant,
    PolicyRule,
    Request,
    connect_verbs,
    parse_version,
    role_documents,
)
from kube_emulator.rbac_objects import grants_for, prepare, role_objects
from kube_emulator.store import Store

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "examples" / "kubernetes" / "rbac.yaml"
USER = "system:serviceaccount:default:pytest-sky"


def req(
    verb: str, resource: str, sub: str = "", namespace: str = "default", name: str = "", group: str = ""
) -> Request:
    return Request(USER, verb, resource, sub, namespace, name, group)


def allowed(grants: tuple[Grant, ...], request: Request) -> bool:
    return any(g.allows(request) for g in grants)


def load_grants(text: str, default_namespace: str = "default") -> tuple[Grant, ...]:
    """What a role file grants the role context's user once applied (its objects in a
    store, then what their bindings give), as the emulator's authorizer sees it."""
    store = Store()
    for resource, namespace, body in role_objects(role_documents(text, "test"), default_namespace, USER):
        if namespace:
            body["metadata"]["namespace"] = namespace
        store.create(resource, body)
    return tuple(grants_for(store, USER))


def role_yaml(rules: list[dict[str, object]]) -> str:
    return yaml.safe_dump({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "rules": rules})


def shipped_rules() -> list[dict[str, object]]:
    (role,) = [d for d in yaml.safe_load_all(SHIPPED.read_text()) if d and d.get("kind") == "Role"]
    return role["rules"]


def without(verb: str, resource: str) -> str:
    """The shipped Role less one verb on one resource (the rest of its rule kept)."""
    rules = []
    for rule in shipped_rules():
        resources = list(rule["resources"])
        if resource in resources:
            resources.remove(resource)
            if resources:
                rules.append({**rule, "resources": resources})
            rules.append({**rule, "resources": [resource], "verbs": [v for v in rule["verbs"] if v != verb]})
        else:
            rules.append(rule)
    return role_yaml(rules)


# -- the authorizer, without a cluster ------------------------------------------------------


def test_rules_match_as_the_real_rbac_authorizer_matches_them() -> None:
    rule = PolicyRule(verbs=("get", "create"), resources=("pods/exec",))
    assert rule.matches(req("get", "pods", "exec", name="x"))
    assert not rule.matches(req("get", "pods", name="x")), "a subresource grant is not one on the resource"
    assert not PolicyRule(verbs=("get",), resources=("pods",)).matches(req("get", "pods", "exec", name="x"))
    assert not rule.matches(req("delete", "pods", "exec", name="x"))
    # "*" is every verb, every group, every resource and subresource; "*/exec" any resource's exec.
    assert PolicyRule(verbs=("*",), api_groups=("*",), resources=("*",)).matches(req("delete", "pods", "exec"))
    assert PolicyRule(verbs=("get",), resources=("*/exec",)).matches(req("get", "pods", "exec", name="x"))
    assert not PolicyRule(verbs=("get",), resources=("*/exec",)).matches(req("get", "pods", name="x"))
    # The API group must match: "" is the core group, "apps" is not it.
    assert not PolicyRule(verbs=("get",), api_groups=("apps",), resources=("pods",)).matches(req("get", "pods"))
    # resourceNames narrow to names, and so never match a request without one (create, list).
    named = PolicyRule(verbs=("get", "create", "list"), resources=("pods",), resource_names=("a",))
    assert named.matches(req("get", "pods", name="a"))
    assert not named.matches(req("get", "pods", name="b"))
    assert not named.matches(req("create", "pods"))
    assert not named.matches(req("list", "pods"))


def test_a_role_grants_only_in_its_namespace_and_never_at_the_cluster_scope() -> None:
    grants = load_grants(role_yaml([{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]), default_namespace="ns1")
    assert allowed(grants, req("create", "pods", namespace="ns1"))
    assert not allowed(grants, req("create", "pods", namespace="ns2"))
    assert not allowed(grants, req("list", "nodes", namespace=""))
    assert not allowed(grants, req("list", "pods", namespace="")), "a list across namespaces is cluster-scoped"
    cluster_role = yaml.safe_dump(
        {"kind": "ClusterRole", "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]}
    )
    assert allowed(load_grants(cluster_role), req("list", "nodes", namespace=""))


def test_websocket_verbs_of_exec_and_port_forward_follow_the_version() -> None:
    """Before 1.35 the websocket upgrade (a GET) is authorized as get; from 1.35 also as create."""
    assert connect_verbs("GET", "1.34") == ("get",)
    assert connect_verbs("GET", "v1.31.0") == ("get",)
    assert connect_verbs("GET", "1.35") == ("get", "create")
    assert connect_verbs("GET", "v1.36.2") == ("get", "create")
    assert connect_verbs("POST", "1.34") == ("create",)  # SPDY
    assert parse_version("v1.35.0") == (1, 35)
    with pytest.raises(ValueError, match=r"expected MAJOR\.MINOR"):
        parse_version("latest")


def test_the_403_reads_like_the_real_api_servers() -> None:
    auth = Authorizer("1.35")
    auth.bind("t", USER, load_grants(role_yaml([{"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["get"]}])))
    subject = auth.authenticate("t")
    assert subject is not None
    with pytest.raises(Forbidden) as err:
        auth.authorize_all(subject, [req(v, "pods", "exec", name="x") for v in connect_verbs("GET", "1.35")])
    assert str(err.value) == (
        'pods "x" is forbidden: User "system:serviceaccount:default:pytest-sky" cannot create resource '
        '"pods/exec" in API group "" in the namespace "default"'
    )
    assert err.value.details() == {"kind": "pods", "name": "x"}
    with pytest.raises(Forbidden) as err:
        auth.authorize(subject, req("list", "nodes", namespace=""))
    assert str(err.value).endswith('cannot list resource "nodes" in API group "" at the cluster scope')
    assert str(err.value).startswith("nodes is forbidden: ")
    assert [(d.request.verb, d.allowed) for d in auth.decisions] == [("get", True), ("create", False), ("list", False)]


def test_malformed_roles_are_refused_naming_the_place() -> None:
    with pytest.raises(ValueError, match="no Role or ClusterRole"):
        load_grants("kind: RoleBinding\n")
    with pytest.raises(ValueError, match="document 1 is a Pod"):
        load_grants("kind: Pod\n")
    with pytest.raises(
        ApiError,
        match=r'Role.rbac.authorization.k8s.io "r" is invalid: rules\[0\]: Invalid value: verbs must be a list',
    ):
        prepare(
            "roles", {"metadata": {"name": "r"}, "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": "get"}]}
        )
    with pytest.raises(ApiError, match=r"roleRef.kind: Unsupported value: \"Role\""):
        binding = {
            "metadata": {"name": "b"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "r"},
        }
        prepare("clusterrolebindings", binding)


def test_the_shipped_role_is_exactly_the_backends_verbs_and_has_no_deletecollection() -> None:
    grants = load_grants(SHIPPED.read_text())
    granted = {
        (verb, resource) for g in grants for rule in g.rules for resource in rule.resources for verb in rule.verbs
    }
    assert granted == {
        *{(v, "pods") for v in ("create", "get", "list", "watch", "delete")},
        *{(v, "secrets") for v in ("create", "delete")},  # never get, list or watch
        *{(v, "services") for v in ("create", "get", "delete")},
        *{(v, "leases") for v in ("create", "get", "list", "update", "patch", "delete")},
        *{(v, r) for r in ("pods/exec", "pods/portforward") for v in ("get", "create")},
        ("get", "pods/log"),
        ("list", "events"),
        ("get", "persistentvolumeclaims"),
    }
    (leases,) = [r for r in shipped_rules() if "leases" in r["resources"]]
    assert leases["apiGroups"] == ["coordination.k8s.io"] and leases["resources"] == ["leases"]
    assert all(g.namespace == "default" for g in grants)  # a Role: applied with kubectl apply -n
    kinds = [d["kind"] for d in yaml.safe_load_all(SHIPPED.read_text()) if d]
    assert kinds == ["Role", "ServiceAccount", "RoleBinding"]


def test_the_launchs_own_check_matches_rules_as_the_authorizer_does() -> None:
    """What ``kube_permissions`` concludes from a rules review, without a cluster."""
    from pytest_sky.backends.kube_permissions import Permission, Rule, missing, needed

    exec_get, exec_create = Permission("get", "pods/exec"), Permission("create", "pods/exec")
    assert Rule(("get",), ("",), ("pods/exec",)).allows(exec_get)
    assert Rule(("*",), ("*",), ("*",)).allows(exec_create)
    assert Rule(("get",), ("",), ("*/exec",)).allows(exec_get)
    assert not Rule(("get",), ("",), ("pods",)).allows(exec_get), "the resource is not its subresources"
    assert not Rule(("get",), ("apps",), ("pods/exec",)).allows(exec_get), "another API group"
    assert not Rule(("create",), ("",), ("pods",), ("x",)).allows(Permission("create", "pods")), "names only"
    assert exec_create not in needed((1, 34), shared_claim=False) and exec_create in needed((1, 35), shared_claim=False)
    assert exec_create in needed(None, shared_claim=False), "a version not known: the newer rules"
    shipped = [Rule(tuple(r["verbs"]), tuple(r["apiGroups"]), tuple(r["resources"])) for r in shipped_rules()]
    assert missing(shipped, needed((1, 35), shared_claim=True)) == []
    granted = {(v, r) for rule in shipped for r in rule.resources for v in rule.verbs}
    assert granted == {(p.verb, p.resource) for p in needed((1, 35), shared_claim=True)}, "exactly, no more"


def test_the_backends_line_for_a_denial_names_verb_resource_and_fix() -> None:
    message = (
        'pods "x" is forbidden: User "system:serviceaccount:ns:sa" cannot create resource "pods/exec" '
        'in API group "" in the namespace "ns"'
    )
    line = kube_proxy.rbac_line(message)
    assert line == (
        'User "system:serviceaccount:ns:sa" may not create pods/exec in namespace "ns" (403 Forbidden): grant the '
        "Role pytest-sky needs, kubectl apply -n ns -f examples/kubernetes/rbac.yaml, and bind it to that user"
    )
    assert kube_proxy.rbac_line("exceeded quota: q, requested: pods=1, used: pods=1, limited: pods=1") is None


# -- against the emulator --------------------------------------------------------------------


def emulator(start_emulator: Callable[..., Emulator], version: str) -> Emulator:
    if os.geteuid() != 0:
        pytest.skip("the emulator's pods are namespace nodes: needs root")
    return start_emulator(nodes=2, kube_version=version)


@pytest.fixture(scope="module")
def emu134(start_emulator: Callable[..., Emulator]) -> Emulator:
    return emulator(start_emulator, "1.34")


@pytest.fixture(scope="module")
def emu135(start_emulator: Callable[..., Emulator]) -> Emulator:
    return emulator(start_emulator, "1.35")


@pytest.fixture(params=["1.34", "1.35"])
def emu(request: pytest.FixtureRequest) -> Emulator:
    """Each version's emulator in turn."""
    return request.getfixturevalue(f"emu{request.param.replace('.', '')}")


def launch_as_role(emu: Emulator, name: str) -> pytest_sky.Cluster:
    return pytest_sky.launch(
        num_nodes=2,
        name=name,
        backend="kubernetes",
        backend_options={"kubeconfig": str(emu.kubeconfig_path), "context": ROLE_CONTEXT},
    )


def purge(emu: Emulator, cluster: str) -> list[str]:
    """Delete (as the admin) what a failed launch under a short Role could not; say what it was."""
    api = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()
    sel = manifests.selector(cluster)
    left = []
    for kind, lister, deleter in (
        ("pod", api.list_namespaced_pod, api.delete_namespaced_pod),
        ("secret", api.list_namespaced_secret, api.delete_namespaced_secret),
        ("service", api.list_namespaced_service, api.delete_namespaced_service),
    ):
        for obj in lister("default", label_selector=sel).items:
            left.append(f"{kind} {obj.metadata.name}")
            deleter(obj.metadata.name, "default")
    from kubernetes import client

    leases = client.CoordinationV1Api(api.api_client)
    for lease in leases.list_namespaced_lease("default", label_selector=sel).items:
        left.append(f"lease {lease.metadata.name}")
        leases.delete_namespaced_lease(lease.metadata.name, "default")
    return left


def admin_api(emu: Emulator):
    return KubernetesBackend(kubeconfig=str(emu.kubeconfig_path)).api()


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def since_135(emu: Emulator) -> bool:
    return parse_version(emu.server.kube_version) >= (1, 35)


@pytest.mark.parametrize(
    ("version", "verb", "resource"),
    [
        *[(v, "create", "pods") for v in ("1.34", "1.35")],
        *[(v, "create", "secrets") for v in ("1.34", "1.35")],
        *[(v, "get", "pods/exec") for v in ("1.34", "1.35")],
        ("1.35", "create", "pods/exec"),  # before 1.35 the websocket exec is a get only
        ("1.34", "get", "pods/portforward"),
        ("1.35", "create", "pods/portforward"),
    ],
)
def test_each_missing_verb_fails_the_launch_in_one_line_naming_it(
    request: pytest.FixtureRequest, home: Path, version: str, verb: str, resource: str
) -> None:
    """Asked first (SelfSubjectRulesReview): the launch fails before it creates anything, not
    half-way with pods to clean up."""
    emu: Emulator = request.getfixturevalue(f"emu{version.replace('.', '')}")
    name = f"rbac-{verb[:3]}-{resource.replace('/', '-')[:10]}"
    emu.set_role(without(verb, resource))
    since = len(emu.decisions())
    try:
        with pytest.raises(BackendUnavailableError) as err:
            launch_as_role(emu, name)
        message = str(err.value)
        assert f"may not {verb} {resource} in namespace 'default'" in message and "nothing was created" in message
        assert "kubectl apply -n default -f examples/kubernetes/rbac.yaml" in message and "\n" not in message
        made = [
            d.request for d in emu.decisions()[since:] if d.request.verb == "create" and d.request.user == ROLE_USER
        ]
        assert made == [], made
    finally:
        emu.set_role(SHIPPED.read_text())
        purge(emu, name)


def test_a_dropped_port_forward_grant_fails_the_proxy_in_one_line(emu: Emulator) -> None:
    """The ProxyCommand (a new SSH connection) says which verb the Role lacks, as ssh shows it."""
    missing = "create" if since_135(emu) else "get"
    emu.set_role(without(missing, "pods/portforward"))
    try:
        proc = subprocess.run(
            [
                *(sys.executable, "-m", "pytest_sky.ssh.kube_proxy", "--namespace", "default", "--pod", "any-head"),
                *("--kubeconfig", str(emu.kubeconfig_path), "--context", ROLE_CONTEXT),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    finally:
        emu.set_role(SHIPPED.read_text())
    assert proc.returncode == 255
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert f'may not {missing} pods/portforward in namespace "default" (403 Forbidden)' in proc.stderr, proc.stderr


def test_gpu_tests_skip_saying_the_role_may_not_list_nodes(
    pytester: pytest.Pytester, home: Path, emu: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = KubernetesBackend(kubeconfig=str(emu.kubeconfig_path), context=ROLE_CONTEXT)
    assert backend.has_gpus() is False
    assert "may not list nodes (403 Forbidden)" in backend.gpus_unseen()
    pytester.makepyfile("import pytest\n\n@pytest.mark.gpu\ndef test_gpu():\n    pass\n")
    monkeypatch.setenv("KUBECONFIG", str(emu.kubeconfig_path))
    result = pytester.runpytest_subprocess(
        "--kubernetes", f"--kube-context={ROLE_CONTEXT}", "-rs", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs a GPU; kube context 'kube-emulator-role' may not list nodes (403 Forbidden)*"])


def role_requests(emu: Emulator, since: int) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """(allowed, denied) verb/resource pairs the Role's user asked for since decision ``since``."""
    allowed_, denied = set(), set()
    for d in emu.decisions()[since:]:
        if d.request.user == ROLE_USER:
            (allowed_ if d.allowed else denied).add((d.request.verb, d.request.combined))
    return allowed_, denied


def granted_by(role: str) -> set[tuple[str, str]]:
    return {(v, r) for g in load_grants(role) for rule in g.rules for r in rule.resources for v in rule.verbs}


#: Cluster-scoped reads a Role cannot grant; the backend goes on without them.
TOLERATED = {("get", "namespaces"), ("list", "nodes")}


def test_launch_run_and_teardown_under_exactly_the_shipped_role(home: Path, emu: Emulator) -> None:
    since = len(emu.decisions())
    with launch_as_role(emu, "rbac-full") as c:
        assert [r.stdout.strip() for r in c.run("hostname").ranks] == ["rbac-full-head", "rbac-full-worker1"]
    assert purge(emu, "rbac-full") == [], "the teardown under the Role left objects behind"
    allowed_, denied = role_requests(emu, since)
    assert denied <= TOLERATED, denied
    assert allowed_ <= granted_by(SHIPPED.read_text())


def test_a_client_certificate_user_launches_runs_and_tears_down_under_the_shipped_role(
    home: Path, emu: Emulator
) -> None:
    """Many kubeconfigs authenticate with a client certificate, not a token: the launch, the
    exec and port-forward websockets and the teardown all present it, and the API server
    knows the user by its common name (the Role's ServiceAccount user here)."""
    import yaml

    users = yaml.safe_load(emu.kubeconfig_path.read_text())["users"]
    (user,) = [u["user"] for u in users if u["name"] == "emulator-role-cert"]
    assert "token" not in user and user["client-certificate-data"] and user["client-key-data"]
    since = len(emu.decisions())
    options = {"kubeconfig": str(emu.kubeconfig_path), "context": ROLE_CERT_CONTEXT}
    with pytest_sky.launch(num_nodes=2, name="rbac-cert", backend="kubernetes", backend_options=options) as c:
        assert [r.stdout.strip() for r in c.run("hostname").ranks] == ["rbac-cert-head", "rbac-cert-worker1"]
    assert purge(emu, "rbac-cert") == []
    allowed_, denied = role_requests(emu, since)
    resources = {resource for _, resource in allowed_}  # the websockets' verb depends on the version
    assert {"pods", "pods/exec", "pods/portforward"} <= resources, allowed_
    assert denied <= TOLERATED, denied


def test_auth_can_i_answers_from_the_role_the_requests_are_checked_against(emu: Emulator) -> None:
    """``kubectl auth can-i`` (a SelfSubjectAccessReview) tells a user what their credentials
    may do before a launch fails half-way: the same Role, token or certificate alike."""

    from kubernetes import client

    from tests.kube_helpers import KUBECTL, api_client, run_kubectl

    def can(context: str, verb: str, resource: str, subresource: str = "") -> bool:
        api = client.AuthorizationV1Api(api_client(emu.kubeconfig_path, context))
        attrs = client.V1ResourceAttributes(
            namespace="default", verb=verb, resource=resource, subresource=subresource or None
        )
        review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attrs))
        return api.create_self_subject_access_review(review).status.allowed

    since = len(emu.decisions())
    for context in (ROLE_CONTEXT, ROLE_CERT_CONTEXT):
        assert can(context, "create", "pods") and can(context, "delete", "services"), context
        assert can(context, "create", "pods", "portforward") or can(context, "get", "pods", "portforward")
        assert not can(context, "list", "nodes") and not can(context, "create", "configmaps"), context
    assert emu.decisions()[since:] == []  # asking is not doing
    if KUBECTL is None:
        return  # the client's own review above is what kubectl sends
    for args, answer in ((["create", "pods"], "yes"), (["list", "nodes"], "no")):
        run = run_kubectl(emu.kubeconfig_path, "auth", "can-i", *args, "-n", "default", context=ROLE_CONTEXT)
        assert run.stdout.decode().strip() == answer, (args, run.stdout, run.stderr)


def test_before_135_a_role_without_create_on_the_websockets_works(home: Path, emu134: Emulator) -> None:
    """What a Role written for 1.34 looks like; the same Role fails on 1.35 (the test above it)."""
    rules = [
        r for r in yaml.safe_load(without("create", "pods/exec"))["rules"] if r["resources"] != ["pods/portforward"]
    ]
    rules.append({"apiGroups": [""], "resources": ["pods/portforward"], "verbs": ["get"]})
    emu134.set_role(role_yaml(rules))
    try:
        with launch_as_role(emu134, "rbac-getonly") as c:
            assert c.run("true").ok
    finally:
        emu134.set_role(SHIPPED.read_text())
        assert purge(emu134, "rbac-getonly") == []


def test_a_missing_delete_fails_the_teardown_in_one_line_naming_it(home: Path, emu: Emulator) -> None:
    c = launch_as_role(emu, "rbac-nodelete")
    emu.set_role(without("delete", "pods"))
    try:
        with pytest.raises(ProvisionError) as err:
            c.down()
        message = str(err.value)
        assert 'may not delete pods in namespace "default" (403 Forbidden)' in message and "\n" not in message, message
        assert "kubectl apply -n default -f examples/kubernetes/rbac.yaml" in message
    finally:
        emu.set_role(SHIPPED.read_text())
        purge(emu, "rbac-nodelete")
        c.down()


def test_the_shipped_role_is_exactly_what_the_backend_asks_for(home: Path, emu135: Emulator) -> None:
    """Least privilege, measured: every verb the Role grants is one the backend asked for in a
    launch, run and teardown, a launch whose pod crashes (events, log) and a launch with a
    shared directory (its claim), on 1.35 (where the websockets use both verbs)."""
    from kubernetes import client

    since = len(emu135.decisions())
    with launch_as_role(emu135, "rbac-all") as c:
        assert c.run("true").ok
    # A lease renewed (get, update), then left to expire and reaped as stale (list, update).
    options = {"kubeconfig": str(emu135.kubeconfig_path), "context": ROLE_CONTEXT, "lease_seconds": 1}
    stale = pytest_sky.launch(num_nodes=1, name="rbac-stale", backend="kubernetes", backend_options=options)
    leases = client.CoordinationV1Api(admin_api(emu135).api_client)
    first = leases.read_namespaced_lease("rbac-stale", "default").spec.renew_time
    wait_until(lambda: leases.read_namespaced_lease("rbac-stale", "default").spec.renew_time != first, "no renewal")
    stale._backend.creator.stop_renewing("rbac-stale")  # its owner gone, as a runner that vanished
    reaper = KubernetesBackend(kubeconfig=str(emu135.kubeconfig_path), context=ROLE_CONTEXT)
    wait_until(lambda: reaper.reap_stale() == ["rbac-stale"], "the stale cluster was not reaped")
    stale.down()  # its local record; nothing of it is left on the cluster
    emu135.set_faults(crash="rbac-crash-*")
    try:
        with pytest.raises(ProvisionError, match="failed before sshd came up"):
            launch_as_role(emu135, "rbac-crash")
    finally:
        emu135.set_faults(crash=[])
        purge(emu135, "rbac-crash")
    admin = KubernetesBackend(kubeconfig=str(emu135.kubeconfig_path)).api()
    spec = client.V1PersistentVolumeClaimSpec(
        access_modes=["ReadWriteMany"], resources={"requests": {"storage": "1Gi"}}
    )
    admin.create_namespaced_persistent_volume_claim(
        "default", client.V1PersistentVolumeClaim(metadata=client.V1ObjectMeta(name="rbac-rwx"), spec=spec)
    )
    shared = pytest_sky.launch(
        num_nodes=2,
        name="rbac-shared",
        backend="kubernetes",
        backend_options={"kubeconfig": str(emu135.kubeconfig_path), "context": ROLE_CONTEXT, "shared_pvc": "rbac-rwx"},
        shared_dir="/mnt/shared",
    )
    shared.down()
    allowed_, denied = role_requests(emu135, since)
    assert denied <= TOLERATED, denied
    assert allowed_ == granted_by(SHIPPED.read_text()), (
        f"granted, never asked for: {sorted(granted_by(SHIPPED.read_text()) - allowed_)}; "
        f"asked for, not granted: {sorted(allowed_ - granted_by(SHIPPED.read_text()))}"
    )


def test_a_launch_refused_at_its_lease_cleans_up_without_reading_a_secret(
    home: Path, emu135: Emulator, caplog: pytest.LogCaptureFixture
) -> None:
    """The Lease is the first object a launch makes: a name whose Lease is taken fails the
    launch in one line, and the clean-up knows nothing was made (no read of the Secret that
    the Role may not read, no warning), and leaves the Lease that took the name alone."""
    from kubernetes import client

    leases = client.CoordinationV1Api(admin_api(emu135).api_client)
    taken = leases.create_namespaced_lease("default", {"metadata": {"name": "rbac-taken"}, "spec": {}})
    since = len(emu135.decisions())
    try:
        with pytest.raises(ProvisionError, match="a Lease named 'rbac-taken' already exists") as err:
            launch_as_role(emu135, "rbac-taken")
        assert "\n" not in str(err.value)
        allowed_, denied = role_requests(emu135, since)
        assert denied <= TOLERATED, denied
        assert not [r for _, r in allowed_ if r == "secrets"], allowed_
        assert leases.read_namespaced_lease("rbac-taken", "default").metadata.uid == taken.metadata.uid
        assert not [r for r in caplog.records if "cleanup" in r.getMessage()], caplog.text
    finally:
        leases.delete_namespaced_lease("rbac-taken", "default")
