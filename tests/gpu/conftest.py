"""The GPU tests: ``pytest -m gpu tests/gpu`` (``bash bench/gpu_check.sh`` runs them on a GPU machine).

Every test module here is marked ``gpu`` (``pytestmark``; tests/test_layers.py checks it), so where
torch sees no CUDA device each test is skipped with the reason (tests/conftest.py); they compare with
the tolerances of tests/conftest.py. What the CPU suite checks on CPU tensors, these check on the
device, shaped as the runtime uses the ops (buffers at odd element offsets, a non-default stream),
and the runtime as it runs on a GPU.

Set from the environment (tests/gpu/_env.py):

* ``LOWCOMM_GPU_TESTS_DEVICE=cpu``: run them on the CPU instead (the cpu backend, gloo on CPU
  tensors; a GPU-only check skips with its reason). ``bash bench/gpu_check.sh --dry-run`` does this,
  so the tests cannot rot unseen where no GPU is lent (tests/test_gpu_check.py).
* ``LOWCOMM_GPU_TESTS_BACKENDS=triton,cuda``: the backends checked (default: every backend but
  ``ref`` available on the device); a named backend that is not available fails.
* ``LOWCOMM_GPU_TESTS_BUDGET_S=N``: a test not started N seconds after collection is skipped
  ("time budget"), so a run under a time limit still ends and writes its report.

Remarks that are not failures (NaN bit patterns, a double rounding) are recorded as the test's
properties (``note: ...``) in the junit report.
"""

from __future__ import annotations

import time

import pytest

from tests.gpu import _env


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The op sweep (hundreds of cases) after every other test: under a time budget, the checks that
    exist once per op, backend or strategy are the ones that run. (A stable sort: tests/conftest.py's
    ordering of slow modules first, which runs after this, keeps it.)"""
    items.sort(key=lambda item: getattr(item, "originalname", "") == "test_op_matches_the_float64_ref")


@pytest.fixture(autouse=True)
def _time_budget() -> None:
    if _env.BUDGET_S is not None and time.monotonic() - _env.START > _env.BUDGET_S:
        pytest.skip(f"time budget: not started within {_env.BUDGET_S:.0f} s")


@pytest.fixture(scope="session")
def gpu_device():
    """The device the GPU tests run on (cuda, or the CPU when asked for)."""
    return _env.DEVICE


@pytest.fixture
def notes(record_property):
    """{key: [remark, ...]} filled by a check; recorded as the test's properties."""
    found: dict[str, list[str]] = {}
    yield found
    for key, texts in sorted(found.items()):
        record_property(f"note: {key}", "; ".join(texts))
