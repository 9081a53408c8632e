"""Workers of test_loop_manager.py, run under `chorus launch
--restart-policy worker`: chorus.torch.Manager in a training loop of the
script's own.

    python3 loop_scenarios.py SCENARIO RUN_DIR

dtypes    a model holding every dtype torch trains in (bf16 and fp16
          layers, an fp64 parameter, integer and fp16 buffers, fp32 master
          weights beside the bf16 weights as the user's own state, an LR
          scheduler), 40 steps; the last worker SIGKILLs itself after step
          15 and its replacement joins (the two others slow down until it
          did). Each worker writes
          RUN_DIR/<pid>.json: its report, its state's digest, its LR.
compile   a torch.compile'd model (inductor), members fed different data
          for 10 steps: their states still hash equal (the gradients were
          averaged through the compiled graph's backward).
localsgd  LocalSGD (sync every 4 steps), then
diloco    Streaming DiLoCo (2 fragments, sync every 4 steps, Nesterov outer
          step, momentum 0.5) around a loop of the script's own, 48 steps, each member on
          its own data; with "kill" the last worker SIGKILLs itself after
          step 20 and its replacement joins at a sync. Each writes its
          losses and report.
mismatch  rank 1 registers one more object than rank 0: both are refused
          at the first step; each writes the error.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import chorus.torch as ct

STEPS, KILL_AFTER = 40, 15


class Mixed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.low = torch.nn.Linear(16, 32).to(torch.bfloat16)
        self.fp16 = torch.nn.Linear(32, 16).to(torch.float16)
        self.scale = torch.nn.Parameter(torch.ones(16, dtype=torch.float64))
        self.register_buffer("seen", torch.zeros(4, dtype=torch.int64))
        self.register_buffer("running", torch.zeros(16, dtype=torch.float16))

    def forward(self, x):
        h = F.relu(self.low(x.to(torch.bfloat16))).to(torch.float16)
        out = self.fp16(h).to(torch.float64) * self.scale
        with torch.no_grad():
            self.seen += 1
            self.running.mul_(0.9).add_(out.detach().to(torch.float16).mean(0), alpha=0.1)
        return out


class MasterWeights:
    """fp32 copies of the bf16 weights, the user's own state."""

    def __init__(self, model: Mixed) -> None:
        self.model = model
        self.weights = [p.detach().float().clone() for p in model.low.parameters()]

    def refresh(self) -> None:
        for w, p in zip(self.weights, self.model.low.parameters()):
            w.copy_(p.detach().float())

    def state_dict(self):
        return {"weights": self.weights}

    def load_state_dict(self, state) -> None:
        for w, v in zip(self.weights, state["weights"]):
            w.copy_(v)


def digest(objects) -> float:
    """A sum over every tensor of the objects' state dicts."""
    total = 0.0
    for obj in objects:
        for t in leaves(obj.state_dict()):
            total += float(t.double().sum())
    return total


def leaves(value):
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in leaves(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in leaves(v)]
    return []


def dtypes(run: Path) -> None:
    torch.manual_seed(1)  # every member builds the same model...
    torch.set_num_threads(1)
    relaunched = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if relaunched:
        torch.manual_seed(99)  # ...but a replacement's differs until it joins
    net = Mixed()
    master = MasterWeights(net)
    manager = ct.Manager(state_dict=master.state_dict, load_state_dict=master.load_state_dict,
                         min_replica_size=2, heartbeat_timeout=1.0, timeout=60)
    model = ct.DistributedDataParallel(manager, net)
    optimizer = ct.Optimizer(manager, torch.optim.AdamW(model.parameters(), lr=1e-2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    manager.register_state("scheduler", scheduler)
    victim = not relaunched and os.environ.get("LOCAL_RANK") == "2"
    first_committed = None
    while manager.current_step() < STEPS:
        optimizer.zero_grad()
        gen = torch.Generator().manual_seed(manager.current_step() * 10 + manager.participating_rank())
        x = torch.randn(8, 16, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = manager.current_step()
        optimizer.step()
        scheduler.step()
        if first_committed is None:
            first_committed = manager.current_step() > before
        master.refresh()
        if victim and manager.current_step() == KILL_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)
        if manager.current_step() > KILL_AFTER and manager.num_participants() < 3:
            time.sleep(0.3)  # leaves the replacement time to join before the end
    manager.verify()
    report = manager.report()
    (run / f"{os.getpid()}.json").write_text(json.dumps({
        "relaunched": relaunched, "report": report, "lr": optimizer.param_groups[0]["lr"],
        "last_epoch": scheduler.last_epoch,
        "digest": digest([net, optimizer, master]),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in net.parameters()}),
        "first_committed": first_committed,
    }))
    manager.shutdown()


