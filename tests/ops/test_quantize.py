"""quantize: the reference's error bounds and edge cases, every CPU backend bit-identical to the
reference, stochastic rounding, error feedback, the quantized reduction against a float64 oracle,
the merges with a quantized average, the registered ops, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lowcomm_kernels import _dispatch
from lowcomm_kernels.ops import (
    FORMATS,
    Quantized,
    dequantize,
    dequantize_ref,
    outer_merge_,
    outer_merge_ref,
    pack_quantized,
    pack_quantized_ref,
    quantize,
    quantize_ref,
    reduce_quantized,
    reduce_quantized_ref,
    sparse_scatter_merge_,
    sparse_scatter_merge_ref,
)
from lowcomm_kernels.ops.quant_format import _encode, _round_magnitude, _spacing, code_values

from ._contract import SETTINGS

CPU = torch.device("cpu")
BACKENDS = [b for b in _dispatch.available_backends(CPU) if _dispatch.available(b, CPU, "lc_pack_quantized")]
NAMES = list(FORMATS)
TINY = 2.0**-149  # the smallest fp32 subnormal
# The largest finite fp32 below FLT_MAX. FLT_MAX itself in int8 dequantizes to inf (127 * fl(FLT_MAX / 127)
# rounds up past it): the one finite input outside the bound, stated in docs/quantization.md.
BELOW_FLT_MAX = 3.4028232635611926e38


def _spacing_bound(fmt: str, v: torch.Tensor, block: int) -> torch.Tensor:
    """Per element: half the grid spacing at |v / s_b|, times s_b (the RNE error), plus the slack of
    the clamp at qmax (|q| may exceed qmax by the rounding of s_b) and of a subnormal s_b."""
    f = FORMATS[fmt]
    w = v.reshape(-1).float()
    _, s = quantize_ref(w, fmt, block)
    se = s.repeat_interleave(block)[: w.numel()].double()
    q = (w.double() / se.clamp_min(TINY)).abs().clamp_max(f.qmax).float()
    h = _spacing(f, q).double()
    return se * h / 2 + w.double().abs() * 2.0**-22 + f.qmax * TINY


def _check_roundtrip(fmt: str, v: torch.Tensor, block: int) -> None:
    codes, scales = quantize_ref(v, fmt, block)
    deq = dequantize_ref(codes, scales, fmt, block, v.numel())
    err = (deq.double() - v.reshape(-1).float().double()).abs()
    bound = _spacing_bound(fmt, v, block)
    bad = err > bound
    assert not bool(bad.any()), f"{fmt}: |v - deq| {err[bad][:4].tolist()} > bound {bound[bad][:4].tolist()}"


@pytest.mark.parametrize("fmt", NAMES)
@SETTINGS
@given(
    data=st.lists(
        st.floats(min_value=-BELOW_FLT_MAX, max_value=BELOW_FLT_MAX, width=32),
        min_size=1,
        max_size=300,
    ),
    log_block=st.integers(1, 7),
)
def test_roundtrip_error_bound(fmt, data, log_block):
    """|v − deq| <= s_b·h/2 per element (h the grid spacing at v/s_b): any values, block sizes
    and a short last block, including subnormal and near-overflow fp32 values."""
    _check_roundtrip(fmt, torch.tensor(data, dtype=torch.float32), 1 << log_block)


@pytest.mark.parametrize("fmt", NAMES)
def test_flt_max_round_trip(fmt):
    """The largest finite fp32 value: every format but int8 keeps it finite (within the bound); int8
    dequantizes it to inf, the documented exception."""
    v = torch.tensor([3.4028234663852886e38, -3.4028234663852886e38, 1.0], dtype=torch.float32)
    codes, scales = quantize_ref(v, fmt, 2)
    deq = dequantize_ref(codes, scales, fmt, 2, 3)
    if fmt == "int8":
        assert deq[:2].tolist() == [float("inf"), float("-inf")] and deq[2] == 1.0
    else:
        _check_roundtrip(fmt, v, 2)


@pytest.mark.parametrize("fmt", NAMES)
def test_edge_blocks(fmt):
    block = 8
    zeros = torch.zeros(8)
    equal = torch.full((8,), -3.25)
    tiny = torch.tensor([1e-40, -3e-41, 0.0, 2e-45, 1e-39, 0.0, -1e-40, 5e-42])
    huge = torch.tensor([3.4e38, -3.3e38, 1e38, 0.0, -1.0, 2e37, 3.0e38, -3.4e38])
    short = torch.tensor([0.5, -0.25, 0.125])
    v = torch.cat([zeros, equal, tiny, huge, short])  # 5 blocks, the last one of 3 elements
    codes, scales = quantize_ref(v, fmt, block)
    deq = dequantize_ref(codes, scales, fmt, block, v.numel())
    assert scales[0] == 0 and bool((deq[:8] == 0).all()) and not bool(torch.signbit(deq[:8]).any())
    assert FORMATS[fmt].payload_bytes(v.numel()) == codes.numel() and scales.numel() == 5
    # an all-equal block is ±qmax·s: max|v| / qmax · qmax, within one fp32 rounding of v
    torch.testing.assert_close(deq[8:16], equal, rtol=2.0**-23, atol=0)
    _check_roundtrip(fmt, v, block)
    assert bool(torch.isfinite(deq).all())


@pytest.mark.parametrize("fmt", NAMES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_blocks(fmt, backend):
    """A block holding inf / NaN gets scale NaN and codes 0 (its dequant is NaN: the receiver's
    check fires); other blocks are untouched by it; pack counts every non-finite value."""
    g = torch.randn(40, dtype=torch.float64)
    x = torch.randn(40, dtype=torch.float64)
    g[3], g[17], x[18], g[39] = math.nan, math.inf, -math.inf, 1e300  # 1e300 overflows fp32
    codes, scales, _, nonfinite = pack_quantized(g, x, fmt, 8, snapshot_out=False, backend=backend)
    assert int(nonfinite) == 4
    assert torch.isnan(scales).tolist() == [True, False, True, False, True]
    deq = dequantize(codes, scales, fmt, 8, 40, backend=backend)
    assert bool(torch.isnan(deq[:8]).all()) and bool(torch.isfinite(deq[8:16]).all())
    ref = pack_quantized_ref(g, x, fmt, 8, snapshot=False)
    assert torch.equal(codes, ref[0]) and torch.allclose(scales, ref[1], rtol=0, atol=0, equal_nan=True)


def test_fp8_is_torch_float8():
    """RNE onto the fp8 grids is torch's float8_e4m3fn / float8_e5m2 conversion, bit for bit: every
    grid point, every midpoint (ties to even) and its fp32 neighbours, random values."""
    for fmt, dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        f = FORMATS[fmt]
        tab = code_values(f)
        grid = tab[torch.isfinite(tab)].sort().values
        mids = (grid[1:] + grid[:-1]) / 2
        up, down = torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1])
        q = torch.cat([grid, mids, up, down, torch.randn(10000) * f.qmax / 4]).clamp(-f.qmax, f.qmax)
        mine = _encode(f, torch.signbit(q), _round_magnitude(f, q.abs(), None))
        assert torch.equal(mine, q.to(dtype).view(torch.uint8).to(torch.int64)), fmt


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", NAMES)
@pytest.mark.parametrize("n", [1, 7, 1000, 1000003])
def test_backend_matches_ref(backend, fmt, n, rng):
    """quantize (RNE and stochastic, fp32 / fp64 / bf16 input) and dequantize (every out dtype)
    are bit-identical to the reference on fresh random inputs."""
    block = [2, 32, 256][n % 3]
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        v = (
            torch.randn(n, generator=rng, dtype=torch.float64)
            * 10.0 ** torch.randint(-3, 4, (1,), generator=rng)
        ).to(dtype)
        for seed in (None, int(torch.randint(0, 2**62, (1,), generator=rng))):
            codes, scales = quantize(v, fmt, block, seed=seed, round=7, backend=backend)
            rc, rs = quantize_ref(v, fmt, block, seed=seed, round=7)
            assert torch.equal(codes, rc) and torch.equal(scales, rs), (dtype, seed)
    for out_dtype in (torch.float32, torch.float64, torch.bfloat16):
        deq = dequantize(codes, scales, fmt, block, n, out_dtype=out_dtype, backend=backend)
        assert torch.equal(deq, dequantize_ref(codes, scales, fmt, block, n, out_dtype=out_dtype))
    # any byte decodes as the reference decodes it (fp8's NaN / inf encodings included)
    junk = torch.randint(0, 256, codes.shape, dtype=torch.uint8, generator=rng)
    deq = dequantize(junk, scales, fmt, block, n, backend=backend)
    assert torch.allclose(deq, dequantize_ref(junk, scales, fmt, block, n), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8_e4m3", "fp4_e2m1", "fp4_e3m0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_pack_matches_ref(backend, fmt, dtype, rng):
    """pack_quantized (residual and snapshot) bit-identical to the reference, 2 rounds in a row."""
    n, block = 300007, 64
    g = torch.randn(n, generator=rng, dtype=torch.float64).to(dtype)
    x = (g + 1e-2 * torch.randn(n, generator=rng, dtype=torch.float64).to(dtype)).contiguous()
    res, res_ref = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
    for r in range(2):
        codes, scales, snap, nf = pack_quantized(
            g, x, fmt, block, residual=res, seed=3, round=r, backend=backend
        )
        rc, rs, rsnap, rnf = pack_quantized_ref(g, x, fmt, block, residual=res_ref, seed=3, round=r)
        assert torch.equal(codes, rc) and torch.equal(scales, rs) and torch.equal(snap, rsnap)
        assert torch.equal(res, res_ref) and int(nf) == int(rnf) == 0


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 / fp64 bit patterns: equal means equal to the bit (signed zeros and NaN payloads too)."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", NAMES)
@pytest.mark.parametrize("block", [64, 1024, 4096])
@pytest.mark.parametrize("with_res", [True, False], ids=["res", "nores"])
@pytest.mark.parametrize("snap", ["aligned", "offset", "none"])
def test_pack_nearest_fp32_matches_ref(backend, fmt, block, with_res, snap, rng):
    """The fp32 pack rounded to nearest (the CPU's vectorised streaming path, every format, when the
    block is a multiple of 64 and the outputs are 32-byte aligned, keeping e between its passes up
    to blocks of 1024 and recomputing it beyond; the scalar path otherwise: an offset snapshot) is
    bit-identical to the reference: codes, scales, snapshot, residual to the bit
    (signed zeros included), the non-finite count, over 2 rounds in a row. The data holds what
    vectorising could get wrong: exact ties, an all-zero block, inf / NaN blocks, a block whose
    scale is subnormal (so |q| is clamped at qmax), e = -0 with residual -0, a partial last block,
    and more than one thread's worth of elements."""
    n = (1 << 18) + 3 * block + 37
    g = torch.randn(n, generator=rng) * 10.0 ** float(torch.randint(-3, 4, (1,), generator=rng))
    x = g + 1e-2 * torch.randn(n, generator=rng)
    g[:block], x[:block] = 0.0, 0.0  # e = 0: scale 0, codes 0
    b = block  # ties: max 127 (or qmax), the others on .5 of the grid where the scale is 1
    g[b : 2 * b] = torch.arange(block, dtype=torch.float32).remainder(16) + 0.5
    g[b], x[b : 2 * b] = FORMATS[fmt].qmax, 0.0
    g[2 * b + 5], x[3 * b + 9] = math.nan, math.inf  # two non-finite blocks
    g[4 * b : 5 * b], x[4 * b : 5 * b] = torch.randn(block, generator=rng) * 2.0**-140, 0.0  # subnormal scale
    g[5 * b : 5 * b + 8], x[5 * b : 5 * b + 8] = -0.0, 0.0  # e = -0 - 0 = -0
    res = (1e-3 * torch.randn(n, generator=rng)) if with_res else None
    if res is not None:
        res[5 * b : 5 * b + 8] = -0.0
    res_ref = None if res is None else res.clone()
    out = {"aligned": torch.empty(n), "offset": torch.empty(n + 1)[1:], "none": False}[snap]
    f = FORMATS[fmt]
    for r in range(2):
        # the second round writes into preallocated codes and scales holding garbage
        reuse = {} if r == 0 else {
            "codes_out": torch.full((f.payload_bytes(n),), 0xA5, dtype=torch.uint8),
            "scales_out": torch.full((f.num_scales(n, block),), math.nan),
        }  # fmt: skip
        codes, scales, s, nf = pack_quantized(
            g, x, fmt, block, residual=res, snapshot_out=out, backend=backend, **reuse
        )
        if reuse:
            assert codes is reuse["codes_out"] and scales is reuse["scales_out"]
        rc, rs, rsnap, rnf = pack_quantized_ref(g, x, fmt, block, residual=res_ref, snapshot=snap != "none")
        assert torch.equal(codes, rc), r
        assert torch.equal(_bits(scales), _bits(rs)), r
        assert int(nf) == int(rnf) == 2, r
        if res is not None:
            assert torch.equal(_bits(res), _bits(res_ref)), r
        if snap != "none":
            assert s is not None and torch.equal(_bits(s), _bits(rsnap)), r
        g = g + 1e-3  # the next round sees other values (and the residual of this one)


