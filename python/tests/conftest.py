"""Builds the torch backend's C++ front once, before any test starts rank
processes: under the default CHORUS_TORCH_BACKEND=auto every rank would
otherwise wait for the first build (about a minute) inside its first
init_process_group. The summary says which implementation the ranks ran."""

import pytest

_front = {"state": "not checked (torch is not importable)"}


def pytest_sessionstart(session):
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    from chorus import cpp_backend

    if cpp_backend.implementation() == "python":
        _front["state"] = f"not used ({cpp_backend.ENV}=python): the ranks ran the Python backend"
        return
    try:
        cpp_backend.load("cpp")
        _front["state"] = f"built ({cpp_backend.library_path()}): the ranks ran it"
    except Exception as e:  # noqa: BLE001 - reported in the summary; the ranks fall back
        _front["state"] = f"did not build, so the ranks ran the Python backend: {e}"[:1000]


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"chorus: the torch backend's C++ front {_front['state']}")
