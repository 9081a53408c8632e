"""chorus as a C++ ``c10d::Backend`` (cpp_backend.cpp), registered as the
backend "chorus_cpp" for the benchmarks to measure against the package's
Python backend ("chorus"). Compiled on first use with torch's extension
builder (needs a C++ compiler and ``pip install ninja``; cached after)."""

from __future__ import annotations

import os

import torch.distributed as dist

import chorus.torch as chorus_torch

NAME = "chorus_cpp"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpp_backend.cpp")


def register() -> None:
    """Builds (or loads the cached) extension and registers the backend."""
    from torch.utils.cpp_extension import load

    extension = load(name="chorus_cpp_backend", sources=[_SOURCE], extra_cflags=["-O2"], verbose=False)

    def create(opts, backend_options=None):
        timeout = chorus_torch._seconds(opts.timeout) or chorus_torch._DEFAULT_TIMEOUT
        python = chorus_torch.ChorusBackend(chorus_torch._form(opts.store, opts.group_rank, opts.group_size, timeout),
                                            timeout)
        api, group = python._core.c_api()
        return extension.ChorusCppBackend(python, api, group, timeout)

    dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu"])
