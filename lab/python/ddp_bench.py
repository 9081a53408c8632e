"""PyTorch DDP over Gloo on given parameter shapes: `chorus bench ddp --compare torch`.

One rank per process (env:// variables set by chorus). argv: comma-separated
parameter sizes, timed steps, warm-up steps, bucket_cap_mb, and optionally
gradient_as_bucket_view (1, the default, as chorus: autograd writes each
gradient into its bucket; 0: DDP copies it in, PyTorch's default). The
backward pass is the gradient of sum(p * scale) per parameter, as on chorus's
side. Rank 0 prints one JSON line with the medians; every step starts after
a barrier.
"""

import contextlib
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Layers(torch.nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.full((n,), 0.01)) for n in sizes)

    def forward(self, scale):
        return sum((p * scale).sum() for p in self.ps)


def main():
    sizes = [int(s) for s in sys.argv[1].split(",")]
    steps, warmup, cap = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    as_view = len(sys.argv) <= 5 or sys.argv[5] != "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = DDP(Layers(sizes), bucket_cap_mb=cap, gradient_as_bucket_view=as_view)
    scale = torch.tensor(1.0)

    def step(sync):
        # Gradients that are bucket views must stay views (not None).
        model.zero_grad(set_to_none=not as_view)
        dist.barrier()
        start = time.perf_counter()
        with contextlib.nullcontext() if sync else model.no_sync():
            model(scale).backward()
        return (time.perf_counter() - start) * 1e3

    timed = {True: [], False: []}
    for i in range(warmup + steps):
        for sync in (True, False):
            took = step(sync)
            if i >= warmup:
                timed[sync].append(took)
    if dist.get_rank() == 0:
        with_sync, without = statistics.median(timed[True]), statistics.median(timed[False])
        print(
            json.dumps(
                {
                    "library": "torch",
                    "version": torch.__version__,
                    "backend": "gloo",
                    "gradient_as_bucket_view": as_view,
                    "world": dist.get_world_size(),
                    "params": sum(sizes),
                    "layers": len(sizes),
                    "steps": steps,
                    "step_ms": with_sync,
                    "no_sync_ms": without,
                    "exposed_sync_ms": max(with_sync - without, 0.0),
                }
            ),
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
