"""liblowcomm_cuda on a GPU (skipped without one, or without the library built by
bench/build_cuda.sh --install): the properties the CPU suite cannot see.

* reductions (fragment_norms, taylor_norms) repeat bit for bit and agree with the ref;
* the vector path with a peeled head: operands sharing a misalignment give the same bits as
  aligned ones and write nothing outside;
* the normalized merge reads nothing on the host (torch's sync debug mode raises on a sync);
* bf16 NaN is the CUDA intrinsic's 0x7FFF, byte-identical to torch's CUDA conversion;
* a failed call names the entry point and the argument or the CUDA error;
* the quantized wire formats (pack with residual, snapshot and stochastic rounding, dequantize,
  reduce) give the reference's bits, and the merges with a quantized average give the bits of the
  dense CUDA merge on the dequantized average.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from lowcomm_kernels import _native
from lowcomm_kernels.ops import fragment_norms, fragment_norms_ref, outer_merge_, outer_merge_ref, pack
from lowcomm_kernels.ops._common import launch
from lowcomm_kernels.ops.outer_merge import taylor_norms_ref
from lowcomm_kernels.ops.quantize import (
    FORMATS,
    Quantized,
    dequantize,
    dequantize_ref,
    pack_quantized,
    pack_quantized_ref,
    reduce_quantized,
    reduce_quantized_ref,
)
from lowcomm_kernels.ops.sparse import sparse_scatter_merge_

pytestmark = pytest.mark.gpu

F64_F32 = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])


@pytest.fixture(autouse=True)
def _cuda_lib():
    if not torch.cuda.is_available() or _native.cuda_lib() is None:
        pytest.skip("needs a GPU and liblowcomm_cuda")


def _randn(n: int, dtype: torch.dtype, rng: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(n, generator=rng, dtype=torch.float64)).to("cuda", dtype)


def _state(n, dtype, rng, avg_dtype=None):
    xs = _randn(n, dtype, rng)
    return xs + _randn(n, dtype, rng, 0.1), _randn(n, dtype, rng, 0.1), _randn(n, dtype, rng, 0.1).to(
        avg_dtype or dtype), xs + _randn(n, dtype, rng, 0.1), xs


# ---- fixed-order reductions ------------------------------------------------------------------

@F64_F32
@pytest.mark.parametrize("bounds", [[0, 3_000_007], [0, 5, 5, 70_000, 1_000_003], [0] + list(range(1, 3000))],
                         ids=["one-segment", "mixed", "many-small"])
@pytest.mark.parametrize("ord", [1, 2])
def test_fragment_norms_repeat_and_match_ref(bounds, ord, dtype, rng, close):
    buf = _randn(bounds[-1] + 3, dtype, rng)[3:]  # misaligned start: scalar loads, same order
    offsets = torch.tensor(bounds, dtype=torch.int64, device="cuda")
    first = fragment_norms(buf, offsets, ord=ord, backend="cuda")
    for _ in range(3):
        assert torch.equal(fragment_norms(buf, offsets, ord=ord, backend="cuda"), first)
    ref = fragment_norms_ref(buf.cpu(), offsets.cpu(), ord=ord)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    close.assert_close(first.cpu(), ref, kind="reduction", n=longest)


@pytest.mark.parametrize("n", [1, 2047, 2048, 2049, 3_000_017])
@pytest.mark.parametrize("avg", ["same", "bf16"])
@F64_F32
def test_taylor_norms_repeat_and_match_ref(n, avg, dtype, rng, close):
    state = _state(n, dtype, rng, torch.bfloat16 if avg == "bf16" else None)
    outs = []
    for _ in range(3):
        out = torch.full((2,), float("nan"), dtype=torch.float64, device="cuda")  # overwritten, not added to
        launch("taylor_norms", "cuda", *state, 0.7, 0.9, True, out)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs)
    ref = taylor_norms_ref(*(t.cpu() for t in state), lr=0.7, momentum=0.9, nesterov=True)
    rtol = close.tolerance("elementwise", dtype)[0] + close.tolerance("reduction", torch.float64, n)[0]
    torch.testing.assert_close(outs[0].cpu(), ref, rtol=rtol, atol=0)


# ---- vector path with a peeled head -------------------------------------------------------------

FULL = dict(lr=0.7, momentum=0.9, nesterov=True, alpha=0.25, beta=1.0, lam=0.3)


def _views(tensors, offsets):
    """Copies of `tensors` at element `offsets` inside fresh buffers filled with 7 (for overrun)."""
    bufs, views = [], []
    for t, off in zip(tensors, offsets, strict=True):
        buf = torch.full((t.numel() + 16,), 7.0, dtype=t.dtype, device=t.device)
        buf[off: off + t.numel()] = t
        bufs.append((buf, off, t.numel()))
        views.append(buf[off: off + t.numel()])
    return bufs, views


@F64_F32
@pytest.mark.parametrize("n", [1, 3, 5, 33, 4099, 1_000_003])
@pytest.mark.parametrize("offsets", [(0,) * 5, (1,) * 5, (2,) * 5, (3,) * 5, (1, 2, 3, 5, 7)],
                         ids=["aligned", "all+1", "all+2", "all+3", "mixed"])
def test_merge_misaligned_same_bits(n, offsets, dtype, rng):
    state = _state(n, dtype, rng)
    aligned = [t.clone() for t in state]
    outer_merge_(*aligned, backend="cuda", **FULL)
    bufs, views = _views(state, offsets)
    outer_merge_(*views, backend="cuda", **FULL)
    for i in (0, 1, 3):
        assert torch.equal(views[i].view(torch.uint8), aligned[i].view(torch.uint8))
    for buf, off, m in bufs:
        assert bool((buf[:off] == 7).all()) and bool((buf[off + m:] == 7).all()), "wrote outside"


@F64_F32
@pytest.mark.parametrize("wire", ["same", "bf16"])
@pytest.mark.parametrize("n", [1, 3, 5, 33, 4099, 1_000_003])
@pytest.mark.parametrize("off", [0, 1, 3])
def test_pack_misaligned_same_bits(n, off, wire, dtype, rng):
    g, x = _randn(n, dtype, rng), _randn(n, dtype, rng)
    wire_dtype = torch.bfloat16 if wire == "bf16" else dtype
    d0, s0, nf0 = pack(g, x, wire_dtype=wire_dtype, backend="cuda")
    bufs, (gv, xv) = _views([g, x], [off, off])
    dbuf = torch.full((n + 16,), 7.0, dtype=wire_dtype, device="cuda")
    sbuf = torch.full((n + 16,), 7.0, dtype=dtype, device="cuda")
    d1, s1, nf1 = pack(gv, xv, wire_dtype=wire_dtype, delta_out=dbuf[off: off + n],
                       snapshot_out=sbuf[off: off + n], backend="cuda")
    assert torch.equal(d1.view(torch.uint8), d0.view(torch.uint8)) and torch.equal(s1, s0)
    assert int(nf1) == int(nf0)
    for buf in (dbuf, sbuf):
        assert bool((buf[:off] == 7).all()) and bool((buf[off + n:] == 7).all()), "wrote outside"


@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("n", [1, 3, 5, 33, 4099, 1_000_003])
@pytest.mark.parametrize("offsets", [(0,) * 5, (1,) * 5, (3,) * 5, (5,) * 5, (1, 2, 3, 5, 7)],
                         ids=["aligned", "all+1", "all+3", "all+5", "mixed"])
def test_low_precision_x_misaligned_same_bits(n, offsets, xdt, rng):
    """A bf16 / fp16 x beside float32 g, u, x_sent (its master): the vector path moves 8 bytes of x
    per 4 elements; views sharing a misalignment (and mixed ones, scalar) give the aligned bits,
    write nothing outside, and x is the float32 merge rounded once (within one ulp of the CPU
    spec, which may differ in where an fp32 product is fused)."""
    g, u, d, x, xs = _state(n, torch.float32, rng)
    state = [g, u, d, x.to(xdt), xs]
    aligned = [t.clone() for t in state]
    outer_merge_(*aligned, backend="cuda", **FULL)
    bufs, views = _views(state, offsets)
    outer_merge_(*views, backend="cuda", **FULL)
    for i in (0, 1, 3):
        assert torch.equal(views[i].view(torch.uint8), aligned[i].view(torch.uint8))
    for buf, off, m in bufs:
        assert bool((buf[:off] == 7).all()) and bool((buf[off + m:] == 7).all()), "wrote outside"
    spec = [t.cpu() for t in state]
    outer_merge_ref(*spec, **FULL)
    eps = torch.finfo(xdt).eps
    torch.testing.assert_close(aligned[3].cpu().double(), spec[3].double(), rtol=eps, atol=2.0**-24)
    d0, s0, nf0 = pack(g, x.to(xdt), wire_dtype=torch.bfloat16, backend="cuda")
    assert s0.dtype == torch.float32 and torch.equal(s0, x.to(xdt).float())


# ---- the normalized merge stays on the device ------------------------------------------------------

@pytest.mark.parametrize("backend", ["cuda", "triton"])
@F64_F32
def test_normalized_merge_without_host_sync(backend, dtype, rng, close):
    from lowcomm_kernels import _dispatch

    if not _dispatch.available(backend, torch.device("cuda"), "lc_outer_merge"):
        pytest.skip(f"{backend} is not available")
    n = 100_003
    kw = dict(FULL, lam_mode="normalized")
    state = _state(n, dtype, rng)
    ref = [t.cpu() for t in state]
    outer_merge_(*[t.clone() for t in state], backend=backend, **kw)  # warm up (compile, allocate)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outer_merge_(*state, backend=backend, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    outer_merge_ref(*ref, **kw)
    rtol = close.tolerance("elementwise", dtype)[0] + close.tolerance("reduction", dtype, n)[0]
    for i in (0, 1, 3):
        torch.testing.assert_close(state[i].cpu(), ref[i], rtol=rtol, atol=8 * rtol)


# ---- bf16 bits ---------------------------------------------------------------------------------

@F64_F32
def test_bf16_wire_is_torch_cuda_bits(dtype, rng):
    """Every float32 class (random bit patterns: NaN payloads, ±inf, subnormals, overflow): the
    bytes torch's CUDA conversion writes (__float2bfloat16_rn: NaN -> 0x7FFF on sm_80+)."""
    n = 1 << 20
    raw = torch.randint(-(2**31), 2**31, (n,), generator=rng, dtype=torch.int64).to(torch.int32)
    g = raw.view(torch.float32).to(dtype).cuda()
    g[:4] = torch.tensor([float("nan"), -float("nan"), float("inf"), 3.4e38], dtype=dtype)
    x = torch.zeros_like(g)
    delta, _, nonfinite = pack(g, x, wire_dtype=torch.bfloat16, backend="cuda")
    expected = (g - x).to(torch.bfloat16)
    assert torch.equal(delta.view(torch.int16), expected.view(torch.int16))
    nan = torch.isnan(expected)
    assert bool(((delta.view(torch.int16)[nan].int() & 0xFFFF) == 0x7FFF).all())
    assert int(nonfinite) == int((~torch.isfinite(expected)).sum())


