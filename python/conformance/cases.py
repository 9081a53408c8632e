"""The suite's test class, as upstream's test_distributed_spawn.py builds
it, with chorus entered where the suite lets a third-party backend in.
Imported by torch_suite.py and by every rank process it spawns."""

import os

import torch.distributed as dist
from torch.testing._internal.common_distributed import DistTestCases

import chorus.torch  # noqa: F401  registers "chorus"

BACKEND = os.environ["CHORUS_SUITE_BACKEND"]

if BACKEND == "chorus":
    # Before the suite's import: its decorators read these sets.
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add("chorus")

if BACKEND == "chorus" and os.environ["BACKEND"] == "gloo":
    # --as-gloo: the suite believes it runs Gloo (its gates and its
    # expectations are Gloo's); every group it makes is chorus's.
    _new_process_group_helper = dist.distributed_c10d._new_process_group_helper

    def _on_chorus(group_size, group_rank, global_ranks, backend, *args, **kwargs):
        if str(backend).lower() in ("gloo", "cpu:gloo,cuda:nccl", "undefined"):
            backend = "chorus"
        return _new_process_group_helper(group_size, group_rank, global_ranks, backend, *args, **kwargs)

    dist.distributed_c10d._new_process_group_helper = _on_chorus

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
