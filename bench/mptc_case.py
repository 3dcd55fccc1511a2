"""A 2-rank gloo all_reduce test written the way PyTorch writes its own distributed tests.

``MultiProcessTestCase`` spawns ``world_size`` processes in ``setUp`` (``_spawn_processes``,
start method spawn); each re-imports this module, runs the test method as its rank, and the
main process joins them.  It lives in its own module because the spawned ranks import the
test class by name.  Used by ``python -m bench.peer_workers mptc``.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase


class GlooAllReduceTest(MultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    def tearDown(self) -> None:
        super().tearDown()
        if self.rank == self.MAIN_PROCESS_RANK:  # the FileStore file MultiProcessTestCase leaves
            with contextlib.suppress(OSError):
                os.remove(self.file_name)

    def test_all_reduce(self) -> None:
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        try:
            t = torch.ones(4)
            dist.all_reduce(t)
            self.assertEqual(t.tolist(), [2.0] * 4)
        finally:
            dist.destroy_process_group()
