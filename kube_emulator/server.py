"""The HTTPS face of the emulator: discovery, authentication, the admin endpoints, the kubeconfig.

HTTPS only, as every real API server, with a CA of its own in the kubeconfig (:mod:`kube_emulator.tls`).

One catch-all aiohttp handler answers discovery (``/version``, ``/api``, ``/api/v1``),
authenticates the bearer token, and hands ``/api/v1/...`` to :class:`~kube_emulator.rest.ResourceApi`
(which resolves the path to a verb, authorizes it and calls the cluster) and ``/emulator/...``
to the admin endpoints.
Errors are ``Status`` bodies with the real codes and reasons, because the backend turns
them into its one-line messages.

Tokens (all in the generated kubeconfig, one context each), authorized by
:mod:`kube_emulator.rbac` with the real RBAC matching rules: the admin token (random)
may do anything (and only it reaches the admin endpoints and fault injection); ``role`` is
the ServiceAccount ``pytest-sky`` bound to the Role of ``examples/kubernetes/rbac.yaml`` (or
``--role FILE``) in its namespace; ``readonly`` holds a ClusterRole of get/list/watch on
every resource (subresources included, as ``*`` grants on a real cluster); ``nobody`` is
authenticated but may do nothing beyond discovery; any other token gets 401.  Without a
token, a client certificate the emulator's CA issued is the user its common name names (the
``kube-emulator-role-cert`` context: the Role's user).  The verb of
an exec or port-forward websocket depends on ``kube_version`` (see the rbac module).

:class:`EmulatorServer` is the async core (used by ``python -m kube_emulator``);
:class:`Emulator` runs it on a background thread for in-process use::

    with Emulator(nodes=3) as emu:
        kubernetes.config.load_kube_config(config_file=str(emu.kubeconfig_path))
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from aiohttp import web

from kube_emulator import access_review, discovery, openapi, rbac_objects
from kube_emulator.api import ApiError
from kube_emulator.cluster import Cluster
from kube_emulator.config import KUBERNETES_VERSION, ClusterConfig
from kube_emulator.faults import Faults
from kube_emulator.leftovers import reap_leftovers
from kube_emulator.rbac import (
    Authorizer,
    Decision,
    Grant,
    PolicyRule,
    Subject,
    parse_version,
    read_role_file,
    role_documents,
)
from kube_emulator.rest import Deletion, ResourceApi, json_response
from kube_emulator.selectors import SelectorError
from kube_emulator.tls import Credential, ServerTls, peer_identity, serving_tls

log = logging.getLogger(__name__)

READONLY_TOKEN = "readonly"
NOBODY_TOKEN = "nobody"
ROLE_TOKEN = "role"
BAD_TOKEN = "invalid-token"
CONTEXT = "kube-emulator"
ROLE_CONTEXT = f"{CONTEXT}-role"
ROLE_USER = "system:serviceaccount:default:pytest-sky"
#: The Role the ``role`` token holds unless another is given: the one the project ships.
SHIPPED_ROLE = Path(__file__).resolve().parents[1] / "examples" / "kubernetes" / "rbac.yaml"
#: The Role's user again, authenticated by a client certificate the emulator's CA issued
#: (``client-certificate-data``) instead of a token, as many kubeconfigs of real clusters do.
ROLE_CERT_CONTEXT = f"{CONTEXT}-role-cert"
CONTEXTS = (
    CONTEXT,
    ROLE_CONTEXT,
    ROLE_CERT_CONTEXT,
    f"{CONTEXT}-readonly",
    f"{CONTEXT}-nobody",
    f"{CONTEXT}-badtoken",
)
READONLY_RULES = (PolicyRule(verbs=("get", "list", "watch"), api_groups=("*",), resources=("*",)),)
T = TypeVar("T")


def default_state_dir() -> Path:
    """Beside the project's own state (``PYTEST_SKY_HOME``), so its leak checks cover it."""
    home = os.environ.get("PYTEST_SKY_HOME") or str(Path.home() / ".pytest_sky")
    return Path(home) / "kube-emulator"


