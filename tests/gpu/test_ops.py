"""Every fused op on every backend against its ``*_ref`` specification in float64, on the GPU.

The CPU suite checks the ops on CPU tensors (tests/ops); these are its GPU counterpart, shaped like
the runtime's use of the ops, so that what passes here is what the runtime runs:

* every op x backend x dtype: fp32, fp64, and for the ops with a wire dtype (pack's delta,
  outer_merge_'s delta_avg, the scatter's avg) bf16 with fp32 data and bf16 with fp64 data;
* sizes 4097, 1000003, 7, 1, 0 (odd: tails, single-element programs, empty calls; 1000003 not in a
  CPU run);
* every buffer (inputs and preallocated outputs) a slice of a larger flat allocation starting at
  element offset 0, 1, 3 or 5, as the runtime's fragments are: 1, 3 and 5 are not 16-byte aligned;
  guard elements around each slice must be untouched afterwards (no overrun);
* on a non-default stream: the inputs are written on that stream after a ``torch.cuda._sleep`` and
  the outputs read back on it, with NaN poison in the buffers before, so an op that launches on
  another stream than the current one reads poison or is overwritten: a wrong result (each checked
  call is preceded by a warm-up call, so a JIT compile cannot hide the race);
* the checks: pack's delta bit-identical to ``pack_ref`` in the same dtype (one rounding of g - x),
  except fp64 data on a bf16 wire, which must be within half a bf16 ulp of the exact difference
  (torch rounds fp64 -> fp32 -> bf16, twice; differences from torch's bits are noted); NaN
  positions compared as NaN-ness, and the bf16 NaN bit patterns written noted beside torch's;
  non-finite counts exact (a NaN, an inf and inf - inf are planted); outer_merge_ (five merge modes),
  the scatter-merge and the norms against the float64 ref with the tolerances of tests/conftest.py
  (``tolerance``: elementwise 8 eps; reductions eps + 8 sqrt(n) eps64); gather and mask_indices exact;
* edge checks, one test per op and backend (skipped with the reason where they cannot run):
  pack (fp32/bf16 wire) and outer_merge_ on 2^31 + 7 elements (int64 indexing; ~44 GB of device
  memory; checked on ~370 sampled positions, the last 64 and the non-finite count); every op once
  with its tensors on cuda:1 while cuda:0 is current (results, current device, memory and kernels
  on cuda:0 untouched); pack to bf16 where g - x overflows bf16 only, or is ±inf/NaN: the bits of
  torch's conversion on the device, and the non-finite count of the values *written* (as documented);
  bf16 / fp16 parameters beside their float32 master (``check_low_precision``: pack bit-identical,
  every merge mode and the scatter-merge within one ulp of x's dtype of the CPU spec, offsets 0/1);
* the quantized wire formats (``check_quantized``, fp32 and fp64 data, a format and block per case
  in rotation over the five formats and blocks 2 / 128 / 4096): pack with error feedback,
  snapshot and stochastic rounding (an inf planted) and dequantize bit-identical to the
  ``*_ref``, reduce_quantized over two rows bit-identical, and outer_merge_ / sparse_scatter_merge_
  with a Quantized average bit-identical to the same backend's dense merge on the dequantized one.

The registered ops (opcheck, compile) on the device: tests/gpu/test_registered_ops.py. Inputs come
from the ``rng`` fixture (a fresh seed per test, printed on failure: ``--seed N`` reruns it).
"""

from __future__ import annotations

import itertools
import traceback
from collections.abc import Callable

import pytest
import torch

from lowcomm_kernels import ops as lk
from tests.conftest import tolerance
from tests.gpu import _env

pytestmark = pytest.mark.gpu

# Triton specializes a kernel on each integer being 1 or a multiple of 16 and each pointer being
# 16-byte aligned: 4097, 1000003 and 7 share one compiled kernel per dtype and alignment, so they
# come first and a JIT-heavy run that meets --budget-s loses only the n = 1 and n = 0 cases.
SIZES = (4097, 1000003, 7, 1, 0) if _env.ON_GPU else (4097, 7, 1, 0)  # the CPU: a dry run's time
OFFSETS = (0, 3, 1, 5)
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
DTYPES = ((F32, F32, "fp32"), (F32, BF16, "fp32/bf16"), (F64, F64, "fp64"), (F64, BF16, "fp64/bf16"))
GUARD, GUARD_VALUE = 16, -77.0  # exact in every dtype used
SLEEP_CYCLES = 2_000_000  # ~1 ms: far longer than the host needs to launch the op after it
MERGES = {  # name -> outer_merge_ keywords
    "overwrite": dict(lr=0.7, momentum=0.0, nesterov=False),
    "mix+nesterov": dict(lr=0.7, momentum=0.9, nesterov=True, alpha=0.3),
    "delay-corrected": dict(lr=0.7, momentum=0.9, nesterov=False, beta=1.0),
    "taylor": dict(lr=0.7, momentum=0.9, nesterov=True, alpha=0.2, beta=1.0, lam=0.5),
    "taylor-normalized": dict(lr=0.7, momentum=0.9, nesterov=True, beta=1.0, lam=0.5, lam_mode="normalized"),
}


