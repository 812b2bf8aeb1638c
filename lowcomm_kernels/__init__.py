"""lowcomm-kernels: fused sync kernels and an overlapping runtime for DiLoCo-family training."""

from __future__ import annotations

__version__ = "0.1.0"

from . import ops  # noqa: F401  (registers torch.ops.lowcomm.*)

# Strategies, imported lazily so `import lowcomm_kernels` (ops only) stays light.
_RUNTIME_EXPORTS = (
    "DiLoCo",
    "StreamingDiLoCo",
    "CoCoDC",
    "LOSCAR",
    "WAN",
    "TensorBoardSink",
    "LoggingSink",
    "MultiSink",
)


def __getattr__(name: str):
    if name in _RUNTIME_EXPORTS:
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'lowcomm_kernels' has no attribute {name!r}")
