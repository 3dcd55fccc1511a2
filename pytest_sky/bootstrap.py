"""What every node and the client need to reach each other with host keys checked.

The same for every backend: the backend decides how the files land (the local backend
writes them into each node's home on disk, the Kubernetes one through a Secret and an exec).
Every node gets the cluster key and a copy of the agent before its sshd starts
(:func:`home_files`), then, once every address is known, the same ``~/.ssh/config`` and
``known_hosts`` (:func:`peer_files`: head -> worker works, and so does worker -> worker,
which mpirun's tree spawn uses).

The agent travels as one zipapp, ``~/.sky/agent.pyz`` (:func:`agent_bundle`): the ``agent``
package, the stdlib-only modules it imports (``protocol``, ``naming``, ``procs``, ``shell``)
and the scripts it runs, generated from this package on every launch, so the head always
runs the same protocol as the client.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import socket
import stat
import subprocess
import zipfile
from pathlib import Path

from pytest_sky import shell
from pytest_sky.backends.base import HomeFiles
from pytest_sky.cluster_info import NodeInfo
from pytest_sky.ssh import config as ssh_config
from pytest_sky.ssh.keys import ClusterKeys, known_host_keys, known_hosts_lines, write_private
from pytest_sky.ssh.keys import load as load_key

#: Where the agent lives in a node's home (a home file), and how a command line names it.
AGENT_FILE = ".sky/" + shell.AGENT_BUNDLE
AGENT_PATH = "~/" + AGENT_FILE
#: The agent and the stdlib-only modules it imports: one zipapp, generated, never copied by hand.
AGENT_MODULES = (
    "agent",
    "agent.child",
    "agent.control",
    "agent.fanout",
    "agent.queue",
    "agent.rank",
    "agent.records",
    "agent.remote",
    "agent.server",
    "agent.site_hook",
    "agent.stacks",
    "agent.supervisor",
    "locks",
    "masking",
    "naming",
    "procs",
    "protocol",
    "shell",
)
#: The scripts the agent reads from its bundle (:func:`pytest_sky.shell.script`).
AGENT_DATA = ("shell/" + shell.RANK_SUPERVISOR,)
#: The bundle's entry; its ``pytest_sky/__init__.py`` is empty (the package's own imports
#: everything, on a node that has none of it).
AGENT_MAIN = b"from pytest_sky.agent import entry\n\nentry()\n"


@functools.cache
def agent_bundle() -> bytes:
    """The agent as one zipapp, run as ``python -I -S ~/.sky/agent.pyz MODE``.

    Built in memory from this package's own modules, the same bytes for the same code (sorted
    entries, a fixed date, stored uncompressed: no zlib version in the result), so that a
    node's copy can be compared and nothing differs between two launches.  Each module also
    comes compiled for this interpreter (:func:`_bytecode`): a python reads no ``.pyc`` of
    a script, and compiling the agent's source cost ~10 ms of every run.

    Building it (a clean interpreter compiles the bytecode) costs ~50 ms, which every pytest
    run would pay on its first launch; so the result is kept in the state directory under a
    hash of the sources and this interpreter, and built only when either changes.
    """
    import hashlib
    import sys

    from pytest_sky.state import home

    package = Path(__file__).parent
    sources = {f"pytest_sky/{path}": (package / path).read_bytes() for path in map(module_path, AGENT_MODULES)}
    data = {f"pytest_sky/{path}": (package / path).read_bytes() for path in AGENT_DATA}
    key = hashlib.sha256(
        repr((sys.version, sys.executable, sorted(sources.items()), sorted(data.items()))).encode()
    ).hexdigest()[:16]
    cached = home() / "cache" / f"agent-{key}.pyz"
    try:
        return cached.read_bytes()
    except OSError:
        pass
    bundle = _build_bundle(sources, data)
    cached.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    tmp.write_bytes(bundle)
    os.replace(tmp, cached)  # atomic: concurrent runs (xdist workers) write the same bytes
    prune_bundles(cached.parent)
    return bundle


#: How many agent bundles the cache keeps (each version of pytest-sky, or interpreter, has one).
KEPT_BUNDLES = 4


def prune_bundles(cache: Path) -> None:
    """Keep the newest :data:`KEPT_BUNDLES` bundles and no half-written one of a process that
    is gone: every upgrade or edit of pytest-sky adds a bundle of ~250 KB, and nothing else
    would ever remove the older ones.  A process still using a removed one builds it again."""
    from pytest_sky import procs

    def age(path: Path) -> float:
        try:
            return -path.stat().st_mtime
        except OSError:  # pruned meanwhile by another process
            return 0.0

    bundles = sorted(cache.glob("agent-*.pyz"), key=age)
    doomed = bundles[KEPT_BUNDLES:]
    for tmp in cache.glob("agent-*.pyz.*.tmp"):
        pid = tmp.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not procs.is_alive(int(pid)):
            doomed.append(tmp)
    for path in doomed:
        try:
            path.unlink()
        except OSError:
            pass  # already gone: another process pruned it


def module_path(module: str) -> str:
    """Where module ``module`` of this package (``"agent.rank"``) lies, relative to it."""
    path = module.replace(".", "/")
    return f"{path}/__init__.py" if (Path(__file__).parent / path).is_dir() else f"{path}.py"


def _build_bundle(sources: dict[str, bytes], data: dict[str, bytes]) -> bytes:
    members = {"__main__.py": AGENT_MAIN, "pytest_sky/__init__.py": b"", **sources, **data}
    members.update({name + "c": pyc for name, pyc in _bytecode(sources).items()})
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as bundle:
        for name in sorted(members):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            bundle.writestr(info, members[name])
    return out.getvalue()


# Run in a fresh interpreter: marshal writes each string as interned or shared the way the
# writing process happens to hold it, so only a process in a known state (no site, a fixed
# hash seed) gives the same bytes for the same source.
_COMPILE = f"""
import importlib.util, marshal, sys
out = {{}}
for name, source in marshal.loads(sys.stdin.buffer.read()).items():
    code = compile(source, {AGENT_PATH!r} + "/" + name, "exec", dont_inherit=True, optimize=0)
    header = importlib.util.MAGIC_NUMBER + (0b01).to_bytes(4, "little") + importlib.util.source_hash(source)
    out[name] = header + marshal.dumps(code)