class CheckFailed(AssertionError):
    pass


def elementwise_close(name: str, actual: torch.Tensor, expected64: torch.Tensor) -> None:
    """Within tests/conftest.py's elementwise tolerance in actual's dtype."""
    rtol, atol = tolerance("elementwise", actual.dtype)
    try:
        torch.testing.assert_close(
            actual.cpu(), expected64.to(actual.dtype).cpu(), rtol=rtol, atol=atol, equal_nan=True
        )
    except AssertionError as exc:
        raise CheckFailed(f"{name}: {' '.join(str(exc).split()[:45])}") from None


def reduction_close(name: str, actual: torch.Tensor, expected64: torch.Tensor, n: int) -> None:
    """Within tests/conftest.py's tolerance of a reduction of n terms."""
    rtol, atol = tolerance("reduction", actual.dtype, n)
    try:
        torch.testing.assert_close(actual.cpu(), expected64.to(actual.dtype).cpu(), rtol=rtol, atol=atol)
    except AssertionError as exc:
        raise CheckFailed(f"{name}: {' '.join(str(exc).split()[:40])}") from None


def identical(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and values; NaN matches NaN whatever its bits (see nan_bits)."""
    a, e = actual.cpu(), expected.cpu()
    if a.dtype != e.dtype or a.shape != e.shape:
        raise CheckFailed(f"{name}: dtype/shape {a.dtype}{tuple(a.shape)} != {e.dtype}{tuple(e.shape)}")
    same = (a == e) | (a.isnan() & e.isnan()) if a.is_floating_point() else (a == e)
    if not bool(same.all()):
        bad = int((~same).reshape(-1).nonzero()[0])
        raise CheckFailed(
            f"{name}: {int((~same).sum())} of {a.numel()} differ, first at {bad}: "
            f"{a.reshape(-1)[bad].item()!r} != {e.reshape(-1)[bad].item()!r}"
        )


def nan_bits(t: torch.Tensor) -> str:
    """The distinct bit patterns of t's NaNs, e.g. '0x7fc0' (bf16)."""
    bits = t.cpu().view(torch.int16)[t.cpu().isnan()].tolist()
    return ",".join(sorted({f"{b & 0xFFFF:#06x}" for b in bits})) or "none"


class Ctx:
    """Where and how one case runs: device, element offset of every buffer, the side stream."""

    def __init__(self, dev: torch.device, offset: int, notes: dict[str, list[str]]) -> None:
        self.dev, self.offset, self.notes = dev, offset, notes
        self.side = torch.cuda.Stream(dev) if dev.type == "cuda" else None


class Staged:
    """Device buffers for one call, each a guarded slice at ``ctx.offset`` of a larger allocation,
    loaded from a CPU master (outputs: a zero master) by ``run``."""

    def __init__(self, ctx: Ctx, **masters: torch.Tensor) -> None:
        self.ctx, self.views, self._parts = ctx, {}, []
        for name, m in masters.items():
            off, n = ctx.offset, m.numel()
            base = torch.full((off + n + GUARD,), GUARD_VALUE, dtype=m.dtype, device=ctx.dev)
            self.views[name] = base[off : off + n]
            self._parts.append((name, base, self.views[name], m.to(ctx.dev, copy=True), off, n))

    def _load(self) -> None:
        for _, _, view, src, _, _ in self._parts:
            view.copy_(src)

    def run(self, fn: Callable[[dict], dict]) -> dict[str, torch.Tensor]:
        """fn(views) -> named outputs; returns them on the CPU. On a GPU: a warm-up call, NaN (0 for
        integers) poison, then sleep + load + call + copy-out all on the side stream."""
        side = self.ctx.side
        if side is None:
            self._load()
            return {k: v.cpu() for k, v in fn(self.views).items()}
        self._load()
        fn(self.views)
        for _, _, view, _, _, _ in self._parts:
            view.fill_(float("nan") if view.is_floating_point() else 0)
        torch.cuda.synchronize(self.ctx.dev)
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            self._load()
            kept = {k: v.clone() for k, v in fn(self.views).items()}
        side.synchronize()
        return {k: v.cpu() for k, v in kept.items()}

    def guards(self) -> None:
        for name, base, _, _, off, n in self._parts:
            outside = torch.cat([base[:off], base[off + n :]]).cpu()
            if not bool((outside == GUARD_VALUE).all()):
                raise CheckFailed(f"{name}: an element outside the slice was written (overrun)")


def note(ctx: Ctx, key: str, text: str) -> None:
    seen = ctx.notes.setdefault(key, [])
    if text not in seen:
        seen.append(text)


def rand(n: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.rand(n, dtype=F64, generator=gen) * 2 - 1).mul_(scale).to(dtype)


# ------------------------------------------------------------------------------------- checks
# Each takes the backends and returns {backend: None (pass) or failure text}; the float64 ref is
# computed once per case and shared by the backends.
def per_backend(backends: list[str], one: Callable[[str], None]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for b in backends:
        try:
            one(b)
            out[b] = None
        except CheckFailed as exc:
            out[b] = str(exc)
        except Exception as exc:  # a crash is a failure too, with where it happened
            where = traceback.format_exc().splitlines()[-3].strip()
            out[b] = f"{type(exc).__name__}: {exc} @ {where}"
    return out


def check_pack(ctx: Ctx, n: int, dt, wire, backends, gen) -> dict[str, str | None]:
    g, x = rand(n, dt, gen), rand(n, dt, gen)
    if n >= 3:  # NaN - x, g - inf and inf - inf: the count must see all three
        g[0], x[n - 1], g[1], x[1] = float("nan"), float("inf"), float("inf"), float("inf")
    d_ref, _, nf_ref = lk.pack_ref(g, x, wire_dtype=wire)
    exact = g.double() - x.double()

    def one(b: str) -> None:
        st = Staged(ctx, g=g, x=x, delta=torch.zeros(n, dtype=wire), snap=torch.zeros(n, dtype=dt))
        out = st.run(
            lambda v: dict(
                zip(
                    ("delta", "snap", "nf"),
                    lk.pack(
                        v["g"],
                        v["x"],
                        wire_dtype=wire,
                        delta_out=v["delta"],
                        snapshot_out=v["snap"],
                        backend=b,
                    ),
                    strict=True,
                )
            )
        )
        st.guards()
        if dt is F64 and wire is BF16:  # one rounding of the exact difference, torch rounds twice
            d = out["delta"]
            identical("delta NaN/inf positions", d.isfinite(), d_ref.isfinite())
            fin = exact.isfinite()
            err = (d.double() - exact).abs()[fin]
            half_ulp = exact.abs()[fin] * 2.0**-8
            if bool((err > half_ulp).any()):
                raise CheckFailed(
                    f"delta (fp64 -> bf16): {int((err > half_ulp).sum())} values are not "
                    "within half a bf16 ulp of g - x"
                )
            differ = int(((d.view(torch.int16) != d_ref.view(torch.int16)) & fin).sum())
            if differ:
                note(ctx, f"{b} pack fp64->bf16", f"{differ} values differ from torch's double rounding")
        else:
            identical("delta", out["delta"], d_ref)
        identical("snapshot", out["snap"], x)
        identical("nonfinite", out["nf"], nf_ref)
        if wire is BF16 and n >= 3:
            note(
                ctx,
                f"{b} pack {str(dt)[6:]}->bf16 NaN bits",
                f"written {nan_bits(out['delta'])}, torch {nan_bits(d_ref)}",
            )
        st2 = Staged(ctx, g=g, x=x)  # op-allocated (aligned) delta, no snapshot
        out2 = st2.run(
            lambda v: {"delta": lk.pack(v["g"], v["x"], wire_dtype=wire, snapshot_out=False, backend=b)[0]}
        )
        identical("delta (op-allocated, no snapshot)", out2["delta"], out["delta"])

    return per_backend(backends, one)


def check_outer_merge(ctx: Ctx, n: int, dt, avg, backends, gen) -> dict[str, str | None]:
    cases = []
    for mode, kw in MERGES.items():
        g, u, d = rand(n, dt, gen), rand(n, dt, gen, 0.1), rand(n, dt, gen, 0.1).to(avg)
        x_sent = g + rand(n, dt, gen, 0.05)
        x = x_sent + rand(n, dt, gen, 0.05)
        ref = [t.to(F64, copy=True) for t in (g, u, d, x, x_sent)]
        lk.outer_merge_ref(*ref, **kw)
        cases.append((mode, kw, (g, u, d, x, x_sent), ref))

    def one(b: str) -> None:
        for mode, kw, (g, u, d, x, xs), ref in cases:
            st = Staged(ctx, g=g, u=u, d=d, x=x, xs=xs)

            def call(v, kw=kw):
                lk.outer_merge_(v["g"], v["u"], v["d"], v["x"], v["xs"], backend=b, **kw)
                return {k: v[k] for k in "gux"}

            out = st.run(call)
            st.guards()
            for name, want in zip("gux", (ref[0], ref[1], ref[3]), strict=True):
                elementwise_close(f"{mode}: {name}", out[name], want)

    return per_backend(backends, one)


def check_sparse(ctx: Ctx, n: int, dt, avg, backends, gen) -> dict[str, str | None]:
    if n == 0:
        return {b: None for b in backends}  # no index exists in [0, 0)
    k = max(1, n // 10)
    idx = lk.mask_indices_ref(5, 3, n, k, device="cpu")
    dup = torch.cat([idx, idx[:3]])  # gather allows duplicates
    x = rand(n, dt, gen)
    merges = []
    for beta in (0.0, 1.0, 0.5):
        a, sent = rand(k, dt, gen, 0.1).to(avg), rand(k, dt, gen, 0.1)
        x_ref = x.to(F64, copy=True)
        lk.sparse_scatter_merge_ref(x_ref, idx, a.double(), sent.double(), beta=beta)
        merges.append((beta, a, sent, x_ref))

    def one(b: str) -> None:
        st = Staged(ctx, x=x, idx=idx, dup=dup, out=torch.zeros(k, dtype=dt))
        got = st.run(
            lambda v: {
                "out": lk.sparse_gather(v["x"], v["idx"], out=v["out"], backend=b),
                "dup": lk.sparse_gather(v["x"], v["dup"], backend=b),
            }
        )
        st.guards()
        identical("gather", got["out"], lk.sparse_gather_ref(x, idx))
        identical("gather (duplicates)", got["dup"], lk.sparse_gather_ref(x, dup))
        for beta, a, sent, x_ref in merges:
            st = Staged(ctx, x=x, idx=idx, a=a, sent=sent)
            got = st.run(
                lambda v, beta=beta: (
                    lk.sparse_scatter_merge_(v["x"], v["idx"], v["a"], v["sent"], beta=beta, backend=b),
                    {"x": v["x"]},
                )[1]
            )
            st.guards()
            elementwise_close(f"scatter_merge beta={beta}", got["x"], x_ref)

    return per_backend(backends, one)


def check_norms(ctx: Ctx, n: int, dt, _wire, backends, gen) -> dict[str, str | None]:
    buf = rand(n, dt, gen)
    cuts = sorted(torch.randint(0, n + 1, (6,), generator=gen).tolist())
    offsets = torch.tensor([0, 0, *cuts, n, n], dtype=torch.int64)  # empty first/last segments
    refs = {o: lk.fragment_norms_ref(buf.double(), offsets, ord=o) for o in (1, 2)}

    def one(b: str) -> None:
        st = Staged(ctx, buf=buf, offsets=offsets)
        got = st.run(
            lambda v: {
                f"{o}{r}": lk.fragment_norms(v["buf"], v["offsets"], ord=o, backend=b)
                for o in (1, 2)
                for r in "ab"
            }
        )
        st.guards()
        for o in (1, 2):
            reduction_close(f"ord={o}", got[f"{o}a"], refs[o], n)
            identical(f"ord={o} repeat", got[f"{o}b"], got[f"{o}a"])

    return per_backend(backends, one)


QFMTS = tuple(lk.FORMATS)
QBLOCKS = (2, 128, 4096)


def check_quantized(ctx: Ctx, n: int, dt, _wire, backends, gen) -> dict[str, str | None]:
    if n == 0:
        return {b: None for b in backends}
    turn = n + ctx.offset + (dt is F64)
    fmt, block = QFMTS[turn % len(QFMTS)], QBLOCKS[turn % len(QBLOCKS)]
    g, x, res = rand(n, dt, gen), rand(n, dt, gen), rand(n, dt, gen, 0.01)
    if n >= 3:
        g[n // 2] = float("inf")  # a non-finite block: NaN scale, zero codes, its residual kept
    want_res = res.clone()
    rc, rs, _, rnf = lk.pack_quantized_ref(g, x, fmt, block, residual=want_res, seed=5, round=2)
    want_deq = lk.dequantize_ref(rc, rs, fmt, block, n, out_dtype=dt)
    rows_c, rows_s = torch.stack([rc, rc.flip(0)]), torch.stack([rs, rs.flip(0)])
    want_rc, want_rs = lk.reduce_quantized_ref(rows_c, rows_s, fmt, block, n, scale=0.5)
    u, xs = rand(n, dt, gen, 0.1), x + rand(n, dt, gen, 0.05)
    kw = MERGES[list(MERGES)[turn % len(MERGES)]]

    def one(b: str) -> None:
        st = Staged(ctx, g=g, x=x, res=res, snap=torch.zeros(n, dtype=dt), out=torch.zeros(n, dtype=dt))

        def call(v):
            c, s, _, nf = lk.pack_quantized(
                v["g"],
                v["x"],
                fmt,
                block,
                residual=v["res"],
                snapshot_out=v["snap"],
                seed=5,
                round=2,
                backend=b,
            )
            lk.dequantize(c, s, fmt, block, n, out=v["out"], backend=b)
            return dict(
                codes=c, scales=s, nonfinite=nf, residual=v["res"], snapshot=v["snap"], dequantize=v["out"]
            )

        out = st.run(call)
        st.guards()
        for name, want in (
            ("codes", rc),
            ("scales", rs),
            ("nonfinite", rnf),
            ("residual", want_res),
            ("snapshot", x),
            ("dequantize", want_deq),
        ):
            identical(f"{fmt} block {block}: {name}", out[name], want)
        red = lk.reduce_quantized(rows_c.to(ctx.dev), rows_s.to(ctx.dev), fmt, block, n, scale=0.5, backend=b)
        identical(f"{fmt} reduce: codes", red[0], want_rc)
        identical(f"{fmt} reduce: scales", red[1], want_rs)
        q = lk.Quantized(rc.to(ctx.dev), rs.to(ctx.dev), fmt, block)
        st2 = Staged(ctx, g=g, u=u, x=x, xs=xs, g2=g, u2=u, x2=x, d=want_deq)

        def merges(v):
            lk.outer_merge_(v["g"], v["u"], q, v["x"], v["xs"], backend=b, **kw)
            lk.outer_merge_(v["g2"], v["u2"], v["d"], v["x2"], v["xs"], backend=b, **kw)
            return {k: v[k] for k in ("g", "u", "x", "g2", "u2", "x2")}

        got = st2.run(merges)
        st2.guards()
        for name in "gux":
            identical(f"{fmt} outer_merge_ with a Quantized average: {name}", got[name], got[name + "2"])
        k = n // 3
        if k:
            idx = torch.arange(0, 3 * k, 3, dtype=torch.int64)
            kc, ks = rc[: lk.FORMATS[fmt].payload_bytes(k)], rs[: -(-k // block)]  # the first k values
            qk = lk.Quantized(kc.to(ctx.dev), ks.to(ctx.dev), fmt, block)
            st3 = Staged(ctx, x=x, x2=x, idx=idx, sent=xs[:k], avg=want_deq[:k])

            def scatter(v):
                lk.sparse_scatter_merge_(v["x"], v["idx"], qk, v["sent"], beta=0.5, backend=b)
                lk.sparse_scatter_merge_(v["x2"], v["idx"], v["avg"], v["sent"], beta=0.5, backend=b)
                return {"x": v["x"], "x2": v["x2"]}

            got = st3.run(scatter)
            identical(f"{fmt} sparse_scatter_merge_ with a Quantized average", got["x"], got["x2"])

    return per_backend(backends, one)


def check_mask(ctx: Ctx, n: int, _dt, _wire, backends, _gen) -> dict[str, str | None]:
    cases = [(k, s, r) for k in sorted({0, min(n, 1), n // 3, n // 100, n}) for s, r in ((0, 0), (1234, 7))]
    refs = {c: lk.mask_indices_ref(c[1], c[2], n, c[0], device="cpu") for c in cases}

    def one(b: str) -> None:
        got = Staged(ctx).run(
            lambda v: {str(c): lk.mask_indices(c[1], c[2], n, c[0], device=ctx.dev, backend=b) for c in cases}
        )
        for c in cases:
            identical(f"k={c[0]} seed={c[1]} round={c[2]}", got[str(c)], refs[c])

    return per_backend(backends, one)


# ---------------------------------------------------------------- edge checks (one test each)
BIG_N = 2**31 + 7  # int64 indexing: offsets past 2^31 overflow an int32 index


def check_big(dev: torch.device, backends, gen, op: str) -> dict[str, str | None]:
    """pack (fp32 data; fp32 and bf16 wire) or outer_merge_ (taylor) on 2^31 + 7 elements, checked on
    sampled positions, the 64 last, and the non-finite count (NaN, +inf, -inf planted past 2^31)."""
    n = BIG_N
    pos = (
        torch.cat(
            [
                torch.randint(0, n, (300,), generator=gen),
                torch.arange(n - 64, n),
                torch.tensor([2**31 - 1, 2**31]),
            ]
        )
        .unique()
        .to(dev)
    )
    plant = torch.tensor([5, 2**31 + 1, n - 1], device=dev)
    dgen = torch.Generator(dev).manual_seed(int(torch.randint(2**31, (1,), generator=gen)))

    def one(b: str) -> None:
        bufs = {k: torch.empty(n, dtype=F32, device=dev).uniform_(-1, 1, generator=dgen) for k in "gx"}
        try:
            g, x = bufs["g"], bufs["x"]
            if op == "pack":
                g[plant[0]], g[plant[1]], x[plant[2]] = float("nan"), float("inf"), float("inf")
                gs, xs = g[pos].cpu(), x[pos].cpu()
                for wire in (F32, BF16):
                    d, snap, nf = lk.pack(g, x, wire_dtype=wire, snapshot_out=wire is F32, backend=b)
                    want = lk.pack_ref(gs, xs, wire_dtype=wire)[0]
                    identical(f"{wire} delta (sampled)", d[pos].cpu(), want)
                    identical(f"{wire} nonfinite", nf.cpu(), torch.tensor(3))
                    if snap is not None:
                        identical("snapshot (sampled)", snap[pos].cpu(), xs)
                    del d, snap
            else:
                kw = MERGES["taylor"]
                u = torch.empty_like(g).uniform_(-0.1, 0.1, generator=dgen)
                d = torch.empty_like(g).uniform_(-0.1, 0.1, generator=dgen)
                x_sent = torch.empty_like(g).uniform_(-0.05, 0.05, generator=dgen).add_(g)
                x.uniform_(-0.05, 0.05, generator=dgen).add_(x_sent)
                ref = [t[pos].double().cpu() for t in (g, u, d, x, x_sent)]
                lk.outer_merge_ref(*ref, **kw)  # elementwise: the ref of a sample is the sample of the ref
                lk.outer_merge_(g, u, d, x, x_sent, backend=b, **kw)
                for name, t, want in (("g", g, ref[0]), ("u", u, ref[1]), ("x", x, ref[3])):
                    elementwise_close(f"{name} (sampled)", t[pos], want)
                del u, d, x_sent
        finally:
            del bufs
            torch.cuda.empty_cache()

    return per_backend(backends, one)


def check_second_device(backends, gen, notes) -> dict[str, str | None]:
    """Every op once (n = 4097, fp32, offset 1) with its tensors on cuda:1 while cuda:0 is current:
    right results, cuda:0 still current, no memory taken on cuda:0, every kernel on device 1."""
    from torch.profiler import ProfilerActivity, profile

    ctx = Ctx(torch.device("cuda", 1), 1, notes)
    ctx.side = None  # torch.cuda.stream(s) would make s's device current: on cuda:1's current stream
    checks = (check_pack, check_outer_merge, check_sparse, check_norms, check_mask)
    out: dict[str, str | None] = {}
    for b in backends:
        torch.cuda.set_device(0)
        before = torch.cuda.memory_allocated(0)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fails = [f"{c.__name__}: {f}" for c in checks if (f := c(ctx, 4097, F32, F32, [b], gen)[b])]
            torch.cuda.synchronize(1)
        if torch.cuda.current_device() != 0:
            fails.append(f"the current device became {torch.cuda.current_device()}")
        if torch.cuda.memory_allocated(0) != before:
            fails.append(f"{torch.cuda.memory_allocated(0) - before} bytes allocated on cuda:0")
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        wrong = sorted({f"{e.name[:40]}@{e.device_index}" for e in kernels if e.device_index != 1})
        if wrong:
            fails.append(f"kernels not on cuda:1: {', '.join(wrong[:5])}")
        note(
            ctx,
            f"{b} second device",
            f"{len(kernels)} CUDA kernels profiled, all on device 1"
            if kernels and not wrong
            else "the profiler saw no kernel"
            if not kernels
            else "see failure",
        )
        out[b] = "; ".join(fails) or None
    return out


def check_bf16_overflow(dev: torch.device, backends, notes) -> dict[str, str | None]:
    """pack to a bf16 wire where g - x is finite in the data's dtype but not in bf16, ±inf and NaN:
    bits as torch's own conversion on the device, and the count of non-finite values written."""
    half = (2 - 2**-8) * 2.0**127  # halfway between bf16's largest finite and 2^128: ties to inf
    below = (2 - 2**-8 - 2**-23) * 2.0**127  # the fp32 just below it: bf16's largest finite
    inf, nan = float("inf"), float("nan")
    pairs = [
        (1.7e38, -1.7e38),
        (-1.7e38, 1.7e38),
        (half, 0.0),
        (0.0, half),
        (below, 0.0),
        (-below, 0.0),
        (inf, 0.0),
        (0.0, inf),
        (inf, inf),
        (nan, 0.0),
        (1.0, 0.5),
        (3.0e38, 0.0),
    ]
    pairs64 = pairs + [(1e39, 0.0), (-1e39, 0.0), (5e38, -5e38), (1e300, -1e300), (half * (1 - 2**-40), 0.0)]
    out: dict[str, str | None] = {b: None for b in backends}
    for dt, ps in ((F32, pairs), (F64, pairs64)):
        # the interpreter's own bf16 cast is wrong, but pack's interpreter path rounds on the bits
        bs = [b for b in backends if not (dev.type == "cpu" and b == "triton" and dt is F64)]
        for b in set(backends) - set(bs):
            notes.setdefault(f"{b} pack bf16 overflow", []).append("float64 data: not run (interpreter)")
        for b, fail in _bf16_overflow(Ctx(dev, 1, notes), dt, ps, bs).items():
            out[b] = out[b] or fail
    return out


def check_low_precision(dev: torch.device, backends, gen, notes) -> dict[str, str | None]:
    """bf16 / fp16 parameters x beside their float32 master (docs/algorithms.md): pack (Δ = g − x in
    float32, one rounding to the wire; the snapshot is x widened, exactly), every merge mode and
    the sparse scatter-merge (computed in float32, x rounded once: within one ulp of x's dtype of the
    float64 spec, g and u as fp32 data), buffers at element offsets 0 and 1; values past fp16's
    range make the merged fp16 x ±inf as the spec does. The Triton interpreter's bf16 / fp16
    arithmetic is wrong (module docstring): not run there."""
    bs = [b for b in backends if not (dev.type == "cpu" and b == "triton")]
    why = "not run: the Triton interpreter's bf16 / fp16 arithmetic"
    out: dict[str, str | None] = {b: why for b in backends}
    cases = []
    sizes = (4097, 1000003) if dev.type == "cuda" else (4097,)  # the CPU (dry run) shares a time limit
    for xdt, wire, n, off in itertools.product((BF16, torch.float16), (F32, BF16), sizes, (0, 1)):
        x = rand(n, F32, gen).to(xdt)
        g = x.float() + rand(n, F32, gen, 0.01)
        if xdt is torch.float16:
            g[:4] = torch.tensor([65504.0, 65520.0, -7e4, 6e-8])  # max, tie to inf, beyond, subnormal
        u, d = rand(n, F32, gen, 0.01), rand(n, F32, gen, 0.01).to(wire)
        xs = x.float() + rand(n, F32, gen, 1e-3)
        cases.append((xdt, wire, n, off, g, u, d, x, xs))

    def one(b: str) -> None:
        for xdt, wire, n, off, g, u, d, x, xs in cases:
            ctx, tag = Ctx(dev, off, notes), f"x={str(xdt)[6:]} wire={str(wire)[6:]} n={n} offset={off}"
            d_ref, _, nf_ref = lk.pack_ref(g, x, wire_dtype=wire)
            st = Staged(ctx, g=g, x=x, delta=torch.zeros(n, dtype=wire), snap=torch.zeros(n, dtype=F32))
            got = st.run(
                lambda v: dict(
                    zip(
                        ("delta", "snap", "nf"),
                        lk.pack(v["g"], v["x"], delta_out=v["delta"], snapshot_out=v["snap"], backend=b),
                        strict=True,
                    )
                )
            )
            st.guards()
            identical(f"{tag}: delta", got["delta"], d_ref)
            identical(f"{tag}: snapshot", got["snap"], x.float())
            identical(f"{tag}: nonfinite", got["nf"], nf_ref)
            eps = torch.finfo(xdt).eps
            for mode, kw in MERGES.items():
                ref = [t.to(F64, copy=True) for t in (g, u, d, x, xs)]
                lk.outer_merge_ref(*ref, **kw)
                spec = [t.clone() for t in (g, u, d, x, xs)]  # the spec in its own dtypes (CPU)
                lk.outer_merge_ref(*spec, **kw)
                st = Staged(ctx, g=g, u=u, d=d, x=x, xs=xs)

                def call(v, kw=kw):
                    lk.outer_merge_(v["g"], v["u"], v["d"], v["x"], v["xs"], backend=b, **kw)
                    return {k: v[k] for k in "gux"}

                res = st.run(call)
                st.guards()
                elementwise_close(f"{tag} {mode}: g", res["g"], ref[0])
                elementwise_close(f"{tag} {mode}: u", res["u"], ref[1])
                try:  # one rounding to x's dtype of a float32 result: within one ulp of the spec's
                    torch.testing.assert_close(res["x"].double(), spec[3].double(), rtol=eps, atol=2.0**-24)
                except AssertionError as e:
                    raise CheckFailed(f"{tag} {mode}: x: {str(e)[:300]}") from None
            k = n // 3
            idx = torch.randperm(n, generator=gen)[:k].sort().values
            sent, avg = xs[idx].clone(), g[idx].to(wire)
            ref_x = x.clone()
            lk.sparse_scatter_merge_ref(ref_x, idx, avg, sent, beta=1.0)
            st = Staged(ctx, x=x, idx=idx, avg=avg, sent=sent)

            def scatter(v):
                lk.sparse_scatter_merge_(v["x"], v["idx"], v["avg"], v["sent"], beta=1.0, backend=b)
                return {"x": v["x"]}

            res = st.run(scatter)
            st.guards()
            try:
                torch.testing.assert_close(res["x"].double(), ref_x.double(), rtol=eps, atol=2.0**-24)
            except AssertionError as e:
                raise CheckFailed(f"{tag} scatter-merge: x: {str(e)[:300]}") from None

    for b, fail in per_backend(bs, one).items():
        out[b] = fail
    return out


def _bf16_overflow(ctx: Ctx, dt: torch.dtype, ps: list, backends) -> dict[str, str | None]:
    dev, name = ctx.dev, str(dt)[6:]
    g, x = (torch.tensor([p[i] for p in ps] * 3, dtype=dt) for i in (0, 1))
    want = (g.to(dev) - x.to(dev)).to(BF16).cpu()  # torch's conversion on the device
    written_nf = int((~want.isfinite()).sum())
    data_nf = int((~(g - x).isfinite()).sum())

    def one(b: str) -> None:
        st = Staged(ctx, g=g, x=x, delta=torch.zeros(g.numel(), dtype=BF16))
        got = st.run(
            lambda v: dict(
                zip(
                    ("delta", "nf"),
                    lk.pack(v["g"], v["x"], delta_out=v["delta"], snapshot_out=False, backend=b)[::2],
                    strict=True,
                )
            )
        )
        st.guards()
        bits, want_bits = (t.view(torch.int16).tolist() for t in (got["delta"], want))
        # the interpreter emulates a GPU's conversion (NaN -> 0x7FC0), not the CPU's: NaN-ness only there
        both_nan = (want.isnan() & got["delta"].isnan()).tolist()
        interp = (dev.type, b) == ("cpu", "triton")
        bad = [
            i
            for i, (a, e) in enumerate(zip(bits, want_bits, strict=True))
            if a != e and not (interp and both_nan[i])
        ]
        if bad:
            i = bad[0]
            raise CheckFailed(
                f"{name} data: {len(bad)} bf16 bit patterns differ from torch's, first "
                f"g={g[i].item()!r} x={x[i].item()!r}: {bits[i] & 0xFFFF:#06x} != "
                f"{want_bits[i] & 0xFFFF:#06x}"
            )
        identical(f"{name} data: nonfinite (non-finite values written)", got["nf"], torch.tensor(written_nf))
        note(
            ctx,
            f"{b} pack bf16 overflow",
            f"{name} data: counts {written_nf} non-finite written, "
            f"of which {written_nf - data_nf} finite before the bf16 rounding; NaN bits written "
            f"{nan_bits(got['delta'])}, torch {nan_bits(want)}",
        )

    return per_backend(backends, one)


# --------------------------------------------------------------------------------------- tests
def passed(out: dict[str, str | None], backend: str) -> None:
    """A check's verdict for one backend: None passes, "not run: why" skips, anything else fails."""
    fail = out[backend]
    if isinstance(fail, str) and fail.startswith("not run"):
        pytest.skip(fail)
    assert fail is None, fail


CHECKS = {
    "pack": check_pack,
    "outer_merge_": check_outer_merge,
    "sparse": check_sparse,
    "fragment_norms": check_norms,
    "quantized": check_quantized,
    "mask_indices": check_mask,
}


def _sweep():
    """(op, n, data dtype, wire dtype, offset) of every case of the sweep."""
    for n, (dt, low, label), off in itertools.product(SIZES, DTYPES, OFFSETS):
        ops = ["pack", "outer_merge_", "sparse"]
        ops += ["fragment_norms", "quantized"] if low is dt else []
        ops += ["mask_indices"] if (dt, low, off) == (F32, F32, 0) else []
        for op in ops:
            yield pytest.param(op, n, dt, low, off, id=f"{op}-n{n}-{label.replace('/', '-')}-offset{off}")


@pytest.mark.parametrize("backend", _env.BACKENDS)
@pytest.mark.parametrize(("op", "n", "dt", "wire", "offset"), list(_sweep()))
def test_op_matches_the_float64_ref(op, n, dt, wire, offset, backend, gpu_device, notes, rng):
    _env.require(backend)
    passed(CHECKS[op](Ctx(gpu_device, offset, notes), n, dt, wire, [backend], rng), backend)


@pytest.mark.parametrize("backend", _env.BACKENDS)
@pytest.mark.parametrize("op", ["pack", "outer_merge_"])
def test_past_2_31_elements(op, backend, gpu_device, rng):
    """int64 indexing: pack (fp32 and bf16 wire) and outer_merge_ (taylor) on 2^31 + 7 elements."""
    if gpu_device.type != "cuda":
        pytest.skip("needs a CUDA device")
    need = 5 * 4 * BIG_N / 1e9 + 1  # outer_merge_'s five fp32 buffers (pack: four) and a margin
    free = torch.cuda.mem_get_info(gpu_device)[0] / 1e9
    if free < need:
        pytest.skip(f"{free:.0f} GB free on the device, {need:.0f} GB needed")
    _env.require(backend)
    passed(check_big(gpu_device, [backend], rng, op), backend)


@pytest.mark.parametrize("backend", _env.BACKENDS)
def test_every_op_on_a_second_device(backend, gpu_device, rng, notes):
    if gpu_device.type != "cuda":
        pytest.skip("needs CUDA devices")
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU")
    _env.require(backend)
    passed(check_second_device([backend], rng, notes), backend)


@pytest.mark.parametrize("backend", _env.BACKENDS)
def test_pack_to_bf16_where_the_difference_overflows(backend, gpu_device, notes):
    _env.require(backend)
    passed(check_bf16_overflow(gpu_device, [backend], notes), backend)


@pytest.mark.parametrize("backend", _env.BACKENDS)
def test_bf16_and_fp16_parameters_beside_a_float32_master(backend, gpu_device, rng, notes):
    _env.require(backend)
    passed(check_low_precision(gpu_device, [backend], rng, notes), backend)
