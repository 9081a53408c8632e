"""chorus.torch.ElasticTrainer against torchft 0.2.0 on the same job, alternated.

    python3 python/bench/vs_torchft.py [--rounds 3] [--steps 400] [--fault-step 150] [--world 4] [--fault kill|freeze]

The job: examples/python/train.py's 3-layer MLP on its synthetic 10-class
data, SGD with momentum, a global batch of 128 split over --world replicas
of one process each, --compute-ms of extra compute per step on both sides
(a sleep standing for a larger model); the last replica is SIGKILLed after
--fault-step and relaunched at once (--fault kill), or SIGSTOPped in the
middle of the next step, once that step's quorum (torchft) or generation
(chorus) holds it, and SIGKILLed --kill-frozen-after seconds later, as an
operator would, then relaunched (--fault freeze: the survivors' stall is
then each side's own detection of a peer that answers nothing). chorus:
the example under `chorus launch --restart-policy worker` (survivors go on
as a smaller group; heartbeat 1 s), once relaunching the killed worker
("chorus") and once promoting a warm standby worker in its place
(`--standby 1`, "standby"). torchft: its Manager, DistributedDataParallel
and OptimizerWrapper over ProcessGroupGloo, one replica group per process,
a lighthouse this script starts (`--min_replicas 1 --join_timeout_ms 100
--quorum_tick_ms 100`, its default 5 s heartbeat timeout),
`min_replica_size=1`, the Manager's and Gloo's timeout --torchft-timeout
(10 s; torchft's default is 60 s), torch's huge pages on
(`THP_MEM_ALLOC_ENABLE=1`, as `chorus launch` sets for an elastic job's
workers), and a loop here that relaunches a replica that died. Per run it
reports the job's longest stall (the longest time without a new committed
step, over every replica and restart), the fault to the replacement's
first committed step (when it joined before the end), the transfer into
it, the median step time, the final held-out loss, and the steps committed
again and survivors restarted (a survivor that crashes loses its
progress); then medians over the rounds and the ratios. Needs torch,
torchft==0.2.0, the chorus package and the `chorus` command.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from chorus import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "python" / "train.py"


def example():
    spec = importlib.util.spec_from_file_location("chorus_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module



def torchft_replica(args) -> None:
    """One torchft replica group of one process."""
    from datetime import timedelta

    import torch
    from torchft.ddp import DistributedDataParallel
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    ex = example()
    run = Path(args.run_dir)
    rid, attempt = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["ATTEMPT"])
    x, y = ex.dataset(args.seed, ex.TRAIN_SAMPLES, 0)
    net = ex.model(args.hidden, args.seed)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    padding = ex.Padding(args.state_mib)
    # The replica group's own store, as torchrun would serve it (torchft's
    # Manager connects to it as a client).
    store = torch.distributed.TCPStore("localhost", int(os.environ["MASTER_PORT"]), is_master=True,
                                       wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.torchft_timeout)), min_replica_size=1,
        load_state_dict=lambda s: (net.load_state_dict(s["model"]), opt.load_state_dict(s["optim"]),
                                   padding.load_state_dict(s["extra"])),
        state_dict=lambda: {"model": net.state_dict(), "optim": opt.state_dict(), "extra": padding.state_dict()},
        replica_id=f"replica_{rid}", timeout=timedelta(seconds=args.torchft_timeout), rank=0, world_size=1,
    )
    if attempt > 0:
        # The replacement's state transfer: torchft's HTTP fetch of the
        # survivors' state dict (its deserialization included, as chorus's
        # figure includes the checksums).
        transport = manager._checkpoint_transport
        receive = transport.recv_checkpoint

        def timed(*a, **kw):
            started = time.monotonic()
            state = receive(*a, **kw)
            (run / "transfer_ms").write_text(str((time.monotonic() - started) * 1e3))
            return state

        transport.recv_checkpoint = timed
    model = DistributedDataParallel(manager, net)
    optimizer = OptimizerWrapper(manager, opt)
    victim = rid == args.world - 1 and attempt == 0
    commits = []
    # Every replica's commits, flushed as they come: a replica that crashes
    # still leaves its record.
    record = open(run / f"commits.{rid}.{attempt}", "w")
    while manager.current_step() < args.steps:
        step = manager.current_step()
        optimizer.zero_grad()
        gen = torch.Generator().manual_seed(args.seed * 7919 + step)
        batch = torch.randint(0, ex.TRAIN_SAMPLES, (args.batch,), generator=gen)
        mine = batch[args.batch * rid // args.world : args.batch * (rid + 1) // args.world]
        loss = torch.nn.functional.cross_entropy(model(x[mine]), y[mine])
        if victim and args.fault == "freeze" and step >= args.fault_step:
            # Mid-step, once the step's quorum holds it, as on chorus's
            # side: the others' gradient all-reduce waits for it.
            manager.wait_quorum()
            victim = False
            (run / "killed_at").write_text(str(time.time()))
            (run / "frozen").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        loss.backward()
        if args.compute_ms:
            time.sleep(args.compute_ms / 1e3)
        if optimizer.step() is not False and manager.current_step() > step:
            padding.advance(step)
            commits.append(time.time())
            record.write(f"{step} {commits[-1]}\n")
            record.flush()
            if attempt > 0 and len(commits) == 1:
                (run / "rejoined_at").write_text(str(commits[0]))
            # At or past the step: a replica that healed at start may skip it.
            if victim and args.fault == "kill" and manager.current_step() >= args.fault_step:
                (run / "killed_at").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
    if rid == 0:
        ex_x, ex_y = ex.dataset(args.seed, ex.EVAL_SAMPLES, 2)
        with torch.no_grad():
            final = torch.nn.functional.cross_entropy(net(ex_x), ex_y).item()
        gaps = sorted(b - a for a, b in zip(commits, commits[1:]))
        (run / "result.json").write_text(json.dumps({
            "final_loss": final, "longest_stall_ms": gaps[-1] * 1e3, "median_step_ms": gaps[len(gaps) // 2] * 1e3,
        }))
    manager.shutdown(wait=False)
    del store


def run_torchft(args, run: Path, replica: Optional[List[str]] = None, group_size: int = 1) -> dict:
    """Runs a torchft job: a lighthouse and --world processes in replica
    groups of `group_size`, each `replica` (default this file's MLP
    replica) with `--run-dir`; a group whose process died is relaunched
    whole, as torchrun restarts a replica group. Each process gets
    REPLICA_GROUP_ID, GROUP_RANK, LOCAL_RANK (its slot in the job),
    ATTEMPT and its group's MASTER_PORT. The replicas record their commits
    in `commits.<slot>.<attempt>`, the fault in `killed_at`, the
    replacement's first commit in `rejoined_at`, and one of them the result."""
    if replica is None:
        replica = [__file__, "--torchft-replica", "--torchft-timeout", str(args.torchft_timeout), *common_flags(args)]
    run.mkdir(parents=True)
    lport = free_port()
    lighthouse = subprocess.Popen(
        ["torchft_lighthouse", "--min_replicas", "1", "--join_timeout_ms", "100", "--quorum_tick_ms", "100",
         "--bind", f"[::]:{lport}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs, attempts = {}, {}

    def start(group: int) -> None:
        attempts[group] = attempts.get(group, -1) + 1
        # torch's huge pages as `chorus launch` gives an elastic job's workers.
        env = dict(os.environ, OMP_NUM_THREADS="1", THP_MEM_ALLOC_ENABLE=os.environ.get("THP_MEM_ALLOC_ENABLE", "1"),
                   MASTER_ADDR="localhost", MASTER_PORT=str(free_port()), REPLICA_GROUP_ID=str(group),
                   ATTEMPT=str(attempts[group]), TORCHFT_LIGHTHOUSE=f"http://localhost:{lport}")
        for rank in range(group_size):
            slot = group * group_size + rank
            log = open(run / f"replica{slot}.{attempts[group]}.log", "w")
            procs[slot] = subprocess.Popen([sys.executable, *replica, "--run-dir", str(run)],
                                           env=dict(env, GROUP_RANK=str(rank), LOCAL_RANK=str(slot)),
                                           stdout=log, stderr=log)

    try:
        for group in range(args.world // group_size):
            start(group)
        deadline = time.monotonic() + args.timeout
        frozen = run / "frozen"
        while procs and time.monotonic() < deadline:
            if frozen.exists() and time.time() - frozen.stat().st_mtime >= args.kill_frozen_after:
                os.kill(int(frozen.read_text()), signal.SIGKILL)
                frozen.unlink()
            for slot, proc in list(procs.items()):
                code = proc.poll()
                if code is None or slot not in procs:
                    continue
                del procs[slot]
                if code == 0:
                    continue
                group = slot // group_size
                for mate in range(group * group_size, (group + 1) * group_size):
                    if mate in procs:
                        procs.pop(mate).kill()
                # A replica started after the others finished would train
                # the whole job alone.
                if attempts[group] < 3 and not (run / "result.json").exists():
                    start(group)
            time.sleep(0.05)
        if procs:
            raise SystemExit(f"torchft run ran past {args.timeout} s; logs in {run}")
    finally:
        for proc in procs.values():
            proc.kill()
        lighthouse.kill()
    outcome = json.loads((run / "result.json").read_text())
    # The job's longest time without a new committed step, over every
    # replica and attempt (a survivor that crashed and restarted counts),
    # and the steps that restarted survivors committed again (progress
    # they lost; not a replica out of one quorum catching up).
    victim = getattr(args, "fault_rank", None)
    victim_group = (args.world - 1 if victim is None else victim) // group_size
    events = []
    for f in run.glob("commits.*"):
        _, slot, attempt = f.name.split(".")
        survivor_restart = int(attempt) > 0 and int(slot) // group_size != victim_group
        events += [(float(t), int(s), survivor_restart)
                   for s, t in (line.split() for line in f.read_text().splitlines())]
    events.sort()
    newest, since, stall, redone = -1, events[0][0], 0.0, set()
    for t, s, survivor_restart in events:
        if s > newest:
            newest, stall, since = s, max(stall, t - since), t
        elif s < newest and survivor_restart:
            redone.add(s)
    outcome["longest_stall_ms"] = stall * 1e3
    outcome["redone"] = len(redone)
    outcome["survivor_restarts"] = sum(n for group, n in attempts.items() if group != victim_group)
    at = float((run / "killed_at").read_text())
    rejoined = run / "rejoined_at"
    outcome["replacement_ms"] = (float(rejoined.read_text()) - at) * 1e3 if rejoined.exists() else None
    transfer = run / "transfer_ms"
    outcome["transfer_ms"] = float(transfer.read_text()) if transfer.exists() else None
    return outcome


def run_chorus(args, run: Path, standby: int) -> dict:
    done = subprocess.run([sys.executable, str(EXAMPLE), "--json", "--heartbeat-ms", "1000",
                           "--kill-frozen-after-ms", str(int(args.kill_frozen_after * 1e3)),
                           "--standby", str(standby), *common_flags(args)],
                          capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"chorus run failed:\n{done.stdout}\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    # The transfer into the replacement: the recovery that moved state.
    moved = [r["transfer_ms"] for r in summary["recoveries"] if r["bytes"] > 0]
    # No member of a chorus job starts over: its survivors' record is the job's.
    return {"final_loss": summary["final_loss"], "longest_stall_ms": summary["longest_stall_ms"], "redone": 0,
            "survivor_restarts": 0,
            "median_step_ms": summary["median_step_ms"], "replacement_ms": summary["replacement_ms"],
            "transfer_ms": moved[-1] if moved else None}


def common_flags(args) -> list:
    return ["--fault", args.fault, "--world", str(args.world), "--steps", str(args.steps), "--fault-step", str(args.fault_step),
            "--batch", str(args.batch), "--hidden", str(args.hidden), "--lr", str(args.lr), "--seed", str(args.seed),
            "--compute-ms", str(args.compute_ms), "--state-mib", str(args.state_mib)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--fault-step", type=int, default=150)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--compute-ms", type=float, default=20.0,
                   help="compute per step added on both sides, as a larger model would need (default 20), so "
                        "that a relaunched worker can join before the job ends")
    p.add_argument("--state-mib", type=int, default=0,
                   help="extra state each side sends to the replacement with the model, in MiB (default 0)")
    p.add_argument("--fault", choices=["kill", "freeze"], default="kill")
    p.add_argument("--kill-frozen-after", type=float, default=15.0,
                   help="--fault freeze: seconds from the freeze to the operator's SIGKILL of the frozen replica "
                        "(default 15, past both sides' own detection)")
    p.add_argument("--torchft-timeout", type=float, default=10.0,
                   help="torchft's Manager and Gloo timeout in seconds (default 10; torchft's own default is 60)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--torchft-replica", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.torchft_replica:
        torchft_replica(args)
        return
    base = Path(tempfile.mkdtemp(prefix="chorus-vs-torchft-"))
    sides = ("torchft", "chorus", "standby")
    results = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            print(f"round {r + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
            run = base / f"{side}{r}"
            if side == "torchft":
                results[side].append(run_torchft(args, run))
            else:
                results[side].append(run_chorus(args, run, standby=1 if side == "standby" else 0))
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    fault = ("SIGKILL" if args.fault == "kill"
             else f"SIGSTOP (SIGKILL {args.kill_frozen_after:g} s later)")
    print(f"# {args.world} replicas x 1 process, {args.steps} steps, {fault} after step {args.fault_step}, "
          f"{args.state_mib} MiB of extra state, {args.rounds} alternated rounds; chorus heartbeat 1 s, "
          f"torchft timeout {args.torchft_timeout:g} s, lighthouse heartbeat 5 s, min_replica_size 1")
    # stall: the job's longest time without a new committed step; redone:
    # steps committed again after survivors restarted and lost them.
    print(f"# {'':8} {'stall ms':>10} {'replacement ms':>15} {'transfer ms':>12} {'step ms':>8} {'final loss':>10} "
          f"{'redone':>6} {'survivor restarts':>17}")
    for side in sides:
        for out in results[side]:
            print(f"  {side:8} {fmt(out['longest_stall_ms']):>10} {fmt(out['replacement_ms']):>15} "
                  f"{fmt(out['transfer_ms']):>12} {out['median_step_ms']:>8.2f} {out['final_loss']:>10.4f} "
                  f"{out['redone']:>6} {out['survivor_restarts']:>17}")
    med = {side: {k: statistics.median(o[k] for o in results[side]) for k in ("longest_stall_ms", "median_step_ms", "final_loss")}
           for side in results}
    ft = med["torchft"]
    for side in ("chorus", "standby"):
        m = med[side]
        print(f"# medians, {side} against torchft: the job's longest stall {m['longest_stall_ms']:.0f} ms vs "
              f"{ft['longest_stall_ms']:.0f} ms ({m['longest_stall_ms'] / ft['longest_stall_ms']:.3f}x); "
              f"step {m['median_step_ms']:.2f} ms vs {ft['median_step_ms']:.2f} ms "
              f"({m['median_step_ms'] / ft['median_step_ms']:.2f}x); "
              f"final loss {m['final_loss']:.4f} vs {ft['final_loss']:.4f}")
    joined = {}
    for side in sides:
        times = [o["replacement_ms"] for o in results[side] if o["replacement_ms"] is not None]
        joined[side] = statistics.median(times) if times else None
        print(f"# {side}: the replacement's first committed step after the kill: "
              + (f"median {joined[side]:.0f} ms over {len(times)} run(s)" if times
                 else "never (the job finished first)"))
    if joined["torchft"]:
        for side in ("chorus", "standby"):
            if joined[side]:
                print(f"# {side} / torchft, kill to the replacement's first step: {joined[side] / joined['torchft']:.3f}x")
    moved = {side: [o["transfer_ms"] for o in results[side] if o["transfer_ms"] is not None] for side in sides}
    if args.state_mib and moved["torchft"]:
        ft_ms = statistics.median(moved["torchft"])
        for side in ("chorus", "standby"):
            if moved[side]:
                ms = statistics.median(moved[side])
                print(f"# state transfer into the replacement, {side} against torchft: median {ms:.0f} ms vs "
                      f"{ft_ms:.0f} ms: {ft_ms / ms:.2f}x torchft's throughput")


if __name__ == "__main__":
    main()