def compiled(run: Path) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    manager = ct.Manager(timeout=120)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = ct.DistributedDataParallel(manager, net)
    optimizer = ct.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.1))
    forward = torch.compile(model)
    losses = []
    while manager.current_step() < 10:
        optimizer.zero_grad()
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(manager.current_step() * 7 + manager.participating_rank()))
        loss = forward(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    manager.verify()
    (run / f"{os.getpid()}.json").write_text(json.dumps({"losses": losses, "steps": manager.current_step()}))
    manager.shutdown()


def periodic(run: Path, kind: str, kill: bool) -> None:
    torch.manual_seed(2)
    torch.set_num_threads(1)
    relaunched = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    manager = ct.Manager(min_replica_size=2, heartbeat_timeout=1.0, timeout=60)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    if kind == "localsgd":
        sync = ct.LocalSGD(manager, net, inner, sync_every=4)
    else:
        # With 4 inner steps per sync (not the paper's hundreds), momentum 0.9 overshoots.
        outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.5, nesterov=True)
        sync = ct.DiLoCo(manager, [net[0], net[2]], inner, outer, sync_every=4)
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(5))
    victim = kill and not relaunched and os.environ.get("LOCAL_RANK") == "2"
    losses, local = [], 0
    with sync:
        while manager.current_step() < 24:  # 2 syncs per 4 steps with 2 fragments, 1 without
            inner.zero_grad()
            gen = torch.Generator().manual_seed(local * 10 + int(os.environ.get("LOCAL_RANK", "0")) + 100 * relaunched)
            x = torch.randn(16, 8, generator=gen)
            loss = (net(x) - x @ target).pow(2).mean()
            loss.backward()
            inner.step()
            local += 1
            losses.append(loss.item())
            if victim and manager.current_step() >= 8:
                os.kill(os.getpid(), signal.SIGKILL)
            if manager.num_participants() < 3 and manager.current_step() > 8:
                time.sleep(0.2)  # leaves the replacement time to join
    manager.verify()
    (run / f"{os.getpid()}.json").write_text(json.dumps({
        "relaunched": relaunched, "losses": losses, "report": manager.report(), "steps": manager.current_step(),
    }))
    manager.shutdown()


def mismatch(run: Path) -> None:
    manager = ct.Manager(timeout=30)
    model = ct.DistributedDataParallel(manager, torch.nn.Linear(4, 4))
    optimizer = ct.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.1))
    if os.environ.get("RANK") == "1":
        manager.register_state("scheduler", torch.optim.lr_scheduler.StepLR(optimizer, 10))
    try:
        optimizer.zero_grad()
        error = None
    except Exception as e:  # the refusal this scenario is about
        error = f"{type(e).__name__}: {e}"
    (run / f"{os.getpid()}.json").write_text(json.dumps({"error": error}))


if __name__ == "__main__":
    scenario, run_dir = sys.argv[1], Path(sys.argv[2])
    if scenario in ("localsgd", "diloco"):
        periodic(run_dir, scenario, kill="kill" in sys.argv[3:])
    else:
        {"dtypes": dtypes, "compile": compiled, "mismatch": mismatch}[scenario](run_dir)
