"""Launch geometry shared by the Triton kernels.

On a GPU a program handles ``GPU_BLOCK`` elements: 2048 fp32 = 16 per thread with 4 warps, enough
for 128-bit loads and few enough registers for the 5-stream merge kernel. Under
``TRITON_INTERPRET=1`` (CPU tensors) every program is a Python-level numpy evaluation, so the cost
is per program, not per element (1M elements: ~0.05 s with 65536 per program, ~3 s with 256):
there one program takes up to ``INTERPRET_BLOCK`` elements.

Kernels here call only Triton *builtins* (``tl.full``, ``tl.reduce``, ...), never the
``@triton.jit`` helpers of ``triton.language.standard`` (``tl.sum``, ``tl.max``, ``tl.zeros``):
see ``block_sum`` for why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch
import triton
import triton.language as tl

GPU_BLOCK = 2048
GPU_WARPS = 4
INTERPRET_BLOCK = 65536
_MIN_BLOCK = 16  # tl.arange needs a power of two; tiny blocks would only add programs


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """The GPU a launch is made for when ``compiling_for`` records it without one (aot_check)."""

    sms: int
    capability: tuple[int, int]


_COMPILING_FOR: GpuTarget | None = None


@contextlib.contextmanager
def compiling_for(target: GpuTarget) -> Iterator[None]:
    """For ``aot_check`` only: inside, a launch on CPU tensors takes the geometry and options it
    would take on a GPU like `target` (block, warps, programs per SM, bf16 rounding), so that
    the launches the launchers make can be recorded, with stand-in tensors, and compiled for a
    GPU that is not there. (Recorded, not run: the kernels are replaced for that.)"""
    global _COMPILING_FOR
    saved, _COMPILING_FOR = _COMPILING_FOR, target
    try:
        yield
    finally:
        _COMPILING_FOR = saved


def interpreted(t: torch.Tensor) -> bool:
    """True when a launch on `t` runs in Triton's interpreter (dispatch allows CPU tensors only
    under TRITON_INTERPRET=1, so the device decides without reading the environment here)."""
    return t.device.type != "cuda" and _COMPILING_FOR is None


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """The context every launch on `t`'s data runs in: ``torch.cuda.device(t.device)`` for a CUDA
    tensor, a no-op for a CPU one (the interpreter).

    Triton launches on the *current* device and its current stream, not on the arguments'
    device: without this, data on cuda:1 launched while cuda:0 is current would run on cuda:0's
    stream against cuda:1's memory (a fault, or a race with cuda:1's stream). Inside it, the
    launch goes to the current stream of `t`'s device, as a torch op on `t` would."""
    if t.device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def block_size(t: torch.Tensor, n: int, gpu_block: int = GPU_BLOCK) -> int:
    """Elements per program for an elementwise pass over n elements of `t`'s device.

    Fixed on a GPU (`gpu_block`: one compiled variant); on the interpreter the smallest power of
    two covering n, capped at INTERPRET_BLOCK (no compilation there, so varying it costs nothing)."""
    if not interpreted(t):
        return gpu_block
    return max(_MIN_BLOCK, min(INTERPRET_BLOCK, triton.next_power_of_2(max(n, 1))))


def launch_options(t: torch.Tensor, warps: int = GPU_WARPS) -> dict[str, object]:
    """Compile options for a launch on `t`'s device.

    ``enable_fp_fusion=False``: no a·b+c -> FMA contraction, so each kernel rounds after every
    operation in the order the ``*_ref`` spec (and the csrc kernels, built with
    ``-ffp-contract=off``) use; results then do not depend on the Triton version (3.9 fuses by
    default and warns that 3.10 will not) and match the CPU backend bit for bit. The kernels are
    memory-bound, so the extra instructions cost nothing measurable. The interpreter ignores both
    options (it never fuses)."""
    return {"num_warps": warps if not interpreted(t) else 1, "enable_fp_fusion": False}


def launch_elementwise(kernel: Any, t: torch.Tensor, n: int, *args: object, **constexprs: object) -> None:
    """``kernel[grid](*args, **constexprs, BLOCK=...)``: one program per BLOCK of n elements, on
    `t`'s device and current stream (``on_device``), with ``launch_options(t)``; n == 0 launches
    nothing. The one launch convention of every elementwise kernel here."""
    if n == 0:
        return
    block = block_size(t, n)
    with on_device(t):
        kernel[(triton.cdiv(n, block),)](*args, **constexprs, BLOCK=block, **launch_options(t))


PROGRAMS_PER_SM = 4  # grid of the fixed-order reductions: enough programs to keep every SM busy


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def gpu_programs(t: torch.Tensor) -> int:
    """Programs of a fixed-order reduction over data on `t`'s GPU: PROGRAMS_PER_SM per SM."""
    if _COMPILING_FOR is not None:
        return PROGRAMS_PER_SM * _COMPILING_FOR.sms
    return PROGRAMS_PER_SM * sm_count(device_index(t))


@functools.cache
def capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def hardware_bf16(t: torch.Tensor) -> bool:
    """Does torch convert to bf16 with the hardware's ``cvt.rn.bf16.f32`` on `t`'s device?

    c10::BFloat16(float) calls ``__float2bfloat16`` (that instruction) in device code built for
    compute capability >= 8.0, and its own ``round_to_nearest_even`` everywhere else (the host, and
    older GPUs); the two differ only in the NaN they write (0x7FFF vs 0x7FC0). A bf16 store that
    must match torch bit for bit picks the same way (see pack's ``_to_bf16``)."""
    if interpreted(t):
        return False
    cap = _COMPILING_FOR.capability if _COMPILING_FOR is not None else capability(device_index(t))
    return cap >= (8, 0)


def finite_max(dtype: torch.dtype) -> float:
    """Largest finite value of a float dtype: |v| <= it is false exactly for inf and NaN."""
    return float(torch.finfo(dtype).max)


@triton.jit
def block_sum(x):
    """Σ over a 1-D block: exactly what ``tl.sum`` lowers to on a GPU.

    Spelled as ``tl.reduce`` with Triton's own ``_sum_combine`` because ``tl.sum`` is itself a
    ``@triton.jit`` function, decorated when ``triton`` is first imported: torch imports Triton
    early (``torch._dynamo`` probes for it), so in a process where that happened before
    ``TRITON_INTERPRET=1`` was set, ``tl.sum`` is a compiled-mode function the interpreter cannot
    call. ``tl.reduce`` is a builtin, and the interpreter maps this combine function to
    ``np.sum`` (a generic combine function would run element by element in Python)."""
    return tl.reduce(x, 0, tl.standard._sum_combine)


# Elementwise kernels run every block but the last without a mask: a masked access can only be
# vectorised when the compiler can prove the mask constant over 4 lanes, which a bound n that is
# not a multiple of 16 prevents, so a 1000003-element fragment would otherwise move 32 bits per
# load instruction instead of 128. The kernel branches once per program on "is this block full".


@triton.jit
def load_block(ptr, offs, n, MASKED: tl.constexpr):
    """ptr[offs] for a float block; with MASKED, lanes at or past n read 0."""
    if MASKED:
        return tl.load(ptr + offs, mask=offs < n, other=0.0)
    else:
        return tl.load(ptr + offs)


@triton.jit
def store_block(ptr, offs, value, n, MASKED: tl.constexpr):
    """ptr[offs] = value; with MASKED, only lanes before n."""
    if MASKED:
        tl.store(ptr + offs, value, mask=offs < n)
    else:
        tl.store(ptr + offs, value)