sys.stdout.buffer.write(marshal.dumps(out))
"""


def _bytecode(sources: dict[str, bytes]) -> dict[str, bytes]:
    """A ``.pyc`` of each source for this python: hash-based and unchecked (PEP 552), so no
    timestamp lands in the bundle.  A node whose python differs (another magic number) skips
    it and compiles the source beside it, as zipimport does."""
    import marshal
    import sys

    done = subprocess.run(
        [sys.executable, "-S", "-s", "-c", _COMPILE],
        input=marshal.dumps(sources),
        capture_output=True,
        env={"PYTHONHASHSEED": "0"},
        cwd="/",
        timeout=120,
        check=True,
    )
    return marshal.loads(done.stdout)


def node_names(cluster: str, node: NodeInfo) -> list[str]:
    """What a node answers to in every ssh file: its hostname, its role (``worker1``) and
    ``<cluster>-<role>``, which is its hostname where the backend names its machines (a
    Slurm node's is the site's); the head also as the cluster."""
    names = [node.hostname, node.name, f"{cluster}-{node.name}"]
    if node.rank == 0:
        names.insert(0, cluster)
    return list(dict.fromkeys(names))


def known_hosts(cluster: str, nodes: list[NodeInfo], keys: ClusterKeys) -> str:
    return known_hosts_lines([([*node_names(cluster, n), n.ip], keys.hosts[n.rank]) for n in nodes])


def client_keys(cluster_dir: Path, nodes: list[NodeInfo]) -> ClusterKeys:
    """The cluster's keys as the client keeps them after a launch (:func:`write_client_files`:
    its key file and its known_hosts), to write the ssh files again where an address changed.

    A node's private host key never stays on the client (the node, or its Secret, holds it),
    so the host keys here are public only: enough for every ``known_hosts``, and the node's
    own key is what it booted with, unchanged."""
    by_name = known_host_keys((cluster_dir / "known_hosts").read_text())
    cluster = load_key((cluster_dir / "id_ed25519").read_bytes())
    return ClusterKeys(cluster=cluster, hosts=tuple(by_name[n.hostname] for n in nodes))


#: Where a node's ``sitecustomize`` lives (``agent.site_hook``): the directory that every
#: session's and every rank's ``PYTHONPATH`` names, so that every Python process on the node
#: can say where its threads are.
SITE_HOOK_FILE = shell.SITE_DIR + "/sitecustomize.py"


def site_hook() -> bytes:
    """The text of every node's ``sitecustomize`` (``agent/site_hook.py``, verbatim)."""
    return (Path(__file__).parent / module_path("agent.site_hook")).read_bytes()


