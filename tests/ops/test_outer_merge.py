"""outer_merge_: every backend against outer_merge_ref, against torch.optim.SGD over several steps,
the normalized-λ formula, the Taylor sign test on a quadratic, and bad input."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from lowcomm_kernels.ops import outer_merge_, outer_merge_ref

pytestmark = pytest.mark.op("outer_merge_")

F64_F32 = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])


def _state(
    n: int,
    dtype: torch.dtype,
    rng: torch.Generator,
    avg_dtype: torch.dtype | None = None,
    device: str = "cpu",
):
    """g, u, delta_avg, x, x_sent with O(1) values and small local/global moves, as in training
    (so every intermediate of the merge is O(1) and the elementwise tolerance applies)."""

    def r(scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(n, generator=rng, dtype=torch.float64)).to(device, dtype)

    x_sent = r()
    g, x = x_sent + r(0.1), x_sent + r(0.1)
    delta_avg = r(0.1).to(avg_dtype or dtype)
    return g, r(0.1), delta_avg, x, x_sent


def _run_both(backend, state, **kw):
    """Run the op on `backend` and the ref on clones; return ((g, u, x), (g_ref, u_ref, x_ref))."""
    g, u, avg, x, xs = state
    ref = [t.clone() for t in (g, u, avg, x, xs)]
    outer_merge_(g, u, avg, x, xs, backend=backend, **kw)
    outer_merge_ref(ref[0], ref[1], ref[2], ref[3], ref[4], **kw)
    return (g, u, x), (ref[0], ref[1], ref[3])


FULL = dict(lr=0.7, momentum=0.9, nesterov=True, alpha=0.25, beta=1.0, lam=0.3)
SCALE = 8.0  # |terms| of the merge stay below ~8 for these inputs (lr·(1+μ)·|Δ̄ + μu| + |v| + λ|v²D|)


@F64_F32
@pytest.mark.parametrize("n", [0, 1, 7, 1000003])
def test_matches_ref(device, backend, n, dtype, rng, close):
    state = _state(n, dtype, rng, device=device)
    xs0 = state[4].clone()
    avg0 = state[2].clone()
    out, ref = _run_both(backend, state, **FULL)
    for name, a, b in zip("gux", out, ref, strict=True):
        close.assert_close(a, b, scale=SCALE, msg=name)
    assert torch.equal(state[4], xs0) and torch.equal(state[2], avg0), "x_sent and delta_avg are read-only"


CONFIGS = {
    "overwrite": dict(lr=0.7, momentum=0.9),
    "overwrite-no-momentum": dict(lr=1.0),
    "sgd-plain-momentum": dict(lr=0.5, momentum=0.8, nesterov=False),
    "streaming-mix": dict(lr=0.7, momentum=0.9, alpha=0.5),
    "alpha-one": dict(lr=0.7, momentum=0.9, alpha=1.0, beta=1.0, lam=2.0),
    "delay-corrected": dict(lr=0.7, momentum=0.9, beta=1.0),
    "taylor-abs": dict(lr=0.7, momentum=0.9, beta=1.0, lam=0.5),
    "taylor-normalized": dict(lr=0.7, momentum=0.9, beta=1.0, lam=0.5, lam_mode="normalized"),
    "normalized-lam0": dict(lr=0.7, momentum=0.9, beta=0.5, lam=0.0, lam_mode="normalized"),
    "normalized-no-momentum": dict(lr=0.5, beta=1.0, lam=0.5, lam_mode="normalized"),
    "normalized-heavyball": dict(
        lr=0.5, momentum=0.8, nesterov=False, alpha=0.3, beta=1.0, lam=0.5, lam_mode="normalized"
    ),
    "mix-with-unused-x_sent": dict(lr=0.7, momentum=0.9, alpha=0.3),
    "lr0": dict(lr=0.0, momentum=0.9, beta=1.0, lam=0.5),
}


@F64_F32
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_modes_match_ref(device, backend, config, dtype, rng, close):
    n = 4099
    kw = CONFIGS[config]
    state = _state(n, dtype, rng, device=device)
    out, ref = _run_both(backend, state, **kw)
    # normalized λ: λ_eff carries the fp64 reduction's error (√n·eps) into every element.
    kind = "reduction" if kw.get("lam_mode") == "normalized" else "elementwise"
    for name, a, b in zip("gux", out, ref, strict=True):
        rtol = close.tolerance("elementwise", dtype)[0] + (
            close.tolerance(kind, dtype, n)[0] if kind == "reduction" else 0.0
        )
        torch.testing.assert_close(
            a, b, rtol=rtol, atol=SCALE * rtol, msg=lambda m, name=name: f"{config}/{name}: {m}"
        )


@F64_F32
@pytest.mark.parametrize("n", [1, 7, 100003])
def test_bf16_delta_avg(device, backend, n, dtype, rng, close):
    """Δ̄ on the bf16 wire is widened exactly to g's dtype: same result as the ref given Δ̄.to(dtype)."""
    state = _state(n, dtype, rng, avg_dtype=torch.bfloat16, device=device)
    g, u, avg, x, xs = state
    ref = [g.clone(), u.clone(), avg.to(dtype), x.clone(), xs.clone()]
    outer_merge_(g, u, avg, x, xs, backend=backend, **FULL)
    outer_merge_ref(*ref, **FULL)
    for name, a, b in zip("gux", (g, u, x), (ref[0], ref[1], ref[3]), strict=True):
        close.assert_close(a, b, scale=SCALE, msg=name)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@F64_F32
