"""Property-based tests of the indexed ops (sparse gather, sparse scatter-merge, fragment norms):
random sizes, dtypes, strides, index sets and offsets, valid and invalid. Each call matches the ref
or raises the documented error with nothing written; never another exception (see _contract.py and
test_properties.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lowcomm_kernels.ops as lk

from ._contract import (
    DATA,
    FLOATS,
    PARAMS,
    SETTINGS,
    alias_violations,
    cleaned,
    close_enough,
    contiguous_layout,
    data,
    outcome,
    scalar,
    scalar_violations,
    tensor_violations,
)

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


IDX_KINDS = st.sampled_from(
    ["sorted"] * 6 + ["unsorted", "dup", "range", "neg", "int32", "strided", "2d", "float"]
)


@pytest.mark.op("sparse_gather")
@SETTINGS
@given(
    **DATA,
    k=st.integers(0, 80),
    kind=IDX_KINDS,
    out_kind=st.sampled_from(["none", "none", "ok", "dtype", "numel", "strided", "alias_x"]),
    clean=st.booleans(),
)
def test_sparse_gather(backend, n, k, seed, dtype, layout, kind, out_kind, clean):
    dtype = cleaned(clean, dtype, torch.float32, lambda d: d not in PARAMS)
    layout = cleaned(clean, layout, "contiguous", lambda v: not contiguous_layout(v))
    kind = cleaned(clean, kind, "dup", lambda k: k not in ("sorted", "unsorted", "dup"))
    out_kind = cleaned(clean, out_kind, "ok", lambda k: k not in ("none", "ok"))
    x = data(seed, n, dtype, layout)
    idx = index_tensor(seed + 1, n, k, kind)
    kk = idx.numel()
    out = {
        "none": None,
        "ok": lambda: torch.full((kk,), 7.0, dtype=x.dtype),
        "dtype": lambda: torch.full((kk,), 7.0, dtype=torch.bfloat16),
        "numel": lambda: torch.full((kk + 1,), 7.0, dtype=x.dtype),
        "strided": lambda: torch.zeros(2 * kk, dtype=x.dtype)[::2],
        "alias_x": lambda: x.reshape(-1)[:kk] if x.is_contiguous() else x,
    }[out_kind]
    out = out() if callable(out) else out
    v = tensor_violations("x", x, PARAMS) + index_violations(idx, x.numel(), False)
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
@given(
    **DATA,
    k=st.integers(0, 80),
    kind=IDX_KINDS,
    avg_kind=st.sampled_from(["same"] * 5 + ["bf16", "f16", "numel", "strided", "alias_x", "alias_sent"]),
    sent_kind=st.sampled_from(["same"] * 6 + ["bf16", "numel", "strided"]),
    beta=scalar(0.0, 2.0, bad=(-1.0,)),
    clean=st.booleans(),
)
def test_sparse_scatter_merge(backend, n, k, seed, dtype, layout, kind, avg_kind, sent_kind, beta, clean):
    dtype = cleaned(clean, dtype, torch.float64, lambda d: d not in PARAMS)
    layout, kind, sent_kind = (
        cleaned(clean, layout, "contiguous", lambda v: not contiguous_layout(v)),
        cleaned(clean, kind, "sorted"),
        cleaned(clean, sent_kind, "same"),
    )
    avg_kind = cleaned(clean, avg_kind, "bf16", lambda k: k not in ("same", "bf16"))
    beta = cleaned(clean, beta, 1.0, lambda s: bool(scalar_violations("b", s, 0.0)))
    x = data(seed, n, dtype, layout)
    idx = index_tensor(seed + 1, n, k, kind)
    kk = idx.numel()
    base_dt = dtype if dtype in FLOATS else torch.float32
    sent = {
        "same": lambda: data(seed + 2, kk, base_dt),
        "bf16": lambda: data(seed + 2, kk, torch.bfloat16),
        "numel": lambda: data(seed + 2, kk + 1, base_dt),
        "strided": lambda: data(seed + 2, kk, base_dt, "strided"),
    }[sent_kind]()
    avg = {
        "same": lambda: data(seed + 3, kk, base_dt),
        "bf16": lambda: data(seed + 3, kk, torch.bfloat16),
        "f16": lambda: data(seed + 3, kk, torch.float16),
        "numel": lambda: data(seed + 3, kk + 1, base_dt),
        "strided": lambda: data(seed + 3, kk, base_dt, "strided"),
        "alias_x": lambda: x.reshape(-1)[:kk] if x.is_contiguous() else x,
        "alias_sent": lambda: sent,
    }[avg_kind]()
    v = tensor_violations("x", x, PARAMS) + index_violations(idx, x.numel(), True)
    master = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype  # x's outer state
    v += tensor_violations("avg", avg, (master, torch.bfloat16)) + tensor_violations(
        "sent", sent, (master,)
    )
    for name, t in (("avg", avg), ("sent", sent)):
        if t.numel() != idx.numel():
            v.append((name, ValueError))
    v += scalar_violations("beta", beta, 0.0)
    v += alias_violations({"x": x, "avg": avg, "sent": sent})
    ref = x.clone()
    res = outcome(
        lambda: lk.sparse_scatter_merge_(x, idx, avg, sent, beta=beta, backend=backend),
        v,
        [x, idx, avg, sent],
    )
    if res is not None:
        lk.sparse_scatter_merge_ref(ref, idx, avg, sent, beta=float(beta))
        close_enough(x, ref, dtype, scale=4.0)


# ---- fragment_norms -----------------------------------------------------------------------------


@pytest.mark.op("fragment_norms")
@SETTINGS
@given(
    **DATA,
    cuts=st.lists(st.integers(-2, 310), max_size=12),
    sort=st.sampled_from([True] * 4 + [False]),
    off_dtype=st.sampled_from([torch.int64] * 6 + [torch.int32, torch.float64]),
    off_2d=st.sampled_from([False] * 8 + [True]),
    ord=st.sampled_from([1, 2, 1, 2, 0, 3, True, "2", -1, 2.0, 1.0]),
    clean=st.booleans(),
)
def test_fragment_norms(backend, n, seed, dtype, layout, cuts, sort, off_dtype, off_2d, ord, clean):
    dtype = cleaned(clean, dtype, torch.float32, lambda d: d not in PARAMS)
    layout, sort, off_dtype, off_2d = (
        cleaned(clean, layout, "contiguous", lambda v: not contiguous_layout(v)),
        cleaned(clean, sort, True),
        cleaned(clean, off_dtype, torch.int64),
        cleaned(clean, off_2d, False),
    )
    ord = cleaned(clean, ord, 1, lambda o: o not in (1, 2) or not isinstance(o, int) or isinstance(o, bool))
    if clean:  # boundaries inside [0, n], at least one
        cuts = [min(max(c, 0), n) for c in cuts] or [0]
    buf = data(seed, n, dtype, layout)
    offs = torch.tensor(sorted(cuts) if sort else cuts, dtype=torch.int64).to(off_dtype)
    if off_2d:
        offs = offs.view(1, -1)
    v = tensor_violations("buf", buf, PARAMS) + tensor_violations("offsets", offs, (torch.int64,), dim=1)
    if isinstance(ord, bool) or not isinstance(ord, int):
        v.append(("ord", TypeError))
    elif ord not in (1, 2):
        v.append(("ord", ValueError))
    if offs.numel() == 0:
        v.append(("offsets", ValueError))
    elif not v:
        o = offs.tolist()
        if any(b < a for a, b in zip(o, o[1:], strict=False)) or min(o) < 0 or max(o) > buf.numel():
            v.append(("offsets", ValueError))
    res = outcome(lambda: lk.fragment_norms(buf, offs, ord=ord, backend=backend), v, [buf, offs])
    if res is None:
        return
    out = res[1]
    ref = lk.fragment_norms_ref(buf, offs, ord=ord)
    assert out.shape == (offs.numel() - 1,) and out.dtype == dtype
    rtol = torch.finfo(dtype).eps + 8 * math.sqrt(max(n, 1)) * 2.3e-16
    torch.testing.assert_close(out, ref, rtol=rtol, atol=0.0)
