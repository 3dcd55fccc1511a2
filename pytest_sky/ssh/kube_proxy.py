"""A pod's sshd through the API server's port-forward websocket (``kube_stream``).

The streams (:class:`Forward`) that the client's own connection opens in its process and the
cluster's forwarder (``kube_forwarder``) opens for each ssh connection; and, as
``python -m pytest_sky.ssh.kube_proxy --namespace NS --pod POD [--context C] [--kubeconfig K]``,
the self-contained ProxyCommand that ``kube_dial`` becomes where no forwarder answers.  Each
connection is handed over only after the pod's SSH banner has arrived through its stream:
ready by construction, where ``kubectl port-forward`` gives no signal at all (the race
SkyPilot papered over with a random sleep).  Loading the kubernetes client costs most of a CPU
second, which is why this runs as a process only as the fallback.

It also reads the API server's refusals (:func:`refusal_message`), for itself and for the
backend: a refused websocket (exec, port-forward) arrives as an ``ApiException`` with status
0 and the handshake's status line, headers and ``Status`` body in its reason, and an RBAC
403 names the verb and resource that were missing (:func:`rbac_line` says how to grant it).

Every new proxy loads the kubeconfig again, through ``kube_credentials``, which keeps what an
exec credential plugin returned for as long as it lasts.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import socket
import sys
from typing import Any

from pytest_sky.cluster_info import PortForward
from pytest_sky.errors import RunError
from pytest_sky.ssh import kube_credentials, kube_dial, kube_stream

BANNER_TIMEOUT = kube_dial.BANNER_TIMEOUT
#: The Role that grants every verb the backend uses (docs/kubernetes.md, "The Role").
RBAC_ROLE_FILE = "examples/kubernetes/rbac.yaml"
_FORBIDDEN = re.compile(
    r'User "(?P<user>[^"]*)" cannot (?P<verb>\S+) resource "(?P<resource>[^"]+)" in API group "(?P<group>[^"]*)" '
    r'(?:in the namespace "(?P<namespace>[^"]*)"|at the cluster scope)'
)
_HANDSHAKE = re.compile(r"Handshake status (\d+)")


def refusal_message(exc: BaseException) -> str:
    """The API server's own message for a refused request (its ``Status.message``), from a
    plain ``ApiException`` or a refused websocket handshake; else the exception's first line."""
    body = getattr(exc, "body", None)
    reason = str(getattr(exc, "reason", "") or "")
    if not body and _HANDSHAKE.match(reason):
        body = reason.rsplit(" -+-+- ", 1)[-1]
    if body:
        try:
            return str(json.loads(body).get("message") or body)[:500]
        except (ValueError, AttributeError):
            return str(body)[:300]
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


def rbac_line(message: str) -> str | None:
    """For an RBAC denial (the API server's message names user, verb and resource): which
    verb on which resource is missing and how to grant it, in one line; None for any other."""
    m = _FORBIDDEN.search(message)
    if m is None:
        return None
    resource = m["resource"] + (f" (API group {m['group']})" if m["group"] else "")
    if m["namespace"] is None:
        return (
            f'User "{m["user"]}" may not {m["verb"]} {resource} at the cluster scope (403 Forbidden): '
            "a Role cannot grant that; ask your cluster admin for a ClusterRole with it"
        )
    ns = m["namespace"]
    return (
        f'User "{m["user"]}" may not {m["verb"]} {resource} in namespace "{ns}" (403 Forbidden): '
        f"grant the Role pytest-sky needs, kubectl apply -n {ns} -f {RBAC_ROLE_FILE}, and bind it to that user"
    )


def describe_refusal(exc: BaseException) -> str:
    """One line for a refused request: the RBAC advice where it is one, else the server's message."""
    message = refusal_message(exc)
    return rbac_line(message) or message


def open_forward(cfg: Any, namespace: str, pod: str, port: int = 22) -> kube_stream.PortStream:
    """``pod``'s ``port`` through its port-forward websocket (``kube_stream``), opened with the
    cluster's ``Configuration`` (``cfg``) alone; a refused handshake raises as the client's own
    call reports one (``ApiException`` with status 0 and the handshake's answer)."""
    from kubernetes.client.rest import ApiException

    try:
        return kube_stream.PortStream(cfg, namespace, pod, port)
    except Exception as exc:  # as the client's own call reports a refused handshake
        raise ApiException(status=0, reason=_handshake_reason(exc)) from exc


def _handshake_reason(exc: BaseException) -> str:
    """websocket-client's refusal as the client's own websocket call words it: the handshake's
    status line and the API server's Status body after ``-+-+-``."""
    status = getattr(exc, "status_code", None)
    body = getattr(exc, "resp_body", None)
    if status is None:
        return str(exc)
    text = body.decode(errors="replace") if isinstance(body, bytes) else str(body or "")
    return f"Handshake status {status} {exc} -+-+- {text}"


def read_banner(cfg: Any, namespace: str, pod: str, port: int = 22, timeout: float = BANNER_TIMEOUT) -> bytes:
    """Open a forward, see the banner, close it: the readiness probe of a pod's sshd."""
    pf = open_forward(cfg, namespace, pod, port)
    try:
        return peek_banner(pf.socket, timeout, f"{pod}:{port}")
    finally:
        pf.close()


