"""PyTorch's own distributed test suite on a backend: the
``DistributedTest._DistTestBase`` cases of the installed torch wheel, each
run as ``WORLD`` rank processes the way upstream's
``test/distributed/test_distributed_spawn.py`` runs them.

    python3 python/conformance/torch_suite.py --backend chorus --world 2 [--json FILE] [-k PATTERN ...] [--names A,B]

``--backend chorus`` enters chorus where upstream lets a third-party backend
in (``DistTestCases.backend_feature`` "plugin", "ddp" and "subgroup").
``--as-gloo`` runs the cases upstream gates to Gloo by name with chorus
under them (see cases.py). ``baseline.json`` beside this file lists the
cases that pass on Gloo, those gated to Gloo by name although what they
test is not Gloo's alone, and those left out with the reason;
``python/tests/test_torch_suite.py`` holds chorus to it. It prints one line per case and a summary, and
with ``--json`` writes ``{"torch": version, "world": N, "outcomes": {case:
"passed" | "failed" | "skipped"}, "failures": {case: traceback}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


class _Outcomes(unittest.TextTestResult):
    """Keeps every case's outcome by name."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, str] = {}
        self.tracebacks: dict[str, str] = {}
        self.began: dict[str, float] = {}
        self.seconds: dict[str, float] = {}

    @staticmethod
    def _name(test) -> str:
        return test.id().rsplit(".", 1)[-1]

    def startTest(self, test):  # noqa: N802 - unittest's name
        self.began[self._name(test)] = time.monotonic()
        super().startTest(test)

    def _record(self, test, outcome, error=None):
        name = self._name(test)
        self.outcomes[name] = outcome
        self.seconds[name] = round(time.monotonic() - self.began.get(name, time.monotonic()), 2)
        if error is not None:
            self.tracebacks[name] = self._exc_info_to_string(error, test)[-4000:]

    def addSuccess(self, test):  # noqa: N802
        super().addSuccess(test)
        self._record(test, "passed")

    def addFailure(self, test, err):  # noqa: N802
        super().addFailure(test, err)
        self._record(test, "failed", err)

    def addError(self, test, err):  # noqa: N802
        super().addError(test, err)
        self._record(test, "failed", err)

    def addSkip(self, test, reason):  # noqa: N802
        super().addSkip(test, reason)
        self._record(test, "skipped")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="chorus")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--as-gloo", action="store_true",
                        help="run the cases upstream gates to Gloo by name, on chorus")
    parser.add_argument("--json", help="write the outcomes here")
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="run only the cases whose names contain this (repeatable)")
    parser.add_argument("--names", default="",
                        help="run only the cases of these exact names (comma-separated)")
    args = parser.parse_args()

    # The suite reads these when it is imported, in this process and in
    # every rank process it spawns (which inherit them).
    os.environ["BACKEND"] = "gloo" if args.as_gloo else args.backend
    os.environ["CHORUS_SUITE_BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world)
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="chorus-torch-suite-"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Spawned ranks import cases.py by name, so it must be importable.
    sys.path.insert(0, HERE)
    import torch

    import cases

    loader = unittest.TestLoader()
    suite = loader.loadTestsFromTestCase(cases.TestDistBackendWithSpawn)
    names = {n for n in args.names.split(",") if n}

    def chosen(test) -> bool:
        name = test.id().rsplit(".", 1)[-1]
        return (not names or name in names) and (not args.patterns or any(p in name for p in args.patterns))

    selected = unittest.TestSuite(t for t in suite if chosen(t))
    runner = unittest.TextTestRunner(resultclass=_Outcomes, verbosity=2, stream=sys.stdout)
    result = runner.run(selected)
    counts = {k: sum(1 for v in result.outcomes.values() if v == k) for k in ("passed", "failed", "skipped")}
    print(f"torch-suite: backend {args.backend}{' (as gloo)' if args.as_gloo else ''}, world {args.world}, "
          f"torch {torch.__version__}: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "backend": args.backend, "as_gloo": args.as_gloo,
                       "world": args.world, "outcomes": result.outcomes, "seconds": result.seconds,
                       "failures": result.tracebacks}, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
