"""A byte-level GPT trained fault-tolerantly in its own training loop.

    python3 examples/python/gpt.py [--world 4] [--steps 300] [--fault kill --fault-step 120] [--standby 1]

A small causal transformer learns to predict the next byte of torch's own
sources (torch/nn/modules/*.py of the installed torch: nothing is
downloaded), written as a researcher writes one: AdamW, warm-up + cosine
`LambdaLR`, `clip_grad_norm_`, bf16 autocast, a `DataLoader`, and the
training loop the script's own. chorus keeps it in sync through failures
with the shape torchft's wrappers have:

    manager = ct.Manager(min_replica_size=world - 1)
    model = ct.DistributedDataParallel(manager, GPT())    # gradients averaged while backward runs
    optimizer = ct.Optimizer(manager, AdamW(...))          # zero_grad() starts the step, step() commits it
    sampler = ct.DistributedSampler(data, manager, batch)  # the shard follows the membership

--world workers run under `chorus launch --restart-policy worker`. At
--fault-step one worker (--fault-rank, the last by default) fails:
SIGKILLed (kill), SIGSTOPped in the middle of its step (freeze: the
heartbeats find it; it is killed later so that the launcher replaces it)
or cut off from the others (partition). The
survivors discard that step, re-form and go on as a smaller group; the
launcher relaunches the worker (or promotes one of --standby warm
workers), which joins at a step boundary and receives the model, the
optimizer's whole state, the scheduler, the sampler's position and the RNG
live from the survivors, checked equal by hash right after. The last line
puts the final held-out loss beside a fault-free run of the same steps
(--json: one object, with `final_loss`, `reference_loss`, `recoveries`,
`state_verified`).

With --replica-group-size N the workers form replica groups of N ranks
(fault-tolerant HSDP): FSDP2 shards the model inside each group, each shard
is replicated across the groups, and a failed rank takes its whole group
out until the launcher relaunches it:

    manager = ct.Manager(min_replica_size=groups - 1, replica_group_size=N)
    model = ct.ReplicateShards(manager, fully_shard(GPT(), mesh=manager.device_mesh))

Needs torch, the chorus package (`pip install ./python`) and the `chorus`
command (`cargo build --release -p chorus-cli`; target/release/chorus is
found, or set CHORUS=/path/to/chorus).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import chorus_command, free_port, kill_frozen  # noqa: E402  (the MLP example's launcher helpers)

def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="workers (default 4)")
    p.add_argument("--steps", type=int, default=300, help="committed steps (default 300)")
    p.add_argument("--batch", type=int, default=8, help="sequences per worker per step (default 8)")
    p.add_argument("--context", type=int, default=64, help="bytes per sequence (default 64)")
    p.add_argument("--width", type=int, default=128, help="model width (default 128)")
    p.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default 3e-3)")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps (default 20)")
    p.add_argument("--fault", choices=["none", "kill", "freeze", "partition"], default="kill")
    p.add_argument("--fault-step", type=int, default=120, help="the worker fails at this step (default 120)")
    p.add_argument("--fault-rank", type=int, help="the worker that fails (default: the last)")
    p.add_argument("--standby", type=int, default=0,
                   help="warm standby workers (default 0: relaunch); with replica groups, as many as a group's "
                        "ranks replace a whole group")
    p.add_argument("--no-fork-server", action="store_true",
                   help="start a relaunched worker afresh instead of forking it from chorus launch's fork server")
    p.add_argument("--heartbeat-ms", type=int, default=1000, help="heartbeat window (default 1000)")
    p.add_argument("--replica-group-size", type=int, default=1,
                   help="ranks per replica group (default 1): above 1, each group shards the model with FSDP2 and "
                        "the groups are the fault-tolerant replicas (HSDP)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dashboard", metavar="ADDR",
                   help="serve the training run's live page at ADDR (chorus launch --dashboard; e.g. 127.0.0.1:8265)")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    p.add_argument("--keep-logs", action="store_true", help="keep the run directory and say where")
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.world < 2:
        p.error("--world must be at least 2 (a fault needs survivors)")
    if args.replica_group_size < 1 or args.world % args.replica_group_size or args.world // args.replica_group_size < 2:
        p.error(f"--replica-group-size {args.replica_group_size} must divide --world {args.world} into at least 2 "
                "groups")
    if args.fault_rank is not None and not 0 <= args.fault_rank < args.world:
        p.error(f"--fault-rank {args.fault_rank} is not a rank of --world {args.world}")
    if args.fault != "none" and not 0 < args.fault_step < args.steps:
        p.error(f"--fault-step {args.fault_step} never fires: it must be between 1 and --steps - 1")
    if min(args.batch, args.context, args.width, args.layers, args.steps) < 1 or args.standby < 0:
        p.error("--batch, --context, --width, --layers and --steps must be positive, --standby 0 or more")
    return args


def corpus() -> bytes:
    """torch's own nn modules' sources, in a fixed order."""
    import torch

    files = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "*.py")))
    return b"".join(Path(f).read_bytes() for f in files)


class Sequences:
    """Non-overlapping windows of the corpus: (input bytes, next bytes)."""

    def __init__(self, data, context: int) -> None:
        self.data, self.context = data, context

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.context

    def __getitem__(self, i: int):
        window = self.data[i * self.context : (i + 1) * self.context + 1].long()
        return window[:-1], window[1:]


def build_model(args: argparse.Namespace):
    import torch

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(256, args.width)
            self.position = torch.nn.Parameter(torch.zeros(args.context, args.width))
            layer = torch.nn.TransformerEncoderLayer(args.width, 4, 4 * args.width, dropout=0.0, batch_first=True,
                                                     norm_first=True)
            self.blocks = torch.nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
            self.norm = torch.nn.LayerNorm(args.width)
            self.head = torch.nn.Linear(args.width, 256, bias=False)
            self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(args.context))

        def forward(self, tokens):
            n = tokens.shape[1]
            x = self.embed(tokens) + self.position[:n]
            return self.head(self.norm(self.blocks(x, mask=self.mask[:n, :n], is_causal=True)))

    torch.manual_seed(args.seed)
    return GPT()


def evaluate(net, held_out, context: int) -> float:
    import torch
    import torch.nn.functional as F

    windows = Sequences(held_out, context)
    x = torch.stack([windows[i][0] for i in range(len(windows))])
    y = torch.stack([windows[i][1] for i in range(len(windows))])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = net(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item()


class Harness:
    """What the example adds around its training loop, apart from it: the
    fault injected into the last worker, each committed step's time, and
    the result. Worker `slot`; `relaunched`: a replacement (it injects
    nothing)."""

    def __init__(self, args: argparse.Namespace, slot: int, relaunched: bool) -> None:
        self.args, self.run, self.relaunched = args, Path(args.run_dir), relaunched
        victim = args.world - 1 if args.fault_rank is None else args.fault_rank
        self.slot, self.victim = slot, not relaunched and slot == victim and args.fault != "none"
        self.commits = []
        attempt = os.environ.get("ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.record = open(self.run / f"commits.{slot}.{attempt}", "a")
        self.started = time.monotonic()

    def step_started(self, step: int) -> None:
        if self.victim and self.args.fault == "freeze" and step == self.args.fault_step:
            # Mid-step, as a hung rank: the others wait for it in the sync.
            (self.run / "killed_at").write_text(str(time.time()))
            (self.run / "frozen").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)

    def step_ended(self, before: int, after: int, manager=None) -> None:
        if after == before:
            return  # not committed
        self.commits.append(time.time())
        self.record.write(f"{before} {self.commits[-1]}\n")
        self.record.flush()
        if self.relaunched and len(self.commits) == 1:
            (self.run / "rejoined_at").write_text(str(self.commits[0]))
        if self.victim and after == self.args.fault_step and self.args.fault in ("kill", "partition"):
            (self.run / "killed_at").write_text(str(time.time()))
            if self.args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            manager.cut_off()

    def finish(self, net, held_out, manager=None, **more) -> None:
        """Writes the result from one worker: the first rank of the
        manager's last generation (the first worker's without one)."""
        if manager is None:
            reporter = not self.relaunched and self.slot == 0
        else:
            reporter = manager.participating_rank() == 0 and self.slot % self.args.replica_group_size == 0
        # A sharded model's forward pass takes its whole group.
        if reporter or self.args.replica_group_size > 1:
            final_loss = evaluate(net, held_out, self.args.context)
        if reporter:
            gaps = sorted(b - a for a, b in zip(self.commits, self.commits[1:]))
            (self.run / "result.json").write_text(json.dumps({
                "final_loss": final_loss,
                "train_seconds": time.monotonic() - self.started,
                "longest_stall_ms": gaps[-1] * 1e3 if gaps else 0.0,
                "median_step_ms": gaps[len(gaps) // 2] * 1e3 if gaps else 0.0, **more,
            }))


def warmup_cosine(args: argparse.Namespace):
    """The learning rate's factor at each step: linear warm-up, then cosine down to 0.1."""

    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def replica_groups(args: argparse.Namespace) -> dict:
    """The Manager's replica-group argument, when the workers form groups."""
    return {"replica_group_size": args.replica_group_size} if args.replica_group_size > 1 else {}


