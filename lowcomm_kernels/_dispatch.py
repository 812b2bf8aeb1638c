"""Which backend runs an op call.

Default by device: CPU tensors -> ``cpu`` (csrc C++, when the native library loaded) else ``ref``;
CUDA tensors -> ``triton`` when Triton imports, else ``ref``. ``LOWCOMM_BACKEND`` and every op's
``backend=`` argument override the default (the argument wins); asking for a backend that cannot
run on the given device is an error, never a silent fallback.

The choice is made in every call, by the op's implementation: under ``torch.compile`` that is the
registered op's body, when the compiled code runs (never while tracing: this reads the
environment and loads libraries).
"""

from __future__ import annotations

import functools
import os

import torch

from . import _config, _native


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def available(backend: str, device: torch.device, entry: str | None = None) -> bool:
    """Can `backend` run on `device`? `entry` names the op's C ABI function (``lc_pack``): a native
    library without it (an older build) cannot run that op."""
    if backend == "ref":
        return True
    if backend == "cpu":
        lib = _native.cpu_lib()
        return device.type == "cpu" and lib is not None and (entry is None or hasattr(lib, entry))
    if backend == "triton":
        if not triton_importable():
            return False
        return device.type == "cuda" or (device.type == "cpu" and triton_interpreted())
    if backend == "cuda":
        if device.type != "cuda":
            return False
        return _native.cuda_has(entry) if entry else _native.cuda_lib() is not None
    return False


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    device = torch.device(device)
    return [b for b in _config.BACKENDS if available(b, device)]


def resolve(backend: str | None, device: torch.device, entry: str | None = None) -> str:
    """The backend that runs a call on `device` (see the module docstring)."""
    chosen = backend if backend is not None else _config.backend_override()
    if chosen is None:
        if device.type == "cpu":
            return "cpu" if available("cpu", device, entry) else "ref"
        if device.type == "cuda":
            return "triton" if available("triton", device) else "ref"
        return "ref"
    if chosen not in _config.BACKENDS:
        raise ValueError(f"backend must be one of {_config.BACKENDS}, got {chosen!r}")
    if not available(chosen, device, entry):
        why = {
            "cpu": "the native library did not load (see the import warning) or the data is not on the CPU",
            "triton": "Triton is not importable, or the data is on the CPU without TRITON_INTERPRET=1",
            "cuda": "liblowcomm_cuda was not built (LOWCOMM_WITH_CUDA=ON) or the data is not on a GPU",
        }[chosen]
        raise ValueError(f"backend {chosen!r} cannot run on {device}: {why}")
    return chosen
