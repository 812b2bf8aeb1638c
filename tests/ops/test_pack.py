"""pack: every backend against pack_ref, the bf16 wire rounding, the non-finite count, bad input."""

from __future__ import annotations

import functools

import pytest
import torch

from lowcomm_kernels.ops import pack, pack_ref

from ._contract import assert_bf16_wire, nan_payloads

pytestmark = pytest.mark.op("pack")

SIZES = [0, 1, 7, 1000003]


def _inputs(
    n: int, dtype: torch.dtype, rng: torch.Generator, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.randn(n, generator=rng, dtype=torch.float64).to(device, dtype)
    x = torch.randn(n, generator=rng, dtype=torch.float64).to(device, dtype)
    return g, x


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("n", SIZES)
def test_matches_ref(device, backend, n, dtype, rng, close):
    g, x = _inputs(n, dtype, rng, device)
    g0, x0 = g.clone(), x.clone()
    delta, snap, nonfinite = pack(g, x, backend=backend)
    ref_delta, ref_snap, ref_nf = pack_ref(g0, x0)
    close.assert_close(delta, ref_delta, msg="delta")
    assert torch.equal(snap, ref_snap), "the snapshot is a copy: bit-exact"
    assert n == 0 or snap.data_ptr() != x.data_ptr()
    assert nonfinite.dtype == torch.int64 and nonfinite.dim() == 0 and int(nonfinite) == int(ref_nf) == 0
    assert torch.equal(g, g0) and torch.equal(x, x0), "inputs are read-only"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("n", [1, 7, 1000003])
def test_bf16_wire_is_one_exact_rounding(device, backend, n, dtype, rng, close):
    """delta on the bf16 wire is g - x (exact in g's dtype) rounded once to nearest-even: bit-equal
    to torch's conversion on the device, and every NaN (any sign or payload, or inf - inf) has the
    bits the backend claims; and within one bf16 rounding of the exact difference."""
    g, x = _inputs(n, dtype, rng, device)
    # Also exercise ties and values near bf16 boundaries: differences that are bf16 halfway points.
    if n >= 7:
        g[:4] = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 3e38], dtype=dtype)
        x[:4] = 0.0
        g[4], g[5], x[5] = float("nan"), float("inf"), float("inf")  # a NaN, and inf - inf
    if n >= 16:
        g[8:12] = nan_payloads(dtype).to(device)
    delta, _, nonfinite = pack(g, x, wire_dtype=torch.bfloat16, snapshot_out=False, backend=backend)
    expected = (g - x).to(torch.bfloat16)
    assert_bf16_wire(delta, expected, backend, msg=f"{backend} on {device}")
    exact = g.double() - x.double()
    finite = torch.isfinite(delta)
    rel = ((delta.double() - exact).abs() / exact.abs().clamp_min(1e-300))[finite]
    rtol, _ = close.tolerance("wire_bf16", torch.bfloat16)
    assert rel.numel() == 0 or float(rel.max()) <= rtol
    assert int(nonfinite) == int((~finite).sum())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_preallocated_outputs_and_no_snapshot(backend, dtype, rng, close):
    g, x = _inputs(1000, dtype, rng)
    g, x = g.view(10, 100), x.view(10, 100)  # any shape: treated as flat
    delta_out = torch.full((1000,), 7.0, dtype=dtype)
    snap_out = torch.full((1000,), 7.0, dtype=dtype)
    delta, snap, _ = pack(g, x, delta_out=delta_out, snapshot_out=snap_out, backend=backend)
    assert delta is delta_out and snap is snap_out
    close.assert_close(delta, (g - x).reshape(-1), msg="delta")
    assert torch.equal(snap, x.reshape(-1))
    delta2, snap2, _ = pack(g, x, snapshot_out=False, backend=backend)
    assert snap2 is None and torch.equal(delta2, delta.view(10, 100))


def test_g_may_alias_x(backend):
    g = torch.randn(33, dtype=torch.float64)
    delta, snap, nf = pack(g, g, backend=backend)
    assert torch.equal(delta, torch.zeros_like(g)) and torch.equal(snap, g) and int(nf) == 0