def test_outer_step_is_torch_sgd(backend, dtype, momentum, nesterov, rng, close):
    """Over several steps (lr changing), g and u follow torch.optim.SGD(lr, momentum, nesterov,
    dampening=0) with Δ̄ as the gradient and u as state['momentum_buffer']; with α=β=λ=0 x is g_new."""
    n = 1031
    g, u, _, x, _ = _state(n, dtype, rng)
    p = torch.nn.Parameter(g.clone())
    sgd_nesterov = nesterov and momentum != 0.0  # SGD rejects Nesterov without momentum
    opt = torch.optim.SGD([p], lr=1.0, momentum=momentum, nesterov=sgd_nesterov, dampening=0.0)
    if momentum:
        opt.state[p]["momentum_buffer"] = u.clone()
    u_before = u.clone()
    for step, lr in enumerate([0.7, 0.5, 1.0, 0.1, 0.0, 0.7]):
        delta_avg = (0.1 * torch.randn(n, generator=rng, dtype=torch.float64)).to(dtype)
        for group in opt.param_groups:
            group["lr"] = lr
        p.grad = delta_avg.clone()
        opt.step()
        outer_merge_(g, u, delta_avg, x, lr=lr, momentum=momentum, nesterov=nesterov, backend=backend)
        close.assert_close(g, p.detach(), scale=4.0, msg=f"g after step {step}")
        if momentum:
            close.assert_close(u, opt.state[p]["momentum_buffer"], scale=4.0, msg=f"u after step {step}")
        close.assert_close(x, g, msg=f"x (overwrite) after step {step}")
    if not momentum:
        assert torch.equal(u, u_before), "momentum 0: u is not touched"


def test_zero_momentum_never_reads_u(backend):
    """μ = 0 skips the buffer entirely: a NaN-poisoned u stays as it is and g stays finite."""
    n = 257
    g, x, avg = (
        torch.randn(n, dtype=torch.float64),
        torch.randn(n, dtype=torch.float64),
        torch.randn(n, dtype=torch.float64),
    )
    u = torch.full((n,), float("nan"), dtype=torch.float64)
    expected = g - 0.5 * avg
    outer_merge_(g, u, avg, x, lr=0.5, backend=backend)
    assert torch.isnan(u).all()
    torch.testing.assert_close(g, expected, rtol=0, atol=0)
    assert torch.equal(x, g)


