"""Triton outer_merge: the receive side of a dense fragment sync, and its normalized-λ reduction.

Outer step, exactly ``torch.optim.SGD(lr=η, momentum=μ, nesterov, dampening=0)`` on g with
gradient Δ̄ and momentum buffer u (ops/outer_merge.py ``outer_step_ref``):

    u     <- μ·u + Δ̄                        (only when μ ≠ 0; otherwise u is not read or written)
    step  =  Δ̄ + μ·u  if nesterov else u    (Δ̄ when μ = 0)
    g_new =  g − η·step

rounded exactly as torch rounds each step (see ``_outer_step``: two of them are FMAs in torch),
then the delay-compensated merge (docs/algorithms.md, CoCoDC (a), with the sign fix):

    v = x − x_sent,  D = g_new − x_sent
    x <- (1−α)·(g_new + β·v − λ·v⊙v⊙D) + α·x

Scalars arrive as fp64 and are rounded once to the data dtype, so fp32 data is computed in fp32
(as torch does) and fp64 data keeps full precision on a GPU (the interpreter turns Python floats
into fp32 constants, so there fp64 runs see fp32-rounded scalars; it is tested in fp32 only).
The v/D terms are compiled out when β = λ = 0 (x_sent is then not read); when also α = 0, x is
written but not read (x <- g_new; the reference computes 0·x, which differs only when x holds
inf/NaN).

Normalized λ without a host read: ``launch_taylor_norms`` leaves [Σ v², Σ (v⊙v⊙D)²] in a float64
device tensor, and ``launch_outer_merge(..., lam, lam_sums)`` has every program form
λ_eff = λ·√s0/√s1 (0 when s1 = 0 or λ = 0) from it in float64 (``_lam_effective``: correctly
rounded sqrt and division, as ops/outer_merge.py's ``lam_effective`` computes it on the host), then
round it once to the data dtype like any other λ. The two launches queue back to back on the
stream; nothing waits for the sums.

Bytes (fp32, n elements): read g, Δ̄ [, u] [, x] [, x_sent]; write g, x [, u].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import (
    block_size,
    block_sum,
    gpu_programs,
    hardware_bf16,
    interpreted,
    launch_elementwise,
    launch_options,
    load_block,
    on_device,
    store_block,
)
from .pack import _to_bf16


@triton.jit
def _to_param(v, x_ptr, HW_BF16: tl.constexpr):
    """v (x's compute dtype) as x's dtype: unchanged for fp32 / fp64 x; a bf16 x as torch converts
    on the device (pack's ``_to_bf16``); an fp16 x rounded to nearest even (cvt.rn.f16.f32)."""
    if x_ptr.dtype.element_ty == tl.bfloat16:
        return _to_bf16(v, HW_BF16)
    elif x_ptr.dtype.element_ty == tl.float16:
        return v.to(tl.float16, fp_downcast_rounding="rtne")
    else:
        return v


@triton.jit
def _outer_step(g, u, d, lr, momentum, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr):
    """(g_new, u_new) of torch.optim.SGD with dampening 0, rounded op for op as its
    ``_single_tensor_sgd`` does (and as csrc's ``sgd_step``):

        u.mul_(μ).add_(Δ̄)          u = μ·u + Δ̄            two roundings
        Δ̄.add(u, alpha=μ)          step = fma(μ, u, Δ̄)    one: torch's add-with-alpha is an FMA
        g.add_(step, alpha=−η)     g = fma(−η, step, g)   one

    (launches disable contraction, so only these explicit FMAs fuse). u_new = u without momentum."""
    if HAS_MOMENTUM:
        u = momentum * u + d
        if NESTEROV:
            step = tl.fma(momentum, u, d)
        else:
            step = u
    else:
        step = d
    return tl.fma(-lr, step, g), u


@triton.jit
def _load_and_step(
    g_ptr,
    u_ptr,
    avg_ptr,
    offs,
    n,
    lr,
    momentum,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Load g, Δ̄ (widened exactly to g's dtype) and u (only with momentum), and take the outer
    step: (g_new, u_new) in g's dtype."""
    g = load_block(g_ptr, offs, n, MASKED)
    dt = g.dtype
    d = load_block(avg_ptr, offs, n, MASKED).to(dt)
    if HAS_MOMENTUM:
        u = load_block(u_ptr, offs, n, MASKED)
    else:
        u = d  # placeholder, neither used nor stored
    g_new, u_new = _outer_step(g, u, d, tl.cast(lr, dt), tl.cast(momentum, dt), HAS_MOMENTUM, NESTEROV)
    return g_new, u_new


@triton.jit
def _lam_effective(lam, sums_ptr):
    """λ_eff = λ·√s0/√s1 in float64 from sums = [s0, s1]; 0 when s1 == 0 or λ == 0. The same
    operations in the same order as ``lam_effective`` in ops/outer_merge.py, each correctly
    rounded (sqrt.rn.f64, mul.rn.f64, div.rn.f64 in the PTX; numpy's under the interpreter), so
    the value is the host's bit for bit. The zero case divides by 1, not by 0, only to keep inf
    and NaN out of the discarded lane."""
    s0 = tl.load(sums_ptr)
    s1 = tl.load(sums_ptr + 1)
    zero = (s1 == 0.0) | (lam == 0.0)
    scaled = lam * tl.sqrt(s0) / tl.sqrt(tl.where(s1 == 0.0, 1.0, s1))
    return tl.where(zero, 0.0, scaled)


@triton.jit
def _outer_merge_kernel(
    g_ptr,
    u_ptr,
    avg_ptr,
    x_ptr,
    sent_ptr,
    lam_sums_ptr,
    n,
    lr: tl.float64,
    momentum: tl.float64,
    alpha: tl.float64,
    one_minus_alpha: tl.float64,
    beta: tl.float64,
    lam: tl.float64,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_SENT: tl.constexpr,
    HAS_ALPHA: tl.constexpr,
    LAM_ON_DEVICE: tl.constexpr,
    HW_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """In place on (n,) g, u, x:

        u <- μ·u + Δ̄ ;  g <- g − η·(Δ̄ + μ·u  |  u  |  Δ̄) ;
        x <- (1−α)·(g + β·v − λ·v·v·(g − x_sent)) + α·x,   v = x − x_sent

    Δ̄ (avg_ptr) is g's dtype or bf16, widened exactly. HAS_SENT compiles the β/λ terms in
    (x_sent read), HAS_ALPHA the α mix (x read); HAS_MOMENTUM=False leaves u untouched.
    one_minus_alpha is 1 − α formed in fp64 by the caller, as the reference's ``(1.0 - alpha)``.
    LAM_ON_DEVICE: λ is normalized here, λ_eff = ``_lam_effective(λ, lam_sums)`` (float64 [s0, s1]
    from ``_taylor_norms_kernel``); otherwise lam_sums_ptr is not read. Full blocks run unmasked.
    x may be bf16 / fp16 beside float32 g, u, x_sent: widened exactly on load, the merge computed in
    float32, the result rounded once to nearest even on store (``_to_param``; HW_BF16 as in pack).
    """
    if LAM_ON_DEVICE:
        lam = _lam_effective(lam, lam_sums_ptr)
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    # Both specialisations are compiled and each block runs one: full blocks unmasked (vector
    # loads and stores), the last, partial one masked.
    for MASKED in tl.static_range(2):
        if (start + BLOCK > n) == MASKED:
            g_new, u_new = _load_and_step(
                g_ptr, u_ptr, avg_ptr, offs, n, lr, momentum, HAS_MOMENTUM, NESTEROV, MASKED
            )
            dt = g_new.dtype
            store_block(g_ptr, offs, g_new, n, MASKED)
            if HAS_MOMENTUM:
                store_block(u_ptr, offs, u_new, n, MASKED)
            target = g_new
            if HAS_SENT or HAS_ALPHA:
                x = load_block(x_ptr, offs, n, MASKED).to(dt)  # exact
                if HAS_SENT:
                    sent = load_block(sent_ptr, offs, n, MASKED)
                    v = x - sent
                    # Same association as the reference: (g + β·v) − ((λ·v)·v)·D.
                    merged = target + tl.cast(beta, dt) * v - tl.cast(lam, dt) * v * v * (g_new - sent)
                    if LAM_ON_DEVICE:
                        # λ_eff can be 0 where the given λ is not; the reference then leaves the
                        # v terms out when β = 0 too (g + 0·v would turn a −0 in g into +0): so
                        # does this select.
                        target = tl.where((beta != 0.0) | (lam != 0.0), merged, target)
                    else:
                        target = merged
                target = tl.cast(one_minus_alpha, dt) * target + tl.cast(alpha, dt) * x
            store_block(x_ptr, offs, _to_param(target, x_ptr, HW_BF16), n, MASKED)


#: Elements per program and loop step of ``_taylor_norms_kernel`` on a GPU: 8 per thread with 4
#: warps. It keeps two float64 accumulators per element live across the loop on top of five
#: loaded streams, so GPU_BLOCK (16 per thread) needed 212 registers per thread on sm_90 (252 for
#: fp64), and PROGRAMS_PER_SM programs of 128 threads did not fit an SM's 64K registers. 1024:
#: at most 100 with aligned data, 128 with unaligned views (every variant on sm_80 and sm_90,
#: ``aot_check`` prints them), so 4 programs of 128 threads fit.
TAYLOR_GPU_BLOCK = 1024


@triton.jit
def _taylor_norms_kernel(
    g_ptr,
    u_ptr,
    avg_ptr,
    x_ptr,
    sent_ptr,
    dst_ptr,
    n,
    lr: tl.float64,
    momentum: tl.float64,
    NPROG,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    FINAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program p of NPROG sums, over blocks p, p+NPROG, … in order and lane-wise in float64,

        Σ v²  and  Σ (v·v·D)²,   v = x − x_sent,  D = g_new − x_sent,

    for the g_new the outer step would produce (computed in registers, nothing mutated). v and D
    are formed in the data dtype, then widened, as in ``taylor_norms_ref``. FINAL (NPROG == 1):
    dst[0] += Σ v², dst[1] += Σ (v·v·D)² (dst = out); otherwise dst[p] and dst[NPROG + p] get
    the partials, summed by ``_taylor_norms_finish_kernel``. No float atomics: bit-identical
    from call to call for a fixed NPROG."""
    pid = tl.program_id(0)
    acc_v = tl.full([BLOCK], 0.0, tl.float64)
    acc_c = tl.full([BLOCK], 0.0, tl.float64)
    for start in range(pid.to(tl.int64) * BLOCK, n, NPROG * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        for MASKED in tl.static_range(2):  # full blocks unmasked, as in _outer_merge_kernel
            if (start + BLOCK > n) == MASKED:
                # masked lanes give v = 0, so they add nothing
                g_new, _ = _load_and_step(
                    g_ptr, u_ptr, avg_ptr, offs, n, lr, momentum, HAS_MOMENTUM, NESTEROV, MASKED
                )
                x = load_block(x_ptr, offs, n, MASKED).to(g_new.dtype)  # exact
                sent = load_block(sent_ptr, offs, n, MASKED)
                v = (x - sent).to(tl.float64)
                corr = v * v * (g_new - sent).to(tl.float64)
                acc_v += v * v
                acc_c += corr * corr
    if FINAL:
        tl.store(dst_ptr, tl.load(dst_ptr) + block_sum(acc_v))
        tl.store(dst_ptr + 1, tl.load(dst_ptr + 1) + block_sum(acc_c))
    else:
        tl.store(dst_ptr + pid, block_sum(acc_v))
        tl.store(dst_ptr + NPROG + pid, block_sum(acc_c))


@triton.jit
def _taylor_norms_finish_kernel(partial_ptr, out_ptr, NPROG, P_BLOCK: tl.constexpr):
    """out[0] += Σ_p partial[p], out[1] += Σ_p partial[NPROG + p]: one fixed-shape sum each."""
    p = tl.arange(0, P_BLOCK)
    sv = block_sum(tl.load(partial_ptr + p, mask=p < NPROG, other=0.0))
    sc = block_sum(tl.load(partial_ptr + NPROG + p, mask=p < NPROG, other=0.0))
    tl.store(out_ptr, tl.load(out_ptr) + sv)
    tl.store(out_ptr + 1, tl.load(out_ptr + 1) + sc)


def launch_outer_merge(
    g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_sums=None
) -> None:
    """Outer SGD/Nesterov step then merge, in place on g, u (only if momentum ≠ 0) and x.

    g, u, x (and x_sent): contiguous, n elements, one fp32/fp64 dtype; delta_avg: n elements of
    that dtype or bf16. x_sent may be None only when beta == lam == 0. Allocates nothing and reads
    nothing on the host; n == 0 is a no-op.

    lam_sums: None, and λ is used as given (absolute); or the float64 (2,) tensor
    [Σ v², Σ (v⊙v⊙D)²] on g's device that ``launch_taylor_norms`` filled for these operands, and
    the kernel uses λ_eff = λ·√s0/√s1 (0 when s1 == 0 or λ == 0), formed on the device exactly as
    ops/outer_merge.py's ``lam_effective`` forms it on the host. Normalized mode is then

        sums = torch.zeros(2, dtype=torch.float64, device=g.device)
        launch_taylor_norms(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, sums)
        launch_outer_merge(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, sums)

    with no host synchronisation.
    """
    n = g.numel()
    if n == 0:
        return
    has_sent = beta != 0.0 or lam != 0.0
    if has_sent and x_sent is None:
        raise ValueError("x_sent is required when beta or lam is non-zero")
    if lam_sums is not None:
        if lam_sums.dtype != torch.float64 or lam_sums.numel() != 2 or lam_sums.device != g.device:
            raise ValueError(
                "lam_sums must be the float64 (2,) tensor of launch_taylor_norms on g's device, got "
                f"{lam_sums.dtype} {tuple(lam_sums.shape)} on {lam_sums.device}"
            )
    lam_on_device = lam_sums is not None and lam != 0.0  # λ = 0 needs no sums: λ_eff = 0 = λ
    launch_elementwise(
        _outer_merge_kernel,
        g,
        n,
        g,
        u,
        delta_avg,
        x,
        x_sent if has_sent else x,
        lam_sums if lam_on_device else g,
        n,
        float(lr),
        float(momentum),
        float(alpha),
        1.0 - float(alpha),
        float(beta),
        float(lam),
        HAS_MOMENTUM=momentum != 0.0,
        NESTEROV=bool(nesterov) and momentum != 0.0,  # irrelevant without momentum: one variant
        HAS_SENT=has_sent,
        HAS_ALPHA=alpha != 0.0,
        LAM_ON_DEVICE=lam_on_device,
        HW_BF16=x.dtype == torch.bfloat16 and hardware_bf16(g),
    )


def launch_taylor_norms(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, out, *, programs=None) -> None:
    """Add [Σ v², Σ (v⊙v⊙D)²] into `out`, a float64 (2,) tensor zeroed by the caller.

    Same operands as ``launch_outer_merge``; nothing but `out` is written. Deterministic (no
    float atomics): one program on the interpreter; on a GPU ``programs`` (default a few per SM)
    each sum a strided set of blocks into a 2·programs float64 scratch (a few KB, the one
    allocation), which a second launch adds into `out` in a fixed order.
    """
    n = g.numel()
    if n == 0:
        return
    block = block_size(g, n, TAYLOR_GPU_BLOCK)
    if programs is None:
        programs = min(gpu_programs(g) if not interpreted(g) else 1, triton.cdiv(n, block))
    nprog = int(programs)
    if nprog < 1:
        raise ValueError(f"programs must be >= 1, got {nprog}")
    flags = dict(HAS_MOMENTUM=momentum != 0.0, NESTEROV=bool(nesterov) and momentum != 0.0, BLOCK=block)
    with on_device(g):
        if nprog == 1:
            _taylor_norms_kernel[(1,)](
                g,
                u,
                delta_avg,
                x,
                x_sent,
                out,
                n,
                float(lr),
                float(momentum),
                1,
                FINAL=True,
                **flags,
                **launch_options(g),
            )
            return
        partial = torch.empty(2 * nprog, dtype=torch.float64, device=g.device)
        _taylor_norms_kernel[(nprog,)](
            g,
            u,
            delta_avg,
            x,
            x_sent,
            partial,
            n,
            float(lr),
            float(momentum),
            nprog,
            FINAL=False,
            **flags,
            **launch_options(g),
        )
        _taylor_norms_finish_kernel[(1,)](
            partial, out, nprog, P_BLOCK=triton.next_power_of_2(nprog), **launch_options(out, warps=1)
        )
