"""Rank programs for the pytest suite: `python scenarios.py NAME [ARGS]`
under the environment torchrun gives (ranks.py sets it). Each prints one
line `RESULT <json>` for the test to check."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import chorus
import chorus.torch  # noqa: F401  registers the backend

R = dist.ReduceOp
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
OPS = {"sum": R.SUM, "avg": R.AVG, "product": R.PRODUCT, "min": R.MIN, "max": R.MAX,
       "band": R.BAND, "bor": R.BOR, "bxor": R.BXOR}


def result(value) -> None:
    print("RESULT " + json.dumps(value), flush=True)


def data(rank: int, n: int, dtype) -> torch.Tensor:
    """Rank `rank`'s input: small values every dtype holds exactly."""
    values = (torch.arange(n) % 5 + 1) * (rank + 1)
    return values.to(dtype)


def reference(op: str, dtype, n: int) -> torch.Tensor:
    """The reduction of every rank's `data`, computed locally."""
    stacked = torch.stack([data(r, n, torch.float64 if dtype in FLOATS else torch.int64) for r in range(WORLD)])
    if op == "sum":
        out = stacked.sum(0)
    elif op == "avg":
        out = stacked.sum(0) / WORLD if dtype in FLOATS else torch.div(stacked.sum(0), WORLD, rounding_mode="trunc")
    elif op == "product":
        out = stacked.prod(0)
    elif op == "min":
        out = stacked.min(0).values
    elif op == "max":
        out = stacked.max(0).values
    else:
        out = stacked[0].clone()
        for row in stacked[1:]:
            out = {"band": out & row, "bor": out | row, "bxor": out ^ row}[op]
    return out.to(dtype)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype in FLOATS:
        return torch.allclose(got.double(), want.double(), rtol=1e-2, atol=1e-2)
    return torch.equal(got, want)


def collectives() -> None:
    dist.init_process_group("chorus")
    gloo = dist.new_group(backend="gloo")
    failures = []
    checked = 0

    def check(name, got, want):
        nonlocal checked
        checked += 1
        if not same(got, want):
            failures.append(f"{name}: got {got.tolist()[:6]} want {want.tolist()[:6]}")

    n = 37
    for dtype in FLOATS + INTS:
        for op_name, op in OPS.items():
            if op_name in ("band", "bor", "bxor") and dtype in FLOATS:
                continue
            t = data(RANK, n, dtype)
            dist.all_reduce(t, op=op)
            check(f"all_reduce {op_name} {dtype}", t, reference(op_name, dtype, n))
            # Gloo where it has the op and dtype: the same bytes.
            if op_name not in ("avg",) and dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
                g = data(RANK, n, dtype)
                dist.all_reduce(g, op=op, group=gloo)
                check(f"all_reduce {op_name} {dtype} vs gloo", t, g)
        root = WORLD - 1
        b = data(RANK, n, dtype)
        dist.broadcast(b, src=root)
        check(f"broadcast {dtype}", b, data(root, n, dtype))
        r = data(RANK, n, dtype)
        dist.reduce(r, dst=0, op=R.MAX)
        check(f"reduce {dtype}", r, reference("max", dtype, n) if RANK == 0 else data(RANK, n, dtype))
        outs = [torch.zeros(n, dtype=dtype) for _ in range(WORLD)]
        dist.all_gather(outs, data(RANK, n, dtype))
        check(f"all_gather {dtype}", torch.cat(outs), torch.cat([data(i, n, dtype) for i in range(WORLD)]))
        into = torch.zeros(n * WORLD, dtype=dtype)
        dist.all_gather_into_tensor(into, data(RANK, n, dtype))
        check(f"all_gather_into_tensor {dtype}", into, torch.cat([data(i, n, dtype) for i in range(WORLD)]))
        gathered = [torch.zeros(n, dtype=dtype) for _ in range(WORLD)] if RANK == 0 else None
        dist.gather(data(RANK, n, dtype), gathered, dst=0)
        if RANK == 0:
            check(f"gather {dtype}", torch.cat(gathered), torch.cat([data(i, n, dtype) for i in range(WORLD)]))
        s = torch.zeros(n, dtype=dtype)
        dist.scatter(s, [data(i, n, dtype) for i in range(WORLD)] if RANK == 0 else None, src=0)
        check(f"scatter {dtype}", s, data(RANK, n, dtype))
        full = data(RANK, n * WORLD, dtype)
        want = reference("sum", dtype, n * WORLD)[RANK * n : (RANK + 1) * n]
        rs = torch.zeros(n, dtype=dtype)
        dist.reduce_scatter_tensor(rs, full)
        check(f"reduce_scatter_tensor {dtype}", rs, want)
        check(f"reduce_scatter_tensor keeps its input {dtype}", full, data(RANK, n * WORLD, dtype))
        rl = torch.zeros(n, dtype=dtype)
        dist.reduce_scatter(rl, list(full.chunk(WORLD)))
        check(f"reduce_scatter {dtype}", rl, want)
        a2a_in = data(RANK, n * WORLD, dtype) + RANK
        a2a_out = torch.zeros(n * WORLD, dtype=dtype)
        dist.all_to_all_single(a2a_out, a2a_in)
        check(f"all_to_all_single {dtype}", a2a_out,
              torch.cat([(data(i, n * WORLD, dtype) + i)[RANK * n : (RANK + 1) * n] for i in range(WORLD)]))
    # Uneven all-to-all: rank i sends i + j + 1 elements to rank j.
    ins = [torch.full((RANK + j + 1,), float(10 * RANK + j)) for j in range(WORLD)]
    outs = [torch.zeros(i + RANK + 1) for i in range(WORLD)]
    dist.all_to_all(outs, ins)
    check("all_to_all uneven", torch.cat(outs), torch.cat([torch.full((i + RANK + 1,), float(10 * i + RANK)) for i in range(WORLD)]))
    split_in = [RANK + j + 1 for j in range(WORLD)]
    split_out = [i + RANK + 1 for i in range(WORLD)]
    single_out = torch.zeros(sum(split_out))
    dist.all_to_all_single(single_out, torch.cat(ins), split_out, split_in)
    check("all_to_all_single uneven", single_out, torch.cat(outs))
    dist.barrier()
    # Point to point round a ring.
    to, frm = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    got = torch.zeros(5)
    if RANK % 2 == 0:
        dist.send(torch.full((5,), float(RANK)), to)
        dist.recv(got, frm)
    else:
        dist.recv(got, frm)
        dist.send(torch.full((5,), float(RANK)), to)
    check("send/recv", got, torch.full((5,), float(frm)))
    # A subgroup of the first two ranks, on chorus too.
    sub = dist.new_group([0, 1])
    if RANK < 2:
        t = torch.ones(3)
        dist.all_reduce(t, group=sub)
        check("new_group all_reduce", t, torch.full((3,), 2.0))
    dist.destroy_process_group()
    result({"failures": failures, "checked": checked})


