"""Triton pack: the send side of a dense fragment sync, one pass over g and x.

    delta[i]  = wire(g[i] − x[i])          (wire = g's dtype, or bf16)
    snapshot[i] = x[i]                     (optional; g's dtype)

x may be bf16 / fp16 beside a float32 g (its master): it is widened exactly to g's dtype on load.
    nonfinite += #{ i : delta[i] is ±inf or NaN }   (the value as written: a bf16 overflow counts)

The bf16 wire value is what ``(g - x).to(torch.bfloat16)`` gives on the data's device, NaNs
included: the difference rounded to fp32 (a no-op for fp32 data; torch rounds fp64 -> bf16 through
fp32 too), then to bf16 to nearest-even, by the same instruction or formula torch's
``c10::BFloat16(float)`` uses there (``_to_bf16``):

* CUDA, compute capability >= 8.0: c10 calls ``__float2bfloat16``, which is the PTX instruction
  ``cvt.rn.bf16.f32``; Triton's ``.to(tl.bfloat16)`` of an fp32 value emits that same instruction
  on sm_80 and sm_90 (``aot_check`` fails if the PTX of a bf16 pack lacks it), so the bits are
  torch's for every input: round to nearest-even, and a NaN becomes the canonical NaN 0x7FFF
  whatever its payload. (Triton's fp64 -> bf16 cast is *not* torch's: on sm_90 it emits the
  single rounding ``cvt.rn.bf16.f64``; the explicit ``.to(tl.float32)`` first keeps torch's two.)
* Anywhere else (the interpreter, whose own bf16 cast truncates, and GPUs before sm_80): c10's
  ``round_to_nearest_even`` by integer arithmetic on the bits (``_bf16_rne``), NaN -> 0x7FC0.
  torch's vectorised CPU conversion writes 0xFFFF for a NaN instead (and its scalar loop tails
  0x7FC0), so on the CPU a NaN's payload is the interpreter's claim, not torch's.

Reads 2·n·s bytes, writes n·(s_wire [+ s]). The count is one integer atomic per program that saw a
non-finite value (none in the normal case), so it is exact and order-independent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import (
    block_sum,
    finite_max,
    hardware_bf16,
    launch_elementwise,
    load_block,
    store_block,
)


@triton.jit
def _bf16_rne(v):
    """v (fp32/fp64) -> bf16 as c10::BFloat16 converts (torch on CUDA): round to fp32, keep the
    top 16 bits rounded to nearest-even (adding 0x7FFF plus the kept lsb carries into the exponent
    exactly when it should, overflowing to ±inf); NaN -> 0x7FC0."""
    f = v.to(tl.float32)
    bits = f.to(tl.uint32, bitcast=True)
    bits = bits + (((bits >> 16) & 1) + 0x7FFF)
    top = tl.where(f != f, 0x7FC0, bits >> 16)
    return top.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_bf16(v, HW_BF16: tl.constexpr):
    """v (fp32/fp64) -> bf16 exactly as torch's conversion on the launch's device: with HW_BF16
    (CUDA, sm_80+) the hardware's ``cvt.rn.bf16.f32`` after an fp32 rounding, as c10's
    ``__float2bfloat16``; otherwise ``_bf16_rne`` (c10's ``round_to_nearest_even``)."""
    if HW_BF16:
        return v.to(tl.float32).to(tl.bfloat16, fp_downcast_rounding="rtne")
    else:
        return _bf16_rne(v)


@triton.jit
def _pack_kernel(
    g_ptr,
    x_ptr,
    delta_ptr,
    snapshot_ptr,
    nonfinite_ptr,
    n,
    HAS_SNAPSHOT: tl.constexpr,
    WIRE_MAX: tl.constexpr,
    HW_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """delta = wire(g − x); snapshot = x; nonfinite += count(!(|delta| <= WIRE_MAX)).

    g, x: (n,) fp32/fp64; delta: (n,) of g's dtype or bf16; snapshot: (n,) of x's dtype (unused
    when HAS_SNAPSHOT is False); nonfinite: 0-d int64. WIRE_MAX is the largest finite value of the
    delta dtype: the comparison is false exactly for ±inf and NaN. HW_BF16: a bf16 delta is
    rounded by the hardware's cvt.rn.bf16.f32 (see ``_to_bf16``). Full blocks run unmasked.
    """
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    for MASKED in tl.static_range(2):  # full blocks unmasked (vector access), the partial one masked
        if (start + BLOCK > n) == MASKED:
            g = load_block(g_ptr, offs, n, MASKED)
            x = load_block(x_ptr, offs, n, MASKED).to(g.dtype)  # exact (a no-op unless x is bf16 / fp16)
            if delta_ptr.dtype.element_ty == tl.bfloat16:
                delta = _to_bf16(g - x, HW_BF16)
            else:
                delta = g - x
            store_block(delta_ptr, offs, delta, n, MASKED)
            if HAS_SNAPSHOT:
                store_block(snapshot_ptr, offs, x, n, MASKED)
            # Widening bf16 -> g's dtype is exact, so the test sees the written value. Masked lanes hold 0.
            bad = ~(tl.abs(delta.to(g.dtype)) <= WIRE_MAX)
            count = block_sum(bad.to(tl.int64))
            if count > 0:
                tl.atomic_add(nonfinite_ptr, count)


def launch_pack(
    g: torch.Tensor,
    x: torch.Tensor,
    delta: torch.Tensor,
    snapshot: torch.Tensor | None,
    nonfinite: torch.Tensor,
) -> None:
    """Fill `delta` (and `snapshot`) from g and x; add the non-finite count into `nonfinite`.

    g, x: contiguous fp32/fp64, n elements; delta: contiguous (n elements) of g's dtype or bf16;
    snapshot: None or contiguous (n elements) of x's dtype; nonfinite: 0-d int64, zeroed by the
    caller, incremented in place. All on one device. Allocates nothing; n == 0 is a no-op.
    """
    n = g.numel()
    launch_elementwise(
        _pack_kernel,
        g,
        n,
        g,
        x,
        delta,
        snapshot if snapshot is not None else delta,
        nonfinite,
        n,
        HAS_SNAPSHOT=snapshot is not None,
        WIRE_MAX=finite_max(delta.dtype),
        HW_BF16=delta.dtype == torch.bfloat16 and hardware_bf16(g),
    )
