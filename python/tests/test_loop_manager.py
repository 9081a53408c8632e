"""chorus.torch.Manager in the user's own training loop: the GPT example
through a kill, a freeze and a warm standby against its fault-free run,
and sharded in replica groups (HSDP) through the loss of any rank;
every dtype moved to a joiner and verified; bad input refused before
training; the sampler's shards."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install torch)")

import chorus.torch as ct  # noqa: E402
from chorus import InvalidArgument, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHORUS = Path(os.environ.get("CHORUS", ROOT / "target" / "release" / "chorus"))
needs_launcher = pytest.mark.skipif(not CHORUS.exists(), reason="needs the chorus command: cargo build --release -p chorus-cli")


def gpt(*flags, timeout=600):
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "python" / "gpt.py"), "--json", *flags],
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ, CHORUS=str(CHORUS)))
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_launcher
@pytest.mark.parametrize("fault,standby", [("kill", 0), ("freeze", 0), ("kill", 1)])
def test_the_gpt_example_survives_a_fault_with_its_state_verified_and_the_fault_free_loss(fault, standby):
    run = gpt("--world", "3", "--steps", "120", "--fault", fault, "--fault-step", "50", "--standby", str(standby))
    assert run["steps"] == 120
    assert run["state_verified"] is True, run
    assert run["within"] < 0.02, run
    survived = run["recoveries"][0]
    assert survived["resumed_step"] == 50, run
    # Every join (the first formation, the shrink, the replacement's) was checked.
    assert all(j["verified"] for j in run["joins"]) and len(run["joins"]) >= 2, run
    if standby:
        assert run["standby_promotions"] >= 1, run
        assert run["replacement_ms"] is not None and max(r["bytes"] for r in run["recoveries"]) > 1 << 20, run


@needs_launcher
@pytest.mark.parametrize("fault,victim", [("kill", 0), ("kill", 3), ("freeze", 1), ("partition", 2)])
def test_replica_groups_shard_the_gpt_and_survive_the_loss_of_any_rank(fault, victim):
    """HSDP: 2 groups of 2 ranks, FSDP2 inside each. The victim's group
    leaves, the other commits on alone, the relaunched group's ranks each
    receive their shard from the matching rank and every shard hashes
    equal across the groups at the end (the run fails otherwise)."""
    run = gpt("--world", "4", "--replica-group-size", "2", "--steps", "60", "--fault", fault, "--fault-step", "25",
              "--fault-rank", str(victim))
    assert run["steps"] == 60 and run["state_verified"] is True, run
    assert run["within"] < 0.02, run
    alone, rejoined = run["recoveries"][0], run["recoveries"][-1]
    assert alone["world_size"] == 1 and alone["resumed_step"] == 25, run
    assert rejoined["world_size"] == 2 and rejoined["bytes"] > 1 << 20, run
    assert run["replacement_ms"] is not None, run


@needs_launcher
def test_two_standbys_replace_a_whole_replica_group():
    """HSDP with 2 warm standbys: rank 3 is killed, its group-mate leaves,
    and a standby is promoted into each slot. Only then do they take the
    slots' ranks and form the group anew; each receives its shard."""
    run = gpt("--world", "4", "--replica-group-size", "2", "--steps", "60", "--fault", "kill", "--fault-step", "25",
              "--standby", "2")
    assert run["steps"] == 60 and run["state_verified"] is True, run
    assert run["within"] < 0.02, run
    assert run["standby_promotions"] == 2, run
    rejoined = run["recoveries"][-1]
    assert rejoined["world_size"] == 2 and rejoined["bytes"] > 1 << 20, run
    assert run["replacement_ms"] is not None, run


@needs_launcher
def test_a_replica_group_relaunched_as_the_job_ends_leaves_it_a_success():
    """Rank 0 is killed two steps before the end: its group is relaunched
    as the other group finishes, and its ranks, arriving at the last
    boundary or after it, find the job ended and exit 0 (the launcher
    would report the job failed otherwise). The result comes from the
    group that finished."""
    run = gpt("--world", "4", "--replica-group-size", "2", "--steps", "60", "--fault", "kill", "--fault-step", "58",
              "--fault-rank", "0")
    assert run["steps"] == 60 and run["state_verified"] is True, run
    assert run["within"] < 0.02, run
    assert run["recoveries"][0]["world_size"] == 1 and run["recoveries"][0]["resumed_step"] == 58, run


