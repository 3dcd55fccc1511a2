"""Starting a launch's nodes: one ``nodeinit.py`` process forks them all and reports on each."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pytest_sky.backends.netns.cgroups import kill_cgroups, make_cgroup, node_cgroup
from pytest_sky.backends.netns.links import delete_links
from pytest_sky.backends.netns.nodes import NODE_MARKER, NODE_PATH, NodeProcess, NodeSpec
from pytest_sky.backends.netns.output import Lines, tail
from pytest_sky.backends.netns.plans import node_plans
from pytest_sky.backends.netns.reap import stop_nodes
from pytest_sky.backends.netns.userns import Holder
from pytest_sky.backends.nodeinit_protocol import Launch, NodePlan, ProtocolError, Report, Stage
from pytest_sky.errors import ProvisionError

#: The program that starts a launch's nodes (one process forks them all; its docstring says why).
NODE_INIT = Path(__file__).parent.parent / "nodeinit.py"


def start_nodes(
    specs: Sequence[NodeSpec],
    *,
    bridge: str,
    prefixlen: int,
    subnet: str,
    mtu: int,
    tools: dict[str, str],
    holder: Holder | None = None,
) -> list[NodeProcess]:
    """Start every node, wire it to the bridge and let it exec sshd.

    Returns once every node has its address and mounts and is exec'ing sshd; the caller
    waits for the SSH banners.  (Dialling a node before its address exists costs a 1 s ARP
    retry, hence the handshake.)  On any failure every node of the call is stopped.  With a
    ``holder`` the nodes start in its network namespace, with no link on the host; a rootless
    holder's are rootless, in its user namespace too, with no cgroup.
    """
    rootless = holder is not None and holder.rootless
    cgroups = [None if rootless else _new_node_cgroup(spec) for spec in specs]
    try:
        plans = node_plans(
            specs, cgroups, prefixlen=prefixlen, subnet=subnet, mtu=mtu, tools=tools, bridge=bridge, holder=holder
        )
        spawner = _Spawner(specs, plans, cgroups, holder.enter() if holder else [])
    except BaseException:
        kill_cgroups(cgroups)
        raise
    try:
        started = spawner.wait_configured()
        spawner.close()
        return started
    except BaseException:
        spawner.close()
        stop_nodes(tools["ip"], list(spawner.started.values()), host_links=holder is None)
        kill_cgroups(cgroups)  # and any node that never said it was there (waited until empty)
        # A node killed before the host heard of it may have made its veth already; the
        # kernel removes it with the node's namespace, but later: remove it now, by name.
        if holder is None:
            delete_links(tools["ip"], [s.veth for s in specs])
        raise


def _new_node_cgroup(spec: NodeSpec) -> Path | None:
    cgroup = node_cgroup(spec.veth)
    return cgroup if cgroup is not None and make_cgroup(cgroup) else None


class _Spawner:
    """The one process that forks a call's nodes (``nodeinit.py``), and what it reports.

    Its command line names every node's directory (``psky-node:<dir>``), and so does each
    node's keeper, a fork of it: how :func:`node_processes` finds the nodes of a dead run."""

    def __init__(
        self,
        specs: Sequence[NodeSpec],
        plans: Sequence[NodePlan],
        cgroups: Sequence[Path | None],
        enter: Sequence[str] = (),
    ) -> None:
        self.specs, self.plans, self.cgroups = specs, plans, cgroups
        self.started: dict[int, NodeProcess] = {}  # every node that said it exists, by index
        argv = [*enter, sys.executable, "-S", "-I", str(NODE_INIT), *(f"{NODE_MARKER}{s.root}" for s in specs)]
        # A session of its own, as each node's keeper: Ctrl-C in the terminal reaches pytest,
        # which tears nodes down in order, instead of killing them under it.  What the
        # spawner itself might print (a crash) goes to the first node's log.
        with open(plans[0].log, "ab") as log_file:
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                env={"PATH": NODE_PATH},
                start_new_session=True,
                close_fds=True,
            )
        self.lines = Lines(self.popen)
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write(Launch(list(plans)).encode())
            self.popen.stdin.flush()
        except BrokenPipeError:
            pass  # it ended: wait_configured() says how

    def wait_configured(self, timeout: float = 30.0) -> list[NodeProcess]:
        """Every node, once each has said it is configured (and exec's sshd); the first node
        that failed (or said nothing within ``timeout``) ends it with a ProvisionError."""
        configured: set[int] = set()  # its init said so; its keeper's "ready" may come later
        deadline = time.monotonic() + timeout
        while len(configured) < len(self.specs) or len(self.started) < len(self.specs):
            line = self.lines.next(deadline)
            if line is None:
                index = min(set(range(len(self.specs))) - (configured & set(self.started)))
                late = f"no answer within {timeout:.0f} s" if time.monotonic() >= deadline else "no output"
                raise self._failure(index, tail(Path(self.plans[index].log)) or late)
            try:
                report = Report.decode(line)
            except ProtocolError as exc:
                raise ProvisionError(f"the node starter said something unexpected: {exc}") from None
            self._take(report, configured)
        return [self.started[i] for i in range(len(self.specs))]

    def _take(self, report: Report, configured: set[int]) -> None:
        """One report: a node started or configured, or the end of the launch."""
        index = report.index
        if report.stage is Stage.FAILED:  # the message names the step (the node's log has it too)
            raise self._failure(index, report.message or "failed")
        if report.stage is Stage.EXITED:  # nothing said why: the node's log may
            log_tail = tail(Path(self.plans[index].log), 1)
            raise self._failure(index, "the node's first process exited" + (f" | {log_tail}" if log_tail else ""))
        if report.stage is Stage.READY:
            spec, log_path = self.specs[index], Path(self.plans[index].log)
            self.started[index] = NodeProcess(
                spec.hostname, spec.ip, spec.veth, report.keeper_pid, report.init_pid, log_path, self.cgroups[index]
            )
        elif report.stage is Stage.CONFIGURED:
            configured.add(index)

    def _failure(self, index: int, detail: str) -> ProvisionError:
        return ProvisionError(f"node {self.specs[index].hostname} did not start: {detail}")

    def close(self) -> None:
        """Let it go: once it has relayed the last report it ends by itself; before that, the
        end of its input makes it kill every node it started."""
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None and not stream.closed:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
