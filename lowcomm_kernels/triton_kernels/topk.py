"""Triton topk_encode / topk_decode_add: the top-k sparse wire format with error feedback, bit for
bit the specification of ``lowcomm_kernels/ops/topk.py`` (fp32 data; decode adds into fp32 or fp64).

Encode runs one program per chunk of C values, in TILE-element tiles (one tile, held in registers,
when the chunk fits; any chunk size otherwise):

1. e ← e·β + Δ (β rounded to fp32, as torch multiplies an fp32 tensor by a Python float; two
   roundings, no FMA: ``launch_options``), stored; count the non-finite values
   and take max |e| (the scale of 2 and 4 bits: the largest |e| is always selected).
2. Selection without a sort: the keys are the bits of |e| as int32 (order-preserving for finite
   floats). A bitwise threshold search finds T, the k-th largest key (31 passes, each a count of
   keys >= a candidate); every key > T is selected, and of the keys == T the k − #(> T) with the
   lowest indices (an exclusive prefix count of ties in index order): exactly the reference's
   stable descending sort with ties to the lower index.
3. The selected indices are compacted in ascending order (an exclusive prefix count of the
   selection) into a per-chunk int32 scratch row, the only global memory the launcher allocates.
   After a block barrier every step reads them back from there.
4. The 1-bit scale is a sequential fp64 sum of |e_i| over the scratch row in index order (as the
   reference's cumsum), divided by k_j and rounded to fp32. Codes and sent values are the spec's
   fp32 operations with ``tl.math.div_rn`` (Triton's ``/`` is approximate on GPUs) and round half
   to even as ``(t + 2^23) − 2^23``; e_i ← e_i − v_i.
5. Packing: codes (1, 2 or 4 bits) are packed from registers, 8/bits codes per byte; each byte of
   the index section gathers the few entries whose bits it holds from the scratch row. The scale
   is written as its four little-endian bytes (the payload is a uint8 buffer, any alignment).

A chunk holding a non-finite value is not encoded (NaN scale, indices 0..k_j−1, codes 0, e keeps
the updated values); its count is one int64 atomic add per such chunk. Decode runs one program
per chunk, each entry read from its bytes and added at jC + index; an index past its chunk (a
corrupt payload) is skipped, as the CUDA kernel does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import interpreted, launch_options, on_device

GPU_TILE = 4096  # elements of a chunk per tile on a GPU (a chunk up to this is held in registers)
INTERPRET_TILE = 65536
GPU_ENTRIES = 1024  # selected entries per tile of the quantize / decode loops on a GPU
BYTE_TILE = 256  # index-section bytes per tile of the packing loop


@triton.jit
def _isum(x):
    return tl.reduce(x.to(tl.int32), 0, tl.standard._sum_combine)


@triton.jit
def _excl_prefix(x):
    """Exclusive prefix sum of an int32 block."""
    return tl.associative_scan(x, 0, tl.standard._sum_combine) - x


@triton.jit
def _abs_key(v, m):
    """|v|'s bits as int32 (order-preserving for finite v), -1 where m is off."""
    return tl.where(m, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, -1)


@triton.jit
def _count_ge(ec, length, cand, u0, ntiles, ONE_TILE: tl.constexpr, TILE: tl.constexpr):
    """#{i < length : key_i >= cand} (u0: the keys, when the chunk is one tile)."""
    if ONE_TILE:
        cnt = _isum(u0 >= cand)
    else:
        cnt = 0
        for t in range(0, ntiles):
            i = t * TILE + tl.arange(0, TILE)
            m = i < length
            u = _abs_key(tl.load(ec + i, mask=m, other=0.0), m)
            cnt += _isum(u >= cand)
    return cnt


