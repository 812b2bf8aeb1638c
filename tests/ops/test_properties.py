"""Property-based tests of every op: pack, outer_merge_ and mask_indices here,
the indexed ops in test_properties_indexed.py, the contract they check in _contract.py. Random
sizes, dtypes, strides, offsets and scalars, valid and invalid. Each call either matches the ref or
raises the documented ValueError/TypeError naming a violated argument; on an error no byte of any
buffer changed; never any other exception. The expected outcome is predicted from the contract,
independently of the ops' own checks. Data come from a drawn seed, so hypothesis explores shapes
and arguments while values stay random (adversarial values such as 0 · inf are the unit tests').

Derandomized and without a database, so CI sees the same examples every run; sized so both files
run in well under a minute on two cores.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lowcomm_kernels.ops as lk

from ._contract import (
    FLOATS,
    INF,
    NAN,
    SETTINGS,
    alias_violations,
    any_dtype,
    assert_bf16_wire,
    cleaned,
    close_enough,
    contiguous_layout,
    data,
    layouts,
    outcome,
    scalar,
    scalar_violations,
    seeds,
    sizes,
    tensor_violations,
)

# ---- pack ---------------------------------------------------------------------------------------


@pytest.mark.op("pack")
@SETTINGS
@given(
    n=sizes,
    seed=seeds,
    dg=any_dtype,
    same_dtype=st.booleans(),
    lg=layouts,
    lx=layouts,
    numel_off=st.sampled_from([0] * 6 + [1, -1]),
    wire=st.sampled_from(["none", "none", "g", "bf16", "f16", "other"]),
    delta_kind=st.sampled_from(["none", "none", "ok", "dtype", "numel", "strided", "alias_g", "alias_x"]),
    snap_kind=st.sampled_from(
        ["none", "none", "false", "ok", "dtype", "numel", "strided", "alias_x", "alias_delta"]
    ),
    specials=st.booleans(),
    clean=st.booleans(),
)
def test_pack(
    backend, n, seed, dg, same_dtype, lg, lx, numel_off, wire, delta_kind, snap_kind, specials, clean
):
    dg = cleaned(clean, dg, torch.float64, lambda d: d not in FLOATS)
    same_dtype, lg, lx, numel_off = (
        cleaned(clean, same_dtype, True),
        cleaned(clean, lg, "contiguous", lambda v: not contiguous_layout(v)),
        cleaned(clean, lx, "contiguous", lambda v: not contiguous_layout(v)),
        cleaned(clean, numel_off, 0),
    )
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
        delta_out = {
            "ok": lambda: (
                torch.full((n,), 7.0, dtype=dd) if dd.is_floating_point else torch.zeros(n, dtype=dd)
            ),
            "dtype": lambda: torch.full((n,), 7.0, dtype=other),
            "numel": lambda: (
                torch.full((n + 1,), 7.0, dtype=dd) if dd.is_floating_point else torch.zeros(n + 1, dtype=dd)
            ),
            "strided": lambda: torch.zeros(2 * n, dtype=dd)[::2],
            "alias_g": lambda: g,
            "alias_x": lambda: x,
        }[delta_kind]()
    if eff_wire is None:
        eff_wire = delta_out.dtype if isinstance(delta_out, torch.Tensor) else dg
    snap = {
        "none": None,
        "false": False,
        "ok": lambda: torch.full((x.numel(),), 7.0, dtype=x.dtype),
        "dtype": lambda: torch.full((x.numel(),), 7.0, dtype=torch.bfloat16),
        "numel": lambda: torch.full((x.numel() + 1,), 7.0, dtype=x.dtype),
        "strided": lambda: torch.zeros(2 * x.numel(), dtype=x.dtype)[::2],
        "alias_x": lambda: x,
        "alias_delta": lambda: delta_out,
    }[snap_kind]
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
    v += alias_violations(
        {"delta_out": delta_out, "snapshot_out": snap if isinstance(snap, torch.Tensor) else None, "g": g}
    ) + alias_violations({"delta_out": delta_out, "x": x})
    v += alias_violations({"snapshot_out": snap if isinstance(snap, torch.Tensor) else None, "x": x})

    g0, x0 = g.clone(), x.clone()
    res = outcome(
        lambda: lk.pack(g, x, wire_dtype=wire_dtype, delta_out=delta_out, snapshot_out=snap, backend=backend),
        v,
        [g, x, delta_out, snap],
    )
    if res is None:
        return
    delta, snapshot, nonfinite = res[1]
    ref_delta, _, ref_nf = lk.pack_ref(g0, x0, wire_dtype=eff_wire)
    if eff_wire == torch.bfloat16:  # one round-to-nearest-even: bit-exact, NaNs as the backend claims
        assert_bf16_wire(delta, ref_delta, backend)
    else:
        close_enough(delta.reshape(-1), ref_delta.reshape(-1), eff_wire, scale=4.0)
    assert int(nonfinite) == int(ref_nf)
    if snap is False:
        assert snapshot is None
    else:
        assert torch.equal(bits(snapshot), bits(x0))
    assert torch.equal(bits(g), bits(g0)) and torch.equal(bits(x), bits(x0)), "inputs are read-only"


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t's values in order (NaN-safe equality). clone(contiguous_format), not
    .contiguous(): an empty stride-2 view counts as contiguous yet cannot be viewed as bytes."""
    return t.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


