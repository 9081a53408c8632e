"""torch.distributed on backend "chorus" against "gloo", side by side.

    python3 python/bench/torch_backend.py [--worlds 2,4] [--rounds 3] [--max-mib 64]

For each world size it runs, alternating the backends round by round, W
rank processes on this host that (1) sweep dist.all_reduce (float32, sum,
in place) from 8 B to --max-mib and (2) train a model with torch's
DistributedDataParallel, timing each step with gradient sync and without
(`no_sync`): the difference is the sync the step could not hide, and (3)
train a byte-level GPT the same way (AdamW, bf16 autocast), and (4) under
FSDP2 (`fully_shard`: all-gathers and reduce-scatters). It prints,
per world, an nccl-tests table per backend (medians over the rounds) with
chorus's bus bandwidth over Gloo's, the DDP step and exposed-sync
medians with their ratio, and the FSDP2 step medians with theirs. Needs torch and the chorus package
(`pip install ./python`). "chorus" is the package's backend as users get
it: its C++ front where that builds (it is built before the first round).
With --python it runs chorus a third way, as the Python backend alone
("chorus_python", what runs where the front cannot build); with --floor it
trains on a backend that does nothing ("idle"), whose exposed sync is
DDP's own work, the part no backend can remove.
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

    if backend.startswith("chorus"):
        import chorus.torch

        if backend == "chorus_python":
            chorus.torch.register(backend, "python")

    torch.set_num_threads(1)
    ddp_group = None
    if backend == "idle":
        import idle_backend

        # Gloo for the barriers; DDP syncs through a backend that does nothing.
        idle_backend.register()
        dist.init_process_group("gloo")
        ddp_group = dist.new_group(backend=idle_backend.NAME)
    else:
        dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    sweep = []
    sizes = [8 << (2 * k) for k in range(30) if 8 << (2 * k) < max_bytes] + [max_bytes]
    if ddp_group is not None:
        sizes = []
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

    model = torch.nn.parallel.DistributedDataParallel(Layers(), bucket_cap_mb=25, gradient_as_bucket_view=True,
                                                      process_group=ddp_group)
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
    gpt_ms, gpt_local = gpt(rank, ddp_steps, ddp_group)
    # FSDP's gathers must hold the shards: not on the idle backend.
    fsdp_ms = fsdp_gpt(rank, ddp_steps) if ddp_group is None else None
    if rank == 0:
        print("RESULT " + json.dumps({"sweep": sweep, "step_ms": step, "exposed_ms": max(0.0, step - local),
                                      "gpt_step_ms": gpt_ms, "gpt_exposed_ms": max(0.0, gpt_ms - gpt_local),
                                      "fsdp_step_ms": fsdp_ms}),
              flush=True)
    dist.destroy_process_group()


def gpt_model():
    """A byte-level GPT as a researcher writes one (pre-norm causal
    transformer), and a sampler of (input, target) batches from this file's
    own bytes."""
    import torch

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

    def sample(gen):
        starts = torch.randint(0, len(corpus) - context - 1, (batch,), generator=gen)
        return (torch.stack([corpus[s : s + context] for s in starts]),
                torch.stack([corpus[s + 1 : s + context + 1] for s in starts]))

    return GPT(), sample


def gpt_step(model, opt, x, y) -> None:
    """One training step: bf16 autocast, gradient clipping, AdamW."""
    import torch
    import torch.nn.functional as F

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def gpt(rank: int, steps: int, group=None):
    """The GPT under DDP (over `group`, None: the default one): the median
    step with gradient sync and without (`no_sync`), in ms."""
    import contextlib

    import torch
    import torch.distributed as dist

    module, sample = gpt_model()
    model = torch.nn.parallel.DistributedDataParallel(module, process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(rank)
    timed = {True: [], False: []}
    for i in range(2 + steps):
        for sync in (True, False):
            x, y = sample(gen)
            dist.barrier()
            start = time.perf_counter()
            with contextlib.nullcontext() if sync else model.no_sync():
                gpt_step(model, opt, x, y)
            if i >= 2:
                timed[sync].append((time.perf_counter() - start) * 1e3)
    return statistics.median(timed[True]), statistics.median(timed[False])


def fsdp_gpt(rank: int, steps: int) -> float:
    """The GPT under FSDP2 (each block and the root `fully_shard`ed over a
    1-D CPU mesh: all-gathers into one tensor, reduce-scatters): the median
    step, in ms."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, sample = gpt_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(rank)
    timed = []
    for i in range(2 + steps):
        x, y = sample(gen)
        dist.barrier()
        start = time.perf_counter()
        gpt_step(model, opt, x, y)
        if i >= 2:
            timed.append((time.perf_counter() - start) * 1e3)
    return statistics.median(timed)


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
    parser.add_argument("--floor", action="store_true",
                        help="also train on a backend that does nothing (idle_backend.py): the exposed sync no "
                             "backend can remove")
    parser.add_argument("--python", action="store_true",
                        help="also run chorus's Python backend alone, without the C++ front (chorus_python)")
    args = parser.parse_args()
    from chorus import cpp_backend

    if cpp_backend.load() is not None:  # built once, before the ranks load it
        print(f"# chorus runs its C++ front ({cpp_backend.library_path()})", flush=True)
    backends = ["gloo", "chorus"]
    if args.python:
        backends.append("chorus_python")
    if args.floor:
        backends.append("idle")
    swept = [b for b in backends if b != "idle"]
    for world in [int(w) for w in args.worlds.split(",")]:
        results = {b: [] for b in backends}
        for r in range(args.rounds):
            for backend in backends[r % len(backends):] + backends[: r % len(backends)]:
                print(f"world {world} round {r + 1}/{args.rounds}: {backend}", file=sys.stderr, flush=True)
                results[backend].append(run(backend, world, args))
        bus = {b: table(b, world, results[b]) for b in swept}
        for b in swept[1:]:
            print(f"# world {world}: {b} busbw / gloo busbw")
            for size in bus["gloo"]:
                ratio = bus[b][size] / bus["gloo"][size] if bus["gloo"][size] else float("nan")
                print(f"  {size:>10} B  {ratio:6.2f}x")
        training(results, world, args, "", f"DDP, 8 x 1 Mi float32 parameters, medians of {args.rounds} rounds x "
                 f"{args.ddp_steps} steps")
        training(results, world, args, "gpt_", f"byte-level GPT under DDP (4 layers, width 192, AdamW, bf16 autocast), "
                 f"medians of {args.rounds} rounds x {args.ddp_steps} steps")
        fsdp(results, world, args)
        print(flush=True)


