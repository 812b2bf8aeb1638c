"""Property-based tests of every op (issue 5 item 1): random sizes, dtypes, strides, offsets and
scalars, valid and invalid. Each call either matches the ref or raises the documented
ValueError/TypeError naming a violated argument; on an error no byte of any buffer changed; never
any other exception. The expected outcome is predicted here from the contract, independently of
the ops' own checks. Data come from a drawn seed, so hypothesis explores shapes and arguments while
values stay random (adversarial values such as 0 · inf are the unit tests' business).

Derandomized and without a database, so CI sees the same examples every run; sized so the file
runs in well under a minute on two cores.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import lowcomm_kernels.ops as lk

SETTINGS = settings(max_examples=150, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FLOATS = (torch.float32, torch.float64)
NAN, INF = float("nan"), float("inf")


# ---- the contract, restated -----------------------------------------------------------------

def tensor_violations(name, t, dtypes, *, dim=None):
    if not isinstance(t, torch.Tensor):
        return [(name, TypeError)]
    v = []
    if t.dtype not in dtypes:
        v.append((name, TypeError))
    if dim is not None and t.dim() != dim:
        v.append((name, ValueError))
    if not t.is_contiguous():
        v.append((name, ValueError))
    return v


def extent(t: torch.Tensor) -> tuple[int, int]:
    last = sum((s - 1) * st_ for s, st_ in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def overlaps(a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = extent(a), extent(b)
    return a0 < b1 and b0 < a1


def alias_violations(named: dict) -> list:
    items = [(k, t) for k, t in named.items() if isinstance(t, torch.Tensor)]
    out = []
    for i, (an, a) in enumerate(items):
        for bn, b in items[i + 1:]:
            if overlaps(a, b):
                out += [(an, ValueError), (bn, ValueError)]
    return out


def scalar_violations(name, value, lo=None, hi=None, hi_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return [(name, TypeError)]
    v = float(value)
    if not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and (v > hi or (hi_open and v == hi))):
        return [(name, ValueError)]
    return []


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def outcome(call, violations, buffers):
    """Run `call`; on a documented error check the name and that nothing was written and return
    None; on success check that nothing was predicted invalid and return the result."""
    live = [b for b in buffers if isinstance(b, torch.Tensor)]
    before = [storage_bytes(b) for b in live]
    try:
        result = call()
    except (ValueError, TypeError) as e:
        msg = str(e)
        event(f"rejected: {type(e).__name__} {msg.split()[0]}")
        assert violations, f"a valid call raised {type(e).__name__}: {msg}"
        assert any(isinstance(e, exc) and re.match(rf"{re.escape(name)}\b", msg) for name, exc in violations), \
            f"{type(e).__name__}({msg!r}) does not name one of the violations {violations}"
        for b, bb in zip(live, before):
            assert torch.equal(storage_bytes(b), bb), f"a rejected call wrote a buffer ({msg})"
        return None
    assert not violations, f"accepted invalid input, expected one of {violations}"
    event("valid: matched the ref")
    return ("ok", result)


# ---- strategies ---------------------------------------------------------------------------------

def data(seed: int, n: int, dtype: torch.dtype, layout: str = "contiguous", scale: float = 1.0) -> torch.Tensor:
    """n values of `dtype` laid out contiguously or as a stride-2 view (non-contiguous when n >= 2)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype in (torch.int64, torch.int32):
        base = torch.randint(-5, 5, (2 * n,), generator=gen, dtype=dtype)
    else:
        base = (scale * torch.randn(2 * n, generator=gen, dtype=torch.float64)).to(dtype)
    return base[::2] if layout == "strided" else base[:n].clone()


def scalar(lo: float, hi: float, *, bad: tuple = ()) -> st.SearchStrategy:
    return st.one_of(st.floats(lo, hi), st.floats(lo, hi), st.sampled_from([lo, hi, NAN, INF, -INF, *bad]),
                     st.sampled_from([int(lo), "0.5", None, True]))


