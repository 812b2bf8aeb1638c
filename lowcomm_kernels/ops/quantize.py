"""quantize: compressed wire formats (8-bit and 4-bit codes with one fp32 scale per block).

Formats (``FORMATS``): ``int8`` (qmax 127), ``int4`` (qmax 7), ``fp8_e4m3`` (torch.float8_e4m3fn,
qmax 448), ``fp8_e5m2`` (torch.float8_e5m2, qmax 57344), ``fp4_e2m1`` (grid {0, .5, 1, 1.5, 2, 3, 4,
6} with a sign, qmax 6), ``fp4_e3m0`` (1 sign, 3 exponent bits of bias 3, no mantissa: grid {0, .25,
.5, 1, 2, 4, 8, 16} with a sign, qmax 16; the Streaming DiLoCo paper's FP4). A flat buffer v of n
elements is cut into blocks of ``block`` consecutive elements (a power of two >= 2; the last block
may be short). Every backend computes, bit for bit:

    w      = v rounded to fp32 (RNE; exact for fp32 / bf16 / fp16 v, one rounding for fp64 v)
    s_b    = max_{i in b} |w_i| / qmax                       (fp32 division, correctly rounded)
             NaN when the block holds a non-finite w_i (so the receiver's non-finite check fires)
    q_i    = w_i / s_b                                       (fp32 division)
    m_i    = min(|q_i|, qmax)
    code_i = sign(q_i) · round(m_i) onto the format's grid: with spacing h = 1 (int), or
             h = 2^(max(floor(log2 m_i), emin) − M) (float: M mantissa bits, emin the smallest
             normal exponent), round(m) = rint(m / h) · h, round half to even; m / h and the
             product are exact in fp32. (M = 0, fp4_e3m0: h = 2^max(floor(log2 m), emin), m / h
             in [1, 2) rounds to 1 or 2, so a tie 1.5 · 2^k goes up to 2^(k+1), and m < 2^emin to 0
             or 2^emin with the tie 2^(emin−1) going to 0: "even" is that of rint(m / h).)
    code_i = 0 for every element of a block whose s_b is not a positive finite number (an all-zero
             block, a block so tiny that max|w| / qmax underflows to 0, or a non-finite block).

Stochastic rounding (``seed`` given) replaces rint(t) with floor(t) + [u_i < t − floor(t)],
u_i = (splitmix64(key + i·γ) >> 40) · 2^-24, where i is the element's index in the flat buffer,
γ = 0x9E3779B97F4A7C15 and key = splitmix64(splitmix64(seed ^ 0x5155414E54495A45) ^ round)
(``sr_key``, exact 64-bit integer arithmetic): a counter-based hash, so every backend, thread and
device draws the same u_i for (seed, round, i) with no RNG state, and E[code·s] = w (unbiased)
away from the clamp at qmax.

Codes: int formats store the two's complement of the integer code (8 or 4 bits); float formats the
sign, biased exponent and mantissa bits (fp8: exactly torch's float8 bits, −0 included; fp4 e2m1:
the OCP MX encoding, sign in bit 3; fp4 e3m0: sign in bit 3, the exponent field in bits 0-2, field 0
the value ±0, every code finite). 4-bit codes are packed two per byte, element 2j in the low
nibble of byte j, 2j+1 in the high nibble (a zero nibble pads an odd n). Dequantisation is
``value(code_i) · s_b`` in fp32 (NaN for the whole of a non-finite block), then ``out_dtype``.

Wire bytes per fragment: ``fmt.wire_bytes(n, block)`` = payload + 4 · ceil(n / block).
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import torch
import torch.nn.functional as F

from .. import _checks, _dispatch, wire_formats
from ..profiling import nvtx_range
from . import outer_merge as _outer_merge
from . import sparse as _sparse
from ._common import code, compiling, declare, launch, launcher, native, traced_call

_M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: the stride of the per-element counter
_SR_SALT = 0x5155414E54495A45  # keeps the rounding stream apart from mask_indices' keys of one seed


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """One wire format: ``bits`` per code (8 or 4), ``kind`` "int" or "float", ``qmax`` the largest
    magnitude of its code grid; float formats have ``exp_bits`` / ``man_bits`` and ``emin``, the
    exponent of the smallest normal value (1 − bias)."""

    name: str
    bits: int
    kind: str
    qmax: float
    exp_bits: int = 0
    man_bits: int = 0

    @property
    def emin(self) -> int:
        return wire_formats.float_emin(self.exp_bits) if self.kind == "float" else 0

    def payload_bytes(self, n: int) -> int:
        """Bytes of the packed codes of n elements (4-bit formats: two codes per byte)."""
        return n if self.bits == 8 else (n + 1) // 2

    def num_scales(self, n: int, block: int) -> int:
        """Scales (one fp32 per block) of n elements: ceil(n / block)."""
        return -(-n // block)

    def wire_bytes(self, n: int, block: int) -> int:
        """Bytes on the wire for n elements: the payload plus 4 per scale."""
        return self.payload_bytes(n) + 4 * self.num_scales(n, block)


#: The quantized rows of ``wire_formats.TABLE``, in abi.h's LC_Q_* order.
FORMATS: dict[str, QuantFormat] = {
    s.name: QuantFormat(s.name, s.bits, s.grid, s.qmax, exp_bits=s.exp_bits, man_bits=s.man_bits)
    for s in wire_formats.QUANTIZED
}


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A quantized flat buffer as it crosses the wire: ``codes`` (uint8, ``fmt.payload_bytes(n)``),
    ``scales`` (fp32, ``fmt.num_scales(n, block)``), the format (a name in ``FORMATS`` or a
    QuantFormat) and the block size. ``outer_merge_`` and ``sparse_scatter_merge_`` accept one in
    place of the averaged delta and dequantize it inside the merge."""

    codes: torch.Tensor
    scales: torch.Tensor
    fmt: str | QuantFormat
    block: int


