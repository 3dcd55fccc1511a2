"""The agent: shipped to every node, run on the head with the node's python, stdlib only.

``agent.py run`` reads a run spec from stdin (``encode_spec``), allocates a job id, fans the
task out to every rank (setup on every node first, then run) and streams JSON events on
stdout: ``job``, ``start``, ``l`` (one output line), ``exit`` and finally ``done``.  When a
rank fails, the others are stopped.  The rest of stdin is a lifeline: when it closes (the
client went away, timed out or was interrupted), every rank is stopped.
``agent.py submit`` does the same in a daemon on the head (a detached job) and returns at
once; ``jobs``, ``wait``, ``logs``, ``events`` and ``cancel`` read and steer jobs.

Each rank runs under ``RANK_SUPERVISOR`` (bash), locally for the head and over head-to-worker
SSH for workers.  Every job keeps its status, prefixed log and events in ``~/.sky/jobs/<id>``.

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


# ---------------------------------------------------------------------------- rank supervisor

# One rank on one node, in bash: a Python supervisor cost ~30 ms of interpreter start per
# node per run, this costs ~3.  The script runs in a session of its own and prints its pid
# before anything else; the supervisor waits and exits with the script's status.
#
# The job owns every process it starts, on every node, whatever sessions they make and
# whoever their parent is.  The kernel keeps that account: the script enters a cgroup of its
# own (a child of the node's, where cgroup2 is mounted writable, as on local nodes) before it
# runs.  Where cgroups are read-only (a Kubernetes pod), every process is told apart by a
# token in its environment, inherited across setsid, daemonising and reparenting alike.
#
# Its stdin is the lifeline: when the head closes it (the run failed elsewhere, timed out, was
# cancelled, or the client went away) every process of the job gets SIGTERM, a grace to stop
# its own children (torchrun stops its workers), then SIGKILL: cgroup.kill, one write.  The
# lifeline's reader does that itself, so it happens however early the head lets go (even
# before the supervisor waits); it tells the supervisor first (USR1), which then leaves the
# stopping to it.  Whatever the script leaves running when it ends is killed at once.
RANK_SUPERVISOR = r"""
exec 3<&0
stop=
trap stop=1 USR1
cg= r=
while read -r _ m t _; do [ "$t" = cgroup2 ] && r=$m; done </proc/self/mounts
[ -n "$r" ] && mkdir "$r/psky-job-$$" 2>/dev/null && cg=$r/psky-job-$$
tag=psky-$$-$RANDOM$RANDOM
members() {  # the job's live processes, the script's own first (even before it has exec'd)
  m=
  if [ -d "$cg" ]; then IFS= read -r -d '' m <"$cg/cgroup.procs"
  else
    for d in /proc/[0-9]*; do
      while IFS= read -r -d '' kv; do
        [ "$kv" = "PSKY_JOB_SCOPE=$tag" ] && { m="$m ${d#/proc/}"; break; }
      done 2>/dev/null <"$d/environ"
    done
  fi
  case " $m " in *" $pid "*) ;; *) ! kill -0 "$pid" 2>/dev/null || m="$pid $m" ;; esac
}
signal() {  # each process once (a second SIGTERM would cut its handler short)
  [ "$1" = KILL ] && [ -d "$cg" ] && echo 1 >"$cg/cgroup.kill" && return
  members; [ -z "$m" ] || kill -"$1" $m
  [ "$1" != KILL ] || kill -KILL -- -"$pid"
}
settle() { i=0; while members; [ -n "$m" ] && [ $i -lt "$1" ]; do sleep 0.05; i=$((i+1)); done; }
PSKY_JOB_SCOPE=$tag setsid /bin/bash -c '[ -z "$2" ] || { echo $$ >"$2/cgroup.procs" || rmdir "$2"; } 2>/dev/null
echo "PSKY-PID $$"; exec /bin/bash -c "$1"' psky-run "$1" "$cg" </dev/null 2>&1 &
pid=$!
[ -z "$cg" ] || echo "$pid" 2>/dev/null >"$cg/cgroup.procs"  # in before the lifeline can act
{ while read -r _; do :; done; kill -USR1 $$; signal TERM; settle 50; signal KILL; settle 100; } <&3 >/dev/null 2>&1 &
life=$!
exec 3<&-
{
wait "$pid"; code=$?
if [ -n "$stop" ]; then
  wait "$life"
  [ "$code" -le 128 ] || { wait "$pid"; code=$?; }
else
  signal KILL; settle 100; kill "$life"
fi
[ -z "$cg" ] || rmdir "$cg"
} >/dev/null 2>&1
exit "$code"
"""


def _sh_quote(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"


def rank_script(script: str, env: dict, cwd: str | None) -> str:
    """The rank's whole program: its environment, its directory, then the task's script."""
    lines = [f"export {key}={_sh_quote(str(value))}" for key, value in env.items()]
    if cwd:
        target = "~/" + _sh_quote(cwd[2:]) if cwd.startswith("~/") else _sh_quote(cwd)
        lines.append(f'cd {target} 2>/dev/null || cd "$HOME"')
    else:
        lines.append('cd "$HOME"')
    lines.append(script)
    return "\n".join(lines) + "\n"


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


_JSON_ESCAPES = {i: f"\\u{i:04x}" for i in range(32)}
_JSON_ESCAPES.update({ord('"'): '\\"', ord("\\"): "\\\\", ord("\n"): "\\n", ord("\t"): "\\t"})


def to_json(value: object, sep: str = ",", colon: str = ":") -> str:
    """JSON for the agent's own records (str, int, float, bool, None, lists, dicts).

    Not the json module: importing it (and ``re`` with it) costs ~18 ms, on every run.
    """
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return '"' + value.translate(_JSON_ESCAPES) + '"'
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + sep.join(to_json(str(k)) + colon + to_json(v, sep, colon) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + sep.join(to_json(v, sep, colon) for v in value) + "]"
    return to_json(str(value))


def encode_spec(spec: dict) -> bytes:
    """Client -> agent: marshal (built in; no import at all) behind an 8-byte length."""
    import marshal

    body = marshal.dumps(spec, 4)
    return len(body).to_bytes(8, "big") + body


def _read_spec() -> dict:
    import marshal

    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = os.read(0, n - len(data))
            if not chunk:
                raise EOFError("stdin closed before the run spec arrived")
            data += chunk
        return data

    return marshal.loads(exactly(int.from_bytes(exactly(8), "big")))


class _Child:
    """A spawned process with pipes, without the subprocess module (~25 ms to import)."""

    def __init__(self, argv: list[str], *, capture_stderr: bool) -> None:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe() if capture_stderr else (-1, -1)
        actions = [(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1)]
        if capture_stderr:
            actions.append((os.POSIX_SPAWN_DUP2, err_w, 2))
        # Pipes are close-on-exec (PEP 446): the child keeps only what dup2 put on 0, 1, 2.
        self.pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=actions)
        for fd in (in_r, out_w, err_w):
            if fd >= 0:
                os.close(fd)
        self.stdin: int | None = in_w
        self.stdout = out_r
        self.stderr = err_r
        self.returncode: int | None = None

    def close_stdin(self) -> None:
        if self.stdin is not None:
            try:
                os.close(self.stdin)
            except OSError:
                pass
            self.stdin = None

    def write_stdin(self, data: bytes) -> None:
        assert self.stdin is not None
        while data:
            data = data[os.write(self.stdin, data) :]

    def wait(self) -> int:
        while self.returncode is None:
            try:
                _, status = os.waitpid(self.pid, 0)
            except ChildProcessError:  # reaped by a concurrent poll(), which set returncode
                if self.returncode is None:
                    self.returncode = 255
                break
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass


class _Emitter:
    """Writes events to the client (attached runs) and to the job's files, one writer at a time."""

    def __init__(self, job_dir: str, *, to_stdout: bool) -> None:
        import threading

        self._lock = threading.Lock()
        self._out = sys.stdout.buffer if to_stdout else None
        self._log = open(os.path.join(job_dir, "run.log"), "ab")  # noqa: SIM115 - lives as long as the job
        self._events = open(os.path.join(job_dir, "events.jsonl"), "ab")  # noqa: SIM115
        self.client_gone = not to_stdout

    def event(self, **fields: object) -> None:
        data = to_json(fields).encode() + b"\n"
        with self._lock:
            self._events.write(data)
            self._events.flush()
            if self.client_gone or self._out is None:
                return
            try:
                self._out.write(data)
                self._out.flush()
            except (BrokenPipeError, OSError):
                self.client_gone = True

    def log(self, text: str) -> None:
        with self._lock:
            self._log.write(text.encode("utf-8", "replace"))
            self._log.flush()


