"""A torch backend whose operations are done the moment they are issued,
registered as "idle": what torch and DDP cost around a backend, with no
backend cost at all. dispatch.py times a call into it; torch_backend.py
--floor trains under DDP on it, which gives the exposed sync that no
backend can remove (DDP's own bucket work)."""

from __future__ import annotations

import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

import chorus.torch as chorus_torch

NAME = "idle"


class IdleBackend(c10d.Backend):
    """Every operation is already done. All-gathers copy this rank's input
    into every slot, so DDP's check that all ranks hold the same shapes
    passes; nothing is exchanged."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._options = c10d.Backend.Options(NAME)

    @property
    def options(self):
        return self._options

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    def allreduce(self, tensors, opts=None):
        return chorus_torch.ChorusWork([], list(tensors))

    def broadcast(self, tensors, opts=None):
        return chorus_torch.ChorusWork([], list(tensors))

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outputs, tensor in zip(output_tensors, input_tensors):
            for output in outputs:
                output.copy_(tensor)
        return chorus_torch.ChorusWork([], output_tensors)

    def barrier(self, opts=None):
        return chorus_torch.ChorusWork([], [])


def register() -> None:
    dist.Backend.register_backend(NAME, lambda store, rank, size, timeout: IdleBackend(rank, size), devices=["cpu"])
