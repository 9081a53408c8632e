"""torch.distributed on backend "chorus" against "gloo", side by side.

    python3 python/bench/torch_backend.py [--worlds 2,4] [--rounds 3] [--max-mib 64]

For each world size it runs, alternating the backends round by round, W
rank processes on this host that (1) sweep dist.all_reduce (float32, sum,
in place) from 8 B to --max-mib and (2) train a model with torch's
DistributedDataParallel, timing each step with gradient sync and without
(`no_sync`): the difference is the sync the step could not hide, and (3)
train a byte-level GPT the same way (AdamW, bf16 autocast). It prints,
per world, an nccl-tests table per backend (medians over the rounds) with
chorus's bus bandwidth over Gloo's, and the DDP step and exposed-sync
medians with their ratio. Needs torch and the chorus package
(`pip install ./python`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from chorus import free_port

HERE = os.path.abspath(__file__)


def worker(backend: str, max_bytes: int, iters: int, ddp_steps: int) -> None:
    import contextlib

    import torch
    import torch.distributed as dist

    if backend == "chorus":
        import chorus.torch  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    sweep = []
    sizes = [8 << (2 * k) for k in range(30) if 8 << (2 * k) < max_bytes] + [max_bytes]
    for size in sizes:
        t = torch.ones(size // 4)
        reps = max(3, min(iters, (64 << 20) // size))
        for _ in range(2):
            dist.all_reduce(t)
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        t.fill_(1.0)
        dist.all_reduce(t)
        wrong = int((t != world).sum().item())
        sweep.append({"bytes": size, "us": statistics.median(times) * 1e6, "wrong": wrong})

    # DDP: 8 layers of 1 Mi parameters (32 MiB of gradients); the backward
    # pass is cheap, so the exposed sync dominates what remains.
    class Layers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.full((1 << 20,), 0.01)) for _ in range(8))

        def forward(self, scale):
            return sum((p * scale).sum() for p in self.ps)

    model = torch.nn.parallel.DistributedDataParallel(Layers(), bucket_cap_mb=25, gradient_as_bucket_view=True)
    scale = torch.tensor(1.0)
    timed = {True: [], False: []}
    for i in range(2 + ddp_steps):
        for sync in (True, False):
            model.zero_grad(set_to_none=False)
            dist.barrier()
            start = time.perf_counter()
            with contextlib.nullcontext() if sync else model.no_sync():
                model(scale).backward()
            if i >= 2:
                timed[sync].append((time.perf_counter() - start) * 1e3)
    step, local = statistics.median(timed[True]), statistics.median(timed[False])
    gpt_step, gpt_local = gpt(rank, ddp_steps)
    if rank == 0:
        print("RESULT " + json.dumps({"sweep": sweep, "step_ms": step, "exposed_ms": max(0.0, step - local),
                                      "gpt_step_ms": gpt_step, "gpt_exposed_ms": max(0.0, gpt_step - gpt_local)}),
              flush=True)
    dist.destroy_process_group()


def gpt(rank: int, steps: int):
    """A byte-level GPT under DDP as a researcher writes one (pre-norm
    causal transformer, AdamW, bf16 autocast, gradient clipping), trained
    on this file's own bytes: the median step with gradient sync and
    without (`no_sync`), in ms."""
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.manual_seed(0)
    width, layers, heads, context, batch = 192, 4, 4, 64, 8

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(256, width)
            self.position = torch.nn.Parameter(torch.zeros(context, width))
            layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                     norm_first=True)
            self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = torch.nn.LayerNorm(width)
            self.head = torch.nn.Linear(width, 256, bias=False)

        def forward(self, tokens):
            mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
            x = self.embed(tokens) + self.position[: tokens.shape[1]]
            return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))

    with open(HERE, "rb") as f:
        corpus = torch.tensor(list(f.read()), dtype=torch.long)
    model = torch.nn.parallel.DistributedDataParallel(GPT())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(rank)
    timed = {True: [], False: []}
    for i in range(2 + steps):
        for sync in (True, False):
            starts = torch.randint(0, len(corpus) - context - 1, (batch,), generator=gen)
            x = torch.stack([corpus[s : s + context] for s in starts])
            y = torch.stack([corpus[s + 1 : s + context + 1] for s in starts])
            dist.barrier()
            start = time.perf_counter()
            with contextlib.nullcontext() if sync else model.no_sync():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
                opt.zero_grad(set_to_none=True)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if i >= 2:
                timed[sync].append((time.perf_counter() - start) * 1e3)
    return statistics.median(timed[True]), statistics.median(timed[False])



def run(backend: str, world: int, args) -> dict:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
        cmd = [sys.executable, HERE, "--worker", backend, str(args.max_mib << 20), str(args.iters), str(args.ddp_steps)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"{backend} world {world}: a rank ran past {args.timeout} s")
        outputs.append((p.returncode, out, err))
    for code, out, err in outputs:
        if code != 0:
            raise SystemExit(f"{backend} world {world} failed (exit {code}):\n{out}\n{err[-3000:]}")
    for line in outputs[0][1].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{backend} world {world}: no result:\n{outputs[0][1]}")


def table(backend: str, world: int, rounds: list) -> dict:
    print(f"# {backend}, world {world}, all_reduce in place, medians of {len(rounds)} rounds")
    print(f"# {'size':>10} {'count':>12} {'type':>6} {'redop':>6} {'root':>5} {'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}")
    print(f"# {'(B)':>10} {'(elements)':>12} {'':>6} {'':>6} {'':>5} {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}")
    busbw = {}
    for i, first in enumerate(rounds[0]["sweep"]):
        size = first["bytes"]
        us = statistics.median(r["sweep"][i]["us"] for r in rounds)
        wrong = sum(r["sweep"][i]["wrong"] for r in rounds)
        alg = size / us / 1e3
        bus = alg * 2 * (world - 1) / world
        busbw[size] = bus
        print(f"  {size:>10} {size // 4:>12} {'float':>6} {'sum':>6} {-1:>5} {us:>9.1f} {alg:>7.2f} {bus:>7.2f} {wrong:>6}")
    return busbw


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds per backend (default 3)")
    parser.add_argument("--max-mib", type=int, default=64, help="largest all-reduce in MiB (default 64)")
    parser.add_argument("--iters", type=int, default=20, help="timed all-reduces per size, at most (default 20)")
    parser.add_argument("--ddp-steps", type=int, default=10, help="timed DDP steps per round (default 10)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a round may take (default 600)")
    args = parser.parse_args()
    for world in [int(w) for w in args.worlds.split(",")]:
        results = {"gloo": [], "chorus": []}
        for r in range(args.rounds):
            for backend in ("gloo", "chorus") if r % 2 == 0 else ("chorus", "gloo"):
                print(f"world {world} round {r + 1}/{args.rounds}: {backend}", file=sys.stderr, flush=True)
                results[backend].append(run(backend, world, args))
        bus = {b: table(b, world, results[b]) for b in ("gloo", "chorus")}
        print(f"# world {world}: chorus busbw / gloo busbw")
        for size in bus["gloo"]:
            ratio = bus["chorus"][size] / bus["gloo"][size] if bus["gloo"][size] else float("nan")
            print(f"  {size:>10} B  {ratio:6.2f}x")
        step = {b: statistics.median(r["step_ms"] for r in results[b]) for b in results}
        exposed = {b: statistics.median(r["exposed_ms"] for r in results[b]) for b in results}
        print(f"# world {world}: DDP, 8 x 1 Mi float32 parameters, medians of {args.rounds} rounds x {args.ddp_steps} steps")
        for b in ("gloo", "chorus"):
            print(f"  {b:>6}: step {step[b]:8.2f} ms, exposed sync {exposed[b]:8.2f} ms  (rounds: "
                  + ", ".join(f"{r['exposed_ms']:.1f}" for r in results[b]) + ")")
        if exposed["gloo"]:
            print(f"  chorus / gloo: step {step['chorus'] / step['gloo']:.2f}x, exposed sync {exposed['chorus'] / exposed['gloo']:.2f}x")
        step = {b: statistics.median(r["gpt_step_ms"] for r in results[b]) for b in results}
        exposed = {b: statistics.median(r["gpt_exposed_ms"] for r in results[b]) for b in results}
        print(f"# world {world}: byte-level GPT under DDP (4 layers, width 192, AdamW, bf16 autocast), "
              f"medians of {args.rounds} rounds x {args.ddp_steps} steps")
        for b in ("gloo", "chorus"):
            print(f"  {b:>6}: step {step[b]:8.2f} ms, exposed sync {exposed[b]:8.2f} ms  (rounds: "
                  + ", ".join(f"{r['gpt_exposed_ms']:.1f}" for r in results[b]) + ")")
        print(f"  chorus / gloo: step {step['chorus'] / step['gloo']:.2f}x, exposed sync "
              + (f"{exposed['chorus'] / exposed['gloo']:.2f}x" if exposed["gloo"] else "n/a (gloo's is 0)"))
        print(flush=True)


if __name__ == "__main__":
    main()
