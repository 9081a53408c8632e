"""The GPT example (examples/python/gpt.py) under chorus.torch.Manager, its
twin on torchft 0.2.0's wrappers and its twin under plain torch DDP,
alternated round by round.

    python3 python/bench/gpt_vs_torchft.py [--rounds 3] [--world 4] [--steps 200] [--fault-step 80]
                                           [--replica-group-size N]

The three training loops below differ only where fault tolerance needs
them to (the script prints how many lines each changed from the plain DDP
one). Per round: plain DDP on backend "chorus", fault-free (the step time
the Manager must keep: its sync overlaps the backward pass as DDP's);
the Manager, fault-free; the Manager with the last replica SIGKILLed after
--fault-step and relaunched, forked from `chorus launch`'s fork server
("chorus") or started afresh (`--no-fork-server`, "afresh"), or replaced
by a warm standby ("standby"); torchft with the same kill (4 replica groups of one process,
a lighthouse, ProcessGroupGloo, a relaunch loop: vs_torchft.py's setup).
It prints each run's longest stall (the longest time without a new
committed step), the kill to the replacement's first committed step, the
median step, the final held-out loss against the fault-free run's, and
whether every member's state hashed equal; then medians and ratios.

With --replica-group-size N (HSDP) each replica is a group of N processes
that shard the model with FSDP2: the example's `--replica-group-size N`
against torchft's HSDP twin (FSDP2 over the group's Gloo group, a torchft
Manager per rank, its all-reduce hook across the groups, the whole group
relaunched when one of its processes dies, as torchrun restarts a group),
with N standbys on the standby side (one per rank of the lost group);
plain DDP does not run.
Needs torch, torchft==0.2.0, the chorus package and the `chorus` command.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT / "examples" / "python"), str(HERE.parent)]
import gpt  # noqa: E402  (the example: its corpus, model, harness and Manager loop)
import vs_torchft  # noqa: E402  (the torchft job's setup)
from gpt import Harness, Sequences, build_model, corpus, warmup_cosine  # noqa: E402


def plain_ddp(args: argparse.Namespace) -> None:
    """The training script under plain torch DDP (no fault tolerance)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import chorus.torch  # noqa: F401

    torch.set_num_threads(1)
    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8)
    split = len(data) * 9 // 10
    train_set, held_out = Sequences(data[:split], args.context), data[split:split + 64 * args.context + 1]
    net = build_model(args)

    dist.init_process_group(args.backend)
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sampler = torch.utils.data.DistributedSampler(train_set, seed=args.seed)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args))
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch, sampler=sampler)
    forward = torch.compile(model) if args.compile else model

    harness = Harness(args, int(os.environ["LOCAL_RANK"]), False)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        epoch += 1
        for x, y in loader:
            if step >= args.steps:
                break
            optimizer.zero_grad()
            harness.step_started(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = forward(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            harness.step_ended(step - 1, step)
    harness.finish(net, held_out, steps=step)
    dist.destroy_process_group()


def torchft_twin(args: argparse.Namespace) -> None:
    """The training script on torchft 0.2.0's wrappers: one replica group
    of one process (REPLICA_GROUP_ID and ATTEMPT from vs_torchft's setup)."""
    import torch
    import torch.nn.functional as F
    from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8)
    split = len(data) * 9 // 10
    train_set, held_out = Sequences(data[:split], args.context), data[split:split + 64 * args.context + 1]
    net = build_model(args)

    rid = int(os.environ["REPLICA_GROUP_ID"])
    store = torch.distributed.TCPStore("localhost", int(os.environ["MASTER_PORT"]), is_master=True,
                                       wait_for_workers=False)  # the replica group's store, as torchrun serves it
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args))
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.torchft_timeout)), min_replica_size=1,
        load_state_dict=lambda s: (net.load_state_dict(s["model"]), opt.load_state_dict(s["optim"]),
                                   scheduler.load_state_dict(s["scheduler"])),
        state_dict=lambda: {"model": net.state_dict(), "optim": opt.state_dict(), "scheduler": scheduler.state_dict()},
        replica_id=f"replica_{rid}", timeout=timedelta(seconds=args.torchft_timeout), rank=0, world_size=1)
    model = DistributedDataParallel(manager, net)
    optimizer = Optimizer(manager, opt)
    sampler = DistributedSampler(train_set, replica_rank=rid, num_replica_groups=args.world, group_rank=0,
                                 num_replicas=1, seed=args.seed)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch, sampler=sampler)
    forward = torch.compile(model) if args.compile else model

    harness = Harness(args, rid, os.environ["ATTEMPT"] != "0")
    while manager.current_step() < args.steps:
        for x, y in loader:
            if manager.current_step() >= args.steps:
                break
            optimizer.zero_grad()
            harness.step_started(manager.current_step())
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = forward(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            before = manager.current_step()
            optimizer.step()
            scheduler.step()
            harness.step_ended(before, manager.current_step(), manager)
    harness.finish(net, held_out, steps=manager.current_step())
    manager.shutdown(wait=False)
    del store


def torchft_hsdp_twin(args: argparse.Namespace) -> None:
    """The replica-group script on torchft 0.2.0, as torchft's HSDP is
    written: FSDP2 inside a replica group over the group's own Gloo
    process group, a torchft Manager per rank whose all-reduce hook
    averages each gradient shard across the groups (REPLICA_GROUP_ID,
    GROUP_RANK, MASTER_PORT and ATTEMPT from vs_torchft's setup). Its
    quorum is synchronous: with torchft's default asynchronous quorum a
    healing peer's state dict is read by torchft's quorum thread while
    FSDP2's forward pass has the parameters unsharded, and the job crashed
    ("got mixed torch.Tensor and DTensor")."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torchft import DistributedSampler, Manager, Optimizer
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8)
    split = len(data) * 9 // 10
    train_set, held_out = Sequences(data[:split], args.context), data[split:split + 64 * args.context + 1]
    net = build_model(args)

    rid, rank, size = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["GROUP_RANK"]), args.replica_group_size
    port, timeout = int(os.environ["MASTER_PORT"]), timedelta(seconds=args.torchft_timeout)
    store = dist.TCPStore("localhost", port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("group/", store), rank=rank, world_size=size,
                            timeout=timeout)
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("shard",))
    for block in net.blocks.layers:
        fully_shard(block, mesh=mesh)
    model = fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args))
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1,
        load_state_dict=lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["optim"]),
                                   scheduler.load_state_dict(s["scheduler"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict(), "scheduler": scheduler.state_dict()},
        replica_id=f"replica_{rid}", timeout=timeout, rank=rank, world_size=size, store_addr="localhost",
        store_port=port, use_async_quorum=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(lambda shard: manager.allreduce(shard).wait())
    optimizer = Optimizer(manager, opt)
    sampler = DistributedSampler(train_set, replica_rank=rid, num_replica_groups=args.world // size, group_rank=rank,
                                 num_replicas=size, seed=args.seed)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch, sampler=sampler)

    harness = Harness(args, int(os.environ["LOCAL_RANK"]), os.environ["ATTEMPT"] != "0")
    while manager.current_step() < args.steps:
        for x, y in loader:
            if manager.current_step() >= args.steps:
                break
            optimizer.zero_grad()
            harness.step_started(manager.current_step())
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            before = manager.current_step()
            optimizer.step()
            scheduler.step()
            harness.step_ended(before, manager.current_step(), manager)
    harness.finish(net, held_out, manager, steps=manager.current_step())
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    del store


def lines_changed(plain, other) -> int:
    """Lines added or removed going from `plain`'s body to `other`'s (the
    signature and docstring aside)."""
    a, b = (inspect.getsource(f).split('"""')[2].splitlines() for f in (plain, other))
    return sum(1 for line in difflib.unified_diff(a, b, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---")))


def model_flags(args) -> list:
    return ["--world", str(args.world), "--steps", str(args.steps), "--fault-step", str(args.fault_step),
            "--batch", str(args.batch), "--context", str(args.context), "--width", str(args.width),
            "--layers", str(args.layers), "--lr", str(args.lr), "--warmup", str(args.warmup), "--seed", str(args.seed),
            "--replica-group-size", str(args.replica_group_size)]


def run_plain(args, run: Path) -> dict:
    run.mkdir(parents=True)
    cmd = [gpt.chorus_command(), "launch", "--nproc-per-node", str(args.world), "--master-port",
           str(gpt.free_port()), "--", sys.executable, str(HERE), "--worker", "plain", "--backend", "chorus",
           "--run-dir", str(run), *model_flags(args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"plain DDP run failed:\n{done.stderr[-3000:]}")
    return json.loads((run / "result.json").read_text())


def run_manager(args, fault: str, standby: int, fork_server: bool = True) -> dict:
    cmd = [sys.executable, str(ROOT / "examples" / "python" / "gpt.py"), "--json", "--fault", fault,
           "--standby", str(standby), *model_flags(args), *([] if fork_server else ["--no-fork-server"])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=2 * args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"chorus run failed:\n{done.stdout}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_torchft(args, run: Path) -> dict:
    args.kill_frozen_after = 0.0  # only a kill here
    worker = "torchft" if args.replica_group_size == 1 else "torchft-hsdp"
    out = vs_torchft.run_torchft(args, run, [str(HERE), "--worker", worker, "--fault", "kill",
                                              "--torchft-timeout", str(args.torchft_timeout), *model_flags(args)],
                                 group_size=args.replica_group_size)
    out["state_verified"] = None  # torchft has no such check
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--fault-step", type=int, default=80)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replica-group-size", type=int, default=1,
                   help="processes per replica, FSDP2 inside each (HSDP; default 1: DDP). With more than 1 the "
                        "plain DDP side does not run, the standby side keeps N standbys")
    p.add_argument("--torchft-timeout", type=float, default=10.0,
                   help="torchft's Manager and Gloo timeout in seconds (default 10; its own default is 60)")
    p.add_argument("--sides", help="the sides to run, comma-separated (default: all that apply; steady and "
                                   "torchft always run, the ratios need them)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--worker", choices=["plain", "torchft", "torchft-hsdp"], help=argparse.SUPPRESS)
    p.add_argument("--backend", default="chorus", help=argparse.SUPPRESS)
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--fault", default="none", help=argparse.SUPPRESS)
    p.set_defaults(fault_rank=None)  # the example's Harness: the last worker fails
    args = p.parse_args()
    if args.worker:
        {"plain": plain_ddp, "torchft": torchft_twin, "torchft-hsdp": torchft_hsdp_twin}[args.worker](args)
        return
    changed = {"chorus": lines_changed(plain_ddp, gpt.worker), "torchft": lines_changed(plain_ddp, torchft_twin)}
    base = Path(tempfile.mkdtemp(prefix="chorus-gpt-vs-torchft-"))
    hsdp = args.replica_group_size > 1
    sides = ("steady", "chorus", "afresh", "standby", "torchft")
    if not hsdp:  # replica groups have no plain DDP twin
        sides = ("plain", *sides)
    if args.sides:
        sides = tuple(side for side in sides if side in {"steady", "torchft", *args.sides.split(",")})
    results = {side: [] for side in sides}
    failed = []
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            print(f"round {r + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
            try:
                if side == "plain":
                    out = run_plain(args, base / f"plain{r}")
                elif side == "steady":
                    out = run_manager(args, "none", 0)
                elif side == "torchft":
                    out = run_torchft(args, base / f"torchft{r}")
                elif side == "afresh":
                    out = run_manager(args, "kill", 0, fork_server=False)
                else:
                    # A whole replica group's worth of standbys.
                    out = run_manager(args, "kill", args.replica_group_size if side == "standby" else 0)
            except (Exception, SystemExit) as error:  # one broken run must not lose the others
                failed.append(f"{side} in round {r + 1}: {str(error)[-500:]}")
                print(f"  {side} failed: {str(error)[-500:]}", file=sys.stderr, flush=True)
                continue
            results[side].append(out)
            print(f"  {json.dumps({k: v for k, v in out.items() if not isinstance(v, (list, dict))})}",
                  file=sys.stderr, flush=True)
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    print(f"# GPT ({args.layers} layers, width {args.width}, context {args.context}, batch {args.batch} per replica), "
          f"{args.world // args.replica_group_size} replicas x {args.replica_group_size} process(es)"
          + (" (FSDP2 inside each)" if hsdp else "")
          + f", {args.steps} steps, SIGKILL of rank {args.world - 1} after step {args.fault_step}, "
          f"{args.rounds} alternated rounds"
          + ("" if hsdp else f"; lines changed from the plain DDP loop: chorus {changed['chorus']}, "
                             f"torchft {changed['torchft']}"))
    print(f"# {'':8} {'stall ms':>9} {'replacement ms':>15} {'step ms':>8} {'final loss':>10} {'verified':>8}")
    for side in sides:
        for out in results[side]:
            print(f"  {side:8} {fmt(out.get('longest_stall_ms')):>9} {fmt(out.get('replacement_ms')):>15} "
                  f"{out['median_step_ms']:>8.2f} {out['final_loss']:>10.4f} {str(out.get('state_verified', '-')):>8}")
    med = lambda side, key: statistics.median(o[key] for o in results[side] if o.get(key) is not None)  # noqa: E731
    if results.get("plain"):
        print(f"# steady step: the Manager {med('steady', 'median_step_ms'):.2f} ms against plain DDP on chorus "
              f"{med('plain', 'median_step_ms'):.2f} ms: "
              f"{med('steady', 'median_step_ms') / med('plain', 'median_step_ms'):.3f}x")
    else:
        print(f"# steady step: the Manager {med('steady', 'median_step_ms'):.2f} ms against torchft's "
              f"{med('torchft', 'median_step_ms'):.2f} ms (with its kill): "
              f"{med('steady', 'median_step_ms') / med('torchft', 'median_step_ms'):.3f}x")
    faulted = [side for side in ("chorus", "afresh", "standby") if side in sides]
    for side in faulted:
        print(f"# {side} against torchft: longest stall {med(side, 'longest_stall_ms'):.0f} vs "
              f"{med('torchft', 'longest_stall_ms'):.0f} ms "
              f"({med(side, 'longest_stall_ms') / med('torchft', 'longest_stall_ms'):.3f}x); replacement's first step "
              + (f"{med(side, 'replacement_ms'):.0f} vs {med('torchft', 'replacement_ms'):.0f} ms "
                 f"({med(side, 'replacement_ms') / med('torchft', 'replacement_ms'):.3f}x)"
                 if any(o.get("replacement_ms") for o in results[side])
                 and any(o.get("replacement_ms") for o in results["torchft"]) else "not in every side's runs"))
    steady = med("steady", "final_loss")
    for side in (*faulted, "torchft"):
        loss = med(side, "final_loss")
        print(f"# {side}: final loss {loss:.4f} against the fault-free Manager run's {steady:.4f} "
              f"({abs(loss - steady) / steady * 100:.2f}% apart)")
    for failure in failed:
        print(f"# FAILED, left out of the medians: {failure}")
    print("# state verified in every chorus run: "
          + str(all(o["state_verified"] for side in ("steady", *faulted) for o in results[side])))


if __name__ == "__main__":
    main()
