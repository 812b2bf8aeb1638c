"""outer_merge_: the receive side of a dense fragment sync, in one pass over memory.

Outer step, exactly ``torch.optim.SGD(lr, momentum, nesterov, dampening=0)`` on g with gradient
Δ̄ (``delta_avg``) and momentum buffer u:

    u     <- μ·u + Δ̄                         (skipped when μ = 0: u is not touched)
    step  =  Δ̄ + μ·u   if nesterov else u    (Δ̄ when μ = 0)
    g_new =  g − η·step

then CoCoDC's delay-compensated merge, with the paper's sign corrected: it replays the local
progress v made while the average was in flight (+β·v) and subtracts the first-order correction
(docs/algorithms.md, "Taylor delay compensation", shows why and which test proves it):

    v = x − x_sent,  D = g_new − x_sent
    x <- (1−α)·(g_new + β·v − λ·v⊙v⊙D) + α·x

Modes: overwrite (α=β=λ=0), Streaming DiLoCo mix (α), delay-corrected (β=1), Taylor (β=1, λ>0).
``lam_mode="normalized"`` uses λ_eff = λ·‖v‖₂ / ‖v⊙v⊙D‖₂ per call (0 when the denominator is 0):
one extra read-only reduction pass (``taylor_norms``) into a float64 (2,) tensor on the data's
device, which the merge kernel reads to form λ_eff itself (no host read, so no host sync on a GPU;
only the ``ref`` backend reads the two sums on the host, as the specification does).

Reads g, u, Δ̄, x, x_sent; writes g, u, x. Bytes: n*(5*s [+ s_avg − s]) read + 3*s written.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import _checks, _dispatch
from ..profiling import nvtx_range
from ._common import code, compiling, declare, launch, launcher, native, traced_call, triton
from .quant_format import (
    _FMT_CODE,
    Quantized,
    _check_fmt_block,
    _check_wire,
    as_format,
    as_quantized,
    wire_buffers,
)
from .quant_ref import dequantize_ref
from .quantize import dequantize_launch

LAM_MODES = ("absolute", "normalized")


def outer_step_ref(
    g: torch.Tensor, u: torch.Tensor, delta_avg: torch.Tensor, *, lr: float, momentum: float, nesterov: bool
) -> None:
    """torch.optim.SGD's update (single-tensor form), in place on g and u (treated as flat)."""
    g, u, d = g.view(-1), u.view(-1), delta_avg.reshape(-1).to(g.dtype)
    if momentum != 0.0:
        u.mul_(momentum).add_(d)
        d = d.add(u, alpha=momentum) if nesterov else u
    g.add_(d, alpha=-lr)


_SUM_BLOCK, _SUM_LANES = 8192, 8  # the fixed summation order of taylor_norms (see _fixed_order_sum)