class _Rank:
    def __init__(self, node: dict, spec: dict, phase: str, script: str, env: dict, emitter: _Emitter) -> None:
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
        program = rank_script(script, env, spec.get("cwd"))
        if self.rank == 0:
            argv = ["/bin/bash", "-c", RANK_SUPERVISOR, "psky-rank", program]
        else:
            # The agent's own hops share one connection per worker (a user's ssh does not: a
            # racing master prints "ControlSocket ... already exists" into the task's output).
            # /run is private to the node, so the socket path is short and dies with it.
            remote = f"exec /bin/bash -c {_sh_quote(RANK_SUPERVISOR)} psky-rank {_sh_quote(program)}"
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
                # A worker that vanishes (its node killed, its link gone) fails the run in ~3 s,
                # also when it vanishes while the connection is still being made.
                "-o",
                "ConnectTimeout=4",
                "-o",
                "ServerAliveInterval=1",
                "-o",
                "ServerAliveCountMax=3",
                node["ssh_target"],
                remote,
            ]
        self.proc = _Child(argv, capture_stderr=bool(self.rank))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        if self.rank:
            self.err_reader = threading.Thread(target=self._read_err, daemon=True)
            self.err_reader.start()

    def _read_err(self) -> None:
        data = b""
        while True:
            try:
                chunk = os.read(self.proc.stderr, 65536)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
        os.close(self.proc.stderr)
        self.ssh_error = data.decode("utf-8", "replace").strip()

    def _read(self) -> None:
        fd = self.proc.stdout
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
        os.close(fd)

    def _emit(self, raw: bytes, prefix: str) -> None:
        text = raw.decode("utf-8", "replace")
        self.emitter.event(e="l", r=self.rank, t=text)
        self.emitter.log(prefix + text + "\n")

    def stop(self) -> None:
        """Close the lifeline: the rank's supervisor stops its whole tree and exits."""
        self.proc.close_stdin()

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
        emitter.event(e="exit", rank=r.rank, code=code, phase=phase, t=round(time.time(), 3))
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
        reason = r.ssh_error.strip().splitlines()[-1] if r.ssh_error.strip() else "no output from ssh"
        if r.rank and r.code == 255 and not r.pid:
            return codes, code, f"{phase} failed: {r.describe()} could not be reached from the head over SSH: {reason}"
        if r.rank and r.code == 255:
            return codes, code, f"{phase} failed: lost the SSH connection to {r.describe()} ({reason})"
        return codes, code, f"{phase} failed on {r.describe()} with exit code {r.code}"
    return codes, 0, None


TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def _jobs_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".sky", "jobs")


_STATUS: dict[str, dict] = {}  # records this process wrote: no need to read them back


def _write_status(job_dir: str, **fields: object) -> dict:
    path = os.path.join(job_dir, "status.json")
    record = _STATUS.get(job_dir)
    if record is None:
        record = _read_status(job_dir) or {}
    record.update(fields)
    _STATUS[job_dir] = record
    with open(path + ".tmp", "w") as f:
        f.write(to_json(record))
    os.replace(path + ".tmp", path)
    return record


def _read_status(job_dir: str) -> dict | None:
    import json

    try:
        with open(os.path.join(job_dir, "status.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _execute(spec: dict, job_id: int, task_id: str, job_dir: str, emitter: _Emitter, cancelled) -> dict:
    """Run setup then run on every rank; record and return the job's final status."""
    _write_status(job_dir, status="RUNNING", pid=os.getpid(), started=time.time())
    ips = "\n".join(n["ip"] for n in spec["nodes"])
    gpus = str(spec.get("gpus_per_node", 0))
    base = dict(spec.get("env", {}))
    base["SKYPILOT_TASK_ID"] = task_id
    base["SKYPILOT_CLUSTER_INFO"] = to_json(spec["cluster_info"], ", ", ": ")
    base["SKYPILOT_NUM_NODES"] = str(len(spec["nodes"]))
    rank_env = spec.get("rank_env", {})

    def _add_rank_env(env: dict, rank: int) -> None:
        # The backend's per-node values (CUDA_VISIBLE_DEVICES) yield to the task's own envs.
        for key, value in rank_env.get(str(rank), {}).items():
            if key not in base:
                env[key] = value

    def setup_env(rank: int) -> dict:
        env = dict(base)
        env.update(
            SKYPILOT_SETUP_NODE_IPS=ips, SKYPILOT_SETUP_NODE_RANK=str(rank), SKYPILOT_SETUP_NUM_GPUS_PER_NODE=gpus
        )
        _add_rank_env(env, rank)
        return env

    def run_env(rank: int) -> dict:
        env = dict(base)
        env.update(SKYPILOT_NODE_IPS=ips, SKYPILOT_NODE_RANK=str(rank), SKYPILOT_NUM_GPUS_PER_NODE=gpus)
        _add_rank_env(env, rank)
        return env

    returncode, error, codes = 0, None, [0] * len(spec["nodes"])
    for phase, env_for in (("setup", setup_env), ("run", run_env)):
        if not spec.get(phase) or cancelled.is_set():
            continue
        emitter.event(e="phase", phase=phase)
        codes, returncode, error = _run_phase(phase, spec, env_for, emitter, cancelled)
        if error:
            break
    if cancelled.is_set() and returncode == 0 and not error:
        returncode, error = 130, "the job was cancelled before it ran"
    status = "SUCCEEDED" if returncode == 0 else ("CANCELLED" if cancelled.is_set() else "FAILED")
    emitter.event(e="done", returncode=returncode, error=error, codes=codes, status=status)
    return _write_status(job_dir, status=status, returncode=returncode, error=error, ended=time.time())


def _new_job(spec: dict, detached: bool) -> tuple[int, str, str]:
    job_id, task_id, job_dir = _allocate_job(os.path.expanduser("~"), spec["cluster"])
    with open(os.path.join(job_dir, "spec.json"), "w") as f:
        f.write(to_json(spec))
    _write_status(
        job_dir,
        id=job_id,
        task_id=task_id,
        status="PENDING",
        submitted=time.time(),
        detached=detached,
        name=spec.get("task_name"),
        num_nodes=len(spec["nodes"]),
    )
    return job_id, task_id, job_dir


def run_main() -> int:
    """An attached run: events to stdout (and the job's files); stdin is the lifeline."""
    import threading

    spec = _read_spec()
    job_id, task_id, job_dir = _new_job(spec, detached=False)
    emitter = _Emitter(job_dir, to_stdout=True)
    emitter.event(e="job", id=job_id, task_id=task_id)
    cancelled = threading.Event()

    def lifeline() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        emitter.client_gone = True
        cancelled.set()

    threading.Thread(target=lifeline, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: cancelled.set())
    signal.signal(signal.SIGHUP, lambda *_: cancelled.set())
    _execute(spec, job_id, task_id, job_dir, emitter, cancelled)
    return 0


def submit_main() -> int:
    """A detached job: a daemon on the head runs it; we print its id and return at once."""
    spec = _read_spec()
    job_id, task_id, job_dir = _new_job(spec, detached=True)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        try:
            devnull = os.open(os.devnull, os.O_RDWR)
            log = os.open(os.path.join(job_dir, "agent.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(devnull, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            import threading

            cancelled = threading.Event()
            signal.signal(signal.SIGTERM, lambda *_: cancelled.set())
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            _execute(spec, job_id, task_id, job_dir, _Emitter(job_dir, to_stdout=False), cancelled)
            code = 0
        except BaseException as exc:  # noqa: BLE001 - a daemon has nobody to raise to
            _write_status(job_dir, status="FAILED", error=f"agent error: {exc!r}", ended=time.time())
            code = 1
        os._exit(code)
    os.waitpid(pid, 0)
    sys.stdout.write(to_json({"e": "job", "id": job_id, "task_id": task_id}) + "\n")
    return 0


def _job_dirs(which: str) -> list[str]:
    root = _jobs_dir()
    if which == "all":
        try:
            ids = sorted(int(d) for d in os.listdir(root) if d.isdigit())
        except OSError:
            ids = []
        return [os.path.join(root, str(i)) for i in ids]
    return [os.path.join(root, str(int(which)))]


def jobs_main(argv: list[str]) -> int:
    """``jobs all|ID``: the job records as one JSON list (the queue)."""
    import json

    out = []
    for d in _job_dirs(argv[0] if argv else "all"):
        record = _read_status(d)
        if record is None:
            continue
        orphaned = record.get("status") == "RUNNING" or time.time() - record.get("submitted", 0) > 30
        if record.get("status") in ("PENDING", "RUNNING") and orphaned and not _pid_alive(record.get("pid")):
            record = _write_status(d, status="FAILED", error="the job's agent died", ended=time.time())
        out.append(record)
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


def _pid_alive(pid: object) -> bool:
    return isinstance(pid, int) and pid > 0 and _alive(pid)


def wait_main(argv: list[str]) -> int:
    """``wait ID SECONDS``: block until the job ends (exit 0) or the bound passes (exit 3)."""
    import json

    job_dir = _job_dirs(argv[0])[0]
    deadline = time.monotonic() + float(argv[1])
    while True:
        record = _read_status(job_dir)
        if record is None:
            sys.stderr.write(f"no job {argv[0]}\n")
            return 2
        if record.get("status") in TERMINAL:
            sys.stdout.write(json.dumps(record) + "\n")
            return 0
        if record.get("status") == "RUNNING" and not _pid_alive(record.get("pid")):
            record = _write_status(job_dir, status="FAILED", error="the job's agent died", ended=time.time())
            continue
        if time.monotonic() >= deadline:
            sys.stdout.write(json.dumps(record) + "\n")
            return 3
        time.sleep(0.05)


def logs_main(argv: list[str]) -> int:
    """``logs ID [follow]``: the prefixed log so far, or followed until the job ends."""
    job_dir = _job_dirs(argv[0])[0]
    follow = len(argv) > 1 and argv[1] == "follow"
    path = os.path.join(job_dir, "run.log")
    out = sys.stdout.buffer
    offset = 0
    while True:
        record = _read_status(job_dir) or {}
        ended = record.get("status") in TERMINAL
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except OSError:
            chunk = b""
        if chunk:
            offset += len(chunk)
            out.write(chunk)
            out.flush()
        if not follow or (ended and not chunk):
            return 0
        if not chunk:
            time.sleep(0.05)


def events_main(argv: list[str]) -> int:
    """``events ID``: the job's spec, then its events as recorded (to rebuild its RunResult)."""
    import json

    job_dir = _job_dirs(argv[0])[0]
    try:
        with open(os.path.join(job_dir, "spec.json")) as f:
            spec = json.load(f)
        with open(os.path.join(job_dir, "events.jsonl"), "rb") as f:
            events = f.read()
    except (OSError, ValueError):
        return 2
    sys.stdout.buffer.write(json.dumps({"e": "spec", "spec": spec}).encode() + b"\n" + events)
    return 0


def cancel_main(argv: list[str]) -> int:
    """``cancel ID|all``: SIGTERM each live job's agent (which stops every rank), then wait."""
    import json

    targets = []
    for d in _job_dirs(argv[0] if argv else "all"):
        record = _read_status(d)
        if record and record.get("status") not in TERMINAL:
            pid = record.get("pid")
            if _pid_alive(pid):
                os.kill(pid, signal.SIGTERM)
                targets.append(d)
            elif record.get("status") == "PENDING":
                _write_status(d, status="CANCELLED", error="cancelled before it started", ended=time.time())
    deadline = time.monotonic() + STOP_GRACE_SECONDS + 10
    while targets and time.monotonic() < deadline:
        targets = [d for d in targets if (_read_status(d) or {}).get("status") not in TERMINAL]
        time.sleep(0.05)
    sys.stdout.write(json.dumps([_read_status(d) for d in _job_dirs(argv[0] if argv else "all")]) + "\n")
    return 0


COMMANDS = {
    "jobs": jobs_main,
    "wait": wait_main,
    "logs": logs_main,
    "events": events_main,
    "cancel": cancel_main,
}


def main(argv: list[str]) -> int:
    mode = argv[1] if len(argv) > 1 else ""
    if mode == "run":
        return run_main()
    if mode == "submit":
        return submit_main()
    if mode in COMMANDS:
        return COMMANDS[mode](argv[2:])
    sys.stderr.write("usage: agent.py run|submit|jobs|wait|logs|events|cancel ...\n")
    return 2


if __name__ == "__main__":
    code = main(sys.argv)
    try:
        sys.stdout.flush()
    except OSError:
        pass
    # Daemon threads still block on stdin (the lifeline); a normal interpreter exit would
    # abort on the stdin buffer lock.  Everything we own is flushed and reaped by now.
    os._exit(code)
