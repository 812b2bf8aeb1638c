"""quantize: the ops of the compressed wire formats (8-bit and 4-bit codes with one fp32 scale per
block): ``quantize``, ``dequantize``, ``pack_quantized`` (the quantized send side of a sync, with
error feedback) and ``reduce_quantized`` (the sum of M quantized chunks, requantized).

The formats, their rounding and the argument rules are ``quant_format`` (its docstring is the
specification every backend meets bit for bit); the plain-torch references are ``quant_ref``. This
module holds the launchers (``ref``, ``cpu`` / ``cuda`` through the C ABI, and ``triton`` through
its own loader of ``triton_kernels.quantize``, which needs each format's decoding table), the
registered ``lowcomm::`` ops and the public functions. The merges with a quantized average
(``outer_merge_quantized_``, ``sparse_scatter_merge_quantized_``) live beside their dense ops in
outer_merge.py and sparse.py, which import this module (never the other way).

The public names of the three modules are importable from here as before.
"""

from __future__ import annotations

import importlib

import torch

from .. import _checks, _dispatch
from ..profiling import nvtx_range
from ._common import code, compiling, declare, launch, launcher, native, refusing, traced_call
from .quant_format import (
    _FMT_CODE,
    _KEY,
    FORMATS,
    GAMMA,
    MAX_BLOCK,
    QuantFormat,
    Quantized,
    _check_fmt_block,
    _check_seed,
    _check_wire,
    _signed,
    as_format,
    as_quantized,
    check_block,
    code_values,
    sr_key,
    wire_buffers,
)
from .quant_ref import dequantize_ref, pack_quantized_ref, quantize_ref, reduce_quantized_ref, sr_uniform_ref

__all__ = [
    "FORMATS",
    "GAMMA",
    "MAX_BLOCK",
    "QuantFormat",
    "Quantized",
    "as_format",
    "as_quantized",
    "check_block",
    "code_values",
    "dequantize",
    "dequantize_ref",
    "pack_quantized",
    "pack_quantized_ref",
    "quantize",
    "quantize_ref",
    "reduce_quantized",
    "reduce_quantized_ref",
    "sr_key",
    "sr_uniform_ref",
]


# ---- launchers (n >= 1, checked arguments) --------------------------------------------------------
# pack_quantized: x None quantizes g itself (quantize); residual / snapshot None when not wanted;
# writes codes, scales, nonfinite (a zeroed 0-d int64), the residual and the snapshot.
# dequantize: out (n). reduce_quantized: out_codes / out_scales. (The merges with a quantized
# average live beside their dense ops: outer_merge.py, sparse.py.)


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