FLOATS = [name for name in NAMES if FORMATS[name].kind == "float"]


def _float_sweep(fmt: str, rng: torch.Generator) -> torch.Tensor:
    """Magnitudes in [0, qmax] for a block of scale 1: every grid value, every midpoint of two
    neighbours (a tie) and the fp32 values either side of both, and every binade from 2^-40 up with
    the top 6 mantissa bits exhaustively and the low bits 0, 1, all ones, half-way or random."""
    f = FORMATS[fmt]
    grid = code_values(fmt)[: 1 << (f.bits - 1)].double()
    grid = grid[torch.isfinite(grid) & (grid <= f.qmax)].sort().values
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    exact = torch.cat([grid.float(), mids])
    near = torch.cat(
        [torch.nextafter(exact, torch.tensor(0.0)), torch.nextafter(exact, torch.tensor(math.inf))]
    )
    top = int(torch.tensor(f.qmax).view(torch.int32)) >> 23
    exps = torch.arange(127 - 40, top + 1, dtype=torch.int32)
    hi = torch.arange(64, dtype=torch.int32) << 17
    low = torch.tensor([0, 1, (1 << 17) - 1, 1 << 16], dtype=torch.int32)
    low = torch.cat([low, torch.randint(0, 1 << 17, (4,), generator=rng, dtype=torch.int32)])
    dense = (
        ((exps[:, None, None] << 23) | hi[None, :, None] | low[None, None, :]).reshape(-1).view(torch.float32)
    )
    v = torch.cat([exact, near, dense, torch.tensor([TINY, 2.0**-126])])
    return v[(v >= 0) & (v <= f.qmax)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FLOATS)
