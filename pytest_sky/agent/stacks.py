"""Where a job's processes are, read on every node while they still run (``agent stacks``).

The client asks when a run reaches its deadline, is interrupted, or a test's own timeout
fires (``diagnosis``), before anything is stopped.  The head's agent answers for every node
of the job at once: its own by looking, each worker's by ``stacks-node`` over
head-to-worker ssh (which any node has from its launch on; an agent server need not run).

On a node, the job's processes are those that carry one of its tokens (``PSKY_JOB_SCOPE``,
which a rank's processes inherit, and which ssh carries to the sessions they open on other
nodes: mpirun's remote ranks), the descendants of the rank's process group leader, and the
members of its cgroup.  For each: pid, parent, state, command line (long or multi-line
arguments, a rank's program among them, elided: they hold the task's environment), what it
waits in (``/proc/<pid>/wchan``, for the process and each thread), and, for a Python
process armed by the node's ``sitecustomize`` (``agent.site_hook``), the stack of every
thread: the agent sends the dumping signal and reads the dump from the process's memfd.
Nothing needs ptrace, which a pod does not grant; nothing is stopped or changed.

Off the run path: it may import what it likes of the standard library.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from pytest_sky import procs, shell
from pytest_sky.agent.site_hook import NAME as MEMFD_NAME
from pytest_sky.masking import mask, masked_values
from pytest_sky.protocol import SECRET_SHOWN

#: How long one process gets to write its dump once signalled (a process stopped, or in an
#: uninterruptible wait, gets none).
DUMP_SECONDS = 2.0
#: How long a worker's answer may take (its ssh connection included).
NODE_SECONDS = 15.0
#: An argument longer than this, or with a line break, is shown as its length only.
ARG_CHARS = 200
#: Source lines looked up per node, at most.
SOURCE_LINES = 400


# ------------------------------------------------------------------------------ one node


def _read(path: str, limit: int = 1 << 16) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def _wchan(path: str) -> str:
    raw = _read(path + "/wchan")
    text = raw.decode("ascii", "replace").strip() if raw else ""
    return "" if text in ("", "0") else text


def _table() -> dict[int, int]:
    """Every process of this node and its parent."""
    out = {}
    for pid in procs.pids():
        parent = procs.parent_pid(pid)
        if parent is not None:
            out[pid] = parent
    return out


def _token(pid: int) -> str | None:
    raw = _read(f"/proc/{pid}/environ", 1 << 20)
    prefix = shell.JOB_SCOPE_VAR.encode() + b"="
    for entry in (raw or b"").split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode("utf-8", "replace")
    return None


def _cgroup_members(pid: int, table: dict[int, int]) -> list[int]:
    """The members of the job's cgroup, which its program entered before it ran: none where
    the leader's cgroup is not one of ours, or holds one of the leader's ancestors (a cgroup
    around the job, not the job's: a Slurm step's, whose slurmd a cgroup of ours may hold
    where Slurm itself runs in pytest-sky's nodes, as the testbed's does)."""
    raw = _read(f"/proc/{pid}/cgroup") or b""
    own = next((line[3:].decode().strip() for line in raw.splitlines() if line.startswith(b"0::")), "")
    if shell.CGROUP_PREFIX not in own:
        return []
    from pytest_sky.agent.rank import cgroup_root

    root = cgroup_root()
    listed = _read(f"{root}{own}/cgroup.procs") if root != "-" else None
    found = [int(p) for p in (listed or b"").split()]
    ancestors, parent = set(), table.get(pid, 0)
    while parent > 0 and parent not in ancestors:
        ancestors.add(parent)
        parent = table.get(parent, 0)
    return [] if ancestors.intersection(found) else found


def members(leader: int, tokens: list[str]) -> list[int]:
    """The job's processes on this node, parents before children: see the module's docstring."""
    table = _table()
    found = {pid for pid in _cgroup_members(leader, table) if pid in table} if leader > 0 else set()
    wanted = [(shell.JOB_SCOPE_VAR + "=" + t).encode() for t in tokens if t]
    for pid in table:
        env = _read(f"/proc/{pid}/environ", 1 << 20) if wanted else None
        if env and any(w in env.split(b"\0") for w in wanted):
            found.add(pid)
    if leader in table:
        found.add(leader)
    grown = True
    while grown:  # the leader's descendants, whatever they carry
        more = {pid for pid, parent in table.items() if parent in found and pid not in found}
        grown = bool(more)
        found |= more
    found -= _own_line(table)
    return _tree_order(found, table)


def _own_line(table: dict[int, int]) -> set[int]:
    """This process and its ancestors: the capture is not the job's."""
    mine, pid = set(), os.getpid()
    while pid > 0 and pid not in mine:
        mine.add(pid)
        pid = table.get(pid, 0)
    return mine