@pytest.mark.parametrize("lam", [0.2, 1.0])
def test_normalized_lambda_formula(backend, lam, rng, close):
    """λ_eff = λ0·‖v‖₂ / ‖v⊙v⊙D‖₂ per call, computed here from scratch."""
    n, lr, mu, alpha, beta = 5003, 0.7, 0.9, 0.1, 1.0
    g, u, avg, x, xs = _state(n, torch.float64, rng)
    # the SGD step by hand
    u_new = mu * u + avg
    g_new = g - lr * (avg + mu * u_new)
    v, D = x - xs, g_new - xs
    lam_eff = lam * math.sqrt(float((v * v).sum())) / math.sqrt(float(((v * v * D) ** 2).sum()))
    x_new = (1 - alpha) * (g_new + beta * v - lam_eff * v * v * D) + alpha * x
    # the correction's norm is λ0 times the first-order term's, as the mode promises
    assert math.isclose(float((lam_eff * v * v * D).norm()), lam * float(v.norm()), rel_tol=1e-12)
    outer_merge_(
        g,
        u,
        avg,
        x,
        xs,
        lr=lr,
        momentum=mu,
        alpha=alpha,
        beta=beta,
        lam=lam,
        lam_mode="normalized",
        backend=backend,
    )
    rtol = (
        close.tolerance("elementwise", torch.float64)[0] + close.tolerance("reduction", torch.float64, n)[0]
    )
    torch.testing.assert_close(g, g_new, rtol=rtol, atol=SCALE * rtol)
    torch.testing.assert_close(u, u_new, rtol=rtol, atol=SCALE * rtol)
    torch.testing.assert_close(x, x_new, rtol=rtol, atol=SCALE * rtol)


@pytest.mark.parametrize("zero", ["v", "D"])
def test_normalized_lambda_zero_denominator(backend, zero, rng):
    """‖v⊙v⊙D‖ = 0 (no local progress, or g_new == x_sent): λ_eff = 0, no NaN from 0/0."""
    n = 100
    g, u, avg, x, xs = _state(n, torch.float64, rng)
    if zero == "v":
        x = xs.clone()
    else:  # g_new = g - 0·… = g = x_sent exactly
        g, avg = xs.clone(), torch.zeros_like(avg)
        u.zero_()
    expected_g = g.clone() if zero == "D" else None
    v = x - xs
    outer_merge_(
        g, u, avg, x, xs, lr=0.7, momentum=0.9, beta=1.0, lam=0.5, lam_mode="normalized", backend=backend
    )
    assert torch.isfinite(x).all()
    if expected_g is not None:
        assert torch.equal(g, expected_g)
    torch.testing.assert_close(x, g + v, rtol=1e-15, atol=1e-15)


# ---- normalized λ: formed by the kernel from the device sums ---------------------------------

NORMALIZED = {
    "nesterov": dict(lr=0.7, momentum=0.9, nesterov=True, alpha=0.25, beta=1.0, lam=0.3),
    "heavyball": dict(lr=0.5, momentum=0.8, nesterov=False, alpha=0.0, beta=0.5, lam=2.0),
    "no-momentum": dict(lr=0.5, momentum=0.0, alpha=0.3, beta=0.0, lam=0.5),
}


def _normalized_cases(rng: torch.Generator, n: int, dtype: torch.dtype, avg_dtype: torch.dtype,
                      device: str = "cpu"):
    """(name, state) pairs: random, and the three ways the correction vanishes (λ_eff = 0)."""
    yield "random", _state(n, dtype, rng, avg_dtype, device)
    g, u, avg, x, xs = _state(n, dtype, rng, avg_dtype, device)
    yield "v=0", (g, u, avg, xs.clone(), xs)  # Σv² = Σ(v⊙v⊙D)² = 0
    g, u, avg, x, xs = _state(n, dtype, rng, avg_dtype, device)
    yield "D=0", (xs.clone(), torch.zeros_like(u), torch.zeros_like(avg), x, xs)  # g_new = x_sent: Σv² > 0


def _cpu_or_skip() -> None:
    from lowcomm_kernels import _dispatch

    if not _dispatch.available("cpu", torch.device("cpu"), "lc_outer_merge"):
        pytest.skip("the native CPU library is not built")


