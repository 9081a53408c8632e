"""Fault-tolerant training of a torch model with chorus, killing a worker halfway.

    python3 examples/python/train.py [--world 4] [--steps 400] [--fault kill --fault-step 150] [--standby 1]

A 3-layer MLP (torch, on the CPU) learns a synthetic 10-class problem on
--world processes under `chorus launch --restart-policy worker`, through
`chorus.torch.ElasticTrainer` (chorus's own loop, calling back for
each step's gradients): every step commits only when every member's
gradient sync succeeded. At --fault-step the last worker fails: SIGKILLed
(--fault kill), SIGSTOPped in the middle of its next step (freeze: the
heartbeats find it, and it is killed --kill-frozen-after-ms later, by
default twice the heartbeat window) or cut off (partition: its links cut
while it runs). The survivors re-form within the heartbeat window and go
on as a smaller group (the global batch re-split); the launcher relaunches
the worker, or with --standby promotes a warm standby worker that has
already imported torch and built the model, and it joins at a
step boundary, receiving the model and optimizer state (and --state-mib of
extra state) live from the survivors. The last line puts the final
held-out loss beside a fault-free run of the same steps (--json: one
object).

Needs torch, the chorus package (`pip install ./python`) and the `chorus`
command (`cargo build --release -p chorus-cli`: target/release/chorus is
found, or set CHORUS=/path/to/chorus).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from chorus import free_port

# Where a replacement's time goes: this process's start, then marks.
MARKS = {"process started": time.time()}

ROOT = Path(__file__).resolve().parents[2]
INPUTS, CLASSES, TRAIN_SAMPLES, EVAL_SAMPLES = 32, 10, 8192, 2048


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="workers (default 4)")
    p.add_argument("--steps", type=int, default=400, help="committed steps (default 400)")
    p.add_argument("--batch", type=int, default=128, help="global batch per step (default 128)")
    p.add_argument("--hidden", type=int, default=128, help="width of the hidden layers (default 128)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default 0.05)")
    p.add_argument("--mode", choices=["ddp", "local-sgd", "diloco"], default="ddp")
    p.add_argument("--every", type=int, default=10, help="steps between outer syncs in the local modes")
    p.add_argument("--fault", choices=["none", "kill", "freeze", "partition"], default="kill")
    p.add_argument("--fault-step", type=int, default=150, help="the last worker dies after this step")
    p.add_argument("--heartbeat-ms", type=int, default=1000, help="heartbeat window (default 1000)")
    p.add_argument("--kill-frozen-after-ms", type=int,
                   help="--fault freeze: the frozen worker is SIGKILLed this long after it froze, as an operator "
                        "would, so that the launcher replaces it (default twice the heartbeat window)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--standby", type=int, default=0,
                   help="warm standby workers kept by the launcher (default 0: a failed worker is relaunched)")
    p.add_argument("--state-mib", type=int, default=0,
                   help="extra state moved to a joiner with the model, in MiB (default 0)")
    p.add_argument("--compute-ms", type=float, default=0.0,
                   help="extra compute per step, as a larger model would need (a sleep; default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    p.add_argument("--keep-logs", action="store_true", help="keep the run directory (the launcher's and workers' logs, progress) and say where")
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.world < 2:
        p.error("--world must be at least 2 (a fault needs survivors)")
    if args.batch < args.world:
        p.error(f"--batch {args.batch} gives some of the {args.world} workers no sample")
    if args.fault != "none" and not 0 < args.fault_step < args.steps:
        p.error(f"--fault-step {args.fault_step} never fires: it must be between 1 and --steps - 1 ({args.steps - 1})")
    if args.standby < 0 or args.state_mib < 0:
        p.error("--standby and --state-mib must be 0 or more")
    if args.hidden < 1 or args.steps < 1:
        p.error("--hidden and --steps must be positive")
    return args


def dataset(seed: int, n: int, salt: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, INPUTS, generator=gen) * 2.0
    gen = torch.Generator().manual_seed(seed * 1000 + salt)
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    x = centers[labels] + torch.randn(n, INPUTS, generator=gen) * 2.5
    return x, labels


def model(hidden: int, seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(INPUTS, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, CLASSES),
    )


class Padding:
    """Extra state (--state-mib): a tensor every step changes, moved to a
    joiner with the model; stands for the data position, RNG and other
    state a real job carries."""

    def __init__(self, mib: int) -> None:
        import torch

        self.tensor = torch.zeros(mib << 18)

    def advance(self, step: int) -> None:
        if len(self.tensor):
            self.tensor[step % len(self.tensor)] += 1.0

    def state_dict(self) -> dict:
        return {"tensor": self.tensor}

    def load_state_dict(self, state: dict) -> None:
        self.tensor = state["tensor"]


def worker(args: argparse.Namespace) -> None:
    import torch

    import chorus.torch as ct

    MARKS["torch imported"] = time.time()
    torch.set_num_threads(1)
    run = Path(args.run_dir)
    finished = run / "finished"
    # A worker relaunched after the others finished has no job to join:
    # it would wait out the rendezvous timeout, again on every relaunch.
    joined = threading.Event()

    def watch_finished():
        while not finished.exists():
            if joined.wait(0.05):
                return
        print("the job finished before this worker could rejoin it", file=sys.stderr, flush=True)
        os._exit(0)

    waiting = threading.Thread(target=watch_finished, daemon=True)
    waiting.start()
    x, y = dataset(args.seed, TRAIN_SAMPLES, 0)
    net = model(args.hidden, args.seed)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    # Survivors go on without a dead worker; its replacement joins later.
    padding = Padding(args.state_mib) if args.state_mib else None
    MARKS["model built"] = time.time()
    manager = ct.ElasticTrainer(net, opt, mode=args.mode, every=args.every, heartbeat_timeout=args.heartbeat_ms / 1e3,
                         min_world=args.world - 1, max_world=args.world, timeout=120, extra_state=padding)
    # Roles follow the launcher's slots, not the group's ranks: on a loaded
    # machine a slow starter may miss the first generation and join the next.
    relaunched = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    first_rank = manager.rank
    MARKS["in the group"] = time.time()
    joined.set()
    (run / "pids").mkdir(exist_ok=True)
    (run / "pids" / str(first_rank)).write_text(str(os.getpid()))
    slot = int(os.environ.get("LOCAL_RANK", "-1"))
    victim = not relaunched and slot == args.world - 1 and args.fault != "none"
    progress = open(run / "progress", "a") if not relaunched and slot == 0 else None

    def backward(step: ct.Step) -> float:
        if victim and args.fault == "freeze" and step.step == args.fault_step:
            # Mid-step, as a hung rank would: its peers are in (or about
            # to enter) the step's gradient sync and wait for it.
            (run / "killed_at").write_text(str(time.time()))
            (run / "frozen").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        gen = torch.Generator().manual_seed(args.seed * 7919 + step.step)
        batch = torch.randint(0, TRAIN_SAMPLES, (step.global_batch,), generator=gen)[step.shard.start : step.shard.stop]
        if len(batch) == 0:
            return 0.0
        loss = torch.nn.functional.cross_entropy(net(x[batch]), y[batch], reduction="sum")
        loss.backward()
        if args.compute_ms:
            time.sleep(args.compute_ms / 1e3)
        return loss.item()

    commits = []

    def on_commit(step: int, loss: float, world: int, generation: int) -> None:
        commits.append(time.time())
        if relaunched and len(commits) == 1:
            (run / "replacement.json").write_text(json.dumps(MARKS))
            (run / "rejoined_at").write_text(str(commits[0]))
        if progress:
            progress.write(f"{step} {loss} {world} {generation}\n")
            progress.flush()
        if padding:
            padding.advance(step)
        if victim and step + 1 == args.fault_step and args.fault != "freeze":
            (run / "killed_at").write_text(str(time.time()))
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                manager.cut_off()

    started = time.monotonic()
    report = manager.train(args.steps, args.batch, backward, on_commit)
    seconds = time.monotonic() - started
    finished.touch()
    manager.verify()
    if report["applied"] + report["adopted"] != report["steps"]:
        raise SystemExit(f"rank {first_rank}: applied {report['applied']} + adopted {report['adopted']} != {report['steps']}")
    # The result comes from the last generation's rank 0: whichever slot
    # it is, it trained to the end.
    if manager.rank == 0:
        ex, ey = dataset(args.seed, EVAL_SAMPLES, 2)
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(net(ex), ey).item()
        digest = float(sum(p.detach().double().sum() for p in net.parameters()))
        if padding:
            digest += float(padding.tensor.double().sum())
        gaps = sorted(b - a for a, b in zip(commits, commits[1:]))
        (run / "result.json").write_text(json.dumps({
            "final_loss": loss, "steps": report["steps"], "train_seconds": seconds,
            "recoveries": report["recoveries"], "state_checksum": digest,
            # The survivors' longest wait between two committed steps, and a typical one.
            "longest_stall_ms": gaps[-1] * 1e3 if gaps else 0.0,
            "median_step_ms": gaps[len(gaps) // 2] * 1e3 if gaps else 0.0,
        }))
    manager.destroy()


def chorus_command() -> str:
    found = os.environ.get("CHORUS") or shutil.which("chorus")
    built = ROOT / "target" / "release" / "chorus"
    if found:
        return found
    if built.exists():
        return str(built)
    raise SystemExit("the `chorus` command is not found: `cargo build --release -p chorus-cli` "
                     "(then target/release/chorus is used), or set CHORUS=/path/to/chorus")



def kill_frozen(marker: Path, after: float, stop: threading.Event) -> None:
    while not stop.wait(0.05):
        if marker.exists():
            time.sleep(after)
            try:
                os.kill(int(marker.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
            return


def launch(args: argparse.Namespace, fault: str, run: Path) -> dict:
    run.mkdir(parents=True, exist_ok=True)
    cmd = [chorus_command(), "launch", "--nproc-per-node", str(args.world), "--restart-policy", "worker",
           "--max-restarts", "3", "--standby", str(args.standby), "--master-port", str(free_port()), "--log-dir", str(run / "logs"), "--",
           sys.executable, os.path.abspath(__file__), "--run-dir", str(run), "--fault", fault]
    for flag in ("world", "steps", "batch", "hidden", "lr", "mode", "every", "fault_step", "heartbeat_ms", "seed",
                 "compute_ms", "state_mib"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    stop = threading.Event()
    # A frozen worker is found by the others' heartbeats, then killed (as
    # an operator or a node agent would) so that the launcher replaces it.
    after_ms = args.kill_frozen_after_ms if args.kill_frozen_after_ms is not None else 2 * args.heartbeat_ms
    thaw = threading.Thread(target=kill_frozen, args=(run / "frozen", after_ms / 1e3, stop), daemon=True)
    thaw.start()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stop.set()
    result = run / "result.json"
    if not result.exists():
        raise SystemExit(f"the {fault} run ended (exit {done.returncode}) without a result; "
                         f"logs under {run / 'logs'}\n{done.stderr[-2000:]}")
    (run / "launcher.log").write_text(done.stderr)
    outcome = json.loads(result.read_text())
    outcome["promotions"] = done.stderr.count("promoted standby worker")
    killed, rejoined = run / "killed_at", run / "rejoined_at"
    if killed.exists():
        at = float(killed.read_text())
        for r in outcome["recoveries"]:
            r["since_kill_ms"] = (r["first_step_at"] - at) * 1e3
        # The relaunched worker's first committed step, if it joined before the end.
        if rejoined.exists():
            outcome["replacement_ms"] = (float(rejoined.read_text()) - at) * 1e3
            # Its marks after the fault (a standby's start and build came before).
            marks = json.loads((run / "replacement.json").read_text())
            outcome["replacement_phases_ms"] = {k: (t - at) * 1e3 for k, t in marks.items() if t > at}
    return outcome


def main() -> None:
    args = parse()
    if args.run_dir:
        worker(args)
        return
    base = Path(tempfile.mkdtemp(prefix="chorus-py-train-"))
    runs = {"training": launch(args, args.fault, base / "run")}
    if args.fault != "none":
        runs["reference"] = launch(args, "none", base / "reference")
    run = runs["training"]
    for r in run["recoveries"]:
        print(f"recovery into generation {r['generation']} ({r['world_size']} workers) at step {r['resumed_step']}: "
              f"rendezvous {r['rendezvous_ms']:.0f} ms, transfer {r['transfer_ms']:.0f} ms "
              f"({r['bytes'] / 1e6:.1f} MB), first step {r['first_step_ms']:.0f} ms"
              + (f"; {r['since_kill_ms']:.0f} ms after the kill" if "since_kill_ms" in r else ""))
    reference = runs.get("reference", run)["final_loss"]
    summary = {
        "final_loss": run["final_loss"], "reference_loss": reference,
        "within": abs(run["final_loss"] - reference) / reference,
        "steps": run["steps"], "recoveries": run["recoveries"], "steps_per_s": run["steps"] / run["train_seconds"],
        "fault": args.fault, "fault_step": args.fault_step if args.fault != "none" else None,
        "longest_stall_ms": run["longest_stall_ms"], "median_step_ms": run["median_step_ms"],
        "replacement_ms": run.get("replacement_ms"), "replacement_phases_ms": run.get("replacement_phases_ms"),
        "state_checksum": run["state_checksum"],
        "standby_promotions": run["promotions"],
    }
    replaced = "a promoted standby worker" if args.standby else "the relaunched worker"
    if "replacement_ms" in run:
        phases = ", ".join(f"{k} at {ms:.0f} ms" for k, ms in run["replacement_phases_ms"].items())
        print(f"{replaced} committed its first step {run['replacement_ms']:.0f} ms after the {args.fault}"
              + (f" ({phases})" if phases else ""))
    elif args.fault in ("kill", "freeze"):
        print(f"{replaced} found the job finished before it could join (survivors never wait for it)")
    print(f"{args.steps} steps on {args.world} workers, fault {args.fault}"
          + (f" at step {args.fault_step}" if args.fault != "none" else "")
          + f": final loss {run['final_loss']:.4f}, fault-free {reference:.4f} "
          f"({summary['within'] * 100:.2f}% apart), {summary['steps_per_s']:.1f} steps/s")
    if args.json:
        print(json.dumps(summary))
    if args.keep_logs:
        print(f"run directory kept: {base}", file=sys.stderr)
    else:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
