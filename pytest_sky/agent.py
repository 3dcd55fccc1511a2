"""The agent: shipped to every node, run with the node's python, standard library only.

Two roles, one file (so one copy per node serves both):

``agent.py run``  (on the head) reads a run spec as the first line of stdin, allocates a job
    id, fans the task out to every rank (setup on every node first, then run), and streams
    JSON events on stdout: ``{"e": "job"}``, ``{"e": "start"}``, ``{"e": "l"}`` (one output
    line), ``{"e": "exit"}`` and finally ``{"e": "done"}``.  When a rank fails, the others are
    stopped.  The rest of stdin is a lifeline: when it closes (the client went away, timed
    out or was interrupted), every rank is stopped.

``agent.py rank``  (on every node, the head included) runs one rank's script under bash in a
    session of its own, prints ``PSKY-PID <pid>`` and then relays the script's merged output.
    It is a child subreaper, so everything the script starts stays its descendant and is
    killed when the script ends, when the rank is stopped, or when its stdin (the head's
    SSH channel) closes.  Its exit status is the script's.

Why our own agent and not Ray: a 2-node ``echo hi`` must cost tens of milliseconds, and the
agent must run on any image that has python3; nothing off the shelf does both.
"""

from __future__ import annotations

# Only what a rank needs is imported at the top: a rank starts once per node per run, and
# every module costs milliseconds there.  The head's run mode imports the rest itself.
import os
import signal
import sys
import time

STOP_GRACE_SECONDS = 2.0
PID_MARK = b"PSKY-PID "


# ---------------------------------------------------------------------------- shared helpers


def line_prefix(rank: int, name: str, pid: int, ip: str, num_nodes: int, task_name: str) -> str:
    """SkyPilot's prefixes, exactly: users grep their logs for them."""
    if num_nodes == 1:
        return f"({task_name}, pid={pid}) "
    if rank == 0:
        return f"(head, rank=0, pid={pid}) "
    return f"({name}, rank={rank}, pid={pid}, ip={ip}) "


