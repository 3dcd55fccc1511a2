"""A kube context's configuration, loaded through the kubernetes client's public loaders, with
an exec plugin's credential run at most once per its lifetime.

Every new proxy loads the kubeconfig again, and a user whose credential comes from an exec
plugin (``aws eks get-token``, ``gke-gcloud-auth-plugin``: about a second each) would run it
for every connection.  So where the context's user names an ``exec`` plugin, pytest-sky runs
it itself, by the documented client-go credential plugin protocol (``KUBERNETES_EXEC_INFO``
in, an ``ExecCredential`` out), keeps what it returned for as long as its
``expirationTimestamp`` says, in a 0600 file of the user's state directory, and hands the
client the kubeconfig with that credential in the plugin's place
(``config.load_kube_config_from_dict``).  A token that expires while a session runs is
fetched again through the configuration's ``refresh_api_key_hook``.  Nothing of the client's
own is replaced: every other kubeconfig is loaded by ``config.load_kube_config`` as it is.
"""

from __future__ import annotations

import base64
import copy
import datetime
import hashlib
import json
import os
import subprocess
import threading
import time
from typing import Any

from pytest_sky.errors import BackendUnavailableError
from pytest_sky.settings import state_home

#: A cached credential this close to its expiry is fetched again (clock skew, slow connects).
EXPIRY_MARGIN = 60.0
#: How long a plugin may take (an SSO plugin that waits on a browser never finishes: it is
#: not interactive here).
PLUGIN_TIMEOUT = 120.0
_lock = threading.Lock()
#: kubeconfig fields that name files, relative to the kubeconfig that holds them.
_FILE_FIELDS = {"cluster": ("certificate-authority",), "user": ("client-certificate", "client-key", "tokenFile")}


def default_path() -> str:
    """The kubeconfig the client reads when none is named: ``KUBECONFIG``, else ~/.kube/config."""
    return os.environ.get("KUBECONFIG") or "~/.kube/config"


def _read(paths: list[str]) -> dict[str, Any]:
    """The kubeconfig files merged as kubectl merges them (the first file that names a
    cluster, user or context, or the current context, wins), each file path made absolute."""
    import yaml

    merged: dict[str, Any] = {"clusters": [], "users": [], "contexts": []}
    for path in paths:
        try:
            with open(path) as f:
                doc = yaml.safe_load(f) or {}
        except OSError:
            continue
        base = os.path.dirname(os.path.abspath(path))
        if not merged.get("current-context"):
            merged["current-context"] = doc.get("current-context")
        for kind, inner in (("clusters", "cluster"), ("users", "user"), ("contexts", "context")):
            known = {e.get("name") for e in merged[kind]}
            for entry in doc.get(kind) or []:
                if entry.get("name") in known:
                    continue
                entry = copy.deepcopy(entry)
                body = entry.get(inner) or {}
                for key in _FILE_FIELDS.get(inner, ()):
                    if isinstance(body.get(key), str) and not os.path.isabs(body[key]):
                        body[key] = os.path.join(base, body[key])
                exec_config = body.get("exec") if inner == "user" else None
                if exec_config and "/" in str(exec_config.get("command", "")):
                    exec_config["command"] = os.path.join(base, exec_config["command"])
                merged[kind].append(entry)
    return merged


def _named(entries: list[dict[str, Any]], name: str | None, inner: str) -> dict[str, Any]:
    for entry in entries:
        if entry.get("name") == name:
            return entry.get(inner) or {}
    return {}


class _CachedCredential:
    """What an exec credential plugin returned (its ExecCredential ``status``), kept in
    ``<state>/kube-credentials/<hash>.json`` (0600) until ``expirationTimestamp``.  The hash
    covers the kubeconfig path, the context and the plugin's own configuration, so another
    context, or an edited plugin entry, never gets this credential.  A plugin that gives no
    expiry is run every time, as the kubernetes client does across processes."""

    def __init__(self, kubeconfig: str, context: str | None, exec_config: dict[str, Any]) -> None:
        self.exec_config = exec_config
        plugin = json.dumps(exec_config, sort_keys=True, default=str)
        digest = hashlib.sha256("\0".join((os.path.abspath(kubeconfig), context or "", plugin)).encode()).hexdigest()
        self.path = state_home() / "kube-credentials" / f"{digest[:24]}.json"

    def read(self) -> dict | None:
        try:
            status = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        expiry = _expiry(status)
        if expiry is None or expiry - time.time() <= EXPIRY_MARGIN:
            return None
        return status

    def write(self, status: dict) -> None:
        if _expiry(status) is None:
            return
        self.path.parent.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # the state home
        self.path.parent.mkdir(exist_ok=True, mode=0o700)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(status, fh)
        os.replace(tmp, self.path)

    def get(self) -> dict:
        """The credential: the cached one while it lasts, else the plugin's, cached."""
        with _lock:
            status = self.read()
            if status is None:
                status = run_plugin(self.exec_config)
                self.write(status)
            return status


