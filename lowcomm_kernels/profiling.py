"""Named ranges for every op and runtime phase.

Each range is an NVTX range (``lowcomm/<name>``) for Nsight Systems when the ``nvtx`` package is
installed and a GPU is in use, and a ``torch.profiler.record_function`` range so the same phases
appear in torch profiler / Chrome traces (``lowcomm profile``). Both are near no-ops when nobody is
recording.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import _config

try:  # optional dependency
    import nvtx as _nvtx  # type: ignore[import-not-found]
except Exception:  # pragma: no cover - depends on the environment
    _nvtx = None


def _nvtx_active() -> bool:
    return _nvtx is not None and _config.nvtx_enabled() and torch.cuda.is_available()


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """``with nvtx_range("pack"):`` marks ``lowcomm/pack`` in Nsight and in torch traces."""
    full = f"lowcomm/{name}"
    use_nvtx = _nvtx_active()
    if use_nvtx:
        _nvtx.push_range(full)
    try:
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(full):
                yield
        else:
            yield
    finally:
        if use_nvtx:
            _nvtx.pop_range()
