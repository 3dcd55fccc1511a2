"""ProxyCommand to a pod's sshd through the API server's port-forward websocket.

``python -m pytest_sky.ssh.kube_proxy --namespace NS --pod POD [--context C] [--kubeconfig K]``

One port-forward stream per SSH connection (no shared local port), and the connection is
handed to ssh only after the pod's SSH banner has arrived through it: ready by construction,
where ``kubectl port-forward`` gives no signal at all (the race SkyPilot papered over with a
random sleep).  Importing the kubernetes client costs most of a second, so the generated ssh
config multiplexes (ControlMaster): bursts of connections reuse one proxy.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import time
from typing import Any

BANNER_TIMEOUT = 30.0


def open_forward(api: Any, namespace: str, pod: str, port: int = 22) -> Any:
    from kubernetes.stream import portforward

    return portforward(api.connect_get_namespaced_pod_portforward, pod, namespace, ports=str(port))


def _read_line(sock: Any, timeout: float) -> bytes:
    data = b""
    deadline = time.monotonic() + timeout
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no SSH banner through the port-forward")
        ready, _, _ = select.select([sock], [], [], left)
        if not ready:
            continue
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError("the port-forward closed before the SSH banner")
        data += chunk
        if len(data) > 1024:
            break
    return data


def read_banner(api: Any, namespace: str, pod: str, port: int = 22, timeout: float = BANNER_TIMEOUT) -> bytes:
    """Open a forward, read the banner, close it: the readiness probe of a pod's sshd."""
    pf = open_forward(api, namespace, pod, port)
    try:
        sock = pf.socket(port)
        banner = _read_line(sock, timeout)
        if not banner.startswith(b"SSH-"):
            raise ConnectionError(f"not an SSH banner: {banner[:60]!r}")
        return banner
    finally:
        pf.close()


def relay(sock: Any, banner: bytes) -> int:
    """stdin -> pod and pod -> stdout until either side closes."""
    out = sys.stdout.fileno()
    inp = sys.stdin.fileno()
    os.write(out, banner)
    watch = [inp, sock]
    while True:
        ready, _, _ = select.select(watch, [], [])
        if inp in ready:
            data = os.read(inp, 65536)
            if not data:
                try:
                    sock.shutdown(1)
                except OSError:
                    pass
                watch.remove(inp)
            else:
                sock.sendall(data)
        if sock in ready:
            data = sock.recv(65536)
            if not data:
                return 0
            while data:
                data = data[os.write(out, data) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_sky.ssh.kube_proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--pod", required=True)
    parser.add_argument("--port", type=int, default=22)
    parser.add_argument("--context")
    parser.add_argument("--kubeconfig")
    args = parser.parse_args(argv)
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        if args.kubeconfig or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_kube_config(config_file=args.kubeconfig, context=args.context, client_configuration=cfg)
        else:
            config.load_incluster_config(client_configuration=cfg)
        api = client.CoreV1Api(client.ApiClient(cfg))
        pf = open_forward(api, args.namespace, args.pod, args.port)
        sock = pf.socket(args.port)
        banner = _read_line(sock, BANNER_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - ssh shows our stderr: one line, then exit 255 like ssh
        sys.stderr.write(f"pytest-sky proxy: cannot reach {args.namespace}/{args.pod}:{args.port}: {exc}\n")
        return 255
    if not banner.startswith(b"SSH-"):
        sys.stderr.write(f"pytest-sky proxy: {args.pod}:{args.port} did not answer with an SSH banner\n")
        return 255
    try:
        return relay(sock, banner)
    except (OSError, ValueError) as exc:
        error = pf.error(args.port)
        sys.stderr.write(f"pytest-sky proxy: port-forward to {args.pod} dropped: {error or exc}\n")
        return 255


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # the forward's proxy thread must not keep the process alive
