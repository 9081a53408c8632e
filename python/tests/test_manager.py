"""chorus.torch.Manager: fault-tolerant training of a torch model, with a
worker SIGKILLed halfway, through the Python example under chorus launch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs PyTorch (pip install torch)")

ROOT = Path(__file__).resolve().parents[2]
CHORUS = ROOT / "target" / "release" / "chorus"


@pytest.mark.skipif(not CHORUS.exists() and "CHORUS" not in os.environ,
                    reason="needs the chorus command: cargo build --release -p chorus-cli")
def test_a_killed_worker_costs_no_step_and_the_loss_matches_the_fault_free_run():
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "python" / "train.py"), "--steps", "200", "--fault-step", "80",
         "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 200
    assert summary["within"] < 0.02, summary
    recoveries = summary["recoveries"]
    assert recoveries and recoveries[0]["resumed_step"] >= 80, summary
    # Training went on within seconds of the kill (heartbeat window 1 s).
    assert recoveries[0]["since_kill_ms"] < 5000, summary


def run_example(*flags):
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "python" / "train.py"), "--json", *flags],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not CHORUS.exists() and "CHORUS" not in os.environ,
                    reason="needs the chorus command: cargo build --release -p chorus-cli")
def test_a_warm_standby_takes_the_killed_workers_place_with_the_extra_state():
    # 20 ms of compute per step leaves 2.4 s after the kill: a standby joins
    # well within it, as a worker started then (importing torch) may not.
    summary = run_example("--steps", "200", "--fault-step", "80", "--standby", "1", "--compute-ms", "20",
                          "--state-mib", "8")
    assert summary["within"] < 0.02, summary
    assert summary["standby_promotions"] >= 1, f"no standby was promoted: {summary}"
    moved = max(r["bytes"] for r in summary["recoveries"])
    assert moved >= 8 << 20, f"the extra state was not sent to the joiner: {summary}"


@pytest.mark.skipif(not CHORUS.exists() and "CHORUS" not in os.environ,
                    reason="needs the chorus command: cargo build --release -p chorus-cli")
@pytest.mark.parametrize("fault", ["freeze", "partition"])
def test_a_frozen_or_cut_off_worker_costs_no_step(fault):
    summary = run_example("--steps", "200", "--fault-step", "80", "--fault", fault)
    assert summary["steps"] == 200
    assert summary["within"] < 0.02, summary
    assert summary["recoveries"] and summary["recoveries"][0]["resumed_step"] >= 80, summary


def test_bad_example_flags_are_refused_before_anything_starts():
    for flags, words in [(["--fault-step", "0"], "never fires"), (["--fault-step", "999"], "never fires"),
                         (["--batch", "3"], "no sample"), (["--world", "1"], "at least 2")]:
        done = subprocess.run([sys.executable, str(ROOT / "examples" / "python" / "train.py"), *flags],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and words in done.stderr, (flags, done.stderr)


class _Extra:
    """Extra state as a job carries it: a tensor handed out itself, one
    handed out as a copy (an RNG's state), a nested one and plain values."""

    def __init__(self, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.live = torch.randn(1000, generator=g)
        self.hidden = torch.randint(0, 255, (64,), dtype=torch.uint8, generator=g)
        self.nested = torch.randn(3, 5, generator=g).double()
        self.position = seed

    def state_dict(self) -> dict:
        return {"live": self.live, "rng": self.hidden.clone(), "more": [self.nested, {"position": self.position}]}

    def load_state_dict(self, state: dict) -> None:
        self.live.copy_(state["live"])
        self.hidden = state["rng"].clone()
        self.nested = state["more"][0].clone()
        self.position = state["more"][1]["position"]


def test_extra_state_tensors_travel_as_entries_and_only_the_rest_is_pickled():
    import torch

    from chorus._manager import _ExtraTensors

    source, joiner = _Extra(1), _Extra(2)
    sent, received = _ExtraTensors(source), _ExtraTensors(joiner)
    assert [n for n, _ in sent.entries] == [n for n, _ in received.entries] == [
        "extra.0:float32[1000]", "extra.1:uint8[64]", "extra.2:float64[3, 5]"]
    # Handed out itself: the entry is the tensor, read and written in place.
    assert sent.entries[0][1].data_ptr() == source.live.data_ptr()
    source.live += 1.0
    source.hidden[0] = 7
    source.position = 41
    blob = sent.save()
    assert len(blob) < 1000, "the tensors' bytes went into the pickle"
    # What the transfer does: each entry's bytes into the joiner's entry.
    for (_, a), (_, b) in zip(sent.entries, received.entries):
        b.copy_(a)
    received.load(blob)
    assert torch.equal(joiner.live, source.live)
    assert torch.equal(joiner.hidden, source.hidden)
    assert torch.equal(joiner.nested, source.nested)
    assert joiner.position == 41


def test_extra_state_tensors_that_change_shape_travel_pickled():
    import torch

    from chorus._manager import _ExtraTensors

    source, joiner = _Extra(1), _Extra(2)
    sent, received = _ExtraTensors(source), _ExtraTensors(joiner)
    source.nested = torch.ones(4, 4, dtype=torch.float64)
    received.load(sent.save())
    assert torch.equal(joiner.nested, source.nested)