def _late_peer_wait(out: dict) -> None:
    """A wait with a timeout returns first when a peer is late: rank 1
    all-reduces 2 s late, rank 0 waits 200 ms, then waits it out."""
    late = torch.ones(4)
    if RANK == 1:
        time.sleep(2)
    work = dist.all_reduce(late, async_op=True)
    if RANK == 0:
        try:
            work.wait(timeout=timedelta(milliseconds=200))
            out["wait_timeout"] = "no error"
        except chorus.WaitTimeout as e:
            out["wait_timeout"] = type(e).__name__
        out["done_after_timeout"] = work.is_completed()
    work.wait()
    out["late_value"] = late[0].item()


def async_work() -> None:
    dist.init_process_group("chorus")
    out = {}
    t = torch.ones(1000)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    chained = fut.then(lambda f: f.value()[0] * 2)
    assert work.wait()
    out["completed"] = work.is_completed()
    out["value"] = t[0].item()
    out["chained"] = chained.wait()[0].item()
    _late_peer_wait(out)
    dist.destroy_process_group()
    result(out)


def ddp(backend: str, steps: str = "5") -> None:
    dist.init_process_group(backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4), torch.nn.Linear(4, 4))
    # The last layer is unused in forward: find_unused_parameters covers it.
    forward = lambda m, x: m.module[2](m.module[1](m.module[0](x)))  # noqa: E731
    ddp_model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + RANK)
    for step in range(int(steps)):
        x = torch.randn(8, 16, generator=gen)
        loss = forward(ddp_model, x).pow(2).mean()
        opt.zero_grad()
        if step == 1:
            with ddp_model.no_sync():
                forward(ddp_model, x).pow(2).mean().backward()
        loss.backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    dist.destroy_process_group()
    result({"params": params.tolist()})


def ddp_failure() -> None:
    """DDP on "chorus"; the last rank dies after a first step, and the
    others step until their backward pass raises: the gradients' future
    carries the error, as chorus's own exception."""
    dist.init_process_group("chorus")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    model(torch.randn(4, 64)).sum().backward()
    dist.barrier()
    if RANK == WORLD - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    out = {"error": "none"}
    try:
        for _ in range(100000):
            model(torch.randn(4, 64)).sum().backward()
    except Exception as e:  # noqa: BLE001 - the type is the result
        out = {"error": type(e).__name__, "ranks": list(getattr(e, "ranks", [])), "message": str(e)[:300]}
    result(out)


