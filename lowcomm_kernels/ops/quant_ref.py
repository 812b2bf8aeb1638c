"""quant_ref: the specification of the quantized wire formats (``quant_format``'s docstring) in
plain torch: quantize, dequantize, the quantized pack and the reduction of M chunks. Every backend
of ``ops.quantize`` equals these bit for bit."""

from __future__ import annotations

import math

import torch

from .quant_format import (
    GAMMA,
    QuantFormat,
    _blocks,
    _encode,
    _expand,
    _lsr,
    _pack_nibbles,
    _round_magnitude,
    _signed,
    _unpack,
    as_format,
    code_values,
    sr_key,
)


def sr_uniform_ref(key: int, start: int, count: int, device: torch.device | None = None) -> torch.Tensor:
    """u_i = (splitmix64(key + i·γ) >> 40) · 2^-24 for i in [start, start + count), fp32 in [0, 1).
    int64 arithmetic wraps mod 2^64, which is the unsigned arithmetic of the hash."""
    i = torch.arange(start + 1, start + count + 1, dtype=torch.int64, device=device)
    z = i * _signed(GAMMA) + _signed(key)  # splitmix64's first step, z = key + (i + 1)·γ
    z = (z ^ _lsr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _lsr(z, 27)) * _signed(0x94D049BB133111EB)
    z = z ^ _lsr(z, 31)
    return _lsr(z, 40).to(torch.float32) * 2.0**-24


def quantize_ref(
    v: torch.Tensor, fmt: str | QuantFormat, block: int, *, seed: int | None = None, round: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification (module docstring), in plain torch: (codes, scales) of v's n elements
    (flat): codes uint8 of ``fmt.payload_bytes(n)``, scales fp32 of ``fmt.num_scales(n, block)``,
    both new, on v's device. ``seed``: stochastic rounding keyed by (seed, round); None: RNE."""
    f = as_format(fmt)
    w = v.reshape(-1).to(torch.float32)
    n = w.numel()
    wb = _blocks(w, block)
    finite = torch.isfinite(wb).all(dim=1)
    amax = wb.abs().amax(dim=1) if n else wb.new_zeros(0)
    scales = torch.where(finite, amax / f.qmax, torch.full_like(amax, math.nan))
    s = _expand(scales, block, n)
    ok = torch.isfinite(s) & (s > 0)
    q = torch.where(ok, w / torch.where(ok, s, 1.0), 0.0)
    mag = q.abs().clamp_max(f.qmax)
    u = None if seed is None else sr_uniform_ref(sr_key(seed, round), 0, n, w.device)
    r = _round_magnitude(f, mag, u)
    c = _encode(f, torch.signbit(q) & ok, r)
    codes = c.to(torch.uint8) if f.bits == 8 else _pack_nibbles(c)
    return codes, scales


def dequantize_ref(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: str | QuantFormat,
    block: int,
    n: int,
    *,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """value(code_i) · s_b in fp32, then out_dtype: a new flat tensor of n elements."""
    f = as_format(fmt)
    c = _unpack(f, codes, n)
    vals = code_values(f).to(codes.device)[c]
    return (vals * _expand(scales.reshape(-1), block, n)).to(out_dtype)


def pack_quantized_ref(
    g: torch.Tensor,
    x: torch.Tensor,
    fmt: str | QuantFormat,
    block: int,
    *,
    residual: torch.Tensor | None = None,
    snapshot: bool = True,
    seed: int | None = None,
    round: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Quantized pack, the specification: (codes, scales, snapshot or None, nonfinite).

    e = g − x (+ residual) in g's dtype (a bf16 / fp16 x widened exactly to its float32 master g),
    quantized as ``quantize_ref(e)``; snapshot = x as a contiguous copy in g's dtype; nonfinite =
    #{i : fp32(e_i) is not finite} (0-d int64, the values quantized). With ``residual`` (g's dtype
    and numel), error feedback in place: residual ← e − dequant(codes, scales) in g's dtype, except
    in blocks whose scale is not finite, where the residual is left as it was."""
    f = as_format(fmt)
    d = g.reshape(-1) - x.reshape(-1).to(g.dtype)
    if residual is not None:
        d = d + residual.reshape(-1)
    codes, scales = quantize_ref(d, f, block, seed=seed, round=round)
    nonfinite = (~torch.isfinite(d.to(torch.float32))).sum(dtype=torch.int64)
    if residual is not None:
        n = d.numel()
        deq = dequantize_ref(codes, scales, f, block, n, out_dtype=g.dtype)
        keep = ~torch.isfinite(_expand(scales, block, n))
        r = residual.view(-1)
        r.copy_(torch.where(keep, r, d - deq))
    snap = x.to(g.dtype, memory_format=torch.contiguous_format, copy=True) if snapshot else None
    return codes, scales, snap, nonfinite


def reduce_quantized_ref(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: str | QuantFormat,
    block: int,
    n: int,
    *,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of M quantized chunks, requantized: codes (M, payload) uint8, scales (M, nscales) fp32.
    acc = Σ_{m=0..M−1} dequant(codes[m], scales[m]) added in fp32 in order m = 0, 1, ...; then
    acc · fp32(scale); then ``quantize_ref(acc)`` (round to nearest even). New (codes, scales)."""
    f = as_format(fmt)
    acc = torch.zeros(n, dtype=torch.float32, device=codes.device)
    for m in range(codes.shape[0]):
        acc = acc + dequantize_ref(codes[m], scales[m], f, block, n)
    acc = acc * torch.tensor(scale, dtype=torch.float32, device=codes.device)
    return quantize_ref(acc, f, block)