def home_files(keys: ClusterKeys) -> HomeFiles:
    """What a node's home needs before its sshd starts: the cluster key, the agent, and the
    ``sitecustomize`` that arms every Python process's stacks."""
    return {
        ".ssh/authorized_keys": (keys.cluster.public_line.encode() + b"\n", 0o600),
        ".ssh/id_ed25519": (keys.cluster.private_openssh, 0o600),
        ".ssh/id_ed25519.pub": (keys.cluster.public_line.encode() + b"\n", 0o644),
        AGENT_FILE: (agent_bundle(), 0o644),
        SITE_HOOK_FILE: (site_hook(), 0o644),
    }


def peer_files(cluster: str, nodes: list[NodeInfo], keys: ClusterKeys, home: str = "~") -> HomeFiles:
    """Every peer by name and IP, with its host key: written once every address is known.

    Each peer's sshd listens on its route's port (22 but on a shared Slurm node, where each
    has a port of its own), and its key is checked under its hostname whatever the port
    (``[ip]:port`` would need a known_hosts line of its own).  ``home``: where the home
    files lie on every node (``ClusterInfo.home``): OpenSSH reads a ``~`` in its config as
    the account's home, which on a Slurm node is not the rank's."""
    entries = [
        ssh_config.HostEntry(
            alias=" ".join(node_names(cluster, n)),
            hostname=n.ip,
            port=n.route.port,
            user=n.route.user,
            host_key_alias=n.hostname,
        )
        for n in nodes
    ]
    cfg = ssh_config.render(
        entries,
        identity_file=f"{home}/.ssh/id_ed25519",
        known_hosts=f"{home}/.ssh/known_hosts",
        extra_patterns=["*"],
        # A job's token goes along to the sessions it opens on other nodes (mpirun's remote
        # ranks): they are the job's there too (``agent.stacks``, the leftover check).
        send_env=[shell.JOB_SCOPE_VAR],
    )
    return {
        ".ssh/config": (cfg.encode(), 0o600),
        ".ssh/known_hosts": (known_hosts(cluster, nodes, keys).encode(), 0o644),
    }


#: Where multiplexed client connections keep their sockets (``ssh.config.SOCKET_DIR``).
CONTROL_DIR = ssh_config.SOCKET_DIR


def control_path(token: str | None = None) -> str:
    """This launch's ControlPath: ``/tmp/psky-<token>-%C``, 61 bytes (ssh adds 17 while it
    binds).  ``%C`` hashes only local host, remote host, port and user, which two clusters of
    one name share (the head is ``<name>-head`` in every namespace and context, or in a
    second state directory), so they would share one master and one cluster's commands would
    run on the other's nodes.  The random per-launch token keeps them apart, and also makes
    the path unguessable to other users of /tmp."""
    import secrets

    return f"{CONTROL_DIR}/psky-{token or secrets.token_hex(5)}-%C"


def start_master(ssh_config_path: Path, cluster: str, *, wait: bool = True) -> None:
    """Open the shared connection now, so a burst of clients never races to become master.

    ``wait=False``: only start opening it (a handshake costs as much as a small cluster's
    whole bring-up here); clients whose config says ``ControlMaster no`` connect directly
    until it is up.  ControlPersist keeps it in the background, where :func:`stop_master`
    finds it by its socket."""
    argv = ["ssh", "-F", str(ssh_config_path), "-o", "ControlMaster=yes", cluster, "true"]
    if wait:
        subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=120, check=False)
        return
    # Not waited for; kept so that a teardown within its handshake can stop it.
    _STARTERS[str(ssh_config_path)] = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


#: This process's unawaited master openers, by ssh config path (see :func:`start_master`).
_STARTERS: dict[str, subprocess.Popen[bytes]] = {}