def as_format(fmt: str | QuantFormat) -> QuantFormat:
    """The QuantFormat named by `fmt` (or `fmt` itself). ValueError naming fmt if unknown."""
    if isinstance(fmt, QuantFormat) and FORMATS.get(fmt.name) == fmt:
        return fmt
    if isinstance(fmt, str) and fmt in FORMATS:
        return FORMATS[fmt]
    raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {fmt!r}")


# ---- the stochastic-rounding hash -----------------------------------------------------------------


def _splitmix64(z: int) -> int:
    z = (z + GAMMA) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def sr_key(seed: int, round: int) -> int:
    """The 64-bit key of the rounding stream of (seed, round) (see the module docstring)."""
    return _splitmix64(_splitmix64((seed ^ _SR_SALT) & _M64) ^ (round & _M64))


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def sr_uniform_ref(key: int, start: int, count: int, device: torch.device | None = None) -> torch.Tensor:
    """u_i = (splitmix64(key + i·γ) >> 40) · 2^-24 for i in [start, start + count), fp32 in [0, 1).
    int64 arithmetic wraps mod 2^64, which is the unsigned arithmetic of the hash."""
    i = torch.arange(start + 1, start + count + 1, dtype=torch.int64, device=device)
    z = i * _signed(GAMMA) + _signed(key)  # splitmix64's first step, z = key + (i + 1)·γ
    z = (z ^ _lsr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _lsr(z, 27)) * _signed(0x94D049BB133111EB)
    z = z ^ _lsr(z, 31)
    return _lsr(z, 40).to(torch.float32) * 2.0**-24


# ---- the grid -------------------------------------------------------------------------------------


def _spacing(f: QuantFormat, m: torch.Tensor) -> torch.Tensor:
    """Grid spacing h at magnitudes m (fp32, >= 0): 1 for ints, 2^(max(floor(log2 m), emin) − M)."""
    if f.kind == "int":
        return torch.ones_like(m)
    _, e = torch.frexp(m)  # m = mant · 2^e, mant in [0.5, 1): floor(log2 m) = e − 1 (m = 0: e = 0)
    return torch.ldexp(torch.ones_like(m), (e - 1).clamp_min(f.emin) - f.man_bits)