sizes = st.one_of(st.sampled_from([0, 1, 2, 7]), st.integers(0, 300))
float_dtype = st.sampled_from(FLOATS)
any_dtype = st.sampled_from([torch.float32, torch.float64, torch.float32, torch.float64, torch.bfloat16,
                             torch.float16, torch.int64])
layouts = st.sampled_from(["contiguous"] * 5 + ["strided"])
seeds = st.integers(0, 2 ** 31)


def cleaned(clean: bool, value, good, bad_when=None):
    """In a `clean` example every knob takes a valid value, so about half the examples exercise the
    numerical path; otherwise the drawn (possibly invalid) value stands."""
    if not clean:
        return value
    if bad_when is None:
        return good
    return good if bad_when(value) else value


def close_enough(a, b, dtype, scale=8.0, extra_rtol=0.0):
    eps = torch.finfo(dtype).eps
    rtol = 8 * eps + extra_rtol
    torch.testing.assert_close(a, b, rtol=rtol, atol=scale * rtol, equal_nan=True)


# ---- pack ---------------------------------------------------------------------------------------

@pytest.mark.op("pack")
@SETTINGS
@given(n=sizes, seed=seeds, dg=any_dtype, same_dtype=st.booleans(), lg=layouts, lx=layouts,
       numel_off=st.sampled_from([0] * 6 + [1, -1]),
       wire=st.sampled_from(["none", "none", "g", "bf16", "f16", "other"]),
       delta_kind=st.sampled_from(["none", "none", "ok", "dtype", "numel", "strided", "alias_g", "alias_x"]),
       snap_kind=st.sampled_from(["none", "none", "false", "ok", "dtype", "numel", "strided", "alias_x", "alias_delta"]),
       specials=st.booleans(), clean=st.booleans())