@pytest.mark.parametrize("config", list(NORMALIZED), ids=list(NORMALIZED))
@pytest.mark.parametrize("avg", ["same", "bf16"])
@F64_F32
@pytest.mark.parametrize("n", [1, 7, 8193, 100003])
def test_normalized_cpu_is_bit_identical_to_ref(n, dtype, avg, config, rng):
    """lam_mode='normalized' on the cpu backend: the sums (fixed order), λ_eff (formed by the
    kernel from them) and the merge are the ref's bit for bit, the vanishing cases included."""
    _cpu_or_skip()
    kw = dict(NORMALIZED[config], lam_mode="normalized")
    avg_dtype = torch.bfloat16 if avg == "bf16" else dtype
    for case, state in _normalized_cases(rng, n, dtype, avg_dtype):
        cpu = [t.clone() for t in state]
        ref = [t.clone() for t in state]
        outer_merge_(*cpu, backend="cpu", **kw)
        outer_merge_ref(*ref, **kw)
        for name, i in (("g", 0), ("u", 1), ("x", 3)):
            assert torch.equal(cpu[i].view(-1).view(torch.uint8), ref[i].view(-1).view(torch.uint8)), (
                f"{case}: {name} differs from the ref")


@F64_F32
@pytest.mark.parametrize("n", [1, 8, 8192, 8193, 70001])
@pytest.mark.parametrize("momentum,nesterov", [(0.0, True), (0.9, True), (0.8, False)])
def test_taylor_norms_cpu_is_bit_identical_to_ref(n, dtype, momentum, nesterov, rng):
    """The two sums behind λ_eff: the CPU kernel sums in the ref's fixed order."""
    _cpu_or_skip()
    from lowcomm_kernels.ops._common import launch
    from lowcomm_kernels.ops.outer_merge import taylor_norms_ref

    g, u, avg, x, xs = _state(n, dtype, rng)
    out = torch.zeros(2, dtype=torch.float64)
    launch("taylor_norms", "cpu", g, u, avg, x, xs, 0.7, momentum, nesterov, out)
    ref = taylor_norms_ref(g, u, avg, x, xs, lr=0.7, momentum=momentum, nesterov=nesterov)
    assert torch.equal(out, ref), (out.tolist(), ref.tolist())


@pytest.mark.op("outer_merge_", exclude=("ref",))
@pytest.mark.parametrize("config", list(NORMALIZED), ids=list(NORMALIZED))
@F64_F32
def test_device_lambda_is_the_host_formula(device, backend, dtype, config, rng):
    """A native/Triton merge given the sums forms λ_eff on the device exactly as lam_effective does
    on the host: the same merge with that λ passed as absolute gives the same bits."""
    from lowcomm_kernels.ops._common import launch
    from lowcomm_kernels.ops.outer_merge import lam_effective

    kw = NORMALIZED[config]
    args = (kw["lr"], kw["momentum"], kw.get("nesterov", True), kw["alpha"], kw["beta"], kw["lam"])
    sums_cases = [[3.0, 7.0], [0.0, 0.0], [5.0, 0.0], [1e-300, 3e-310], [2.5e10, 1e-3]]
    for case, state in _normalized_cases(rng, 4099, dtype, dtype, device):
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        launch("taylor_norms", backend, *state, *args[:3], sums)
        for s in [sums] + [torch.tensor(v, dtype=torch.float64, device=device) for v in sums_cases]:
            on_device = [t.clone() for t in state]
            on_host = [t.clone() for t in state]
            launch("outer_merge", backend, *on_device, *args, s)
            lam_eff = lam_effective(kw["lam"], s)
            launch("outer_merge", backend, *on_host, *args[:5], lam_eff, None)
            for name, i in (("g", 0), ("u", 1), ("x", 3)):
                assert torch.equal(on_device[i].view(torch.uint8), on_host[i].view(torch.uint8)), (
                    f"{case}, sums {s.tolist()}: {name}")


