"""fragment_norms: every backend against the ref (ord 1 and 2, empty segments, K = 0 and 1),
bit-identical from call to call and across thread counts, and bad offsets."""

from __future__ import annotations

import pytest
import torch

from lowcomm_kernels.ops import fragment_norms, fragment_norms_ref

pytestmark = pytest.mark.op("fragment_norms")

F64_F32 = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
ORD = pytest.mark.parametrize("ord", [1, 2], ids=["l1", "l2"])


def _offsets(n: int, k: int, rng: torch.Generator, *, empty: int = 0) -> torch.Tensor:
    """K+1 sorted boundaries from 0 to n; `empty` of the K segments forced empty (repeated cuts)."""
    cuts = (
        torch.sort(torch.randint(0, n + 1, (k - 1,), generator=rng)).values
        if k > 1
        else torch.empty(0, dtype=torch.int64)
    )
    offs = torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]).to(torch.int64)
    if empty:
        offs[1 : 1 + empty] = 0  # segments 0..empty-1 become [0, 0)
    return torch.sort(offs).values


def _check(backend, buf, offs, ord, close):
    out = fragment_norms(buf, offs, ord=ord, backend=backend)
    ref = fragment_norms_ref(buf, offs, ord=ord)
    seg = int((offs[1:] - offs[:-1]).max()) if offs.numel() > 1 else 0
    close.assert_close(out, ref, kind="reduction", n=seg)
    return out


@ORD
@F64_F32
@pytest.mark.parametrize(
    ("n", "k"),
    [(0, 1), (1, 1), (7, 3), (1000, 1), (1000, 37), (1000003, 5)],
    ids=["n0-K1", "n1-K1", "n7-K3", "n1000-K1", "n1000-K37", "n1000003-K5"],
)
def test_matches_ref(device, backend, n, k, dtype, ord, rng, close):
    buf = torch.randn(n, generator=rng, dtype=torch.float64).to(device, dtype)
    offs = _offsets(n, k, rng).to(device)
    out = _check(backend, buf, offs, ord, close)
    assert out.shape == (k,) and out.dtype == dtype


@ORD
@F64_F32
def test_empty_segments_subrange_and_shape(backend, dtype, ord, rng, close):
    buf = torch.randn(40, 25, generator=rng, dtype=torch.float64).to(dtype)  # any shape: flattened
    offs = torch.tensor([0, 0, 0, 10, 10, 333, 999, 1000, 1000], dtype=torch.int64)
    out = _check(backend, buf, offs, ord, close)
    assert torch.equal(out[[0, 1, 3, 7]], torch.zeros(4, dtype=dtype))
    # boundaries need not cover the buffer: [5, 17) and [17, 900)
    _check(backend, buf, torch.tensor([5, 17, 900]), ord, close)


def test_no_segments(backend):
    out = fragment_norms(torch.randn(10), torch.tensor([3]), backend=backend)
    assert out.shape == (0,) and out.dtype == torch.float32


def test_known_values(backend):
    buf = torch.tensor([3.0, -4.0, 0.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    offs = torch.tensor([0, 2, 3, 7])
    assert fragment_norms(buf, offs, ord=2, backend=backend).tolist() == [5.0, 0.0, 2.0]
    assert fragment_norms(buf, offs, ord=1, backend=backend).tolist() == [7.0, 0.0, 4.0]


@ORD
@F64_F32
def test_bit_identical_across_calls(backend, dtype, ord, rng):
    """The schedule ranks fragments by these norms on every rank: the bits must not change."""
    buf = torch.randn(1 << 18, generator=rng, dtype=torch.float64).to(dtype)
    offs = _offsets(buf.numel(), 9, rng)
    first = fragment_norms(buf, offs, ord=ord, backend=backend)
    for _ in range(3):
        again = fragment_norms(buf, offs, ord=ord, backend=backend)
        assert torch.equal(again.view(torch.uint8), first.view(torch.uint8))


@ORD
def test_bit_identical_across_thread_counts(backend, ord, rng):
    """... nor with the thread count (ranks may run with different OMP_NUM_THREADS). In fp64, where
    a different summation order shows in the last bits (in fp32 the final rounding hides it)."""
    buf = torch.randn(1 << 20, generator=rng, dtype=torch.float64)
    offs = _offsets(buf.numel(), 9, rng)
    threads = torch.get_num_threads()
    try:
        results = {}
        for t in (1, 2, 4):
            torch.set_num_threads(t)
            results[t] = fragment_norms(buf, offs, ord=ord, backend=backend).view(torch.uint8)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[1], results[2]) and torch.equal(results[1], results[4])


BAD = [
    ("decreasing", dict(offsets=torch.tensor([0, 5, 3, 10])), ValueError, "offsets"),
    ("past the end", dict(offsets=torch.tensor([0, 5, 11])), ValueError, "offsets"),
    ("negative", dict(offsets=torch.tensor([-1, 5, 10])), ValueError, "offsets"),
    ("empty", dict(offsets=torch.empty(0, dtype=torch.int64)), ValueError, "offsets"),
    ("int32", dict(offsets=torch.tensor([0, 5, 10], dtype=torch.int32)), TypeError, "offsets"),
    ("float", dict(offsets=torch.tensor([0.0, 5.0, 10.0])), TypeError, "offsets"),
    ("2-D", dict(offsets=torch.tensor([[0, 5, 10]])), ValueError, "offsets"),
    ("strided", dict(offsets=torch.tensor([0, 9, 5, 9, 10])[::2]), ValueError, "offsets"),
    ("device", dict(offsets=torch.tensor([0, 5, 10], device="meta")), ValueError, "offsets"),
    ("list", dict(offsets=[0, 5, 10]), TypeError, "offsets"),
    ("ord 3", dict(ord=3), ValueError, "ord"),
    ("ord 0", dict(ord=0), ValueError, "ord"),
    ("ord -1", dict(ord=-1), ValueError, "ord"),
    ("ord inf", dict(ord=float("inf")), TypeError, "ord"),
    ("ord 2.0", dict(ord=2.0), TypeError, "ord"),  # once reached the C ABI as a float
    ("ord True", dict(ord=True), TypeError, "ord"),
    ("ord str", dict(ord="2"), TypeError, "ord"),
    ("buf int", dict(buf=torch.arange(10)), TypeError, "buf"),
    ("buf float8", dict(buf=torch.randn(10).to(torch.float8_e4m3fn)), TypeError, "buf"),
    ("buf strided", dict(buf=torch.randn(20)[::2]), ValueError, "buf"),
    ("buf list", dict(buf=[0.0] * 10), TypeError, "buf"),
    ("backend", dict(backend="cuda"), ValueError, "backend"),
]


@pytest.mark.parametrize(("what", "over", "exc", "arg"), BAD, ids=[b[0] for b in BAD])
def test_bad_input(backend, what, over, exc, arg, close):
    kw = dict(buf=torch.randn(10), offsets=torch.tensor([0, 5, 10]), ord=2, backend=backend)
    kw.update(over)
    bufs = [t for t in (kw["buf"], kw["offsets"]) if isinstance(t, torch.Tensor)]
    close.assert_rejected(lambda: fragment_norms(**kw), exc, arg, bufs)


@ORD
@F64_F32
def test_unaligned_view(backend, dtype, ord, rng, close):
    buf = torch.randn(5000, generator=rng, dtype=torch.float64).to(dtype)[3:4999]
    _check(backend, buf, _offsets(buf.numel(), 7, rng), ord, close)