def _tree_order(found: set[int], table: dict[int, int]) -> list[int]:
    ordered: list[int] = []

    def visit(pid: int) -> None:
        ordered.append(pid)
        for child in sorted(p for p in found if table.get(p) == pid):
            visit(child)

    for root in sorted(p for p in found if table.get(p) not in found):
        visit(root)
    return ordered


def shown_argv(argv: list[str]) -> list[str]:
    """The command line as a report may show it: a rank's program (it sets the task's
    environment, secrets included) and other long or multi-line arguments by length only."""
    out = []
    for arg in argv:
        if "\n" in arg or len(arg) > ARG_CHARS:
            out.append(f"<{len(arg)} characters>")
        else:
            out.append(arg)
    return out


def _threads(pid: int) -> list[dict]:
    out: list[dict] = []
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return out
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        fields = procs.stat_fields(pid) if tid == pid else _task_stat(base)
        comm = (_read(base + "/comm") or b"").decode("utf-8", "replace").strip()
        out.append({"tid": tid, "name": comm, "state": fields[procs.STATE] if fields else "?", "wchan": _wchan(base)})
    return out


def _task_stat(base: str) -> list[str] | None:
    raw = _read(base + "/stat")
    if not raw or b")" not in raw:
        return None
    return raw[raw.rfind(b")") + 2 :].decode("ascii", "replace").split()


