"""outer_merge_: the receive side of a dense fragment sync, in one pass over memory.

Outer step, exactly ``torch.optim.SGD(lr, momentum, nesterov, dampening=0)`` on g with gradient
Δ̄ (``delta_avg``) and momentum buffer u:

    u     <- μ·u + Δ̄                         (skipped when μ = 0: u is not touched)
    step  =  Δ̄ + μ·u   if nesterov else u    (Δ̄ when μ = 0)
    g_new =  g − η·step

then the delay-compensated merge (ALGORITHMS.md, CoCoDC (a), with the sign fix):

    v = x − x_sent,  D = g_new − x_sent
    x <- (1−α)·(g_new + β·v − λ·v⊙v⊙D) + α·x

Modes: overwrite (α=β=λ=0), Streaming DiLoCo mix (α), delay-corrected (β=1), Taylor (β=1, λ>0).
``lam_mode="normalized"`` uses λ_eff = λ·‖v‖₂ / ‖v⊙v⊙D‖₂ per call (0 when the denominator is 0):
one extra read-only reduction pass (``taylor_norms``) before the fused pass.

Reads g, u, Δ̄, x, x_sent; writes g, u, x. Bytes: n*(5*s [+ s_avg − s]) read + 3*s written.
"""

from __future__ import annotations

import math

import torch

from .. import _checks, _dispatch
from ..profiling import nvtx_range
from ._common import code, compiling, cpu_call, cuda_call, declare, ptr, traced_call

LAM_MODES = ("absolute", "normalized")


def outer_step_ref(g: torch.Tensor, u: torch.Tensor, delta_avg: torch.Tensor, *, lr: float,
                   momentum: float, nesterov: bool) -> None:
    """torch.optim.SGD's update (single-tensor form), in place on g and u (treated as flat)."""
    g, u, d = g.view(-1), u.view(-1), delta_avg.reshape(-1).to(g.dtype)
    if momentum != 0.0:
        u.mul_(momentum).add_(d)
        d = d.add(u, alpha=momentum) if nesterov else u
    g.add_(d, alpha=-lr)


def taylor_norms_ref(g: torch.Tensor, u: torch.Tensor, delta_avg: torch.Tensor, x: torch.Tensor,
                     x_sent: torch.Tensor, *, lr: float, momentum: float, nesterov: bool) -> torch.Tensor:
    """[Σ v², Σ (v⊙v⊙D)²] in float64 for the g_new the outer step would produce (nothing mutated)."""
    g_new, u_new = g.reshape(-1).clone(), u.reshape(-1).clone()
    outer_step_ref(g_new, u_new, delta_avg, lr=lr, momentum=momentum, nesterov=nesterov)
    x, x_sent = x.reshape(-1), x_sent.reshape(-1)
    v = (x - x_sent).double()
    corr = v * v * (g_new - x_sent).double()
    return torch.stack([(v * v).sum(), (corr * corr).sum()])


def lam_effective(lam: float, sums: torch.Tensor) -> float:
    """λ_eff = λ·‖v‖/‖v⊙v⊙D‖ from the two sums of squares; 0 when the correction vanishes."""
    sv, sc = (float(s) for s in sums.tolist())
    return 0.0 if sc == 0.0 or lam == 0.0 else lam * math.sqrt(sv) / math.sqrt(sc)


def outer_merge_ref(g: torch.Tensor, u: torch.Tensor, delta_avg: torch.Tensor, x: torch.Tensor,
                    x_sent: torch.Tensor | None = None, *, lr: float, momentum: float = 0.0,
                    nesterov: bool = True, alpha: float = 0.0, beta: float = 0.0, lam: float = 0.0,
                    lam_mode: str = "absolute") -> None:
    """The specification, in plain torch (float64-capable). In place on g, u, x."""
    if lam_mode == "normalized" and lam != 0.0:
        lam = lam_effective(lam, taylor_norms_ref(g, u, delta_avg, x, x_sent, lr=lr, momentum=momentum,
                                                  nesterov=nesterov))
    outer_step_ref(g, u, delta_avg, lr=lr, momentum=momentum, nesterov=nesterov)
    g, x = g.view(-1), x.view(-1)  # flat, like every op: the buffers need only the same numel
    target = g.clone()
    if beta != 0.0 or lam != 0.0:
        x_sent = x_sent.reshape(-1)
        v = x - x_sent
        target = target + beta * v - lam * v * v * (g - x_sent)
    x.copy_((1.0 - alpha) * target + alpha * x)


def _taylor_norms_launch(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, backend) -> torch.Tensor:
    out = torch.zeros(2, dtype=torch.float64, device=g.device)
    if g.numel() == 0:
        return out
    if backend == "ref":
        out.copy_(taylor_norms_ref(g, u, delta_avg, x, x_sent, lr=lr, momentum=momentum, nesterov=nesterov))
    elif backend == "cpu":
        cpu_call("lc_taylor_norms", code(g), code(delta_avg), ptr(g), ptr(u), ptr(delta_avg), ptr(x),
                 ptr(x_sent), g.numel(), lr, momentum, int(nesterov), ptr(out))
    elif backend == "cuda":
        cuda_call("lc_taylor_norms", g.device, code(g), code(delta_avg), ptr(g), ptr(u), ptr(delta_avg),
                  ptr(x), ptr(x_sent), g.numel(), lr, momentum, int(nesterov), ptr(out))
    else:
        from ..triton_kernels.outer_merge import launch_taylor_norms
        launch_taylor_norms(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, out)
    return out