def test_pack(backend, n, seed, dg, same_dtype, lg, lx, numel_off, wire, delta_kind, snap_kind, specials, clean):
    dg = cleaned(clean, dg, torch.float64, lambda d: d not in FLOATS)
    same_dtype, lg, lx, numel_off = (cleaned(clean, same_dtype, True), cleaned(clean, lg, "contiguous"),
                                     cleaned(clean, lx, "contiguous"), cleaned(clean, numel_off, 0))
    wire = cleaned(clean, wire, "bf16", lambda w: w in ("f16", "other"))
    delta_kind = cleaned(clean, delta_kind, "ok", lambda k: k not in ("none", "ok"))
    snap_kind = cleaned(clean, snap_kind, "ok", lambda k: k not in ("none", "ok", "false"))
    other = {torch.float32: torch.float64}.get(dg, torch.float32)
    g = data(seed, n, dg, lg)
    x = data(seed + 1, max(n + numel_off, 0), dg if same_dtype else other, lx)
    if specials and n >= 3 and dg in FLOATS and g.is_contiguous():
        g[:3] = torch.tensor([NAN, INF, -INF], dtype=dg)
    wire_dtype = {"none": None, "g": dg, "bf16": torch.bfloat16, "f16": torch.float16, "other": other}[wire]
    eff_wire = wire_dtype
    delta_out = None
    if delta_kind != "none":
        dd = wire_dtype or dg
        delta_out = {"ok": lambda: torch.full((n,), 7.0, dtype=dd) if dd.is_floating_point else torch.zeros(n, dtype=dd),
                     "dtype": lambda: torch.full((n,), 7.0, dtype=other),
                     "numel": lambda: torch.full((n + 1,), 7.0, dtype=dd) if dd.is_floating_point else torch.zeros(n + 1, dtype=dd),
                     "strided": lambda: torch.zeros(2 * n, dtype=dd)[::2],
                     "alias_g": lambda: g, "alias_x": lambda: x}[delta_kind]()
    if eff_wire is None:
        eff_wire = delta_out.dtype if isinstance(delta_out, torch.Tensor) else dg
    snap = {"none": None, "false": False, "ok": lambda: torch.full((x.numel(),), 7.0, dtype=x.dtype),
            "dtype": lambda: torch.full((x.numel(),), 7.0, dtype=torch.bfloat16),
            "numel": lambda: torch.full((x.numel() + 1,), 7.0, dtype=x.dtype),
            "strided": lambda: torch.zeros(2 * x.numel(), dtype=x.dtype)[::2],
            "alias_x": lambda: x, "alias_delta": lambda: delta_out}[snap_kind]
    snap = snap() if callable(snap) else snap

    v = tensor_violations("g", g, FLOATS) + tensor_violations("x", x, FLOATS)
    if x.dtype != g.dtype:
        v.append(("x", TypeError))
    if x.numel() != g.numel():
        v.append(("x", ValueError))
    if eff_wire not in (g.dtype, torch.bfloat16):
        v += [("wire_dtype", TypeError), ("delta_out", TypeError)]
    if isinstance(delta_out, torch.Tensor):
        v += tensor_violations("delta_out", delta_out, (eff_wire,))
        if delta_out.numel() != g.numel():
            v.append(("delta_out", ValueError))
    if isinstance(snap, torch.Tensor):
        v += tensor_violations("snapshot_out", snap, (x.dtype,))
        if snap.numel() != g.numel():
            v.append(("snapshot_out", ValueError))
    v += alias_violations({"delta_out": delta_out, "snapshot_out": snap if isinstance(snap, torch.Tensor) else None,
                           "g": g}) + alias_violations({"delta_out": delta_out, "x": x})
    v += alias_violations({"snapshot_out": snap if isinstance(snap, torch.Tensor) else None, "x": x})

    g0, x0 = g.clone(), x.clone()
    res = outcome(lambda: lk.pack(g, x, wire_dtype=wire_dtype, delta_out=delta_out, snapshot_out=snap,
                                  backend=backend), v, [g, x, delta_out, snap])
    if res is None:
        return
    delta, snapshot, nonfinite = res[1]
    ref_delta, _, ref_nf = lk.pack_ref(g0, x0, wire_dtype=eff_wire)
    if eff_wire == torch.bfloat16:  # one round-to-nearest-even: bit-exact (any NaN payload is a NaN)
        d, r = delta.reshape(-1), ref_delta.reshape(-1)
        assert torch.equal(torch.isnan(d), torch.isnan(r))
        keep = ~torch.isnan(r)
        assert torch.equal(d[keep].view(torch.int16), r[keep].view(torch.int16))
    else:
        close_enough(delta.reshape(-1), ref_delta.reshape(-1), eff_wire, scale=4.0)
    assert int(nonfinite) == int(ref_nf)
    if snap is False:
        assert snapshot is None
    else:
        assert torch.equal(snapshot.reshape(-1).view(torch.uint8), x0.reshape(-1).contiguous().view(torch.uint8))
    assert torch.equal(storage_bytes(g), storage_bytes(g0)) and torch.equal(storage_bytes(x), storage_bytes(x0))


# ---- outer_merge_ -------------------------------------------------------------------------------

NAMES = ("g", "u", "delta_avg", "x", "x_sent")


@pytest.mark.op("outer_merge_")
@SETTINGS
@given(n=sizes, seed=seeds, dtype=any_dtype, avg_kind=st.sampled_from(["same"] * 4 + ["bf16", "other", "f16"]),
       strided=st.sampled_from([None] * 8 + list(NAMES)), wrong_numel=st.sampled_from([None] * 8 + list(NAMES[1:])),
       wrong_dtype=st.sampled_from([None] * 8 + ["u", "x", "x_sent"]),
       alias=st.sampled_from([None] * 8 + [("g", "u"), ("x", "g"), ("delta_avg", "x"), ("x_sent", "x"),
                                           ("u", "x_sent")]),
       has_sent=st.sampled_from([True, True, True, False]),
       lr=scalar(0.0, 2.0, bad=(-0.1,)), momentum=scalar(0.0, 0.99, bad=(1.0, -0.1)),
       alpha=scalar(0.0, 1.0, bad=(1.01, -0.01)), beta=scalar(0.0, 2.0, bad=(-1.0,)),
       lam=scalar(0.0, 2.0, bad=(-0.5,)), nesterov=st.sampled_from([True, False, True, False, 1]),
       lam_mode=st.sampled_from(["absolute", "normalized", "absolute", "normalized", "taylor"]), clean=st.booleans())
