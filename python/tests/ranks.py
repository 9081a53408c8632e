"""Runs a scenario of scenarios.py as N rank processes (the environment
torchrun gives its workers), each with a hard timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from chorus import free_port

SCENARIOS = Path(__file__).with_name("scenarios.py")



@dataclass
class Rank:
    rank: int
    returncode: Optional[int]
    output: str

    def result(self):
        """The JSON object the scenario printed last."""
        for line in reversed(self.output.splitlines()):
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        raise AssertionError(f"rank {self.rank} printed no result (exit {self.returncode}):\n{self.output}")


def run(scenario: str, world: int, timeout: float = 60, env: Optional[Dict[str, str]] = None,
        args: List[str] = (), expect_exit: Optional[Dict[int, str]] = None) -> List[Rank]:
    """Runs `scenario` on `world` ranks; fails with every rank's output when
    one hangs past `timeout` or exits non-zero, unless `expect_exit` names it
    (a rank meant to die or freeze: a frozen one is killed at the end)."""
    port = free_port()
    procs = []
    for rank in range(world):
        child_env = dict(os.environ)
        child_env.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
            CHORUS_LOG=os.environ.get("CHORUS_LOG", "warn"),
        )
        child_env.update(env or {})
        procs.append(subprocess.Popen([sys.executable, str(SCENARIOS), scenario, *args], env=child_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    deadline = time.monotonic() + timeout
    outputs = [""] * world
    hung = []
    # The ranks meant to die or freeze last: once the others are done, a
    # frozen one gets a second more, then is killed.
    expected = expect_exit or {}
    order = sorted(range(world), key=lambda r: r in expected)
    for rank in order:
        proc = procs[rank]
        if rank in expected and not hung:
            deadline = min(deadline, time.monotonic() + 1.0)
        try:
            outputs[rank], _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(rank)
    for rank in hung:
        os.killpg(procs[rank].pid, signal.SIGKILL)
        outputs[rank], _ = procs[rank].communicate()
    ranks = [Rank(r, p.returncode, outputs[r]) for r, p in enumerate(procs)]
    report = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output}" for r in ranks)
    unexpected = [r for r in hung if r not in expected]
    assert not unexpected, f"ranks {unexpected} still ran after {timeout} s:\n{report}"
    for r in ranks:
        if r.rank not in expected:
            assert r.returncode == 0, f"rank {r.rank} failed:\n{report}"
    return ranks
