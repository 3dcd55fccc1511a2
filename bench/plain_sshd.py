"""Baseline for bring-up and teardown: N plain sshd processes on 127.0.0.1, nothing else.

This is the irreducible part of a local cluster (N sshd start-ups until each sends its
banner, then N kills), so ``launch`` / this is the overhead of namespaces, links, keys and
bookkeeping.

Why a helper process: OpenSSH 9.2's sshd refuses to start without its privilege-separation
directory ``/run/sshd``, which this host does not have (nodes get it on their private
``/run``).  Rather than create it on the shared host, the helper runs in its own mount
namespace with a private tmpfs on ``/run`` and times each trial itself: the namespace is
made once, outside every timed region, and the sshds it starts are plain fork+exec children,
exactly as cheap as they would be on a host that had ``/run/sshd``.

Protocol: JSON lines on stdin/stdout.  ``{"configs": [...], "ports": [...], "logs": [...]}``
runs one trial and answers ``{"up": s, "down": s}`` or ``{"error": "..."}``.  EOF ends it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pytest_sky.ssh.sshd import daemon_args

SSHD = shutil.which("sshd", path="/usr/sbin:/usr/local/sbin:/sbin:" + os.environ.get("PATH", "")) or "/usr/sbin/sshd"
TRIAL_TIMEOUT = 20.0
PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class Trial:
    """Seconds from the first fork to the last banner, and from the first kill to the last reap."""

    up: float
    down: float


def sshd_config(port: int, host_key: Path, pid_file: Path) -> str:
    """The minimal config the brief asks for: nothing that would make sshd do extra work."""
    return f"ListenAddress 127.0.0.1:{port}\nHostKey {host_key}\nPidFile {pid_file}\nUsePAM no\n"


def free_ports(n: int) -> list[int]:
    """Distinct free high ports, all held at once while choosing so none repeats."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class PlainSshdPool:
    """Client side: prepares keys and configs ahead of timing and asks the helper for trials."""

    def __init__(self, workdir: Path, max_nodes: int) -> None:
        self.workdir = workdir
        self.max_nodes = max_nodes
        self.configs: list[Path] = []
        self.logs: list[Path] = []
        self.ports: list[int] = []
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> PlainSshdPool:
        try:
            self._prepare()
            self._start_helper()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.ports = free_ports(self.max_nodes)
        for i, port in enumerate(self.ports):
            key = self.workdir / f"host_key_{i}"
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                check=True,
                stdin=subprocess.DEVNULL,
            )
            cfg = self.workdir / f"sshd_config_{i}"
            cfg.write_text(sshd_config(port, key, self.workdir / f"sshd_{i}.pid"))
            self.configs.append(cfg)
            self.logs.append(self.workdir / f"sshd_{i}.log")

    def _start_helper(self) -> None:
        repo = Path(__file__).resolve().parent.parent
        self._proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", sys.executable, "-m", "bench.plain_sshd"],
            cwd=repo,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = self._proc.stdout.readline() if self._proc.stdout else ""
        if not hello:
            code = self._proc.wait(timeout=10)
            raise RuntimeError(f"plain-sshd helper did not start (exit {code}); is `unshare` available, are we root?")
        msg = json.loads(hello)
        if "error" in msg:
            raise RuntimeError(f"plain-sshd helper: {msg['error']}")

    def trial(self, n: int) -> Trial:
        if n > self.max_nodes:
            raise ValueError(f"asked for {n} sshds, prepared {self.max_nodes}")
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        req = {
            "args": list(daemon_args(SSHD)),  # as a node runs it: the same work
            "configs": [str(c) for c in self.configs[:n]],
            "ports": self.ports[:n],
            "logs": [str(p) for p in self.logs[:n]],
        }
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("plain-sshd helper exited during a trial")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"plain sshd baseline failed: {msg['error']}")
        return Trial(up=msg["up"], down=msg["down"])

    def close(self) -> None:
        """EOF tells the helper to stop; it kills its own sshds in its ``finally``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        finally:
            if proc.stdout is not None:
                proc.stdout.close()


# ------------------------------------------------------------------------------------- helper


def _wait_banners(procs: list[subprocess.Popen[bytes]], ports: list[int], logs: list[str], deadline: float) -> None:
    """Connect to every port until each answers ``SSH-``: a non-blocking sweep with a 1 ms
    tick, one thread, so polling steals as little CPU as possible from the starting sshds."""
    pending = dict(enumerate(ports))
    sel = selectors.DefaultSelector()
    try:
        while pending or sel.get_map():
            for i, port in list(pending.items()):
                if procs[i].poll() is not None:
                    raise RuntimeError(f"sshd on port {port} exited {procs[i].returncode}: {_tail(logs[i])}")
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setblocking(False)
                rc = s.connect_ex(("127.0.0.1", port))
                if rc in (0, errno.EINPROGRESS):
                    sel.register(s, selectors.EVENT_READ, i)
                    del pending[i]
                else:
                    s.close()
            for key, _ in sel.select(timeout=0.001):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    data = s.recv(64)
                except OSError:
                    data = b""
                sel.unregister(s)
                s.close()
                if not data.startswith(b"SSH-"):
                    pending[key.data] = ports[key.data]  # refused or reset: not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"no banner within {TRIAL_TIMEOUT:.0f} s from ports {sorted(pending.values())}")
            if pending and not sel.get_map():
                time.sleep(0.001)
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        sel.close()


def _tail(path: str) -> str:
    try:
        return " | ".join(Path(path).read_text(errors="replace").strip().splitlines()[-3:]) or "no output"
    except OSError:
        return "no log"


def _run_trial(req: dict) -> dict:
    procs: list[subprocess.Popen[bytes]] = []
    files = []
    try:
        for log in req["logs"]:
            files.append(open(log, "wb"))  # noqa: SIM115 - closed in finally, after the sshds are gone
        t0 = time.perf_counter()
        for cfg, out in zip(req["configs"], files, strict=True):
            procs.append(
                subprocess.Popen(
                    [SSHD, *req["args"], "-f", cfg], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=out
                )
            )
        _wait_banners(procs, req["ports"], req["logs"], time.monotonic() + TRIAL_TIMEOUT)
        t1 = time.perf_counter()
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        t2 = time.perf_counter()
        return {"up": t1 - t0, "down": t2 - t1}
    except Exception as exc:  # noqa: BLE001 - reported to the client, which raises it
        return {"error": str(exc)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
        _reap_orphans()


def _children() -> list[int]:
    me = str(os.getpid())
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2 :].split()[1] == me:
            pids.append(int(entry))
    return pids


def _reap_orphans(grace: float = 1.0) -> None:
    """Outside the timed region: the per-connection sshds our banner probes forked outlive
    their killed listener for a moment; as subreaper we collect them (SIGKILL after ``grace``)
    so none is left to this machine's slow-reaping pid 1."""
    deadline = time.monotonic() + grace
    while True:
        kids = _children()
        if not kids:
            return
        late = time.monotonic() > deadline
        for pid in kids:
            try:
                if late:
                    os.kill(pid, 9)
                os.waitpid(pid, os.WNOHANG)
            except (ChildProcessError, ProcessLookupError):
                pass
        time.sleep(0.005)


def _serve() -> int:
    """Runs inside ``unshare --mount``: give sshd its /run/sshd on a private /run, then serve."""
    # Orphaned per-connection sshds come back to us, not to pid 1 (see _reap_orphans).
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/run"], check=True, capture_output=True)
        os.mkdir("/run/sshd", 0o755)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        print(json.dumps({"error": f"cannot prepare a private /run/sshd: {exc} {detail.decode().strip()}"}), flush=True)
        return 1
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(_run_trial(json.loads(line))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_serve())