def test_float_formats_sweep_matches_ref(backend, fmt, rng):
    """The float formats' rounding on every path of the CPU pack, against the reference: the sweep
    above with both signs and ±0, 63 values to a block behind a first element of qmax·2^k, so the
    scale is exactly 2^k and the ties stay ties. The fp32 pack with error feedback (the streaming
    path: block 64, aligned outputs), the same with an offset snapshot and in fp64 (the vectorised
    scalar loop, fp32 and fp64 residual), and quantize: codes, scales and residual to the bit. The
    residual starts at -0, so e = g exactly, -0 included (its residual is +0: e − (−0))."""
    f = FORMATS[fmt]
    v = _float_sweep(fmt, rng)
    v = torch.cat([v, -v])
    block, per = 64, 63
    nb = -(-v.numel() // per)
    body = torch.zeros(nb * per)
    body[: v.numel()] = v
    k = float(2.0 ** int(torch.randint(-20, 21, (1,), generator=rng)))
    w = torch.cat([torch.full((nb, 1), f.qmax), body.view(nb, per)], dim=1).reshape(-1) * k
    for dtype, snap in ((torch.float32, True), (torch.float32, False), (torch.float64, True)):
        g = w.to(dtype)
        x = torch.zeros_like(g)
        res, res_ref = torch.full_like(g, -0.0), torch.full_like(g, -0.0)
        out = torch.empty(g.numel(), dtype=dtype) if snap else torch.empty(g.numel() + 1, dtype=dtype)[1:]
        codes, scales, _, _ = pack_quantized(
            g, x, fmt, block, residual=res, snapshot_out=out, backend=backend
        )
        rc, rs, _, _ = pack_quantized_ref(g, x, fmt, block, residual=res_ref)
        assert bool((rs == k).all())
        assert torch.equal(codes, rc), (dtype, snap)
        assert torch.equal(_bits(scales), _bits(rs)) and torch.equal(_bits(res), _bits(res_ref)), (
            dtype,
            snap,
        )
    codes, scales = quantize(w, fmt, block, backend=backend)
    assert torch.equal(codes, quantize_ref(w, fmt, block)[0])


@pytest.mark.parametrize("fmt", NAMES)
def test_error_feedback_identity(fmt, rng):
    """residual_new = e − dequant exactly (e = g − x + residual_old, fp64), and over rounds what
    was sent plus the final residual is what was owed: Σ deq_r + res_R = Σ Δ_r."""
    n, block = 5000, 32
    g = torch.randn(n, generator=rng, dtype=torch.float64)
    res = torch.zeros(n, dtype=torch.float64)
    sent = torch.zeros(n, dtype=torch.float64)
    owed = torch.zeros(n, dtype=torch.float64)
    for r in range(5):
        x = g + 0.01 * torch.randn(n, generator=rng, dtype=torch.float64)
        e = g - x + res
        codes, scales, _, _ = pack_quantized(g, x, fmt, block, residual=res, snapshot_out=False)
        deq = dequantize(codes, scales, fmt, block, n, out_dtype=torch.float64)
        assert torch.equal(res, e - deq), r
        sent += deq
        owed += g - x
    torch.testing.assert_close(sent + res, owed, rtol=0, atol=1e-13)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", NAMES)
def test_stochastic_rounding(backend, fmt):
    """Deterministic in (seed, round), different across rounds, and unbiased: a constant value
    between two grid points rounds up with the probability of its distance (mean within 5 sigma)."""
    n = 1 << 16
    f = FORMATS[fmt]
    v = torch.full((n,), 0.3)
    v[::64] = 1.0  # each block of 64 has max 1.0: s = 1/qmax, v/s = 0.3·qmax
    a = quantize(v, fmt, 64, seed=11, round=2, backend=backend)
    b = quantize(v, fmt, 64, seed=11, round=2, backend=backend)
    c = quantize(v, fmt, 64, seed=11, round=3, backend=backend)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    deq = dequantize(*a, fmt, 64, n, out_dtype=torch.float64)
    keep = torch.ones(n, dtype=torch.bool)
    keep[::64] = False
    d = deq[keep]
    q = 0.3 * f.qmax
    lo_h = float(_spacing(f, torch.tensor([q]))[0])
    p = (q / lo_h) % 1.0  # probability of rounding up
    sigma = lo_h / f.qmax * math.sqrt(p * (1 - p) / d.numel())
    assert abs(float(d.mean()) - 0.3) < 5 * sigma + 1e-7
    assert d.unique().numel() == 2  # the two neighbouring grid points, nothing else
    rne = dequantize(*quantize(v, fmt, 64, backend=backend), fmt, 64, n)[keep]
    assert rne.unique().numel() == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", NAMES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_reduce(backend, fmt, m, rng):
    """Bit-identical to the reference; within one requantization (s·h/2) plus the fp32 sum's
    rounding of the float64 oracle Σ_m dequant_m / M."""
    n, block = 100003, 128
    rows = [quantize(torch.randn(n, generator=rng), fmt, block) for _ in range(m)]
    codes = torch.stack([c for c, _ in rows])
    scales = torch.stack([s for _, s in rows])
    oc, os_ = reduce_quantized(codes, scales, fmt, block, n, scale=1.0 / m, backend=backend)
    rc, rs = reduce_quantized_ref(codes, scales, fmt, block, n, scale=1.0 / m)
    assert torch.equal(oc, rc) and torch.equal(os_, rs)
    oracle = sum(dequantize_ref(c, s, fmt, block, n, out_dtype=torch.float64) for c, s in rows) / m
    mag = sum(dequantize_ref(c, s, fmt, block, n, out_dtype=torch.float64).abs() for c, s in rows) / m
    got = dequantize_ref(oc, os_, fmt, block, n, out_dtype=torch.float64)
    bound = _spacing_bound(fmt, oracle.float(), block) + (m + 1) * 2.0**-23 * mag * (
        1 + 1 / FORMATS[fmt].qmax
    )
    assert bool(((got - oracle).abs() <= bound * 1.01).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["int8", "fp4_e2m1", "fp4_e3m0"])
@pytest.mark.parametrize("lam_mode", ["absolute", "normalized"])
@pytest.mark.parametrize("dtype,nesterov", [(torch.float32, True), (torch.float64, False)])
def test_outer_merge_quantized(backend, fmt, lam_mode, dtype, nesterov, rng):
    """outer_merge_ with a Quantized (or a tuple) Δ̄ equals the dense merge of the dequantized Δ̄,
    bit for bit (the CPU kernel dequantizes int8 inside the merge's loop, the other formats into
    chunks that the dense kernel reads)."""
    n, block = 300001, 64
    g, u, x, xs = (torch.randn(n, generator=rng, dtype=dtype) for _ in range(4))
    codes, scales = quantize(torch.randn(n, generator=rng), fmt, block)
    ref = [t.clone() for t in (g, u, x)]
    kw = {
        "lr": 0.7,
        "momentum": 0.9,
        "nesterov": nesterov,
        "alpha": 0.1,
        "beta": 1.0,
        "lam": 0.2,
        "lam_mode": lam_mode,
    }
    outer_merge_(g, u, Quantized(codes, scales, fmt, block), x, xs, **kw, backend=backend)
    deq = dequantize_ref(codes, scales, fmt, block, n, out_dtype=dtype)
    outer_merge_ref(ref[0], ref[1], deq, ref[2], xs, **kw)
    assert torch.equal(g, ref[0]) and torch.equal(u, ref[1]) and torch.equal(x, ref[2])
    outer_merge_(g, u, (codes, scales, fmt, block), x, xs, **kw, backend=backend)
    outer_merge_ref(ref[0], ref[1], deq, ref[2], xs, **kw)
    assert torch.equal(g, ref[0]) and torch.equal(x, ref[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_scatter_merge_quantized(backend, rng):
    n, k, block = 100000, 30011, 32
    x = torch.randn(n, generator=rng)
    idx = torch.randperm(n, generator=rng)[:k].sort().values
    sent = torch.randn(k, generator=rng)
    codes, scales = quantize(torch.randn(k, generator=rng), "int4", block)
    ref = x.clone()
    sparse_scatter_merge_(x, idx, Quantized(codes, scales, "int4", block), sent, beta=0.5, backend=backend)
    sparse_scatter_merge_ref(ref, idx, dequantize_ref(codes, scales, "int4", block, k), sent, beta=0.5)
    assert torch.equal(x, ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("xd", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_sparse_scatter_merge_quantized_low_precision_x(backend, xd, rng):
    """bf16 / fp16 x: sent is x's float32 master, as for the dense scatter (the kernels read it so);
    the merge matches the dense spec on the dequantized average bit for bit. A sent of x's own
    dtype is refused before anything is written (it was once accepted and read as float32)."""
    n, k, block = 5000, 1501, 32
    x = torch.randn(n, generator=rng).to(xd)
    idx = torch.randperm(n, generator=rng)[:k].sort().values
    sent = x[idx].float() - 1e-2 * torch.randn(k, generator=rng)
    codes, scales = quantize(torch.randn(k, generator=rng), "int8", block)
    ref = x.clone()
    avg = Quantized(codes, scales, "int8", block)
    sparse_scatter_merge_(x, idx, avg, sent, beta=0.5, backend=backend)
    sparse_scatter_merge_ref(ref, idx, dequantize_ref(codes, scales, "int8", block, k), sent, beta=0.5)
    assert torch.equal(x.view(torch.int16), ref.view(torch.int16))
    before = x.clone()
    with pytest.raises(TypeError, match="^sent has dtype"):
        sparse_scatter_merge_(x, idx, avg, sent.to(xd), beta=0.5, backend=backend)
    assert torch.equal(x.view(torch.int16), before.view(torch.int16))


def test_wire_sizes():
    assert FORMATS["int8"].wire_bytes(1000, 32) == 1000 + 4 * 32
    assert FORMATS["int4"].wire_bytes(1001, 32) == 501 + 4 * 32
    assert FORMATS["fp4_e2m1"].payload_bytes(7) == 4 and FORMATS["fp8_e5m2"].num_scales(64, 64) == 1
    assert {f.name: f.qmax for f in FORMATS.values()} == {
        "int8": 127,
        "int4": 7,
        "fp8_e4m3": 448,
        "fp8_e5m2": 57344,
        "fp4_e2m1": 6,
        "fp4_e3m0": 16,
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input(backend, close):
    g, x = torch.randn(100), torch.randn(100)
    res = torch.zeros(100)
    snap = torch.full((100,), 7.0)
    bufs = [g, x, res, snap]
    rej = close.assert_rejected
    rej(lambda: quantize(g, "int3", 32, backend=backend), ValueError, "fmt")
    rej(lambda: quantize(g, "int8", 24, backend=backend), ValueError, "block")
    rej(lambda: quantize(g, "int8", 1, backend=backend), ValueError, "block")
    rej(lambda: quantize(g, "int8", 32, seed=-1, backend=backend), ValueError, "seed")
    rej(lambda: quantize(g.long(), "int8", 32, backend=backend), TypeError, "v")
    pq = pack_quantized
    rej(
        lambda: pq(g, x, "int8", 32, residual=res.double(), snapshot_out=snap, backend=backend),
        TypeError,
        "residual",
        bufs,
    )
    rej(
        lambda: pq(g, x, "int8", 32, residual=res[:99], snapshot_out=snap, backend=backend),
        ValueError,
        "residual",
        bufs,
    )
    rej(
        lambda: pq(g, x, "int8", 32, residual=x, snapshot_out=snap, backend=backend),
        ValueError,
        ("x", "residual"),
        bufs,
    )
    rej(lambda: pq(g, x[:50], "int8", 32, residual=res, backend=backend), ValueError, "x", bufs)
    c_out, s_out = torch.full((100,), 9, dtype=torch.uint8), torch.full((4,), 3.0)
    outs = bufs + [c_out, s_out]
    rej(lambda: pq(g, x, "int8", 32, codes_out=c_out, backend=backend), TypeError, "codes_out", outs)
    rej(
        lambda: pq(g, x, "int8", 32, residual=res, codes_out=c_out[:99], scales_out=s_out, backend=backend),
        ValueError,
        "codes_out",
        outs,
    )
    rej(
        lambda: pq(g, x, "int8", 32, residual=res, codes_out=c_out, scales_out=s_out[:3], backend=backend),
        ValueError,
        "scales_out",
        outs,
    )
    rej(
        lambda: pq(g, x, "int8", 32, codes_out=c_out, scales_out=s_out.double(), backend=backend),
        TypeError,
        "scales_out",
        outs,
    )
    rej(
        lambda: pq(g, x, "int8", 25 * 4, codes_out=c_out, scales_out=res[:1], residual=res, backend=backend),
        ValueError,
        "block",
        outs,
    )
    alias = torch.zeros(400, dtype=torch.uint8)  # scales_out a float view of the codes' last bytes
    rej(
        lambda: pq(g, x, "int8", 32, codes_out=alias[:100], scales_out=alias[96:112].view(torch.float32)),
        ValueError,
        ("codes_out", "scales_out"),
        outs + [alias],
    )
    codes, scales = quantize(g, "int4", 32)
    out = torch.full((100,), 5.0)
    rej(
        lambda: dequantize(codes[:49], scales, "int4", 32, 100, out=out, backend=backend),
        ValueError,
        "codes",
        [out],
    )
    rej(
        lambda: dequantize(codes, scales[:3], "int4", 32, 100, out=out, backend=backend),
        ValueError,
        "scales",
        [out],
    )
    rej(
        lambda: dequantize(codes, scales.double(), "int4", 32, 100, out=out, backend=backend),
        TypeError,
        "scales",
    )
    rej(lambda: reduce_quantized(codes, scales, "int4", 32, 100, backend=backend), ValueError, "codes")
    rej(
        lambda: reduce_quantized(codes[None], scales[None], "int4", 32, 100, scale=math.nan),
        ValueError,
        "scale",
    )
    u = torch.zeros(100)
    rej(
        lambda: outer_merge_(g, u, (codes[:10], scales, "int4", 32), x, lr=1.0, backend=backend),
        ValueError,
        "delta_avg.codes",
        bufs + [u],
    )
    rej(
        lambda: outer_merge_(g, u, (codes, scales), x, lr=1.0, backend=backend),
        TypeError,
        "delta_avg",
        bufs + [u],
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    g, x = torch.randn(37), torch.randn(37)
    c, s = torch.empty(19, dtype=torch.uint8), torch.empty(2, dtype=torch.float32)
    lc = torch.ops.lowcomm
    cases = [
        (lc.pack_quantized, (g, x, torch.zeros(37), torch.empty(37), c, s, "int4", 32, True, 5, 1, backend)),
        (lc.pack_quantized, (g, None, None, None, c, s, "fp4_e2m1", 32, False, 0, 0, backend)),
    ]
    codes, scales = quantize(g, "int4", 32)
    cases += [
        (lc.dequantize, (codes, scales, torch.empty(37), "int4", 32, backend)),
        (
            lc.reduce_quantized,
            (torch.stack([codes, codes]), torch.stack([scales, scales]), c, s, "int4", 32, 37, 0.5, backend),
        ),
        (
            lc.outer_merge_quantized_,
            (
                g,
                torch.randn(37),
                codes,
                scales,
                "int4",
                32,
                x,
                torch.randn(37),
                0.7,
                0.9,
                True,
                0.1,
                1.0,
                0.2,
                "absolute",
                backend,
            ),
        ),
    ]
    for op, args in cases:
        torch.library.opcheck(op.default, args)


def test_compile_fullgraph():
    def f(g, x, res):
        codes, scales, snap, nf = pack_quantized(g, x, "int8", 64, residual=res, seed=1, round=2)
        return dequantize(codes, scales, "int8", 64, g.numel()), snap, nf

    g, x = torch.randn(1000), torch.randn(1000)
    r1, r2 = torch.zeros(1000), torch.zeros(1000)
    eager = f(g, x, r1)
    compiled = torch.compile(f, fullgraph=True)(g, x, r2)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(r1, r2)


_TRITON_CHECK = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from lowcomm_kernels.ops import (FORMATS, dequantize, dequantize_ref, pack_quantized, pack_quantized_ref,
    quantize, quantize_ref, reduce_quantized, reduce_quantized_ref)
gen = torch.Generator().manual_seed(int(sys.argv[1]))
bad = []
for f in FORMATS:
    for n in (1, 7, 1000003):
        v = torch.randn(n, generator=gen)
        for seed in (None, 9):
            c, s = quantize(v, f, 64, seed=seed, round=2, backend="triton")
            rc, rs = quantize_ref(v, f, 64, seed=seed, round=2)
            bad += [] if torch.equal(c, rc) and torch.equal(s, rs) else [("quantize", f, n, seed)]
        if not torch.equal(dequantize(c, s, f, 64, n, backend="triton"), dequantize_ref(c, s, f, 64, n)):
            bad.append(("dequantize", f, n))
        g, x, r1 = (torch.randn(n, generator=gen) for _ in range(3))
        g[n // 2] = float("inf")
        r2 = r1.clone()
        a = pack_quantized(g, x, f, 32, residual=r1, seed=4, backend="triton")
        b = pack_quantized_ref(g, x, f, 32, residual=r2, seed=4)
        same = all(torch.allclose(i, j, rtol=0, atol=0, equal_nan=True) for i, j in zip(a, b))
        bad += [] if same and torch.equal(r1, r2) else [("pack_quantized", f, n)]
        C, S = torch.stack([c, c, c]), torch.stack([s, s, s])
        out = reduce_quantized(C, S, f, 64, n, scale=1 / 3, backend="triton")
        ref = reduce_quantized_ref(C, S, f, 64, n, scale=1 / 3)
        bad += [] if all(torch.equal(i, j) for i, j in zip(out, ref)) else [("reduce", f, n)]
print("MISMATCH", bad) if bad else print("OK")
"""


def test_triton_interpreted_matches_ref(rng):
    """The Triton kernels under TRITON_INTERPRET=1 (fp32), bit-identical to the reference: quantize
    (RNE and stochastic), dequantize, pack with residual and a non-finite value, reduce. In a fresh
    interpreter, so the variable does not reach the other tests (see test_triton_interpret.py)."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    seed = str(int(torch.randint(0, 2**31, (1,), generator=rng)))
    out = subprocess.run(
        [sys.executable, "-c", _TRITON_CHECK, seed], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK"), out.stdout[-2000:]
