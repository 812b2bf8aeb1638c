"""quant_format: the compressed wire formats (8-bit and 4-bit codes with one fp32 scale per block),
their rounding and their argument rules; the specification every backend meets. The table of the
formats is ``wire_formats.TABLE``; the references are in ``quant_ref``, the ops in ``quantize``.

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
import math

import torch
import torch.nn.functional as F

from .. import _checks, wire_formats

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


def as_quantized(delta: object, name: str) -> Quantized:
    """A Quantized from a Quantized or a (codes, scales, fmt, block) tuple; TypeError naming `name`."""
    if isinstance(delta, tuple) and len(delta) == 4:
        delta = Quantized(*delta)
    if not isinstance(delta, Quantized):
        raise TypeError(f"{name} must be a torch.Tensor, a Quantized or a (codes, scales, fmt, block) tuple")
    return delta


#: abi.h LC_Q_* of each format
_FMT_CODE = {s.name: s.abi for s in wire_formats.QUANTIZED}


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


def wire_buffers(
    codes: str = "codes",
    scales: str = "scales",
    *,
    prefix: str = "",
    suffix: str = "",
    dim: int | None = None,
) -> tuple[_checks.Buffer, _checks.Buffer]:
    """A quantized buffer's two tensors as an op's contract declares them: uint8 codes and fp32
    scales (their sizes for a format and block: ``_check_wire``), named ``{prefix}{codes}{suffix}``
    and ``{prefix}{scales}{suffix}`` in errors."""
    return (
        _checks.Buffer(codes, (torch.uint8,), shown=prefix + codes + suffix, numel=None, dim=dim),
        _checks.Buffer(scales, (torch.float32,), shown=prefix + scales + suffix, numel=None, dim=dim),
    )


def _check_wire(
    f: QuantFormat,
    block: int,
    n: int,
    codes: torch.Tensor,
    scales: torch.Tensor,
    wire: tuple[_checks.Buffer, _checks.Buffer],
) -> None:
    """The sizes of (codes, scales), checked by their contract as `wire` (``wire_buffers``):
    f.payload_bytes(n) codes and f.num_scales(n, block) scales."""
    cname, sname = wire[0].label, wire[1].label
    if codes.numel() != f.payload_bytes(n):
        raise ValueError(
            f"{cname} has {codes.numel()} bytes; {f.name} codes of n = {n} elements take {f.payload_bytes(n)}"
        )
    if scales.numel() != (m := f.num_scales(n, block)):
        raise ValueError(f"{sname} has {scales.numel()} elements; n = {n} in blocks of {block} takes {m}")


def _check_seed(sr: object, seed: object, round: object) -> tuple[bool, int, int]:
    sr = _checks.flag("sr", sr)
    seed = _checks.integer("seed", seed, lo=0, hi=(1 << 63) - 1, why=_KEY)
    round = _checks.integer("round", round, lo=0, hi=(1 << 63) - 1, why=_KEY)
    return sr, seed, round
