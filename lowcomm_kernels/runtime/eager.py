"""A whole outer round overlapped with the next inner phase: eager updates, and the naive delay.

DiLoCo and Streaming DiLoCo with ``outer_delay="eager"`` (Kale et al. 2025, "Eager Updates for
Overlapped Communication and Computation in DiLoCo", arXiv 2502.12996) or ``"delayed"`` (its
baseline). The rule as the paper's summaries state it (its §3 text was not at hand): M workers;
at the end of round t (fragment p's send step) worker m sends its outer gradient Δ_m^(t) without
waiting, and the average Δ^(t) = (1/M) Σ_m Δ_m^(t) arrives during round t+1. At that same step
worker m applies the outer step (and the merge into x) with

    eager     Δ̃_m^(t) = Δ^(t−1) + (Δ_m^(t) − Δ_m^(t−1)) / M     its fresh share replaces its stale one
    delayed   Δ̃^(t)   = Δ^(t−1)                                    the stale average alone

Δ^(0) = Δ_m^(0) = 0: the first round's eager step is Δ_m^(1)/M (the others' shares are not known
yet), the delayed one a zero outer gradient. The average of round t is collected at the next send
of the same fragment, before that send; a wait there is exposed communication.

Choices, each one place:

- **Δ_m is what this worker put on the wire**: the wire-dtype Δ (bf16 rounded) or the dequantized
  codes of a quantized format (after error feedback), so that the replicas' own shares are the terms
  of the average they all receive. Computed as Δ^(t−1) − Δ_m^(t−1)/M + Δ_m^(t)/M (others' stale
  shares, then the fresh one): with M = 1 the first two cancel exactly and the rule is plain DiLoCo.
- **g and u differ between replicas** under eager (each applies its own share): by the momentum-
  weighted sum of (Δ_m^(t) − Δ_m^(t−1))/M, which telescopes, so the gap stays the size of one
  round's share and does not grow. The consistency guard therefore hashes, per fragment, the last
  average every rank collected (identical everywhere) instead of g; under ``delayed`` every replica
  applies the same averages and the guard keeps hashing g.
- **A skipped sync** (some rank sent non-finite values, known to every rank from its control vector
  at collection) contributes nothing: Δ^(t−1) and Δ_m^(t−1) count as 0, as in the first round.
  A rank whose fresh Δ̃ is not finite skips its own outer step (x ← g, g and u kept); its sync is
  then skipped everywhere when collected. An outer step that overflows is undone as in ``dense``.
- **finish()** collects the in-flight averages (checks, metrics) and applies nothing: the rule uses
  an average only at the next round's outer step, which a resumed run still takes (the collected
  average is kept, and saved in checkpoints).
- **Not with**: a fragment_sync_delay (the overlap is the whole round), CoCoDC (its merge corrects
  a τ-step delay of its own), torchft's Manager (a replica that joins would need the others' stale
  shares, which no one holds).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..ops.quantize import dequantize
from .base import abs_max
from .checkpoint import CheckpointError, expect_tensor
from .compression import to_average_
from .schedule import SPARSE_WIRE_FORMATS

if TYPE_CHECKING:
    from .dense import DenseStrategy, Pending

#: what ``outer_delay`` may be: no overlap of the outer step (the method as it was), the paper's
#: eager update, or its naive delayed baseline
OUTER_DELAYS = ("none", "eager", "delayed")
#: the strategies that take ``outer_delay`` (class names)
TAKES_OUTER_DELAY = ("DiLoCo", "StreamingDiLoCo")

__all__ = [
    "OUTER_DELAYS",
    "OuterOverlap",
    "check_outer_delay",
    "refuse_replicated_save",
    "resolve_outer_delay",
]


def resolve_outer_delay(eager: object, outer_delay: object, name: Callable[[str], str] = str) -> str:
    """The mode from the two ways to ask for it: ``eager=True`` is ``outer_delay="eager"``."""
    if not isinstance(eager, bool):
        raise TypeError(f"{name('eager')} must be a bool, got {type(eager).__name__}")
    if outer_delay not in OUTER_DELAYS:
        raise ValueError(f"{name('outer_delay')} must be one of {OUTER_DELAYS}, got {outer_delay!r}")
    if eager and outer_delay not in ("none", "eager"):
        raise ValueError(
            f"{name('eager')}=True asks for outer_delay 'eager' but {name('outer_delay')} is {outer_delay!r}"
        )
    return "eager" if eager else str(outer_delay)


def check_outer_delay(
    mode: str,
    method: str,
    *,
    fragment_sync_delay: int,
    ft: bool,
    wire_dtype: object = None,
    name: Callable[[str], str] = str,
) -> None:
    """Where an overlapped outer step can run: DiLoCo or Streaming DiLoCo (``method``: the class
    name), no fragment_sync_delay, no torchft Manager, a dense or quantized ``wire_dtype`` (a sparse
    payload's own share is not read yet). Nothing to check for 'none'."""
    if mode == "none":
        return
    if method not in TAKES_OUTER_DELAY:
        raise ValueError(
            f"{method} takes no {name('outer_delay')}={mode!r}: only {' and '.join(TAKES_OUTER_DELAY)} "
            "overlap a whole outer round"
        )
    if fragment_sync_delay != 0:
        raise ValueError(
            f"{name('outer_delay')}={mode!r} overlaps the whole round (the average arrives by the next "
            f"send of the fragment), so {name('fragment_sync_delay')} must be 0, got {fragment_sync_delay}"
        )
    if isinstance(wire_dtype, str) and wire_dtype in SPARSE_WIRE_FORMATS:
        raise ValueError(
            f"{name('outer_delay')}={mode!r} is not supported with {name('wire_dtype')}={wire_dtype!r} "
            "(a sparse payload): use a dense or quantized wire format"
        )
    if ft:
        raise ValueError(
            f"{name('outer_delay')}={mode!r} is not supported with a torchft Manager: a replica that "
            "joins would need the stale shares of the average that no replica holds"
        )


class OuterOverlap:
    """The state and the steps of an overlapped outer round, for a ``DenseStrategy`` (one owner of
    the rule above; ``dense`` calls it at send, at collection and for checkpoints and the guard)."""

    def __init__(self, st: DenseStrategy, mode: str, period: int) -> None:
        self.st = st
        self.mode = mode
        self.period = period  # H: steps from a fragment's send to its next one, where it is collected
        # Δ^(t−1) per fragment: the last average collected (0 before the first, or if skipped)
        self.avg = st._outer_buffer()
        # Δ_m^(t−1) per fragment: this worker's share of the average in flight (eager only)
        self.own = st._outer_buffer() if mode == "eager" else None
        held = [t for t in (self.avg, self.own) if t is not None]
        st.metrics.extra_memory_bytes += sum(t.numel() * t.element_size() for t in held)
        self._step_s: dict[int, float] = {}  # fragment -> seconds of its last outer step

    # ----- send ----------------------------------------------------------------------------------
    def sent_share(
        self, p: int, payload: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor | None:
        """Δ_m^(t) of fragment p as it goes on the wire (a dense wire-dtype Δ, or (codes, scales)),
        in the outer state's dtype and device; read before the all-reduce sums into the payload."""
        if self.own is None:
            return None
        st = self.st
        n, dev, dt = st.frags.sizes()[p], st.g.device, st.g.dtype
        if isinstance(payload, tuple):
            codes, scales = (t.to(dev) for t in payload)
            return dequantize(codes, scales, st.wire.quant.name, st.wire.block, n, out_dtype=dt)
        return payload.to(device=dev, dtype=dt, copy=True)

    def after_send(self, pd: Pending, share: torch.Tensor | None) -> None:
        """The outer step of fragment pd.fragment at its send step, with Δ̃; the sync just sent is
        collected at the fragment's next send."""
        st, p = self.st, pd.fragment
        pd.apply_step = pd.send_step + self.period
        t0 = time.perf_counter()
        avg = st.frags.slice(self.avg, p)
        if self.own is None:
            d = avg
        else:
            own = st.frags.slice(self.own, p)
            d = avg - own / st.world  # the others' stale shares (exactly 0 for M = 1)
            d.add_(share / st.world)
            own.copy_(share)
        g_p, u_p, x_p = st.frags.slice(st.g, p), st.frags.slice(st.u, p), st.frags.x(p)
        what = f"{st.method} ({self.mode}) outer step of fragment {p} at step {pd.send_step}"
        facts = [float(abs_max(v)) for v in (d, g_p, u_p)]
        if not all(map(math.isfinite, facts)):
            # this rank's fresh share is not finite: keep g and u; every rank skips its sync later
            st.log.warning(f"{what}: this rank's outer gradient is not finite; its outer step is skipped")
            x_p.copy_(st.to_model(g_p))
            return
        x_work = st.to_outer(x_p)
        # near the dtype's limit keep g and u to restore (the bound of dense, from local facts)
        kept = None if st._step_fits([v * st.world for v in facts]) else (g_p.clone(), u_p.clone())
        st._merge(pd, g_p, u_p, d, x_work)
        if kept is not None and st._step_failed(g_p, u_p):
            g_p.copy_(kept[0])
            u_p.copy_(kept[1])
            x_p.copy_(st.to_model(g_p))
            st._overflowed(what)
        else:
            st._overflow_streak = 0
            if x_work is not x_p:
                x_p.copy_(st.to_model(x_work))
        self._step_s[p] = time.perf_counter() - t0  # recorded as merge time with the sync

    # ----- collection ------------------------------------------------------------------------------
    def collect(self, pd: Pending, t: int) -> None:
        """The average of fragment pd.fragment's last sync, waited for (exposed if late), checked
        like any sync and kept for the fragment's next outer step."""
        st, p = self.st, pd.fragment
        st._wait(pd)
        control = pd.handle.host_values() if pd.handle is not None else pd.control_host
        t0 = time.perf_counter()
        what = f"{st.method} sync of fragment {p} sent at step {pd.send_step}"
        skipped = st._sync_outcome(control, what)
        avg = st.frags.slice(self.avg, p)
        if skipped:  # this round contributes nothing: as before the first round
            avg.zero_()
            if self.own is not None:
                st.frags.slice(self.own, p).zero_()
            if st.residual is not None:  # on every rank: carry no poisoned error forward
                st.frags.slice(st.residual, p).zero_()
            st._heal_buffers([r for r in range(st.world) if control[r] > 0])
            if st._poisoned():
                st._restart_poisoned()
        else:
            # as the run that sent it would (a result restored under another wire or world too)
            avg.copy_(st.to_outer(to_average_(pd.delta, pd.summed_over)))
        st.applied_count += 1
        if pd.buffers:
            st._spare.append(pd.buffers)
        step_s = self._step_s.pop(p, 0.0)  # the outer step taken at its send counts as its merge
        st._record_sync(pd, t, t0 - step_s, fragment=p, skipped=skipped, reason=pd.reason)

    # ----- guard and checkpoints -----------------------------------------------------------------
    def guarded(self) -> tuple[str, torch.Tensor]:
        """(name, flat buffer) of the state that must be identical on every rank."""
        if self.mode == "eager":  # g differs between replicas by design (module docstring)
            return "the last collected average", self.avg
        return "g", self.st.g

    def state(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "avg": self.avg.detach().cpu().clone(),
            "own": None if self.own is None else self.own.detach().cpu().clone(),
        }

    def load(self, sd: dict[str, Any]) -> None:
        self.avg.copy_(sd["avg"])
        if self.own is not None:
            self.own.copy_(sd["own"])


def refuse_replicated_save(st: Any, what: str) -> None:
    """Refuse, by name, a save that keeps one copy of g and u for all ranks (DCP stores a tensor with
    the same name on every rank once): under eager they differ between replicas, and each worker's
    own share of the average in flight is its own, so one rank's copy would silently replace the
    others'. The delayed baseline's state is replicated and saves like any dense strategy's."""
    overlap = getattr(st, "overlap", None)
    if overlap is not None and overlap.mode == "eager":
        raise CheckpointError(
            f"{what} does not support outer_delay='eager': g, u and each worker's own share differ "
            "between replicas; use save_checkpoint / load_checkpoint (one file per rank)"
        )


def validate_state(st: DenseStrategy, sd: dict[str, Any]) -> None:
    """A checkpoint's outer-delay entry: written in the same mode as this strategy runs, with its
    buffers. A checkpoint of another mode would resume the wrong rule (its in-flight syncs are
    collected a round later than the other modes apply them), so it is refused by name."""
    entry = sd.get("outer_delay")
    if entry is not None and not isinstance(entry, dict):
        raise CheckpointError("checkpoint entry outer_delay should be None or a dict")
    mine = st.overlap.mode if st.overlap is not None else "none"
    theirs = "none" if entry is None else entry.get("mode")
    if theirs != mine:
        raise CheckpointError(
            f"checkpoint was written with outer_delay={theirs!r} but this strategy has outer_delay={mine!r}"
        )
    if st.overlap is None:
        return
    n, dt = st.frags.numel, st.frags.master_dtype
    expect_tensor("outer_delay.avg", entry.get("avg"), (n,), dt)
    if st.overlap.own is not None:
        expect_tensor("outer_delay.own", entry.get("own"), (n,), dt)
