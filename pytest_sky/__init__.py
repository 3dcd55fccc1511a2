"""pytest-sky: multi-node clusters for tests, on this machine, on Kubernetes or on Slurm.

The public contract (DESIGN.md section 2) is what this module exports.

A run, by module: ``cluster.Cluster.run`` builds a ``protocol.RunSpec`` and hands it to
``runner.AgentClient``, which asks the agent (``agent``, shipped by ``bootstrap`` as a
zipapp) on the head over one SSH connection (its server, ``agent.server``, or an exec); the
agent fans the ranks out to the workers (``agent.fanout``; ``agent.remote``: each worker's
server, or head-to-worker SSH; each rank supervised by its node's server, ``agent.supervisor``,
or else by the bash supervisor that ``agent.rank`` reads from ``shell``) and streams
``protocol`` events back, which the runner turns into the ``RunResult``.  Before that,
``lifecycle.provision`` had a backend (``backends.local``, ``backends.kubernetes``,
``backends.slurm``) create the nodes and return a ``cluster_info.ClusterInfo``.

Layers, lowest first; a module imports only from its own layer or lower ones (and never in
a circle), which ``tests/test_layering.py`` checks:

0. errors, naming, cluster_names, procs, locks, protocol, masking, cluster_info, console, shell, registry,
   interrupts: leaves (registry and cluster_names import only errors, masking only protocol)
1. resources, task_file, task, script_files, task_tarball, gpus, settings, state: what the user asks for,
   and what is on disk
2. ssh, ssh.banner, ssh.config, ssh.keys, ssh.sshd, ssh.client, ssh.parallel, ssh.kube_dial,
   ssh.kube_credentials, ssh.kube_stream, ssh.kube_proxy, ssh.kube_forwarder
3. backends.base, backends.netlink, backends.confine, backends.rootpath, backends.nodeinit_protocol, backends.nodelink,
   backends.nodeinit,
   backends.fdpass, backends.gateway, backends.clusterns, backends.privileges, backends.netns,
   backends.netns.nodes, backends.netns.links, backends.netns.owners, backends.netns.cgroups,
   backends.netns.preflight, backends.netns.userns, backends.netns.output, backends.netns.reap,
   backends.netns.view, backends.netns.plans, backends.netns.spawn, backends.netns.faults, backends.nfdelay,
   backends.kube_policy, backends.kube_manifests, backends.kube_journal, backends.kube_permissions,
   backends.kube_client,
   backends.kube_ownership, backends.kube_errors, backends.kube_preflight, backends.kube_waiting,
   backends.kube_files, backends.kube_lease, backends.kube_objects, backends.kube_reaping,
   backends.slurm_site, backends.slurm_owner, backends.slurm_journal, backends.slurm_steps,
   backends.slurm_submit: the backend interface and its parts
4. backends.local_journal, backends.local, backends.kubernetes, backends.slurm, backends
5. agent.site_hook, agent.records, agent.queue, agent.child, agent.remote, agent.rank, agent.stacks,
   agent.fanout, agent.control, agent.supervisor, agent.server, agent, bootstrap: what goes onto the nodes
6. diagnosis, runner, job, timeline: the client side of a run
7. lifecycle: launch, provision, teardown, reap
8. cluster, artifacts: the handle, and what a failed test keeps of it
9. junit, failure_report, node_needs, markers, plugin, cli.job_report, cli.power, cli.stale, cli.commands, cli.logs,
   cli, cli.__main__, doctor, pytest_sky: the ways in
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    from pytest_sky.job import Job
    from pytest_sky.node_needs import require_on_nodes
    from pytest_sky.protocol import JobStatus
    from pytest_sky.resources import Resources
    from pytest_sky.runner import RankResult, RunFailedError, RunResult
    from pytest_sky.ssh.parallel import CommandResult, run_command_in_parallel
    from pytest_sky.task import Task

__version__ = "0.1.0"

#: Each public name and the module that defines it.  Imported on first use (PEP 562), not
#: with the package: pytest loads the plugin, and so this package, in every run of every
#: project that has pytest-sky installed, and the CLI starts with it; importing the cluster
#: machinery up front cost each of them about 100 ms.
_EXPORTS = {
    "BackendUnavailableError": "pytest_sky.errors",
    "Cluster": "pytest_sky.cluster",
    "CommandFailedError": "pytest_sky.errors",
    "CommandResult": "pytest_sky.ssh.parallel",
    "Job": "pytest_sky.job",
    "JobStatus": "pytest_sky.protocol",
    "NotSupportedError": "pytest_sky.errors",
    "ProvisionError": "pytest_sky.errors",
    "RankResult": "pytest_sky.runner",
    "Resources": "pytest_sky.resources",
    "RunError": "pytest_sky.errors",
    "RunFailedError": "pytest_sky.runner",
    "RunResult": "pytest_sky.runner",
    "RunTimeoutError": "pytest_sky.errors",
    "SkyError": "pytest_sky.errors",
    "Task": "pytest_sky.task",
    "TaskError": "pytest_sky.errors",
    "get_cluster": "pytest_sky.cluster",
    "launch": "pytest_sky.cluster",
    "reap_orphans": "pytest_sky.cluster",
    "require_on_nodes": "pytest_sky.node_needs",
    "run_command_in_parallel": "pytest_sky.ssh.parallel",
}

__all__ = [  # the names of _EXPORTS, spelled out so that tools read them without running this
    "BackendUnavailableError",
    "Cluster",
    "CommandFailedError",
    "CommandResult",
    "Job",
    "JobStatus",
    "NotSupportedError",
    "ProvisionError",
    "RankResult",
    "Resources",
    "RunError",
    "RunFailedError",
    "RunResult",
    "RunTimeoutError",
    "SkyError",
    "Task",
    "TaskError",
    "get_cluster",
    "launch",
    "reap_orphans",
    "require_on_nodes",
    "run_command_in_parallel",
]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_sky' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later uses find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