def _fixed_order_sum(t: torch.Tensor) -> torch.Tensor:
    """Σ t (flat float64) in one fixed order: blocks of 8192 elements; in a block, lane l (of 8)
    adds elements 8q + l for q = 0, 1, ... in turn, then the lanes are added in order; then the
    block sums in order (cumsum adds strictly in sequence). The order depends only on len(t),
    never on threads, and is the CPU kernel's (csrc/cpu/outer_merge.cpp), bit for bit."""
    nb = -(-t.numel() // _SUM_BLOCK)
    if nb == 0:
        return t.new_zeros(())
    blocks = F.pad(t, (0, nb * _SUM_BLOCK - t.numel())).view(nb, _SUM_BLOCK // _SUM_LANES, _SUM_LANES)
    lanes = blocks.cumsum(1)[:, -1, :]
    return lanes.cumsum(1)[:, -1].cumsum(0)[-1]


def taylor_norms_ref(
    g: torch.Tensor,
    u: torch.Tensor,
    delta_avg: torch.Tensor,
    x: torch.Tensor,
    x_sent: torch.Tensor,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
) -> torch.Tensor:
    """[Σ v², Σ (v⊙v⊙D)²] in float64 for the g_new the outer step would produce (nothing mutated),
    each summed in the fixed order of ``_fixed_order_sum``."""
    g_new, u_new = g.reshape(-1).clone(), u.reshape(-1).clone()
    outer_step_ref(g_new, u_new, delta_avg, lr=lr, momentum=momentum, nesterov=nesterov)
    x, x_sent = x.reshape(-1), x_sent.reshape(-1)
    v = (x - x_sent).double()
    corr = v * v * (g_new - x_sent).double()
    return torch.stack([_fixed_order_sum(v * v), _fixed_order_sum(corr * corr)])


def lam_effective(lam: float, sums: torch.Tensor) -> float:
    """λ_eff = λ·‖v‖/‖v⊙v⊙D‖ from the two sums of squares; 0 when the correction vanishes.
    Python floats, left to right: the kernels (csrc kernels.h ``lam_effective``, the Triton
    merge) form it from the same sums on the device with the same roundings."""
    sv, sc = (float(s) for s in sums.tolist())
    return 0.0 if sc == 0.0 or lam == 0.0 else lam * math.sqrt(sv) / math.sqrt(sc)


def outer_merge_ref(
    g: torch.Tensor, u: torch.Tensor, delta_avg: torch.Tensor, x: torch.Tensor,
    x_sent: torch.Tensor | None = None, *, lr: float, momentum: float = 0.0, nesterov: bool = True,
    alpha: float = 0.0, beta: float = 0.0, lam: float = 0.0, lam_mode: str = "absolute",
) -> None:  # fmt: skip
    """The specification, in plain torch (float64-capable). In place on g, u, x."""
    if lam_mode == "normalized" and lam != 0.0:
        lam = lam_effective(
            lam, taylor_norms_ref(g, u, delta_avg, x, x_sent, lr=lr, momentum=momentum, nesterov=nesterov)
        )
    outer_step_ref(g, u, delta_avg, lr=lr, momentum=momentum, nesterov=nesterov)
    g, x_out = g.view(-1), x.view(-1)  # flat, like every op: the buffers need only the same numel
    x = x_out.to(g.dtype)  # a bf16 / fp16 x widened exactly to its float32 master's dtype
    target = g.clone()
    if beta != 0.0 or lam != 0.0:
        x_sent = x_sent.reshape(-1)
        v = x - x_sent
        target = target + beta * v - lam * v * v * (g - x_sent)
    x_out.copy_((1.0 - alpha) * target + alpha * x)  # into a bf16 / fp16 x: round to nearest even, once


TAYLOR_CONTROLS = ("none", "flip", "random")  # controls of the Taylor term (outer_merge_control_ref)


def outer_merge_control_ref(
    g: torch.Tensor, u: torch.Tensor, delta_avg: torch.Tensor, x: torch.Tensor, x_sent: torch.Tensor, *,
    lr: float, momentum: float = 0.0, nesterov: bool = True, alpha: float = 0.0, beta: float = 1.0,
    lam: float = 0.0, lam_mode: str = "absolute", control: str = "none",
    direction: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Controls that isolate the Taylor term c = λ_eff·v⊙v⊙D (v = x − x_sent, D = g_new − x_sent,
    λ_eff as in ``outer_merge_ref``). A slow path in plain torch, for experiments, not a fused op:

        none:   x <- (1−α)·(g_new + β·v − c) + α·x              (exactly ``outer_merge_ref``)
        flip:   x <- (1−α)·(g_new + β·v + c) + α·x              (the correction's sign reversed)
        random: x <- (1−α)·(g_new + β·v − ‖c‖₂·r/‖r‖₂) + α·x    (r = ``direction``: a correction
                of the same norm in a direction unrelated to v and D; 0 when ‖r‖₂ = 0)

    The outer step on (g, u) is the same as ``outer_merge_``'s. In place on g, u, x; the norms are
    float64. Raises ValueError naming ``control`` or ``direction`` before anything is written."""
    if control not in TAYLOR_CONTROLS:
        raise ValueError(f"control must be one of {TAYLOR_CONTROLS}, got {control!r}")
    if lam_mode not in LAM_MODES:
        raise ValueError(f"lam_mode must be one of {LAM_MODES}, got {lam_mode!r}")
    if control == "random" and (not isinstance(direction, torch.Tensor) or direction.numel() != g.numel()):
        raise ValueError(f"direction must be a tensor of g's numel ({g.numel()}) when control='random'")
    if control == "none":
        step = {"lr": lr, "momentum": momentum, "nesterov": nesterov}
        return outer_merge_ref(
            g, u, delta_avg, x, x_sent, **step, alpha=alpha, beta=beta, lam=lam, lam_mode=lam_mode
        )
    if lam_mode == "normalized" and lam != 0.0:
        lam = lam_effective(
            lam, taylor_norms_ref(g, u, delta_avg, x, x_sent, lr=lr, momentum=momentum, nesterov=nesterov)
        )
    outer_step_ref(g, u, delta_avg, lr=lr, momentum=momentum, nesterov=nesterov)
    g, x_out, x_sent = g.view(-1), x.view(-1), x_sent.reshape(-1)
    x = x_out.to(g.dtype)
    v = x - x_sent
    corr = lam * v * v * (g - x_sent)
    if control == "flip":
        target = g + beta * v + corr
    else:
        r = direction.reshape(-1).to(device=g.device, dtype=torch.float64)
        r_norm = float(torch.linalg.vector_norm(r))
        scale = 0.0 if r_norm == 0.0 else float(torch.linalg.vector_norm(corr.double())) / r_norm
        target = g + beta * v - (r * scale).to(g.dtype)
    x_out.copy_((1.0 - alpha) * target + alpha * x)


# ---- launchers (n >= 1, checked arguments) ------------------------------------------------------
# taylor_norms: the two float64 sums into `out` (2,), zeroed, read-only otherwise. outer_merge: in
# place on g, u, x; `lam_sums` None: λ is absolute; else the float64 (2,) tensor of taylor_norms on
# the data's device, and the launcher merges with λ_eff = lam_effective(λ, lam_sums), formed by the
# kernel on the device (only the ref reads the sums on the host).


@launcher("taylor_norms", "ref")
def _(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, out):
    out.copy_(taylor_norms_ref(g, u, delta_avg, x, x_sent, lr=lr, momentum=momentum, nesterov=nesterov))


@launcher("outer_merge", "ref")
def _(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_sums):
    lam = lam if lam_sums is None else lam_effective(lam, lam_sums)
    step = {"lr": lr, "momentum": momentum, "nesterov": nesterov}
    outer_merge_ref(g, u, delta_avg, x, x_sent, **step, alpha=alpha, beta=beta, lam=lam)


# Both entry points: the dtype codes (dtype the parameters' (x's); g's, u's and x_sent's are implied,
# abi.h), n, the step's nesterov as an int; the rest the launcher arguments of their names.
_STEP = {
    "dtype": ("x", code),
    "avg_dtype": ("delta_avg", code),
    "n": ("g", torch.Tensor.numel),
    "nesterov": ("nesterov", int),
}
native("taylor_norms", "lc_taylor_norms", **_STEP, out2="out")
native("outer_merge", "lc_outer_merge", **_STEP)
triton("taylor_norms", "outer_merge", "launch_taylor_norms")
triton("outer_merge", "outer_merge", "launch_outer_merge")


# The scalars of both merges (and of taylor_norms' pass inside outer_merge_).
_MERGE_SCALARS = (
    _checks.Real("lr", lo=0.0),
    _checks.Real("momentum", lo=0.0, hi=1.0, hi_open=True),
    _checks.Flag("nesterov"),
    _checks.Real("alpha", lo=0.0, hi=1.0),
    _checks.Real("beta", lo=0.0),
    _checks.Real("lam", lo=0.0),
)
#: outer_merge_'s arguments: g, u, delta_avg, x and x_sent pairwise distinct. (lam_sums: taylor_norms'
#: two sums, which the op allocates for the normalized Taylor mode.)
CONTRACT = _checks.Contract(
    "lc_outer_merge",
    _checks.Buffer("g", _checks.FLOAT_DTYPES),
    _checks.Buffer("u", _checks.like("g")),
    _checks.Buffer("delta_avg", _checks.wire_of("g")),
    _checks.Buffer("x", _checks.PARAM_DTYPES, params_of="g"),
    _checks.Buffer("x_sent", _checks.like("g"), optional=True),
    *_MERGE_SCALARS,
    internal=["lam_sums"],
)


def _check_lam(x_sent: torch.Tensor | None, beta: float, lam: float, lam_mode: object) -> None:
    """What both merges check beyond their contract."""
    if lam_mode not in LAM_MODES:
        raise ValueError(f"lam_mode must be one of {LAM_MODES}, got {lam_mode!r}")
    if x_sent is None and (beta != 0.0 or lam != 0.0):
        raise ValueError("x_sent is required when beta or lam is non-zero")


def _outer_merge_impl(
    g: torch.Tensor,
    u: torch.Tensor,
    delta_avg: torch.Tensor,
    x: torch.Tensor,
    x_sent: torch.Tensor | None,
    lr: float,
    momentum: float,
    nesterov: bool,
    alpha: float,
    beta: float,
    lam: float,
    lam_mode: str,
    backend: str | None,
) -> None:
    """Check, choose the backend, launch: the registered op's body, and the eager path of
    outer_merge_."""
    step = dict(lr=lr, momentum=momentum, nesterov=nesterov, alpha=alpha, beta=beta, lam=lam)
    c = CONTRACT.check(g=g, u=u, delta_avg=delta_avg, x=x, x_sent=x_sent, **step)
    lr, momentum, alpha, beta, lam = c["lr"], c["momentum"], c["alpha"], c["beta"], c["lam"]
    _check_lam(x_sent, beta, lam, lam_mode)
    b = _dispatch.resolve(backend, g.device, "lc_outer_merge")
    if g.numel() == 0:
        return
    with nvtx_range("outer_merge"):
        lam_sums = None
        if lam_mode == "normalized" and lam != 0.0:
            # The scale is a global reduction over the fragment, so it needs its own pass; its two
            # sums stay on the device, where the merge kernel forms λ_eff (no host sync).
            lam_sums = torch.zeros(2, dtype=torch.float64, device=g.device)
            launch("taylor_norms", b, g, u, delta_avg, x, x_sent, lr, momentum, nesterov, lam_sums)
        launch(
            "outer_merge", b, g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_sums
        )


_outer_merge_op = torch.library.custom_op(
    "lowcomm::outer_merge_", _outer_merge_impl, mutates_args=("g", "u", "x")
)


@_outer_merge_op.register_fake
def _(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_mode, backend):
    CONTRACT.same_device(g=g, u=u, delta_avg=delta_avg, x=x, x_sent=x_sent)  # see _common


declare("outer_merge_")


@torch.no_grad()  # optimizer-style updates: parameters that require grad are fine
def outer_merge_(
    g: torch.Tensor,
    u: torch.Tensor,
    delta_avg: torch.Tensor,
    x: torch.Tensor,
    x_sent: torch.Tensor | None = None,
    *,
    lr: float,
    momentum: float = 0.0,
    nesterov: bool = True,
    alpha: float = 0.0,
    beta: float = 0.0,
    lam: float = 0.0,
    lam_mode: str = "absolute",
    backend: str | None = None,
) -> None:
    """Outer step on (g, u) with the averaged pseudo-gradient Δ̄, then the delay-compensated
    merge into x, in place, in one pass (see the module docstring for the equations):

        u <- μ·u + Δ̄;  g <- g − η·(Δ̄ + μ·u if nesterov else u);
        x <- (1−α)·(g + β·v − λ·v⊙v⊙(g − x_sent)) + α·x,   v = x − x_sent

    Args:
        g: global parameters, fp32/fp64, any shape, contiguous. Mutated (g_new).
        u: momentum buffer, g's numel/dtype/device, contiguous. Mutated, unless momentum == 0
            (then never read either).
        delta_avg: averaged pseudo-gradient Δ̄, g's numel, g's dtype or bfloat16 (the wire
            dtype), contiguous. Read only.
            Or a ``Quantized`` (codes, scales, fmt, block) of g's numel, dequantized inside the merge.
        x: local parameters, g's numel/dtype/device, contiguous. Mutated (the merge).
        x_sent: snapshot of x at send time (pack's snapshot), g's numel/dtype, contiguous; required
            when beta or lam is non-zero, else unused. Read only.
        lr: η >= 0. momentum: 0 <= μ < 1. nesterov: bool (torch.optim.SGD's).
        alpha: 0 <= α <= 1, the weight kept on the local x (Streaming DiLoCo's mix).
        beta: β >= 0, the share of the local progress v replayed (1: delay-corrected).
        lam: λ >= 0, the Taylor correction. All scalars finite.
        lam_mode: 'absolute' (λ as given) or 'normalized' (λ·‖v‖₂/‖v⊙v⊙D‖₂, 0 when the
            denominator is 0; one extra read-only pass).
        backend: 'ref' | 'cpu' | 'triton' | 'cuda' (default by device, see ``_dispatch``).
    g, u, delta_avg, x and x_sent are pairwise distinct buffers (no overlap at all).

    Returns:
        None: the results are g, u and x.
    Raises:
        TypeError / ValueError naming the argument, before anything is written.
    """
    if not isinstance(delta_avg, torch.Tensor):  # a quantized Δ̄: outer_merge_quantized_ (below)
        kw = {"lr": lr, "momentum": momentum, "nesterov": nesterov, "alpha": alpha, "beta": beta, "lam": lam}
        return outer_merge_quantized_(g, u, delta_avg, x, x_sent, **kw, lam_mode=lam_mode, backend=backend)
    args = (g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_mode, backend)
    if compiling():
        traced_call("outer_merge_", *args)
    else:
        _outer_merge_impl(*args)


# ---- with Δ̄ quantized (codes, scales, fmt, block): dequantized inside the merge ----------------


def outer_merge_quantized_ref(
    g: torch.Tensor, u: torch.Tensor, delta_avg: Quantized, x: torch.Tensor,
    x_sent: torch.Tensor | None = None, **kwargs: object,
) -> None:  # fmt: skip
    """``outer_merge_ref`` with Δ̄ = dequantize_ref(delta_avg) in g's dtype (in place on g, u, x)."""
    f = as_format(delta_avg.fmt)
    d = dequantize_ref(delta_avg.codes, delta_avg.scales, f, delta_avg.block, g.numel(), out_dtype=g.dtype)
    outer_merge_ref(g, u, d, x, x_sent, **kwargs)


@launcher("outer_merge_quantized", "ref")
def _(g, u, codes, scales, fmt, block, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_sums):
    step = {"lr": lr, "momentum": momentum, "nesterov": nesterov, "alpha": alpha, "beta": beta, "lam": lam}
    outer_merge_quantized_ref(g, u, Quantized(codes, scales, fmt, block), x, x_sent, **step)


native(
    "outer_merge_quantized",
    "lc_outer_merge_quantized",
    dtype=("x", code),
    fmt=("fmt", _FMT_CODE.__getitem__),
    n=("g", torch.Tensor.numel),
    nesterov=("nesterov", int),
)


_DELTA_AVG_WIRE = wire_buffers(prefix="delta_avg.")  # Δ̄ as (codes, scales)
#: outer_merge_quantized_'s arguments: outer_merge_'s with Δ̄ as (codes, scales) of a quantized
#: format (their sizes: ``_check_wire``).
QUANTIZED_CONTRACT = _checks.Contract(
    "lc_outer_merge_quantized",
    _checks.Buffer("g", _checks.FLOAT_DTYPES),
    _checks.Buffer("u", _checks.like("g")),
    *_DELTA_AVG_WIRE,
    _checks.Buffer("x", _checks.PARAM_DTYPES, params_of="g"),
    _checks.Buffer("x_sent", _checks.like("g"), optional=True),
    *_MERGE_SCALARS,
    internal=["lam_sums"],
)


def _outer_merge_quantized_impl(
    g, u, codes, scales, fmt, block, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_mode, backend
) -> None:
    """outer_merge_'s checks with Δ̄ as (codes, scales); then one fused pass (cpu, cuda), or
    dequantize into a temporary and the dense merge (the normalized Taylor mode, and triton)."""
    f, block = _check_fmt_block(fmt, block)
    step = dict(lr=lr, momentum=momentum, nesterov=nesterov, alpha=alpha, beta=beta, lam=lam)
    c = QUANTIZED_CONTRACT.check(g=g, u=u, codes=codes, scales=scales, x=x, x_sent=x_sent, **step)
    lr, momentum, alpha, beta, lam = c["lr"], c["momentum"], c["alpha"], c["beta"], c["lam"]
    _check_wire(f, block, g.numel(), codes, scales, _DELTA_AVG_WIRE)
    _check_lam(x_sent, beta, lam, lam_mode)
    b = _dispatch.resolve(backend, g.device, "lc_outer_merge_quantized")
    if g.numel() == 0:
        return
    with nvtx_range("outer_merge"):
        fused = (b in ("ref", "cpu", "cuda")) and not (lam_mode == "normalized" and lam != 0.0)
        if fused:
            merge = (lr, momentum, nesterov, alpha, beta, lam)
            launch("outer_merge_quantized", b, g, u, codes, scales, f.name, block, x, x_sent, *merge, None)
            return
        # The normalized mode's scale is a reduction over Δ̄ that the merge needs before its first
        # element, and Triton has no fused kernel yet: Δ̄ is dequantized once here.
        d = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        dequantize_launch(b, codes, scales, d, f.name, block)
        _outer_merge_impl(g, u, d, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_mode, b)


# outer_merge_'s schema with Δ̄ as (codes, scales, fmt, block), written out (the impl is unannotated).
_outer_merge_quantized_op = torch.library.custom_op(
    "lowcomm::outer_merge_quantized_",
    _outer_merge_quantized_impl,
    mutates_args=("g", "u", "x"),
    schema="(Tensor(a0!) g, Tensor(a1!) u, Tensor codes, Tensor scales, str fmt, SymInt block, "
    "Tensor(a6!) x, Tensor? x_sent, float lr, float momentum, bool nesterov, float alpha, float beta, "
    "float lam, str lam_mode, str? backend) -> ()",
)


@_outer_merge_quantized_op.register_fake
def _(
    g, u, codes, scales, fmt, block, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_mode, backend
):
    QUANTIZED_CONTRACT.same_device(g=g, u=u, codes=codes, scales=scales, x=x, x_sent=x_sent)


declare("outer_merge_quantized_")


@torch.no_grad()
def outer_merge_quantized_(
    g: torch.Tensor, u: torch.Tensor, delta_avg: Quantized | tuple, x: torch.Tensor,
    x_sent: torch.Tensor | None = None, *, lr: float, momentum: float = 0.0, nesterov: bool = True,
    alpha: float = 0.0, beta: float = 0.0, lam: float = 0.0, lam_mode: str = "absolute",
    backend: str | None = None,
) -> None:  # fmt: skip
    """``outer_merge_`` with the averaged pseudo-gradient given quantized (what ``outer_merge_``
    calls for a Quantized delta_avg): Δ̄ is dequantized inside the merge on the cpu backend
    (chunk by chunk) and the cuda backend (in registers), never stored whole (normalized λ, and
    triton for now, dequantize it once into a temporary). Arguments and results as
    ``outer_merge_``'s."""
    q = as_quantized(delta_avg, "delta_avg")
    f = as_format(q.fmt)
    wire = (q.codes, q.scales, f.name, q.block)
    merge = (lr, momentum, nesterov, alpha, beta, lam, lam_mode)
    args = (g, u, *wire, x, x_sent, *merge, backend)
    if compiling():
        traced_call("outer_merge_quantized_", *args)
    else:
        _outer_merge_quantized_impl(*args)