@triton.jit(do_not_specialize=["n", "kl", "nc", "val0"])  # one compilation per format, any n
def _topk_encode_kernel(
    delta, e, payload, scratch, nonfinite, beta, n, chunk, kf, kl, nc, val0, ibf, vbf,
    IB: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr, KT: tl.constexpr, BT: tl.constexpr,
    ONE_TILE: tl.constexpr,
):  # fmt: skip
    j = tl.program_id(0).to(tl.int64)
    off = j * chunk
    length = tl.minimum(n - off, chunk).to(tl.int32)
    kk = tl.where(j + 1 < nc, kf, kl).to(tl.int32)
    ec = e + off
    row = scratch + j * kf
    ntiles = (length + (TILE - 1)) // TILE

    # 1. e <- e·β + Δ; non-finite count; max key
    if ONE_TILE:
        i = tl.arange(0, TILE)
        m = i < length
        v = tl.load(ec + i, mask=m, other=0.0) * beta + tl.load(delta + off + i, mask=m, other=0.0)
        tl.store(ec + i, v, mask=m)
        u0 = _abs_key(v, m)
        bad = _isum(u0 >= 0x7F800000)
        top = tl.reduce(u0, 0, tl.standard._elementwise_max)
    else:
        u0 = 0
        bad = 0
        top = 0
        for t in range(0, ntiles):
            i = t * TILE + tl.arange(0, TILE)
            m = i < length
            v = tl.load(ec + i, mask=m, other=0.0) * beta + tl.load(delta + off + i, mask=m, other=0.0)
            tl.store(ec + i, v, mask=m)
            u = _abs_key(v, m)
            bad += _isum(u >= 0x7F800000)
            top = tl.maximum(top, tl.reduce(u, 0, tl.standard._elementwise_max))
        tl.debug_barrier()  # the passes below read e back by tiles

    # 2-3. the k_j selected indices, ascending, into the scratch row
    if bad == 0:
        thr = 0
        for b in range(0, 31):
            cand = thr | (1 << (30 - b))
            thr = tl.where(_count_ge(ec, length, cand, u0, ntiles, ONE_TILE, TILE) >= kk, cand, thr)
        r = kk - _count_ge(ec, length, thr + 1, u0, ntiles, ONE_TILE, TILE)  # ties to take
        ties = 0
        taken = 0
        for t in range(0, ntiles):
            i = t * TILE + tl.arange(0, TILE)
            if ONE_TILE:
                u = u0
            else:
                u = _abs_key(tl.load(ec + i, mask=i < length, other=0.0), i < length)
            eq = (u == thr).to(tl.int32)
            sel = ((u > thr) | ((eq != 0) & (_excl_prefix(eq) + ties < r))).to(tl.int32)
            tl.store(row + _excl_prefix(sel) + taken, i, mask=sel != 0)
            ties += _isum(eq)
            taken += _isum(sel)
    else:
        tl.atomic_add(nonfinite, bad.to(tl.int64))
        for t0 in range(0, kk, KT):
            tt = t0 + tl.arange(0, KT)
            tl.store(row + tt, tt, mask=tt < kk)
    tl.debug_barrier()

    # 4. scale, codes, e minus what was sent; codes packed from registers
    LQ: tl.constexpr = (1 << BITS) - 1
    if bad == 0:
        if BITS == 1:
            acc = tl.cast(0.0, tl.float64)
            for t in range(0, kk):
                acc += tl.abs(tl.load(ec + tl.load(row + t))).to(tl.float64)
            s = (acc / kk.to(tl.float64)).to(tl.float32)
        else:
            s = top.to(tl.float32, bitcast=True)
    else:
        s = float("nan")
    vals = payload + val0 + j * vbf
    PER_BYTE: tl.constexpr = 8 // BITS
    for t0 in range(0, kk, KT):
        tt = t0 + tl.arange(0, KT)
        mt = tt < kk
        c = tl.full((KT,), 0, tl.int32)
        if bad == 0:
            ii = tl.load(row + tt, mask=mt, other=0)
            w = tl.load(ec + ii, mask=mt, other=0.0)
            q = tl.where(s > 0.0, tl.math.div_rn(w, tl.where(s > 0.0, s, 1.0)), 0.0)
            q = tl.maximum((q * LQ + LQ) * 0.5, 0.0)
            q = tl.minimum((q + 8388608.0) - 8388608.0, LQ)  # round half to even, clamp
            c = q.to(tl.int32)
            sent = tl.math.div_rn((2 * c - LQ).to(tl.float32) * s, float(LQ))
            tl.store(ec + ii, w - sent, mask=mt)
        c = tl.where(mt, c, 0)
        shifted = tl.reshape(c, (KT // PER_BYTE, PER_BYTE)) << (tl.arange(0, PER_BYTE) * BITS)[None, :]
        byte = tl.reduce(shifted, 1, tl.standard._sum_combine)  # disjoint bits: sum = or
        bo = t0 // PER_BYTE + tl.arange(0, KT // PER_BYTE)
        tl.store(vals + bo, byte.to(tl.uint8), mask=bo * 8 < kk * BITS)

    # 5. the index section, each byte from the entries it holds bits of; the scale's bytes
    idxs = payload + 4 * nc + j * ibf
    nbytes = (kk.to(tl.int64) * IB + 7) // 8
    SPAN: tl.constexpr = (2 * IB + 6) // IB  # entries one byte can touch
    for b0 in range(0, nbytes, BT):
        bb = b0 + tl.arange(0, BT)
        first = (bb.to(tl.int64) * 8) // IB
        byte = tl.full((BT,), 0, tl.int32)
        for u in tl.static_range(SPAN):
            te = first + u
            x = tl.load(row + te, mask=(bb < nbytes) & (te < kk), other=0)
            shift = (te * IB - bb.to(tl.int64) * 8).to(tl.int32)  # in (-IB, 8)
            byte |= ((x >> tl.maximum(-shift, 0)) << tl.maximum(shift, 0)) & 0xFF
        tl.store(idxs + bb, byte.to(tl.uint8), mask=bb < nbytes)
    sb = tl.arange(0, 4)
    tl.store(payload + 4 * j + sb, ((s.to(tl.int32, bitcast=True) >> (sb * 8)) & 0xFF).to(tl.uint8))


@triton.jit(do_not_specialize=["n", "kl", "nc", "val0"])
def _topk_decode_kernel(
    payload, out, n, chunk, kf, kl, nc, val0, ibf, vbf,
    IB: tl.constexpr, BITS: tl.constexpr, KT: tl.constexpr,
):  # fmt: skip
    j = tl.program_id(0).to(tl.int64)
    off = j * chunk
    length = tl.minimum(n - off, chunk).to(tl.int32)
    kk = tl.where(j + 1 < nc, kf, kl).to(tl.int32)
    sb = tl.arange(0, 4)
    sbits = tl.reduce(tl.load(payload + 4 * j + sb).to(tl.int32) << (sb * 8), 0, tl.standard._sum_combine)
    s = sbits.to(tl.float32, bitcast=True)
    LQ: tl.constexpr = (1 << BITS) - 1
    idxs = payload + 4 * nc + j * ibf
    vals = payload + val0 + j * vbf
    nbytes = (kk.to(tl.int64) * IB + 7) // 8
    NB: tl.constexpr = (IB + 14) // 8  # bytes one index can touch
    for t0 in range(0, kk, KT):
        tt = t0 + tl.arange(0, KT)
        mt = tt < kk
        p = tt.to(tl.int64) * IB
        word = tl.full((KT,), 0, tl.int64)
        for u in tl.static_range(NB):
            at = (p >> 3) + u
            word |= tl.load(idxs + at, mask=mt & (at < nbytes), other=0).to(tl.int64) << (8 * u)
        i = ((word >> (p & 7)) & ((1 << IB) - 1)).to(tl.int32)
        cp = tt * BITS
        c = (tl.load(vals + (cp >> 3), mask=mt, other=0).to(tl.int32) >> (cp & 7)) & LQ
        v = tl.math.div_rn((2 * c - LQ).to(tl.float32) * s, float(LQ))
        ok = mt & (i < length)
        o = tl.load(out + off + i, mask=ok, other=0.0)
        tl.store(out + off + i, o + v.to(o.dtype), mask=ok)


def _geometry(k: int, chunk: int, bits: int, n: int) -> tuple[int, ...]:
    """(kf, kl, nc, val0, ibf, vbf, index bits): the payload layout of ops/topk.py."""
    ib = (chunk - 1).bit_length()
    nc = -(-n // chunk)
    kf, kl = min(k, chunk), min(k, n - (nc - 1) * chunk)
    ibf, vbf = (kf * ib + 7) // 8, (kf * bits + 7) // 8
    val0 = 4 * nc + (nc - 1) * ibf + (kl * ib + 7) // 8
    return kf, kl, nc, val0, ibf, vbf, ib


def _entry_tile(t: torch.Tensor, kf: int) -> int:
    cap = INTERPRET_TILE if interpreted(t) else GPU_ENTRIES
    return max(8, min(cap, triton.next_power_of_2(kf)))


def launch_topk_encode(delta, e, payload, nonfinite, k, chunk, bits, beta) -> None:
    """topk_encode on fp32 data: e (contiguous) updated in place, the payload written, the
    non-finite count added into the zeroed 0-d int64 `nonfinite`. Allocates an int32 scratch of
    min(k, chunk) per chunk; n == 0 launches nothing."""
    n = e.numel()
    if n == 0:
        return
    assert e.dtype == torch.float32 and delta.dtype == torch.float32, "the Triton top-k encodes fp32"
    kf, kl, nc, val0, ibf, vbf, ib = _geometry(k, chunk, bits, n)
    tile = min(INTERPRET_TILE if interpreted(e) else GPU_TILE, triton.next_power_of_2(chunk))
    scratch = torch.empty(nc * kf, dtype=torch.int32, device=e.device)
    # Measured on an H200 (64M values, C = 4096, 12 bytes moved per value): 2 warps 1000 GB/s, 4: 840,
    # 8: 790, 16: 430 (each of the 33 counting passes ends in a block reduction); a chunk over
    # several tiles (C = 65536): 16 warps 220 GB/s, 2: 170.
    warps = 2 if chunk <= tile else 16
    with on_device(e):
        _topk_encode_kernel[(nc,)](
            delta, e, payload, scratch, nonfinite, float(beta), n, chunk, kf, kl, nc, val0, ibf, vbf,
            IB=ib, BITS=bits, TILE=tile, KT=_entry_tile(e, kf), BT=BYTE_TILE, ONE_TILE=chunk <= tile,
            **launch_options(e, warps),
        )  # fmt: skip


def launch_topk_decode_add(out, payload, k, chunk, bits) -> None:
    """topk_decode_add into fp32 / fp64 `out` (contiguous): out[jC + i] += v. Allocates nothing."""
    n = out.numel()
    if n == 0:
        return
    kf, kl, nc, val0, ibf, vbf, ib = _geometry(k, chunk, bits, n)
    with on_device(out):
        _topk_decode_kernel[(nc,)](
            payload, out, n, chunk, kf, kl, nc, val0, ibf, vbf,
            IB=ib, BITS=bits, KT=_entry_tile(out, kf), **launch_options(out),
        )  # fmt: skip