def _outer_merge_launch(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_mode,
                        backend) -> None:
    if g.numel() == 0:
        return
    with nvtx_range("outer_merge"):
        if lam_mode == "normalized" and lam != 0.0:
            # The scale is a global reduction over the fragment, so it needs its own pass (and, on
            # a GPU, one host sync to read the two sums).
            lam = lam_effective(lam, _taylor_norms_launch(g, u, delta_avg, x, x_sent, lr, momentum,
                                                          nesterov, backend))
        if backend == "ref":
            outer_merge_ref(g, u, delta_avg, x, x_sent, lr=lr, momentum=momentum, nesterov=nesterov,
                            alpha=alpha, beta=beta, lam=lam)
        elif backend == "cpu":
            cpu_call("lc_outer_merge", code(g), code(delta_avg), ptr(g), ptr(u), ptr(delta_avg), ptr(x),
                     ptr(x_sent), g.numel(), lr, momentum, int(nesterov), alpha, beta, lam)
        elif backend == "cuda":
            cuda_call("lc_outer_merge", g.device, code(g), code(delta_avg), ptr(g), ptr(u), ptr(delta_avg),
                      ptr(x), ptr(x_sent), g.numel(), lr, momentum, int(nesterov), alpha, beta, lam)
        elif backend == "triton":
            from ..triton_kernels.outer_merge import launch_outer_merge
            launch_outer_merge(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta, lam)
        else:  # pragma: no cover
            raise ValueError(f"unknown backend {backend!r}")


def _check(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta, lam,
           lam_mode) -> tuple[float, float, float, float, float]:
    """Every check of an outer_merge_ call, before anything is written; returns the scalars
    (lr, momentum, alpha, beta, lam) as floats."""
    for name, t in (("g", g), ("u", u), ("x", x)):
        _checks.tensor(name, t, dtypes=_checks.FLOAT_DTYPES)
    _checks.tensor("delta_avg", delta_avg, dtypes=(g.dtype, torch.bfloat16))
    _checks.same_dtype("g", g, u=u, x=x)
    _checks.same_device("g", g, u=u, delta_avg=delta_avg, x=x, x_sent=x_sent)
    _checks.same_numel("g", g, u=u, delta_avg=delta_avg, x=x, x_sent=x_sent)
    lr = _checks.scalar("lr", lr, lo=0.0)
    momentum = _checks.scalar("momentum", momentum, lo=0.0, hi=1.0, hi_open=True)
    alpha = _checks.scalar("alpha", alpha, lo=0.0, hi=1.0)
    beta = _checks.scalar("beta", beta, lo=0.0)
    lam = _checks.scalar("lam", lam, lo=0.0)
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool, got {type(nesterov).__name__}")
    if lam_mode not in LAM_MODES:
        raise ValueError(f"lam_mode must be one of {LAM_MODES}, got {lam_mode!r}")
    if x_sent is None and (beta != 0.0 or lam != 0.0):
        raise ValueError("x_sent is required when beta or lam is non-zero")
    if x_sent is not None:
        _checks.tensor("x_sent", x_sent, dtypes=(g.dtype,))
    _checks.distinct({"g": g, "u": u, "delta_avg": delta_avg, "x": x, "x_sent": x_sent})
    return lr, momentum, alpha, beta, lam


def _outer_merge_impl(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_mode,
                      backend) -> None:
    """Check, choose the backend, launch: the registered op's body, and the eager path of outer_merge_."""
    lr, momentum, alpha, beta, lam = _check(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta,
                                            lam, lam_mode)
    _outer_merge_launch(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_mode,
                        _dispatch.resolve(backend, g.device, "lc_outer_merge"))


@torch.library.custom_op("lowcomm::outer_merge_", mutates_args=("g", "u", "x"))
def _outer_merge_op(g: torch.Tensor, u: torch.Tensor, delta_avg: torch.Tensor, x: torch.Tensor,
                    x_sent: torch.Tensor | None, lr: float, momentum: float, nesterov: bool, alpha: float,
                    beta: float, lam: float, lam_mode: str, backend: str | None) -> None:
    _outer_merge_impl(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_mode, backend)


@_outer_merge_op.register_fake
def _(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_mode, backend):
    _checks.same_device("g", g, u=u, delta_avg=delta_avg, x=x, x_sent=x_sent)  # see _common


declare("outer_merge_")


@torch.no_grad()  # optimizer-style updates: parameters that require grad are fine
def outer_merge_(g: torch.Tensor, u: torch.Tensor, delta_avg: torch.Tensor, x: torch.Tensor,
                 x_sent: torch.Tensor | None = None, *, lr: float, momentum: float = 0.0,
                 nesterov: bool = True, alpha: float = 0.0, beta: float = 0.0, lam: float = 0.0,
                 lam_mode: str = "absolute", backend: str | None = None) -> None:
    """Nesterov outer step on (g, u) with Δ̄, then the delay-compensated merge into x. In place.

    Args:
        g, u, x: fp32/fp64, same numel/dtype/device, contiguous, pairwise distinct. Mutated.
        delta_avg: averaged pseudo-gradient Δ̄, g's dtype or bfloat16 (the wire dtype).
        x_sent: snapshot of x at send time; required when beta or lam is non-zero.
        lr >= 0, 0 <= momentum < 1, 0 <= alpha <= 1, beta and lam >= 0 finite.
        lam_mode: 'absolute' (λ as given) or 'normalized' (λ·‖v‖/‖v⊙v⊙D‖).
    """
    args = (g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_mode, backend)
    if compiling():
        traced_call("outer_merge_", *args)
    else:
        _outer_merge_impl(*args)