def test_outer_merge(backend, n, seed, dtype, avg_kind, strided, wrong_numel, wrong_dtype, alias, has_sent, lr,
                     momentum, alpha, beta, lam, nesterov, lam_mode, clean):
    dtype = cleaned(clean, dtype, torch.float32, lambda d: d not in FLOATS)
    avg_kind = cleaned(clean, avg_kind, "bf16", lambda k: k not in ("same", "bf16"))
    strided, wrong_numel, wrong_dtype, alias = (cleaned(clean, x, None) for x in (strided, wrong_numel, wrong_dtype, alias))
    has_sent = cleaned(clean, has_sent, True)
    lr = cleaned(clean, lr, 0.7, lambda s: bool(scalar_violations("lr", s, 0.0)))
    momentum = cleaned(clean, momentum, 0.9, lambda s: bool(scalar_violations("m", s, 0.0, 1.0, hi_open=True)))
    alpha = cleaned(clean, alpha, 0.5, lambda s: bool(scalar_violations("a", s, 0.0, 1.0)))
    beta = cleaned(clean, beta, 1.0, lambda s: bool(scalar_violations("b", s, 0.0)))
    lam = cleaned(clean, lam, 0.5, lambda s: bool(scalar_violations("l", s, 0.0)))
    nesterov = cleaned(clean, nesterov, True, lambda b: not isinstance(b, bool))
    lam_mode = cleaned(clean, lam_mode, "normalized", lambda m: m not in ("absolute", "normalized"))
    other = {torch.float32: torch.float64}.get(dtype, torch.float32)
    avg_dtype = {"same": dtype, "bf16": torch.bfloat16, "other": other, "f16": torch.float16}[avg_kind]
    t = {}
    for i, name in enumerate(NAMES):
        dt = avg_dtype if name == "delta_avg" else (other if name == wrong_dtype else dtype)
        size = n + 1 if name == wrong_numel else n
        # training-like values: small local and global moves around x_sent
        t[name] = data(seed + i, size, dt, "strided" if name == strided else "contiguous",
                       scale=1.0 if name in ("g", "x", "x_sent") else 0.1)
    if alias is not None:
        t[alias[0]] = t[alias[1]]
    if not has_sent:
        t["x_sent"] = None
    g = t["g"]
    v = tensor_violations("g", g, FLOATS) + tensor_violations("u", t["u"], FLOATS) + tensor_violations("x", t["x"], FLOATS)
    v += tensor_violations("delta_avg", t["delta_avg"], (g.dtype, torch.bfloat16))
    for name in ("u", "x", "x_sent"):
        if isinstance(t[name], torch.Tensor) and t[name].dtype != g.dtype:
            v.append((name, TypeError))
        if isinstance(t[name], torch.Tensor) and not t[name].is_contiguous():
            v.append((name, ValueError))
    for name in NAMES[1:]:
        if isinstance(t[name], torch.Tensor) and t[name].numel() != g.numel():
            v.append((name, ValueError))
    v += scalar_violations("lr", lr, 0.0) + scalar_violations("momentum", momentum, 0.0, 1.0, hi_open=True)
    v += scalar_violations("alpha", alpha, 0.0, 1.0) + scalar_violations("beta", beta, 0.0)
    v += scalar_violations("lam", lam, 0.0)
    if not isinstance(nesterov, bool):
        v.append(("nesterov", TypeError))
    if lam_mode not in ("absolute", "normalized"):
        v.append(("lam_mode", ValueError))
    nonzero = [s for s in (beta, lam) if not scalar_violations("s", s) and float(s) != 0.0]
    if t["x_sent"] is None and (nonzero or scalar_violations("beta", beta) or scalar_violations("lam", lam)):
        v.append(("x_sent", ValueError))
    v += alias_violations(t)

    ref = {k: (x.clone() if isinstance(x, torch.Tensor) else x) for k, x in t.items()}
    kw = dict(lr=lr, momentum=momentum, nesterov=nesterov, alpha=alpha, beta=beta, lam=lam, lam_mode=lam_mode)
    res = outcome(lambda: lk.outer_merge_(*(t[k] for k in NAMES), backend=backend, **kw), v, list(t.values()))
    if res is None:
        return
    lk.outer_merge_ref(*(ref[k] for k in NAMES), **kw)
    extra = 8 * math.sqrt(max(n, 1)) * 2.3e-16 if lam_mode == "normalized" else 0.0
    for name in ("g", "u", "x"):
        close_enough(t[name], ref[name], dtype, extra_rtol=extra)