def test_normalized_reads_no_sum_on_the_host(monkeypatch, rng):
    """Only the ref backend turns the sums into a Python float; the others pass the tensor on."""
    from lowcomm_kernels.ops import outer_merge as mod

    _cpu_or_skip()
    calls = []
    real = mod.lam_effective
    monkeypatch.setattr(mod, "lam_effective", lambda lam, sums: calls.append(sums) or real(lam, sums))
    kw = dict(NORMALIZED["nesterov"], lam_mode="normalized")
    outer_merge_(*_state(1000, torch.float64, rng), backend="cpu", **kw)
    assert calls == []
    outer_merge_(*_state(1000, torch.float64, rng), backend="ref", **kw)
    assert len(calls) == 1


# ---- the Taylor sign test --------------------------------------------------------------------


def _delayed_quadratic(rng: torch.Generator, d: int = 512):
    """A worker on f(x) = ½ xᵀAx, A = diag(a) known, with a second worker on a shifted quadratic.

    Both start a round at g_old and run H local SGD steps (lr η); worker 0 sends x_sent, runs τ
    more steps to x_now while the average is in flight; the outer step (DiLoCo's lr 0.7, μ 0.9
    Nesterov) gives g_new. The ideal, undelayed state is τ steps started from g_new.

    x_sent is drawn so that gradients satisfy DC-ASGD's premise H ≈ λ0·grad⊙grad only roughly:
    |grad_i|² = a_i²·x_i² = s·a_i·(1+ε_i)² with ε_i ~ U(−0.3, 0.3).
    """
    s, eta, tau, steps_h = 1.0, 0.01, 4, 5
    a = torch.logspace(-1, 1, d, dtype=torch.float64)
    sign = torch.randint(0, 2, (d,), generator=rng).double() * 2 - 1
    eps = (torch.rand(d, generator=rng, dtype=torch.float64) * 2 - 1) * 0.3
    x_sent = sign * (s / a).sqrt() * (1 + eps)
    contraction = 1 - eta * a  # one SGD step on f is x <- (1 - ηa)⊙x, exactly
    g_old = x_sent / contraction**steps_h
    centre1 = 0.2 * torch.randn(d, generator=rng, dtype=torch.float64) * (s / a).sqrt()
    x_sent1 = centre1 + contraction**steps_h * (g_old - centre1)
    delta_avg = ((g_old - x_sent) + (g_old - x_sent1)) / 2
    u = 0.1 * torch.randn(d, generator=rng, dtype=torch.float64) * delta_avg.abs()
    x_now = contraction**tau * x_sent
    return dict(
        a=a,
        eta=eta,
        tau=tau,
        contraction=contraction,
        g_old=g_old,
        u=u,
        delta_avg=delta_avg,
        x_sent=x_sent,
        x_now=x_now,
    )


