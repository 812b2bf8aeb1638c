"""fp4_e3m0 (1 sign, 3 exponent bits of bias 3, no mantissa: the Streaming DiLoCo paper's FP4): its
decoding table, exact round trips of its grid, ties (rint of m / h, module docstring of
ops/quantize.py), the clamp at qmax = 16, and every backend (the CPU library, the Triton kernels
under the interpreter) bit-identical to the reference on inputs that reach every binade, the
zero / subnormal end, -0, ties and a subnormal scale, with and without stochastic rounding.
(The tests of test_quantize.py parametrized over FORMATS cover it as well.)"""

from __future__ import annotations

import pytest
import torch

from lowcomm_kernels import _dispatch
from lowcomm_kernels.ops import (
    FORMATS,
    dequantize,
    dequantize_ref,
    pack_quantized,
    pack_quantized_ref,
    quantize,
    quantize_ref,
    reduce_quantized,
    reduce_quantized_ref,
)
from lowcomm_kernels.ops.quant_format import _FMT_CODE, code_values

CPU = torch.device("cpu")
FMT = "fp4_e3m0"
GRID = [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
BACKENDS = [b for b in _dispatch.available_backends(CPU) if _dispatch.available(b, CPU, "lc_pack_quantized")]
ALL = sorted({"ref", *BACKENDS})
NATIVE = [b for b in BACKENDS if b != "ref"]  # checked against the reference
TINY = 2.0**-149


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int64)


def _nibbles(codes: torch.Tensor, n: int) -> list[int]:
    c = codes.to(torch.int64)
    return torch.stack([c & 0xF, c >> 4], dim=1).reshape(-1)[:n].tolist()


