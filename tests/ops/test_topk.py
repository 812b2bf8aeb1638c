"""The top-k sparse wire format with error feedback (ops/topk.py): the byte count, the selection and
its ties, the scale rules, the error-feedback invariants in float64, the native kernel bit-identical
to the reference (fresh random inputs, odd sizes, short last chunks, k = chunk, zeros, ties,
non-finite chunks) and across thread counts, named refusals, and opcheck of both registered ops."""

from __future__ import annotations

import pytest
import torch

from lowcomm_kernels import _dispatch
from lowcomm_kernels.ops import TopKFormat, topk_decode_add_, topk_encode, topk_encode_ref
from lowcomm_kernels.ops.topk import _unpack_bits, topk_decode_ref

CPU = torch.device("cpu")
BACKENDS = [b for b in _dispatch.available_backends(CPU) if _dispatch.available(b, CPU, "lc_topk_encode")]
NATIVE = [b for b in BACKENDS if b != "ref"]
DTYPES = [torch.float32, torch.float64]
# (n, k, chunk, bits): defaults, short last chunks, k = chunk, k past a short last chunk, tiny
SHAPES = [
    (3 * 4096 + 77, 64, 4096, 2),
    (4096, 64, 4096, 1),
    (1001, 7, 100, 1),
    (999, 16, 64, 4),
    (37, 5, 16, 2),
    (40, 16, 16, 2),
    (3, 5, 8, 2),
    (1, 1, 2, 1),
    (65537, 300, 1000, 2),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int64)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a), _bits(b))