@pytest.mark.parametrize("wire", [None, torch.bfloat16], ids=["wire=g", "wire=bf16"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_nonfinite_counts_the_written_delta(backend, dtype, wire, rng):
    n = 4099
    g, x = _inputs(n, dtype, rng)
    picks = torch.randperm(n, generator=rng)[:45]
    g[picks[:10]] = float("nan")
    g[picks[10:20]] = float("inf")
    x[picks[20:30]] = float("-inf")
    x[picks[30:35]] = float("inf")
    g[picks[30:35]] = float("inf")  # inf - inf = nan
    big = torch.finfo(dtype).max
    g[picks[35:40]], x[picks[35:40]] = big, -big  # finite operands, the difference overflows
    want = 40
    if dtype == torch.float64 and wire is torch.bfloat16:
        g[picks[40:45]] = 1e39  # finite in fp64, overflows to inf on the bf16 wire
        want = 45
    delta, _, nonfinite = pack(g, x, wire_dtype=wire, backend=backend)
    assert int(nonfinite) == want == int((~torch.isfinite(delta)).sum())
    assert int(pack_ref(g, x, wire_dtype=wire)[2]) == want
    if wire is torch.bfloat16:
        assert_bf16_wire(delta, (g - x).to(wire), backend)


# ---- bad input: a ValueError/TypeError naming the argument, and nothing written ----------------


def _poisoned(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((n,), 12345.0, dtype=dtype)


def _bad_cases(dtype: torch.dtype):
    n = 16
    g = torch.randn(n, dtype=dtype)
    x = torch.randn(n, dtype=dtype)
    other = torch.float32 if dtype == torch.float64 else torch.float64
    big = torch.randn(2 * n, dtype=dtype)
    storage = torch.randn(3 * n, dtype=dtype)
    meta = torch.empty(n, dtype=dtype, device="meta")
    d, s = _poisoned(n, dtype), _poisoned(n, dtype)
    yield "g not a tensor", dict(g=g.tolist(), x=x), TypeError, "g"
    yield "g int", dict(g=g.long(), x=x), TypeError, "g"
    yield "g fp16", dict(g=g.half(), x=x.half()), TypeError, "g"
    yield "x dtype", dict(g=g, x=x.to(other)), TypeError, "x"
    yield "x device", dict(g=g, x=meta), ValueError, "x"
    yield "x numel", dict(g=g, x=x[: n - 1]), ValueError, "x"
    yield "g strided", dict(g=big[::2], x=x), ValueError, "g"
    yield "x strided", dict(g=g, x=big[::2]), ValueError, "x"
    yield "x transposed", dict(g=g.view(4, 4), x=x.view(4, 4).t()), ValueError, "x"
    yield "wire fp16", dict(g=g, x=x, wire_dtype=torch.float16), TypeError, "wire_dtype"
    yield "wire other float", dict(g=g, x=x, wire_dtype=other), TypeError, "wire_dtype"
    yield (
        "delta_out dtype",
        dict(g=g, x=x, delta_out=_poisoned(n, other), wire_dtype=dtype),
        TypeError,
        "delta_out",
    )
    yield (
        "delta_out fp16",
        dict(g=g, x=x, delta_out=_poisoned(n, torch.float16)),
        TypeError,
        ("delta_out", "wire_dtype"),
    )
    yield "delta_out numel", dict(g=g, x=x, delta_out=_poisoned(n + 1, dtype)), ValueError, "delta_out"
    yield (
        "delta_out device",
        dict(g=g, x=x, delta_out=torch.empty(n, dtype=dtype, device="meta")),
        ValueError,
        "delta_out",
    )
    yield "delta_out strided", dict(g=g, x=x, delta_out=_poisoned(2 * n, dtype)[::2]), ValueError, "delta_out"
    yield "delta_out not tensor", dict(g=g, x=x, delta_out=[0.0] * n), TypeError, "delta_out"
    yield (
        "snapshot_out dtype",
        dict(g=g, x=x, delta_out=d, snapshot_out=_poisoned(n, other)),
        TypeError,
        "snapshot_out",
    )
    yield (
        "snapshot_out numel",
        dict(g=g, x=x, delta_out=d, snapshot_out=_poisoned(n - 1, dtype)),
        ValueError,
        "snapshot_out",
    )
    yield (
        "snapshot_out device",
        dict(g=g, x=x, delta_out=d, snapshot_out=torch.empty(n, dtype=dtype, device="meta")),
        ValueError,
        "snapshot_out",
    )
    yield (
        "snapshot_out strided",
        dict(g=g, x=x, delta_out=d, snapshot_out=_poisoned(2 * n, dtype)[::2]),
        ValueError,
        "snapshot_out",
    )
    yield "delta_out is g", dict(g=g, x=x, delta_out=g), ValueError, "delta_out"
    yield "delta_out is x", dict(g=g, x=x, delta_out=x, snapshot_out=s), ValueError, "delta_out"
    yield "snapshot_out is x", dict(g=g, x=x, delta_out=d, snapshot_out=x), ValueError, "snapshot_out"
    yield "snapshot_out is g", dict(g=g, x=x, delta_out=d, snapshot_out=g), ValueError, "snapshot_out"
    yield (
        "delta_out is snapshot_out",
        dict(g=g, x=x, delta_out=d, snapshot_out=d),
        ValueError,
        ("delta_out", "snapshot_out"),
    )
    # partial overlap: views of one storage that share some elements
    yield (
        "delta_out overlaps x",
        dict(g=g, x=storage[:n], delta_out=storage[n // 2 : n // 2 + n]),
        ValueError,
        "delta_out",
    )
    yield (
        "snapshot_out overlaps g",
        dict(g=storage[n : 2 * n], x=x, delta_out=d, snapshot_out=storage[n + 3 : 2 * n + 3]),
        ValueError,
        "snapshot_out",
    )
    yield "backend unknown", dict(g=g, x=x, backend="gpu"), ValueError, "backend"
    yield "backend cuda on cpu", dict(g=g, x=x, backend="cuda"), ValueError, "backend"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_bad_input_rejected_and_nothing_written(backend, dtype, close):
    for what, kwargs, exc, arg in _bad_cases(dtype):
        kwargs.setdefault("backend", backend)
        g, x = kwargs.pop("g"), kwargs.pop("x")
        buffers = [
            t
            for t in (g, x, kwargs.get("delta_out"), kwargs.get("snapshot_out"))
            if isinstance(t, torch.Tensor)
        ]
        try:
            close.assert_rejected(functools.partial(pack, g, x, **kwargs), exc, arg, buffers)
        except AssertionError as e:
            raise AssertionError(f"case {what!r}: {e}") from e


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("wire", [None, torch.bfloat16], ids=["wire=g", "wire=bf16"])
@pytest.mark.parametrize("n", [1, 7, 33, 4099])
def test_unaligned_views_and_no_overrun(backend, n, dtype, wire, rng, close):
    """Contiguous views at odd element offsets (misaligned for SIMD, and misaligned differently from
    each other) give the ref's result, and not one byte around the outputs is written (a vector
    tail must not run past the end)."""
    wd = wire or dtype
    g = torch.randn(n + 3, generator=rng, dtype=torch.float64).to(dtype)[1 : n + 1]
    x = torch.randn(n + 5, generator=rng, dtype=torch.float64).to(dtype)[3 : n + 3]
    delta_buf = torch.full((n + 40,), 7.0, dtype=wd)
    snap_buf = torch.full((n + 40,), 7.0, dtype=dtype)
    delta_out, snap_out = delta_buf[1 : n + 1], snap_buf[3 : n + 3]
    pack(g, x, wire_dtype=wire, delta_out=delta_out, snapshot_out=snap_out, backend=backend)
    ref = (g - x).to(wd)
    if wd == torch.bfloat16:
        assert torch.equal(delta_out.view(torch.int16), ref.view(torch.int16))
    else:
        close.assert_close(delta_out, ref)
    assert torch.equal(snap_out, x)
    sentinel = torch.tensor(7.0, dtype=wd)
    assert bool((delta_buf[:1] == sentinel).all()) and bool((delta_buf[n + 1 :] == sentinel).all())
    assert bool((snap_buf[:3] == 7.0).all()) and bool((snap_buf[n + 3 :] == 7.0).all())


STREAM_N = (1 << 22) + 13  # >= 4M fp32 elements: the csrc streaming-store path; odd tail


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16], ids=["wire=f32", "wire=bf16"])
@pytest.mark.parametrize(
    ("delta_off", "snap_off"),
    [(0, 0), (1, 1), (0, 1), (3, None)],
    ids=["aligned", "both-offset", "relatively-misaligned", "no-snapshot"],
)
@pytest.mark.op("pack", exclude=("ref",))  # the ref has no such path; it is the oracle here
def test_large_fp32_streaming_path(backend, wire, delta_off, snap_off, rng):
    """fp32 at >= 4M elements takes a streaming-store path in the native backend (a scalar head up to
    a common 32-byte alignment of delta and snapshot, 16-element steps split over threads, a tail;
    plain stores when no common alignment exists). Each case: bit-exact delta (one IEEE subtraction,
    then one RNE rounding for bf16), exact snapshot, exact non-finite count with non-finite values
    in the head, the body and the tail, and nothing written around the outputs."""
    n = STREAM_N
    g = torch.randn(n, generator=rng, dtype=torch.float32)
    x = torch.randn(n, generator=rng, dtype=torch.float32)
    for i in (0, 5, 17, n // 2, n // 2 + 1, n - 1):  # head, first steps, middle, tail
        g[i] = float("nan") if i % 2 else float("inf")
    delta_buf = torch.full((n + 40,), 7.0, dtype=wire)
    delta_out = delta_buf[delta_off : delta_off + n]
    snap_buf = torch.full((n + 40,), 7.0) if snap_off is not None else None
    snap_out = snap_buf[snap_off : snap_off + n] if snap_buf is not None else False
    delta, snap, nonfinite = pack(g, x, delta_out=delta_out, snapshot_out=snap_out, backend=backend)
    expected = (g - x).to(wire)
    if wire == torch.bfloat16:
        assert_bf16_wire(delta, expected, backend)
    else:  # fp32: g - x claims torch's value; a NaN's payload is not claimed
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(delta), nan)
        assert torch.equal(delta[~nan].view(torch.int32), expected[~nan].view(torch.int32))
    assert int(nonfinite) == 6
    sentinel = torch.tensor(7.0, dtype=wire)
    assert bool((delta_buf[:delta_off] == sentinel).all()) and bool(
        (delta_buf[delta_off + n :] == sentinel).all()
    )
    if snap_buf is None:
        assert snap is None
    else:
        assert torch.equal(snap.view(torch.int32), x.view(torch.int32))
        assert bool((snap_buf[:snap_off] == 7.0).all()) and bool((snap_buf[snap_off + n :] == 7.0).all())
