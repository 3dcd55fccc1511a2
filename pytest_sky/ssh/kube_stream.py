"""A pod's port through the API server's port-forward websocket, spoken by pytest-sky itself
over ``websocket-client``: the documented channel protocol, and nothing private of the
kubernetes client.

The subresource ``pods/<pod>/portforward?ports=<port>`` upgrades to a websocket of the
``v4.channel.k8s.io`` protocol: every binary message begins with its channel (``2i`` the data
of the i-th port, ``2i+1`` its errors), and the first message of each channel from the server
carries the port, two bytes little-endian, before any data.  The request is the one the
client's ``CoreV1Api.connect_get_namespaced_pod_portforward`` sends, made from the
configuration alone (its host, its TLS settings, its credentials through ``auth_settings()``,
its proxy): importing ``CoreV1Api`` builds every typed model of the core API, most of a
forwarder's start.

One thread per stream relays between the websocket and one end of a socket pair; the other end
is :attr:`PortStream.socket`.  Whatever ends the websocket (a close, a reset from the API
server or a load balancer) ends the relay the way a close does: the local socket reads
end-of-file, which ssh reports as a closed connection, never a traceback.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
from typing import Any
from urllib.parse import quote, urlparse

#: The streaming protocol the port-forward websocket speaks.
PROTOCOL = "v4.channel.k8s.io"
DATA, ERROR = 0, 1  # the channels of the one port a stream forwards


def websocket_url(host: str, path: str) -> str:
    """The configuration's host (``https://...``) as the websocket's URL."""
    if host.startswith("https://"):
        return "wss://" + host[len("https://") :] + path
    if host.startswith("http://"):
        return "ws://" + host[len("http://") :] + path
    return host + path


def _ssl_options(cfg: Any) -> dict[str, Any]:
    """The configuration's TLS settings as websocket-client's ``sslopt``."""
    if not cfg.verify_ssl:
        options: dict[str, Any] = {"cert_reqs": ssl.CERT_NONE}
    else:
        import certifi

        options = {"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": cfg.ssl_ca_cert or certifi.where()}
        if cfg.assert_hostname is not None:
            options["check_hostname"] = bool(cfg.assert_hostname)
    if cfg.cert_file:
        options["certfile"] = cfg.cert_file
    if cfg.key_file:
        options["keyfile"] = cfg.key_file
    if getattr(cfg, "tls_server_name", None):
        options["server_hostname"] = cfg.tls_server_name
    return options


def _proxy_options(cfg: Any, url: str) -> dict[str, Any]:
    """The configuration's HTTP proxy (unless ``no_proxy`` names the API server's host)."""
    proxy = getattr(cfg, "proxy", None)
    if not proxy:
        return {}
    host = urlparse(url).hostname or ""
    skip = [h.strip().lstrip(".") for h in str(getattr(cfg, "no_proxy", "") or "").split(",") if h.strip()]
    if "*" in skip or any(host == h or host.endswith("." + h) for h in skip):
        return {}
    parsed = urlparse(proxy)
    options: dict[str, Any] = {"http_proxy_host": parsed.hostname, "http_proxy_port": parsed.port, "proxy_type": "http"}
    if parsed.username:
        options["http_proxy_auth"] = (parsed.username, parsed.password or "")
    return options


def connect(cfg: Any, namespace: str, pod: str, port: int) -> Any:
    """The port-forward websocket of ``pod``'s ``port``, open (its handshake answered)."""
    import websocket

    path = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(pod, safe='')}/portforward?ports={port}"
    url = websocket_url(cfg.host, path)
    headers = [f"{a['key']}: {a['value']}" for a in cfg.auth_settings().values() if a["in"] == "header" and a["value"]]
    ws = websocket.WebSocket(sslopt=_ssl_options(cfg), skip_utf8_validation=True)
    ws.connect(url, header=headers, subprotocols=[PROTOCOL], **_proxy_options(cfg, url))
    return ws


class PortStream:
    """One port of a pod, through its own port-forward websocket, as a local socket."""

    def __init__(self, cfg: Any, namespace: str, pod: str, port: int) -> None:
        self._ws = connect(cfg, namespace, pod, port)
        self.socket, self._theirs = socket.socketpair()
        self._error: str | None = None
        self._prefixed = {DATA: False, ERROR: False}
        self._thread = threading.Thread(target=self._relay, name=f"port-forward {pod}:{port}", daemon=True)
        self._thread.start()

    def error(self) -> str | None:
        """What the API server said on the port's error channel, if anything."""
        return self._error

    def close(self) -> None:
        """Close the websocket: the relay ends, and the local socket reads end-of-file."""
        try:
            self._ws.shutdown()
        except OSError:
            pass

    def _relay(self) -> None:
        import websocket

        try:
            while self._pump():
                pass
        except (OSError, ValueError, websocket.WebSocketException):
            pass  # a reset or a broken frame ends the stream as a close does
        finally:
            try:
                self._theirs.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._theirs.close()
            self.close()

    def _pump(self) -> bool:
        """Move what is ready, each way; False once either side has ended."""
        ws_sock = self._ws.sock
        if ws_sock is None:
            return False
        pending = isinstance(ws_sock, ssl.SSLSocket) and ws_sock.pending()
        ready = [ws_sock] if pending else select.select([ws_sock, self._theirs], [], [])[0]
        if self._theirs in ready:
            data = self._theirs.recv(65536)
            if not data:
                return False
            self._ws.send_binary(bytes([DATA]) + data)
        if ws_sock in ready:
            return self._receive()
        return True

    def _receive(self) -> bool:
        import websocket

        opcode, payload = self._ws.recv_data(control_frame=True)
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            return False
        if opcode not in (websocket.ABNF.OPCODE_BINARY, websocket.ABNF.OPCODE_TEXT) or not payload:
            return True
        channel, body = payload[0], bytes(payload[1:])
        if channel in self._prefixed and not self._prefixed[channel]:
            body, self._prefixed[channel] = body[2:], True  # the port, before the first data
        if channel == DATA and body:
            self._theirs.sendall(body)
        elif channel == ERROR and body:
            self._error = body.decode(errors="replace")
        return True
