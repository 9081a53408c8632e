"""PyTorch's own distributed test suite (the installed wheel's
``DistributedTest``) on chorus: every case that passes on Gloo at a world
size passes on chorus, but those ``python/conformance/baseline.json`` leaves
out with its reason. The cases upstream gates to Gloo by name run with
chorus under them (``--as-gloo``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install torch)")
pytest.importorskip("expecttest", reason="torch's test suite needs expecttest (pip install expecttest hypothesis)")

CONFORMANCE = Path(__file__).resolve().parents[1] / "conformance"
BASELINE = json.loads((CONFORMANCE / "baseline.json").read_text())
#: World sizes run by default; CHORUS_TORCH_SUITE_WORLDS adds others the
#: baseline has (each is minutes of rank processes on two cores).
WORLDS = os.environ.get("CHORUS_TORCH_SUITE_WORLDS", "2").split(",")


def _run(world: str, names, as_gloo: bool, out: Path) -> dict:
    if not names:
        return {}
    cmd = [sys.executable, str(CONFORMANCE / "torch_suite.py"), "--backend", "chorus", "--world", world,
           "--names", ",".join(names), "--json", str(out)] + (["--as-gloo"] if as_gloo else [])
    env = dict(os.environ, TEMP_DIR=str(out.parent / f"tmp-{world}-{as_gloo}"))
    os.makedirs(env["TEMP_DIR"], exist_ok=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60 * len(names) + 300)
    assert out.exists(), f"the suite runner failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("world", sorted(BASELINE["gloo_passing"]))
def test_every_case_that_passes_on_gloo_passes_on_chorus(world, tmp_path):
    if world not in WORLDS:
        pytest.skip(f"world {world} not run (CHORUS_TORCH_SUITE_WORLDS={','.join(WORLDS)})")
    if torch.__version__ != BASELINE["torch"]:
        pytest.skip(f"the baseline was taken with torch {BASELINE['torch']}, this is {torch.__version__}: "
                    "run python/conformance/torch_suite.py --backend gloo to take it again")
    names = [n for n in BASELINE["gloo_passing"][world] if n not in BASELINE["left_out"]]
    gated = BASELINE["gated_to_gloo"]
    plugin = _run(world, [n for n in names if n not in gated], False, tmp_path / "plugin.json")
    as_gloo = _run(world, [n for n in names if n in gated], True, tmp_path / "as_gloo.json")
    outcomes = {**plugin.get("outcomes", {}), **as_gloo.get("outcomes", {})}
    failures = {**plugin.get("failures", {}), **as_gloo.get("failures", {})}
    missed = {n: outcomes.get(n, "not run") for n in names if outcomes.get(n) != "passed"}
    report = "\n".join(f"--- {n}: {state}\n{failures.get(n, '')[-1500:]}" for n, state in missed.items())
    assert not missed, f"{len(missed)} of {len(names)} cases that pass on Gloo do not pass on chorus:\n{report}"
