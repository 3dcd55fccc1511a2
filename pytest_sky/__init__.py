"""pytest-sky: multi-node clusters for tests, on this machine or on Kubernetes.

The public contract (DESIGN.md section 2) is what this module exports.

A run, by module: ``cluster.Cluster.run`` builds a ``protocol.RunSpec`` and hands it to
``runner.AgentClient``, which execs the agent (``agent``, shipped by ``bootstrap`` as a
zipapp) on the head over one SSH connection; the agent fans the ranks out to the workers
over head-to-worker SSH (``agent.fanout``, each rank under the bash supervisor that
``agent.rank`` reads from ``shell``) and streams ``protocol`` events back, which the runner
turns into the ``RunResult``.  Before that, ``lifecycle.provision`` had a backend (``backends.local``,
``backends.kubernetes``) create the nodes and return a ``cluster_info.ClusterInfo``.

Layers, lowest first; a module imports only from its own layer or lower ones (and never in
a circle), which ``tests/test_layering.py`` checks:

0. errors, naming, procs, protocol, cluster_info, console, shell, registry: leaves (registry imports
   only errors)
1. resources, task_file, task, gpus, settings, state: what the user asks for, and what is on disk
2. ssh, ssh.banner, ssh.config, ssh.keys, ssh.sshd, ssh.client, ssh.parallel, ssh.kube_proxy
3. backends.base, backends.netlink, backends.confine, backends.nodeinit_protocol, backends.nodeinit,
   backends.privileges, backends.netns, backends.netns.nodes, backends.netns.links,
   backends.netns.cgroups, backends.netns.preflight, backends.netns.output, backends.netns.reap,
   backends.netns.plans, backends.netns.spawn, backends.netns.faults, backends.nfdelay,
   backends.kube_policy, backends.kube_manifests, backends.kube_journal, backends.kube_client,
   backends.kube_ownership, backends.kube_errors, backends.kube_preflight, backends.kube_waiting,
   backends.kube_files: the backend interface and its parts
4. backends.local_journal, backends.local, backends.kubernetes, backends
5. agent.records, agent.rank, agent.fanout, agent.control, agent, bootstrap: what goes onto the nodes
6. runner, job: the client side of a run
7. lifecycle: launch, provision, teardown, reap
8. cluster: the handle
9. plugin, cli.commands, cli, cli.__main__, doctor, pytest_sky: the ways in
"""

from __future__ import annotations

from pytest_sky.cluster import Cluster, get_cluster, launch, reap_orphans
from pytest_sky.errors import (
    BackendUnavailableError,
    CommandFailedError,
    NotSupportedError,
    ProvisionError,
    RunError,
    RunTimeoutError,
    SkyError,
    TaskError,
)
from pytest_sky.resources import Resources
from pytest_sky.runner import RankResult, RunResult
from pytest_sky.ssh.parallel import CommandResult, run_command_in_parallel
from pytest_sky.task import Task

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "Cluster",
    "CommandFailedError",
    "CommandResult",
    "NotSupportedError",
    "ProvisionError",
    "RankResult",
    "Resources",
    "RunError",
    "RunResult",
    "RunTimeoutError",
    "SkyError",
    "Task",
    "TaskError",
    "get_cluster",
    "launch",
    "reap_orphans",
    "run_command_in_parallel",
]