def _round_magnitude(f: QuantFormat, m: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """m (fp32, in [0, qmax]) rounded onto the grid: to nearest even, or stochastically with u."""
    h = _spacing(f, m)
    t = m / h  # exact: h is a power of two and m / h stays normal
    if u is None:
        r = torch.round(t)  # half to even
    else:
        lo = torch.floor(t)
        r = lo + (u < t - lo).to(torch.float32)
    return r * h  # a grid point, <= qmax (qmax is one and m <= qmax)


def _encode(f: QuantFormat, neg: torch.Tensor, mag: torch.Tensor) -> torch.Tensor:
    """Code bits (int64, `f.bits` wide) of the grid value ±mag."""
    if f.kind == "int":
        c = torch.where(neg, -mag, mag).to(torch.int64)
        return c & ((1 << f.bits) - 1)
    _, e = torch.frexp(mag)
    normal = mag >= 2.0**f.emin
    exp_field = torch.where(normal, e - 1 - f.emin + 1, 0)
    top = torch.where(normal, e - 1, f.emin)  # mag = (implicit + mant / 2^M) · 2^top
    mant = torch.ldexp(mag, f.man_bits - top).to(torch.int64) - torch.where(normal, 1 << f.man_bits, 0)
    return (neg.to(torch.int64) << (f.bits - 1)) | (exp_field.to(torch.int64) << f.man_bits) | mant


def code_values(fmt: str | QuantFormat) -> torch.Tensor:
    """value(code) for every code of the format, fp32 (2^bits entries): the decoding table."""
    f = as_format(fmt)
    c = torch.arange(1 << f.bits, dtype=torch.int64)
    if f.kind == "int":
        return torch.where(c >= 1 << (f.bits - 1), c - (1 << f.bits), c).to(torch.float32)
    sign = torch.where(c >> (f.bits - 1) == 1, -1.0, 1.0)
    ef = (c >> f.man_bits) & ((1 << f.exp_bits) - 1)
    mant = (c & ((1 << f.man_bits) - 1)).to(torch.float64)
    implicit = (ef > 0).to(torch.float64)
    exponent = torch.where(ef > 0, ef - 1 + f.emin, f.emin)
    v = sign * torch.ldexp(implicit + mant / (1 << f.man_bits), exponent)
    if f.name == "fp8_e4m3":
        v[0x7F], v[0xFF] = math.nan, math.nan  # e4m3fn's only NaNs (never produced: m <= qmax)
    if f.name == "fp8_e5m2":
        v[(ef == 31)] = math.nan  # inf / NaN encodings (never produced)
        v[0x7C], v[0xFC] = math.inf, -math.inf
    return v.to(torch.float32)


def _pack_nibbles(c: torch.Tensor) -> torch.Tensor:
    c = F.pad(c, (0, c.numel() % 2)).view(-1, 2)
    return (c[:, 0] | (c[:, 1] << 4)).to(torch.uint8)


def _unpack(f: QuantFormat, codes: torch.Tensor, n: int) -> torch.Tensor:
    """The n codes (int64) of a payload."""
    c = codes.reshape(-1).to(torch.int64)
    if f.bits == 4:
        c = torch.stack([c & 0xF, c >> 4], dim=1).reshape(-1)
    return c[:n]


def _blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    """w (flat) as (nblocks, block), the short last block padded with zeros."""
    nb = -(-w.numel() // block)
    return F.pad(w, (0, nb * block - w.numel())).view(nb, block)


def _expand(s: torch.Tensor, block: int, n: int) -> torch.Tensor:
    return s.repeat_interleave(block)[:n]


# ---- the specification ----------------------------------------------------------------------------


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


def outer_merge_quantized_ref(
    g: torch.Tensor, u: torch.Tensor, delta_avg: Quantized, x: torch.Tensor,
    x_sent: torch.Tensor | None = None, **kwargs: object,
) -> None:  # fmt: skip
    """``outer_merge_ref`` with Δ̄ = dequantize_ref(delta_avg) in g's dtype (in place on g, u, x)."""
    f = as_format(delta_avg.fmt)
    d = dequantize_ref(delta_avg.codes, delta_avg.scales, f, delta_avg.block, g.numel(), out_dtype=g.dtype)
    _outer_merge.outer_merge_ref(g, u, d, x, x_sent, **kwargs)


def sparse_scatter_merge_quantized_ref(
    x: torch.Tensor, idx: torch.Tensor, avg: Quantized, sent: torch.Tensor, *, beta: float = 1.0
) -> None:
    """``sparse_scatter_merge_ref`` with avg = dequantize_ref(avg) (k values) in x's dtype."""
    f = as_format(avg.fmt)
    a = dequantize_ref(avg.codes, avg.scales, f, avg.block, idx.numel(), out_dtype=sent.dtype)
    _sparse.sparse_scatter_merge_ref(x, idx, a, sent, beta=beta)


# ---- launchers (n >= 1, checked arguments) --------------------------------------------------------
# pack_quantized: x None quantizes g itself (quantize); residual / snapshot None when not wanted;
# writes codes, scales, nonfinite (a zeroed 0-d int64), the residual and the snapshot.
# dequantize: out (n). reduce_quantized: out_codes / out_scales. The merges: in place, λ absolute
# (lam_sums is None: the normalized mode dequantizes first and runs the dense merge).

_FMT_CODE = {s.name: s.abi for s in wire_formats.QUANTIZED}  # abi.h LC_Q_*


def _seed(sr: bool, seed: int) -> int | None:
    return seed if sr else None


@launcher("pack_quantized", "ref")
def _(g, x, residual, snapshot, codes, scales, nonfinite, fmt, block, sr, seed, round):
    if x is None:
        c, s = quantize_ref(g, fmt, block, seed=_seed(sr, seed), round=round)
        nf = (~torch.isfinite(g.reshape(-1).to(torch.float32))).sum(dtype=torch.int64)
    else:
        c, s, snap, nf = pack_quantized_ref(
            g,
            x,
            fmt,
            block,
            residual=residual,
            snapshot=snapshot is not None,
            seed=_seed(sr, seed),
            round=round,
        )
        if snapshot is not None:
            snapshot.view(-1).copy_(snap.view(-1))
    codes.copy_(c)
    scales.copy_(s)
    nonfinite.copy_(nf)


@launcher("dequantize", "ref")
def _(codes, scales, out, fmt, block):
    out.view(-1).copy_(dequantize_ref(codes, scales, fmt, block, out.numel(), out_dtype=out.dtype))


@launcher("reduce_quantized", "ref")
def _(codes, scales, out_codes, out_scales, fmt, block, n, scale):
    c, s = reduce_quantized_ref(codes, scales, fmt, block, n, scale=scale)
    out_codes.copy_(c)
    out_scales.copy_(s)


@launcher("outer_merge_quantized", "ref")
def _(g, u, codes, scales, fmt, block, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_sums):
    step = {"lr": lr, "momentum": momentum, "nesterov": nesterov, "alpha": alpha, "beta": beta, "lam": lam}
    outer_merge_quantized_ref(g, u, Quantized(codes, scales, fmt, block), x, x_sent, **step)


@launcher("sparse_scatter_merge_quantized", "ref")
def _(x, idx, codes, scales, fmt, block, sent, beta):
    sparse_scatter_merge_quantized_ref(x, idx, Quantized(codes, scales, fmt, block), sent, beta=beta)


native(
    "pack_quantized",
    "lc_pack_quantized",
    lambda g, x, residual, snapshot, codes, scales, nonfinite, fmt, block, sr, seed, round: (
        code(g if x is None else x),
        _FMT_CODE[fmt],
        g,
        x,
        residual,
        snapshot,
        g.numel(),
        block,
        int(sr),
        _signed(sr_key(seed, round)) if sr else 0,
        codes,
        scales,
        nonfinite,
    ),
)
native(
    "dequantize",
    "lc_dequantize",
    lambda codes, scales, out, fmt, block: (
        _FMT_CODE[fmt],
        codes,
        scales,
        out.numel(),
        block,
        code(out),
        out,
    ),
)
native(
    "reduce_quantized",
    "lc_reduce_quantized",
    lambda codes, scales, out_codes, out_scales, fmt, block, n, scale: (
        _FMT_CODE[fmt],
        codes,
        scales,
        codes.shape[0],
        n,
        block,
        scale,
        out_codes,
        out_scales,
    ),
)


def _triton_module():
    """Imported at each launch, as ``_common.triton`` does (Triton decides interpretation then)."""
    return importlib.import_module("lowcomm_kernels.triton_kernels.quantize")


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _triton_fmt(fmt: str, device: torch.device) -> tuple[torch.Tensor, dict[str, object]]:
    """The decoding table on `device` (cached) and the kernels' constants of the format."""
    f = FORMATS[fmt]
    if (fmt, device) not in _TABLES:
        _TABLES[(fmt, device)] = code_values(f).to(device)
    consts = {"BITS": f.bits, "IS_FLOAT": f.kind == "float", "M": f.man_bits, "EMIN": f.emin, "QMAX": f.qmax}
    return _TABLES[(fmt, device)], {**consts, "SUB_POW": float(2.0 ** (f.man_bits - f.emin))}


@launcher("pack_quantized", "triton")
def _(g, x, residual, snapshot, codes, scales, nonfinite, fmt, block, sr, seed, round):
    table, consts = _triton_fmt(fmt, g.device)
    key = _signed(sr_key(seed, round)) if sr else 0
    _triton_module().launch_pack_quantized(
        g, x, residual, snapshot, codes, scales, nonfinite, table, consts, block, sr, key
    )


@launcher("dequantize", "triton")
def _(codes, scales, out, fmt, block):
    table, consts = _triton_fmt(fmt, out.device)
    _triton_module().launch_dequantize(codes, scales, out, table, consts, block)


@launcher("reduce_quantized", "triton")
def _(codes, scales, out_codes, out_scales, fmt, block, n, scale):
    table, consts = _triton_fmt(fmt, codes.device)
    _triton_module().launch_reduce_quantized(
        codes, scales, out_codes, out_scales, table, consts, block, n, scale
    )


def _merge_c_args(
    g, u, codes, scales, fmt, block, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_sums
):
    return (
        code(x),
        _FMT_CODE[fmt],
        g,
        u,
        codes,
        scales,
        block,
        x,
        x_sent,
        g.numel(),
        lr,
        momentum,
        int(nesterov),
        alpha,
        beta,
        lam,
        lam_sums,
    )


native("outer_merge_quantized", "lc_outer_merge_quantized", _merge_c_args)
native(
    "sparse_scatter_merge_quantized",
    "lc_sparse_scatter_merge_quantized",
    lambda x, idx, codes, scales, fmt, block, sent, beta: (
        code(x),
        _FMT_CODE[fmt],
        x,
        idx,
        idx.numel(),
        codes,
        scales,
        block,
        sent,
        beta,
    ),
)


# ---- checks ---------------------------------------------------------------------------------------

_KEY = " (a non-negative int64: the registered op carries it as one)"


MAX_BLOCK = 1 << 40  # the largest block the ops accept


def check_block(block: object, name: str = "block") -> int:
    """A power of two in [2, MAX_BLOCK] (two 4-bit codes per byte need an even block); the
    strategies check their ``quant_block`` with it at construction (runtime.compression)."""
    if isinstance(block, bool) or not isinstance(block, int):
        raise TypeError(f"{name} must be an int, got {type(block).__name__}")
    if block < 2 or block & (block - 1):
        raise ValueError(f"{name} must be a power of two >= 2, got {block}")
    if block > MAX_BLOCK:
        raise ValueError(f"{name} must be <= 2**40, got {block}")
    return block


def _check_fmt_block(fmt: object, block: object) -> tuple[QuantFormat, int]:
    f = as_format(fmt)
    block = check_block(_checks.integer("block", block))  # a 1-element integer tensor too
    return f, block


def _check_wire(
    f: QuantFormat,
    block: int,
    n: int,
    codes: object,
    scales: object,
    device,
    prefix: str = "",
    suffix: str = "",
) -> None:
    """codes: uint8 of f.payload_bytes(n); scales: fp32 of f.num_scales(n, block); on `device`.
    Errors name them ``{prefix}codes{suffix}`` and ``{prefix}scales{suffix}``."""
    cname, sname = f"{prefix}codes{suffix}", f"{prefix}scales{suffix}"
    c = _checks.tensor(cname, codes, dtypes=(torch.uint8,))
    s = _checks.tensor(sname, scales, dtypes=(torch.float32,))
    if c.numel() != f.payload_bytes(n):
        raise ValueError(
            f"{cname} has {c.numel()} bytes; {f.name} codes of n = {n} elements take {f.payload_bytes(n)}"
        )
    if s.numel() != f.num_scales(n, block):
        raise ValueError(
            f"{sname} has {s.numel()} elements; n = {n} in blocks of {block} takes {f.num_scales(n, block)}"
        )
    for name, t in ((cname, c), (sname, s)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the data is on {device}")


def _check_seed(sr: object, seed: object, round: object) -> tuple[bool, int, int]:
    sr = _checks.flag("sr", sr)
    seed = _checks.integer("seed", seed, lo=0, hi=(1 << 63) - 1, why=_KEY)
    round = _checks.integer("round", round, lo=0, hi=(1 << 63) - 1, why=_KEY)
    return sr, seed, round


# ---- implementations (the registered ops' bodies and the eager paths) ------------------------------


def _pack_quantized_impl(
    g: torch.Tensor,
    x: torch.Tensor | None,
    residual: torch.Tensor | None,
    snapshot: torch.Tensor | None,
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: str,
    block: int,
    sr: bool,
    seed: int,
    round: int,
    backend: str | None,
) -> torch.Tensor:
    """Check, choose the backend, launch (quantize when x is None). Returns the 0-d int64
    non-finite count."""
    f, block = _check_fmt_block(fmt, block)
    sr, seed, round = _check_seed(sr, seed, round)
    name = "v" if x is None else "g"
    if x is None:
        _checks.tensor("v", g, dtypes=_checks.PARAM_DTYPES)
    else:
        _checks.tensor("x", x, dtypes=_checks.PARAM_DTYPES)
        _checks.tensor("g", g, dtypes=_checks.FLOAT_DTYPES)
        _checks.params_of("x", x, "g", g)
        _checks.same_device("g", g, x=x)
        _checks.same_numel("g", g, x=x)
        for oname, t in (("residual", residual), ("snapshot_out", snapshot)):
            if t is not None:
                _checks.tensor(oname, t, dtypes=(g.dtype,))
                _checks.same_device("g", g, **{oname: t})
                _checks.same_numel("g", g, **{oname: t})
    _check_wire(
        f,
        block,
        g.numel(),
        codes,
        scales,
        g.device,
    )
    _checks.distinct(
        {name: g, "x": x, "residual": residual, "snapshot_out": snapshot, "codes": codes, "scales": scales}
    )
    b = _dispatch.resolve(backend, g.device, "lc_pack_quantized")
    nonfinite = torch.zeros((), dtype=torch.int64, device=g.device)
    if g.numel():
        with nvtx_range("pack_quantized"):
            launch(
                "pack_quantized",
                b,
                g,
                x,
                residual,
                snapshot,
                codes,
                scales,
                nonfinite,
                f.name,
                block,
                sr,
                seed,
                round,
            )
    return nonfinite


_pack_quantized_op = torch.library.custom_op(
    "lowcomm::pack_quantized", _pack_quantized_impl, mutates_args=("residual", "snapshot", "codes", "scales")
)


@_pack_quantized_op.register_fake
def _(g, x, residual, snapshot, codes, scales, fmt, block, sr, seed, round, backend):
    _checks.same_device("g", g, x=x, residual=residual, snapshot_out=snapshot, codes=codes, scales=scales)
    return g.new_empty((), dtype=torch.int64)


def _dequantize_impl(
    codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, fmt: str, block: int, backend: str | None
) -> None:
    f, block = _check_fmt_block(fmt, block)
    _checks.tensor("out", out, dtypes=_checks.PARAM_DTYPES)
    _check_wire(f, block, out.numel(), codes, scales, out.device)
    _checks.distinct({"codes": codes, "scales": scales, "out": out})
    b = _dispatch.resolve(backend, out.device, "lc_dequantize")
    if out.numel():
        with nvtx_range("dequantize"):
            launch("dequantize", b, codes, scales, out, f.name, block)


_dequantize_op = torch.library.custom_op("lowcomm::dequantize", _dequantize_impl, mutates_args=("out",))


@_dequantize_op.register_fake
def _(codes, scales, out, fmt, block, backend):
    _checks.same_device("out", out, codes=codes, scales=scales)


def _reduce_quantized_impl(
    codes: torch.Tensor,
    scales: torch.Tensor,
    out_codes: torch.Tensor,
    out_scales: torch.Tensor,
    fmt: str,
    block: int,
    n: int,
    scale: float,
    backend: str | None,
) -> None:
    f, block = _check_fmt_block(fmt, block)
    n = _checks.integer("n", n, lo=0)
    scale = _checks.scalar("scale", scale)
    c = _checks.tensor("codes", codes, dtypes=(torch.uint8,), dim=2)
    s = _checks.tensor("scales", scales, dtypes=(torch.float32,), dim=2)
    if c.shape[0] < 1 or tuple(c.shape) != (c.shape[0], f.payload_bytes(n)):
        raise ValueError(
            f"codes must be (M >= 1, {f.payload_bytes(n)}) for n = {n} {f.name} codes, got {tuple(c.shape)}"
        )
    if tuple(s.shape) != (c.shape[0], f.num_scales(n, block)):
        raise ValueError(
            f"scales must be ({c.shape[0]}, {f.num_scales(n, block)}) (M rows as codes), got {tuple(s.shape)}"
        )
    _checks.same_device("codes", c, scales=s)
    _check_wire(f, block, n, out_codes, out_scales, c.device, prefix="out_")
    _checks.distinct({"codes": c, "scales": s, "out_codes": out_codes, "out_scales": out_scales})
    b = _dispatch.resolve(backend, c.device, "lc_reduce_quantized")
    if n:
        with nvtx_range("reduce_quantized"):
            launch("reduce_quantized", b, c, s, out_codes, out_scales, f.name, block, n, scale)


_reduce_quantized_op = torch.library.custom_op(
    "lowcomm::reduce_quantized", _reduce_quantized_impl, mutates_args=("out_codes", "out_scales")
)


@_reduce_quantized_op.register_fake
def _(codes, scales, out_codes, out_scales, fmt, block, n, scale, backend):
    _checks.same_device("codes", codes, scales=scales, out_codes=out_codes, out_scales=out_scales)


def _outer_merge_quantized_impl(
    g, u, codes, scales, fmt, block, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_mode, backend
) -> None:
    """outer_merge_'s checks with Δ̄ as (codes, scales); then one fused pass (cpu, cuda), or
    dequantize into a temporary and the dense merge (the normalized Taylor mode, and triton)."""
    f, block = _check_fmt_block(fmt, block)
    for name, t in (("g", g), ("u", u)):
        _checks.tensor(name, t, dtypes=_checks.FLOAT_DTYPES)
    _checks.tensor("x", x, dtypes=_checks.PARAM_DTYPES)
    _checks.params_of("x", x, "g", g)
    _checks.same_dtype("g", g, u=u)
    _checks.same_device("g", g, u=u, x=x, x_sent=x_sent)
    _checks.same_numel("g", g, u=u, x=x, x_sent=x_sent)
    _check_wire(f, block, g.numel(), codes, scales, g.device, prefix="delta_avg.")
    lr = _checks.scalar("lr", lr, lo=0.0)
    momentum = _checks.scalar("momentum", momentum, lo=0.0, hi=1.0, hi_open=True)
    alpha = _checks.scalar("alpha", alpha, lo=0.0, hi=1.0)
    beta = _checks.scalar("beta", beta, lo=0.0)
    lam = _checks.scalar("lam", lam, lo=0.0)
    _checks.flag("nesterov", nesterov)
    if lam_mode not in _outer_merge.LAM_MODES:
        raise ValueError(f"lam_mode must be one of {_outer_merge.LAM_MODES}, got {lam_mode!r}")
    if x_sent is None and (beta != 0.0 or lam != 0.0):
        raise ValueError("x_sent is required when beta or lam is non-zero")
    if x_sent is not None:
        _checks.tensor("x_sent", x_sent, dtypes=(g.dtype,))
    _checks.distinct(
        {"g": g, "u": u, "delta_avg.codes": codes, "delta_avg.scales": scales, "x": x, "x_sent": x_sent}
    )
    b = _dispatch.resolve(backend, g.device, "lc_outer_merge_quantized")
    if g.numel() == 0:
        return
    with nvtx_range("outer_merge"):
        fused = (b in ("ref", "cpu", "cuda")) and not (lam_mode == "normalized" and lam != 0.0)
        if fused:
            merge = (lr, momentum, nesterov, alpha, beta, lam)
            launch("outer_merge_quantized", b, g, u, codes, scales, f.name, block, x, x_sent, *merge, None)
            return
        # The normalized mode's scale is a reduction over Δ̄ that the merge needs before its first
        # element, and Triton has no fused kernel yet: Δ̄ is dequantized once here.
        d = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        launch("dequantize", b, codes, scales, d, f.name, block)
        _outer_merge._outer_merge_impl(
            g, u, d, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_mode, b
        )


# outer_merge_'s schema with Δ̄ as (codes, scales, fmt, block), written out (the impl is unannotated).
_outer_merge_quantized_op = torch.library.custom_op(
    "lowcomm::outer_merge_quantized_",
    _outer_merge_quantized_impl,
    mutates_args=("g", "u", "x"),
    schema="(Tensor(a0!) g, Tensor(a1!) u, Tensor codes, Tensor scales, str fmt, SymInt block, "
    "Tensor(a6!) x, Tensor? x_sent, float lr, float momentum, bool nesterov, float alpha, float beta, "
    "float lam, str lam_mode, str? backend) -> ()",
)


@_outer_merge_quantized_op.register_fake
def _(
    g, u, codes, scales, fmt, block, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_mode, backend
):
    _checks.same_device("g", g, u=u, codes=codes, scales=scales, x=x, x_sent=x_sent)


def _scatter_merge_quantized_impl(
    x: torch.Tensor,
    idx: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: str,
    block: int,
    sent: torch.Tensor,
    beta: float,
    backend: str | None,
    check_values: bool = True,
) -> None:
    f, block = _check_fmt_block(fmt, block)
    idx = _sparse._checked_x_idx(x, idx, check_values, strictly_increasing=True)
    _checks.tensor("sent", sent, dtypes=(x.dtype,))
    _checks.same_device("x", x, sent=sent)
    _checks.same_numel("idx", idx, sent=sent)
    _check_wire(f, block, idx.numel(), codes, scales, x.device, prefix="avg.")
    beta = _checks.scalar("beta", beta, lo=0.0)
    _checks.distinct({"x": x, "idx": idx, "avg.codes": codes, "avg.scales": scales, "sent": sent})
    b = _dispatch.resolve(backend, x.device, "lc_sparse_scatter_merge_quantized")
    if idx.numel() == 0:
        return
    with nvtx_range("sparse_scatter_merge"):
        if b in ("ref", "cpu", "cuda"):
            launch("sparse_scatter_merge_quantized", b, x, idx, codes, scales, f.name, block, sent, beta)
            return
        avg = torch.empty(idx.numel(), dtype=x.dtype, device=x.device)  # k values: small
        launch("dequantize", b, codes, scales, avg, f.name, block)
        launch("sparse_scatter_merge", b, x, idx, avg, sent, beta)


_scatter_merge_quantized_op = torch.library.custom_op(
    "lowcomm::sparse_scatter_merge_quantized_", _scatter_merge_quantized_impl, mutates_args=("x",)
)


@_scatter_merge_quantized_op.register_fake
def _(x, idx, codes, scales, fmt, block, sent, beta, backend, check_values=True):
    _checks.same_device("x", x, idx=idx, codes=codes, scales=scales, sent=sent)


for _name in (
    "pack_quantized",
    "dequantize",
    "reduce_quantized",
    "outer_merge_quantized_",
    "sparse_scatter_merge_quantized_",
):
    declare(_name)


# ---- public functions -----------------------------------------------------------------------------


def _sr_args(seed: object, round: object) -> tuple[bool, int, int]:
    """(sr, seed, round) as the registered ops carry them; seed None: round to nearest even."""
    if seed is None:
        return False, 0, _checks.integer("round", round, lo=0, hi=(1 << 63) - 1, why=_KEY)
    return _check_seed(True, seed, round)


def _wire_out(f: QuantFormat, block: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.empty(f.payload_bytes(n), dtype=torch.uint8, device=device)
    return codes, torch.empty(f.num_scales(n, block), dtype=torch.float32, device=device)


def _call(name: str, impl, *args: object) -> object:
    return traced_call(name, *args) if compiling() else impl(*args)


def _pack_call(*args: object) -> torch.Tensor:
    """lowcomm::pack_quantized on `args` (its schema's order): quantize and pack_quantized."""
    return _call("pack_quantized", _pack_quantized_impl, *args)


@torch.no_grad()
def quantize(
    v: torch.Tensor,
    fmt: str,
    block: int,
    *,
    seed: int | None = None,
    round: int = 0,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax quantization of v (flat) onto the grid of `fmt` (module docstring).

    Args:
        v: fp32 / fp64 / bf16 / fp16, any shape, contiguous, n elements. Read only.
        fmt: a name in ``FORMATS`` ('int8', 'int4', 'fp8_e4m3', 'fp8_e5m2', 'fp4_e2m1',
            'fp4_e3m0').
        block: elements per scale, a power of two >= 2 (4-bit formats: two codes per byte).
        seed: None rounds to nearest even; an int in [0, 2^63) rounds stochastically with the
            counter-based stream of (seed, round) (the same bits on every backend).
        round: int in [0, 2^63), the stream's second key (e.g. the sync round).
        backend: 'ref' | 'cpu' | 'triton' | 'cuda' (default by device, see ``_dispatch``).
    Returns:
        (codes, scales): new uint8 (``fmt.payload_bytes(n)``) and fp32 (``fmt.num_scales(n,
        block)``) tensors on v's device. A block holding inf / NaN gets scale NaN and codes 0.
    Raises:
        TypeError / ValueError naming the argument.
    """
    f, block = _check_fmt_block(fmt, block)
    sr, seed, round = _sr_args(seed, round)
    codes, scales = _wire_out(f, block, _checks.is_tensor("v", v).numel(), v.device)
    _pack_call(v, None, None, None, codes, scales, f.name, block, sr, seed, round, backend)
    return codes, scales


@torch.no_grad()
def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: str,
    block: int,
    n: int,
    *,
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """value(code_i) · s_b in fp32, rounded to out_dtype.

    Args:
        codes: uint8, ``fmt.payload_bytes(n)`` bytes, contiguous. Read only.
        scales: fp32, ``fmt.num_scales(n, block)`` elements, contiguous, codes' device. Read only.
        fmt, block: as given to ``quantize``. n: the number of elements (>= 0).
        out_dtype: fp32 / fp64 / bf16 / fp16 (out's dtype when out is given).
        out: optional preallocated result (n elements, contiguous, aliasing nothing). Written.
        backend: 'ref' | 'cpu' | 'triton' | 'cuda'.
    Returns:
        out, or a new flat tensor of n elements of out_dtype.
    Raises:
        TypeError / ValueError naming the argument, before anything is written.
    """
    f, block = _check_fmt_block(fmt, block)
    n = _checks.integer("n", n, lo=0)
    if out is None:
        if out_dtype not in _checks.PARAM_DTYPES:
            raise TypeError(f"out_dtype must be one of {_checks.PARAM_DTYPES}, got {out_dtype}")
        out = torch.empty(n, dtype=out_dtype, device=_checks.is_tensor("codes", codes).device)
    elif _checks.is_tensor("out", out).numel() != n:
        raise ValueError(f"out has {out.numel()} elements; expected n = {n}")
    _call("dequantize", _dequantize_impl, codes, scales, out, f.name, block, backend)
    return out


@torch.no_grad()
def pack_quantized(
    g: torch.Tensor,
    x: torch.Tensor,
    fmt: str,
    block: int,
    *,
    residual: torch.Tensor | None = None,
    snapshot_out: torch.Tensor | None | bool = None,
    codes_out: torch.Tensor | None = None,
    scales_out: torch.Tensor | None = None,
    seed: int | None = None,
    round: int = 0,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The quantized send side of a sync, one pass: e = g − x (+ residual), quantized per block;
    snapshot = x; the non-finite count; error feedback residual ← e − dequant(codes, scales).

    Args:
        g: global parameters, fp32 / fp64, any shape, contiguous. Read only.
        x: local parameters, g's numel and device, g's dtype (or bf16 / fp16 with a float32 g),
            contiguous; may alias g. Read only.
        fmt, block, seed, round: as for ``quantize``.
        residual: optional error-feedback buffer, g's dtype and numel, contiguous, aliasing
            nothing. Added to e, then overwritten with e − dequant(codes, scales) (left unchanged
            in blocks whose scale is not finite).
        snapshot_out: a preallocated snapshot (g's dtype and numel; written), None to allocate
            one, or False to skip it.
        codes_out, scales_out: preallocated codes (uint8, ``payload_bytes(n)``) and scales (fp32,
            ``num_scales(n, block)``) on g's device, both or neither; written. Reusing them across
            syncs saves the page faults of fresh large buffers (at 64M int8 elements, 64 MB of
            codes faulted in cost about as much as the pack's own memory traffic).
        backend: 'ref' | 'cpu' | 'triton' | 'cuda'.
    Returns:
        (codes, scales, snapshot or None, nonfinite): the codes / scales as ``quantize``'s (new
        ones, or codes_out / scales_out), the snapshot, and a new 0-d int64 count of non-finite
        fp32(e_i).
    Raises:
        TypeError / ValueError naming the argument, before anything is written.
    """
    f, block = _check_fmt_block(fmt, block)
    sr, seed, round = _sr_args(seed, round)
    _checks.is_tensor("g", g)
    _checks.is_tensor("x", x)
    if (codes_out is None) != (scales_out is None):
        raise TypeError("codes_out and scales_out go together: give both preallocated buffers or neither")
    if codes_out is None:
        codes, scales = _wire_out(f, block, g.numel(), g.device)
    else:
        _check_wire(f, block, g.numel(), codes_out, scales_out, g.device, suffix="_out")
        others = {"g": g, "x": x, "residual": residual, "scales_out": scales_out}
        if isinstance(snapshot_out, torch.Tensor):
            others["snapshot_out"] = snapshot_out
        for on, o in others.items():  # x may alias g; the outputs may alias nothing
            _checks.no_alias([("codes_out", codes_out, on, o)])
            if on != "scales_out":
                _checks.no_alias([("scales_out", scales_out, on, o)])
        codes, scales = codes_out, scales_out
    if snapshot_out is False:
        snapshot = None
    elif snapshot_out is None or snapshot_out is True:
        snapshot = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    else:
        snapshot = _checks.is_tensor("snapshot_out", snapshot_out)
    nonfinite = _pack_call(g, x, residual, snapshot, codes, scales, f.name, block, sr, seed, round, backend)
    return codes, scales, snapshot, nonfinite


@torch.no_grad()
def reduce_quantized(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: str,
    block: int,
    n: int,
    *,
    scale: float = 1.0,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum M quantized chunks and requantize: acc = Σ_m dequant(codes[m], scales[m]) in fp32 in
    the order m = 0..M−1, times fp32(scale), quantized to nearest even. Bit-identical on every
    backend.

    Args:
        codes: (M, ``fmt.payload_bytes(n)``) uint8, M >= 1, contiguous. Read only.
        scales: (M, ``fmt.num_scales(n, block)``) fp32, contiguous. Read only.
        fmt, block: the chunks' format. n: elements per chunk.
        scale: finite multiplier (1/M for the average), rounded to fp32 once.
        backend: 'ref' | 'cpu' | 'triton' | 'cuda'.
    Returns:
        (codes, scales) of the result: new tensors of one row's sizes.
    Raises:
        TypeError / ValueError naming the argument.
    """
    f, block = _check_fmt_block(fmt, block)
    n = _checks.integer("n", n, lo=0)
    out_codes, out_scales = _wire_out(f, block, n, _checks.is_tensor("codes", codes).device)
    _call(
        "reduce_quantized",
        _reduce_quantized_impl,
        codes,
        scales,
        out_codes,
        out_scales,
        f.name,
        block,
        n,
        scale,
        backend,
    )
    return out_codes, out_scales


def as_quantized(delta: object, name: str) -> Quantized:
    """A Quantized from a Quantized or a (codes, scales, fmt, block) tuple; TypeError naming `name`."""
    if isinstance(delta, tuple) and len(delta) == 4:
        delta = Quantized(*delta)
    if not isinstance(delta, Quantized):
        raise TypeError(f"{name} must be a torch.Tensor, a Quantized or a (codes, scales, fmt, block) tuple")
    return delta


@torch.no_grad()
def outer_merge_quantized_(
    g: torch.Tensor, u: torch.Tensor, delta_avg: Quantized | tuple, x: torch.Tensor,
    x_sent: torch.Tensor | None = None, *, lr: float, momentum: float = 0.0, nesterov: bool = True,
    alpha: float = 0.0, beta: float = 0.0, lam: float = 0.0, lam_mode: str = "absolute",
    backend: str | None = None,
) -> None:  # fmt: skip
    """``outer_merge_`` with the averaged pseudo-gradient given quantized (what ``outer_merge_``
    calls for a Quantized delta_avg): Δ̄ is dequantized inside the merge on the cpu backend
    (chunk by chunk) and the cuda backend (in registers), never stored whole (normalized λ, and
    triton for now, dequantize it once into a temporary). Arguments and results as
    ``outer_merge_``'s."""
    q = as_quantized(delta_avg, "delta_avg")
    f = as_format(q.fmt)
    wire = (q.codes, q.scales, f.name, q.block)
    merge = (lr, momentum, nesterov, alpha, beta, lam, lam_mode)
    _call("outer_merge_quantized_", _outer_merge_quantized_impl, g, u, *wire, x, x_sent, *merge, backend)


@torch.no_grad()
def sparse_scatter_merge_quantized_(
    x: torch.Tensor,
    idx: torch.Tensor,
    avg: Quantized | tuple,
    sent: torch.Tensor,
    *,
    beta: float = 1.0,
    backend: str | None = None,
    check_values: bool = True,
) -> None:
    """``sparse_scatter_merge_`` with avg (k values) given quantized (what it calls for a
    Quantized avg); dequantized inside the merge on the cpu and cuda backends."""
    q = as_quantized(avg, "avg")
    f = as_format(q.fmt)
    _call(
        "sparse_scatter_merge_quantized_",
        _scatter_merge_quantized_impl,
        x,
        idx,
        q.codes,
        q.scales,
        f.name,
        q.block,
        sent,
        beta,
        backend,
        check_values,
    )