def launch(scenario, world, timeout=240, *extra):
    run = Path(tempfile.mkdtemp(prefix=f"chorus-loop-{scenario}-"))
    cmd = [str(CHORUS), "launch", "--nproc-per-node", str(world), "--restart-policy", "worker", "--max-restarts", "2",
           "--master-port", str(free_port()), "--log-dir", str(run / "logs"), "--",
           sys.executable, str(Path(__file__).with_name("loop_scenarios.py")), scenario, str(run), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    results = [json.loads(p.read_text()) for p in sorted(run.glob("*.json"))]
    return done, results


@needs_launcher
def test_every_dtype_reaches_the_joiner_and_hashes_equal():
    done, results = launch("dtypes", 3)
    assert done.returncode == 0, done.stderr[-3000:]
    finished = [r for r in results if "report" in r]
    assert len(finished) == 3 and any(r["relaunched"] for r in finished), results
    joiner = next(r for r in finished if r["relaunched"])
    assert joiner["report"]["adopted"] >= 15, joiner
    assert {r["digest"] for r in finished} == {finished[0]["digest"]}, finished
    # The scheduler and the optimizer's param_groups travelled: one LR, one epoch count.
    assert len({r["lr"] for r in finished}) == 1 and len({r["last_epoch"] for r in finished}) == 1, finished
    assert finished[0]["grad_dtypes"] == ["torch.bfloat16", "torch.float16", "torch.float64"], finished
    # The joiner's first step was its warm-up, run on its own while it joined, never applied.
    assert [r["first_committed"] for r in finished if r["relaunched"]] == [False], finished
    assert all(r["first_committed"] for r in finished if not r["relaunched"]), finished


@needs_launcher
def test_a_compiled_model_syncs_its_gradients():
    done, results = launch("compile", 2, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(results) == 2 and all(r["steps"] == 10 for r in results), results
    # Different data on each member, one state: the averages went through the compiled backward.
    assert results[0]["losses"] != results[1]["losses"], results


@needs_launcher
@pytest.mark.parametrize("kind,kill", [("localsgd", False), ("diloco", True)])
def test_local_sgd_and_streaming_diloco_in_the_users_loop_learn_and_admit_a_joiner(kind, kill):
    done, results = launch(kind, 3, 300, *(["kill"] if kill else []))
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(results) == 3 and all(r["steps"] == 24 for r in results), results
    for r in results:
        if r["relaunched"]:
            continue  # it starts from the trained anchor: its first losses are low already
        losses = r["losses"]
        assert sum(losses[-8:]) < 0.5 * sum(losses[:8]), f"did not learn: {losses[:8]} ... {losses[-8:]}"
    if kill:
        joiner = [r for r in results if r["relaunched"]]
        assert joiner and joiner[0]["report"]["adopted"] >= 8, results
        assert any(joiner[0]["report"]["joins"]), results


@needs_launcher
def test_members_with_different_state_are_refused_at_the_first_step():
    done, results = launch("mismatch", 2, timeout=120)
    errors = [r["error"] for r in results]
    assert len(errors) == 2 and all(errors), (errors, done.stderr[-2000:])
    assert all("rank 1 lists different state" in e and "scheduler" in e for e in errors), errors


def test_bad_input_is_refused_before_training(monkeypatch):
    manager = ct.Manager()
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(InvalidArgument, match="no parameter that requires grad"):
        ct.DistributedDataParallel(manager, frozen)
    with pytest.raises(InvalidArgument, match="on meta"):
        ct.DistributedDataParallel(manager, torch.nn.Linear(2, 2, device="meta"))

    class OffHost:
        def state_dict(self):
            return {"t": torch.empty(3, device="meta")}

        def load_state_dict(self, state):
            pass

    with pytest.raises(InvalidArgument, match="tensor on meta"):
        manager.register_state("offhost", OffHost())
    with pytest.raises(InvalidArgument, match="no state_dict"):
        manager.register_state("plain", object())
    with pytest.raises(InvalidArgument, match="no step is under way"):
        manager.allreduce(torch.ones(2))
    with pytest.raises(InvalidArgument, match="needs replica groups"):
        ct.ReplicateShards(manager, torch.nn.Linear(2, 2))
    with pytest.raises(InvalidArgument, match="belongs to replica groups"):
        manager.device_mesh
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(InvalidArgument, match="does not divide the launcher's world of 4"):
        ct.Manager(replica_group_size=3)
    # A launcher that restarts every worker from step 0 undoes recovery.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.delenv("CHORUS_MIN_WORLD", raising=False)
    monkeypatch.delenv("CHORUS_ELASTIC_JOIN", raising=False)
    with pytest.raises(InvalidArgument, match="--restart-policy worker"):
        ct.Manager()
    ct.Manager(allow_full_restart=True)


class Members:
    """A stand-in for the manager's membership."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def num_participants(self):
        return self.world

    def participating_rank(self):
        return self.rank

    def _data_shard(self):
        return self.rank, self.world

    def register_state(self, name, obj):
        pass


def test_the_sampler_shards_each_step_by_the_membership_and_resumes_from_a_position():
    data = list(range(100))
    members = [Members(r, 4) for r in range(4)]
    samplers = [ct.DistributedSampler(data, m, batch_size=5, seed=3) for m in members]
    iters = [iter(s) for s in samplers]
    first = [[next(it) for _ in range(5)] for it in iters]
    assert len({i for batch in first for i in batch}) == 20, "the members' batches overlap"
    # One member is gone: the next step's 15 samples split over 3.
    for r, m in enumerate(members[:3]):
        m.world = 3
    second = [[next(iters[r]) for _ in range(5)] for r in range(3)]
    assert len({i for batch in first + second for i in batch}) == 35
    # A joiner takes a survivor's position and draws what the others do not.
    joiner = ct.DistributedSampler(data, Members(3, 4), batch_size=5, seed=3)
    joiner.load_state_dict(samplers[0].state_dict())
    for m in members[:3]:
        m.world = 4
    joined = iter(joiner)
    third = [[next(iters[r]) for _ in range(5)] for r in range(3)] + [[next(joined) for _ in range(5)]]
    assert len({i for batch in first + second + third for i in batch}) == 55
    assert [s.state_dict() for s in samplers[:3] + [joiner]] == [{"epoch": 0, "cursor": 55}] * 4
