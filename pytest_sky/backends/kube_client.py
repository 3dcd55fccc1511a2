"""The connection to one kube context's API server, and the one module of the backend that
imports the kubernetes client.

Which context and namespace are used is settled the way kubectl settles it (KUBECONFIG, the
kubeconfig's current context and its namespace, else the pod's service account), once, on
the first request: nothing is read from disk or the network when the backend is built.
Everything else of the backend reaches the API server through a :class:`KubeClient`, and
catches ``kube_client.ApiException``.

The client is imported on first use, never with this module: ``import kubernetes`` costs a
quarter of a CPU-second and ``CoreV1Api``'s module (its typed models) three times that, which
a CLI call that only reads a cluster's record (``exec``, ``logs``, ``queue``) would pay for
nothing.  So the rest of the backend names ``kube_client.ApiException`` where it catches it
(evaluated only when something is raised), never imports it by name.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from pytest_sky.backends.kube_journal import KubeRecord
from pytest_sky.backends.kube_permissions import Rule
from pytest_sky.cluster_info import PortForward
from pytest_sky.errors import BackendUnavailableError
from pytest_sky.ssh import kube_credentials

if TYPE_CHECKING:
    from kubernetes import client, watch
    from kubernetes.client import CoordinationV1Api, CoreV1Api
    from kubernetes.client.exceptions import ApiException

__all__ = ["ApiException", "CoreV1Api", "KubeClient"]


def __getattr__(name: str) -> Any:
    """``ApiException`` and ``CoreV1Api``, imported when first named (see the module's docstring)."""
    if name == "ApiException":
        from kubernetes.client.exceptions import ApiException

        return ApiException
    if name == "CoreV1Api":
        from kubernetes.client import CoreV1Api

        return CoreV1Api
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Where a pod finds its own namespace (in-cluster configuration).
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
IN_CLUSTER = "in-cluster"


class KubeClient:
    """One kube context and namespace, and the API objects that talk to them."""

    def __init__(self, context: str | None = None, namespace: str | None = None, kubeconfig: str | None = None):
        self.context = context or None
        self.requested_namespace = namespace or None
        # KUBECONFIG is Kubernetes' own convention, read as kubectl reads it.
        self.kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or None
        self.namespace = self.requested_namespace or "default"
        self.in_cluster = False
        self._api: CoreV1Api | None = None
        self._cfg: client.Configuration | None = None
        self._coordination: CoordinationV1Api | None = None

    def api(self) -> CoreV1Api:
        if self._api is not None:
            return self._api
        from kubernetes import client
        from kubernetes.client import CoreV1Api

        cfg = client.Configuration()
        path = self.kubeconfig or os.path.expanduser("~/.kube/config")
        if os.path.exists(path.split(os.pathsep)[0]):
            self._load_kubeconfig(cfg, path)
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            self._load_in_cluster(cfg)
        else:
            raise BackendUnavailableError(
                f"no Kubernetes configuration: {path} does not exist and this is not a pod; "
                "set KUBECONFIG or run `kubectl config use-context ...`"
            )
        self._cfg = cfg
        self._api = CoreV1Api(client.ApiClient(cfg))
        return self._api

    def _load_kubeconfig(self, cfg: client.Configuration, path: str) -> None:
        """The context asked for (else the current one) and its namespace, unless one was asked."""
        from kubernetes import config

        try:
            contexts, current = config.list_kube_config_contexts(config_file=path)
        except config.ConfigException as exc:
            raise BackendUnavailableError(f"cannot read kubeconfig {path}: {exc}") from None
        names = [c["name"] for c in contexts]
        if self.context and self.context not in names:
            raise BackendUnavailableError(
                f"kube context {self.context!r} is not in {path} (contexts: {', '.join(names) or 'none'}); "
                "pass --kube-context with one of them"
            )
        ctx = next(c for c in contexts if c["name"] == (self.context or current["name"]))
        self.context = ctx["name"]
        if not self.requested_namespace:
            self.namespace = ctx.get("context", {}).get("namespace") or "default"
        kube_credentials.load_kube_config(cfg, path, self.context)  # exec plugins' credentials cached
        self.kubeconfig = path

    def _load_in_cluster(self, cfg: client.Configuration) -> None:
        from kubernetes import config

        config.load_incluster_config(client_configuration=cfg)
        self.in_cluster = True
        self.context = IN_CLUSTER
        if not self.requested_namespace:
            try:
                with open(SERVICE_ACCOUNT_NAMESPACE) as f:
                    self.namespace = f.read().strip() or "default"
            except OSError:
                pass

    def coordination(self, own: bool = False) -> CoordinationV1Api:
        """The Leases API (``coordination.k8s.io/v1``); ``own``: on a connection pool of its
        own, for another thread (a lease's renewer)."""
        from kubernetes import client

        api = self.api()
        if own:
            return client.CoordinationV1Api(client.ApiClient(self._cfg))
        if self._coordination is None:
            self._coordination = client.CoordinationV1Api(api.api_client)
        return self._coordination

    def configuration(self) -> client.Configuration:
        """The client's configuration of this context (what a port-forward is opened with)."""
        self.api()
        assert self._cfg is not None
        return self._cfg

    def stream_api(self) -> CoreV1Api:
        """A client of its own for each exec: the client's ``stream`` swaps its ApiClient's
        request function while it runs, which breaks any other call sharing it.  (A
        port-forward needs none: ``kube_stream`` opens it from the configuration.)"""
        from kubernetes import client

        self.api()
        return client.CoreV1Api(client.ApiClient(self._cfg))

    @property
    def server(self) -> str:
        """The API server's address ("" before the first request)."""
        return getattr(self._cfg, "host", "")

    def adopt(self, record: KubeRecord) -> None:
        """Talk to the cluster a journal names (context, kubeconfig, namespace): a later
        process's backend (the reaper's, the CLI's) was built without them."""
        if record.context and record.context != IN_CLUSTER:
            self.context = record.context
            self.kubeconfig = record.kubeconfig or self.kubeconfig
        if record.namespace:  # asked for, so that loading the kubeconfig keeps it
            self.namespace = self.requested_namespace = record.namespace

    def exec(self, pod: str, command: list[str], timeout: float = 120) -> tuple[int, str]:
        """Run ``command`` in ``pod``'s container: its exit code and its output (stdout and
        stderr as they came); exit 1 where the exec ended without a status."""
        from kubernetes.stream import stream

        resp = stream(
            self.stream_api().connect_get_namespaced_pod_exec,
            pod,
            self.namespace,
            command=command,
            stderr=True,
            stdin=False,
            stdout=True,
            tty=False,
            _preload_content=False,
        )
        out = []
        deadline = time.monotonic() + timeout
        while resp.is_open() and time.monotonic() < deadline:
            resp.update(timeout=1)
            if resp.peek_stdout():
                out.append(resp.read_stdout())
            if resp.peek_stderr():
                out.append(resp.read_stderr())
        resp.close()
        code = resp.returncode
        return (code if code is not None else 1), "".join(out)

    def port_forward(self, pod: str) -> PortForward:
        """How a client reaches ``pod``'s sshd by a port-forward of this context."""
        context = self.context if self.context and self.context != IN_CLUSTER else None
        return PortForward(self.namespace, pod, 22, self.kubeconfig or None, context)

    def watch_pods(self, selector: str, version: str, seconds: float) -> tuple[watch.Watch, Any]:
        """A watch of the pods of ``selector`` from ``version``, for at most ``seconds``: the
        watch (to stop it) and its stream of events.  Started with ``timeout_seconds``, it
        gets no 410-Gone retry from the client: an expired version raises ApiException(410)."""
        from kubernetes import watch

        w = watch.Watch()
        events = w.stream(
            self.api().list_namespaced_pod,
            self.namespace,
            label_selector=selector,
            resource_version=version,
            timeout_seconds=max(1, int(seconds)),
        )
        return w, events

    def rules_review(self) -> tuple[list[Rule], bool]:
        """The resource rules that apply to this context's user in its namespace
        (SelfSubjectRulesReview), and whether the server says the list is complete."""
        from kubernetes import client

        api = client.AuthorizationV1Api(self.api().api_client)
        spec = client.V1SelfSubjectRulesReviewSpec(namespace=self.namespace)
        status = api.create_self_subject_rules_review(
            client.V1SelfSubjectRulesReview(spec=spec), _request_timeout=30
        ).status
        rules = [
            Rule(
                tuple(r.verbs or ()), tuple(r.api_groups or ()), tuple(r.resources or ()), tuple(r.resource_names or ())
            )
            for r in status.resource_rules or []
        ]
        return rules, not status.incomplete

    def server_version(self) -> tuple[int, int] | None:
        """The API server's Kubernetes version (major, minor); None where it does not say
        (a managed cluster may write its minor as ``"35+"``)."""
        import re

        from kubernetes import client

        info = client.VersionApi(self.api().api_client).get_code(_request_timeout=30)
        major, minor = re.match(r"\d*", info.major or "")[0], re.match(r"\d*", info.minor or "")[0]  # type: ignore[index]
        return (int(major), int(minor)) if major and minor else None

    @staticmethod
    def delete_options(uid: str, grace_period: int | None = None, propagation: str | None = None) -> dict[str, Any]:
        """Delete only the object of this uid (a same-named replacement is never hit); a
        DeleteOptions body as plain JSON, the same for every client major."""
        options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
        if grace_period is not None:
            options["gracePeriodSeconds"] = grace_period
        if propagation is not None:
            options["propagationPolicy"] = propagation
        return options