# ---- outer_merge_ -------------------------------------------------------------------------------

NAMES = ("g", "u", "delta_avg", "x", "x_sent")


@pytest.mark.op("outer_merge_")
@SETTINGS
@given(
    n=sizes,
    seed=seeds,
    dtype=any_dtype,
    avg_kind=st.sampled_from(["same"] * 4 + ["bf16", "other", "f16"]),
    strided=st.sampled_from([None] * 8 + list(NAMES)),
    wrong_numel=st.sampled_from([None] * 8 + list(NAMES[1:])),
    wrong_dtype=st.sampled_from([None] * 8 + ["u", "x", "x_sent"]),
    alias=st.sampled_from(
        [None] * 8 + [("g", "u"), ("x", "g"), ("delta_avg", "x"), ("x_sent", "x"), ("u", "x_sent")]
    ),
    has_sent=st.sampled_from([True, True, True, False]),
    lr=scalar(0.0, 2.0, bad=(-0.1,)),
    momentum=scalar(0.0, 0.99, bad=(1.0, -0.1)),
    alpha=scalar(0.0, 1.0, bad=(1.01, -0.01)),
    beta=scalar(0.0, 2.0, bad=(-1.0,)),
    lam=scalar(0.0, 2.0, bad=(-0.5,)),
    nesterov=st.sampled_from([True, False, True, False, 1]),
    lam_mode=st.sampled_from(["absolute", "normalized", "absolute", "normalized", "taylor"]),
    clean=st.booleans(),
)
def test_outer_merge(
    backend,
    n,
    seed,
    dtype,
    avg_kind,
    strided,
    wrong_numel,
    wrong_dtype,
    alias,
    has_sent,
    lr,
    momentum,
    alpha,
    beta,
    lam,
    nesterov,
    lam_mode,
    clean,
):
    dtype = cleaned(clean, dtype, torch.float32, lambda d: d not in FLOATS)
    avg_kind = cleaned(clean, avg_kind, "bf16", lambda k: k not in ("same", "bf16"))
    strided, wrong_numel, wrong_dtype, alias = (
        cleaned(clean, x, None) for x in (strided, wrong_numel, wrong_dtype, alias)
    )
    has_sent = cleaned(clean, has_sent, True)
    lr = cleaned(clean, lr, 0.7, lambda s: bool(scalar_violations("lr", s, 0.0)))
    momentum = cleaned(
        clean, momentum, 0.9, lambda s: bool(scalar_violations("m", s, 0.0, 1.0, hi_open=True))
    )
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
        t[name] = data(
            seed + i,
            size,
            dt,
            "strided" if name == strided else "contiguous",
            scale=1.0 if name in ("g", "x", "x_sent") else 0.1,
        )
    if alias is not None:
        t[alias[0]] = t[alias[1]]
    if not has_sent:
        t["x_sent"] = None
    g = t["g"]
    v = (
        tensor_violations("g", g, FLOATS)
        + tensor_violations("u", t["u"], FLOATS)
        + tensor_violations("x", t["x"], FLOATS)
    )
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

ints = st.one_of(st.integers(0, 2**63), st.integers(-3, -1), st.sampled_from([1.0, True, "3", None]))


@pytest.mark.op("mask_indices")
@SETTINGS
@given(
    seed=ints,
    rnd=ints,
    n=st.one_of(st.integers(0, 3000), st.sampled_from([-1, 2**62 + 1, 2**40, 7.0])),
    k_off=st.integers(-3, 3),
    k_frac=st.floats(0, 1),
    clean=st.booleans(),
)
def test_mask_indices(backend, seed, rnd, n, k_off, k_frac, clean):
    def bad_int(v):
        return isinstance(v, bool) or not isinstance(v, int) or v < 0

    seed, rnd = cleaned(clean, seed, 12345, bad_int), cleaned(clean, rnd, 7, bad_int)
    n = cleaned(clean, n, 1000, lambda v: bad_int(v) or v > 3000)
    k_off = cleaned(clean, k_off, 0, lambda v: v < 0 or v > 0)
    k = (
        (int(k_frac * n) + k_off)
        if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= 3000
        else k_off
    )
    v = []
    for name, val in (("seed", seed), ("round", rnd), ("n", n), ("k", k)):
        if isinstance(val, bool) or not isinstance(val, int):
            v.append((name, TypeError))
        elif val < 0 or (name in ("seed", "round") and val >= 2**63):  # seed and round are int64
            v.append((name, ValueError))
    if isinstance(n, int) and not isinstance(n, bool) and n > 2**62:
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