def _expiry(status: dict) -> float | None:
    stamp = status.get("expirationTimestamp")
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def run_plugin(exec_config: dict[str, Any]) -> dict:
    """Run an exec credential plugin as client-go does (not interactive): its ExecCredential's
    ``status``; a plugin that fails is one line naming it and its last words."""
    command = [str(exec_config.get("command", "")), *(str(a) for a in exec_config.get("args") or [])]
    env = {**os.environ, **{str(e["name"]): str(e["value"]) for e in exec_config.get("env") or []}}
    version = exec_config.get("apiVersion") or "client.authentication.k8s.io/v1beta1"
    env["KUBERNETES_EXEC_INFO"] = json.dumps(
        {"apiVersion": version, "kind": "ExecCredential", "spec": {"interactive": False}}
    )
    try:
        done = subprocess.run(
            command,
            env=env,
            capture_output=True,
            text=True,
            timeout=PLUGIN_TIMEOUT,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendUnavailableError(
            f"the kubeconfig's exec credential plugin {command[0]!r} did not run: {exc}"
        ) from None
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:300]
        raise BackendUnavailableError(f"the kubeconfig's exec credential plugin {command[0]!r} failed: {said}")
    try:
        status = json.loads(done.stdout)["status"]
    except (ValueError, KeyError, TypeError):
        raise BackendUnavailableError(
            f"the kubeconfig's exec credential plugin {command[0]!r} printed no ExecCredential status"
        ) from None
    return status


def _with_credential(user: dict[str, Any], status: dict) -> dict[str, Any]:
    """The kubeconfig user entry with the plugin's credential in its ``exec``'s place."""
    user = {k: v for k, v in user.items() if k != "exec"}
    if status.get("token"):
        user["token"] = status["token"]
    if status.get("clientCertificateData") and status.get("clientKeyData"):
        user["client-certificate-data"] = base64.b64encode(status["clientCertificateData"].encode()).decode()
        user["client-key-data"] = base64.b64encode(status["clientKeyData"].encode()).decode()
    return user


def load_kube_config(cfg: Any, kubeconfig: str | None, context: str | None) -> None:
    """The kubeconfig's ``context`` (its current one when None) into the client's
    configuration ``cfg``, an exec plugin's credential served from the cache while it lasts."""
    from pytest_sky import state

    path = os.path.expanduser(kubeconfig or default_path())
    paths = [os.path.expanduser(p) for p in path.split(os.pathsep) if p]
    merged = _read(paths)
    name = context or merged.get("current-context")
    user_name = _named(merged["contexts"], name, "context").get("user")
    user_entry = next((u for u in merged["users"] if u.get("name") == user_name), None)
    exec_config = (user_entry or {}).get("user", {}).get("exec")
    temp = str(state.process_files())  # inline certificates: never left in /tmp
    from kubernetes import config

    if not exec_config:
        config.load_kube_config(config_file=path, context=context, client_configuration=cfg, temp_file_path=temp)
        return
    cached = _CachedCredential(paths[0], name, exec_config)
    status = cached.get()
    assert user_entry is not None
    user_entry["user"] = _with_credential(user_entry["user"], status)
    config.load_kube_config_from_dict(merged, context=name, client_configuration=cfg, temp_file_path=temp)
    if status.get("token") and _expiry(status) is not None:
        cfg.refresh_api_key_hook = _Refresher(cached, _expiry(status) or 0.0)


class _Refresher:
    """The configuration's ``refresh_api_key_hook``: a token near its expiry is fetched again
    (from the cache, else the plugin) before a request carries it."""

    def __init__(self, cached: _CachedCredential, expiry: float) -> None:
        self.cached = cached
        self.expiry = expiry

    def __call__(self, cfg: Any) -> None:
        if self.expiry - time.time() > EXPIRY_MARGIN:
            return
        status = self.cached.get()
        self.expiry = _expiry(status) or time.time() + EXPIRY_MARGIN * 2
        for key in ("BearerToken", "authorization"):  # the key the client's major stores it under
            if key in cfg.api_key:
                cfg.api_key[key] = f"Bearer {status['token']}"
