"""The torch backend's two implementations: the C++ front
(chorus/_backend.cpp over the extension's C entry point), which "chorus"
runs where it builds, and the Python backend behind it, which runs alone
where it does not or where CHORUS_TORCH_BACKEND=python asks; real rank
processes."""

import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install torch)")

from chorus import cpp_backend  # noqa: E402
from ranks import run  # noqa: E402

CPP = {cpp_backend.ENV: "cpp"}
FRONTS = {"cpp": "ChorusCppBackend", "python": "ChorusBackend"}


@pytest.fixture(scope="module")
def built():
    """The C++ front, built once before the ranks load it; the tests that
    need it skip, saying why, where it cannot build."""
    try:
        cpp_backend.load("cpp")
    except Exception as e:  # noqa: BLE001 - the reason is the skip message
        pytest.skip(f"the C++ front did not build (needs a C++ compiler and ninja): {e}"[:500])


@pytest.mark.parametrize("implementation", ["cpp", "python"])
def test_each_implementation_runs_the_fronts_collectives_and_the_front_hands_the_rest_to_python(request, implementation):
    if implementation == "cpp":
        request.getfixturevalue("built")
    ranks = run("cpp_backend", 2, timeout=120, env={cpp_backend.ENV: implementation})
    for rank in ranks:
        outcome = rank.result()
        assert outcome["front"] == FRONTS[implementation], outcome
        assert outcome["failures"] == [] and outcome["checked"] == 18 + 6 + 8, outcome
        assert outcome["chained"] == 4.0 and outcome["waited"] == 2.0
        assert outcome["late_value"] == 2.0
        assert outcome["broadcast"] == [1.0] * 5
        assert outcome["all_gather"] == [0.0, 1.0]
    # Rank 1 comes 2 s late: rank 0's wait of 200 ms ends first.
    first = ranks[0].result()
    assert first["wait_timeout"] == "WaitTimeout" and first["done_after_timeout"] is False


def test_where_the_front_cannot_build_the_python_backend_runs_and_a_warning_says_why(tmp_path, monkeypatch):
    env = {cpp_backend.ENV: "auto", "CHORUS_CACHE_DIR": str(tmp_path), "CXX": str(tmp_path / "no-compiler")}
    # torch's build lock, as a builder killed mid-way leaves it: no rank
    # waits on it.
    monkeypatch.setenv("CHORUS_CACHE_DIR", str(tmp_path))
    stale = cpp_backend.library_path().parent / "build" / "lock"
    stale.parent.mkdir(parents=True)
    stale.touch()
    for rank in run("cpp_backend", 2, timeout=180, env=env):
        assert rank.result()["front"] == "ChorusBackend" and rank.result()["failures"] == []
        assert "the C++ front of the torch backend did not build" in rank.output, rank.output


def test_asking_for_the_front_where_it_cannot_build_is_an_error(tmp_path):
    env = {cpp_backend.ENV: "cpp", "CHORUS_CACHE_DIR": str(tmp_path), "CXX": str(tmp_path / "no-compiler")}
    with pytest.raises(AssertionError, match="CHORUS_TORCH_BACKEND=cpp but the C\\+\\+ front of the torch backend did not"):
        run("cpp_backend", 1, timeout=180, env=env)


def test_the_cpp_front_gives_ddp_the_parameters_gloo_gives(built):
    cpp = run("ddp", 2, args=["chorus"], env=CPP)[0].result()["params"]
    gloo = run("ddp", 2, args=["gloo"])[0].result()["params"]
    worst = max(abs(a - b) for a, b in zip(cpp, gloo))
    assert len(cpp) == len(gloo) and worst < 1e-5, f"parameters differ by up to {worst}"


def test_powersgds_callbacks_that_wait_on_further_all_reduces_run_on_the_cpp_front(built):
    # Its future callbacks block on the next all-reduce: run on the
    # library's runtime threads, they would hang it.
    checksums = {r.result()["checksum"] for r in run("ddp_hooks", 2, args=["powersgd", "chorus"], env=CPP)}
    assert len(checksums) == 1, f"replicas diverged: {checksums}"


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_dead_or_frozen_rank_raises_group_aborted_naming_it_from_the_python_backend_alone(how):
    # The same scenario under the default implementation (the C++ front
    # where it builds) is test_backend.py's.
    window = 2.0
    ranks = run("failure", 3, args=[how], timeout=60,
                env={cpp_backend.ENV: "python", "CHORUS_HEARTBEAT_TIMEOUT": str(window)}, expect_exit={2: how})
    for rank in ranks[:2]:
        outcome = rank.result()
        assert outcome["front"] == "ChorusBackend", outcome
        assert outcome["error"] == "GroupAborted" and outcome["is_dist_backend_error"], outcome
        assert 2 in outcome["ranks"] and "rank 2" in outcome["message"], outcome
        assert outcome["elapsed"] < window + 2.0, outcome
        assert outcome["next"] == "GroupAborted"


@pytest.mark.parametrize("implementation", ["cpp", "python"])
def test_a_dead_rank_fails_ddps_backward_with_group_aborted_naming_it(request, implementation):
    if implementation == "cpp":
        request.getfixturevalue("built")
    ranks = run("ddp_failure", 3, timeout=60, env={cpp_backend.ENV: implementation, "CHORUS_HEARTBEAT_TIMEOUT": "2"},
                expect_exit={2: "kill"})
    for rank in ranks[:2]:
        outcome = rank.result()
        assert outcome["error"] == "GroupAborted" and 2 in outcome["ranks"], outcome