def _descendants(root: int) -> list[int]:
    """Every descendant of ``root`` (a subreaper, so orphans stay in its subtree)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rindex(b")") + 2 :].split()
        children.setdefault(int(rest[1]), []).append(int(entry))
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


# ---------------------------------------------------------------------------- rank supervisor


def _become_subreaper() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:  # noqa: BLE001 - best effort: without it, orphans escape the tree walk
        pass


def _read_exact(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("stdin closed before the rank spec arrived")
        data += chunk
    return data


def encode_rank_spec(payload: dict) -> bytes:
    """Head -> rank: marshal (built in, no import cost) behind an 8-byte length."""
    import marshal

    body = marshal.dumps(payload, 4)
    return len(body).to_bytes(8, "big") + body


def rank_main() -> int:
    """One rank: single-threaded and lean on imports, since it starts once per node per run."""
    import marshal
    import select

    size = int.from_bytes(_read_exact(0, 8), "big")
    spec = marshal.loads(_read_exact(0, size))
    _become_subreaper()
    env = dict(os.environ)
    env.update(spec.get("env", {}))
    cwd = os.path.expanduser(spec.get("cwd") or "~")
    if not os.path.isdir(cwd):
        cwd = os.path.expanduser("~")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the rank's script: a session of its own, stdin from /dev/null
        try:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            os.closerange(3, 65536)
            os.chdir(cwd)
            os.execve("/bin/bash", ["bash", "-c", spec["script"]], env)
        finally:
            os._exit(127)
    os.close(write_end)
    os.write(1, PID_MARK + str(pid).encode() + b"\n")
    me = os.getpid()
    stopping = [False]
    kill_at = [0.0]

    def stop_tree(*_: object) -> None:
        if not stopping[0]:
            stopping[0] = True
            kill_at[0] = time.monotonic() + STOP_GRACE_SECONDS
            _signal_all(_descendants(me), signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop_tree)
    signal.signal(signal.SIGHUP, stop_tree)
    child = os.pidfd_open(pid)
    watch = [0, read_end, child]
    code: int | None = None
    while True:
        ready, _, _ = select.select(watch, [], [], 0.2)
        if 0 in ready and not os.read(0, 4096):  # lifeline: the head closed our stdin
            watch.remove(0)
            stop_tree()
        if read_end in ready:
            chunk = os.read(read_end, 65536)
            if chunk:
                try:
                    _write_all(1, chunk)
                except OSError:
                    stop_tree()
            else:
                watch.remove(read_end)
        if child in ready:
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            watch.remove(child)
            # The script is done; anything it left running (a `&` job, a daemon) goes with it.
            _signal_all([p for p in _descendants(me) if _alive(p)], signal.SIGKILL)
            kill_at[0] = time.monotonic() + 5  # bound on draining output of killed leftovers
        if stopping[0] and kill_at[0] and time.monotonic() > kill_at[0]:
            _signal_all(_descendants(me), signal.SIGKILL)
            if code is not None:
                break
            kill_at[0] = time.monotonic() + STOP_GRACE_SECONDS
        if code is not None and read_end not in watch:
            break
        if code is not None and not stopping[0] and time.monotonic() > kill_at[0]:
            break
    return 128 - code if code < 0 else code


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3]
    if state == b"Z":
        try:
            os.waitpid(pid, os.WNOHANG)  # we are the subreaper: reap what we inherited
        except ChildProcessError:
            pass
        return False
    return True


# ---------------------------------------------------------------------------- head: a run


class _Emitter:
    """Writes events to stdout and the job's log file, one writer at a time."""

    def __init__(self, log_path: str | None) -> None:
        import threading

        self._lock = threading.Lock()
        self._out = sys.stdout.buffer
        self._log = open(log_path, "ab") if log_path else None  # noqa: SIM115
        self.client_gone = False

    def event(self, **fields: object) -> None:
        import json

        data = json.dumps(fields, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            if self.client_gone:
                return
            try:
                self._out.write(data)
                self._out.flush()
            except (BrokenPipeError, OSError):
                self.client_gone = True

    def log(self, text: str) -> None:
        if self._log is not None:
            with self._lock:
                self._log.write(text.encode("utf-8", "replace"))
                self._log.flush()


class _Rank:
    def __init__(self, node: dict, spec: dict, phase: str, script: str, env: dict, emitter: _Emitter) -> None:
        import subprocess
        import threading

        self.rank: int = node["rank"]
        self.name: str = node["name"]
        self.ip: str = node["ip"]
        self.spec = spec
        self.phase = phase
        self.emitter = emitter
        self.pid = 0
        self.code: int | None = None
        self.ssh_error = ""
        python = spec["python"]
        agent = spec["agent_path"]
        if self.rank == 0:
            argv = [python, "-I", "-S", os.path.expanduser(agent), "rank"]
        else:
            # The agent's own hops share one connection per worker (a user's ssh does not: a
            # racing master prints "ControlSocket ... already exists" into the task's output).
            # /run is private to the node, so the socket path is short and dies with it.
            argv = [
                "ssh",
                "-T",
                "-F",
                os.path.expanduser("~/.ssh/config"),
                "-o",
                "ControlMaster=auto",
                "-o",
                "ControlPath=/run/psky-cm-%C",
                "-o",
                "ControlPersist=120",
                node["ssh_target"],
                f"{python} -I -S {agent} rank",
            ]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            stderr=subprocess.PIPE if self.rank else None,
            close_fds=True,
        )
        payload = {"script": script, "env": env, "cwd": spec.get("cwd")}
        assert self.proc.stdin is not None
        self.proc.stdin.write(encode_rank_spec(payload))
        self.proc.stdin.flush()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        if self.rank:
            self.err_reader = threading.Thread(target=self._read_err, daemon=True)
            self.err_reader.start()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        data = self.proc.stderr.read()
        self.ssh_error = data.decode("utf-8", "replace").strip()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        pending = b""
        prefix: str | None = None
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            pending += chunk
            if prefix is None:
                if b"\n" not in pending:
                    continue
                first, pending = pending.split(b"\n", 1)
                if not first.startswith(PID_MARK):
                    self.ssh_error += first.decode("utf-8", "replace")
                    continue
                self.pid = int(first[len(PID_MARK) :].strip() or 0)
                prefix = line_prefix(
                    self.rank, self.name, self.pid, self.ip, self.spec["num_nodes"], self.spec["task_name"]
                )
                self.emitter.event(e="start", rank=self.rank, pid=self.pid, phase=self.phase)
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                self._emit(raw, prefix)
        if pending and prefix is not None:
            self._emit(pending, prefix)

    def _emit(self, raw: bytes, prefix: str) -> None:
        text = raw.decode("utf-8", "replace")
        self.emitter.event(e="l", r=self.rank, t=text)
        self.emitter.log(prefix + text + "\n")

    def stop(self) -> None:
        """Close the lifeline: the rank's supervisor stops its whole tree and exits."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        except OSError:
            pass

    def wait(self) -> int:
        code = self.proc.wait()
        self.reader.join()
        if self.rank:
            self.err_reader.join(2)
        self.code = 128 - code if code < 0 else code
        return self.code

    def describe(self) -> str:
        where = "head" if self.rank == 0 else f"{self.name}, {self.ip}"
        return f"rank {self.rank} ({where})"


def _allocate_job(home: str, cluster: str) -> tuple[int, str, str]:
    import fcntl

    jobs = os.path.join(home, ".sky", "jobs")
    os.makedirs(jobs, exist_ok=True)
    with open(os.path.join(jobs, ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        counter = os.path.join(jobs, "last_id")
        try:
            with open(counter) as f:
                last = int(f.read().strip() or 0)
        except (OSError, ValueError):
            last = 0
        job_id = last + 1
        with open(counter + ".tmp", "w") as f:
            f.write(str(job_id))
        os.replace(counter + ".tmp", counter)
    job_dir = os.path.join(jobs, str(job_id))
    os.makedirs(job_dir, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d-%H-%M-%S", time.gmtime()) + f"-{int(time.time() * 1e6) % 1_000_000:06d}"
    return job_id, f"sky-{stamp}_{cluster}_{job_id}", job_dir


def _run_phase(
    phase: str,
    spec: dict,
    env_for,
    emitter: _Emitter,
    cancelled: threading.Event,  # noqa: F821
) -> tuple[list[int], int, str | None]:
    """Run one phase on every rank; the first failure stops the others."""
    import threading

    script = spec[phase]
    ranks = [_Rank(node, spec, phase, script, env_for(node["rank"]), emitter) for node in spec["nodes"]]
    first_failure: list[_Rank] = []
    done = threading.Event()
    lock = threading.Lock()
    remaining = [len(ranks)]

    def watch(r: _Rank) -> None:
        code = r.wait()
        emitter.event(e="exit", rank=r.rank, code=code, phase=phase)
        with lock:
            if code != 0 and not first_failure and not cancelled.is_set():
                first_failure.append(r)
                for other in ranks:
                    if other is not r:
                        other.stop()
            remaining[0] -= 1
            if remaining[0] == 0:
                done.set()

    for r in ranks:
        threading.Thread(target=watch, args=(r,), daemon=True).start()
    while not done.wait(0.2):
        if cancelled.is_set():
            for r in ranks:
                r.stop()
            break
    done.wait(STOP_GRACE_SECONDS + 10)
    for r in ranks:
        if r.proc.poll() is None:
            r.proc.kill()
    codes = [r.code if r.code is not None else 137 for r in ranks]
    if cancelled.is_set() and not first_failure:
        return codes, 130, "the run was interrupted: every rank was stopped"
    if first_failure:
        r = first_failure[0]
        code = r.code if r.code is not None else 1
        if r.rank and r.code == 255 and not r.pid:
            reason = r.ssh_error.splitlines()[-1] if r.ssh_error else "no output from ssh"
            return codes, code, f"{phase} failed: {r.describe()} could not be reached from the head over SSH: {reason}"
        return codes, code, f"{phase} failed on {r.describe()} with exit code {r.code}"
    return codes, 0, None


def run_main() -> int:
    import json
    import threading

    spec = json.loads(sys.stdin.buffer.readline())
    home = os.path.expanduser("~")
    job_id, task_id, job_dir = _allocate_job(home, spec["cluster"])
    emitter = _Emitter(os.path.join(job_dir, "run.log"))
    emitter.event(e="job", id=job_id, task_id=task_id)
    cancelled = threading.Event()

    def lifeline() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except OSError:
            pass
        emitter.client_gone = True
        cancelled.set()

    threading.Thread(target=lifeline, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: cancelled.set())
    signal.signal(signal.SIGHUP, lambda *_: cancelled.set())

    ips = "\n".join(n["ip"] for n in spec["nodes"])
    num_nodes = str(len(spec["nodes"]))
    gpus = str(spec.get("gpus_per_node", 0))
    base = dict(spec.get("env", {}))
    base["SKYPILOT_TASK_ID"] = task_id
    base["SKYPILOT_CLUSTER_INFO"] = json.dumps(spec["cluster_info"])
    base["SKYPILOT_NUM_NODES"] = num_nodes

    def setup_env(rank: int) -> dict:
        env = dict(base)
        env.update(
            SKYPILOT_SETUP_NODE_IPS=ips, SKYPILOT_SETUP_NODE_RANK=str(rank), SKYPILOT_SETUP_NUM_GPUS_PER_NODE=gpus
        )
        env.update(spec.get("rank_env", {}).get(str(rank), {}))
        return env

    def run_env(rank: int) -> dict:
        env = dict(base)
        env.update(SKYPILOT_NODE_IPS=ips, SKYPILOT_NODE_RANK=str(rank), SKYPILOT_NUM_GPUS_PER_NODE=gpus)
        env.update(spec.get("rank_env", {}).get(str(rank), {}))
        return env

    returncode, error, codes = 0, None, [0] * len(spec["nodes"])
    for phase, env_for in (("setup", setup_env), ("run", run_env)):
        if not spec.get(phase):
            continue
        emitter.event(e="phase", phase=phase)
        codes, returncode, error = _run_phase(phase, spec, env_for, emitter, cancelled)
        if error:
            break
    status = "SUCCEEDED" if returncode == 0 else ("CANCELLED" if cancelled.is_set() else "FAILED")
    with open(os.path.join(job_dir, "status"), "w") as f:
        f.write(status)
    emitter.event(e="done", returncode=returncode, error=error, codes=codes, status=status)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in ("run", "rank"):
        sys.stderr.write("usage: agent.py run|rank (spec as JSON on the first line of stdin)\n")
        return 2
    if argv[1] == "rank":
        return rank_main()
    return run_main()


if __name__ == "__main__":
    code = main(sys.argv)
    try:
        sys.stdout.flush()
    except OSError:
        pass
    # Daemon threads still block on stdin (the lifeline); a normal interpreter exit would
    # abort on the stdin buffer lock.  Everything we own is flushed and reaped by now.
    os._exit(code)
