"""The steady-state cost of chorus.torch.ElasticTrainer against plain torch DDP.

    python3 python/bench/manager_step.py [--world 4] [--steps 200] [--rounds 3] [--hidden 1024]

The same job three ways, alternated round by round, W rank processes on
this host, no fault: examples/python/train.py's 3-layer MLP (--hidden wide)
on its synthetic data, SGD with momentum, a global batch split over the
ranks, (1) under torch's DistributedDataParallel on backend "gloo", (2) the
same on backend "chorus", (3) under chorus.torch.ElasticTrainer (a commit vote per
step, the state kept ready for a joiner). Each rank times every step after
a warm-up; it prints the median step per way (medians over the rounds) and
the trainer's against each DDP's. Needs torch and the chorus package.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from chorus import free_port

ROOT = Path(__file__).resolve().parents[2]
WAYS = ("ddp-gloo", "ddp-chorus", "manager")
WARMUP = 10


def example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("chorus_example", ROOT / "examples" / "python" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(way: str, args) -> None:
    import torch
    import torch.distributed as dist

    import chorus.torch as ct

    torch.set_num_threads(1)
    ex = example()
    x, y = ex.dataset(args.seed, ex.TRAIN_SAMPLES, 0)
    net = ex.model(args.hidden, args.seed)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)

    def batch_of(step: int):
        gen = torch.Generator().manual_seed(args.seed * 7919 + step)
        return torch.randint(0, ex.TRAIN_SAMPLES, (args.batch,), generator=gen)

    stamps = []
    if way == "manager":
        manager = ct.ElasticTrainer(net, opt, timeout=120)

        def backward(step: ct.Step) -> float:
            mine = batch_of(step.step)[step.shard.start : step.shard.stop]
            loss = torch.nn.functional.cross_entropy(net(x[mine]), y[mine], reduction="sum")
            loss.backward()
            return loss.item()

        manager.train(args.steps, args.batch, backward, lambda *_: stamps.append(time.perf_counter()))
        rank = manager.rank
        manager.destroy()
    else:
        dist.init_process_group(way.removeprefix("ddp-"))
        rank, world = dist.get_rank(), dist.get_world_size()
        model = torch.nn.parallel.DistributedDataParallel(net)
        for step in range(args.steps):
            mine = batch_of(step)[args.batch * rank // world : args.batch * (rank + 1) // world]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
            opt.step()
            stamps.append(time.perf_counter())
        dist.destroy_process_group()
    if rank == 0:
        gaps = [(b - a) * 1e3 for a, b in zip(stamps[WARMUP:], stamps[WARMUP + 1 :])]
        print("RESULT " + json.dumps({"step_ms": statistics.median(gaps)}), flush=True)



def run(way: str, args) -> float:
    port = free_port()
    procs = []
    for rank in range(args.world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(args.world),
                   OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--worker", way, *flags(args)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    for p in procs:
        try:
            outputs.append((p.returncode, *p.communicate(timeout=args.timeout)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"{way}: a rank ran past {args.timeout} s")
    for p, (_, out, err) in zip(procs, outputs):
        if p.returncode != 0:
            raise SystemExit(f"{way} failed (exit {p.returncode}):\n{out}\n{err[-3000:]}")
    for _, out, _ in outputs:
        for line in out.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])["step_ms"]
    raise SystemExit(f"{way}: no result")


def flags(args) -> list:
    return ["--world", str(args.world), "--steps", str(args.steps), "--batch", str(args.batch),
            "--hidden", str(args.hidden), "--lr", str(args.lr), "--seed", str(args.seed)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--hidden", type=int, default=1024, help="width of the hidden layers (default 1024: 1.1 M parameters)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args)
        return
    if args.steps <= WARMUP + 1:
        p.error(f"--steps must be above {WARMUP + 1} (the first {WARMUP} are a warm-up)")
    results = {way: [] for way in WAYS}
    for r in range(args.rounds):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:
            print(f"round {r + 1}/{args.rounds}: {way}", file=sys.stderr, flush=True)
            results[way].append(run(way, args))
    print(f"# world {args.world}, hidden {args.hidden}, {args.steps} steps, median step per way over "
          f"{args.rounds} alternated rounds")
    med = {}
    for way in WAYS:
        med[way] = statistics.median(results[way])
        print(f"  {way:>10}: {med[way]:7.2f} ms  (rounds: " + ", ".join(f"{v:.2f}" for v in results[way]) + ")")
    print(f"# manager / ddp-chorus {med['manager'] / med['ddp-chorus']:.3f}x, "
          f"manager / ddp-gloo {med['manager'] / med['ddp-gloo']:.3f}x")


if __name__ == "__main__":
    main()