native(
    "pack_quantized",
    "lc_pack_quantized",
    dtype=(("g", "x"), lambda g, x: code(g if x is None else x)),
    fmt=("fmt", _FMT_CODE.__getitem__),
    n=("g", torch.Tensor.numel),
    sr=("sr", int),
    key=(("sr", "seed", "round"), lambda sr, seed, round: _signed(sr_key(seed, round)) if sr else 0),
)
native(
    "dequantize",
    "lc_dequantize",
    fmt=("fmt", _FMT_CODE.__getitem__),
    n=("out", torch.Tensor.numel),
    out_dtype=("out", code),
)
native(
    "reduce_quantized",
    "lc_reduce_quantized",
    fmt=("fmt", _FMT_CODE.__getitem__),
    m=("codes", lambda codes: codes.shape[0]),
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


# ---- implementations (the registered ops' bodies and the eager paths) ------------------------------


_WIRE = wire_buffers()
#: quantize's arguments: lowcomm::pack_quantized with x (and so residual and snapshot) None.
QUANTIZE = _checks.Contract(
    "lc_pack_quantized",
    _checks.Buffer("g", _checks.PARAM_DTYPES, shown="v"),
    *_WIRE,
    internal=["x", "residual", "snapshot", "nonfinite"],
)
# named as pack_quantized's keywords: its codes and scales are the caller's codes_out and scales_out,
# or new ones, which overlap nothing
_WIRE_OUT = wire_buffers(suffix="_out")
#: pack_quantized's arguments: g and x may alias each other (e = 0); the outputs alias nothing.
PACK_QUANTIZED = _checks.Contract(
    "lc_pack_quantized",
    _checks.Buffer("g", _checks.FLOAT_DTYPES),
    _checks.Buffer("x", _checks.PARAM_DTYPES, params_of="g"),
    _checks.Buffer("residual", _checks.like("g"), optional=True),
    _checks.Buffer("snapshot", _checks.like("g"), shown="snapshot_out", optional=True),
    *_WIRE_OUT,
    may_alias=[("g", "x")],
    internal=["nonfinite"],
)
#: dequantize's arguments: codes, scales and out pairwise distinct (codes first: the public
#: function makes out on codes' device when it is not given).
DEQUANTIZE = _checks.Contract(
    "lc_dequantize", *_WIRE, _checks.Buffer("out", _checks.PARAM_DTYPES, numel=None)
)
_WIRE_SUM = wire_buffers("out_codes", "out_scales")
#: reduce_quantized's arguments: M rows of codes and scales in, one row out, all distinct.
REDUCE_QUANTIZED = _checks.Contract(
    "lc_reduce_quantized",
    *wire_buffers(dim=2),
    *_WIRE_SUM,
    _checks.Real("scale"),
)


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
    if x is None:
        for name, t in (("residual", residual), ("snapshot_out", snapshot)):
            if t is not None:
                raise ValueError(f"{name} needs x: quantize (x None) has no error feedback or snapshot")
        QUANTIZE.check(g=g, codes=codes, scales=scales)
    else:
        PACK_QUANTIZED.check(g=g, x=x, residual=residual, snapshot=snapshot, codes=codes, scales=scales)
    _check_wire(f, block, g.numel(), codes, scales, _WIRE if x is None else _WIRE_OUT)
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
    PACK_QUANTIZED.same_device(g=g, x=x, residual=residual, snapshot=snapshot, codes=codes, scales=scales)
    return g.new_empty((), dtype=torch.int64)


def _dequantize_impl(
    codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, fmt: str, block: int, backend: str | None
) -> None:
    f, block = _check_fmt_block(fmt, block)
    DEQUANTIZE.check(codes=codes, scales=scales, out=out)
    _check_wire(f, block, out.numel(), codes, scales, _WIRE)
    b = _dispatch.resolve(backend, out.device, "lc_dequantize")
    if out.numel():
        with nvtx_range("dequantize"):
            launch("dequantize", b, codes, scales, out, f.name, block)


_dequantize_op = torch.library.custom_op("lowcomm::dequantize", _dequantize_impl, mutates_args=("out",))


@_dequantize_op.register_fake
def _(codes, scales, out, fmt, block, backend):
    DEQUANTIZE.same_device(codes=codes, scales=scales, out=out)


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
    c, s, wire = codes, scales, dict(out_codes=out_codes, out_scales=out_scales)
    scale = REDUCE_QUANTIZED.check(codes=c, scales=s, **wire, scale=scale)["scale"]
    if c.shape[0] < 1 or tuple(c.shape) != (c.shape[0], f.payload_bytes(n)):
        raise ValueError(
            f"codes must be (M >= 1, {f.payload_bytes(n)}) for n = {n} {f.name} codes, got {tuple(c.shape)}"
        )
    if tuple(s.shape) != (c.shape[0], f.num_scales(n, block)):
        raise ValueError(
            f"scales must be ({c.shape[0]}, {f.num_scales(n, block)}) (M rows as codes), got {tuple(s.shape)}"
        )
    _check_wire(f, block, n, out_codes, out_scales, _WIRE_SUM)
    b = _dispatch.resolve(backend, c.device, "lc_reduce_quantized")
    if n:
        with nvtx_range("reduce_quantized"):
            launch("reduce_quantized", b, c, s, out_codes, out_scales, f.name, block, n, scale)


_reduce_quantized_op = torch.library.custom_op(
    "lowcomm::reduce_quantized", _reduce_quantized_impl, mutates_args=("out_codes", "out_scales")
)


@_reduce_quantized_op.register_fake
def _(codes, scales, out_codes, out_scales, fmt, block, n, scale, backend):
    REDUCE_QUANTIZED.same_device(codes=codes, scales=scales, out_codes=out_codes, out_scales=out_scales)


for _name in (
    "pack_quantized",
    "dequantize",
    "reduce_quantized",
):
    declare(_name)


def dequantize_launch(backend: str, codes, scales, out, fmt: str, block: int) -> None:
    """Dequantize checked (codes, scales) into out (n >= 1) on `backend`: the unfused path of the
    merges with a quantized average (outer_merge.py, sparse.py), which then run the dense merge."""
    launch("dequantize", backend, codes, scales, out, fmt, block)


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


@refusing(2)
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


@refusing(0)
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


@refusing(4)
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
        codes, scales = codes_out, scales_out
    if snapshot_out is False:
        snapshot = None
    elif snapshot_out is None or snapshot_out is True:
        snapshot = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    else:
        snapshot = _checks.is_tensor("snapshot_out", snapshot_out)
    nonfinite = _pack_call(g, x, residual, snapshot, codes, scales, f.name, block, sr, seed, round, backend)
    return codes, scales, snapshot, nonfinite


@refusing(2)
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
