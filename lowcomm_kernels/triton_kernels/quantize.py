"""Triton quantized wire formats: pack / quantize, dequantize and the quantized reduction, bit for
bit the specification of ``lowcomm_kernels/ops/quantize.py`` (and csrc/include/lowcomm/quant.h).

A program quantizes ROWS whole blocks as a (ROWS, BLOCK) tile: the block's absmax is a row
reduction, so each block is read once. Every step is an exactly rounded fp32 operation:
``tl.math.div_rn`` for w / s and max|w| / qmax (Triton's ``/`` is an approximate division on
GPUs), round half to even as ``(t + 2^23) − 2^23`` (exact for 0 <= t < 2^23; t <= 2^M+1 or qmax),
powers of two built from their bits, launches without FMA contraction (``launch_options``).
Codes decode through the format's 2^bits-entry table (``code_values``), loaded per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import interpreted, launch_options, on_device

GPU_TILE = 4096  # elements per program on a GPU (ROWS = GPU_TILE // block whole blocks)
INTERPRET_TILE = 65536


@triton.jit
def _pow2(e):
    """2^e (int32 tensor, normal range) as fp32, from its bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _hash_uniform(offs, key):
    """u_i = (splitmix64(key + i·γ) >> 40) · 2^-24 (ops/quantize.py sr_uniform_ref)."""
    z = key + (offs.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return (z >> 40).to(tl.float32) * 5.9604644775390625e-8


@triton.jit
def _quantize_tile(
    w, offs, mask, rows, nb, scales, key, u_key_offs, SR: tl.constexpr,
    BITS: tl.constexpr, IS_FLOAT: tl.constexpr, M: tl.constexpr,  # the format (ops/quantize.py)
    EMIN: tl.constexpr, QMAX: tl.constexpr, SUB_POW: tl.constexpr,
):  # fmt: skip
    """Codes (int32, one per element) of the (ROWS, BLOCK) tile w, its rows' scales (stored), and
    whether each row's scale is positive and finite."""
    abits = w.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    amax = tl.reduce(abits, 1, tl.standard._elementwise_max)
    finite = amax < 0x7F800000
    s = tl.where(finite, tl.math.div_rn(amax.to(tl.float32, bitcast=True), QMAX), float("nan"))
    tl.store(scales + rows, s, mask=rows < nb)
    ok = finite & (s > 0.0)
    s2 = tl.where(ok, s, 1.0)[:, None]
    q = tl.math.div_rn(tl.where(ok[:, None], w, 0.0), s2)
    neg = (q.to(tl.uint32, bitcast=True) >> 31).to(tl.int32)
    m = tl.minimum(tl.abs(q), QMAX)
    if IS_FLOAT:
        ew = ((m.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
        e = tl.maximum(ew, EMIN) - M
        t = m * _pow2(-e)
    else:
        t = m
    if SR:
        u = _hash_uniform(u_key_offs, key)
        lo = tl.math.floor(t)
        r = lo + tl.where(u < t - lo, 1.0, 0.0)
    else:
        r = (t + 8388608.0) - 8388608.0
    if IS_FLOAT:
        val = r * _pow2(e)
        vb = val.to(tl.uint32, bitcast=True)
        ev = ((vb >> 23) & 0xFF).to(tl.int32) - 127
        normal = (ev >= EMIN) & (val != 0.0)
        ef = tl.where(normal, ev - EMIN + 1, 0)
        mant = tl.where(
            normal, ((vb >> (23 - M)) & ((1 << M) - 1)).to(tl.int32), (val * SUB_POW).to(tl.int32)
        )
        c = (neg << (BITS - 1)) | (ef << M) | mant
    else:
        ci = r.to(tl.int32)
        c = tl.where(neg != 0, -ci, ci) & ((1 << BITS) - 1)
    c = tl.where(ok[:, None] & mask, c, 0)
    return c, s, ok


@triton.jit
def _store_codes(codes, c, rows, n, ROWS: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    if BITS == 8:
        offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        tl.store(codes + offs, c.to(tl.uint8), mask=offs < n)
    else:
        lo, hi = tl.split(tl.reshape(c, (ROWS, BLOCK // 2, 2)))
        boffs = rows[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        tl.store(codes + boffs, (lo | (hi << 4)).to(tl.uint8), mask=boffs * 2 < n)


@triton.jit
def _tile(n, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's ROWS quantization blocks: their indices, element offsets and in-range mask."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    return rows, offs, offs < n


@triton.jit
def _pack_quantized_kernel(
    g, x, res, snap, codes, scales, nonfinite, table, n, nb, key,
    HAS_X: tl.constexpr, HAS_RES: tl.constexpr, HAS_SNAP: tl.constexpr, SR: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr, IS_FLOAT: tl.constexpr, M: tl.constexpr,  # the format (ops/quantize.py)
    EMIN: tl.constexpr, QMAX: tl.constexpr, SUB_POW: tl.constexpr,
):  # fmt: skip
    rows, offs, mask = _tile(n, ROWS, BLOCK)
    if HAS_X:
        gv = tl.load(g + offs, mask=mask, other=0.0)
        xv = tl.load(x + offs, mask=mask, other=0.0).to(gv.dtype)
        e = gv - xv
        if HAS_RES:
            e = e + tl.load(res + offs, mask=mask, other=0.0)
        if HAS_SNAP:
            tl.store(snap + offs, xv, mask=mask)
    else:
        e = tl.load(g + offs, mask=mask, other=0.0)
    w = e.to(tl.float32)
    inf_or_nan = mask & ((w.to(tl.uint32, bitcast=True) & 0x7F800000) == 0x7F800000)
    bad = tl.reduce(
        tl.reduce(tl.where(inf_or_nan, 1, 0), 1, tl.standard._sum_combine), 0, tl.standard._sum_combine
    )
    if bad > 0:
        tl.atomic_add(nonfinite, bad.to(tl.int64))
    k64 = key.to(tl.int64).to(tl.uint64, bitcast=True)  # a small key arrives as int32
    c, s, ok = _quantize_tile(
        w, offs, mask, rows, nb, scales, k64, offs, SR, BITS, IS_FLOAT, M, EMIN, QMAX, SUB_POW
    )
    _store_codes(codes, c, rows, n, ROWS, BLOCK, BITS)
    if HAS_RES:
        deq = (tl.load(table + c) * s[:, None]).to(e.dtype)
        old = tl.load(res + offs, mask=mask, other=0.0)
        tl.store(res + offs, tl.where(tl.abs(s[:, None]) < float("inf"), e - deq, old), mask=mask)


@triton.jit
def _dequant(codes, scales, table, offs, mask, QBLOCK: tl.constexpr, BITS: tl.constexpr):
    if BITS == 8:
        c = tl.load(codes + offs, mask=mask, other=0).to(tl.int32)
    else:
        c = (
            tl.load(codes + offs // 2, mask=mask, other=0).to(tl.int32) >> ((offs & 1) * 4).to(tl.int32)
        ) & 0xF
    return tl.load(table + c) * tl.load(scales + offs // QBLOCK, mask=mask, other=0.0)


@triton.jit
def _dequantize_kernel(
    codes, scales, table, out, n, QBLOCK: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offs < n
    v = _dequant(codes, scales, table, offs, mask, QBLOCK, BITS)
    tl.store(out + offs, v.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_kernel(
    codes, scales, table, out_codes, out_scales, n, nb, nrows, pstride, sstride, scale,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
    BITS: tl.constexpr, IS_FLOAT: tl.constexpr, M: tl.constexpr,  # the format (ops/quantize.py)
    EMIN: tl.constexpr, QMAX: tl.constexpr, SUB_POW: tl.constexpr,
):  # fmt: skip
    rows, offs, mask = _tile(n, ROWS, BLOCK)
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for j in range(nrows):
        acc = acc + _dequant(codes + j * pstride, scales + j * sstride, table, offs, mask, BLOCK, BITS)
    acc = acc * scale
    c, s, ok = _quantize_tile(
        acc, offs, mask, rows, nb, out_scales, 0, offs, False, BITS, IS_FLOAT, M, EMIN, QMAX, SUB_POW
    )
    _store_codes(out_codes, c, rows, n, ROWS, BLOCK, BITS)


def _rows(t: torch.Tensor, block: int) -> int:
    tile = INTERPRET_TILE if interpreted(t) else GPU_TILE
    return max(1, tile // block)


# The launchers take the format as its decoding table (a 2^bits fp32 tensor on the data's device)
# and constants ``fmt`` = dict(BITS, IS_FLOAT, M, EMIN, QMAX, SUB_POW = 2^(M − EMIN)), and the
# stochastic-rounding stream as its signed 64-bit key (0 without): ops/quantize.py forms them.


def launch_pack_quantized(
    g, x, residual, snapshot, codes, scales, nonfinite, table, fmt, block, sr, key
) -> None:
    """Quantize g (x None) or g − x (+ residual) per block into codes / scales; snapshot, residual
    and the non-finite count (added into the zeroed 0-d int64 `nonfinite`) as ops/quantize.py
    specifies. Tensors contiguous on one device; allocates nothing."""
    n = g.numel()
    nb = -(-n // block)
    rows = _rows(g, block)
    with on_device(g):
        _pack_quantized_kernel[(triton.cdiv(nb, rows),)](
            g,
            x if x is not None else g,
            residual if residual is not None else g,
            snapshot if snapshot is not None else g,
            codes,
            scales,
            nonfinite,
            table,
            n,
            nb,
            key,
            HAS_X=x is not None,
            HAS_RES=residual is not None,
            HAS_SNAP=snapshot is not None,
            SR=bool(sr),
            ROWS=rows,
            BLOCK=block,
            **fmt,
            **launch_options(g),
        )


def launch_dequantize(codes, scales, out, table, fmt, block) -> None:
    n = out.numel()
    tile = INTERPRET_TILE if interpreted(out) else GPU_TILE
    with on_device(out):
        _dequantize_kernel[(triton.cdiv(n, tile),)](
            codes,
            scales,
            table,
            out,
            n,
            QBLOCK=block,
            BITS=fmt["BITS"],
            TILE=tile,
            **launch_options(out),
        )


def launch_reduce_quantized(codes, scales, out_codes, out_scales, table, fmt, block, n, scale) -> None:
    nb = -(-n // block)
    rows = _rows(codes, block)
    with on_device(codes):
        _reduce_kernel[(triton.cdiv(nb, rows),)](
            codes,
            scales,
            table,
            out_codes,
            out_scales,
            n,
            nb,
            codes.shape[0],
            codes.shape[1],
            scales.shape[1],
            float(scale),
            ROWS=rows,
            BLOCK=block,
            **fmt,
            **launch_options(codes),
        )