def stop_master(ssh_config_path: Path, cluster: str) -> None:
    """Close the cluster's shared client connections before it goes away: the head's and any
    a client opened to a worker (``ssh <cluster>-worker1``), each one socket of this launch's
    ControlPath.  Where no client opened one, there is nothing to ask ssh."""
    import glob
    import re

    starter = _STARTERS.pop(str(ssh_config_path), None)
    if starter is not None and starter.poll() is None:
        # Still in its handshake (no master yet), or a client of the master it forked: SIGTERM
        # lets ssh remove a socket it already bound.
        starter.terminate()
        try:
            starter.wait(timeout=5)
        except subprocess.TimeoutExpired:
            starter.kill()
            starter.wait()
    try:
        match = re.search(r"^\s*ControlPath (\S+)", ssh_config_path.read_text(), re.M)
    except OSError:
        return
    sockets = glob.glob(match.group(1).replace("%C", "*")) if match else []
    exits = [
        subprocess.Popen(
            ["ssh", "-F", str(ssh_config_path), "-S", sock, "-O", "exit", cluster],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for sock in sockets
    ]
    for proc in exits:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for sock in sockets:
        remove_if_stale(sock)


def _nobody_answers(path: str) -> bool:
    """Whether ``path`` is a socket of ours (a ControlPath master's, a forwarder's) that
    nothing listens on any more."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:
        return False
    return False  # a master answers


def remove_if_stale(path: str) -> bool:
    """Remove a ControlPath socket whose master was killed (ssh removes its socket only when
    it exits of its own accord); True when it was stale."""
    if not _nobody_answers(path):
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return True


#: How long after its bind a socket of ours that refuses connections is dead to the reaper's
#: machine-wide sweep: ssh and the forwarder listen microseconds after they bind, so one still
#: refusing this long after is a socket whose process was killed.
DEAD_SOCKET_AGE = 30.0


def remove_dead_sockets(min_age: float = DEAD_SOCKET_AGE) -> None:
    """Remove this user's sockets of ours that nothing answers, bound ``min_age`` seconds ago
    or more: left by a master or forwarder killed with a run whose state directory went too
    (a CI runner's, a test's), which no cluster's record names any more.  Only those old
    enough and this user's are probed, once each."""
    import glob
    import time

    for path in glob.glob(f"{CONTROL_DIR}/psky-*"):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if st.st_uid == os.getuid() and time.time() - st.st_mtime >= min_age:
            remove_if_stale(path)


def stale_control_sockets() -> list[str]:
    """Sockets of ours (``/tmp/psky-*``: ControlPath masters, Kubernetes forwarders) that
    nothing answers on any more."""
    import glob

    return [path for path in sorted(glob.glob(f"{CONTROL_DIR}/psky-*")) if _nobody_answers(path)]


def write_client_files(
    cluster_dir: Path,
    cluster: str,
    nodes: list[NodeInfo],
    keys: ClusterKeys,
    *,
    multiplex: bool = False,
    clients_open_master: bool = True,
) -> Path:
    """The client's key, known_hosts and ``ssh_config``; returns the config's path.

    Each node is dialled by its route; host keys are checked under the node's name
    (``HostKeyAlias``), whatever the route.  With ``multiplex``, clients share one
    connection per host; ``clients_open_master=False`` leaves opening it to
    :func:`start_master` (in the background): clients meanwhile connect directly.
    """
    key = cluster_dir / "id_ed25519"
    write_private(key, keys.cluster.private_openssh)
    kh = cluster_dir / "known_hosts"
    kh.write_text(known_hosts(cluster, nodes, keys))
    entries = []
    for n in nodes:
        alias = cluster if n.rank == 0 else f"{cluster}-{n.name}"  # the contract's name, whatever the hostname
        r = n.route
        entries.append(
            ssh_config.HostEntry(
                alias=alias,
                hostname=r.hostname,
                port=r.port,
                user=r.user,
                proxy_command=r.proxy_command,
                proxy_fdpass=r.proxy_passes_socket,
                proxy_jump=r.proxy_jump,
                host_key_alias=n.hostname,
            )
        )
    cfg = cluster_dir / "ssh_config"
    cfg.write_text(
        ssh_config.render(
            entries,
            identity_file=str(key),
            known_hosts=str(kh),
            control_path=control_path() if multiplex else None,
            control_master="auto" if clients_open_master else "no",
        )
    )
    return cfg
