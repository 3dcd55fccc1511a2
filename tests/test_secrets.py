"""A secret stays secret: a canary value in a task's ``secrets``, then everything pytest-sky
shows or keeps, read for it.

An inner pytest run (the way a user runs one, with ``--junitxml`` and ``--sky-artifacts``)
launches a two-node cluster and runs tasks holding the canary: a first run (the head's agent
exec'd), a detached job, then, once every node has its agent server, the canary task itself:
each rank prints the secret, rank 1 fails when told to, rank 0 sleeps.  At each step the
inner test stops and this test reads, for the canary:

- every process's command line on this machine (every node's processes are among them) and
  in each node, through its sshd;
- every file under the state directories (the client's records, each node's disk and job
  records; the emulator's pods on Kubernetes), while the cluster is up and after teardown;
- a packet capture (``tcpdump``) of the cluster's bridge, from launch to teardown: the
  client's connection to the head and every head-to-worker hop cross it (a local cluster's
  bridge is in its holder's network namespace, where the capture runs: the host's link into
  that namespace carries the client's hops only);
- the inner run's output, its JUnit XML and every file under its artifacts directory.

The value is in none of them; ``***`` stands where a rank printed it, and the ranks'
environment holds the real value (a sleeping rank's ``/proc/PID/environ``, and a digest the
rank printed).  Every message of this test shows the canary as ``<CANARY>``.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.plugin_helpers import needs_local_backend

CANARY = f"psky-canary-{secrets.token_hex(12)}"
DIGEST = hashlib.sha256(CANARY.encode()).hexdigest()[:16]
#: How long one step of the inner run may take (a launch on a loaded machine included).
STEP_SECONDS = 300

INNER = r'''
import json, os, threading
import pytest
from pytest_sky import Task

STEPS_IN, STEPS_OUT = (int(fd) for fd in os.environ["PSKY_TEST_STEPS"].split(","))
for fd in (STEPS_IN, STEPS_OUT):
    os.set_inheritable(fd, False)  # nothing this run starts holds the outer test's pipes
steps_in, steps_out = os.fdopen(STEPS_IN), os.fdopen(STEPS_OUT, "w")


def step(where, **facts):
    """Tell the outer test where this run stands, and wait until it has looked."""
    steps_out.write(json.dumps({"step": where, **facts}) + "\n")
    steps_out.flush()
    assert steps_in.readline() == "go\n", where


SECRETS = {"PSKY_CANARY": os.environ.pop("PSKY_TEST_CANARY")}
FIRST = Task(
    num_nodes=2,
    secrets=SECRETS,
    setup='echo "setup sees $PSKY_CANARY"',
    run='echo "first sees $PSKY_CANARY"',
)
CANARY_RUN = Task(
    num_nodes=2,
    secrets=SECRETS,
    envs={"PLAIN": "plain-value-shown"},
    run="""
echo "rank $SKYPILOT_NODE_RANK sees $PSKY_CANARY and $PLAIN"
printf %s "$PSKY_CANARY" | sha256sum | cut -c1-16
echo ready
if [ "$SKYPILOT_NODE_RANK" = 1 ]; then
  until [ -e ~/go ]; do sleep 0.05; done
  echo "failing with $PSKY_CANARY"
  exit 3
