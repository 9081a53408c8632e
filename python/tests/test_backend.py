"""The chorus torch.distributed backend, run as real rank processes."""

import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install torch)")

from ranks import run  # noqa: E402


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_dtype_and_op_matches_the_reference_and_gloo(world):
    for rank in run("collectives", world, timeout=180):
        outcome = rank.result()
        assert outcome["failures"] == [], f"rank {rank.rank}: {outcome['failures']}"
        assert outcome["checked"] >= 149


def test_async_work_waits_with_a_timeout_and_completes_its_future():
    ranks = run("async_work", 2)
    for rank in ranks:
        outcome = rank.result()
        assert outcome["completed"] and outcome["value"] == 2.0 and outcome["chained"] == 4.0
        assert outcome["late_value"] == 2.0
    first = ranks[0].result()
    assert first["wait_timeout"] == "WaitTimeout"
    assert first["done_after_timeout"] is False


def test_ddp_on_chorus_ends_with_the_parameters_ddp_on_gloo_ends_with():
    chorus_params = run("ddp", 2, args=["chorus"])[0].result()["params"]
    gloo_params = run("ddp", 2, args=["gloo"])[0].result()["params"]
    assert len(chorus_params) == len(gloo_params)
    worst = max(abs(a - b) for a, b in zip(chorus_params, gloo_params))
    assert worst < 1e-5, f"parameters differ by up to {worst}"


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_ddp_comm_hooks_run_on_chorus(hook):
    checksums = {r.result()["checksum"] for r in run("ddp_hooks", 2, args=[hook])}
    assert len(checksums) == 1, f"replicas diverged: {checksums}"


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_dead_or_frozen_rank_raises_group_aborted_naming_it_within_the_window(how):
    window = 2.0
    ranks = run("failure", 3, args=[how], timeout=60, env={"CHORUS_HEARTBEAT_TIMEOUT": str(window)},
                expect_exit={2: how})
    for rank in ranks[:2]:
        outcome = rank.result()
        assert outcome["error"] == "GroupAborted", outcome
        assert outcome["is_dist_backend_error"]
        assert 2 in outcome["ranks"], outcome
        assert "rank 2" in outcome["message"], outcome["message"]
        assert outcome["elapsed"] < window + 2.0, outcome
        assert outcome["next"] == "GroupAborted"


def test_fault_rules_act_on_a_python_job():
    ranks = run("fault_rules", 3, timeout=60, env={"CHORUS_FAULTS": "kill(rank=2, after_frames=40)"},
                expect_exit={2: "killed by its fault rule"})
    assert ranks[2].returncode != 0
    for rank in ranks[:2]:
        outcome = rank.result()
        assert outcome["error"] == "GroupAborted", outcome
        assert 2 in outcome["ranks"], outcome


def test_ranks_calling_different_collectives_raise_a_desync_naming_both():
    outcomes = [r.result() for r in run("desync", 2, timeout=60)]
    assert any(o["error"] == "DesyncError" for o in outcomes), outcomes
    desync = next(o for o in outcomes if o["error"] == "DesyncError")
    assert "all_reduce" in desync["message"] and "broadcast" in desync["message"], desync


def test_bad_input_raises_a_clear_python_error():
    for rank in run("bad_input", 2, timeout=60):
        out = rank.result()
        assert out["non_contiguous"].startswith("ValueError") and "contiguous" in out["non_contiguous"]
        # torch answers meta tensors itself (shape only), before any backend, as on Gloo.
        assert out["meta_device"] == "none", out["meta_device"]
        assert out["float_band"].startswith("InvalidArgument"), out["float_band"]
        assert out["int16"].startswith("TypeError") and "int16" in out["int16"]
        assert out["gather_into_wrong_size"].startswith("InvalidArgument")
        assert out["healthy_after"] == 2.0
        assert out["mismatched_sizes"] != "none", out
        assert out["after_destroy"].startswith("GroupAborted") and "destroyed" in out["after_destroy"]


def test_the_flight_recorder_and_chorus_trace_work_on_a_python_job(tmp_path):
    chorus_bin = Path(__file__).resolve().parents[2] / "target" / "release" / "chorus"
    if not chorus_bin.exists():
        pytest.skip("needs the chorus command: cargo build --release -p chorus-cli")
    run("failure", 3, args=["freeze"], timeout=60, expect_exit={2: "freeze"},
        env={"CHORUS_HEARTBEAT_TIMEOUT": "2", "CHORUS_TRACE_DIR": str(tmp_path)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chorus-trace-g0-r0.json", "chorus-trace-g0-r1.json"]
    report = subprocess.run([str(chorus_bin), "trace", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert "rank 2 left no dump" in report.stdout and "all_reduce" in report.stdout, report.stdout + report.stderr


@pytest.mark.parametrize("world", [2, 4])
def test_torchs_modern_stack_runs_on_chorus_with_gloos_results(world):
    chorus_side = [r.result() for r in run("modern_stack", world, args=["chorus"], timeout=300)]
    gloo_side = [r.result() for r in run("modern_stack", world, args=["gloo"], timeout=300)]
    for rank, (mine, gloos) in enumerate(zip(chorus_side, gloo_side)):
        assert set(mine) == set(gloos)
        differ = {k: (mine[k], gloos[k]) for k in mine if mine[k] != gloos[k]}
        assert not differ, f"rank {rank}: chorus against gloo: {differ}"


@pytest.mark.parametrize("world", [2, 3])
def test_point_to_point_runs_as_on_gloo(world):
    chorus_side = [r.result() for r in run("point_to_point", world, args=["chorus"], timeout=120)]
    gloo_side = [r.result() for r in run("point_to_point", world, args=["gloo"], timeout=120)]
    assert chorus_side == gloo_side
    assert chorus_side[0]["any_source"] == [[r, float(r)] for r in range(1, world)]
    assert chorus_side[1]["tags"] == [1.0, 2.0]
