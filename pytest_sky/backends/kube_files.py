"""Files in a cluster's pods: what the Secret carries, what is written once pod IPs exist, and
the shared directory emptied when the cluster goes.

Keys and the agent go in the Secret, mounted before sshd starts; ``~/.ssh/config`` and
``known_hosts`` name every pod by IP, so they can only be written (by exec) once every pod
runs.
"""

from __future__ import annotations

import base64
import logging
import shlex

from pytest_sky import shell
from pytest_sky.backends import kube_manifests as manifests
from pytest_sky.backends.base import HomeFiles, ProvisionConfig
from pytest_sky.backends.kube_client import KubeClient
from pytest_sky.backends.kube_errors import api_message
from pytest_sky.backends.kube_waiting import PodWaiter, in_parallel
from pytest_sky.cluster_info import NodeInfo
from pytest_sky.errors import ProvisionError

log = logging.getLogger(__name__)


def secret_files(config: ProvisionConfig) -> dict[str, bytes]:
    """Host keys and the cluster key go in the Secret now; files that need pod IPs follow."""
    home = config.home_files
    files = {
        "authorized_keys": home[".ssh/authorized_keys"][0],
        "id_ed25519": home[".ssh/id_ed25519"][0],
        "id_ed25519.pub": home[".ssh/id_ed25519.pub"][0],
        shell.AGENT_BUNDLE: home[f".sky/{shell.AGENT_BUNDLE}"][0],
        manifests.SITE_HOOK_KEY: home[f"{shell.SITE_DIR}/{manifests.SITE_HOOK_KEY}"][0],
        manifests.SSHD_CONFIG_KEY: manifests.sshd_config_text().encode(),
    }
    for rank, key in enumerate(config.keys.hosts):
        files[manifests.host_key(rank)] = key.private_openssh
    return files


def install_script(files: HomeFiles) -> list[str]:
    """The command that writes ``files`` into the home of the pod it runs in."""
    script = ["set -e", "umask 077", 'mkdir -p "$HOME/.ssh"']
    for rel, (content, mode) in files.items():
        b64 = base64.b64encode(content).decode()
        script.append(f'echo {b64} | base64 -d > "$HOME/{rel}"')
        script.append(f'chmod {mode:o} "$HOME/{rel}"')
    return ["/bin/sh", "-c", "\n".join(script)]


def install_node_files(client: KubeClient, waiter: PodWaiter, nodes: list[NodeInfo], files: HomeFiles) -> None:
    """Write ``files`` into every pod at once; a pod that died under the exec is named with
    its own error (phase, events, log) rather than the exec's."""
    command = install_script(files)
    errors: dict[str, str] = {}

    def one(hostname: str) -> None:
        try:
            code, out = client.exec(hostname, command)
        except Exception as exc:  # noqa: BLE001 - a pod that died under us refuses the exec: say so
            errors[hostname] = api_message(exc)
            return
        if code != 0:
            errors[hostname] = out.strip()[-300:] or f"exit {code}"

    in_parallel([n.hostname for n in nodes], one)
    if errors:
        name, err = sorted(errors.items())[0]
        waiter.explain_exec_failure(name)
        raise ProvisionError(f"could not set up SSH on pod {name}: {err}")


def empty_shared_dir(client: KubeClient, head: str, path: str) -> None:
    """The cluster's directory in the shared claim goes with the cluster: emptied from the
    head while it still runs (the claim and its other clusters' directories stay)."""
    try:
        code, out = client.exec(head, ["/bin/sh", "-c", f"find {shlex.quote(path)} -mindepth 1 -delete"], timeout=60)
    except Exception as exc:  # noqa: BLE001 - a head already gone has nothing to empty from
        log.warning("could not empty %s's shared directory: %s", head, exc)
        return
    if code != 0:
        log.warning("could not empty %s's shared directory: %s", head, out.strip()[-200:])