fi
sleep 10000
""",
)


@pytest.mark.multinode(num_nodes=2)
def test_canary(sky_cluster):
    record = sky_cluster.journal.load()
    holder = (record.get("holder") or {}).get("pid", 0)
    where = {"bridge": record.get("bridge", ""), "holder": holder, "ips": sky_cluster.node_ips}
    step("up", name=sky_cluster.name, ssh_config=sky_cluster.ssh_config, **where)
    first = sky_cluster.run(FIRST)
    job = sky_cluster.submit(FIRST)
    job.wait(120)
    for _ in range(2):
        assert sky_cluster.run("true").ok  # the second starts every worker's agent server
    ready = threading.Event()
    seen = []

    def on_line(line):
        seen.append(line)
        if sum(x.endswith(") ready") for x in seen) == 2:
            ready.set()

    done = {}
    runner = threading.Thread(target=lambda: done.update(res=sky_cluster.run(CANARY_RUN, on_line=on_line)))
    runner.start()
    assert ready.wait(120), seen
    step("running")
    runner.join(120)
    res = done["res"]
    step(
        "ended",
        outputs=[first.output, job.logs(), res.output],
        ranks=[r.stdout for r in res.ranks],
        returncode=res.returncode,
    )
    assert res.returncode == 0, res.error  # fails, as a user's test would: the report carries the ranks
'''


def shown(text: str) -> str:
    """``text`` as this test's messages show it."""
    return text.replace(CANARY, "<CANARY>")


def files_holding(roots: list[Path], needle: bytes) -> list[str]:
    """Every regular file under ``roots`` whose bytes hold ``needle``."""
    found = []
    for root in roots:
        for top, _, names in os.walk(root):
            for name in names:
                path = Path(top) / name
                try:
                    if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
                        found.append(str(path))
                except OSError:  # gone meanwhile (a teardown's trash), or not to be read
                    pass
    return found


def _cmdlines() -> Iterator[tuple[str, bytes]]:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                yield proc.name, (proc / "cmdline").read_bytes()
            except OSError:
                pass


def command_lines_holding(needle: bytes) -> list[str]:
    """This machine's processes whose command line holds ``needle``: pid and program."""
    found = []
    for pid, argv in _cmdlines():
        if needle in argv:
            program = argv.split(b"\0", 1)[0].decode(errors="replace")
            found.append(f"pid {pid}: {shown(program)}")
    return found


def node_command_lines(ssh_config: str, host: str) -> str:
    """Every command line on one node, as its own ``/proc`` lists them (read over its sshd)."""
    listing = 'for f in /proc/[0-9]*/cmdline; do tr "\\0" " " <"$f"; echo; done 2>/dev/null'
    argv = ["ssh", "-F", ssh_config, host, listing]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout


def environs_of(argv: bytes) -> list[bytes]:
    """The environments of this machine's processes whose command line is ``argv`` (other
    runs' among them: only the rank's holds this test's canary)."""
    found = []
    for pid, cmdline in _cmdlines():
        if cmdline == argv:
            try:
                found.append(Path(f"/proc/{pid}/environ").read_bytes())
            except OSError:
                pass
    return found


class Steps:
    """The inner run's side of the conversation: its steps, one JSON line each."""

    def __init__(self) -> None:
        self.from_inner, self.inner_out = os.pipe()
        self.inner_in, self.to_inner = os.pipe()
        self.fds = f"{self.inner_in},{self.inner_out}"

    def started(self) -> None:
        os.close(self.inner_in)
        os.close(self.inner_out)
        self.reader = os.fdopen(self.from_inner)
        self.writer = os.fdopen(self.to_inner, "w")

    def next(self, expected: str, inner: subprocess.Popen, log: Path) -> dict:
        ready, _, _ = select.select([self.reader], [], [], STEP_SECONDS)
        line = self.reader.readline() if ready else ""
        if not line:
            inner.kill()
            inner.wait()
            pytest.fail(f"the inner run never reached {expected!r}:\n{shown(log.read_text(errors='replace'))}")
        facts = json.loads(line)
        assert facts["step"] == expected, shown(line)
        return facts

    def go(self) -> None:
        self.writer.write("go\n")
        self.writer.flush()

    def close(self) -> None:
        for f in (self.reader, self.writer):
            try:
                f.close()
            except OSError:
                pass


