"""An in-memory backend for testing what sits above backends: the lifecycle (claim, create,
failure cleanup, teardown, reaping), the plugin's and the CLI's bookkeeping.

It makes no node: ``create`` returns addresses nothing answers at (no traffic is ever sent
to them) and remembers, per cluster, what it was asked.  So it proves nothing about clusters
working; the local backend and the emulator do that.  Tests register it through the
``memory_backend`` fixture (tests/conftest.py), which adds it to ``pytest_sky.registry``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pytest_sky.backends.base import Backend, HomeFiles, ProvisionConfig
from pytest_sky.cluster_info import ClusterInfo, NodeInfo, SshRoute
from pytest_sky.errors import ProvisionError
from pytest_sky.registry import BackendEntry
from pytest_sky.resources import Resources
from pytest_sky.state import Journal

ENTRY = BackendEntry("memory", ("mem",), "tests.fake_backend:MemoryBackend", "nothing: clusters on paper")


@dataclass
class Ledger:
    """What the backend was asked, shared by every instance (the plugin, the lifecycle and a
    reaper each build their own): clusters in creation order, and each one destroyed."""

    created: list[str] = field(default_factory=list)
    destroyed: list[str] = field(default_factory=list)
    #: Names whose ``create`` fails (after journaling it, as a real backend half-way would).
    fail_create: set[str] = field(default_factory=set)


LEDGER = Ledger()


class MemoryBackend(Backend):
    name = "memory"
    cloud_label = "Memory"

    def plan(self, name: str, num_nodes: int, resources: Resources, shared_dir: str | None = None) -> None:
        if resources.accelerators is not None:
            raise ProvisionError("the memory backend has no GPUs")

    def create(self, config: ProvisionConfig) -> ClusterInfo:
        config.journal.update(nodes=config.num_nodes)  # intent before action, as every backend
        if config.name in LEDGER.fail_create:
            raise ProvisionError(f"{config.name}: the memory backend was told to fail")
        LEDGER.created.append(config.name)
        nodes = tuple(
            NodeInfo(
                rank,
                "head" if rank == 0 else f"worker{rank}",
                f"{config.name}-{'head' if rank == 0 else f'worker{rank}'}",
                f"198.19.255.{rank + 1}",
                SshRoute(f"198.19.255.{rank + 1}"),
            )
            for rank in range(config.num_nodes)
        )
        return ClusterInfo(nodes=nodes, cloud="memory", region=None)

    def put_files(self, name: str, journal: Journal, info: ClusterInfo, files: HomeFiles) -> None:
        """Nothing to write to: the nodes exist only here."""

    def destroy(self, name: str, journal: Journal) -> None:
        if journal.load():
            LEDGER.destroyed.append(name)
