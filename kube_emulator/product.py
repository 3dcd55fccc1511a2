"""The emulator's one door into pytest-sky: everything it borrows from the product, by name.

The emulator runs each pod as a namespace node of the local backend, confined the way the
kubernetes backend asks a real runtime to confine it, so it must reuse the product's node
primitive rather than grow a second one.  Keeping that reuse to this module means a change
inside ``pytest_sky`` breaks the emulator in one visible place, and the list below is the
whole of the contract between the two (``tests/test_layering.py`` holds every other
emulator module to it).
"""

from __future__ import annotations

from pytest_sky import procs
from pytest_sky.backends import clusterns, confine, local, netns
from pytest_sky.errors import ProvisionError, SkyError

__all__ = [
    "CAPABILITY_BITS",
    "EMULATOR_RECORD",
    "LINK_PREFIX",
    "NODE_HOME",
    "Confinement",
    "NodeProcess",
    "NodeRecord",
    "NodeSpec",
    "OwnerProcess",
    "ProvisionError",
    "SkyError",
    "bridge_name",
    "check_forward_policy",
    "delete_links",
    "is_alive",
    "lease_subnet",
    "link_lock",
    "node_cgroup",
    "passwd_with_home",
    "reap_nodes",
    "reap_stray_bridges",
    "require_privileges",
    "require_tools",
    "start_nodes",
    "start_time",
    "stop_nodes",
    "subnet_of",
]

# Nodes: a pod is one, on a bridge of the emulator's own (the local backend's primitive).
NodeSpec = netns.NodeSpec
NodeProcess = netns.NodeProcess
NodeRecord = netns.NodeRecord
LINK_PREFIX = netns.LINK_PREFIX
NODE_HOME = netns.NODE_HOME
require_privileges = netns.require_privileges
require_tools = netns.require_tools
check_forward_policy = netns.check_forward_policy
lease_subnet = netns.lease_subnet
subnet_of = clusterns.subnet_of
bridge_name = clusterns.bridge_name
delete_links = netns.delete_links
start_nodes = netns.start_nodes
stop_nodes = netns.stop_nodes
reap_nodes = netns.reap_nodes
node_cgroup = netns.node_cgroup
# Whose a bridge is: the emulator's record names its owner as the product's reaper reads it,
# and an emulator's start runs that reaper's pass over the machine's bridges.
OwnerProcess = netns.OwnerProcess
EMULATOR_RECORD = netns.EMULATOR_RECORD
link_lock = netns.link_lock
reap_stray_bridges = netns.reap_stray_bridges
passwd_with_home = local.passwd_with_home

# The node runtime's terms for what a container holds, which a node's init carries out, and
# the kernel's capabilities by name.  Never the product's policy (what a pod of ours asks for,
# what a runtime gives by default): the emulator judges those by upstream's own lists
# (``runtime.py``, ``admission.py``).
Confinement = confine.Confinement
CAPABILITY_BITS = confine.CAPABILITY_BITS

# Processes: telling a recorded pid from a reused one, when reaping a killed emulator's pods.
start_time = procs.start_time
is_alive = procs.is_alive