def peek_banner(sock: Any, timeout: float, where: str) -> bytes:
    """The first bytes through the stream, which must begin an SSH banner (readiness: sshd
    answered), left unread: whoever gets the stream next (ssh, paramiko, a relay) reads the
    banner itself.  Whatever part of it has arrived will do: it is the answer that counts."""
    ready, _, _ = select.select([sock], [], [], timeout)
    if not ready:
        raise TimeoutError("no SSH banner through the port-forward")
    first = sock.recv(64, socket.MSG_PEEK)
    if not first:
        raise ConnectionError("the port-forward closed before the SSH banner")
    if not first.startswith(b"SSH-"[: len(first)]):
        raise ConnectionError(f"{where} did not answer with an SSH banner: {first[:60]!r}")
    return first


class Forward:
    """An open port-forward to a pod's port, whose socket carries the connection; the
    client's thread that relays it to the API server's websocket ends with :meth:`close`."""

    def __init__(self, route: PortForward, cfg: Any = None) -> None:
        """``cfg``: the kubernetes client's configuration to open it with (none: the route's)."""
        self.route = route
        self._pf = open_forward(cfg or configuration(route), route.namespace, route.pod, route.port)
        self.socket = _ClosesGently(self._pf.socket)

    def error(self) -> str | None:
        """What the API server said when the forward failed, if it said anything."""
        return self._pf.error()

    def close(self) -> None:
        self._pf.close()

    def hand_over(self) -> int:
        """The stream's descriptor, for another process to use: this object no longer closes
        it (the relay thread ends once every copy of it is closed)."""
        return self._pf.socket.detach()


def configuration(route: PortForward) -> Any:
    """The kubernetes client's configuration for ``route``'s cluster: its kubeconfig and
    context, or the pod's own service account where there is no kubeconfig in a pod."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if route.kubeconfig or not os.environ.get("KUBERNETES_SERVICE_HOST"):
        kube_credentials.load_kube_config(cfg, route.kubeconfig, route.context)
    else:
        config.load_incluster_config(client_configuration=cfg)
    return cfg


class _ClosesGently:
    """The forward's socket, closed so that the client's relay thread sees an end of stream.

    The relay holds the other end of a socketpair; closing this end with bytes still unread
    (sshd's last packets, after the SSH client said goodbye) resets the relay's next read,
    and its thread dies with a traceback on the user's terminal.  So a close first says
    "no more from us", then reads until the relay has closed its end (it does once it sees
    ours), for at most a moment, and only then closes."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def close(self) -> None:
        kube_dial.close_gently(self._sock)


def open_in_process(route: PortForward) -> Forward:
    """The forward of ``route``, in this process (no proxy process to start), for a client
    that already has the kubernetes client loaded; a refusal is one line, as the proxy's."""
    try:
        return Forward(route)
    except Exception as exc:  # noqa: BLE001 - any failure is the run's: one line, pod and reason
        where = f"{route.namespace}/{route.pod}:{route.port}"
        raise RunError(f"cannot connect to the head at {where}: {describe_refusal(exc)}") from None


def open_head(route: PortForward, dial_socket: str | None) -> Forward | kube_dial.Dialled:
    """The head's stream for a client in this process: from the cluster's forwarder where one
    answers (this process then never loads the kubernetes client, most of a CPU second for a
    CLI call), else a port-forward opened here; a refusal is one line, as the proxy's."""
    if dial_socket:
        try:
            return kube_dial.open_stream(dial_socket, kube_dial.DialRequest(route.namespace, route.pod, route.port))
        except (FileNotFoundError, ConnectionRefusedError):
            pass  # no forwarder listens (gone with the process that launched): open it here
        except OSError as exc:
            where = f"{route.namespace}/{route.pod}:{route.port}"
            raise RunError(f"cannot connect to the head at {where}: {exc}") from None
    return open_in_process(route)


def command(route: PortForward) -> str:
    """The ProxyCommand (a shell line) that runs this module for ``route``: the arguments are
    the ones :func:`main` parses, from the same parser (``kube_dial``'s)."""
    argv = [sys.executable, "-m", "pytest_sky.ssh.kube_proxy", *args_of(route)]
    return shlex.join(argv)


def args_of(route: PortForward) -> list[str]:
    return kube_dial.route_args(route.namespace, route.pod, route.port, route.kubeconfig, route.context)


def main(argv: list[str] | None = None) -> int:
    args = kube_dial.parser("python -m pytest_sky.ssh.kube_proxy", __doc__.split("\n")[0]).parse_args(argv)
    route = PortForward(args.namespace, args.pod, args.port, args.kubeconfig, args.context)
    try:
        forward = Forward(route)
        peek_banner(forward.socket, BANNER_TIMEOUT, f"{args.pod}:{args.port}")
    except Exception as exc:  # noqa: BLE001 - ssh shows our stderr: one line, then exit 255 like ssh
        reason = describe_refusal(exc)
        sys.stderr.write(f"pytest-sky proxy: cannot reach {args.namespace}/{args.pod}:{args.port}: {reason}\n")
        return 255
    try:
        return kube_dial.relay(forward.socket)  # type: ignore[arg-type]
    except (OSError, ValueError) as exc:
        error = forward.error()
        sys.stderr.write(f"pytest-sky proxy: port-forward to {args.pod} dropped: {error or exc}\n")
        return 255


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # the forward's proxy thread must not keep the process alive
