"""bf16 / fp16 parameters with a float32 master: every backend bit-identical to the `*_ref` spec.

The rule (docs/algorithms.md, "Low-precision parameters"): x is bf16 or fp16; g, u, x_sent, pack's
snapshot and the scatter's `sent` are float32; every element is computed in float32 from x widened
exactly, and x is written back rounded to nearest even once (as ``float32_tensor.to(x.dtype)``).
The inputs put values on the edges of that rule: exact ties of the x dtype (round to even),
subnormals of both x dtypes, fp16's overflow boundary (65504 stays, 65520 is a tie that rounds to
inf), inf and NaN. NaN payloads are not specified (only NaN-ness is compared), as for the bf16 wire.
"""

from __future__ import annotations

import pytest
import torch

from lowcomm_kernels import ops
from lowcomm_kernels.ops import (
    fragment_norms_ref,
    outer_merge_ref,
    pack_ref,
    sparse_gather_ref,
    sparse_scatter_merge_ref,
)

LOW = (torch.bfloat16, torch.float16)
F32 = torch.float32
SIZES = [1, 7, 1000, 300_007]  # 300_007 > the CPU kernels' parallel threshold, odd


def same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit-identical, NaN-ness only for NaNs."""
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    iview = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    a, b = a.reshape(-1), b.reshape(-1)
    nan = a.isnan() & b.isnan()
    bad = (a.view(iview) != b.view(iview)) & ~nan
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} of {a.numel()} elements differ, first at "
        f"{int(bad.nonzero()[0])}: {a[bad][:4].tolist()} vs {b[bad][:4].tolist()}"
    )


def ties_and_edges(xd: torch.dtype, rng: torch.Generator) -> torch.Tensor:
    """float32 values on the edges of rounding to `xd` (see the module docstring)."""
    v = torch.randn(64, generator=rng).to(xd).float()  # representable in xd
    half_ulp = 1 << 15 if xd == torch.bfloat16 else 1 << 12  # below xd's last mantissa bit (normals)
    ties = (v.view(torch.int32) | half_ulp).view(F32)  # exactly halfway between two xd values
    sub = torch.finfo(xd).smallest_normal * torch.tensor([0.75, 0.5 + 2.0**-12, 2.0**-5, -0.3, 2.0**-9])
    edges = [ties, sub, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])]
    if xd == torch.float16:  # 65504 = max, 65520 = halfway to 65536 (the would-be next): rounds to inf
        edges.append(torch.tensor([65504.0, 65519.0, 65520.0, -65520.0, 70000.0, 1e-8]))
    return torch.cat(edges)


def mixed(n: int, xd: torch.dtype, rng: torch.Generator, edges: bool = True) -> dict[str, torch.Tensor]:
    """x in `xd`; g, u, x_sent in float32 near x, training-like (small moves) and with edge values
    spread through g (so that g − x and the merged x land on them)."""
    x = torch.randn(n, generator=rng).to(xd)
    g = x.float() + 1e-2 * torch.randn(n, generator=rng)
    x_sent = x.float() - 1e-3 * torch.randn(n, generator=rng)
    u = 1e-2 * torch.randn(n, generator=rng)
    if edges:
        e = ties_and_edges(xd, rng)
        where = torch.randperm(n, generator=rng)[: min(n, e.numel())]
        g[where] = e[: where.numel()]
    return {"g": g, "u": u, "x": x, "x_sent": x_sent}


# ---- pack -----------------------------------------------------------------------------------------


@pytest.mark.op("pack")
@pytest.mark.parametrize("xd", LOW, ids=["bf16", "f16"])
@pytest.mark.parametrize("wire", [F32, torch.bfloat16], ids=["wire_f32", "wire_bf16"])
@pytest.mark.parametrize("n", SIZES)
def test_pack_matches_the_spec_bit_for_bit(backend, xd, wire, n, rng):
    t = mixed(n, xd, rng)
    g, x = t["g"], t["x"]
    g0, x0 = g.clone(), x.clone()
    delta, snap, nonfinite = ops.pack(g, x, wire_dtype=wire, backend=backend)
    ref_delta, ref_snap, ref_nf = pack_ref(g0, x0, wire_dtype=wire)
    same_bits(delta, ref_delta, "delta")
    assert snap.dtype == F32 and torch.equal(snap, x0.float()), "the snapshot is x widened exactly to float32"
    assert torch.equal(ref_snap, x0.float())
    assert int(nonfinite) == int(ref_nf) == int((~torch.isfinite(ref_delta)).sum())
    assert torch.equal(g.view(torch.int32), g0.view(torch.int32)), "g is read-only"
    assert torch.equal(x.view(torch.int16), x0.view(torch.int16)), "x is read-only"


def test_pack_spec_is_float32_arithmetic():
    """g − x is formed in float32 from x widened exactly, rounded once to the wire dtype: a bf16
    x of 1 and g = 1 + 2⁻⁸ + 2⁻¹⁶ gives Δ = 2⁻⁸ + 2⁻¹⁶ exactly in float32 (a bf16 subtraction would
    give 0 or 2⁻⁸) and 2⁻⁸ on a bf16 wire (the 2⁻¹⁶ below bf16's 8 bits rounded away)."""
    x = torch.ones(1, dtype=torch.bfloat16)
    g = torch.tensor([1 + 2.0**-8 + 2.0**-16])
    d32, snap, _ = pack_ref(g, x, wire_dtype=F32)
    d16, _, _ = pack_ref(g, x, wire_dtype=torch.bfloat16)
    assert d32.item() == 2.0**-8 + 2.0**-16 and d16.item() == 2.0**-8 and snap.dtype == F32


@pytest.mark.op("pack")
@pytest.mark.parametrize("xd", LOW, ids=["bf16", "f16"])
def test_pack_counts_nonfinite(backend, xd):
    x = torch.tensor([1.0, 2.0, 3.0, float("inf"), 0.0], dtype=xd)
    g = torch.tensor([float("nan"), 2.0, float("inf"), 1.0, 3e38])  # 3e38 - 0 fits in f32 and bf16
    for wire in (F32, torch.bfloat16):
        _, _, nf = ops.pack(g, x, wire_dtype=wire, backend=backend)
        assert int(nf) == 3, (wire, int(nf))


# ---- outer_merge_ ---------------------------------------------------------------------------------

MERGES = {
    "overwrite": dict(lr=0.7, momentum=0.9, nesterov=True),
    "no_momentum": dict(lr=1.0, momentum=0.0),
    "heavy_ball_mix": dict(lr=0.5, momentum=0.8, nesterov=False, alpha=0.3),
    "delay_corrected": dict(lr=0.7, momentum=0.9, beta=1.0),
    "taylor": dict(lr=0.7, momentum=0.9, beta=1.0, lam=0.5),
    "taylor_normalized": dict(lr=0.7, momentum=0.9, beta=1.0, lam=0.5, lam_mode="normalized"),
    "copy_g": dict(lr=0.0),  # x = round(g): g's ties, subnormals and fp16 overflow reach x directly
}


@pytest.mark.op("outer_merge_")
@pytest.mark.parametrize("xd", LOW, ids=["bf16", "f16"])
@pytest.mark.parametrize("avg", [F32, torch.bfloat16], ids=["avg_f32", "avg_bf16"])
@pytest.mark.parametrize("mode", sorted(MERGES))
@pytest.mark.parametrize("n", SIZES)
def test_outer_merge_matches_the_spec_bit_for_bit(backend, xd, avg, mode, n, rng):
    t = mixed(n, xd, rng)
    t["delta_avg"] = (1e-2 * torch.randn(n, generator=rng)).to(avg)
    kw = MERGES[mode]
    ref = {k: v.clone() for k, v in t.items()}
    ops.outer_merge_(t["g"], t["u"], t["delta_avg"], t["x"], t["x_sent"], backend=backend, **kw)
    outer_merge_ref(ref["g"], ref["u"], ref["delta_avg"], ref["x"], ref["x_sent"], **kw)
    for name in ("g", "u", "x"):
        same_bits(t[name], ref[name], name)
    assert t["x"].dtype == xd and t["g"].dtype == F32


@pytest.mark.parametrize("xd", LOW, ids=["bf16", "f16"])
def test_outer_merge_spec_rounds_x_once_from_float32(xd, rng):
    """The spec equals the float32 merge of the widened x, rounded once: what the fp32-master
    rule says (a merge computed in x's own dtype would round every intermediate)."""
    n = 4096
    t = mixed(n, xd, rng, edges=False)
    t["delta_avg"] = 1e-2 * torch.randn(n, generator=rng)
    kw = dict(lr=0.7, momentum=0.9, alpha=0.3, beta=1.0, lam=0.5)
    low = {k: v.clone() for k, v in t.items()}
    wide = {k: v.clone() for k, v in t.items()}
    wide["x"] = wide["x"].float()
    outer_merge_ref(*(low[k] for k in ("g", "u", "delta_avg", "x", "x_sent")), **kw)
    outer_merge_ref(*(wide[k] for k in ("g", "u", "delta_avg", "x", "x_sent")), **kw)
    same_bits(low["x"], wide["x"].to(xd), "x")
    same_bits(low["g"], wide["g"], "g")


@pytest.mark.op("outer_merge_")
def test_fp16_merge_overflows_to_inf(backend):
    """g_new beyond fp16's range: the merged fp16 x is ±inf (round to nearest even, as torch), the
    float32 master keeps the value."""
    g = torch.tensor([65504.0, 65519.0, 65520.0, -65520.0, 1e5])
    u, d = torch.zeros(5), torch.zeros(5)
    x = torch.zeros(5, dtype=torch.float16)
    ops.outer_merge_(g, u, d, x, lr=1.0, backend=backend)
    assert x.tolist() == [65504.0, 65504.0, float("inf"), -float("inf"), float("inf")]
    assert g.tolist() == [65504.0, 65519.0, 65520.0, -65520.0, 1e5]


# ---- sparse ---------------------------------------------------------------------------------------


@pytest.mark.op("sparse_scatter_merge_")
@pytest.mark.parametrize("xd", LOW, ids=["bf16", "f16"])
@pytest.mark.parametrize("avg", [F32, torch.bfloat16], ids=["avg_f32", "avg_bf16"])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.25])
@pytest.mark.parametrize("n", SIZES)
def test_scatter_merge_matches_the_spec_bit_for_bit(backend, xd, avg, beta, n, rng):
    t = mixed(n, xd, rng)
    k = max(1, n // 3)
    idx = torch.randperm(n, generator=rng)[:k].sort().values
    sent = t["x"][idx].float() - 1e-3 * torch.randn(k, generator=rng)
    m = t["g"][idx].to(avg)  # the edge values as the averages
    x = t["x"]
    ref = x.clone()
    ops.sparse_scatter_merge_(x, idx, m, sent, beta=beta, backend=backend)
    sparse_scatter_merge_ref(ref, idx, m, sent, beta=beta)
    same_bits(x, ref, "x")


@pytest.mark.op("sparse_gather")
@pytest.mark.parametrize("xd", LOW, ids=["bf16", "f16"])
def test_gather_reads_low_precision(backend, xd, rng):
    x = torch.randn(1001, generator=rng).to(xd)
    idx = torch.randint(0, 1001, (300,), generator=rng)
    out = ops.sparse_gather(x, idx, backend=backend)
    same_bits(out, sparse_gather_ref(x, idx), "gather")


@pytest.mark.op("fragment_norms")
@pytest.mark.parametrize("xd", LOW, ids=["bf16", "f16"])
@pytest.mark.parametrize("ord", [1, 2])
def test_fragment_norms_read_low_precision(backend, xd, ord, rng, close):
    x = torch.randn(50_000, generator=rng).to(xd)
    offsets = torch.tensor([0, 7, 20_000, 50_000])
    got = ops.fragment_norms(x, offsets, ord=ord, backend=backend)
    want = fragment_norms_ref(x, offsets, ord=ord)
    same_bits(got, want, "norms")  # the float64 sums agree far below one rounding to xd
    x[3] = float("nan")
    assert bool(ops.fragment_norms(x, offsets, ord=1, backend=backend)[0].isnan())


# ---- bad input ------------------------------------------------------------------------------------


def test_the_checks_accept_exactly_the_supported_mixes(close):
    n = 8
    x16, xh = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.float16)
    g, u = torch.zeros(n), torch.zeros(n)
    d = torch.zeros(n)
    # pack: g must be x's float32 master; the snapshot float32; the wire float32 or bf16
    close.assert_rejected(lambda: ops.pack(g.bfloat16(), x16), TypeError, "g", [x16])
    close.assert_rejected(lambda: ops.pack(g.double(), x16), TypeError, "x", [x16])
    close.assert_rejected(lambda: ops.pack(g.half(), xh), TypeError, "g", [xh])
    snap = torch.zeros(n, dtype=torch.bfloat16)
    close.assert_rejected(lambda: ops.pack(g, x16, snapshot_out=snap), TypeError, "snapshot_out", [snap])
    close.assert_rejected(lambda: ops.pack(g, xh, wire_dtype=torch.float16), TypeError, "wire_dtype")
    # outer_merge_: g, u, x_sent float32 for a bf16 / fp16 x; delta_avg float32 or bf16
    args = lambda **o: {"g": g, "u": u, "delta_avg": d, "x": x16, "x_sent": g.clone(), **o}  # noqa: E731
    for name, bad in (
        ("u", u.bfloat16()),
        ("x_sent", g.bfloat16()),
        ("delta_avg", d.half()),
        ("x", g.double()),
    ):
        a = args(**{name: bad})
        close.assert_rejected(
            lambda a=a: ops.outer_merge_(*a.values(), lr=1.0, beta=1.0), TypeError, name, list(a.values())
        )
    a = args(g=g.double(), u=u.double(), x_sent=g.double(), delta_avg=d.double())  # no float64 master
    close.assert_rejected(
        lambda: ops.outer_merge_(*a.values(), lr=1.0, beta=1.0), TypeError, "x", list(a.values())
    )
    a = args(g=g.bfloat16(), u=u.bfloat16(), x_sent=g.bfloat16())
    close.assert_rejected(
        lambda: ops.outer_merge_(*a.values(), lr=1.0, beta=1.0), TypeError, "g", list(a.values())
    )
    # sparse_scatter_merge_: sent is x's master dtype, avg float32 or bf16
    idx = torch.arange(3)
    for name, kw in (
        ("sent", dict(avg=torch.zeros(3), sent=torch.zeros(3, dtype=torch.bfloat16))),
        ("avg", dict(avg=torch.zeros(3, dtype=torch.float16), sent=torch.zeros(3))),
    ):
        close.assert_rejected(lambda kw=kw: ops.sparse_scatter_merge_(x16, idx, **kw), TypeError, name, [x16])
    # still accepted: every supported mix runs
    ops.pack(g, x16, wire_dtype=torch.bfloat16)
    ops.outer_merge_(g, u, d.bfloat16(), xh, g.clone(), lr=1.0, beta=1.0)
    ops.sparse_scatter_merge_(xh, idx, torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3))


