"""Triton pack: the send side of a dense fragment sync, one pass over g and x.

    delta[i]  = wire(g[i] − x[i])          (wire = g's dtype, or bf16)
    snapshot[i] = x[i]                     (optional)
    nonfinite += #{ i : delta[i] is ±inf or NaN }   (the value as written: a bf16 overflow counts)

The bf16 wire value is what ``(g - x).to(torch.bfloat16)`` gives: the difference rounded to fp32
(a no-op for fp32 data; torch rounds fp64 -> bf16 through fp32 too), then to bf16 to nearest-even
by integer arithmetic on the bits (``_bf16_rne``), NaN -> 0x7FC0 as c10 does. Doing it by hand makes
the result independent of how a Triton version lowers the cast, and exact under the interpreter
(whose own ``.to(tl.bfloat16)`` truncates).

Reads 2·n·s bytes, writes n·(s_wire [+ s]). The count is one integer atomic per program that saw a
non-finite value (none in the normal case), so it is exact and order-independent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import (
    block_size,
    block_sum,
    finite_max,
    launch_options,
    load_block,
    on_device,
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
def _pack_block(
    g_ptr,
    x_ptr,
    delta_ptr,
    snapshot_ptr,
    nonfinite_ptr,
    offs,
    n,
    HAS_SNAPSHOT: tl.constexpr,
    WIRE_MAX: tl.constexpr,
    MASKED: tl.constexpr,
):
    g = load_block(g_ptr, offs, n, MASKED)
    x = load_block(x_ptr, offs, n, MASKED)
    if delta_ptr.dtype.element_ty == tl.bfloat16:
        delta = _bf16_rne(g - x)
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
    BLOCK: tl.constexpr,
):
    """delta = wire(g − x); snapshot = x; nonfinite += count(!(|delta| <= WIRE_MAX)).

    g, x: (n,) fp32/fp64; delta: (n,) of g's dtype or bf16; snapshot: (n,) of x's dtype (unused
    when HAS_SNAPSHOT is False); nonfinite: 0-d int64. WIRE_MAX is the largest finite value of the
    delta dtype: the comparison is false exactly for ±inf and NaN. Full blocks run unmasked.
    """
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        _pack_block(
            g_ptr, x_ptr, delta_ptr, snapshot_ptr, nonfinite_ptr, offs, n, HAS_SNAPSHOT, WIRE_MAX, False
        )
    else:
        _pack_block(
            g_ptr, x_ptr, delta_ptr, snapshot_ptr, nonfinite_ptr, offs, n, HAS_SNAPSHOT, WIRE_MAX, True
        )


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
    if n == 0:
        return
    block = block_size(g, n)
    with on_device(g):
        _pack_kernel[(triton.cdiv(n, block),)](
            g,
            x,
            delta,
            snapshot if snapshot is not None else delta,
            nonfinite,
            n,
            HAS_SNAPSHOT=snapshot is not None,
            WIRE_MAX=finite_max(delta.dtype),
            BLOCK=block,
            **launch_options(g),
        )