def ddp_hooks(hook: str, backend: str = "chorus") -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    dist.init_process_group(backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    if hook == "fp16":
        ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp_model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    else:
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp_model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7 + RANK)
    for _ in range(4):
        opt.zero_grad()
        ddp_model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    dist.destroy_process_group()
    result({"checksum": float(params.double().sum()), "finite": bool(torch.isfinite(params).all())})


def failure(how: str) -> None:
    """Rank WORLD-1 dies (`kill`) or stops (`freeze`) after a first
    all-reduce; the others keep calling all-reduce until it raises."""
    dist.init_process_group("chorus")
    t = torch.ones(8)
    dist.all_reduce(t)
    dist.barrier()
    if RANK == WORLD - 1:
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(60)
    began = time.monotonic()
    try:
        for _ in range(100000):
            dist.all_reduce(t)
        error, ranks, message, is_torch = "none", [], "", False
    except chorus.ChorusError as e:
        error, ranks, message = type(e).__name__, list(e.ranks), str(e)
        is_torch = isinstance(e, dist.DistBackendError)
    elapsed = time.monotonic() - began
    # The next call fails at once too.
    try:
        dist.all_reduce(t)
        after = "none"
    except chorus.GroupAborted:
        after = "GroupAborted"
    result({"error": error, "ranks": ranks, "message": message, "elapsed": elapsed, "next": after,
            "is_dist_backend_error": is_torch, "front": _front()})


def fault_rules() -> None:
    """CHORUS_FAULTS (set by the test) kills a rank mid-job; the others
    keep calling all-reduce until it raises."""
    dist.init_process_group("chorus")
    t = torch.ones(1024)
    try:
        for _ in range(100000):
            dist.all_reduce(t)
        out = {"error": "none"}
    except chorus.ChorusError as e:
        out = {"error": type(e).__name__, "ranks": list(e.ranks), "message": str(e)}
    result(out)


def desync() -> None:
    dist.init_process_group("chorus")
    t = torch.ones(4)
    try:
        if RANK == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=0)
        out = {"error": "none"}
    except chorus.ChorusError as e:
        out = {"error": type(e).__name__, "message": str(e)}
    result(out)


def bad_input() -> None:
    dist.init_process_group("chorus")
    out = {}

    def attempt(name, call):
        try:
            call()
            out[name] = "none"
        except Exception as e:  # noqa: BLE001 - the test checks which
            out[name] = f"{type(e).__name__}: {e}"

    attempt("non_contiguous", lambda: dist.all_reduce(torch.ones(4, 4).t()))
    attempt("meta_device", lambda: dist.all_reduce(torch.ones(4, device="meta")))
    attempt("float_band", lambda: dist.all_reduce(torch.ones(4), op=R.BAND))
    attempt("int16", lambda: dist.all_reduce(torch.ones(4, dtype=torch.int16)))
    attempt("gather_into_wrong_size", lambda: dist.all_gather_into_tensor(torch.zeros(3), torch.ones(2)))
    # Still healthy: the refusals above broke nothing.
    t = torch.ones(4)
    dist.all_reduce(t)
    out["healthy_after"] = t[0].item()
    # Sizes that disagree across ranks: an error on every rank, no hang.
    attempt("mismatched_sizes", lambda: dist.all_reduce(torch.ones(4 + RANK)))
    pg = dist.group.WORLD
    dist.destroy_process_group()
    attempt("after_destroy", lambda: pg.allreduce([torch.ones(2)], dist.AllreduceOptions()).wait())
    result(out)


