"""Ways into a running pod: an exec session's process, and a port-forward's connection.

An exec enters the pod's namespaces with ``nsenter`` and drops to the container's own
privileges with ``setpriv``, as a runtime execs into a container; a port-forward dials the
pod's own loopback from a socket made inside its network namespace, as a kubelet does.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import os
import shutil
import socket
import struct
from concurrent.futures import ThreadPoolExecutor

from kube_emulator.pods import DEFAULT_PATH, PodRuntime
from kube_emulator.product import Confinement

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def socket_in_netns(pid: int, family: int) -> socket.socket:
    """A TCP socket created inside the network namespace of ``pid``.

    A socket keeps the namespace it was created in, so the thread may switch back at once;
    connecting it to 127.0.0.1 then reaches the pod's own loopback, which is what a real
    kubelet's port-forward dials.  Runs on a dedicated thread: setns(2) changes only the
    calling thread's namespace.
    """
    host = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    except OSError:
        os.close(host)
        raise
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        finally:
            if _libc.setns(host, CLONE_NEWNET) != 0:  # pragma: no cover - cannot happen for our own ns
                os._exit(70)
        sock.setblocking(False)
        return sock
    finally:
        os.close(target)
        os.close(host)


class PodEntry:
    """Spawns exec sessions in pods and dials their ports."""

    def __init__(self) -> None:
        self.netns_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kubelet-netns")
        self.nsenter = shutil.which("nsenter", path="/usr/bin:/bin:/usr/sbin:/sbin") or "nsenter"
        self.setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin") or "setpriv"
        self.setsid = shutil.which("setsid", path="/usr/bin:/bin:/usr/sbin:/sbin") or "setsid"

    def shutdown(self) -> None:
        self.netns_pool.shutdown(wait=False)

    async def spawn_exec(
        self, rt: PodRuntime, command: list[str], *, stdin: bool, tty: bool
    ) -> tuple[asyncio.subprocess.Process, int | None]:
        """Start ``command`` in the pod's namespaces with the container's environment.

        Returns the process and, with ``tty``, the pty master's fd (stdout and stderr both go
        there, as with a real terminal).  A session of its own, so a client that goes away
        mid-command can have the whole command stopped (the pod's PID namespace would stop it
        too, with the pod).
        """
        argv = self._exec_argv(rt)
        if tty:
            assert rt.node is not None
            return await _spawn_on_pty([*argv, self.setsid, "-c", *command], rt.env, rt.node.init_pid)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            *command,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=rt.env,
            start_new_session=True,
        )
        return proc, None

    def _exec_argv(self, rt: PodRuntime) -> list[str]:
        """Into the pod's namespaces with the container's privileges, in its working directory."""
        assert rt.node is not None
        return [
            self.nsenter,
            f"--target={rt.node.init_pid}",
            "--net",
            "--uts",
            "--mount",
            "--pid",
            "--ipc",
            "--",
            *exec_privileges(self.setpriv, rt.confinement),
            # Not nsenter's --wd: it opens the directory before entering the mount namespace,
            # which leaves the command in the emulator's tree instead of the pod's own root.
            "/bin/sh",
            "-c",
            'cd -- "$0" && exec "$@"',
            rt.workdir,
        ]

    def command_missing(self, rt: PodRuntime, command: list[str]) -> bool:
        """Whether ``command[0]`` cannot be found (the runtime refuses to exec it at all)."""
        exe = command[0]
        if "/" in exe:
            return not exe.startswith("/run/") and (not os.path.exists(exe) or rt.view.hides(exe))
        return rt.view.which(exe, rt.env.get("PATH", DEFAULT_PATH)) is None

    async def connect(self, rt: PodRuntime, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Dial ``localhost:port`` inside the pod, IPv4 then IPv6, as the kubelet's port-forward does."""
        assert rt.node is not None
        loop = asyncio.get_running_loop()
        errors = []
        for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            try:
                sock = await loop.run_in_executor(self.netns_pool, socket_in_netns, rt.node.init_pid, family)
            except OSError as exc:
                errors.append(f"{address}: {exc.strerror or exc}")
                continue
            try:
                await loop.sock_connect(sock, (address, port))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return await asyncio.open_connection(sock=sock)
            except OSError as exc:
                sock.close()
                label = "IPv4: dial tcp4 127.0.0.1" if family == socket.AF_INET else "IPv6 dial tcp6 [::1]"
                errors.append(f"{label}:{port}: connect: {os.strerror(exc.errno or errno.ECONNREFUSED).lower()}")
        raise ConnectionError(
            f"failed to connect to localhost:{port} inside namespace of pod {rt.name}, " + " ".join(errors)
        )


#: ioctls of a pty master: unlock its peer; open its peer (Linux 4.13+, no path lookup).
TIOCSPTLCK, TIOCGPTPEER = 0x40045431, 0x5441


def pod_pty(init_pid: int) -> tuple[int, int]:
    """A pty of the pod's own ``devpts`` (its master and its peer), as a runtime allocates
    the terminal of an exec inside the container: one of this host's would be a terminal
    with no name in the pod (``tty`` says "not a tty", and so do programs that ask)."""
    master = os.open(f"/proc/{init_pid}/root/dev/ptmx", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(master, TIOCSPTLCK, struct.pack("i", 0))
        slave = fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except BaseException:
        os.close(master)
        raise
    return master, slave


async def _spawn_on_pty(argv: list[str], env: dict[str, str], init_pid: int) -> tuple[asyncio.subprocess.Process, int]:
    """``argv`` on a new pty of the pod's (stdin, stdout and stderr all), in a session of its
    own; the process and the pty's master side, non-blocking."""
    master, slave = pod_pty(init_pid)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    os.set_blocking(master, False)
    return proc, master


def exec_privileges(setpriv: str, confinement: Confinement) -> list[str]:
    """``setpriv`` arguments that give an exec session what the container's own processes
    hold (its uid and gid, its bounding set, no inheritable or ambient capabilities,
    no_new_privs), as a runtime execs into a container: an exec may not do what the
    container could not."""
    ids: list[str] = []
    if confinement.user is not None or confinement.group is not None:
        ids = [f"--reuid={confinement.user or 0}", f"--regid={confinement.group or 0}", "--clear-groups"]
    if confinement.privileged:
        return [setpriv, *ids, "--"] if ids else []
    caps = ",".join(["-all", *(f"+{c.lower()}" for c in confinement.capabilities)])
    argv = [setpriv, *ids, "--bounding-set", caps, "--inh-caps", "-all", "--ambient-caps", "-all"]
    return [*argv, "--no-new-privs", "--"] if confinement.no_new_privs else [*argv, "--"]
