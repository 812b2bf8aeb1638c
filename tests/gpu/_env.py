"""Where and what the GPU tests check, read once from the environment (see tests/gpu/conftest.py)."""

from __future__ import annotations

import os
import time

import torch

from lowcomm_kernels import _dispatch

#: LOWCOMM_GPU_TESTS_DEVICE: "cuda" (default) or "cpu" (bench/gpu_check.sh --dry-run)
DEVICE = torch.device(os.environ.get("LOWCOMM_GPU_TESTS_DEVICE") or "cuda")
ON_GPU = DEVICE.type == "cuda"
#: the tests run (rather than skip) here: a CUDA device, or the CPU asked for explicitly
RUNS = not ON_GPU or torch.cuda.is_available()
_named = [b for b in os.environ.get("LOWCOMM_GPU_TESTS_BACKENDS", "").split(",") if b]
if _named:
    BACKENDS = tuple(_named)
elif RUNS:
    BACKENDS = tuple(b for b in _dispatch.available_backends(DEVICE) if b != "ref")
else:  # nothing runs: the names the tests would have on a GPU, so that each skip is listed
    BACKENDS = ("triton", "cuda")
_budget = os.environ.get("LOWCOMM_GPU_TESTS_BUDGET_S")
#: a test not started this many seconds after collection is skipped (a run under a time limit)
BUDGET_S = float(_budget) if _budget else None
START = time.monotonic()


def require(backend: str, entry: str | None = None) -> None:
    """Fail, not skip, when a backend the run checks cannot run here: a library that was built but
    does not load is an error."""
    args = (entry,) if entry else ()
    assert _dispatch.available(backend, DEVICE, *args), f"backend {backend!r} is not available on {DEVICE}"
