"""The benchmark workloads, shared by the CPU suite (bench_ops.py) and the GPU check (gpu_bench.py).

A workload is one op in one configuration (pack with an fp32 wire, outer_merge_ in Taylor mode, ...)
at one size n (fp32 elements). For each it gives:

* ``setup(n, device)``: the buffers, allocated once and reused by every implementation;
* ``nbytes(n)``: the bytes the op must move, each buffer counted once (reads + writes), which is
  what GB/s and "% of memcpy" are computed from;
* three callables over those buffers: ``ref`` (the ``*_ref`` specification exactly as written,
  allocating its outputs), ``compile_target`` (the same ref writing into the preallocated outputs,
  to be wrapped by ``torch.compile``: inductor then stores straight into them, the strongest peer
  we can give it), and ``fused`` (the public op with preallocated outputs, as the runtime calls it;
  ``backend=None`` lets ``_dispatch.resolve`` pick, or a backend name forces one).

In-place ops are re-run on the same buffers: the values drift from call to call but stay finite
(small lr, x_sent close to g), which is all a bandwidth measurement needs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lowcomm_kernels import _dispatch, _native
from lowcomm_kernels.ops import (
    TopKFormat,
    fragment_norms,
    fragment_norms_ref,
    mask_indices,
    mask_indices_ref,
    outer_merge_,
    outer_merge_ref,
    pack,
    pack_ref,
    sparse_gather,
    sparse_gather_ref,
    sparse_scatter_merge_,
    sparse_scatter_merge_ref,
    topk_decode_add_,
    topk_decode_add_ref,
    topk_encode,
    topk_encode_ref,
)

Buffers = dict[str, Any]
DEFAULT_SIZES = "1M,16M,64M"
SIZES_ENV = "LOWCOMM_BENCH_SIZES"  # a benchmark knob, read only here (not a package knob)

# Outer-step and merge hyper-parameters: small lr keeps repeated in-place calls finite.
MERGE_TAYLOR = dict(lr=1e-3, momentum=0.9, nesterov=True, alpha=0.0, beta=1.0, lam=0.5, lam_mode="absolute")
MERGE_NORMALIZED = dict(MERGE_TAYLOR, lam_mode="normalized")
MASK_SEED, MASK_ROUND = 1234, 7
NORM_SEGMENTS = 8


def parse_size(text: str) -> int:
    """'64M' -> 67108864, '4K' -> 4096, '1000' -> 1000 (binary multiples: 1M = 2**20 elements)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", text)
    if m is None:
        raise ValueError(f"{SIZES_ENV}: cannot parse size {text!r} (examples: 64K, 16M, 1000)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    n = int(m.group(1)) * scale
    if n < 100:
        raise ValueError(f"{SIZES_ENV}: size {text!r} is below 100 elements (the sparse cases need k >= 1)")
    return n


def size_label(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def sizes_from_env(default: str = DEFAULT_SIZES) -> list[int]:
    """Sizes from ``LOWCOMM_BENCH_SIZES`` (comma-separated, e.g. ``64K`` for a CI smoke run)."""
    text = os.environ.get(SIZES_ENV, "").strip() or default
    return [parse_size(part) for part in text.split(",") if part.strip()]


def _rand(n: int, device: torch.device, scale: float = 1.0, gen: torch.Generator | None = None,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # uniform_ is ~2x cheaper than randn at 64M elements and just as good for timing.
    return torch.empty(n, dtype=dtype, device=device).uniform_(-scale, scale, generator=gen)


@dataclass(repr=False)
class Workload:
    """One op configuration; see the module docstring."""

    name: str                # row key, e.g. "pack/fp32-wire"
    op: str                  # public op name
    entry: str               # C ABI entry point (for resolve())
    setup: Callable[[int, torch.device], Buffers]
    nbytes: Callable[[int], int]
    ref: Callable[[Buffers], object]
    compile_target: Callable[..., object]   # called as compile_target(**compile_args(buffers))
    compile_args: Callable[[Buffers], dict[str, Any]]
    fused: Callable[[Buffers, str | None], object]
    note: str = ""
    target: bool = False     # the bandwidth targets apply (pack, outer_merge at >= 16M)
    # why no memcpy target applies (selection / compute-bound ops, a known ceiling): the renderer
    # prints it beside the op's rows and gives them no verdict
    no_target: str = ""
    target_pct: float = 80.0  # % of the nt memcpy the target asks (the quantized wire formats: 90)
    compile_dynamic: bool = True  # one dynamic-shape graph for every size (False: one graph per size)
    extra: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:  # short: pytest-benchmark stores it in the JSON's params
        return f"Workload({self.name!r})"

    def resolved_backend(self, device: torch.device) -> str:
        return _dispatch.resolve(None, device, self.entry)


# ----------------------------------------------------------------------------------------- pack
def _pack_workload(wire: torch.dtype, label: str) -> Workload:
    wire_size = torch.empty((), dtype=wire).element_size()

    def setup(n: int, device: torch.device) -> Buffers:
        gen = torch.Generator(device=device).manual_seed(n)
        g = _rand(n, device, gen=gen)
        x = g + _rand(n, device, 0.01, gen)
        return dict(g=g, x=x, delta=torch.empty(n, dtype=wire, device=device), snap=torch.empty_like(x))

    def target(g, x, delta, snap):
        d, s, nonfinite = pack_ref(g, x, wire_dtype=delta.dtype, snapshot=True)
        delta.copy_(d)
        snap.copy_(s)
        return nonfinite

    return Workload(
        name=f"pack/{label}", op="pack", entry="lc_pack", setup=setup,
        nbytes=lambda n: n * (4 + 4 + wire_size + 4),  # read g, x; write delta, snapshot
        ref=lambda b: pack_ref(b["g"], b["x"], wire_dtype=wire, snapshot=True),
        compile_target=target,
        compile_args=lambda b: dict(g=b["g"], x=b["x"], delta=b["delta"], snap=b["snap"]),
        fused=lambda b, backend: pack(b["g"], b["x"], wire_dtype=wire, delta_out=b["delta"],
                                      snapshot_out=b["snap"], backend=backend),
        note="read g, x; write delta (wire dtype), snapshot", target=True)


# ---------------------------------------------------------------------------------- outer_merge
def _merge_setup(n: int, device: torch.device) -> Buffers:
    gen = torch.Generator(device=device).manual_seed(n + 1)
    g = _rand(n, device, gen=gen)
    x_sent = g.clone()  # x_sent = g keeps D = g_new - x_sent small, so v stays finite over many calls
    return dict(g=g, u=torch.zeros_like(g), d=_rand(n, device, 0.01, gen), x=g + _rand(n, device, 0.01, gen),
                xs=x_sent)


def _merge_workload(kw: dict[str, Any], label: str, note: str, target: bool, no_target: str = "") -> Workload:
    def compiled(g, u, d, x, xs):
        outer_merge_ref(g, u, d, x, xs, **kw)

    args = lambda b: dict(g=b["g"], u=b["u"], d=b["d"], x=b["x"], xs=b["xs"])  # noqa: E731
    return Workload(
        name=f"outer_merge/{label}", op="outer_merge_", entry="lc_outer_merge", setup=_merge_setup,
        nbytes=lambda n: n * 4 * (5 + 3),  # read g, u, delta_avg, x, x_sent; write g, u, x
        ref=lambda b: outer_merge_ref(b["g"], b["u"], b["d"], b["x"], b["xs"], **kw),
        compile_target=compiled, compile_args=args,
        fused=lambda b, backend: outer_merge_(b["g"], b["u"], b["d"], b["x"], b["xs"], backend=backend, **kw),
        note=note, target=target, no_target=no_target, extra=dict(kw))


# --------------------------------------------------------------------------------------- sparse
SPARSE_NO_TARGET = "random access: a 4-byte read costs a 64-byte line, so useful GB/s is far below memcpy"


def _sparse_setup(density: float) -> Callable[[int, torch.device], Buffers]:
    def setup(n: int, device: torch.device) -> Buffers:
        gen = torch.Generator(device=device).manual_seed(n + 2)
        k = max(1, int(n * density))
        idx = mask_indices(MASK_SEED, MASK_ROUND, n, k, device=device)
        return dict(x=_rand(n, device, gen=gen), idx=idx, out=torch.empty(k, device=device),
                    avg=_rand(k, device, 0.01, gen), sent=_rand(k, device, 0.01, gen), k=k)
    return setup


def _gather_workload(density: float) -> Workload:
    def target(x, idx, out):
        out.copy_(sparse_gather_ref(x, idx))

    return Workload(
        name=f"sparse_gather/d={density:g}", op="sparse_gather", entry="lc_sparse_gather",
        setup=_sparse_setup(density),
        nbytes=lambda n: max(1, int(n * density)) * (8 + 4 + 4),  # read idx, x[idx]; write out
        ref=lambda b: sparse_gather_ref(b["x"], b["idx"]),
        compile_target=target, compile_args=lambda b: dict(x=b["x"], idx=b["idx"], out=b["out"]),
        fused=lambda b, backend: sparse_gather(b["x"], b["idx"], out=b["out"], backend=backend),
        note=f"k = {density:g}·n; read idx (int64), x[idx]; write out", no_target=SPARSE_NO_TARGET,
        extra=dict(density=density))


def _scatter_workload(density: float) -> Workload:
    def target(x, idx, avg, sent):
        sparse_scatter_merge_ref(x, idx, avg, sent, beta=1.0)

    return Workload(
        name=f"sparse_scatter_merge/d={density:g}", op="sparse_scatter_merge_",
        entry="lc_sparse_scatter_merge", setup=_sparse_setup(density),
        # read idx, x[idx], avg, sent; write x[idx]
        nbytes=lambda n: max(1, int(n * density)) * (8 + 4 + 4 + 4 + 4),
        ref=lambda b: sparse_scatter_merge_ref(b["x"], b["idx"], b["avg"], b["sent"], beta=1.0),
        compile_target=target,
        compile_args=lambda b: dict(x=b["x"], idx=b["idx"], avg=b["avg"], sent=b["sent"]),
        fused=lambda b, backend: sparse_scatter_merge_(b["x"], b["idx"], b["avg"], b["sent"], beta=1.0,
                                                       backend=backend),
        note=f"k = {density:g}·n, beta = 1; read idx, x[idx], avg, sent; write x[idx]",
        no_target=SPARSE_NO_TARGET, extra=dict(density=density))


# ------------------------------------------------------------------------------- fragment_norms
def _norms_setup(n: int, device: torch.device) -> Buffers:
    gen = torch.Generator(device=device).manual_seed(n + 3)
    # Uneven segments (fragments of a model are not equal), fixed per n so every run sees the same.
    cuts = torch.sort(torch.randint(0, n + 1, (NORM_SEGMENTS - 1,), generator=gen, device=device)).values
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), cuts,
                         torch.full((1,), n, dtype=torch.int64, device=device)])
    return dict(buf=_rand(n, device, gen=gen), offsets=offsets)


