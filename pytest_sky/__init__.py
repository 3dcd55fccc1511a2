"""pytest-sky: multi-node clusters for tests, on this machine or on Kubernetes.

The public contract (DESIGN.md section 2) is what this module exports.
"""

from __future__ import annotations

from pytest_sky.cluster import Cluster, get_cluster, launch, reap_orphans
from pytest_sky.errors import (
    BackendUnavailableError,
    CommandFailedError,
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