def _armed(pid: int) -> tuple[int, int, int] | None:
    """(fd, signal, inode) of the process's stack memfd, where ``site_hook`` armed one and the
    process still has the handler; None otherwise."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if not target.startswith(f"/memfd:{MEMFD_NAME}:"):
                continue
            signum = int(target.split(":")[2].split()[0])
            if _catches(pid, signum):
                return int(fd), signum, os.stat(f"/proc/{pid}/fd/{fd}").st_ino
        except (OSError, ValueError, IndexError):  # gone meanwhile, or a memfd of another name
            continue
    return None


def _catches(pid: int, signum: int) -> bool:
    for line in (_read(f"/proc/{pid}/status") or b"").splitlines():
        if line.startswith(b"SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def describe(pid: int) -> dict | None:
    """One process as the report shows it (None once it is gone)."""
    fields = procs.stat_fields(pid)
    argv = procs.cmdline(pid)
    if fields is None or argv is None:
        return None
    exe = ""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        pass
    python = "python" in os.path.basename(exe) or any("python" in os.path.basename(a) for a in argv[:1])
    return {
        "pid": pid,
        "ppid": int(fields[procs.PPID]),
        "state": fields[procs.STATE],
        "wchan": _wchan(f"/proc/{pid}"),
        "argv": shown_argv(argv),
        "threads": _threads(pid),
        "python": python,
        "dump": None,
        "note": "",
        "sources": {},
    }


def dump_stacks(found: list[dict]) -> None:
    """Each armed Python process's dump into its entry (``dump``), or why there is none
    (``note``).  Processes that share a memfd (a fork that never re-armed) are asked one at a
    time, so that their dumps do not interleave; the others all at once."""
    waiting: dict[int, list[tuple[dict, int, int]]] = {}
    for entry in found:
        armed = _armed(entry["pid"])
        if armed is None:
            if entry["python"]:
                entry["note"] = "no stack: this Python was not armed (started without ~/.sky/python on PYTHONPATH)"
            continue
        fd, signum, inode = armed
        waiting.setdefault(inode, []).append((entry, fd, signum))
    while waiting:
        batch = [queue.pop(0) for queue in waiting.values()]
        waiting = {inode: queue for inode, queue in waiting.items() if queue}
        _dump_batch(batch)


def _dump_batch(batch: list[tuple[dict, int, int]]) -> None:
    started: list[tuple[dict, str, int]] = []
    for entry, fd, signum in batch:
        path = f"/proc/{entry['pid']}/fd/{fd}"
        try:
            before = os.stat(path).st_size
            os.kill(entry["pid"], signum)
        except OSError as exc:
            entry["note"] = f"no stack: {exc.strerror or exc}"
            continue
        started.append((entry, path, before))
    deadline = time.monotonic() + DUMP_SECONDS
    sizes = {id(e): b for e, _, b in started}
    settled: set[int] = set()
    while len(settled) < len(started) and time.monotonic() < deadline:
        time.sleep(0.02)
        for entry, path, before in started:
            try:
                size = os.stat(path).st_size
            except OSError:
                settled.add(id(entry))
                continue
            if size > before and size == sizes[id(entry)]:
                settled.add(id(entry))  # grew, then stayed: the handler is done
            sizes[id(entry)] = size
    for entry, path, before in started:
        try:
            with open(path, "rb") as f:
                f.seek(before)
                text = f.read(1 << 20).decode("utf-8", "replace")
        except OSError:
            text = ""
        if text.strip():
            entry["dump"] = text
        else:
            entry["note"] = f"no stack within {DUMP_SECONDS:g} s (state {entry['state']}: stopped or in the kernel)"


def sources(found: list[dict], argvs: dict[int, list[str]]) -> None:
    """The source line of every frame each dump names, into its entry (``"file:line"`` ->
    text), read here: the files are the node's, which the client cannot see.  ``python -c``'s
    code (``<string>``) is read from the process's own command line (``argvs``, in full)."""
    files: dict[str, list[str]] = {}
    looked = 0
    for entry in found:
        lines: dict[str, str] = entry.setdefault("sources", {})
        argv = argvs.get(entry["pid"], [])
        code = argv[argv.index("-c", 1) + 1] if "-c" in argv[1:-1] else ""
        files_of = {"<string>": code.splitlines()} if code else {}
        for raw in (entry["dump"] or "").splitlines():
            raw = raw.strip()
            if not raw.startswith('File "') or '", line ' not in raw or looked >= SOURCE_LINES:
                continue
            name, rest = raw[6:].split('", line ', 1)
            number = rest.split(" ", 1)[0]
            if not number.isdigit() or f"{name}:{number}" in lines:
                continue
            looked += 1
            if name not in files_of:
                if name not in files:
                    text = _read(name, 8 << 20) if not name.startswith("<") else None
                    files[name] = text.decode("utf-8", "replace").splitlines() if text else []
                files_of[name] = files[name]
            found_lines = files_of[name]
            n = int(number)
            lines[f"{name}:{n}"] = found_lines[n - 1].strip() if 0 < n <= len(found_lines) else ""


def snapshot(leader: int, tokens: list[str], secrets: Secrets) -> tuple[dict, list[str]]:
    """This node's part of the answer, every secret's value in it masked; and the values this
    node's processes hold (for the head to mask the other nodes' answers with)."""
    own = _token(leader) if leader > 0 else None
    pids = members(leader, [*tokens, own or ""])
    argvs = {pid: procs.cmdline(pid) or [] for pid in pids}
    found = [d for d in (describe(pid) for pid in pids) if d is not None]
    dump_stacks(found)
    sources(found, argvs)
    values = sorted({*secrets.values, *_held(pids, secrets.names)})
    answer = {"leader": leader, "token": own, "processes": found, "error": None}
    return _masked(answer, masked_values({str(i): v for i, v in enumerate(values)})), values