def _norms_workload() -> Workload:
    return Workload(
        name=f"fragment_norms/K={NORM_SEGMENTS}", op="fragment_norms", entry="lc_fragment_norms",
        setup=_norms_setup, nbytes=lambda n: n * 4,  # read buf once
        ref=lambda b: fragment_norms_ref(b["buf"], b["offsets"], ord=2),
        compile_target=lambda buf, offsets: fragment_norms_ref(buf, offsets, ord=2),
        compile_args=lambda b: dict(buf=b["buf"], offsets=b["offsets"]),
        fused=lambda b, backend: fragment_norms(b["buf"], b["offsets"], ord=2, backend=backend),
        note=f"K = {NORM_SEGMENTS} uneven segments, ord 2; read buf",
        no_target="none set: a read-only reduction, reported for context")


# --------------------------------------------------------------------------------- mask_indices
def _mask_setup(n: int, device: torch.device) -> Buffers:
    return dict(n=n, k=max(1, n // 100), device=device)


def _mask_workload() -> Workload:
    return Workload(
        name="mask_indices/k=1%", op="mask_indices", entry="lc_mask_perm", setup=_mask_setup,
        nbytes=lambda n: max(1, n // 100) * 8,  # write k int64 (compute-bound: hash + sort)
        ref=lambda b: mask_indices_ref(MASK_SEED, MASK_ROUND, b["n"], b["k"], device=b["device"]),
        # Sizes travel as Python ints; dynamo specialises on them (one graph per size).
        compile_target=lambda n, k, device: mask_indices_ref(MASK_SEED, MASK_ROUND, n, k, device=device),
        compile_args=lambda b: dict(n=b["n"], k=b["k"], device=b["device"]),
        fused=lambda b, backend: mask_indices(MASK_SEED, MASK_ROUND, b["n"], b["k"], device=b["device"],
                                              backend=backend),
        note="k = n/100; write k sorted int64 (hash + sort: compute-bound, not a bandwidth op)",
        no_target="hash + sort: compute-bound, not a bandwidth op",
        # dynamic=True never finished compiling here (> 5 min: the key schedule on symbolic ints).
        compile_dynamic=False)


# ------------------------------------------------------------------------- quantized wire formats
QBLOCK = 128  # elements per fp32 scale in the quantized rows


def _qpack_workload(fmt: str) -> Workload:
    from lowcomm_kernels.ops import FORMATS, pack_quantized, pack_quantized_ref  # noqa: PLC0415

    f = FORMATS[fmt]

    def setup(n: int, device: torch.device) -> Buffers:
        gen = torch.Generator(device=device).manual_seed(n + 7)
        g = _rand(n, device, gen=gen)
        codes = torch.empty(f.payload_bytes(n), dtype=torch.uint8, device=device)
        scales = torch.empty(f.num_scales(n, QBLOCK), dtype=torch.float32, device=device)
        return dict(g=g, x=g + _rand(n, device, 0.01, gen), res=torch.zeros_like(g), snap=torch.empty_like(g),
                    codes_out=codes, scales_out=scales)  # fmt: skip

    def target(g, x, res, snap, codes_out, scales_out):  # the unfused reference, writing the same outputs
        c, sc, s, nonfinite = pack_quantized_ref(g, x, fmt, QBLOCK, residual=res, snapshot=True)
        snap.copy_(s)
        codes_out.copy_(c)
        scales_out.copy_(sc)
        return nonfinite

    return Workload(
        name=f"pack_quantized/{fmt}-ef", op="pack_quantized", entry="lc_pack_quantized", setup=setup,
        # read g, x, residual; write codes, scales, snapshot, residual
        nbytes=lambda n: n * (4 * 3 + 4 * 2) + f.wire_bytes(n, QBLOCK),
        ref=lambda b: pack_quantized_ref(b["g"], b["x"], fmt, QBLOCK, residual=b["res"]),
        compile_target=target,
        compile_args=lambda b: {k: b[k] for k in ("g", "x", "res", "snap", "codes_out", "scales_out")},
        fused=lambda b, backend: pack_quantized(b["g"], b["x"], fmt, QBLOCK, residual=b["res"],
                                                snapshot_out=b["snap"], codes_out=b["codes_out"],
                                                scales_out=b["scales_out"], backend=backend),
        note=f"{fmt}, block {QBLOCK}, error feedback: read g, x, residual; write codes, scales, snapshot, "
             "residual", target=True, target_pct=90.0, extra=dict(fmt=fmt, block=QBLOCK))


def _qmerge_workload(fmt: str) -> Workload:
    from lowcomm_kernels.ops import FORMATS, Quantized, dequantize_ref, quantize_ref  # noqa: PLC0415

    f = FORMATS[fmt]
    kw = MERGE_TAYLOR

    def setup(n: int, device: torch.device) -> Buffers:
        b = _merge_setup(n, device)
        b["codes"], b["scales"] = quantize_ref(b.pop("d"), fmt, QBLOCK)
        return b

    def compiled(g, u, codes, scales, x, xs):  # the unfused reference: dequantize, then merge
        outer_merge_ref(g, u, dequantize_ref(codes, scales, fmt, QBLOCK, g.numel()), x, xs, **kw)

    args = lambda b: dict(g=b["g"], u=b["u"], codes=b["codes"], scales=b["scales"], x=b["x"], xs=b["xs"])  # noqa: E731
    return Workload(
        name=f"outer_merge/{fmt}-avg", op="outer_merge_", entry="lc_outer_merge_quantized", setup=setup,
        # read g, u, x, x_sent, codes, scales; write g, u, x
        nbytes=lambda n: n * 4 * (4 + 3) + f.wire_bytes(n, QBLOCK),
        ref=lambda b: compiled(**args(b)),
        compile_target=compiled, compile_args=args,
        fused=lambda b, backend: outer_merge_(b["g"], b["u"], Quantized(b["codes"], b["scales"], fmt, QBLOCK),
                                              b["x"], b["xs"], backend=backend, **kw),
        note=f"taylor merge with the average as {fmt} codes (block {QBLOCK}), dequantized inside the merge",
        target=True, target_pct=90.0, extra=dict(kw, fmt=fmt, block=QBLOCK))


# ---------------------------------------------------------------------------- top-k sparse codec
TOPK = TopKFormat()  # the defaults: k = 64 entries per chunk of 4096 values, 2 bits per value
TOPK_BETA = 0.95     # the error-feedback decay (topk_encode's default)
TOPK_LABEL = f"k={TOPK.k}-of-{TOPK.chunk}-{TOPK.bits}bit"
TOPK_KW = dict(k=TOPK.k, chunk=TOPK.chunk, bits=TOPK.bits)


def _topk_entries(n: int) -> int:
    """The entries one payload for n values carries: k per chunk, fewer in a short last chunk."""
    nc, kf, kl, *_ = TOPK.sections(n)
    return (nc - 1) * kf + kl if nc else 0


def _topk_encode_workload() -> Workload:
    def setup(n: int, device: torch.device) -> Buffers:
        gen = torch.Generator(device=device).manual_seed(n + 11)
        return dict(delta=_rand(n, device, gen=gen), e=_rand(n, device, 0.1, gen),
                    out=torch.empty(TOPK.payload_bytes(n), dtype=torch.uint8, device=device))

    def target(delta, e, out):  # the reference, writing the preallocated payload
        payload, nonfinite = topk_encode_ref(delta, e, TOPK, TOPK_BETA)
        out.copy_(payload)
        return nonfinite

    return Workload(
        name=f"topk_encode/{TOPK_LABEL}", op="topk_encode", entry="lc_topk_encode", setup=setup,
        # read delta; read + write e (each buffer once: 12 B per value); write the payload
        nbytes=lambda n: n * (4 + 4 + 4) + TOPK.payload_bytes(n),
        ref=lambda b: topk_encode_ref(b["delta"], b["e"], TOPK, TOPK_BETA),
        compile_target=target, compile_args=lambda b: dict(delta=b["delta"], e=b["e"], out=b["out"]),
        # check_values=False: as the runtime calls it (no host read of the data first)
        fused=lambda b, backend: topk_encode(b["delta"], b["e"], beta=TOPK_BETA, payload_out=b["out"],
                                             backend=backend, check_values=False, **TOPK_KW),
        note=f"e ← β·e + Δ (β = {TOPK_BETA}), per chunk of {TOPK.chunk} the {TOPK.k} largest |e| quantized "
             f"to {TOPK.bits} bits and packed, what was sent subtracted from e; check_values=False as the "
             "runtime calls it. Bytes counted: read Δ, read + write e (12 B per value), write the payload "
             f"({TOPK.payload_bytes(TOPK.chunk)} B per {TOPK.chunk} values); the per-chunk selection is "
             "compute, not bytes",
        no_target="selection-bound (every chunk's k largest |e|), not a bandwidth op",
        # one graph per size: the payload layout is Python arithmetic on n
        compile_dynamic=False, extra=dict(TOPK_KW, beta=TOPK_BETA))


def _topk_decode_workload() -> Workload:
    def setup(n: int, device: torch.device) -> Buffers:
        gen = torch.Generator(device=device).manual_seed(n + 12)
        delta, e = _rand(n, device, gen=gen), _rand(n, device, 0.1, gen)
        payload, _ = topk_encode(delta, e, beta=TOPK_BETA, check_values=False, **TOPK_KW)
        return dict(acc=_rand(n, device, gen=gen), payload=payload)

    return Workload(
        name=f"topk_decode_add_/{TOPK_LABEL}", op="topk_decode_add_", entry="lc_topk_decode_add",
        setup=setup,
        # read the payload; read + write the touched fp32 values of acc (8 B per entry sent)
        nbytes=lambda n: TOPK.payload_bytes(n) + 8 * _topk_entries(n),
        ref=lambda b: topk_decode_add_ref(b["acc"], b["payload"], TOPK),
        compile_target=lambda acc, payload: topk_decode_add_ref(acc, payload, TOPK),
        compile_args=lambda b: dict(acc=b["acc"], payload=b["payload"]),
        fused=lambda b, backend: topk_decode_add_(b["acc"], b["payload"], backend=backend, **TOPK_KW),
        note=f"one payload ({TOPK.k} of every {TOPK.chunk} values, {TOPK.bits} bits) added into an fp32 "
             "buffer in place. Bytes counted: read the payload, read + write the k·n/chunk touched fp32 "
             "values at 4 B each (8 B per entry), not the 64-byte lines they sit in; the rest of the "
             "buffer is not touched",
        no_target="a scatter of k values per chunk at data-dependent addresses, not a bandwidth op",
        compile_dynamic=False, extra=dict(TOPK_KW))


WORKLOADS: list[Workload] = [
    _pack_workload(torch.float32, "fp32-wire"),
    _pack_workload(torch.bfloat16, "bf16-wire"),
    _merge_workload(MERGE_TAYLOR, "taylor", "momentum 0.9 Nesterov, beta 1, lam 0.5 absolute", True),
    _merge_workload(MERGE_NORMALIZED, "normalized",
                    "as taylor with lam_mode='normalized': a read-only norms pass (5 reads) precedes the "
                    "fused pass, so the ceiling is 32/52 = 62% of memcpy", False,
                    "a read-only norms pass precedes the fused pass: its ceiling is 62% of memcpy"),
    _gather_workload(0.01), _gather_workload(0.1),
    _scatter_workload(0.01), _scatter_workload(0.1),
    _norms_workload(),
    _mask_workload(),
    _qpack_workload("int8"),
    _qpack_workload("int4"),
    _qpack_workload("fp4_e3m0"),
    _qmerge_workload("int8"),
    _topk_encode_workload(),
    _topk_decode_workload(),
]


# ------------------------------------------------------------------------------------- memcpy
def nt_copy_available() -> bool:
    lib = _native.cpu_lib()
    return lib is not None and hasattr(lib, "lc_copy_nt")


def cpu_copy_nt(dst: torch.Tensor, src: torch.Tensor) -> None:
    """memcpy with non-temporal stores from the native library: the honest roofline on CPUs
    (torch's copy_ pays a hidden read-for-ownership of dst; docs/design.md)."""
    lib = _native.cpu_lib()
    assert lib is not None
    rc = lib.lc_copy_nt(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    _native.check(rc, "lc_copy_nt")


def copy_buffers(op_bytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """src/dst for a copy that moves `op_bytes` in total (op_bytes/2 read + op_bytes/2 written)."""
    half = max(64, (op_bytes // 2 + 63) // 64 * 64)  # whole cache lines
    src = torch.empty(half, dtype=torch.uint8, device=device).fill_(1)
    return src, torch.empty_like(src).fill_(0)  # fill: first-touch the pages outside the timing
