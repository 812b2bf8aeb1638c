"""Bad input under torch.compile, and meta tensors.

Under torch.compile the public functions are traced and call the registered ops, whose bodies check
everything at run time on the real data (see ``lowcomm_kernels/ops/_common.py``). Tested two ways:

* every bad case of the op test files, with the public functions forced onto that path in eager
  (``through_registered_ops``): the same refusal as the eager path, nothing written;
* real ``torch.compile(fullgraph=True)`` calls per op: good input matches the ref; aliased, strided
  or out-of-range input raises the ValueError/TypeError of eager, naming the argument, with every
  buffer unchanged; a bad host value (a format, block, seed, round or count) raises the documented
  ValueError when the compiled code runs (``ops._common.refusing``); a wrong argument kind is
  refused while tracing, where dynamo wraps the error (the test checks that the original message
  is in the text the user sees).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re

import pytest
import torch

import lowcomm_kernels.ops as lk

from . import test_fragment_norms, test_mask_indices, test_outer_merge, test_pack, test_sparse

MODULES = [importlib.import_module(f"lowcomm_kernels.ops.{m}")
           for m in ("pack", "outer_merge", "sparse", "fragment_norms", "mask_indices")]
NAN = float("nan")


@contextlib.contextmanager
def through_registered_ops():
    """The public functions take their torch.compile path in eager: the argument kinds are checked,
    then the registered op runs, so its body does the checking."""
    saved = [m.compiling for m in MODULES]
    for m in MODULES:
        m.compiling = lambda: True
    try:
        yield
    finally:
        for m, f in zip(MODULES, saved, strict=True):
            m.compiling = f


def _bad_calls(dtype: torch.dtype):
    """(what, call, buffers) for every bad case of the op test files."""
    for what, kw, _, _ in test_pack._bad_cases(dtype):
        g, x = kw.pop("g"), kw.pop("x")
        yield f"pack {what}", functools.partial(lk.pack, g, x, **kw), [g, x, kw.get("delta_out"),
                                                                        kw.get("snapshot_out")]
    for what, kw, _, _ in test_outer_merge._bad_cases(dtype):
        args = [kw.pop(k) for k in ("g", "u", "delta_avg", "x", "x_sent")]
        yield f"outer_merge_ {what}", functools.partial(lk.outer_merge_, *args, **kw), args
    for what, kw, _, _ in test_sparse._gather_bad(dtype):
        x, idx = kw.pop("x"), kw.pop("idx")
        call = functools.partial(lk.sparse_gather, x, idx, **kw)
        yield f"sparse_gather {what}", call, [x, idx, kw.get("out")]
    for what, kw, _, _ in test_sparse._scatter_bad(dtype):
        args = [kw.pop(k) for k in ("x", "idx", "avg", "sent")]
        yield f"sparse_scatter_merge_ {what}", functools.partial(lk.sparse_scatter_merge_, *args, **kw), args
    for what, over, _, _ in test_fragment_norms.BAD:
        kw = dict(buf=torch.randn(10, dtype=dtype), offsets=torch.tensor([0, 5, 10]), ord=2)
        kw.update(over)
        yield f"fragment_norms {what}", functools.partial(lk.fragment_norms, **kw), [kw["buf"], kw["offsets"]]
    for what, args, _, _ in test_mask_indices.BAD:
        yield f"mask_indices {what}", functools.partial(lk.mask_indices, *args), []


def _first_word(e: BaseException) -> str:
    return re.match(r"\w+", str(e)).group(0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_registered_ops_refuse_what_eager_refuses(dtype, close):
    """Each bad case: eager raises; through the registered op it raises for the same argument, and
    no byte of any buffer changes. The error is the same, except: a wrong argument kind is a
    TypeError from the kind check; a meta tensor among real ones sends the call to the fake kernel
    (the dispatcher picks the meta kernel), which refuses the mix of devices."""
    for what, call, buffers in _bad_calls(dtype):
        with pytest.raises((TypeError, ValueError)) as eager:
            call()
        live = [b for b in buffers if isinstance(b, torch.Tensor) and b.device.type != "meta"]
        before = [close.storage_bytes(b) for b in live]
        with through_registered_ops(), pytest.raises((TypeError, ValueError)) as registered:
            call()
        e, r = eager.value, registered.value
        assert _first_word(r) == _first_word(e), f"{what}: {r!r} vs eager {e!r}"
        meta = any(isinstance(b, torch.Tensor) and b.device.type == "meta" for b in buffers)
        if isinstance(r, ValueError) and not meta:
            assert type(r) is type(e) and str(r) == str(e), f"{what}: {r!r} vs eager {e!r}"
        for b, bb in zip(live, before, strict=True):
            assert torch.equal(close.storage_bytes(b), bb), f"{what}: a refused call wrote a buffer"


def test_registered_ops_run_good_input():
    """The same path with good input: the results of the eager path."""
    gen = torch.Generator().manual_seed(3)
    g, x, u, avg, xs = (torch.randn(50, generator=gen) for _ in range(5))
    idx = torch.tensor([0, 7, 8, 49])
    offsets = torch.tensor([0, 20, 20, 50])
    state = [t.clone() for t in (g, u, x)]

    def run():
        gg, uu, xx = (t.clone() for t in state)
        lk.outer_merge_(gg, uu, avg, xx, xs, lr=0.7, momentum=0.9, alpha=0.2, beta=1.0, lam=0.3)
        y = lk.sparse_gather(xx, idx)
        lk.sparse_scatter_merge_(xx, idx, y * 0.5, y + 1.0, beta=0.5)
        return (*lk.pack(g, x), gg, uu, xx, y, lk.fragment_norms(g, offsets), lk.mask_indices(3, 4, 50, 9))

    eager = run()
    with through_registered_ops():
        registered = run()
    for a, b in zip(registered, eager, strict=True):
        assert torch.equal(a, b)


# ---- real torch.compile(fullgraph=True) --------------------------------------------------------


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True)


def _refused_while_tracing(call, message: str) -> None:
    """A wrong argument kind fails while dynamo traces; dynamo wraps the exception, so check that
    the user still sees the original message."""
    with pytest.raises(Exception) as info:
        call()
    assert message in str(info.value), str(info.value)


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.slow
def test_compiled_pack(close):
    f = _compiled(lambda g, x, d, s: lk.pack(g, x, delta_out=d, snapshot_out=s))
    g, x = _randn(64, seed=1), _randn(64, seed=2)
    d, s = torch.full((64,), 7.0), torch.full((64,), 7.0)
    delta, snap, nonfinite = f(g, x, d, s)
    ref_delta, ref_snap, ref_nf = lk.pack_ref(g, x)
    assert torch.equal(delta, ref_delta) and torch.equal(snap, ref_snap) and int(nonfinite) == int(ref_nf)
    close.assert_rejected(lambda: f(g, x, x, s), ValueError, "delta_out", [g, x, s])
    close.assert_rejected(lambda: f(g, x, d, g), ValueError, "snapshot_out", [g, x, d])
    big = torch.full((128,), 7.0)
    close.assert_rejected(lambda: f(g, x, d, big[::2]), ValueError, "snapshot_out", [g, x, d, big])
    _refused_while_tracing(lambda: _compiled(lambda g, x: lk.pack(g, x, wire_dtype=torch.float16))(g, x),
                           "wire_dtype must be g's dtype (torch.float32) or torch.bfloat16")


@pytest.mark.slow
def test_compiled_outer_merge(close):
    kw = dict(momentum=0.9, alpha=0.25, beta=1.0, lam=0.3)
    f = _compiled(lambda g, u, d, x, xs, lr: lk.outer_merge_(g, u, d, x, xs, lr=lr, **kw))
    g, u, d, x, xs = (_randn(64, seed=i) for i in range(5))
    ref = [t.clone() for t in (g, u, d, x, xs)]
    f(g, u, d, x, xs, 0.7)
    lk.outer_merge_ref(*ref, lr=0.7, **kw)
    for name, a, b in zip(("g", "u", "x"), (g, u, x), (ref[0], ref[1], ref[3]), strict=True):
        close.assert_close(a, b, scale=8.0, msg=name)
    close.assert_rejected(lambda: f(g, g, d, x, xs, 0.7), ValueError, ("g", "u"), [g, d, x, xs])
    close.assert_rejected(lambda: f(g, u, x, x, xs, 0.7), ValueError, ("delta_avg", "x"), [g, u, x, xs])
    close.assert_rejected(lambda: f(g, u, d, x, xs, NAN), ValueError, "lr", [g, u, d, x, xs])
    close.assert_rejected(lambda: f(g, u, d, x, xs, -0.5), ValueError, "lr", [g, u, d, x, xs])
    big = _randn(128)
    close.assert_rejected(lambda: f(g, u, d, big[::2], xs, 0.7), ValueError, "x", [g, u, d, big, xs])
    close.assert_rejected(lambda: f(g, u, d, x, xs.double(), 0.7), TypeError, "x_sent", [g, u, d, x])
    _refused_while_tracing(lambda: f(g, u, d, x, xs, "0.7"), "lr must be a real number, got str")


@pytest.mark.slow
def test_compiled_sparse_gather(close):
    f = _compiled(lambda x, idx, out: lk.sparse_gather(x, idx, out=out))
    x, out = _randn(64), torch.full((4,), 7.0)
    idx = torch.tensor([3, 3, 60, 0])
    assert torch.equal(f(x, idx, out), lk.sparse_gather_ref(x, idx))
    close.assert_rejected(lambda: f(x, idx, x[10:14]), ValueError, "out", [x, idx])
    close.assert_rejected(lambda: f(x, torch.tensor([3, 64, 0, 1]), out), ValueError, "idx", [x, out])
    close.assert_rejected(lambda: f(x, torch.tensor([3, -1, 0, 1]), out), ValueError, "idx", [x, out])
    _refused_while_tracing(lambda: f(x, [3, 3, 60, 0], out), "idx must be a torch.Tensor, got list")


@pytest.mark.slow
def test_compiled_sparse_scatter_merge(close):
    f = _compiled(lambda x, idx, avg, sent, beta: lk.sparse_scatter_merge_(x, idx, avg, sent, beta=beta))
    x, avg, sent = _randn(64, seed=1), _randn(4, seed=2), _randn(4, seed=3)
    idx = torch.tensor([0, 5, 6, 63])
    ref = x.clone()
    f(x, idx, avg, sent, 0.5)
    lk.sparse_scatter_merge_ref(ref, idx, avg, sent, beta=0.5)
    close.assert_close(x, ref)
    close.assert_rejected(lambda: f(x, idx, x[:4], sent, 0.5), ValueError, ("x", "avg"), [x, idx, sent])
    close.assert_rejected(lambda: f(x, torch.tensor([5, 0, 6, 63]), avg, sent, 0.5), ValueError, "idx",
                          [x, avg, sent])
    close.assert_rejected(lambda: f(x, torch.tensor([0, 5, 5, 63]), avg, sent, 0.5), ValueError, "idx",
                          [x, avg, sent])
    close.assert_rejected(lambda: f(x, idx, avg, sent, NAN), ValueError, "beta", [x, idx, avg, sent])
    _refused_while_tracing(lambda: f(x, idx, avg, sent, None), "beta must be a real number, got NoneType")


@pytest.mark.slow
def test_compiled_fragment_norms(close):
    f = _compiled(lambda buf, offsets: lk.fragment_norms(buf, offsets))
    buf = _randn(64)
    offsets = torch.tensor([0, 10, 10, 64])
    close.assert_close(f(buf, offsets), lk.fragment_norms_ref(buf, offsets), kind="reduction")
    close.assert_rejected(lambda: f(buf, torch.tensor([0, 30, 10, 64])), ValueError, "offsets", [buf])
    close.assert_rejected(lambda: f(buf, torch.tensor([0, 10, 10, 65])), ValueError, "offsets", [buf])
    close.assert_rejected(lambda: f(buf, torch.tensor([0, 10, 64], dtype=torch.int32)), TypeError, "offsets",
                          [buf])
    g = _compiled(lambda buf, offsets: lk.fragment_norms(buf, offsets, ord=2.0))
    _refused_while_tracing(lambda: g(buf, offsets), "ord must be an int, got float")


@pytest.mark.slow
def test_compiled_mask_indices():
    f = _compiled(lambda seed, rnd, k: lk.mask_indices(seed, rnd, 1000, k))
    for rnd in range(3):  # a changing round becomes a symbolic int after the first recompile
        assert torch.equal(f(5, rnd, 10 + rnd), lk.mask_indices_ref(5, rnd, 1000, 10 + rnd))
    assert torch.equal(f(2**63 - 1, 1, 10), lk.mask_indices_ref(2**63 - 1, 1, 1000, 10))
    # host values checked while tracing: the documented ValueError when the compiled code runs, not
    # dynamo's Unsupported wrapping it (ops._common.refusing)
    with pytest.raises(ValueError, match=re.escape("seed must be in [0, 9223372036854775807]")):
        f(2**64, 1, 10)
    with pytest.raises(ValueError, match=re.escape("round must be in [0, 9223372036854775807]")):
        f(5, -1, 10)  # (round is a symbolic int by now)
    with pytest.raises(ValueError, match="k must be <= n, got k=1001 > n=1000"):
        f(5, 1, 1001)


@pytest.mark.slow
def test_compiled_quantize_family_refuses_bad_host_values():
    """quantize, dequantize, pack_quantized and reduce_quantized under torch.compile(fullgraph=True):
    good input gives the eager result; a bad format, block, seed or count raises the documented
    ValueError naming it when the compiled code runs (it used to surface as dynamo's Unsupported)."""
    v = _randn(64)
    q = _compiled(lambda v, block: lk.quantize(v, "int8", block))
    codes, scales = q(v, 16)
    ref_codes, ref_scales = lk.quantize(v, "int8", 16)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    with pytest.raises(ValueError, match="block must be a power of two >= 2, got 3"):
        q(v, 3)
    with pytest.raises(ValueError, match="fmt must be one of"):
        _compiled(lambda v: lk.quantize(v, "int9", 16))(v)
    dq = _compiled(lambda c, s, n: lk.dequantize(c, s, "int8", 16, n))
    assert torch.equal(dq(codes, scales, 64), lk.dequantize(codes, scales, "int8", 16, 64))
    with pytest.raises(ValueError, match="n must be >= 0, got -1"):
        dq(codes, scales, -1)
    with pytest.raises(ValueError, match=re.escape("seed must be in [0, 9223372036854775807]")):
        _compiled(lambda g, x: lk.pack_quantized(g, x, "int4", 16, seed=-5))(v, v.clone())
    with pytest.raises(ValueError, match="n must be >= 0, got -3"):
        _compiled(lambda c, s: lk.reduce_quantized(c, s, "int8", 16, -3))(codes[None], scales[None])


# ---- meta tensors ------------------------------------------------------------------------------


def _meta(n=8, dtype=torch.float32):
    return torch.empty(n, dtype=dtype, device="meta")


META_CALLS = [
    ("pack", lambda m: lk.pack(m(), m()), "g"),
    ("pack snapshot_out", lambda m: lk.pack(torch.zeros(8), torch.ones(8), snapshot_out=m()), "snapshot_out"),
    ("outer_merge_", lambda m: lk.outer_merge_(m(), m(), m(), m(), m(), lr=0.5, beta=1.0), "g"),
    ("outer_merge_ x_sent", lambda m: lk.outer_merge_(*(torch.zeros(8) for _ in range(4)), m(), lr=0.5,
                                                      beta=1.0), "x_sent"),
    ("sparse_gather", lambda m: lk.sparse_gather(m(), m(2, torch.int64)), "x"),
    ("sparse_scatter_merge_", lambda m: lk.sparse_scatter_merge_(m(), m(2, torch.int64), m(2), m(2)), "x"),
    ("fragment_norms", lambda m: lk.fragment_norms(m(), m(3, torch.int64)), "buf"),
    ("mask_indices", lambda m: lk.mask_indices(1, 2, 10, 3, device="meta"), "device"),
]


@pytest.mark.parametrize(("what", "call", "arg"), META_CALLS, ids=[c[0] for c in META_CALLS])
def test_meta_tensors_are_refused_in_eager(what, call, arg, close):
    """A meta tensor has no data: the error names the argument and says so (once it said that two
    meta tensors 'share memory', their data pointers being equal)."""
    with pytest.raises(ValueError, match=rf"^{arg}\b.*meta") as info:
        call(_meta)
    assert "share memory" not in str(info.value)


@pytest.mark.slow
def test_meta_tensors_trace_under_compile():
    """Under torch.compile meta inputs go through the fake kernels: shapes and dtypes come out, as
    for any torch op on meta tensors. Mixing meta with real tensors is refused while tracing."""
    f = _compiled(lambda g, x: lk.pack(g, x, wire_dtype=torch.bfloat16))
    delta, snapshot, nonfinite = f(_meta(), _meta())
    assert delta.device.type == "meta" and delta.dtype == torch.bfloat16 and delta.shape == (8,)
    assert snapshot.device.type == "meta" and nonfinite.shape == ()
    _refused_while_tracing(lambda: f(torch.zeros(8), _meta()), "x is on meta but g is on cpu")
