"""A plain PyTorch Gloo job: every rank all-reduces rank + 1 and checks the
sum. Written for torchrun; runs unmodified under `chorus launch`.

usage: torchrun --nproc-per-node N gloo_allreduce.py
"""
import os

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
    tensor = torch.tensor([float(rank + 1)])
    dist.all_reduce(tensor)
    expected = world * (world + 1) / 2
    assert tensor.item() == expected, f"rank {rank}: got {tensor.item()}, expected {expected}"
    print(f"OK rank {rank}/{world} sum {tensor.item():g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