# ---- mask_indices -------------------------------------------------------------------------------

ints = st.one_of(st.integers(0, 2 ** 63), st.integers(-3, -1), st.sampled_from([1.0, True, "3", None]))


@pytest.mark.op("mask_indices")
@SETTINGS
@given(seed=ints, rnd=ints, n=st.one_of(st.integers(0, 3000), st.sampled_from([-1, 2 ** 62 + 1, 2 ** 40, 7.0])),
       k_off=st.integers(-3, 3), k_frac=st.floats(0, 1), clean=st.booleans())
def test_mask_indices(backend, seed, rnd, n, k_off, k_frac, clean):
    def bad_int(v):
        return isinstance(v, bool) or not isinstance(v, int) or v < 0
    seed, rnd = cleaned(clean, seed, 12345, bad_int), cleaned(clean, rnd, 7, bad_int)
    n = cleaned(clean, n, 1000, lambda v: bad_int(v) or v > 3000)
    k_off = cleaned(clean, k_off, 0, lambda v: v < 0 or v > 0)
    k = (int(k_frac * n) + k_off) if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= 3000 else k_off
    v = []
    for name, val in (("seed", seed), ("round", rnd), ("n", n), ("k", k)):
        if isinstance(val, bool) or not isinstance(val, int):
            v.append((name, TypeError))
        elif val < 0:
            v.append((name, ValueError))
    if isinstance(n, int) and not isinstance(n, bool) and n > 2 ** 62:
        v.append(("n", ValueError))
    if not v and k > n:
        v.append(("k", ValueError))
    res = outcome(lambda: lk.mask_indices(seed, rnd, n, k, backend=backend), v, [])
    if res is None:
        return
    idx = res[1]
    assert idx.dtype == torch.int64 and idx.shape == (k,)
    assert torch.equal(idx, lk.mask_indices_ref(seed, rnd, n, k))
    if k:
        assert int(idx[0]) >= 0 and int(idx[-1]) < n and bool((idx[1:] > idx[:-1]).all())


# ---- sparse gather / scatter-merge --------------------------------------------------------------

def index_tensor(seed, n, k, kind):
    gen = torch.Generator().manual_seed(seed)
    k = min(k, n) if kind in ("sorted", "unsorted") else k
    if kind in ("sorted", "unsorted", "dup", "range", "neg", "int32", "strided"):
        base = torch.randperm(n, generator=gen)[:k] if n else torch.empty(0, dtype=torch.int64)
        if kind == "sorted" or kind == "strided":
            base = torch.sort(base).values
        if kind == "dup" and base.numel() >= 2:
            base = torch.sort(base).values
            base[1] = base[0]
        if kind == "range" and base.numel():
            base[-1] = n
        if kind == "neg" and base.numel():
            base[0] = -1
        if kind == "int32":
            base = base.int()
        if kind == "strided":
            base = torch.stack([base, base]).t().reshape(-1)[::2]
        return base
    if kind == "2d":
        return torch.zeros(1, max(k, 1), dtype=torch.int64)
    return torch.zeros(k, dtype=torch.float64)  # "float"


def index_violations(idx, n, strictly_increasing):
    v = tensor_violations("idx", idx, (torch.int64,), dim=1)
    if v or idx.numel() == 0:
        return v
    if int(idx.min()) < 0 or int(idx.max()) >= n:
        return [("idx", ValueError)]
    if strictly_increasing and idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
        return [("idx", ValueError)]
    return []