def _parts(payload: torch.Tensor, n: int, f: TopKFormat):
    """(scales, [indices per chunk], [codes per chunk]) read back from a payload."""
    nc, kf, kl, ibf, vbf, _ = f.sections(n)
    scales = payload[: 4 * nc].clone().view(torch.float32)
    ks = [kf] * (nc - 1) + [kl]
    ib = [ibf] * (nc - 1) + [(kl * f.index_bits + 7) // 8]
    vb = [vbf] * (nc - 1) + [(kl * f.bits + 7) // 8]
    o, idx = 4 * nc, []
    for j in range(nc):
        idx.append(_unpack_bits(payload[o : o + ib[j]].view(1, -1), f.index_bits, ks[j])[0])
        o += ib[j]
    codes = []
    for j in range(nc):
        codes.append(_unpack_bits(payload[o : o + vb[j]].view(1, -1), f.bits, ks[j])[0])
        o += vb[j]
    assert o == payload.numel()
    return scales, idx, codes


def test_bytes_at_the_defaults():
    """Every byte counted: 4 (scale) + 64·12/8 (indices) + 64·2/8 (values) = 116 bytes per 4096
    values, 0.2266 bits per value, 141× fewer than fp32; a short last chunk pads to whole bytes."""
    f = TopKFormat()
    assert (f.k, f.chunk, f.bits, f.index_bits) == (64, 4096, 2, 12)
    assert f.payload_bytes(4096) == 116
    assert f.payload_bytes(10 * 4096) == 1160
    assert f.bits_per_value(1 << 26) == pytest.approx(928 / 4096)
    assert 32 / f.bits_per_value(1 << 26) == pytest.approx(141.24, abs=0.01)
    assert TopKFormat(64, 4096, 1).payload_bytes(4096) == 4 + 96 + 8
    # 3 values, k = 5, chunk 8: 3 indices of 3 bits (2 bytes), 3 codes of 2 bits (1 byte), a scale
    assert TopKFormat(5, 8, 2).payload_bytes(3) == 4 + 2 + 1
    # one full chunk of 16 (k = 5: 5·4 bits = 3 bytes, 5·4 bits = 3 bytes) and a short one of 5
    assert TopKFormat(5, 16, 4).sections(21) == (2, 5, 5, 3, 3, 8 + 6 + 6)
    assert TopKFormat().payload_bytes(0) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_chunk_by_hand(backend):
    """chunk 8, k 3, 2 bits, β = 0.5: e = 0.5·e + Δ, the three largest |e| sent, scale max |e| =
    3, levels ±1, ±3; e keeps the rest and the rounding error of the sent ones."""
    e = torch.tensor([2.0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float64)
    delta = torch.tensor([0.0, -3, 0.5, 1.4, 0, 0.2, -0.1, 2.5], dtype=torch.float64)
    payload, nonfinite = topk_encode(delta, e, k=3, chunk=8, bits=2, beta=0.5, backend=backend)
    f = TopKFormat(3, 8, 2)
    scales, idx, codes = _parts(payload, 8, f)
    # e after the update: [1, -3, .5, 1.4, 0, .2, -.1, 2.5]: the top 3 are 1 (-3), 7 (2.5), 3 (1.4)
    assert idx[0].tolist() == [1, 3, 7]
    assert scales.tolist() == [3.0]
    # m = -1, 0.4667, 0.8333 -> (m·3 + 3)/2 = 0, 2.2, 2.75 -> codes 0, 2, 3 -> -3, 1, 3
    assert codes[0].tolist() == [0, 2, 3]
    want = torch.tensor([1.0, 0, 0.5, 0.4, 0, 0.2, -0.1, -0.5], dtype=torch.float64)
    torch.testing.assert_close(e, want, rtol=0, atol=1e-15)
    assert int(nonfinite) == 0
    dec = topk_decode_ref(payload, 8, f)
    assert dec.tolist() == [0.0, -3, 0, 1, 0, 0, 0, 3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_go_to_the_lower_index(backend):
    """Equal |e| (signs differ, ±0 among the zeros) are taken in index order; an all-zero chunk sends
    its first k indices with scale 0 and leaves e at zero."""
    e = torch.zeros(16)
    delta = torch.tensor([0.0, 1, -1, 0, 1, -0.0, -1, 1, 0, 0, 0, 0, 0, 0, 0, 0.5])
    payload, _ = topk_encode(delta, e, k=3, chunk=8, bits=1, beta=1.0, backend=backend)
    scales, idx, codes = _parts(payload, 16, TopKFormat(3, 8, 1))
    assert idx[0].tolist() == [1, 2, 4]
    assert idx[1].tolist() == [0, 1, 7]  # 0.5 first, then the two lowest zeros
    assert scales.tolist() == [1.0, pytest.approx(0.5 / 3)]
    assert codes[0].tolist() == [1, 0, 1]
    z = torch.zeros(8)
    payload, _ = topk_encode(torch.zeros(8), z, k=3, chunk=8, bits=2, backend=backend)
    scales, idx, _ = _parts(payload, 8, TopKFormat(3, 8, 2))
    assert idx[0].tolist() == [0, 1, 2] and scales.tolist() == [0.0]
    assert torch.equal(z, torch.zeros(8)) and not bool(torch.signbit(z).any())


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_error_feedback_invariants_in_float64(bits):
    """What is not sent stays in e exactly; the entries sent keep only their rounding error (|e_i|
    after <= s / Lq for b >= 2, the grid's half step); and over rounds, with β = 1, the sum of
    everything decoded plus e equals the sum of every Δ (to fp64 rounding)."""
    gen = torch.Generator().manual_seed(3)
    n, f = 5000, TopKFormat(9, 300, bits)
    e = torch.zeros(n, dtype=torch.float64)
    sent_total = torch.zeros(n, dtype=torch.float64)
    delta_total = torch.zeros(n, dtype=torch.float64)
    for _ in range(6):
        delta = torch.randn(n, generator=gen, dtype=torch.float64)
        before = e + delta
        payload, nf = topk_encode(delta, e, k=f.k, chunk=f.chunk, bits=bits, beta=1.0, backend="ref")
        assert int(nf) == 0
        dec = topk_decode_ref(payload, n, f).to(torch.float64)
        untouched = dec == 0
        assert torch.equal(e[untouched], before[untouched])
        scales, _, _ = _parts(payload, n, f)
        if bits > 1:
            s = scales.to(torch.float64).repeat_interleave(f.chunk)[:n]
            assert bool((e[~untouched].abs() <= s[~untouched] / ((1 << bits) - 1) * (1 + 1e-6)).all())
        sent_total += dec
        delta_total += delta
    torch.testing.assert_close(sent_total + e, delta_total, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_native_encode_and_decode_match_the_reference(backend, dtype, shape, rng):
    """Fresh random inputs: payload, e and the count bit for bit; decoding into a random buffer too.
    Heavy-tailed Δ, exact zeros and repeated magnitudes exercise ties and the clamp."""
    n, k, chunk, bits = shape
    gen = rng  # seeded per test (conftest), reported on failure
    delta = torch.randn(n, generator=gen, dtype=torch.float64) ** 3
    delta[torch.rand(n, generator=gen) < 0.2] = 0.0
    delta[torch.rand(n, generator=gen) < 0.1] = 0.75
    delta = delta.to(dtype)
    e0 = (0.1 * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype)
    for beta in (0.95, 1.0, 0.0):
        e_ref, e_nat = e0.clone(), e0.clone()
        p_ref, nf_ref = topk_encode(delta, e_ref, k=k, chunk=chunk, bits=bits, beta=beta, backend="ref")
        p_nat, nf_nat = topk_encode(delta, e_nat, k=k, chunk=chunk, bits=bits, beta=beta, backend=backend)
        assert torch.equal(p_nat, p_ref), (beta, "payload")
        assert _same(e_nat, e_ref), (beta, "e")
        assert int(nf_nat) == int(nf_ref) == 0
        for out_dtype in DTYPES:
            o_ref = torch.randn(n, generator=gen, dtype=torch.float64).to(out_dtype)
            o_nat = o_ref.clone()
            topk_decode_add_(o_ref, p_ref, k=k, chunk=chunk, bits=bits, backend="ref")
            topk_decode_add_(o_nat, p_ref, k=k, chunk=chunk, bits=bits, backend=backend)
            assert _same(o_nat, o_ref), (beta, out_dtype)


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize(
    "n,fmt",
    [((1 << 21) + 12345, {}), ((1 << 20) + 12345, dict(k=32, chunk=64))],
    ids=["encode-parallel", "decode-parallel"],
)
def test_native_is_the_same_on_any_number_of_threads(backend, n, fmt):
    """Large enough to run in parallel: 1, 2 and 3 threads write the same bits. The native library
    runs the encode on one thread below 2^21 values and the decode below 2^19 entries (csrc/cpu/
    topk.cpp), so the default format at 2^21+ values takes the parallel encode, and k = 32 of every
    64 at 2^20+ values (2^19+ entries) the parallel decode."""
    gen = torch.Generator().manual_seed(5)
    delta, e0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            e = e0.clone()
            p, nf = topk_encode(delta, e, backend=backend, **fmt)
            out = torch.zeros(n)
            topk_decode_add_(out, p, backend=backend, **fmt)
            results.append((p, e, out))
    finally:
        torch.set_num_threads(threads)
    e_ref = e0.clone()
    p_ref, _ = topk_encode(delta, e_ref, backend="ref", **fmt)
    out_ref = torch.zeros(n)
    topk_decode_add_(out_ref, p_ref, backend="ref", **fmt)
    for p, e, out in results:
        assert torch.equal(p, p_ref) and _same(e, e_ref)
        assert _same(out, out_ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_non_finite_chunks(backend, dtype):
    """check_values (the default) refuses a non-finite delta or e by name, before writing. Without
    it a chunk holding inf / NaN is not encoded (scale NaN, indices 0..k−1, codes 0, e kept) and
    counted; the other chunks are encoded as usual, bit for bit as the reference."""
    n = 50
    delta = torch.randn(n, dtype=torch.float64).to(dtype)
    e = torch.zeros(n, dtype=dtype)
    bad = delta.clone()
    bad[3], bad[25] = float("inf"), float("nan")
    e_before = e.clone()
    with pytest.raises(ValueError, match="^delta holds non-finite"):
        topk_encode(bad, e, k=4, chunk=16, backend=backend)
    with pytest.raises(ValueError, match="^e holds non-finite"):
        topk_encode(delta, bad.clone(), k=4, chunk=16, backend=backend)
    assert torch.equal(e, e_before)
    e_ref = e.clone()
    p, nf = topk_encode(bad, e, k=4, chunk=16, backend=backend, check_values=False)
    p_ref, nf_ref = topk_encode_ref(bad, e_ref, TopKFormat(4, 16, 2), 0.95)
    assert int(nf) == int(nf_ref) == 2
    assert torch.equal(p, p_ref) and torch.equal(e.nan_to_num(), e_ref.nan_to_num())
    scales, idx, codes = _parts(p, n, TopKFormat(4, 16, 2))
    assert torch.isnan(scales[0]) and torch.isnan(scales[1]) and bool(torch.isfinite(scales[2:]).all())
    assert idx[0].tolist() == [0, 1, 2, 3] and codes[0].tolist() == [0, 0, 0, 0]
    assert torch.equal(e[16:32].nan_to_num(), bad[16:32].nan_to_num())  # kept: 0.95·0 + Δ


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_scale_beyond_fp32_is_counted(backend):
    """fp64 values whose chunk maximum overflows the fp32 scale: not encoded, counted once per chunk."""
    delta = torch.tensor([1e300, 1.0, 0.0, 2.0], dtype=torch.float64)
    e = torch.zeros(4, dtype=torch.float64)
    p, nf = topk_encode(delta, e, k=1, chunk=2, bits=2, backend=backend, check_values=False)
    assert int(nf) == 1
    scales, _, _ = _parts(p, 4, TopKFormat(1, 2, 2))
    assert torch.isnan(scales[0]) and scales[1].item() == 2.0
    assert e.tolist() == [1e300, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_are_refused_by_name(backend):
    d, e = torch.randn(100), torch.zeros(100)
    cases = [
        (dict(k=17, chunk=16), ValueError, "^k must be in \\[1, 16\\]"),
        (dict(k=0), ValueError, "^k must be"),
        (dict(chunk=1), ValueError, "^chunk must be"),
        (dict(bits=3), ValueError, "^bits must be one of \\(1, 2, 4\\)"),
        (dict(bits=2.0), TypeError, "^bits must be an int"),
        (dict(beta=1.5), ValueError, "^beta must be <= 1"),
        (dict(beta=-0.1), ValueError, "^beta must be >= 0"),
        (dict(beta=float("nan")), ValueError, "^beta must be finite"),
    ]
    for kw, exc, text in cases:
        with pytest.raises(exc, match=text):
            topk_encode(d, e, backend=backend, **kw)
    with pytest.raises(TypeError, match="^delta has dtype float64"):
        topk_encode(d.double(), e, backend=backend)
    with pytest.raises(ValueError, match="^delta has 99 elements"):
        topk_encode(d[:99], e, backend=backend)
    with pytest.raises(ValueError, match="^payload_out has 5 bytes"):
        topk_encode(d, e, payload_out=torch.empty(5, dtype=torch.uint8), backend=backend)
    with pytest.raises(ValueError, match="^delta and e share memory"):
        topk_encode(e, e, backend=backend)
    assert torch.equal(e, torch.zeros(100))
    payload, _ = topk_encode(d, e, k=4, chunk=16, backend=backend)
    with pytest.raises(ValueError, match="^payload has"):
        topk_decode_add_(torch.zeros(130), payload, k=4, chunk=16, backend=backend)
    with pytest.raises(TypeError, match="^out has dtype bfloat16"):
        topk_decode_add_(torch.zeros(100, dtype=torch.bfloat16), payload, k=4, chunk=16, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_corrupt_index_is_refused_before_anything_is_written(backend):
    """An index past its chunk (the short last chunk here) is refused, out untouched."""
    f = TopKFormat(2, 8, 2)
    payload, _ = topk_encode(torch.arange(10.0), torch.zeros(10), k=2, chunk=8, bits=2, backend=backend)
    nc, _, kl, ibf, _, _ = f.sections(10)
    bad = payload.clone()
    bad[4 * nc + ibf] = 0b111_111  # last chunk (2 values): indices 7 and 7
    out = torch.zeros(10)
    with pytest.raises((ValueError, RuntimeError), match="payload"):
        topk_decode_add_(out, bad, k=2, chunk=8, bits=2, backend=backend)
    assert torch.equal(out, torch.zeros(10))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_opcheck(backend, dtype):
    gen = torch.Generator().manual_seed(0)
    n, f = 37, TopKFormat(5, 16, 2)
    d = torch.randn(n, generator=gen, dtype=dtype)
    e = torch.randn(n, generator=gen, dtype=dtype)
    payload = torch.empty(f.payload_bytes(n), dtype=torch.uint8)
    torch.library.opcheck(
        torch.ops.lowcomm.topk_encode.default, (d, e, payload, 5, 16, 2, 0.9, backend, True)
    )
    full, _ = topk_encode(d, e.clone(), k=5, chunk=16, bits=2, backend=backend)
    out = torch.randn(n, generator=gen, dtype=dtype)
    torch.library.opcheck(torch.ops.lowcomm.topk_decode_add_.default, (out, full, 5, 16, 2, backend))


def _encode_decode(delta, e, out):
    payload, nonfinite = topk_encode(delta, e, k=5, chunk=16, bits=2, beta=0.9)
    topk_decode_add_(out, payload, k=5, chunk=16, bits=2)
    return payload, nonfinite


@pytest.mark.slow
def test_compile_fullgraph_equals_eager():
    """torch.compile(fullgraph=True) of an encode and a decode through the registered ops: the same
    payload, e and out as eager, and a bad argument still refused by name from the compiled code."""
    gen = torch.Generator().manual_seed(2)
    delta, e, out = (torch.randn(101, generator=gen) for _ in range(3))
    eager_in = [t.clone() for t in (delta, e, out)]
    compiled_in = [t.clone() for t in (delta, e, out)]
    want = _encode_decode(*eager_in)
    torch._dynamo.reset()
    got = torch.compile(_encode_decode, fullgraph=True)(*compiled_in)
    assert torch.equal(got[0], want[0]) and int(got[1]) == int(want[1])
    for a, b in zip(compiled_in, eager_in, strict=True):
        assert _same(a, b)
    with pytest.raises(ValueError, match="^delta holds non-finite"):
        torch.compile(_encode_decode, fullgraph=True)(
            torch.full((101,), float("nan")), e.clone(), out.clone()
        )


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and _dispatch.available("cuda", torch.device("cuda"), "lc_topk_encode")


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ready(), reason="needs a GPU and liblowcomm_cuda")
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2] <= 4096] + [(5000, 4096, 4096, 2)], ids=str)
def test_cuda_matches_the_reference(shape):
    """fp32 on the GPU (chunks up to 4096): payload, e, the count and the decode bit for bit."""
    n, k, chunk, bits = shape
    gen = torch.Generator().manual_seed(n + k)
    delta = (torch.randn(n, generator=gen, dtype=torch.float64) ** 3).float()
    delta[torch.rand(n, generator=gen) < 0.2] = 0.0
    e0 = 0.1 * torch.randn(n, generator=gen)
    f = TopKFormat(k, chunk, bits)
    e_ref = e0.clone()
    p_ref, nf_ref = topk_encode_ref(delta, e_ref, f, 0.95)
    e_gpu = e0.cuda()
    p_gpu, nf_gpu = topk_encode(delta.cuda(), e_gpu, k=k, chunk=chunk, bits=bits, backend="cuda")
    assert torch.equal(p_gpu.cpu(), p_ref) and _same(e_gpu.cpu(), e_ref) and int(nf_gpu) == int(nf_ref)
    for dtype in DTYPES:
        o_ref = torch.randn(n, generator=gen, dtype=dtype)
        o_gpu = o_ref.cuda()
        topk_decode_add_(o_ref, p_ref, k=k, chunk=chunk, bits=bits, backend="ref")
        topk_decode_add_(o_gpu, p_ref.cuda(), k=k, chunk=chunk, bits=bits, backend="cuda")
        assert _same(o_gpu.cpu(), o_ref)


def test_a_huge_chunk_over_a_small_buffer_allocates_by_the_buffer():
    """A chunk knob of 2^30 over 337 values: the kernel's work buffers are sized by the values, not the
    knob (it used to reserve gigabytes and abort the process with std::bad_alloc)."""
    import subprocess
    import sys

    code = (
        # the address-space limit in the child only
        "import resource, torch; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30));"
        "from lowcomm_kernels.ops import topk;"
        "p, n = topk.topk_encode(torch.randn(337), torch.zeros(337), k=8, chunk=2**30);"
        "print(p.numel(), int(n))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[1] == "0"