def _merge(backend: str, p: dict, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    g, u, x = p["g_old"].clone(), p["u"].clone(), p["x_now"].clone()
    outer_merge_(g, u, p["delta_avg"], x, p["x_sent"].clone(), lr=0.7, momentum=0.9, backend=backend, **kw)
    return x, g


def test_taylor_sign(backend, rng):
    """The compensated merge lands nearer the undelayed trajectory than overwrite and than λ = 0,
    and the opposite sign (the paper's Eq. 8 reading) lands farther than λ = 0.

    On this quadratic everything is exact: with c = (1−ηa)^τ, v = (c−1)·x_sent, and
    ideal − (g_new + v) = −(1−c)·D, so λ = 0 misses by (1−c)·D per coordinate and the Taylor merge
    by (1−c)·D − λ·v²·D. λ follows DC-ASGD: Hessian ≈ λ0·grad⊙grad (λ0 = median(a/grad²), from the
    known Hessian) and v ≈ −ητ·grad, so λ = λ0/(ητ). Then λv²/(1−c) ∈ (0.4, 1.8) for every
    coordinate: |1 − λv²/(1−c)| < 1 everywhere, a strict gain, whereas −λ gives |1 + λv²/(1−c)| > 1.
    """
    p = _delayed_quadratic(rng)
    grad = p["a"] * p["x_sent"]
    lam = float((p["a"] / grad**2).median()) / (p["eta"] * p["tau"])

    x_over, g_new = _merge(backend, p)
    x_lam0, _ = _merge(backend, p, beta=1.0)
    x_taylor, _ = _merge(backend, p, beta=1.0, lam=lam)
    ideal = p["contraction"] ** p["tau"] * g_new
    err = {
        name: (xm - ideal).abs()
        for name, xm in (("overwrite", x_over), ("lam0", x_lam0), ("taylor", x_taylor))
    }
    # the wrong sign, by the formula (the op rightly rejects λ < 0)
    v, D = p["x_now"] - p["x_sent"], g_new - p["x_sent"]
    err["flipped"] = (g_new + v + lam * v * v * D - ideal).abs()
    norm = {k: float(e.norm()) for k, e in err.items()}

    assert norm["lam0"] < 0.5 * norm["overwrite"], norm
    assert norm["taylor"] < 0.5 * norm["lam0"], norm
    assert bool((err["taylor"] < err["lam0"]).all()), "the correction must help every coordinate"
    assert norm["flipped"] > norm["lam0"] and bool((err["flipped"] > err["lam0"]).all()), norm


def test_taylor_sign_normalized(backend, rng):
    """Same, with lam_mode='normalized': λ0 is the first-order ideal correction's size relative to
    the local progress, ‖ητ·a⊙D‖/‖v‖ (from the known Hessian); the merge fixes the direction."""
    p = _delayed_quadratic(rng)
    x_lam0, g_new = _merge(backend, p, beta=1.0)
    v, D = p["x_now"] - p["x_sent"], g_new - p["x_sent"]
    lam0 = float((p["eta"] * p["tau"] * p["a"] * D).norm() / v.norm())
    x_norm, _ = _merge(backend, p, beta=1.0, lam=lam0, lam_mode="normalized")
    ideal = p["contraction"] ** p["tau"] * g_new
    lam_eff = lam0 * float(v.norm()) / float((v * v * D).norm())
    flipped = g_new + v + lam_eff * v * v * D
    e_lam0, e_norm, e_flip = (float((t - ideal).norm()) for t in (x_lam0, x_norm, flipped))
    assert e_norm < 0.5 * e_lam0 and e_flip > e_lam0, (e_norm, e_lam0, e_flip)


# ---- bad input ---------------------------------------------------------------------------------


def _bad_cases(dtype: torch.dtype):
    n = 16
    other = torch.float32 if dtype == torch.float64 else torch.float64

    def t() -> torch.Tensor:
        return torch.randn(n, dtype=dtype)

    def base(**over):
        kw = dict(g=t(), u=t(), delta_avg=t(), x=t(), x_sent=t(), lr=0.7, momentum=0.9, beta=1.0, lam=0.1)
        kw.update(over)
        return kw

    big = torch.randn(2 * n, dtype=dtype)
    meta = torch.empty(n, dtype=dtype, device="meta")
    shared = torch.randn(3 * n, dtype=dtype)
    for name in ("g", "u", "x"):
        yield f"{name} int", base(**{name: torch.zeros(n, dtype=torch.int64)}), TypeError, name
        yield f"{name} strided", base(**{name: big[::2]}), ValueError, name
        yield f"{name} not tensor", base(**{name: [0.0] * n}), TypeError, name
    for name in ("u", "x", "delta_avg", "x_sent"):
        yield f"{name} device", base(**{name: meta}), ValueError, name
        yield f"{name} numel", base(**{name: torch.randn(n + 1, dtype=dtype)}), ValueError, name
    yield "u dtype", base(u=t().to(other)), TypeError, "u"
    yield "x dtype", base(x=t().to(other)), TypeError, "x"
    yield "x_sent dtype", base(x_sent=t().to(other)), TypeError, "x_sent"
    yield "x_sent bf16", base(x_sent=t().bfloat16()), TypeError, "x_sent"
    yield "delta_avg dtype", base(delta_avg=t().to(other)), TypeError, "delta_avg"
    yield "delta_avg fp16", base(delta_avg=t().half()), TypeError, "delta_avg"
    yield "delta_avg strided", base(delta_avg=big[::2]), ValueError, "delta_avg"
    yield "x_sent strided", base(x_sent=big[::2]), ValueError, "x_sent"
    yield "x 2-D transposed", base(x=torch.randn(4, 4, dtype=dtype).t()), ValueError, "x"
    for name, bad, exc in [
        ("lr", -0.1, ValueError),
        ("lr", float("nan"), ValueError),
        ("lr", float("inf"), ValueError),
        ("lr", "0.7", TypeError),
        ("lr", None, TypeError),
        ("momentum", 1.0, ValueError),
        ("momentum", 1.5, ValueError),
        ("momentum", -0.1, ValueError),
        ("momentum", float("nan"), ValueError),
        ("alpha", -0.01, ValueError),
        ("alpha", 1.01, ValueError),
        ("alpha", float("nan"), ValueError),
        ("beta", -1.0, ValueError),
        ("beta", float("inf"), ValueError),
        ("lam", -0.5, ValueError),
        ("lam", float("nan"), ValueError),
        ("lam", float("-inf"), ValueError),
        ("nesterov", "yes", TypeError),
        ("lam_mode", "relative", ValueError),
        ("lam_mode", None, ValueError),
    ]:
        yield f"{name}={bad!r}", base(**{name: bad}), exc, name
    yield "x_sent missing, beta", base(x_sent=None, lam=0.0), ValueError, "x_sent"
    yield "x_sent missing, lam", base(x_sent=None, beta=0.0), ValueError, "x_sent"
    g = t()
    yield "u is g", base(g=g, u=g), ValueError, ("g", "u")
    yield "x is g", base(g=g, x=g), ValueError, ("g", "x")
    yield "delta_avg is x", base(x=g, delta_avg=g), ValueError, ("delta_avg", "x")
    yield "x_sent is x", base(x=g, x_sent=g), ValueError, ("x", "x_sent")
    yield "u overlaps x", base(u=shared[:n], x=shared[n // 2 : n // 2 + n]), ValueError, ("u", "x")
    yield (
        "x_sent overlaps g",
        base(g=shared[n : 2 * n], x_sent=shared[2 * n - 1 : 3 * n - 1]),
        ValueError,
        ("g", "x_sent"),
    )
    yield "backend unknown", base(backend="numpy"), ValueError, "backend"


@F64_F32
def test_bad_input_rejected_and_nothing_written(backend, dtype, close):
    for what, kw, exc, arg in _bad_cases(dtype):
        kw.setdefault("backend", backend)
        args = [kw.pop(k) for k in ("g", "u", "delta_avg", "x", "x_sent")]
        buffers = [a for a in args if isinstance(a, torch.Tensor)]
        try:
            close.assert_rejected(functools.partial(outer_merge_, *args, **kw), exc, arg, buffers)
        except AssertionError as e:
            raise AssertionError(f"case {what!r}: {e}") from e


@F64_F32
@pytest.mark.parametrize("n", [1, 7, 33, 4099])
def test_unaligned_views_and_no_overrun(backend, n, dtype, rng, close):
    """Operands at different odd offsets inside larger buffers: the ref's result, and the elements
    around g, u and x are not written."""
    g, u, avg, x, xs = _state(n, dtype, rng)
    bufs, views = [], []
    for off, t in zip((1, 2, 3, 5, 7), (g, u, avg, x, xs), strict=True):
        buf = torch.full((n + 16,), 7.0, dtype=dtype)
        buf[off : off + n] = t
        bufs.append((buf, off))
        views.append(buf[off : off + n])
    ref = [t.clone() for t in (g, u, avg, x, xs)]
    outer_merge_(*views, backend=backend, **FULL)
    outer_merge_ref(*ref, **FULL)
    for i, name in ((0, "g"), (1, "u"), (3, "x")):
        close.assert_close(views[i], ref[i], scale=SCALE, msg=name)
    for buf, off in bufs:
        assert bool((buf[:off] == 7.0).all()) and bool((buf[off + n :] == 7.0).all()), "wrote outside"