IDX_KINDS = st.sampled_from(["sorted"] * 6 + ["unsorted", "dup", "range", "neg", "int32", "strided", "2d", "float"])


@pytest.mark.op("sparse_gather")
@SETTINGS
@given(n=sizes, k=st.integers(0, 80), seed=seeds, dtype=any_dtype, layout=layouts, kind=IDX_KINDS,
       out_kind=st.sampled_from(["none", "none", "ok", "dtype", "numel", "strided", "alias_x"]), clean=st.booleans())
def test_sparse_gather(backend, n, k, seed, dtype, layout, kind, out_kind, clean):
    dtype = cleaned(clean, dtype, torch.float32, lambda d: d not in FLOATS)
    layout = cleaned(clean, layout, "contiguous")
    kind = cleaned(clean, kind, "dup", lambda k: k not in ("sorted", "unsorted", "dup"))
    out_kind = cleaned(clean, out_kind, "ok", lambda k: k not in ("none", "ok"))
    x = data(seed, n, dtype, layout)
    idx = index_tensor(seed + 1, n, k, kind)
    kk = idx.numel()
    out = {"none": None, "ok": lambda: torch.full((kk,), 7.0, dtype=x.dtype),
           "dtype": lambda: torch.full((kk,), 7.0, dtype=torch.bfloat16),
           "numel": lambda: torch.full((kk + 1,), 7.0, dtype=x.dtype),
           "strided": lambda: torch.zeros(2 * kk, dtype=x.dtype)[::2],
           "alias_x": lambda: x.reshape(-1)[:kk] if x.is_contiguous() else x}[out_kind]
    out = out() if callable(out) else out
    v = tensor_violations("x", x, FLOATS) + index_violations(idx, x.numel(), False)
    if isinstance(out, torch.Tensor):
        v += tensor_violations("out", out, (x.dtype,))
        if out.numel() != idx.numel():
            v.append(("out", ValueError))
        v += alias_violations({"out": out, "x": x})
    x0 = x.clone()
    res = outcome(lambda: lk.sparse_gather(x, idx, out=out, backend=backend), v, [x, idx, out])
    if res is not None:
        assert torch.equal(res[1], lk.sparse_gather_ref(x0, idx))


@pytest.mark.op("sparse_scatter_merge_")
@SETTINGS
@given(n=sizes, k=st.integers(0, 80), seed=seeds, dtype=any_dtype, layout=layouts, kind=IDX_KINDS,
       avg_kind=st.sampled_from(["same"] * 5 + ["bf16", "f16", "numel", "strided", "alias_x", "alias_sent"]),
       sent_kind=st.sampled_from(["same"] * 6 + ["bf16", "numel", "strided"]), beta=scalar(0.0, 2.0, bad=(-1.0,)),
       clean=st.booleans())
