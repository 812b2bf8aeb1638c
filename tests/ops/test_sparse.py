"""sparse_gather / sparse_scatter_merge_: every backend against the ref, k = 0 and k = n, the dense
LOSCAR identity with outer_merge_, and bad input."""

from __future__ import annotations

import functools

import pytest
import torch

from lowcomm_kernels.ops import (
    mask_indices,
    outer_merge_,
    sparse_gather,
    sparse_gather_ref,
    sparse_scatter_merge_,
    sparse_scatter_merge_ref,
)

F64_F32 = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
SIZES = [(0, 0), (1, 0), (1, 1), (7, 3), (7, 7), (1000, 0), (100003, 4099), (1000003, 1000003)]
SIZE_IDS = [f"n{n}-k{k}" for n, k in SIZES]


def _idx(n: int, k: int, rng: torch.Generator) -> torch.Tensor:
    return torch.sort(torch.randperm(n, generator=rng)[:k]).values


@pytest.mark.op("sparse_gather")
@F64_F32
@pytest.mark.parametrize(("n", "k"), SIZES, ids=SIZE_IDS)
def test_gather_matches_ref(device, backend, n, k, dtype, rng):
    x = torch.randn(n, generator=rng, dtype=torch.float64).to(device, dtype)
    idx = _idx(n, k, rng).to(device)
    x0 = x.clone()
    y = sparse_gather(x, idx, backend=backend)
    assert y.dtype == dtype and y.shape == (k,)
    assert torch.equal(y, sparse_gather_ref(x, idx)), "a gather is a copy: bit-exact"
    assert torch.equal(x, x0)


@pytest.mark.op("sparse_gather")
@F64_F32
def test_gather_duplicates_unsorted_shape_and_out(backend, dtype, rng):
    x = torch.randn(6, 50, generator=rng, dtype=torch.float64).to(dtype)  # any shape: flat indices
    idx = torch.randint(0, 300, (777,), generator=rng)  # duplicates and any order are fine for a read
    out = torch.full((777,), float("nan"), dtype=dtype)
    y = sparse_gather(x, idx, out=out, backend=backend)
    assert y is out and torch.equal(out, x.reshape(-1)[idx])


def _scatter_inputs(n, k, dtype, avg_dtype, rng, device="cpu"):
    x = torch.randn(n, generator=rng, dtype=torch.float64).to(device, dtype)
    idx = _idx(n, k, rng).to(device)
    sent = (x[idx] + 0.1 * torch.randn(k, generator=rng, dtype=torch.float64).to(device, dtype)).contiguous()
    avg = (sent + 0.1 * torch.randn(k, generator=rng, dtype=torch.float64).to(device, dtype)).to(
        avg_dtype or dtype
    )
    return x, idx, avg, sent


@pytest.mark.op("sparse_scatter_merge_")
@F64_F32
@pytest.mark.parametrize(
    ("n", "k", "beta"),
    [(n, k, 1.0) for n, k in SIZES] + [(7, 3, 0.0), (1000, 999, 0.5)],
    ids=SIZE_IDS + ["n7-k3-beta0", "n1000-k999-beta0.5"],
)
def test_scatter_merge_matches_ref(device, backend, n, k, dtype, beta, rng, close):
    x, idx, avg, sent = _scatter_inputs(n, k, dtype, None, rng, device)
    expected = x.clone()
    sparse_scatter_merge_ref(expected, idx, avg, sent, beta=beta)
    untouched = torch.ones(n, dtype=torch.bool, device=device)
    untouched[idx] = False
    x_before = x.clone()
    avg0, sent0 = avg.clone(), sent.clone()
    sparse_scatter_merge_(x, idx, avg, sent, beta=beta, backend=backend)
    close.assert_close(x, expected, scale=4.0)
    assert torch.equal(x[untouched], x_before[untouched]), "coordinates outside S are not written"
    assert torch.equal(avg, avg0) and torch.equal(sent, sent0)


@pytest.mark.op("sparse_scatter_merge_")
@F64_F32
def test_scatter_merge_bf16_avg(device, backend, dtype, rng, close):
    x, idx, avg, sent = _scatter_inputs(10007, 3001, dtype, torch.bfloat16, rng, device)
    expected = x.clone()
    sparse_scatter_merge_ref(expected, idx, avg.to(dtype), sent, beta=1.0)
    sparse_scatter_merge_(x, idx, avg, sent, backend=backend)
    close.assert_close(x, expected, scale=4.0)


@pytest.mark.op("mask_indices", "sparse_gather", "sparse_scatter_merge_")
def test_loscar_round(backend, rng, close):
    """One LOSCAR round on 3 workers (docs/algorithms.md): mask from (seed, r), send y_i = x_i[S],
    keep training (z_i), average, merge x_i[S] = m̄ + (z_i[S] − y_i[S]); x_i elsewhere = z_i."""
    d, k, workers = 5000, 50, 3
    xs = [torch.randn(d, generator=rng, dtype=torch.float64) for _ in range(workers)]
    S = mask_indices(3, 11, d, k, backend=backend)
    ys = [sparse_gather(x, S, backend=backend) for x in xs]
    zs = [x + 0.01 * torch.randn(d, generator=rng, dtype=torch.float64) for x in xs]  # local steps
    m = torch.stack(ys).mean(0)
    for y, z in zip(ys, zs, strict=True):
        expected = z.clone()
        expected[S] = m + (z[S] - y)
        sparse_scatter_merge_(z, S, m, y, backend=backend)
        close.assert_close(z, expected)


