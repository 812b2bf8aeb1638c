"""lowcomm-kernels: fused sync kernels and an overlapping runtime for DiLoCo-family training."""

from __future__ import annotations

__version__ = "0.1.0"

from . import ops  # noqa: E402,F401  (registers torch.ops.lowcomm.*)