def test_sparse_scatter_merge(backend, n, k, seed, dtype, layout, kind, avg_kind, sent_kind, beta, clean):
    dtype = cleaned(clean, dtype, torch.float64, lambda d: d not in FLOATS)
    layout, kind, sent_kind = cleaned(clean, layout, "contiguous"), cleaned(clean, kind, "sorted"), cleaned(clean, sent_kind, "same")
    avg_kind = cleaned(clean, avg_kind, "bf16", lambda k: k not in ("same", "bf16"))
    beta = cleaned(clean, beta, 1.0, lambda s: bool(scalar_violations("b", s, 0.0)))
    x = data(seed, n, dtype, layout)
    idx = index_tensor(seed + 1, n, k, kind)
    kk = idx.numel()
    base_dt = dtype if dtype in FLOATS else torch.float32
    sent = {"same": lambda: data(seed + 2, kk, base_dt), "bf16": lambda: data(seed + 2, kk, torch.bfloat16),
            "numel": lambda: data(seed + 2, kk + 1, base_dt),
            "strided": lambda: data(seed + 2, kk, base_dt, "strided")}[sent_kind]()
    avg = {"same": lambda: data(seed + 3, kk, base_dt), "bf16": lambda: data(seed + 3, kk, torch.bfloat16),
           "f16": lambda: data(seed + 3, kk, torch.float16), "numel": lambda: data(seed + 3, kk + 1, base_dt),
           "strided": lambda: data(seed + 3, kk, base_dt, "strided"),
           "alias_x": lambda: x.reshape(-1)[:kk] if x.is_contiguous() else x,
           "alias_sent": lambda: sent}[avg_kind]()
    v = tensor_violations("x", x, FLOATS) + index_violations(idx, x.numel(), True)
    v += tensor_violations("avg", avg, (x.dtype, torch.bfloat16)) + tensor_violations("sent", sent, (x.dtype,))
    for name, t in (("avg", avg), ("sent", sent)):
        if t.numel() != idx.numel():
            v.append((name, ValueError))
    v += scalar_violations("beta", beta, 0.0)
    v += alias_violations({"x": x, "avg": avg, "sent": sent})
    ref = x.clone()
    res = outcome(lambda: lk.sparse_scatter_merge_(x, idx, avg, sent, beta=beta, backend=backend), v,
                  [x, idx, avg, sent])
    if res is not None:
        lk.sparse_scatter_merge_ref(ref, idx, avg, sent, beta=float(beta))
        close_enough(x, ref, dtype, scale=4.0)


# ---- fragment_norms -----------------------------------------------------------------------------

@pytest.mark.op("fragment_norms")
@SETTINGS
@given(n=sizes, seed=seeds, dtype=any_dtype, layout=layouts,
       cuts=st.lists(st.integers(-2, 310), max_size=12), sort=st.sampled_from([True] * 4 + [False]),
       off_dtype=st.sampled_from([torch.int64] * 6 + [torch.int32, torch.float64]),
       off_2d=st.sampled_from([False] * 8 + [True]),
       ord=st.sampled_from([1, 2, 1, 2, 0, 3, True, "2", -1, 2.0, 1.0]), clean=st.booleans())
def test_fragment_norms(backend, n, seed, dtype, layout, cuts, sort, off_dtype, off_2d, ord, clean):
    dtype = cleaned(clean, dtype, torch.float32, lambda d: d not in FLOATS)
    layout, sort, off_dtype, off_2d = (cleaned(clean, layout, "contiguous"), cleaned(clean, sort, True),
                                       cleaned(clean, off_dtype, torch.int64), cleaned(clean, off_2d, False))
    ord = cleaned(clean, ord, 1, lambda o: o not in (1, 2) or not isinstance(o, int) or isinstance(o, bool))
    if clean:  # boundaries inside [0, n], at least one
        cuts = [min(max(c, 0), n) for c in cuts] or [0]
    buf = data(seed, n, dtype, layout)
    offs = torch.tensor(sorted(cuts) if sort else cuts, dtype=torch.int64).to(off_dtype)
    if off_2d:
        offs = offs.view(1, -1)
    v = tensor_violations("buf", buf, FLOATS) + tensor_violations("offsets", offs, (torch.int64,), dim=1)
    if isinstance(ord, bool) or not isinstance(ord, int):
        v.append(("ord", TypeError))
    elif ord not in (1, 2):
        v.append(("ord", ValueError))
    if offs.numel() == 0:
        v.append(("offsets", ValueError))
    elif not v:
        o = offs.tolist()
        if any(b < a for a, b in zip(o, o[1:])) or min(o) < 0 or max(o) > buf.numel():
            v.append(("offsets", ValueError))
    res = outcome(lambda: lk.fragment_norms(buf, offs, ord=ord, backend=backend), v, [buf, offs])
    if res is None:
        return
    out = res[1]
    ref = lk.fragment_norms_ref(buf, offs, ord=ord)
    assert out.shape == (offs.numel() - 1,) and out.dtype == dtype
    rtol = torch.finfo(dtype).eps + 8 * math.sqrt(max(n, 1)) * 2.3e-16
    torch.testing.assert_close(out, ref, rtol=rtol, atol=0.0)