# ---- on a GPU (skipped without one): Triton and CUDA against the spec --------------------------------


def _gpu_backend(backend: str) -> torch.device:
    from lowcomm_kernels import _dispatch

    dev = torch.device("cuda")
    if not torch.cuda.is_available() or not _dispatch.available(backend, dev, "lc_outer_merge"):
        pytest.skip(f"needs a GPU with the {backend} backend")
    return dev


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("xd", LOW, ids=["bf16", "f16"])
@pytest.mark.parametrize("wire", [F32, torch.bfloat16], ids=["wire_f32", "wire_bf16"])
@pytest.mark.parametrize("n", [7, 300_007])
def test_gpu_backends_match_the_spec(backend, xd, wire, n, rng):
    """pack bit for bit (one subtraction, one rounding; NaN-ness only); the merges within one ulp of
    x's dtype of the CPU spec (an fp32 product may be fused differently on the device, and the
    rounding to x's dtype can then land on the neighbour), g and u to fp32's elementwise tolerance."""
    dev = _gpu_backend(backend)
    t = mixed(n, xd, rng)
    t["delta_avg"] = (1e-2 * torch.randn(n, generator=rng)).to(wire)
    d, snap, nf = ops.pack(t["g"].to(dev), t["x"].to(dev), wire_dtype=wire, backend=backend)
    ref_d, _, ref_nf = pack_ref(t["g"], t["x"], wire_dtype=wire)
    same_bits(d.cpu(), ref_d, "delta")
    assert torch.equal(snap.cpu(), t["x"].float()) and int(nf) == int(ref_nf)
    eps, eps32 = torch.finfo(xd).eps, torch.finfo(F32).eps
    for mode, kw in MERGES.items():
        gpu = {k: v.to(dev) for k, v in t.items()}
        ref = {k: v.clone() for k, v in t.items()}
        ops.outer_merge_(*(gpu[k] for k in ("g", "u", "delta_avg", "x", "x_sent")), backend=backend, **kw)
        outer_merge_ref(*(ref[k] for k in ("g", "u", "delta_avg", "x", "x_sent")), **kw)
        for name in ("g", "u"):
            torch.testing.assert_close(
                gpu[name].cpu(), ref[name], rtol=8 * eps32, atol=8 * eps32, equal_nan=True
            )
        torch.testing.assert_close(
            gpu["x"].cpu().double(), ref["x"].double(), rtol=eps, atol=2.0**-24, equal_nan=True, msg=mode
        )
    k = n // 3 or 1
    idx = torch.randperm(n, generator=rng)[:k].sort().values
    sent = t["x"][idx].float() - 1e-3 * torch.randn(k, generator=rng)
    m = t["g"][idx].to(wire)
    x, ref = t["x"].to(dev), t["x"].clone()
    ops.sparse_scatter_merge_(x, idx.to(dev), m.to(dev), sent.to(dev), beta=1.0, backend=backend)
    sparse_scatter_merge_ref(ref, idx, m, sent, beta=1.0)
    same_bits(x.cpu(), ref, "scatter x")  # avg + (x − sent): no product to fuse


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_fp16_merge_overflows_to_inf(backend):
    dev = _gpu_backend(backend)
    g = torch.tensor([65504.0, 65519.0, 65520.0, -65520.0, 1e5], device=dev)
    x = torch.zeros(5, dtype=torch.float16, device=dev)
    ops.outer_merge_(g, torch.zeros_like(g), torch.zeros_like(g), x, lr=1.0, backend=backend)
    assert x.cpu().tolist() == [65504.0, 65504.0, float("inf"), -float("inf"), float("inf")]
