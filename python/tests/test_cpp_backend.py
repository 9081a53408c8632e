"""chorus as a C++ `c10d::Backend` (python/bench/cpp_backend.cpp) over the
extension's C entry point: the path the benchmarks measure against the
Python backend, run as real rank processes."""

import os
import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install torch)")

from ranks import run  # noqa: E402

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module", autouse=True)
def built():
    """Builds the extension once, before the ranks load it."""
    if shutil.which("c++") is None:
        pytest.skip("needs a C++ compiler (c++) to build the C++ backend")
    if shutil.which("ninja") is None and shutil.which("ninja", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("needs ninja (pip install ninja) to build the C++ backend")
    sys.path.insert(0, str(BENCH))
    import cpp_backend

    cpp_backend.register()


def test_the_cpp_backend_reduces_every_dtype_and_op_and_hands_the_rest_to_python():
    ranks = run("cpp_backend", 2, args=["collectives"], timeout=120)
    for rank in ranks:
        outcome = rank.result()
        assert outcome["failures"] == [] and outcome["checked"] == 18, outcome
        assert outcome["chained"] == 4.0 and outcome["waited"] == 2.0
        assert outcome["late_value"] == 2.0
        assert outcome["broadcast"] == [1.0] * 5
    # Rank 1 comes 2 s late: rank 0's wait of 200 ms ends first.
    first = ranks[0].result()
    assert first["wait_timeout"] == "WaitTimeout" and first["done_after_timeout"] is False


def test_the_cpp_backend_gives_ddp_the_parameters_gloo_gives():
    cpp = run("ddp", 2, args=["chorus_cpp"])[0].result()["params"]
    gloo = run("ddp", 2, args=["gloo"])[0].result()["params"]
    worst = max(abs(a - b) for a, b in zip(cpp, gloo))
    assert len(cpp) == len(gloo) and worst < 1e-5, f"parameters differ by up to {worst}"


def test_powersgds_callbacks_that_wait_on_further_all_reduces_run_on_the_cpp_backend():
    # Its future callbacks block on the next all-reduce: run on the
    # library's runtime threads, they would hang it.
    checksums = {r.result()["checksum"] for r in run("ddp_hooks", 2, args=["powersgd", "chorus_cpp"])}
    assert len(checksums) == 1, f"replicas diverged: {checksums}"


def test_a_dead_rank_raises_group_aborted_naming_it_from_the_cpp_backend():
    window = 2.0
    ranks = run("cpp_backend", 3, args=["failure"], timeout=60, env={"CHORUS_HEARTBEAT_TIMEOUT": str(window)},
                expect_exit={2: "kill"})
    for rank in ranks[:2]:
        outcome = rank.result()
        assert outcome["error"] == "GroupAborted" and outcome["is_dist_backend_error"], outcome
        assert 2 in outcome["ranks"] and "rank 2" in outcome["message"], outcome
        assert outcome["elapsed"] < window + 2.0, outcome