@pytest.mark.op("sparse_scatter_merge_", "outer_merge_")
@F64_F32
@pytest.mark.parametrize("n", [1, 7, 10007])
def test_dense_loscar_is_outer_merge(backend, n, dtype, rng, close):
    """Dense LOSCAR (S = everything, β = 1) == outer_merge_(lr=1, μ=0, β=1, λ=0) with
    Δ̄ = g − mean(y) and x_sent = y: both give x = m̄ + (x − y) (the outer step yields g_new = m̄ up
    to the rounding of g − (g − m̄), whence the tolerance scale)."""
    ys = [torch.randn(n, generator=rng, dtype=torch.float64).to(dtype) for _ in range(3)]
    y = ys[0]
    m = torch.stack(ys).mean(0)
    x = y + (0.1 * torch.randn(n, generator=rng, dtype=torch.float64)).to(dtype)
    g = torch.randn(n, generator=rng, dtype=torch.float64).to(dtype)

    x_sparse = x.clone()
    sparse_scatter_merge_(x_sparse, torch.arange(n), m, y, beta=1.0, backend=backend)
    x_dense, g_dense, u = x.clone(), g.clone(), torch.zeros(n, dtype=dtype)
    outer_merge_(g_dense, u, g - m, x_dense, y, lr=1.0, momentum=0.0, beta=1.0, lam=0.0, backend=backend)
    close.assert_close(g_dense, m, scale=8.0, msg="g_new = mean(y)")
    close.assert_close(x_dense, x_sparse, scale=8.0, msg="x")


# ---- bad input ---------------------------------------------------------------------------------


def _gather_bad(dtype):
    n, k = 20, 5
    other = torch.float32 if dtype == torch.float64 else torch.float64
    x = torch.randn(n, dtype=dtype)
    idx = torch.tensor([0, 3, 3, 19, 7])
    big = torch.randn(2 * n, dtype=dtype)
    as_float = idx.view(torch.float64) if dtype == torch.float64 else idx.view(torch.float32)[:k]
    yield "x int", dict(x=x.long(), idx=idx), TypeError, "x"
    yield "x strided", dict(x=big[::2], idx=idx), ValueError, "x"
    yield "x not tensor", dict(x=x.tolist(), idx=idx), TypeError, "x"
    yield "idx int32", dict(x=x, idx=idx.int()), TypeError, "idx"
    yield "idx float", dict(x=x, idx=idx.double()), TypeError, "idx"
    yield "idx list", dict(x=x, idx=idx.tolist()), TypeError, "idx"
    yield "idx 2-D", dict(x=x, idx=idx.view(1, k)), ValueError, "idx"
    yield "idx == n", dict(x=x, idx=torch.tensor([0, n])), ValueError, "idx"
    yield "idx < 0", dict(x=x, idx=torch.tensor([-1, 2])), ValueError, "idx"
    yield "idx strided", dict(x=x, idx=torch.arange(10)[::2]), ValueError, "idx"
    yield "idx device", dict(x=x, idx=idx.to("meta")), ValueError, "idx"
    yield "out dtype", dict(x=x, idx=idx, out=torch.zeros(k, dtype=other)), TypeError, "out"
    yield "out numel", dict(x=x, idx=idx, out=torch.zeros(k + 1, dtype=dtype)), ValueError, "out"
    yield "out device", dict(x=x, idx=idx, out=torch.zeros(k, dtype=dtype, device="meta")), ValueError, "out"
    yield "out strided", dict(x=x, idx=idx, out=torch.zeros(2 * k, dtype=dtype)[::2]), ValueError, "out"
    yield "out aliases x", dict(x=x, idx=idx, out=x[10:15]), ValueError, "out"
    yield "out aliases idx", dict(x=x, idx=idx, out=as_float), ValueError, "out"
    yield "backend", dict(x=x, idx=idx, backend="cuda"), ValueError, "backend"


@pytest.mark.op("sparse_gather")
@F64_F32
def test_gather_bad_input(backend, dtype, close):
    for what, kw, exc, arg in _gather_bad(dtype):
        kw.setdefault("backend", backend)
        x, idx = kw.pop("x"), kw.pop("idx")
        bufs = [t for t in (x, idx, kw.get("out")) if isinstance(t, torch.Tensor)]
        try:
            close.assert_rejected(functools.partial(sparse_gather, x, idx, **kw), exc, arg, bufs)
        except AssertionError as e:
            raise AssertionError(f"case {what!r}: {e}") from e