def point_to_point(backend: str) -> None:
    """Sends and receives as Gloo runs them: receives posted before their
    sends on every rank (tensors larger than a link queues), tags taken out
    of order, receives from any source naming their senders, a receive
    pending across a collective."""
    dist.init_process_group(backend)
    out = {}
    n = 4 << 20
    received, sent = torch.zeros(n), torch.full((n,), float(RANK))
    first = dist.irecv(received, (RANK - 1) % WORLD)
    second = dist.isend(sent, (RANK + 1) % WORLD)
    first.wait()
    second.wait()
    out["ring"] = [received[0].item(), received[-1].item()]
    if RANK == 0:
        # isend: Gloo's blocking send of tag 2 would wait for its receive.
        works = [dist.isend(torch.full((3,), 2.0), 1, tag=2), dist.isend(torch.full((3,), 1.0), 1, tag=1)]
        for work in works:
            work.wait()
    elif RANK == 1:
        one, two = torch.zeros(3), torch.zeros(3)
        dist.recv(one, 0, tag=1)
        dist.recv(two, 0, tag=2)
        out["tags"] = [one[0].item(), two[0].item()]
    if RANK == 0:
        senders = []
        for _ in range(WORLD - 1):
            t = torch.zeros(2)
            senders.append([dist.recv(t), t[0].item()])
        out["any_source"] = sorted(senders)
        work = dist.irecv(torch.zeros(2))
        dist.barrier()
        work.wait()
        out["irecv_any_source"] = [work._source_rank(), work.is_completed()]
    else:
        dist.send(torch.full((2,), float(RANK)), 0)
        dist.barrier()
        if RANK == 1:
            dist.send(torch.ones(2), 0)
    pending = dist.irecv(torch.zeros(1), 0) if RANK == 1 else None
    dist.all_reduce(torch.ones(1))
    if RANK == 0:
        dist.send(torch.ones(1), 1)
    if pending is not None:
        pending.wait()
        out["pending_across_a_collective"] = pending.is_completed()
    dist.destroy_process_group()
    result(out)


def modern_stack(backend: str) -> None:
    """torch's modern stack on `backend`: each feature's result (or its
    error), for the test to compare with Gloo's."""
    dist.init_process_group(backend)
    out = {}
    for name, feature in STACK.items():
        try:
            out[name] = feature()
        except Exception as e:  # noqa: BLE001 - the test shows which failed
            out[name] = f"{type(e).__name__}: {e}"
    dist.destroy_process_group()
    result(out)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))


def _train(model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(RANK)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 16, generator=gen)).pow(2).mean().backward()
        opt.step()


def _checksum(tensors) -> float:
    return round(float(sum(t.double().sum() for t in tensors)), 6)


def _mesh_shape():
    return (2, WORLD // 2) if WORLD % 2 == 0 and WORLD >= 4 else (1, WORLD)


def _compiled_ddp():
    model = _model()
    # aot_eager traces through dynamo's DDP optimizer as inductor does,
    # without compiling C++ (minutes on CI's 2 cores).
    compiled = torch.compile(torch.nn.parallel.DistributedDataParallel(model), backend="aot_eager")
    _train(compiled)
    return _checksum(model.parameters())


def _device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", _mesh_shape(), mesh_dim_names=("dp", "tp"))
    t = torch.ones(2) * (RANK + 1)
    dist.all_reduce(t, group=mesh["tp"].get_group())
    return [mesh["dp"].size(), mesh["tp"].size(), t.tolist(), mesh.get_group("dp").size()]


def _dtensor():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(1)
    d = distribute_tensor(torch.randn(WORLD * 2, 4), mesh, [Shard(0)])
    return round(float((d @ d.T.redistribute(mesh, [Replicate()])).full_tensor().sum()), 4)


def _fsdp2(shape):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model)
    return _checksum(p.full_tensor() for p in model.parameters())