class Capture:
    """``tcpdump`` on one bridge, every packet whole, written as it comes; in the network
    namespace of process ``holder`` where it is one (a local cluster's holder), else the host's."""

    def __init__(self, bridge: str, path: Path, holder: int = 0) -> None:
        self.path = path
        argv = ["tcpdump", "-i", bridge, "-s", "0", "-U", "-n", "-w", str(path)]
        if holder:
            argv = ["nsenter", f"--net=/proc/{holder}/ns/net", *argv]
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        said = self.proc.stderr.readline()  # "listening on <bridge>, ..." once it captures
        assert "listening on" in said, said

    def stop(self) -> bytes:
        self.proc.send_signal(signal.SIGINT)
        self.proc.communicate(timeout=30)
        return self.path.read_bytes()


@needs_local_backend
def test_a_canary_secret_appears_nowhere_but_in_the_ranks_environment(
    pytester: pytest.Pytester, inner_sky_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    canary_run(pytester, inner_sky_home, monkeypatch, options=[], other_state=[], emulator_bridge="")


def test_on_kubernetes_a_canary_secret_appears_nowhere_but_in_the_ranks_environment(
    pytester: pytest.Pytester, inner_sky_home: Path, monkeypatch: pytest.MonkeyPatch, emu: Any
) -> None:
    """The same on the emulator: its pods' disks are under its own state directory, and its
    bridge carries every pod's traffic."""
    from kube_emulator.images import READY_IMAGE

    monkeypatch.setenv("KUBECONFIG", str(emu.kubeconfig_path))
    options = ["--kubernetes", f"--kube-image={READY_IMAGE}"]
    bridge = emu.server.cluster.kubelet.network.bridge
    canary_run(pytester, inner_sky_home, monkeypatch, options, [emu.instance_dir], bridge)


def canary_run(
    pytester: pytest.Pytester,
    inner_sky_home: Path,
    monkeypatch: pytest.MonkeyPatch,
    options: list[str],
    other_state: list[Path],
    emulator_bridge: str,
) -> None:
    """The inner run with ``options``, read at each of its steps and after it; ``other_state``:
    state directories beside its own; ``emulator_bridge``: the bridge its nodes share where
    the cluster's journal names none."""
    state = [inner_sky_home, *other_state]
    pytester.makepyfile(test_inner=INNER)
    art, xml, log = pytester.path / "art", pytester.path / "r.xml", pytester.path / "inner.log"
    steps = Steps()
    args = ["-p", "no:cacheprovider", "-o", "junit_logging=all", f"--junitxml={xml}", f"--sky-artifacts={art}"]
    # In the inner run's environment only, as CI hands a job its secrets: not in this process's,
    # which the emulator's pods would inherit.
    with log.open("w") as out, monkeypatch.context() as only_inner:
        only_inner.setenv("PSKY_TEST_STEPS", steps.fds)
        only_inner.setenv("PSKY_TEST_CANARY", CANARY)
        inner = pytester.popen(
            [sys.executable, "-m", "pytest", *args, *options],
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=(steps.inner_in, steps.inner_out),
        )
    steps.started()
    capture = None
    try:
        up = steps.next("up", inner, log)
        capture = Capture(up["bridge"] or emulator_bridge, pytester.path / "bridge.pcap", up["holder"])
        steps.go()
        steps.next("running", inner, log)
        while_running(up["ssh_config"], [up["name"], f"{up['name']}-worker1"], state)
        steps.go()
        once_ended(steps.next("ended", inner, log), up["ssh_config"], [up["name"], f"{up['name']}-worker1"], state)
        steps.go()
        assert inner.wait(STEP_SECONDS) == 1, shown(log.read_text(errors="replace"))
    finally:
        steps.close()
        if inner.poll() is None:
            inner.kill()
            inner.wait()
        packets = capture.stop() if capture is not None else b""
    # The capture saw the hops between nodes: an IPv4 header from the head to the worker.
    assert socket.inet_aton(up["ips"][0]) + socket.inet_aton(up["ips"][1]) in packets, "no head-to-worker packet"
    after_teardown(log.read_text(), xml.read_text(), art, packets, state)


def while_running(ssh_config: str, hosts: list[str], state: list[Path]) -> None:
    """Rank 0 sleeps, rank 1 waits: every command line and file, then the ranks' environment;
    then rank 1 is told to fail."""
    needle = CANARY.encode()
    assert command_lines_holding(needle) == []
    listings = [node_command_lines(ssh_config, host) for host in hosts]
    assert "\nsleep 10000 \n" in listings[0], listings[0]  # the head's own view lists rank 0's sleep
    assert all(CANARY not in listing for listing in listings), shown("\n".join(listings))
    assert files_holding(state, needle) == []
    environs = environs_of(b"sleep\x0010000\x00")
    assert any(b"PSKY_CANARY=" + needle + b"\0" in env for env in environs), len(environs)
    worker = subprocess.run(["ssh", "-F", ssh_config, hosts[1], "touch go"], timeout=60, check=False)
    assert worker.returncode == 0


def once_ended(ended: dict, ssh_config: str, hosts: list[str], state: list[Path]) -> None:
    """The run failed (rank 1, exit 3): command lines and files again (the job records are
    there now: the nodes' disks are read), and what the runs' results hold."""
    needle = CANARY.encode()
    assert command_lines_holding(needle) == []
    assert all(CANARY not in node_command_lines(ssh_config, host) for host in hosts)
    assert files_holding(state, needle) == []
    assert any(any(root.rglob("events.jsonl")) for root in state), "no job record under the state directories"
    first, detached, canary = ended["outputs"]
    assert ended["returncode"] == 3
    for text in (first, detached):
        assert "setup sees ***" in text and "first sees ***" in text, shown(text)
    rank0, rank1 = ended["ranks"]
    assert rank0.startswith(f"rank 0 sees *** and plain-value-shown\n{DIGEST}\nready\n"), shown(rank0)
    assert rank1 == f"rank 1 sees *** and plain-value-shown\n{DIGEST}\nready\nfailing with ***\n", shown(rank1)
    assert "failing with ***" in canary
    assert all(CANARY not in text for text in (first, detached, canary, rank0, rank1))


def after_teardown(output: str, junit: str, art: Path, packets: bytes, state: list[Path]) -> None:
    """The inner run's output, its JUnit XML, its artifacts, the capture, what is left of the
    state directories."""
    needle = CANARY.encode()
    assert "failing with ***" in output and "1 failed" in output, shown(output)
    assert "failing with ***" in junit, shown(junit)
    assert any("failing with ***" in p.read_text(errors="replace") for p in art.rglob("*.log")), "no rank log"
    assert b"SSH-2.0-" in packets  # the capture holds whole packets: the bridge carried the ssh sessions
    read = {"pytest's output": output.encode(), "the JUnit XML": junit.encode(), "the capture": packets}
    assert [where for where, data in read.items() if needle in data] == []
    assert files_holding([art, *state], needle) == []


def test_masking_replaces_each_value_and_each_line_of_one_longest_first() -> None:
    from pytest_sky.masking import mask, masked_values, too_short

    pem = "-----BEGIN KEY-----\nabcdefgh\nxy\n-----END KEY-----"
    values = masked_values({"KEY": pem, "TOKEN": "tok-1234", "LONGER": "tok-12345"})
    assert "xy" not in values and "abcdefgh" in values and values.index("tok-12345") < values.index("tok-1234")
    assert mask("a tok-12345 b tok-1234 c abcdefgh", values) == "a *** b *** c ***"
    assert mask("nothing here", values) == "nothing here"
    assert too_short({"PIN": "42", "KEY": pem, "TOKEN": "tok-1234", "EMPTY": ""}) == ["EMPTY", "KEY", "PIN"]


def test_the_cli_shows_the_safe_form_of_secret() -> None:
    pytest_sky = str(Path(sys.executable).with_name("pytest-sky"))
    for command in ("launch", "exec"):
        text = subprocess.run([pytest_sky, command, "--help"], capture_output=True, text=True, check=True).stdout
        assert "--secret KEY" in text and "KEY=VALUE" in text, text
