"""Triton fragment_norms: one norm per segment [offsets[s], offsets[s+1]) of a flat buffer.

    out[s] = ( Σ_{i in segment s} |buf[i]|^ord )^(1/ord),   ord ∈ {1, 2}

Deterministic by construction (no floating-point atomics): program (s, p) of a (K, P) grid walks
blocks p, p+P, p+2P, … of segment s (cut on the global BLOCK grid) in order, accumulating
|buf|^ord in a float64 vector, and reduces it with a fixed-shape sum (``block_sum``, what
``tl.sum`` lowers to). With P = 1 it writes the norm directly (one launch);
with P > 1 it writes a partial and a second launch sums the P partials of each segment in index
order. P depends only on (n, K, device), so repeated calls are bit-identical.

P > 1 only on a GPU, where a few large fragments would otherwise leave most SMs idle: it needs a
scratch of K·P float64 (at most a few KB, P·K ≈ 4 programs per SM), the one allocation here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import (
    GPU_BLOCK,
    block_size,
    block_sum,
    gpu_programs,
    interpreted,
    launch_options,
    on_device,
)


@triton.jit
def _fragment_norms_kernel(
    buf_ptr, offsets_ptr, out_ptr, P, ORD: tl.constexpr, FINAL: tl.constexpr, BLOCK: tl.constexpr
):
    """Program (s, p): acc = Σ_{blocks p, p+P, …} |buf|^ord in float64 (elementwise fp64 vector,
    then one block_sum). FINAL (P == 1): out[s] = acc^(1/ord); else out[s·P + p] = acc."""
    s = tl.program_id(0)
    p = tl.program_id(1)
    lo = tl.load(offsets_ptr + s)
    hi = tl.load(offsets_ptr + s + 1)
    acc = tl.full([BLOCK], 0.0, tl.float64)  # tl.zeros is @jit: see block_sum
    # Blocks sit on the global BLOCK grid, so those inside the segment are aligned and load
    # unmasked (vectorised); only the segment's first and last block need a mask.
    first = (lo // BLOCK) * BLOCK
    for start in range(first + p * BLOCK, hi, P * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        if start >= lo and start + BLOCK <= hi:
            v = tl.load(buf_ptr + offs).to(tl.float64)
        else:
            v = tl.load(buf_ptr + offs, mask=(offs >= lo) & (offs < hi), other=0.0).to(tl.float64)
        if ORD == 1:
            acc += tl.abs(v)
        else:
            acc += v * v  # exact for fp32 inputs (24x24-bit products fit in 53 bits)
    total = block_sum(acc)
    if FINAL:
        if ORD == 2:
            total = tl.sqrt(total)  # fp64: lowers to a correctly rounded sqrt
        tl.store(out_ptr + s, total)
    else:
        tl.store(out_ptr + s * P + p, total)


@triton.jit
def _fragment_norms_finish_kernel(partial_ptr, out_ptr, P, ORD: tl.constexpr, P_BLOCK: tl.constexpr):
    """out[s] = (Σ_p partial[s, p])^(1/ord), summed by one fixed-shape block_sum (zeros pad to P_BLOCK)."""
    s = tl.program_id(0)
    p = tl.arange(0, P_BLOCK)
    total = block_sum(tl.load(partial_ptr + s * P + p, mask=p < P, other=0.0))
    if ORD == 2:
        total = tl.sqrt(total)  # fp64: lowers to a correctly rounded sqrt
    tl.store(out_ptr + s, total)


def programs_per_segment(buf: torch.Tensor, n: int, nseg: int) -> int:
    """P for a (K, P) grid: 1 on the interpreter (programs run one after another there) and when
    the segments are small; on a GPU enough to give each SM a few programs, at most one block
    per program on average."""
    if interpreted(buf):
        return 1
    want = triton.cdiv(gpu_programs(buf), nseg)
    return max(1, min(want, triton.cdiv(n, nseg * GPU_BLOCK)))


def launch_fragment_norms(
    buf: torch.Tensor, offsets: torch.Tensor, ord: int, out: torch.Tensor, *, programs: int | None = None
) -> None:
    """Write the K segment norms of `buf` into `out` (float64, (K,)), K = offsets.numel() − 1.

    buf: contiguous fp32/fp64; offsets: (K+1,) int64, non-decreasing, in [0, buf.numel()], on
    buf's device; ord: 1 or 2. One launch (two when P > 1, with a K·P float64 scratch).
    programs: P, programs per segment (default ``programs_per_segment``; tests set it to run the
    two-stage path under the interpreter). Results are bit-identical for a fixed P."""
    if ord not in (1, 2):
        raise ValueError(f"ord must be 1 or 2, got {ord!r}")
    nseg = offsets.numel() - 1
    if nseg <= 0:
        return
    n = buf.numel()
    block = block_size(buf, n)
    P = programs_per_segment(buf, n, nseg) if programs is None else int(programs)
    if not 1 <= P <= 65535:  # the grid's second dimension
        raise ValueError(f"programs must be in [1, 65535], got {P}")
    with on_device(buf):
        if P == 1:
            _fragment_norms_kernel[(nseg, 1)](
                buf, offsets, out, 1, ORD=ord, FINAL=True, BLOCK=block, **launch_options(buf)
            )
            return
        partial = torch.empty(nseg * P, dtype=torch.float64, device=buf.device)
        _fragment_norms_kernel[(nseg, P)](
            buf, offsets, partial, P, ORD=ord, FINAL=False, BLOCK=block, **launch_options(buf)
        )
        _fragment_norms_finish_kernel[(nseg,)](
            partial, out, P, ORD=ord, P_BLOCK=triton.next_power_of_2(P), **launch_options(out, warps=1)
        )