class Secrets:
    """The task's secrets as a capture masks them: their names (the head's records keep no
    value), and the values the client or the head knows.  Values travel on ssh's stdin only."""

    def __init__(self, wire: dict) -> None:
        self.names = [str(n) for n in wire.get("secrets") or []]
        self.values = [str(v) for v in wire.get("values") or [] if v and v != SECRET_SHOWN]

    def wire(self, values: list[str]) -> dict:
        return {"secrets": self.names, "values": values}


def _held(pids: list[int], names: list[str]) -> set[str]:
    """The values the job's processes hold for the secrets' names (each rank exports them)."""
    prefixes = [(name + "=").encode() for name in names]
    held: set[str] = set()
    for pid in pids if prefixes else ():
        for entry in (_read(f"/proc/{pid}/environ", 1 << 20) or b"").split(b"\0"):
            held.update(entry[len(p) :].decode("utf-8", "replace") for p in prefixes if entry.startswith(p))
    return held


def _masked(value: Any, masks: list[str]) -> Any:
    """``value`` (the answer: strings in lists and dicts) with every secret's value masked."""
    if isinstance(value, str):
        return mask(value, masks) if masks else value
    if isinstance(value, list):
        return [_masked(v, masks) for v in value]
    if isinstance(value, dict):
        return {_masked(k, masks): _masked(v, masks) for k, v in value.items()}
    return value


def node_main(argv: list[str]) -> int:
    """``stacks-node``: this node's snapshot, asked by the head (the request on stdin)."""
    request = json.loads(sys.stdin.buffer.read() or b"{}")
    answer, _ = snapshot(int(request.get("pid") or 0), list(request.get("tokens") or []), Secrets(request))
    sys.stdout.write(json.dumps(answer))
    return 0


# ------------------------------------------------------------------------------ the head


def _remote(node: dict, tokens: list[str], secrets: dict) -> dict:
    """A worker's snapshot, over head-to-worker ssh."""
    import subprocess

    from pytest_sky.agent.rank import ssh_argv

    remote = f"{sys.executable} -I -S ~/.sky/{shell.AGENT_BUNDLE} stacks-node"
    request = json.dumps({"pid": node.get("pid") or 0, "tokens": tokens, **secrets}).encode()
    try:
        done = subprocess.run(
            ssh_argv(str(node["target"]), remote), input=request, capture_output=True, timeout=NODE_SECONDS
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {NODE_SECONDS:g} s"}
    except OSError as exc:
        return {"error": f"could not run ssh: {exc.strerror or exc}"}
    if done.returncode != 0:
        said = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return {"error": f"ssh exit {done.returncode}" + (f": {said[-1]}" if said else "")}
    try:
        return json.loads(done.stdout)
    except ValueError:
        return {"error": "an answer this agent cannot read"}


def main(argv: list[str]) -> int:
    """``stacks``: every node's snapshot, the head's first; the request (each rank's node and
    its leader's pid, the task's secrets) on stdin, the answer as one JSON object."""
    import threading

    request = json.loads(sys.stdin.buffer.read() or b"{}")
    nodes = list(request.get("nodes") or [])
    secrets = Secrets(request)
    answers: dict[int, dict] = {}
    tokens: list[str] = []
    values = secrets.values
    if nodes:
        answers[0], values = snapshot(int(nodes[0].get("pid") or 0), [], secrets)
        tokens = [answers[0]["token"]] if answers[0]["token"] else []

    def one(i: int, node: dict) -> None:
        answers[i] = _remote(node, tokens, secrets.wire(values))

    threads = [threading.Thread(target=one, args=(i, n), daemon=True) for i, n in enumerate(nodes) if i > 0]
    for t in threads:
        t.start()
    for t in threads:
        t.join(NODE_SECONDS + 5)
    out = []
    for i, node in enumerate(nodes):
        answer = answers.get(i) or {"error": "no answer"}
        out.append({"rank": node.get("rank", i), **answer})
    sys.stdout.write(json.dumps({"nodes": out}))
    return 0
