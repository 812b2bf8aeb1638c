"""The rules every caller must share: the choice sets and the schedule constraints of the strategies.

Owned here; the strategies check their arguments with these functions and the CLI's run
specification calls the same ones before it starts any worker, so a rule is written once. Each
check takes ``name``, which turns an argument name into the words the caller's user typed (the
identity for the Python API; ``--flag`` for the CLI).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .._checks import integer
from ..ops.outer_merge import LAM_MODES as _OP_LAM_MODES
from ..ops.outer_merge import TAYLOR_CONTROLS
from ..wire_formats import DENSE, QUANTIZED, SPARSE

# CoCoDC's λ modes: the fused op's ('absolute', 'normalized': one scale per fragment) and
# 'normalized_tensor' (one scale per parameter tensor of the fragment, as the reference code does)
LAM_MODES = (*_OP_LAM_MODES, "normalized_tensor")
SCORES = ("l2_global", "l2_rms", "l1_local", "round_robin")  # CoCoDC's fragment choice
# how CoCoDC's adaptive N gets T_c and T_s: from the emulated link and step time, or measured
TIMINGS = ("emulated", "measured")
DEFAULT_STEP_TIME_S = 0.02  # the emulated inner step of CoCoDC's timing='emulated' (20 ms)
LOSCAR_MERGES = {"delay_corrected": 1.0, "overwrite": 0.0}  # merge name -> β of the scatter-merge
# what users type -> the dense wire dtype, or the name of a quantized format (ops.quantize.FORMATS:
# codes + one fp32 scale per quant_block elements, averaged by runtime.compression); the table is
# wire_formats.TABLE
WIRE_FORMATS: dict[str, torch.dtype | str] = {
    **{s.name: s.dtype for s in DENSE},
    **{s.name: s.name for s in QUANTIZED},
}
# sparse formats, beside WIRE_FORMATS (not summed on the wire: all-gathered, runtime.topk_wire):
# "topk", the k largest entries per chunk with error feedback (ops.topk)
SPARSE_WIRE_FORMATS = tuple(s.name for s in SPARSE)

__all__ = [
    "LAM_MODES",
    "LOSCAR_MERGES",
    "SCORES",
    "TAYLOR_CONTROLS",
    "TIMINGS",
    "DEFAULT_STEP_TIME_S",
    "SPARSE_WIRE_FORMATS",
    "WIRE_FORMATS",
    "check_cocodc_schedule",
    "check_streaming_schedule",
    "cocodc_auto_syncs",
    "cocodc_max_syncs",
    "cocodc_slot",
    "diloco_sends",
    "fragment_schedule",
    "streaming_offsets",
]

Name = Callable[[str], str]


def _plain(n: str) -> str:
    return n


def fragment_schedule(sync_every: int, num_fragments: int, fragment_sync_delay: int) -> tuple[int, int, int]:
    """(H, K, τ) of a fragmented strategy, each checked: integers, H ≥ 1, K ≥ 1, τ ≥ 0."""
    return (
        integer("sync_every", sync_every, lo=1),
        integer("num_fragments", num_fragments, lo=1),
        integer("fragment_sync_delay", fragment_sync_delay, lo=0),
    )


def diloco_sends(t: int, sync_every: int) -> bool:
    """DiLoCo sends (all parameters, blocking) after inner step t when t ≡ 0 (mod H)."""
    return t % sync_every == 0


def streaming_offsets(sync_every: int, num_fragments: int) -> list[int]:
    """Streaming DiLoCo's stagger: fragment p is sent after inner steps t ≡ ⌊p·H/K⌋ (mod H), t ≥ 1."""
    return [(p * sync_every) // num_fragments for p in range(num_fragments)]


def check_streaming_schedule(
    sync_every: int, num_fragments: int, fragment_sync_delay: int, name: Name = _plain
) -> None:
    """Streaming DiLoCo: one send slot per fragment (K ≤ H), and τ < ⌊H/K⌋ so each fragment's result
    lands before the next fragment is sent."""
    H, K, tau = sync_every, num_fragments, fragment_sync_delay
    if K > H:
        raise ValueError(
            f"{name('num_fragments')}={K} must be <= {name('sync_every')}={H} (one send slot per fragment)"
        )
    if tau >= H // K:
        raise ValueError(
            f"{name('fragment_sync_delay')}={tau} must be < {name('sync_every')} // "
            f"{name('num_fragments')} = {H // K} (the per-fragment period), so each result "
            "lands before the next fragment is sent"
        )


def cocodc_max_syncs(sync_every: int, fragment_sync_delay: int) -> int:
    """⌊H/τ⌋ (H when τ = 0): at most one sync in flight per τ steps."""
    return sync_every if fragment_sync_delay == 0 else sync_every // fragment_sync_delay


def cocodc_slot(s: int, syncs: int, sync_every: int) -> bool:
    """Is there a CoCoDC send slot after step s of a period (s = 1..H)? N = ``syncs`` evenly spaced
    slots, the last at s = H: ⌊s·N/H⌋ > ⌊(s−1)·N/H⌋."""
    return (s * syncs) // sync_every != ((s - 1) * syncs) // sync_every


def cocodc_auto_syncs(
    gamma: float, sync_every: int, step_s: float, sync_s: float, num_fragments: int, max_syncs: int
) -> int:
    """CoCoDC's adaptive N = clamp(⌊γ·H·T_c/T_s⌋, K, ⌊H/τ⌋) from an inner step's time T_c =
    ``step_s`` and a fragment sync's time on the link T_s = ``sync_s`` (T_s = 0, or a ratio past
    any float: the cap ⌊H/τ⌋)."""
    ratio = gamma * sync_every * step_s / sync_s if sync_s > 0 else math.inf
    n = max_syncs if not ratio < max_syncs else math.floor(ratio)
    return max(num_fragments, n)


def check_cocodc_schedule(
    sync_every: int,
    num_fragments: int,
    fragment_sync_delay: int,
    syncs_per_period: str | int,
    name: Name = _plain,
) -> None:
    """CoCoDC: τ·K ≤ H (each fragment fits once per period) and N ∈ [K, ⌊H/τ⌋] when N is fixed."""
    H, K, tau = sync_every, num_fragments, fragment_sync_delay
    if tau * K > H:
        raise ValueError(
            f"{name('fragment_sync_delay')}={tau} is too long: {name('fragment_sync_delay')} x "
            f"{name('num_fragments')} = {tau * K} must be <= {name('sync_every')}={H} "
            "(the per-fragment period is H/K)"
        )
    if syncs_per_period == "auto":
        return
    if isinstance(syncs_per_period, bool) or not isinstance(syncs_per_period, int):
        raise ValueError(f"{name('syncs_per_period')} must be 'auto' or an int, got {syncs_per_period!r}")
    n_max = cocodc_max_syncs(H, tau)
    if not K <= syncs_per_period <= n_max:
        raise ValueError(
            f"{name('syncs_per_period')}={syncs_per_period} must lie in "
            f"[{name('num_fragments')}={K}, {name('sync_every')} // "
            f"{name('fragment_sync_delay')} = {n_max}]"
        )
