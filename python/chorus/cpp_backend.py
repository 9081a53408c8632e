"""The C++ front of the ``"chorus"`` torch backend (``_backend.cpp``).

The operations DDP and FSDP2 issue most (all-reduce, broadcast,
all_gather_into_tensor, reduce_scatter_tensor on one dense CPU tensor) go
from torch's dispatcher to the Rust library with no Python step;
everything else goes to the Python backend
(:class:`chorus.torch.ChorusBackend`) behind it. The front is compiled against the installed torch on first use
(a C++ compiler and ``ninja``, about a minute), once per torch version, and
loaded from the cache after::

    python -m chorus.cpp_backend     # builds it now, prints where it is cached

``CHORUS_TORCH_BACKEND`` picks the implementation when a group is made:
``auto`` (the default) the C++ front where it builds, else the Python
backend with a warning saying why; ``cpp`` the C++ front or an error;
``python`` the Python backend. ``CHORUS_CACHE_DIR`` moves the cache
(default ``~/.cache/chorus``).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

__all__ = ["ENV", "IMPLEMENTATIONS", "implementation", "library_path", "load"]

ENV = "CHORUS_TORCH_BACKEND"
IMPLEMENTATIONS = ("auto", "cpp", "python")
_SOURCE = Path(__file__).with_name("_backend.cpp")
#: The module name the source is compiled under (its PyInit_ symbol).
_MODULE = "chorus_backend"

_lock = threading.Lock()
_loaded: Optional[ModuleType] = None
_failure: Optional[str] = None


def implementation() -> str:
    """The implementation ``CHORUS_TORCH_BACKEND`` asks for."""
    chosen = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if chosen not in IMPLEMENTATIONS:
        raise ValueError(f"{ENV}={chosen!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
    return chosen


def library_path() -> Path:
    """Where the compiled front is cached: one directory per torch version,
    Python version and source, since a front built for another torch would
    not load (or worse, would)."""
    key = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]
    torch_version = torch.__version__.replace("+", "_")
    tag = f"torch{torch_version}-py{sys.version_info[0]}{sys.version_info[1]}-{key}"
    root = Path(os.environ.get("CHORUS_CACHE_DIR") or Path.home() / ".cache" / "chorus")
    return root / "backend" / tag / f"{_MODULE}.so"


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
    spec = importlib.util.spec_from_file_location(_MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build() -> ModuleType:
    """The front, compiled into the cache unless it is there, and loaded
    (once per process: `load` keeps it). Ranks that start together build it
    once."""
    library = library_path()
    if library.exists():
        return _import(library)
    from torch.utils.cpp_extension import load as jit_load

    work = library.parent / "build"
    work.mkdir(parents=True, exist_ok=True)
    # `pip install ninja` puts it beside the interpreter, which an
    # unactivated virtual environment leaves off PATH.
    interpreter_bin = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and shutil.which("ninja", path=interpreter_bin):
        os.environ["PATH"] = interpreter_bin + os.pathsep + os.environ.get("PATH", "")
    # One builder at a time, under a lock the kernel lets go of if its
    # holder dies; torch's builder has its own lock file, which a builder
    # killed mid-way leaves behind and every later one would wait on
    # forever, so it is cleared while this lock is held.
    with open(library.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():  # built while this rank waited
            return _import(library)
        (work / "lock").unlink(missing_ok=True)
        print(f"chorus: building the torch backend's C++ front for torch {torch.__version__} into {library.parent} "
              f"(once; about a minute)", file=sys.stderr, flush=True)
        module = jit_load(name=_MODULE, sources=[str(_SOURCE)], extra_cflags=["-O2"], build_directory=str(work),
                          verbose=False)
        # Moved into place whole: no process loads a half-written library.
        staged = tempfile.NamedTemporaryFile(dir=library.parent, suffix=".so", delete=False)
        staged.close()
        shutil.copyfile(work / f"{_MODULE}.so", staged.name)
        os.replace(staged.name, library)
    return module


def load(chosen: Optional[str] = None) -> Optional[ModuleType]:
    """The compiled front (built on first use), or None where the Python
    backend is to run: asked for, or (``auto``) the front did not build.
    `chosen` overrides ``CHORUS_TORCH_BACKEND``."""
    global _loaded, _failure
    chosen = chosen or implementation()
    if chosen == "python":
        return None
    with _lock:
        if _loaded is None and _failure is None:
            try:
                _loaded = _build()
            except Exception as e:  # noqa: BLE001 - any build failure means the fallback (or the error asked for)
                _failure = f"{type(e).__name__}: {e}".strip()
                if chosen == "auto":
                    warnings.warn(f"chorus: the C++ front of the torch backend did not build, so the Python backend "
                                  f"runs (slower per call); {ENV}=python silences this. Why: {_failure[:2000]}",
                                  RuntimeWarning, stacklevel=2)
        if _loaded is None and chosen == "cpp":
            raise RuntimeError(f"{ENV}=cpp but the C++ front of the torch backend did not build: {_failure}")
        return _loaded


def main() -> None:
    load("cpp")
    print(library_path())


if __name__ == "__main__":
    main()