def test_format_and_table():
    """The format's constants, its ABI code (appended: no other code moves) and the decoding table:
    code s|eee is (-1)^s · 2^(eee − 3), eee = 0 is ±0; no inf / NaN encodings."""
    f = FORMATS[FMT]
    assert (f.bits, f.kind, f.qmax, f.exp_bits, f.man_bits, f.emin) == (4, "float", 16.0, 3, 0, -2)
    assert list(FORMATS)[-1] == FMT and _FMT_CODE[FMT] == 5
    assert [_FMT_CODE[k] for k in ("int8", "int4", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")] == [0, 1, 2, 3, 4]
    assert f.payload_bytes(7) == 4 and f.wire_bytes(1001, 32) == 501 + 4 * 32
    tab = code_values(FMT)
    want = torch.tensor(GRID + [-g for g in GRID])
    assert torch.equal(_bits(tab), _bits(want))  # code 8 is -0.0, to the bit
    assert bool(torch.isfinite(tab).all())


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("seed", [None, 12345])
@pytest.mark.parametrize("scale_exp", [0, -7, 20])
def test_grid_round_trips_exactly(backend, seed, scale_exp):
    """The 16 grid values (±0 included) times 2^k in one block (max 16 · 2^k: s = 2^k exactly)
    encode to codes 0..15 and decode to themselves, to the bit; stochastic rounding leaves grid
    points where they are."""
    k = 2.0**scale_exp
    v = torch.tensor(GRID + [-g for g in GRID]) * k
    codes, scales = quantize(v, FMT, 16, seed=seed, round=3, backend=backend)
    assert scales.tolist() == [k]
    assert _nibbles(codes, 16) == list(range(16))
    deq = dequantize(codes, scales, FMT, 16, 16, backend=backend)
    assert torch.equal(_bits(deq), _bits(v))


# value (in a block whose scale is 1) -> its code, to nearest, ties as rint(m / h): m / h = 1.5
# rounds to 2 (up to the next power of two), and 0.125 = half of the smallest step rounds to 0.
TIES = {
    0.125: 0.0,  # between 0 and 0.25: t = 0.5 -> 0
    0.375: 0.5,  # t = 1.5 -> 2
    0.75: 1.0,
    1.5: 2.0,
    3.0: 4.0,
    6.0: 8.0,
    12.0: 16.0,
}


@pytest.mark.parametrize("backend", ALL)
def test_ties_and_neighbours(backend):
    """Each midpoint of two neighbouring grid points rounds as the reference defines (table above),
    its fp32 neighbours to the nearer point; negatives mirror (−0.125 gives −0)."""
    ties = torch.tensor(list(TIES))
    lo = torch.tensor([max(g for g in GRID if g < t) for t in TIES])
    hi = torch.tensor([min(g for g in GRID if g > t) for t in TIES])
    below, above = torch.nextafter(ties, lo), torch.nextafter(ties, hi)
    vals = torch.cat([ties, below, above])
    want = torch.cat([torch.tensor(list(TIES.values())), lo, hi])
    v = torch.cat([vals, -vals, torch.tensor([16.0])])  # the max: s = 1
    want = torch.cat([want, -want, torch.tensor([16.0])])
    codes, scales = quantize(v, FMT, 64, backend=backend)
    assert scales.tolist() == [1.0]
    deq = dequantize(codes, scales, FMT, 64, v.numel(), backend=backend)
    assert torch.equal(_bits(deq), _bits(want)), (deq - want).nonzero().reshape(-1).tolist()
    assert torch.equal(codes, quantize_ref(v, FMT, 64)[0])


@pytest.mark.parametrize("backend", ALL)
def test_clamp_beyond_qmax(backend):
    """A block whose scale is subnormal: s = fl(40 · 2^-149 / 16) = 2 · 2^-149 (2.5 rounds to even),
    so q = 20 and −20, beyond qmax: clamped to ±16; q = 12 (a tie) goes to 16 too, q = 0.5 stays."""
    v = torch.tensor([40.0, -40.0, 24.0, 1.0]) * TINY
    codes, scales = quantize(v, FMT, 4, backend=backend)
    assert scales.tolist() == [2 * TINY]
    assert _nibbles(codes, 4) == [7, 15, 7, 2]  # 16, -16, 16, 0.5
    deq = dequantize(codes, scales, FMT, 4, 4, backend=backend)
    assert deq.tolist() == [32 * TINY, -32 * TINY, 32 * TINY, TINY]


def _inputs(n: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Log-uniform magnitudes over 2^-12 .. 2^6 (every binade of the grid and below its smallest
    step, relative to the block's max), random signs, with ±0, exact ties and grid values relative
    to a power-of-two scale, a subnormal block and an all-zero block mixed in."""
    mag = torch.exp2(torch.rand(n, generator=gen, dtype=torch.float64) * 18 - 12)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
    v = mag * sign
    pick = torch.randint(0, 8, (n,), generator=gen)
    pool = torch.tensor([*TIES, *GRID[1:]], dtype=torch.float64)
    special = pool[torch.randint(0, pool.numel(), (n,), generator=gen)] * sign
    v = torch.where(pick == 0, special, v)
    v = torch.where(pick == 1, 0.0 * sign, v)  # ±0
    if n >= 64:
        v[:32] = torch.randn(32, generator=gen, dtype=torch.float64) * 2.0**-140  # subnormal scale
        v[32:64] = 0.0
    return v.to(dtype)


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("n", [1, 7, 1000003])
def test_backend_bit_identical(backend, n, rng):
    """quantize (RNE and stochastic; fp32, fp64 and bf16 input), dequantize (every out dtype), pack
    with error feedback over two rounds and the reduction: bit-identical to the reference."""
    block = [2, 32, 256][n % 3]
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        v = _inputs(n, rng, dtype)
        for seed in (None, int(torch.randint(0, 2**62, (1,), generator=rng))):
            codes, scales = quantize(v, FMT, block, seed=seed, round=7, backend=backend)
            rc, rs = quantize_ref(v, FMT, block, seed=seed, round=7)
            assert torch.equal(codes, rc) and torch.equal(_bits(scales), _bits(rs)), (dtype, seed)
            for out_dtype in (torch.float32, torch.float64, torch.bfloat16):
                deq = dequantize(codes, scales, FMT, block, n, out_dtype=out_dtype, backend=backend)
                want = dequantize_ref(codes, scales, FMT, block, n, out_dtype=out_dtype)
                assert torch.equal(deq.view(torch.uint8), want.view(torch.uint8)), (dtype, seed, out_dtype)
    g = _inputs(n, rng, torch.float32)
    res, res_ref = torch.zeros(n), torch.zeros(n)
    for r in range(2):
        x = g - _inputs(n, rng, torch.float32)
        seed = None if r == 0 else 77
        got = pack_quantized(g, x, FMT, block, residual=res, seed=seed, round=r, backend=backend)
        want = pack_quantized_ref(g, x, FMT, block, residual=res_ref, seed=seed, round=r)
        assert torch.equal(got[0], want[0]) and torch.equal(_bits(got[1]), _bits(want[1])), r
        assert torch.equal(_bits(res), _bits(res_ref)), r
    rows = [quantize_ref(_inputs(n, rng, torch.float32), FMT, block) for _ in range(3)]
    codes, scales = torch.stack([c for c, _ in rows]), torch.stack([s for _, s in rows])
    oc, os_ = reduce_quantized(codes, scales, FMT, block, n, scale=1.0 / 3, backend=backend)
    rc, rs = reduce_quantized_ref(codes, scales, FMT, block, n, scale=1.0 / 3)
    assert torch.equal(oc, rc) and torch.equal(_bits(os_), _bits(rs))


@pytest.mark.parametrize("backend", BACKENDS)
def test_error_feedback_residual(backend, rng):
    """residual_new = e − dequant(codes) exactly, and the residual stays within half a grid step of
    the block's scale per element (|e − deq| <= s · h / 2, h <= qmax / 2 = 8 at the top binade)."""
    n, block = 10007, 64
    g = torch.randn(n, generator=rng, dtype=torch.float64)
    res = torch.zeros(n, dtype=torch.float64)
    for r in range(3):
        x = g + 0.01 * torch.randn(n, generator=rng, dtype=torch.float64)
        e = g - x + res
        codes, scales, _, _ = pack_quantized(
            g, x, FMT, block, residual=res, snapshot_out=False, backend=backend
        )
        deq = dequantize(codes, scales, FMT, block, n, out_dtype=torch.float64, backend=backend)
        assert torch.equal(res, e - deq), r
        s = scales.double().repeat_interleave(block)[:n]
        assert bool((res.abs() <= 4 * s * (1 + 2.0**-20) + 1e-300).all()), r


_TRITON_CHECK = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
sys.path.insert(0, sys.argv[2])
from test_quantize_e3m0 import FMT, _inputs
from lowcomm_kernels.ops import (dequantize, dequantize_ref, pack_quantized, pack_quantized_ref,
    quantize, quantize_ref, reduce_quantized, reduce_quantized_ref)
gen = torch.Generator().manual_seed(int(sys.argv[1]))
bits = lambda t: t.view(torch.int32)
bad = []
for n in (1, 7, 100003):
    for block in (2, 64):
        v = _inputs(n, gen, torch.float32)
        for seed in (None, 9):
            c, s = quantize(v, FMT, block, seed=seed, round=2, backend="triton")
            rc, rs = quantize_ref(v, FMT, block, seed=seed, round=2)
            ok = torch.equal(c, rc) and torch.equal(bits(s), bits(rs))
            bad += [] if ok else [("quantize", n, block, seed)]
            d = dequantize(c, s, FMT, block, n, backend="triton")
            ok = torch.equal(bits(d), bits(dequantize_ref(c, s, FMT, block, n)))
            bad += [] if ok else [("deq", n, block)]
        g, x = _inputs(n, gen, torch.float32), _inputs(n, gen, torch.float32)
        r1 = _inputs(n, gen, torch.float32)
        r2 = r1.clone()
        a = pack_quantized(g, x, FMT, block, residual=r1, seed=4, backend="triton")
        b = pack_quantized_ref(g, x, FMT, block, residual=r2, seed=4)
        same = torch.equal(a[0], b[0]) and torch.equal(bits(a[1]), bits(b[1]))
        same = same and torch.equal(bits(r1), bits(r2))
        bad += [] if same else [("pack_quantized", n, block)]
        C, S = torch.stack([c, rc, c]), torch.stack([s, rs, s])
        out = reduce_quantized(C, S, FMT, block, n, scale=1 / 3, backend="triton")
        ref = reduce_quantized_ref(C, S, FMT, block, n, scale=1 / 3)
        ok = torch.equal(out[0], ref[0]) and torch.equal(bits(out[1]), bits(ref[1]))
        bad += [] if ok else [("reduce", n)]
v = torch.tensor([40.0, -40.0, 24.0, 1.0]) * 2.0**-149
c, s = quantize(v, FMT, 4, backend="triton")
bad += [] if torch.equal(c, quantize_ref(v, FMT, 4)[0]) else [("clamp",)]
print("MISMATCH", bad) if bad else print("OK")
"""


def test_triton_interpreted_bit_identical(rng):
    """The Triton kernels under TRITON_INTERPRET=1 (fp32) on the inputs above: quantize (RNE and
    stochastic), dequantize, pack with error feedback, reduce, the clamp; in a fresh interpreter."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    seed = str(int(torch.randint(0, 2**31, (1,), generator=rng)))
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", _TRITON_CHECK, seed, here], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK"), out.stdout[-2000:]
