"""What a backend written in Python costs per call, against one in C++.

    python3 python/bench/dispatch.py [--calls 20000]

chorus's torch backend has two implementations: a C++ `c10d::Backend`
front whose all-reduce goes from torch's dispatcher to the Rust library
with no Python step, and the Python `Backend` behind it, which runs alone
where the front cannot build. This measures the per-call cost in one
process (world 1, so no rank waits on another): `dist.all_reduce` of one
float through (1) Gloo, C++ all the way, (2) a Python backend that does
nothing (returns a finished work at once: torch's dispatch into Python and
back, the whole cost of a call into a Python backend), (3) chorus's Python
backend and (4) chorus as users get it, the C++ front: (3) - (4) is what
the front saves per call. It prints the medians of 5 rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import chorus.torch
import idle_backend
from chorus import cpp_backend


def per_call_us(group, calls: int) -> float:
    t = torch.ones(1)
    for _ in range(100):
        dist.all_reduce(t, group=group)
    began = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(t, group=group)
    return (time.perf_counter() - began) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    if cpp_backend.load() is None:
        raise SystemExit("the C++ front did not build (see the warning above); nothing to compare")
    chorus.torch.register("chorus_python", "python")
    idle_backend.register()
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    groups = {"gloo": dist.group.WORLD, "python, idle": dist.new_group(backend=idle_backend.NAME),
              "chorus, Python": dist.new_group(backend="chorus_python"), "chorus, C++": dist.new_group(backend="chorus")}
    rounds = {name: [] for name in groups}
    for _ in range(5):
        for name, group in groups.items():
            rounds[name].append(per_call_us(group, args.calls))
    print(f"# dist.all_reduce of 1 float at world 1, us per call, medians of 5 rounds x {args.calls} calls")
    for name, values in rounds.items():
        print(f"  {name:>13}: {statistics.median(values):7.2f} us  (rounds: " + ", ".join(f"{v:.2f}" for v in values) + ")")
    idle, whole = statistics.median(rounds["python, idle"]), statistics.median(rounds["chorus, Python"])
    print(f"  a call into a Python backend that does nothing: {idle:.2f} us (at most what a C++ backend saves); "
          f"chorus's Python backend: {whole:.2f} us, {whole - idle:.2f} us of it past the Python step")
    cpp = statistics.median(rounds["chorus, C++"])
    print(f"  chorus's C++ front: {cpp:.2f} us per call, {whole - cpp:.2f} us less than the Python backend "
          f"({cpp / whole:.2f}x its time)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
