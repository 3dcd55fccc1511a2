"""Namespace nodes: the primitive under the local backend (and the emulator's kubelet).

A node is one process tree in fresh network, UTS, IPC, mount, PID and cgroup namespaces, with
OpenSSH ``sshd -D`` as its first process, one veth into a per-cluster bridge, a private
``/run`` and bind-mounted ``/etc/passwd`` and ``/etc/hosts``.  ``nodeinit.py`` starts a
launch's nodes (one process forks them all and each makes its namespaces, mounts and link
with system calls); this package plans them, waits for them and stops them.

Why a cgroup per node: the kernel's own accounting of every process the node ever started,
whatever sessions they made or whoever their parent was.  The host kills a whole node with
one write (``cgroup.kill``), and inside the node (a cgroup namespace with cgroup2 mounted on
``/sys/fs/cgroup``, as a container has) the agent gives each job's rank a child cgroup of
its own, so a failed or cancelled job leaves nothing running.  Where the host's cgroup2
hierarchy is missing or read-only, nodes start without one and the agent falls back to
walking processes (``pytest_sky/shell/rank_supervisor.sh``).

Why not ``ip netns add``: a named namespace is a bind mount under ``/run/netns`` that every
later node's mount namespace copies, which keeps deleted namespaces (and their veths)
alive until those nodes die.  An anonymous namespace lives exactly as long as the node's
processes, so killing the node's first process releases everything but the bridge.

Why shell ``ip`` (for a bridge's address and route, and teardown) rather than pyroute2:
measured faster here (DESIGN.md section 5).  The bridge itself, and each node's own link
(made from inside the node), are raw netlink requests (``netlink.py``): no program to
start, 64 times, and an errno rather than a message to read.

The package, by concern (each module imports only those above it in this list):

- ``nodes``: what a node is before it starts (``NodeSpec``) and once it runs (``NodeProcess``,
  and ``NodeRecord``, the part of it a later process can act on)
- ``links``: the bridge, veth names, link groups and aliases, and their deletion
- ``owners``: whose a bridge is (the directory its alias names), and whether that owner lives
- ``cgroups``: a cgroup per node on the host, and killing through it
- ``preflight``: the programs, privileges and FORWARD policy a host needs
- ``output``: reading a helper's stdout by a deadline, tailing a node's log
- ``userns``: rootless clusters: which mode runs, and each cluster's namespace holder
  (``clusterns.py``), in whose user and network namespaces its nodes start
- ``reap``: stopping nodes, by pid, cgroup or command line; bridges whose owner is gone
- ``view``: what of the host's files a node sees (its homes and scratch directories emptied)
- ``plans``: each node's ``NodePlan`` (and its layers' directories), made on the host
- ``spawn``: starting nodes through ``nodeinit.py`` and reading its reports
- ``faults``: network faults inside a node's namespace, and its packet delayer

Callers use this package's names (``netns.start_nodes``), never a module's: which module
holds a function is this package's own business.
"""

from __future__ import annotations

from pytest_sky.backends.netns.cgroups import (
    cgroup2_root,
    kill_cgroups,
    node_cgroup,
    orphaned_cgroups,
    remove_empty_cgroup,
    signal_cgroups,
)
from pytest_sky.backends.netns.faults import (
    DELAY_CHAIN,
    DELAY_QUEUE,
    FAULT_CHAINS,
    Delayer,
    LinkFaults,
    apply_link_faults,
    iptables_rules,
    netem_available,
    shaping_commands,
    start_delayer,
    stop_delayer,
)
from pytest_sky.backends.netns.links import (
    LINK_GROUP_BASE,
    LINK_PREFIX,
    bridge_owned_by,
    create_bridge,
    delete_cluster_links,
    delete_links,
    disable_forwarding,
    ip_batch,
    lease_subnet,
    link_alias,
    link_exists,
    link_group,
    link_lock,
    node_mac,
    routed_networks,
    set_alias,
)
from pytest_sky.backends.netns.nodes import (
    NODE_EXIT,
    NODE_HOME,
    NODE_LOG,
    NODE_PATH,
    NodeProcess,
    NodeRecord,
    NodeSpec,
)
from pytest_sky.backends.netns.output import tail
from pytest_sky.backends.netns.owners import EMULATOR_RECORD, OwnerProcess, owner_gone
from pytest_sky.backends.netns.plans import host_submounts, prepare_layers
from pytest_sky.backends.netns.preflight import (
    check_forward_policy,
    fault_tools,
    forward_policy_problem,
    holder_tools,
    holds_root_caps,
    require_privileges,
    require_tools,
)
from pytest_sky.backends.netns.reap import (
    kill_and_wait,
    node_processes,
    reap_abandoned,
    reap_nodes,
    reap_ownerless_holders,
    reap_stray_bridges,
    stop_nodes,
)
from pytest_sky.backends.netns.spawn import NODE_INIT, start_nodes
from pytest_sky.backends.netns.userns import (
    HOLDER_MARKER,
    Holder,
    LocalMode,
    await_gateway,
    dial_command,
    holder_processes,
    local_mode,
    node_user,
    reap_stray_holders,
    start_holder,
    stop_holder,
    userns_problem,
)
from pytest_sky.backends.netns.view import node_view

__all__ = [
    "DELAY_CHAIN",
    "DELAY_QUEUE",
    "EMULATOR_RECORD",
    "FAULT_CHAINS",
    "HOLDER_MARKER",
    "LINK_GROUP_BASE",
    "LINK_PREFIX",
    "NODE_EXIT",
    "NODE_HOME",
    "NODE_INIT",
    "NODE_LOG",
    "NODE_PATH",
    "Delayer",
    "Holder",
    "LinkFaults",
    "LocalMode",
    "NodeProcess",
    "NodeRecord",
    "NodeSpec",
    "OwnerProcess",
    "apply_link_faults",
    "await_gateway",
    "bridge_owned_by",
    "cgroup2_root",
    "check_forward_policy",
    "create_bridge",
    "delete_cluster_links",
    "delete_links",
    "dial_command",
    "disable_forwarding",
    "fault_tools",
    "forward_policy_problem",
    "holder_processes",
    "holder_tools",
    "holds_root_caps",
    "host_submounts",
    "ip_batch",
    "iptables_rules",
    "kill_and_wait",
    "kill_cgroups",
    "lease_subnet",
    "link_alias",
    "link_exists",
    "link_group",
    "link_lock",
    "local_mode",
    "netem_available",
    "node_cgroup",
    "node_mac",
    "node_processes",
    "node_user",
    "node_view",
    "orphaned_cgroups",
    "owner_gone",
    "prepare_layers",
    "reap_abandoned",
    "reap_nodes",
    "reap_ownerless_holders",
    "reap_stray_bridges",
    "reap_stray_holders",
    "remove_empty_cgroup",
    "require_privileges",
    "require_tools",
    "routed_networks",
    "set_alias",
    "shaping_commands",
    "signal_cgroups",
    "start_delayer",
    "start_holder",
    "start_nodes",
    "stop_delayer",
    "stop_holder",
    "stop_nodes",
    "tail",
    "userns_problem",
]