def sharded(manager, net):
    """`net` sharded inside the replica group with FSDP2 (each block, then
    the rest), its gradient shards averaged across the groups."""
    import chorus.torch as ct
    from torch.distributed.fsdp import fully_shard

    for block in net.blocks.layers:
        fully_shard(block, mesh=manager.device_mesh)
    return ct.ReplicateShards(manager, fully_shard(net, mesh=manager.device_mesh))


def worker(args: argparse.Namespace) -> None:
    """The training script (under chorus launch --restart-policy worker)."""
    import torch
    import torch.nn.functional as F

    import chorus.torch as ct

    torch.set_num_threads(1)
    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8)
    split = len(data) * 9 // 10
    train_set, held_out = Sequences(data[:split], args.context), data[split:split + 64 * args.context + 1]
    net = build_model(args)

    manager = ct.Manager(min_replica_size=args.world // args.replica_group_size - 1,
                         heartbeat_timeout=args.heartbeat_ms / 1e3, timeout=120, **replica_groups(args))
    model = sharded(manager, net) if args.replica_group_size > 1 else ct.DistributedDataParallel(manager, net)
    optimizer = ct.Optimizer(manager, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1))
    sampler = ct.DistributedSampler(train_set, manager, args.batch, seed=args.seed)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args))
    manager.register_state("scheduler", scheduler)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch, sampler=sampler)
    forward = torch.compile(model) if args.compile else model

    relaunched = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or bool(os.environ.get("CHORUS_STANDBY"))
    harness = Harness(args, int(os.environ["LOCAL_RANK"]), relaunched)
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
            manager.report_loss(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            before = manager.current_step()
            optimizer.step()
            scheduler.step()
            harness.step_ended(before, manager.current_step(), manager)
    manager.verify()
    report = manager.report()
    harness.finish(net, held_out, manager, steps=report["steps"], recoveries=report["recoveries"], joins=report["joins"],
                   state_verified=all(j["verified"] for j in report["joins"]))
    manager.shutdown()


def launch(args: argparse.Namespace, fault: str, run: Path) -> dict:
    run.mkdir(parents=True, exist_ok=True)
    # A failed rank takes its replica group out: each of its ranks is relaunched.
    restarts = 3 * args.replica_group_size
    cmd = [chorus_command(), "launch", "--nproc-per-node", str(args.world), "--restart-policy", "worker",
           "--max-restarts", str(restarts), "--standby", str(args.standby), "--master-port", str(free_port()),
           "--log-dir", str(run / "logs"), "--",
           sys.executable, os.path.abspath(__file__), "--run-dir", str(run), "--fault", fault]
    for flag in ("world", "steps", "batch", "context", "width", "layers", "lr", "warmup", "fault_step",
                 "heartbeat_ms", "seed", "replica_group_size"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.fault_rank is not None:
        cmd += ["--fault-rank", str(args.fault_rank)]
    if args.compile:
        cmd.append("--compile")
    if args.no_fork_server:
        cmd[2:2] = ["--no-fork-server"]
    if args.dashboard and fault == args.fault:
        cmd[2:2] = ["--dashboard", args.dashboard]
    stop = threading.Event()
    threading.Thread(target=kill_frozen, args=(run / "frozen", 2 * args.heartbeat_ms / 1e3, stop), daemon=True).start()
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    stop.set()
    (run / "launcher.log").write_text(done.stderr)
    result = run / "result.json"
    if done.returncode != 0 or not result.exists():
        raise SystemExit(f"the {fault} run failed (exit {done.returncode}); logs under {run / 'logs'}\n"
                         f"{done.stderr[-3000:]}")
    outcome = json.loads(result.read_text())
    outcome["promotions"] = done.stderr.count("promoted standby worker")
    killed, rejoined = run / "killed_at", run / "rejoined_at"
    if killed.exists():
        at = float(killed.read_text())
        for r in outcome["recoveries"]:
            r["since_fault_ms"] = (r["first_step_at"] - at) * 1e3
        if rejoined.exists():
            outcome["replacement_ms"] = (float(rejoined.read_text()) - at) * 1e3
    return outcome


def main() -> None:
    args = parse()
    if args.run_dir:
        worker(args)
        return
    base = Path(tempfile.mkdtemp(prefix="chorus-gpt-"))
    run = launch(args, args.fault, base / "run")
    reference = launch(args, "none", base / "reference")["final_loss"] if args.fault != "none" else run["final_loss"]
    for r in run["recoveries"]:
        print(f"recovery into generation {r['generation']} ({r['world_size']} workers) at step {r['resumed_step']}: "
              f"rendezvous {r['rendezvous_ms']:.0f} ms, transfer {r['transfer_ms']:.0f} ms "
              f"({r['bytes'] / 1e6:.1f} MB), first step {r['first_step_ms']:.0f} ms"
              + (f"; {r['since_fault_ms']:.0f} ms after the {args.fault}" if "since_fault_ms" in r else ""))
    if "replacement_ms" in run:
        who = "a promoted standby worker" if args.standby else "the relaunched worker"
        print(f"{who} committed its first step {run['replacement_ms']:.0f} ms after the {args.fault}")
    within = abs(run["final_loss"] - reference) / reference
    print(f"{run['steps']} steps on {args.world} workers, fault {args.fault}"
          + (f" at step {args.fault_step}" if args.fault != "none" else "")
          + f": held-out loss {run['final_loss']:.4f}, fault-free {reference:.4f} ({within * 100:.2f}% apart), "
          f"{run['steps'] / run['train_seconds']:.1f} steps/s, state verified: {run['state_verified']}")
    if args.json:
        print(json.dumps({
            "final_loss": run["final_loss"], "reference_loss": reference, "within": within,
            "steps": run["steps"], "recoveries": run["recoveries"], "joins": run["joins"],
            "state_verified": run["state_verified"], "fault": args.fault,
            "fault_step": args.fault_step if args.fault != "none" else None,
            "longest_stall_ms": run["longest_stall_ms"], "median_step_ms": run["median_step_ms"],
            "replacement_ms": run.get("replacement_ms"), "standby_promotions": run["promotions"],
            "steps_per_s": run["steps"] / run["train_seconds"],
        }))
    if args.keep_logs:
        print(f"run directory kept: {base}", file=sys.stderr)
    else:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