# ---- error messages ----------------------------------------------------------------------------

def test_cuda_errors_name_the_entry_point_and_the_cause():
    lib = _native.cuda_lib()
    stream = _native.stream_ptr(torch.device("cuda"))
    t = torch.zeros(8, device="cuda")
    rc = lib.lc_cuda_pack(0, 1, t.data_ptr(), t.data_ptr(), t.data_ptr(), None, 8, t.data_ptr(), stream)
    assert rc == 1
    msg = _native.last_error("lc_cuda_pack")
    assert msg.startswith("lc_cuda_pack: dtype = 0 (f32) with wire_dtype = 1 (f64)"), msg


def test_a_cuda_api_error_is_named():
    """A CUDA call that fails (a memset of an address that is no allocation), in a child process
    so that a driver that faults instead of refusing cannot poison this process's context."""
    child = textwrap.dedent("""
        import ctypes, torch
        from lowcomm_kernels import _native
        lib = _native.cuda_lib()
        t = torch.zeros(8, device="cuda")
        stream = _native.stream_ptr(t.device)
        p = t.data_ptr()
        rc = lib.lc_cuda_pack(0, 0, p, p, p, None, 8, ctypes.c_void_p(16), stream)
        print(rc)
        print(_native.last_error("lc_cuda_pack"))
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    rc, msg = out.stdout.strip().split("\n", 1)
    assert rc == "3", out
    assert msg.startswith("lc_cuda_pack: cudaMemsetAsync(nonfinite): cuda"), msg


# ---- quantized wire formats ----------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (NaN payloads and -0 included), on the CPU."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().cpu().contiguous().view(ints[t.element_size()])


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n", [1, 7, 4099, 1_000_003])
@pytest.mark.parametrize("block", [2, 128, 4096])
@pytest.mark.parametrize("seed", [None, 5])
@F64_F32
def test_pack_quantized_is_the_refs_bits(fmt, n, block, seed, dtype, rng):
    g, x, res = _randn(n, dtype, rng), _randn(n, dtype, rng), _randn(n, dtype, rng, 0.01)
    if n > 4:
        g[n // 2] = float("inf")  # one non-finite block: NaN scale, zero codes, residual kept
        g[: min(n // 4, block)] = x[: min(n // 4, block)]  # an all-zero first block (when res is too)
        res[: min(n // 4, block)] = 0
    got_res, want_res = res.clone(), res.cpu()
    codes, scales, snap, nf = pack_quantized(
        g, x, fmt, block, residual=got_res, snapshot_out=True, seed=seed, round=3, backend="cuda"
    )
    rc, rs, rsnap, rnf = pack_quantized_ref(
        g.cpu(), x.cpu(), fmt, block, residual=want_res, snapshot=True, seed=seed, round=3
    )
    assert torch.equal(codes.cpu(), rc)
    assert torch.equal(_bits(scales), _bits(rs))
    assert torch.equal(_bits(got_res), _bits(want_res))
    assert torch.equal(_bits(snap), _bits(rsnap))
    assert int(nf) == int(rnf) == (1 if n > 4 else 0)
    # quantize (no x): the same codes as the reference's of v
    deq = dequantize(codes, scales, fmt, block, n, out_dtype=dtype, backend="cuda")
    assert torch.equal(_bits(deq), _bits(dequantize_ref(rc, rs, fmt, block, n, out_dtype=dtype)))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n", [1, 9, 70_001])
@pytest.mark.parametrize("m", [1, 3])
def test_reduce_quantized_is_the_refs_bits(fmt, n, m, rng):
    block = 64
    rows = [pack_quantized_ref(_randn(n, torch.float32, rng).cpu(), torch.zeros(n), fmt, block)[:2]
            for _ in range(m)]
    codes = torch.stack([c for c, _ in rows]).cuda()
    scales = torch.stack([s for _, s in rows]).cuda()
    oc, os_ = reduce_quantized(codes, scales, fmt, block, n, scale=1.0 / m, backend="cuda")
    rc, rs = reduce_quantized_ref(codes.cpu(), scales.cpu(), fmt, block, n, scale=1.0 / m)
    assert torch.equal(oc.cpu(), rc)
    assert torch.equal(_bits(os_), _bits(rs))


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8_e4m3", "fp4_e2m1", "fp4_e3m0"])
@pytest.mark.parametrize("n", [1, 7, 4099, 1_000_003])
@pytest.mark.parametrize("xdt", [None, torch.bfloat16], ids=["x-master", "x-bf16"])
@F64_F32
def test_quantized_merges_are_the_dense_merges_bits(fmt, n, xdt, dtype, rng):
    if xdt is not None and dtype is torch.float64:
        pytest.skip("bf16 parameters have an fp32 master")
    block = 128
    g, u, d, x, xs = _state(n, dtype, rng)
    if xdt is not None:
        x = x.to(xdt)
    zeros = torch.zeros_like(d)
    codes, scales, _, _ = pack_quantized(d, zeros, fmt, block, snapshot_out=False, backend="cuda")
    kw = dict(lr=0.7, momentum=0.9, nesterov=True, alpha=0.25, beta=0.5, lam=0.1)
    want = [t.clone() for t in (g, u, x)]
    dense = dequantize(codes, scales, fmt, block, n, out_dtype=dtype, backend="cuda")
    outer_merge_(want[0], want[1], dense, want[2], xs, **kw, backend="cuda")
    outer_merge_(g, u, Quantized(codes, scales, fmt, block), x, xs, **kw, backend="cuda")
    for got, exp in zip((g, u, x), want, strict=True):
        assert torch.equal(_bits(got), _bits(exp))
    # the sparse merge: k = n // 3 strictly increasing indices, the average as k quantized values
    k = n // 3
    if k == 0:
        return
    idx = torch.arange(0, 3 * k, 3, device="cuda")
    sent = _randn(k, dtype, rng)
    kv = _randn(k, dtype, rng)
    kc, ks, _, _ = pack_quantized(kv, zeros[:k], fmt, block, snapshot_out=False, backend="cuda")
    want_x = x.clone()
    avg = dequantize(kc, ks, fmt, block, k, out_dtype=dtype, backend="cuda")
    sparse_scatter_merge_(want_x, idx, avg, sent, beta=0.5, backend="cuda")
    sparse_scatter_merge_(x, idx, Quantized(kc, ks, fmt, block), sent, beta=0.5, backend="cuda")
    assert torch.equal(_bits(x), _bits(want_x))


def test_quantized_errors_name_the_entry_point():
    lib = _native.cuda_lib()
    stream = _native.stream_ptr(torch.device("cuda"))
    t = torch.zeros(8, device="cuda")
    p = t.data_ptr()
    rc = lib.lc_cuda_dequantize(0, p, p, 8, 3, 0, p, stream)
    assert rc == 1
    msg = _native.last_error("lc_cuda_dequantize")
    assert msg.startswith("lc_cuda_dequantize: block = 3 is not a power of two >= 2"), msg