def training(results: dict, world: int, args, key: str, title: str) -> None:
    """Prints one model's step and exposed sync per backend, and each
    other backend's ratios to Gloo's."""
    step = {b: statistics.median(r[f"{key}step_ms"] for r in rounds) for b, rounds in results.items()}
    exposed = {b: statistics.median(r[f"{key}exposed_ms"] for r in rounds) for b, rounds in results.items()}
    print(f"# world {world}: {title}")
    for b, rounds in results.items():
        print(f"  {b:>10}: step {step[b]:8.2f} ms, exposed sync {exposed[b]:8.2f} ms  (rounds: "
              + ", ".join(f"{r[f'{key}exposed_ms']:.1f}" for r in rounds) + ")")
    for b in list(results)[1:]:
        label = "idle (no backend cost: DDP's own work)" if b == "idle" else b
        print(f"  {label} / gloo: step {step[b] / step['gloo']:.2f}x, exposed sync "
              + (f"{exposed[b] / exposed['gloo']:.2f}x" if exposed["gloo"] else "n/a (gloo's is 0)"))


def fsdp(results: dict, world: int, args) -> None:
    """Prints the GPT's FSDP2 step per backend and its ratio to Gloo's."""
    step = {b: statistics.median(r["fsdp_step_ms"] for r in rounds) for b, rounds in results.items() if b != "idle"}
    print(f"# world {world}: the GPT under FSDP2 (fully_shard per block, 1-D CPU mesh), step medians of "
          f"{args.rounds} rounds x {args.ddp_steps} steps")
    for b, ms in step.items():
        ratio = "" if b == "gloo" else f"  ({ms / step['gloo']:.2f}x gloo's)"
        print(f"  {b:>13}: step {ms:8.2f} ms{ratio}")


if __name__ == "__main__":
    main()
