"""Plumbing shared by the op modules: calling the csrc ABI, and the eager fast path.

Eager calls go straight to the implementation (~3 µs); only under ``torch.compile`` do they go
through the registered ``torch.ops.lowcomm.*`` op, whose dispatcher costs ~22 µs per call
(BUILD-NOTES.md), which matters for per-fragment calls.
"""

from __future__ import annotations

import torch

from .. import _native


def compiling() -> bool:
    return torch.compiler.is_compiling()


def cpu_call(name: str, *args: object) -> None:
    lib = _native.cpu_lib()
    assert lib is not None, "dispatch chose 'cpu' without the native library"
    _native.check(getattr(lib, name)(*args), name)


def cuda_call(name: str, device: torch.device, *args: object) -> None:
    lib = _native.cuda_lib()
    assert lib is not None, "dispatch chose 'cuda' without liblowcomm_cuda"
    cuda_name = name.replace("lc_", "lc_cuda_", 1)
    _native.check(getattr(lib, cuda_name)(*args, _native.stream_ptr(device)), cuda_name)


def code(t: torch.Tensor) -> int:
    return _native.DTYPE_CODE[t.dtype]


def ptr(t: torch.Tensor | None) -> int | None:
    return _native.ptr(t)