class EmulatorServer:
    """The emulated API server, its cluster and its kubeconfig."""

    def __init__(
        self,
        config: ClusterConfig | None = None,
        *,
        faults: Faults | None = None,
        state_dir: Path | None = None,
        kubeconfig_path: Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        role: Path | None = None,
        current_context: str = CONTEXT,
    ) -> None:
        self.config = config or ClusterConfig()
        self.faults = faults or Faults()
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        self.instance_dir = self.state_dir / f"emu-{os.getpid()}-{secrets.token_hex(3)}"
        self.kubeconfig_path = Path(kubeconfig_path) if kubeconfig_path else self.instance_dir / "kubeconfig"
        self.host = host
        self.port = port
        self.token = secrets.token_hex(16)
        self.kube_version = self.config.kube_version
        self.authorizer = Authorizer(self.kube_version)
        self.authorizer.bind(self.token, "admin", None)
        self.authorizer.bind(ROLE_TOKEN, ROLE_USER, [])  # what the cluster's bindings give it
        role_path = role or SHIPPED_ROLE
        self._role = (read_role_file(role_path), str(role_path))
        role_documents(*self._role)  # a bad file fails here, before anything starts
        #: The objects the role file made, removed when another takes its place.
        self._seeded: list[tuple[str, str, str]] = []
        self.authorizer.bind(READONLY_TOKEN, "system:serviceaccount:default:readonly", [Grant(READONLY_RULES)])
        self.authorizer.bind(NOBODY_TOKEN, "system:serviceaccount:default:nobody", [])
        if current_context not in CONTEXTS:
            raise ValueError(f"current context {current_context!r}: expected one of {', '.join(CONTEXTS)}")
        self.current_context = current_context
        self.cluster = Cluster(self.config, self.faults, self.instance_dir)
        self.cluster.kubelet.kubeconfig = str(self.kubeconfig_path)
        self.rest = ResourceApi(self.cluster, self.authorizer, self.kube_version)
        self.authorizer.bound = lambda user: rbac_objects.grants_for(self.cluster.store, user)
        self._runner: web.AppRunner | None = None
        self._wrote_kubeconfig = False
        self.url = ""
        self.tls: ServerTls | None = None
        self._role_cert: Credential | None = None

    # -- life -------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        reaped = await loop.run_in_executor(None, reap_leftovers, self.state_dir)
        for what in reaped:
            log.warning("reaped what a dead owner left: %s", what)
        await self.cluster.start()
        self.seed_role(*self._role)
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.dispatch)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        self.tls = await loop.run_in_executor(None, serving_tls, (self.host,))
        self.cluster.ca_pem = self.tls.ca.pem
        self._role_cert = self.tls.ca.issue_client(ROLE_USER)
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.tls.context)
        await site.start()
        sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
        self.port = sockets[0].getsockname()[1]
        self.url = f"https://{self.host}:{self.port}"
        self._write_kubeconfig()

    def seed_role(self, text: str, source: str) -> None:
        """Apply a role file (``--role``), as ``kubectl apply -n default -f`` would, in place
        of the last one; a Role it binds to nobody is bound to the role context's user."""
        objects = rbac_objects.role_objects(role_documents(text, source), "default", ROLE_USER)
        for resource, namespace, name in self._seeded:
            with contextlib.suppress(ApiError):
                self.cluster.delete(resource, namespace, name)
        self._seeded = []
        for resource, namespace, body in objects:
            name = body["metadata"]["name"]
            try:
                if self.cluster.store.get(resource, namespace, name) is not None:
                    self.cluster.delete(resource, namespace, name)
                self.cluster.create(resource, namespace, body)
            except ApiError as exc:
                raise ValueError(f"{source}: {exc.message}") from None
            self._seeded.append((resource, namespace, name))

    async def stop(self) -> None:
        """Tear everything down: the HTTP side first (no new pods), then every pod and the bridge."""
        if self._runner is not None:
            self.cluster.store.close_watches()
            for session in list(self.cluster.portforwards):
                session.drop()
            with contextlib.suppress(Exception):
                await self._runner.cleanup()
            self._runner = None
        await self.cluster.shutdown()
        if self._wrote_kubeconfig:
            with contextlib.suppress(OSError):
                if self.token in self.kubeconfig_path.read_text():
                    self.kubeconfig_path.unlink()

    def kubeconfig(self) -> dict[str, Any]:
        users = {
            "emulator-admin": self.token,
            "emulator-readonly": READONLY_TOKEN,
            "emulator-nobody": NOBODY_TOKEN,
            "emulator-role": ROLE_TOKEN,
            "emulator-badtoken": BAD_TOKEN,
        }
        contexts = {
            CONTEXT: "emulator-admin",
            ROLE_CONTEXT: "emulator-role",
            ROLE_CERT_CONTEXT: "emulator-role-cert",
            f"{CONTEXT}-readonly": "emulator-readonly",
            f"{CONTEXT}-nobody": "emulator-nobody",
            f"{CONTEXT}-badtoken": "emulator-badtoken",
        }
        assert set(contexts) == set(CONTEXTS)
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": CONTEXT, "cluster": self.cluster_entry()}],
            "users": [
                *({"name": n, "user": {"token": t}} for n, t in users.items()),
                {"name": "emulator-role-cert", "user": self._client_certificate_entry()},
            ],
            "contexts": [
                {"name": c, "context": {"cluster": CONTEXT, "user": u, "namespace": "default"}}
                for c, u in contexts.items()
            ],
            "current-context": self.current_context,
            "preferences": {},
        }

    def cluster_entry(self) -> dict[str, str]:
        """The kubeconfig's ``cluster``: the HTTPS address and the CA that signed its certificate."""
        assert self.tls is not None, "the server has not started"
        return {"server": self.url, "certificate-authority-data": base64.b64encode(self.tls.ca.pem).decode()}

    def _client_certificate_entry(self) -> dict[str, str]:
        assert self._role_cert is not None, "the server has not started"
        return {
            "client-certificate-data": base64.b64encode(self._role_cert.cert_pem).decode(),
            "client-key-data": base64.b64encode(self._role_cert.key_pem).decode(),
        }

    def _write_kubeconfig(self) -> None:
        """Written only once the server answers, by rename: its appearance means ready."""
        path = self.kubeconfig_path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            yaml.safe_dump(self.kubeconfig(), fh, sort_keys=False)
        os.replace(tmp, path)
        self._wrote_kubeconfig = True

    def update_faults(self, data: dict[str, Any]) -> dict[str, Any]:
        drop = self.faults.update(data)
        if drop:
            for session in list(self.cluster.portforwards):
                session.drop()
        self.cluster.trigger_scheduler()
        return self.faults.as_dict()

    def pods_info(self) -> dict[str, Any]:
        """Where each running pod lives on this machine (the admin endpoint and tests use it)."""
        out = {}
        kubelet = self.cluster.kubelet
        for rt in sorted(kubelet.runtimes.values(), key=lambda r: kubelet.current(*r.key) is r):
            # A pod's current runtime last: it is the one its name shows (a deleted
            # predecessor's container may still be stopping).
            out[f"{rt.namespace}/{rt.name}"] = {
                "uid": rt.uid,
                "root": str(rt.root),
                "home": str(rt.root / "home"),
                "log": str(rt.log_path),
                "ip": rt.ip,
                "node": rt.node_name,
                "pid": rt.node.pid if rt.node else None,
                "init_pid": rt.node.init_pid if rt.node else None,
                "veth": rt.node.veth if rt.node else None,
            }
        return out

    def info(self) -> dict[str, Any]:
        kubelet = self.cluster.kubelet
        return {
            "url": self.url,
            "bridge": kubelet.network.bridge,
            "subnet": kubelet.network.subnet,
            "state_dir": str(self.state_dir),
            "instance_dir": str(self.instance_dir),
            "kubeconfig": str(self.kubeconfig_path),
            "faults": self.faults.as_dict(),
        }

    # -- HTTP -------------------------------------------------------------------------------

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path.rstrip("/") or "/"
        try:
            if path == "/version":
                return json_response(_version(self.kube_version))
            if path in ("/healthz", "/livez", "/readyz"):
                return web.Response(text="ok")
            user = self._authenticate(request)
            if path == "/api":
                return json_response(discovery.core_versions(f"{self.host}:{self.port}"))
            if path == "/apis":
                return json_response(discovery.group_list())
            if path.startswith(f"/apis/{access_review.GROUP_VERSION}/") and request.method == "POST":
                return await self._review(request, user, path.rsplit("/", 1)[1])
            if path.startswith("/openapi/v3"):
                return self._openapi(path)
            if path.startswith("/emulator/"):
                return await self._admin(request, user, path)
            group, parts = _api_path(path)
            if group is not None and not parts:
                listed = discovery.resource_list(group)
                if listed is not None:
                    return json_response(listed)
            elif group is not None:
                return await self.rest.handle(request, user, parts, group)
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        except ApiError as exc:
            return json_response(exc.status(), exc.code)
        except SelectorError as exc:
            return json_response(ApiError(400, "BadRequest", str(exc)).status(), 400)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as exc:
            log.exception("kube emulator: %s %s failed", request.method, request.path)
            return json_response(ApiError(500, "InternalError", f"kube emulator bug: {exc!r}").status(), 500)

    def _authenticate(self, request: web.Request) -> Subject:
        """A bearer token, else a client certificate our CA issued (TLS verified it already;
        the user is its common name), as the real API server's authenticators are tried."""
        header = request.headers.get("Authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if token:
            subject = self.authorizer.authenticate(token)
        else:
            ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
            identity = peer_identity(ssl_object.getpeercert() if ssl_object is not None else None)
            subject = self.authorizer.authenticate_user(identity[0]) if identity else None
        if subject is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return subject

    async def _review(self, request: web.Request, user: Subject, resource: str) -> web.Response:
        """A SelfSubjectAccessReview or SelfSubjectRulesReview, in JSON or (kubectl) protobuf."""
        raw = await request.read()
        protobuf = request.content_type == "application/vnd.kubernetes.protobuf"
        if resource == access_review.RESOURCE:
            body = access_review.from_protobuf(raw) if protobuf else _json_body(raw)
            return json_response(access_review.review(self.authorizer, user, body), 201)
        if resource == access_review.RULES_RESOURCE:
            body = access_review.rules_from_protobuf(raw) if protobuf else _json_body(raw)
            return json_response(access_review.rules_review(self.authorizer, user, body), 201)
        raise ApiError(404, "NotFound", "the server could not find the requested resource")

    @staticmethod
    def _openapi(path: str) -> web.Response:
        """``/openapi/v3`` and each group-version's document under it."""
        rest = path[len("/openapi/v3") :].strip("/")
        body = openapi.root() if not rest else openapi.document(rest)
        if body is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return json_response(body)

    def decisions(self) -> list[Decision]:
        """Every authorization decision so far, in order (what clients asked for)."""
        return list(self.authorizer.decisions)

    async def _admin(self, request: web.Request, user: Subject, path: str) -> web.StreamResponse:
        if user.grants is not None:
            raise ApiError(403, "Forbidden", "the emulator's admin endpoints need the admin token")
        if path == "/emulator/faults":
            if request.method == "GET":
                return json_response(self.faults.as_dict())
            if request.method == "POST":
                try:
                    data = await request.json()
                    if not isinstance(data, dict):
                        raise ValueError("the body must be a JSON object")
                    return json_response(self.update_faults(data))
                except ValueError as exc:
                    raise ApiError(400, "BadRequest", str(exc)) from None
        if path == "/emulator/pods" and request.method == "GET":
            return json_response(self.pods_info())
        if path == "/emulator/deletions" and request.method == "GET":
            return json_response([dataclasses.asdict(d) for d in self.rest.deletions])
        if path == "/emulator/info" and request.method == "GET":
            return json_response(self.info())
        raise ApiError(404, "NotFound", f"no admin endpoint {request.method} {path}")


def _json_body(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"{}")
    except ValueError as exc:
        raise ApiError(400, "BadRequest", f"the body is not JSON: {exc}") from None


def _version(version: str) -> dict[str, str]:
    major, minor = parse_version(version)
    return {
        "major": str(major),
        "minor": str(minor),
        "gitVersion": f"{version}+pytest-sky-emulator",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2024-08-13T00:00:00Z",
        "goVersion": "go1.22.5",
        "compiler": "gc",
        "platform": "linux/amd64",
    }


def _api_path(path: str) -> tuple[str | None, list[str]]:
    """``/api/v1/REST`` -> ("", REST's parts); ``/apis/GROUP/v1/REST`` -> (GROUP, ...);
    anything else (None, [])."""
    words = path.strip("/").split("/")
    if words[:2] == ["api", "v1"]:
        return "", words[2:]
    if len(words) >= 3 and words[0] == "apis" and words[2] == "v1":
        return words[1], words[3:]
    return None, []


class Emulator:
    """The emulator in-process, on a background thread with its own event loop.

    ``with Emulator(nodes=3, gpus_per_node=0) as emu: ...`` gives ``emu.kubeconfig_path``
    (current context: admin unless ``current_context`` names another, e.g. ``ROLE_CONTEXT``),
    ``emu.url``, ``emu.token``; ``kube_version="1.35"`` picks the RBAC rules of exec and
    port-forward, ``role=PATH`` the Role of the role context; ``emu.decisions()`` lists every
    authorization decision; ``emu.set_faults(pending="x-*")``
    changes faults; ``emu.pods_info()`` says where each pod lives on this machine.
    Nodes are small (4 CPU / 8Gi) and the ``default`` namespace enforces policies
    (``policies=False``: none); ``gpu_product="Tesla-T4"`` labels GPU nodes with that product.
    Leaving the block tears down every pod, the bridge and the state it wrote.
    """

    def __init__(
        self,
        *,
        nodes: int = 3,
        gpus_per_node: int = 0,
        cpus_per_node: str = ClusterConfig.cpus_per_node,
        memory_per_node: str = ClusterConfig.memory_per_node,
        gpu_taint: bool = False,
        mtu: int = 65535,
        gpu_product: str | None = None,
        policies: bool = True,
        state_dir: Path | str | None = None,
        kubeconfig_path: Path | str | None = None,
        faults: dict[str, Any] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        kube_version: str = KUBERNETES_VERSION,
        role: Path | str | None = None,
        current_context: str = CONTEXT,
    ) -> None:
        config = ClusterConfig(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            cpus_per_node=str(cpus_per_node),
            memory_per_node=str(memory_per_node),
            gpu_taint=gpu_taint,
            mtu=mtu,
            kube_version=kube_version,
            gpu_product=gpu_product,
            policies=policies,
        )
        fault_state = Faults()
        if faults:
            fault_state.update(faults)
        self.server = EmulatorServer(
            config,
            faults=fault_state,
            state_dir=Path(state_dir) if state_dir else None,
            kubeconfig_path=Path(kubeconfig_path) if kubeconfig_path else None,
            host=host,
            port=port,
            role=Path(role) if role else None,
            current_context=current_context,
        )
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def kubeconfig_path(self) -> Path:
        return self.server.kubeconfig_path

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def token(self) -> str:
        return self.server.token

    @property
    def instance_dir(self) -> Path:
        return self.server.instance_dir

    def start(self, timeout: float = 60.0) -> Emulator:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="kube-emulator", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the kube emulator did not start within {timeout:.0f} s")
        if self._error is not None:
            self._thread.join(30)
            raise self._error
        return self

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            await self.server.start()
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that called start()
            self._error = exc
            self._ready.set()
            await self.server.stop()
            return
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            try:
                await self.server.stop()
            except Exception:
                log.exception("kube emulator: teardown failed")

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(60)
            self._thread = None

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def call(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """Run ``fn`` on the emulator's loop thread (where all its state lives) and return its result."""
        assert self._loop is not None

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def set_faults(self, **faults: Any) -> dict[str, Any]:
        """Same keys as ``POST /emulator/faults`` (see :mod:`kube_emulator.faults`)."""
        return self.call(lambda: self.server.update_faults(faults))

    def pods_info(self) -> dict[str, Any]:
        return self.call(self.server.pods_info)

    def decisions(self) -> list[Decision]:
        """Every RBAC decision so far (who asked for which verb on what, and the answer)."""
        return self.call(self.server.decisions)

    def set_role(self, role_yaml: str) -> None:
        """Bind the role context's token to the Role(s) of this YAML from now on (as editing
        and re-applying a Role does on a real cluster)."""
        self.call(lambda: self.server.seed_role(role_yaml, "set_role"))

    def deletions(self) -> list[Deletion]:
        """Every single-object delete so far, with its DeleteOptions (see :class:`Deletion`)."""
        return self.call(lambda: list(self.server.rest.deletions))
