#!/usr/bin/env python3
"""The Gloo side of `chorus bench --compare gloo`: one rank of torch.distributed
with the Gloo backend, measuring the same collective as chorus.

Started once per rank with env:// variables (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE), like torchrun does. After joining, it prints one JSON line
{"ready": true, ...}; then it reads commands on stdin, one per line:

  run COUNT   measure the collective with nccl-tests' COUNT (elements per
              rank, or per block for all_gather, reduce_scatter, all_to_all)
              and print one JSON line: {"rank", "count", "oop": [us...],
              "ip": [us...]} (one time per iteration), or {"rank", "count",
              "error"} when Gloo cannot run it;
  quit        leave the group and exit.

Out-of-place means the input survives the call: a copy into a reused buffer
first (buf.copy_(x)) for the collectives torch only has in place (all_reduce,
broadcast, reduce), a separate output tensor for the others. In-place means torch's in-place form
(for all_gather and reduce_scatter the input is a view of the output, as in
nccl-tests). The parent alternates these steps with chorus's, per size.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

DTYPES = {
    "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32,
    "int64": torch.int64, "half": torch.float16, "float16": torch.float16,
    "float": torch.float32, "float32": torch.float32, "double": torch.float64,
    "float64": torch.float64, "bfloat16": torch.bfloat16,
}
REDOPS = {
    "sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG, "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
}


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", required=True)
    parser.add_argument("--dtype", default="float")
    parser.add_argument("--redop", default="sum")
    parser.add_argument("--root", type=int, default=0)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if args.dtype not in DTYPES:
        emit({"error": f"dtype {args.dtype} has no torch equivalent here"})
        return 1
    dtype, redop = DTYPES[args.dtype], REDOPS[args.redop]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    emit({"ready": True, "rank": rank, "torch": torch.__version__})

    def prepare(count):
        """Returns run(inplace) for one call of the collective."""
        op = args.op
        per_rank = count * world if op in ("reduce_scatter", "all_to_all") else count
        x = torch.ones(per_rank, dtype=dtype)
        if op in ("all_reduce", "broadcast", "reduce"):
            buf = x.clone()

            def call(t):
                if op == "all_reduce":
                    dist.all_reduce(t, op=redop)
                elif op == "broadcast":
                    dist.broadcast(t, src=args.root)
                else:
                    dist.reduce(t, dst=args.root, op=redop)

            def run(inplace):
                if not inplace:
                    buf.copy_(x)
                call(buf)

            return run
        if op == "all_gather":
            out = torch.empty(count * world, dtype=dtype)
            mine = out[rank * count:(rank + 1) * count]
            return lambda inplace: dist.all_gather_into_tensor(out, mine if inplace else x)
        if op == "reduce_scatter":
            out = torch.empty(count, dtype=dtype)
            buf = x.clone()
            mine = buf[rank * count:(rank + 1) * count]
            return lambda inplace: dist.reduce_scatter_tensor(mine if inplace else out, buf if inplace else x, op=redop)
        if op == "all_to_all":
            out = torch.empty(count * world, dtype=dtype)
            return lambda inplace: dist.all_to_all_single(out, x)
        if op == "send_recv":
            if world < 2:
                raise RuntimeError("send_recv needs at least 2 ranks")
            out = torch.empty(count, dtype=dtype)
            to, frm = (rank + 1) % world, (rank - 1 + world) % world

            def sendrecv(inplace):
                reqs = [dist.isend(x, to), dist.irecv(out, src=frm)]
                for req in reqs:
                    req.wait()

            return sendrecv
        raise RuntimeError(f"unknown op {op}")

    for line in iter(sys.stdin.readline, ""):
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        count = int(words[1])
        try:
            run = prepare(count)
            times = {}
            for half, inplace in (("oop", False), ("ip", True)):
                for _ in range(args.warmup):
                    run(inplace)
                samples = []
                for _ in range(args.iters):
                    started = time.perf_counter()
                    run(inplace)
                    samples.append((time.perf_counter() - started) * 1e6)
                times[half] = samples
            emit({"rank": rank, "count": count, "oop": times["oop"], "ip": times["ip"]})
        except Exception as e:  # an op or dtype Gloo lacks
            emit({"rank": rank, "count": count, "error": f"{type(e).__name__}: {e}".splitlines()[0]})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