def _scatter_bad(dtype):
    n, k = 20, 4
    other = torch.float32 if dtype == torch.float64 else torch.float64
    x = torch.randn(n, dtype=dtype)
    idx = torch.tensor([1, 4, 9, 19])
    avg, sent = torch.randn(k, dtype=dtype), torch.randn(k, dtype=dtype)
    big = torch.randn(2 * n, dtype=dtype)

    def kw(**over):
        d = dict(x=x.clone(), idx=idx.clone(), avg=avg.clone(), sent=sent.clone())
        d.update(over)
        return d

    yield "x int", kw(x=x.long()), TypeError, "x"
    yield "x strided", kw(x=big[::2]), ValueError, "x"
    yield "idx duplicate", kw(idx=torch.tensor([1, 4, 4, 19])), ValueError, "idx"
    yield "idx unsorted", kw(idx=torch.tensor([4, 1, 9, 19])), ValueError, "idx"
    yield "idx out of range", kw(idx=torch.tensor([1, 4, 9, 20])), ValueError, "idx"
    yield "idx negative", kw(idx=torch.tensor([-1, 4, 9, 10])), ValueError, "idx"
    yield "idx int32", kw(idx=idx.int()), TypeError, "idx"
    yield "idx 2-D", kw(idx=idx.view(2, 2)), ValueError, "idx"
    yield "idx device", kw(idx=idx.to("meta")), ValueError, "idx"
    yield "idx strided", kw(idx=torch.tensor([1, 0, 4, 0, 9, 0, 19, 0])[::2]), ValueError, "idx"
    yield "avg fp16", kw(avg=avg.half()), TypeError, "avg"
    yield "avg other float", kw(avg=avg.to(other)), TypeError, "avg"
    yield "sent bf16", kw(sent=sent.bfloat16()), TypeError, "sent"
    yield "sent other float", kw(sent=sent.to(other)), TypeError, "sent"
    yield "avg numel", kw(avg=torch.randn(k + 1, dtype=dtype)), ValueError, "avg"
    yield "sent numel", kw(sent=torch.randn(k - 1, dtype=dtype)), ValueError, "sent"
    yield "avg device", kw(avg=avg.to("meta")), ValueError, "avg"
    yield "sent device", kw(sent=sent.to("meta")), ValueError, "sent"
    yield "avg strided", kw(avg=torch.randn(2 * k, dtype=dtype)[::2]), ValueError, "avg"
    yield "sent strided", kw(sent=torch.randn(2 * k, dtype=dtype)[::2]), ValueError, "sent"
    shared = torch.randn(n, dtype=dtype)
    yield "avg aliases x", kw(x=shared, avg=shared[:k]), ValueError, ("x", "avg")
    yield "sent aliases x", kw(x=shared, sent=shared[n - k :]), ValueError, ("x", "sent")
    yield "avg is sent", kw(avg=sent, sent=sent), ValueError, ("avg", "sent")
    if dtype == torch.float64:
        own = idx.clone()
        yield "avg aliases idx", kw(idx=own, avg=own.view(torch.float64)), ValueError, ("idx", "avg")
    for bad, exc in [
        (-0.5, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("1", TypeError),
        (None, TypeError),
    ]:
        yield f"beta={bad!r}", kw(beta=bad), exc, "beta"
    yield "backend", kw(backend="cuda"), ValueError, "backend"


@pytest.mark.op("sparse_scatter_merge_")
@F64_F32
def test_scatter_merge_bad_input(backend, dtype, close):
    for what, kw, exc, arg in _scatter_bad(dtype):
        kw.setdefault("backend", backend)
        args = [kw.pop(k) for k in ("x", "idx", "avg", "sent")]
        bufs = [t for t in args if isinstance(t, torch.Tensor)]
        try:
            close.assert_rejected(functools.partial(sparse_scatter_merge_, *args, **kw), exc, arg, bufs)
        except AssertionError as e:
            raise AssertionError(f"case {what!r}: {e}") from e


@pytest.mark.op("sparse_gather", "sparse_scatter_merge_")
@F64_F32
@pytest.mark.parametrize("k", [1, 7, 33, 1001])
def test_unaligned_views_and_no_overrun(backend, k, dtype, rng, close):
    n = 3000
    x_buf = torch.randn(n + 8, generator=rng, dtype=torch.float64).to(dtype)
    x = x_buf[3 : n + 3]
    idx = _idx(n, k, rng)
    out_buf = torch.full((k + 20,), 7.0, dtype=dtype)
    out = out_buf[1 : k + 1]
    sparse_gather(x, idx, out=out, backend=backend)
    assert torch.equal(out, x[idx])
    assert bool((out_buf[:1] == 7.0).all()) and bool((out_buf[k + 1 :] == 7.0).all())
    avg_buf = torch.randn(k + 5, generator=rng, dtype=torch.float64).to(dtype)
    avg, sent = avg_buf[1 : k + 1], out
    x_before = x_buf.clone()
    expected = x.clone()
    sparse_scatter_merge_ref(expected, idx, avg, sent, beta=1.0)
    sparse_scatter_merge_(x, idx, avg, sent, beta=1.0, backend=backend)
    close.assert_close(x, expected, scale=4.0)
    assert torch.equal(x_buf[:3], x_before[:3]) and torch.equal(x_buf[n + 3 :], x_before[n + 3 :])
