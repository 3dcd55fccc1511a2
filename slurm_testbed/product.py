"""The testbed's one door into pytest-sky: its public API, and the reaper of a killed testbed.

The testbed's nodes are a pytest-sky local cluster, its daemons detached jobs on it, so it
uses the product as a user would; keeping every import of ``pytest_sky`` here makes that the
whole of the contract (``tests/test_layering.py`` holds the other modules to it).
"""

from __future__ import annotations

from pytest_sky import Cluster, RunTimeoutError, SkyError, Task, launch
from pytest_sky.job import Job
from pytest_sky.lifecycle import reap
from pytest_sky.settings import state_home
from pytest_sky.state import StateStore

__all__ = ["Cluster", "Job", "RunTimeoutError", "SkyError", "StateStore", "Task", "launch", "reap", "state_home"]