def _tensor_parallel():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model()
    parallelize_module(model, init_device_mesh("cpu", (WORLD,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    torch.manual_seed(5)
    y = model(torch.randn(4, 16))
    y.sum().backward()
    return [round(float(y.detach().sum()), 5), _checksum(p.grad.full_tensor() for p in model.parameters())]


def _batch_p2p():
    send, recv = torch.full((3,), float(RANK)), torch.zeros(3)
    ops = [dist.P2POp(dist.isend, send, (RANK + 1) % WORLD), dist.P2POp(dist.irecv, recv, (RANK - 1) % WORLD)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return recv.tolist()


def _subgroups():
    mine, groups = dist.new_subgroups(group_size=WORLD // 2 if WORLD % 2 == 0 else WORLD)
    t = torch.ones(1)
    dist.all_reduce(t, group=mine)
    split = dist.split_group(split_ranks=[list(range(0, WORLD, 2)), list(range(1, WORLD, 2))])
    u = torch.full((1,), float(RANK))
    dist.all_reduce(u, group=split)
    for group in groups:
        dist.destroy_process_group(group)
    dist.destroy_process_group(split)
    v = torch.ones(1)
    dist.all_reduce(v)  # the default group lives on
    return [t.item(), u.item(), v.item()]


def _objects():
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, {"rank": RANK})
    broadcast = [RANK * 10]
    dist.broadcast_object_list(broadcast, src=0)
    scattered = [None]
    dist.scatter_object_list(scattered, [f"to {r}" for r in range(WORLD)] if RANK == 0 else None, src=0)
    at_root = [None] * WORLD if RANK == 0 else None
    dist.gather_object(RANK, at_root, dst=0)
    return [gathered, broadcast, scattered, at_root]


def _front() -> str:
    """The class of the default group's CPU backend: which implementation
    CHORUS_TORCH_BACKEND picked."""
    return type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__


def cpp_backend() -> None:
    """The operations the C++ front runs itself, on the implementation
    CHORUS_TORCH_BACKEND picks (reported as "front"): all-reduce (dtypes,
    ops, futures, a wait that times out on a late peer), broadcast,
    all_gather_into_tensor (in place too), reduce_scatter_tensor, and an
    operation the front hands to the Python backend."""
    dist.init_process_group("chorus")
    out = {"failures": [], "checked": 0, "front": _front()}
    for dtype in [torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]:
        for op in ["sum", "avg", "min", "max"]:
            if op == "avg" and dtype not in FLOATS:
                continue
            t = data(RANK, 1000, dtype)
            dist.all_reduce(t, op=OPS[op])
            out["checked"] += 1
            if not same(t, reference(op, dtype, 1000)):
                out["failures"].append(f"all_reduce {op} {dtype}")
    t = torch.ones(1000)
    work = dist.all_reduce(t, async_op=True)
    out["chained"] = work.get_future().then(lambda f: f.value()[0][0].item() * 2).wait()
    out["waited"] = work.wait() and t[0].item()
    _late_peer_wait(out)
    b = torch.full((5,), float(RANK))
    dist.broadcast(b, src=1)
    out["broadcast"] = b.tolist()
    # all_gather_into_tensor out of place, and in place as FSDP2 gathers
    # (the input is the output's own block).
    for dtype in [torch.bfloat16, torch.float32, torch.int64]:
        shard = data(RANK, 6, dtype)
        want = torch.cat([data(r, 6, dtype) for r in range(WORLD)])
        gathered = torch.zeros(6 * WORLD, dtype=dtype)
        dist.all_gather_into_tensor(gathered, shard)
        in_place = torch.zeros(6 * WORLD, dtype=dtype)
        in_place[RANK * 6 : (RANK + 1) * 6] = shard
        dist.all_gather_into_tensor(in_place, in_place[RANK * 6 : (RANK + 1) * 6])
        out["checked"] += 2
        for name, got in [("all_gather_into_tensor", gathered), ("all_gather_into_tensor in place", in_place)]:
            if not torch.equal(got, want):
                out["failures"].append(f"{name} {dtype}")
    # reduce_scatter_tensor: this rank's block of the reduction.
    for dtype in [torch.bfloat16, torch.float32, torch.int32]:
        for op in ["sum", "avg", "max"]:
            if op == "avg" and dtype not in FLOATS:
                continue
            block = torch.empty(4, dtype=dtype)
            dist.reduce_scatter_tensor(block, data(RANK, 4 * WORLD, dtype), op=OPS[op])
            out["checked"] += 1
            if not same(block, reference(op, dtype, 4 * WORLD)[RANK * 4 : (RANK + 1) * 4]):
                out["failures"].append(f"reduce_scatter_tensor {op} {dtype}")
    # A list all-gather: the C++ front hands it to the Python backend.
    parts = [torch.zeros(3) for _ in range(WORLD)]
    dist.all_gather(parts, torch.full((3,), float(RANK)))
    out["all_gather"] = [p[0].item() for p in parts]
    dist.destroy_process_group()
    result(out)


def _future():
    t = torch.ones(3)
    work = dist.all_reduce(t, async_op=True)
    return work.get_future().then(lambda f: f.value()[0] * 2).wait().tolist()


def _coalescing():
    tensors = [torch.ones(2) * (i + 1) for i in range(3)]
    with dist._coalescing_manager(async_ops=True) as manager:
        for t in tensors:
            dist.all_reduce(t)
    manager.wait()
    return [t.tolist() for t in tensors]


def _monitored_barrier():
    dist.monitored_barrier(timeout=timedelta(seconds=30))
    return "passed"


STACK = {
    "device_mesh": _device_mesh,
    "dtensor": _dtensor,
    "fsdp2": lambda: _fsdp2((WORLD,)),
    "hsdp": lambda: _fsdp2(_mesh_shape()),
    "tensor_parallel": _tensor_parallel,
    "batch_isend_irecv": _batch_p2p,
    "subgroups": _subgroups,
    "objects": _objects,
    "future": _future,
    "coalescing": _coalescing,
    "monitored_barrier": _monitored_barrier,
    "compiled_ddp": _compiled_ddp,
}


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
