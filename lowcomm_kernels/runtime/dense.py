"""Dense fragment syncs (DiLoCo, Streaming DiLoCo; CoCoDC builds on this): send, overlap, apply.

One sync of fragment p (docs/algorithms.md), sent after inner step t and applied after step t + τ:

    send   Δ_p, x_sent ← pack(g_p, x_p)               one pass; Δ in the wire dtype
           all-reduce SUM of [Δ_p] and of a tiny fp64 control vector (per-rank non-finite counts
           and view checks, then strategy extras)
    ...    τ inner steps run while the collective is in flight
    apply  Δ̄_p = ΣΔ_p / M; outer_merge_(g_p, u_p, Δ̄_p, x_p, x_sent): Nesterov outer step on
           (g_p, u_p), then x_p ← (1−α)(g_new + β·v − λ·v⊙v⊙D) + α·x_p

The apply step is fixed (t + τ) whatever the wall clock did, so training is deterministic; if the
result is late the wait is counted as exposed communication. τ = 0 is blocking (DiLoCo).
If the control vector says any rank had a non-finite Δ, every rank skips the outer step (g, u
unchanged) and resets x_p ← g_p; a rank whose parameters or inner-optimizer state hold non-finite
values anywhere restarts entirely: x ← g for every fragment, the snapshots of its in-flight syncs
← g (so their merges land on g_new), and its inner-optimizer state cleared (see ``Strategy``).
Finite Δs can still overflow in the sum or the outer step: the control vector also carries
max|Δ_p|, max|g_p| and max|u_p| (``_step_facts``), and where their bound on the outer step comes
near the dtype's limit the merge is checked, and a result whose g or u is not finite (or g beyond
the parameters' dtype) is skipped on every rank with g and u restored (``_apply``).
All ranks start from rank 0's parameters (broadcast at construction), so g is identical everywhere.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import ops
from .._checks import integer, scalar
from . import topk_wire
from .base import Strategy, abs_max, nvtx, tensor_hash
from .checkpoint import CheckpointError, expect_int, expect_tensor
from .compression import check_result, pack_quantized, result_form, to_average_
from .eager import OuterOverlap, check_outer_delay, resolve_outer_delay
from .eager import validate_state as validate_overlap_state
from .schedule import check_streaming_schedule, diloco_sends, fragment_schedule, streaming_offsets
from .transport import Handle


@dataclass
class Pending:
    """A sync that was sent and not yet applied (its result may already have arrived)."""

    fragment: int
    send_step: int
    apply_step: int
    delta: torch.Tensor  # wire dtype: summed in place by a dense all-reduce, averaged by a quantized one
    x_sent: torch.Tensor | None  # snapshot of x_p at send (outer device); None when the merge needs none
    control: torch.Tensor  # fp64 [per-rank facts (Strategy._control), strategy extras...], summed in place
    handle: Handle | None  # None once restored from a checkpoint (already complete)
    reason: str = "schedule"
    pack_s: float = 0.0
    exposed_s: float = 0.0  # accumulated by drain() before the apply
    in_flight_s: float = 0.0
    wire_bytes: int = 0
    control_host: list[float] | None = None  # restored from a checkpoint: the reduced control
    # what delta holds (compression.result_form): its wire format, and how many ranks' Δ it sums
    wire_format: str = ""
    summed_over: int = 1
    # the full-size wire buffers this sync's tensors are cut from, kept for a later send once it
    # is applied (DenseStrategy._take_buffers); empty when its tensors were allocated for it alone
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def nbytes(self) -> int:
        n = self.delta.numel() * self.delta.element_size()
        return n + (self.x_sent.numel() * self.x_sent.element_size() if self.x_sent is not None else 0)


#: outer_merge_'s knobs of the merge into x, and the argument that sets each
MERGE_KNOBS = {
    "alpha": "StreamingDiLoCo's fragment_update_alpha",
    "beta": "CoCoDC (fixed at 1)",
    "lam": "CoCoDC's lam",
    "lam_mode": "CoCoDC's lam_mode",
}


class DenseStrategy(Strategy):
    """Shared engine; subclasses choose when to send which fragment (``_sends_at``) and the merge."""

    needs_snapshot = False  # the merge reads x_sent (β or λ non-zero)
    local_keys: tuple[str, ...] = ()  # schedule-state keys that legitimately differ between ranks

    def __init__(
        self,
        model,
        inner_optimizer,
        *,
        num_fragments: int,
        fragment_sync_delay: int,
        outer_lr: float,
        outer_momentum: float,
        nesterov: bool = True,
        merge: dict[str, Any] | None = None,
        eager: bool = False,
        outer_delay: str = "none",
        **common: Any,
    ) -> None:
        # an outer step overlapped with the next round (runtime.eager), where the method takes it
        self.outer_delay = resolve_outer_delay(eager, outer_delay)
        check_outer_delay(
            self.outer_delay, type(self).__name__, fragment_sync_delay=fragment_sync_delay,
            ft=common.get("manager") is not None, wire_dtype=common.get("wire_dtype"),
        )  # fmt: skip
        # the merge's knobs are each subclass's own (its named arguments fill ``merge``): one given
        # through **common would silently change another method's merge
        for knob, owner in MERGE_KNOBS.items():
            if knob in common:
                raise TypeError(
                    f"{type(self).__name__} takes no {knob}: that merge knob is set by {owner} only, "
                    f"and here it would silently change {type(self).__name__}'s merge"
                )
        super().__init__(model, inner_optimizer, num_fragments=num_fragments, **common)
        self.tau = integer("fragment_sync_delay", fragment_sync_delay, lo=0)
        self.outer_lr = scalar("outer_lr", outer_lr, lo=0.0)
        self.outer_momentum = scalar("outer_momentum", outer_momentum, lo=0.0, hi=1.0, hi_open=True)
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov must be a bool, got {type(nesterov).__name__}")
        self.nesterov = nesterov
        self.merge_kw: dict[str, Any] = {"alpha": 0.0, "beta": 0.0, "lam": 0.0, "lam_mode": "absolute"}
        self.merge_kw.update(merge or {})

    def _init_buffers(self) -> None:
        """Call at the end of a subclass constructor, after all configuration checks passed."""
        self._join_group()
        self.g = self._outer_buffer()
        self.g.copy_(self.frags.flat)
        self.u = self._outer_buffer()
        self.pending: list[Pending] = []
        self.metrics.extra_memory_bytes = 2 * self.g.numel() * self.g.element_size()
        # error feedback: this worker's quantization error per fragment (runtime.compression)
        self.residual = self._outer_buffer() if self.error_feedback else None
        if self.residual is not None:
            self.metrics.residual_bytes = self.residual.numel() * self.residual.element_size()
            self.metrics.extra_memory_bytes += self.metrics.residual_bytes
        self.overlap = None if self.outer_delay == "none" else OuterOverlap(self, self.outer_delay, self.H)
        self.applied_count = 0
        self._overflow_streak = 0  # consecutive syncs whose outer step overflowed (_overflowed)
        # The wire buffers of applied syncs, for later sends (_take_buffers; CPU only). On the CPU a
        # fresh large buffer is a fresh mapping whose first write faults in every page: a pack of 8M
        # fp32 elements into new buffers took 2.2x as long as into reused ones (bench/send_buffers.py).
        # Every set is sized for the largest fragment and cut to the one it serves, so as many are
        # kept as syncs were in flight at once. GPUs keep none: the caching allocator already reuses
        # freed memory, and there a kept set would only take memory from the activations.
        self._spare: list[dict[str, torch.Tensor]] = []
        self._largest_fragment = max(self.frags.sizes(), default=0)

    # ----- schedule (subclasses) -----------------------------------------------------------------
    @abc.abstractmethod
    def _sends_at(self, t: int) -> list[tuple[int, str]]:
        """(fragment, reason) pairs to send after inner step t, in order."""

    def _config_fields(self) -> dict[str, Any]:
        return {
            "fragment_sync_delay": self.tau,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "nesterov": self.nesterov,
            "outer_delay": self.outer_delay,
            **self.merge_kw,
            **self._schedule_fields(),
        }

    @abc.abstractmethod
    def _schedule_fields(self) -> dict[str, Any]:
        """The schedule's knobs (sync_every, ...) for the cross-rank agreement."""

    def _control_extras(self, p: int, t: int) -> tuple[list[float], torch.Tensor | None]:
        """Strategy values all-reduced beside fragment p's sync (e.g. CoCoDC timings, scores):
        host floats, then optionally a device tensor; ``_num_extras()`` of them in all."""
        return [], None

    def _num_extras(self) -> int:
        return 0

    STEP_FACTS = 3  # control slots after the extras: Σ_r max|Δ_r|, Σ_r max|g_p|, Σ_r max|u_p|

    def _on_result(self, pd: Pending, delta_avg: torch.Tensor, control: list[float]) -> None:
        """Called with the averaged result of a sync that was applied, after its merge (CoCoDC
        updates scores here; the merge reads none of them)."""

    def _schedule_state(self) -> dict[str, Any]:
        return {}

    def _load_schedule_state(self, sd: dict[str, Any]) -> None:
        pass

    # ----- engine --------------------------------------------------------------------------------
    def _advance(self, t: int) -> None:
        for pd in self.pending:  # note completion times for in-flight / T_s measurements
            if pd.handle is not None:
                pd.handle.poll()
        self._apply_due(t)
        for p, reason in self._sends_at(t):
            self._send(p, t, reason)
        self._apply_due(t)  # τ = 0: blocking, applied in the same step

    def _apply_due(self, t: int) -> None:
        while self.pending and self.pending[0].apply_step <= t:
            self._apply(self.pending.pop(0), t)

    # ----- healing (Strategy's hooks, runtime.ft) --------------------------------------------------
    def load_heal_state(self, sd: dict[str, Any]) -> str:
        self.load_state_dict(sd)
        with torch.no_grad():
            self.frags.flat.copy_(self.to_model(self.g))
        return "the global"

    def replay(self, t: int) -> None:
        sent = {pd.fragment for pd in self.pending if pd.send_step == t}
        for p, reason in self._replayed_sends(t):
            if p not in sent:
                self._send(p, t, reason)
        self._apply_due(t)

    def _replayed_sends(self, t: int) -> list[tuple[int, str]]:
        """The sends of step t as the peers chose them before their state was read (``replay``):
        a pure function of t unless the schedule decides at run time (CoCoDC)."""
        return self._sends_at(t)

    def restart_from_shared(self) -> None:
        with torch.no_grad():
            self.frags.flat.copy_(self.to_model(self.g))
        self.clear_inner_state()

    def _send(self, p: int, t: int, reason: str) -> None:
        if any(pd.fragment == p for pd in self.pending):
            raise RuntimeError(f"fragment {p} is already in flight at step {t} (schedule bug)")
        t0 = time.perf_counter()
        # Pack runs on the compute stream: the next inner step overwrites x, so it has to wait for the
        # pack either way; only the collective gains from the side stream (Transport.all_reduce).
        with nvtx("pack"):
            g_p = self.frags.slice(self.g, p)
            x_p = self.frags.x(p)
            x_src = self.to_outer(x_p)
            buffers, out = self._take_buffers(g_p.numel())
            if self.sparse is not None:  # the top-k of Δ + e, e updated (runtime.topk_wire)
                e_p = self.frags.slice(self.residual, p)
                payload, snap, nonfinite, scales = topk_wire.encode(
                    self.wire, g_p, x_src, e_p, snapshot=self.needs_snapshot, reuse=out
                )
            elif self.quantized is not None:  # codes + scales (runtime.compression)
                res = None if self.residual is None else self.frags.slice(self.residual, p)
                codes, scales, snap, nonfinite = pack_quantized(
                    g_p, x_src, self.wire, residual=res, snapshot=self.needs_snapshot, reuse=out
                )
            else:
                snap_out = out.get("snapshot") if self.needs_snapshot else False
                delta, snap, nonfinite = ops.pack(
                    g_p, x_src, wire_dtype=self.wire_dtype, delta_out=out.get("delta"), snapshot_out=snap_out
                )
            # the fragment's inner-optimizer state and the model's buffers count too: a finite x
            # beside an inf Adam moment or a NaN running mean is a poisoned rank all the same
            nonfinite = nonfinite.to(self.device, torch.float64) + self._hidden_nonfinite(
                self.frags.params[p]
            )
            if self.quantized is None and self.sparse is None:
                delta = self.to_model(delta)
            # what bounds the outer step at apply; last in the control vector
            peak = scales if self.quantized is not None or self.sparse is not None else delta
            facts = self._step_facts(peak, g_p, self.frags.slice(self.u, p))
            extras, dev_extras = self._control_extras(p, t)
            if dev_extras is not None:
                facts = torch.cat([dev_extras.reshape(-1).to(torch.float64), facts])
            control = self._control(nonfinite, t, extras, facts)
        pack_s = time.perf_counter() - t0
        if self.overlap is not None:  # this worker's Δ as sent, before the all-reduce sums into it
            share = self.overlap.sent_share(p, delta if self.quantized is None else (codes, scales))
        name = f"{self.method} sync of fragment {p} sent at step {t}"
        if self.sparse is not None:  # every rank's payload decoded and summed into handle.result
            handle = self.sparse.start(
                self.to_model(payload), g_p.numel(), control=control, name=name,
                out_dtype=self.wire_dtype, out=out.get("result"),
            )  # fmt: skip
            delta = handle.result
        elif self.quantized is not None:  # averaged on arrival into handle.result, in the outer dtype
            handle = self.quantized.start(
                self.to_model(codes), self.to_model(scales), g_p.numel(), control=control, name=name,
                out_dtype=self.wire_dtype, out=out.get("result"),
            )  # fmt: skip
            delta = handle.result
        else:
            handle = self.transport.all_reduce(
                [delta, control], name=name, host=control, payload_bytes=delta.numel() * delta.element_size()
            )
        fmt, summed_over = result_form(self.wire, self.world)
        pd = Pending(
            p, t, t + self.tau, delta, snap, control, handle, reason, pack_s, wire_bytes=handle.wire_bytes,
            wire_format=fmt, summed_over=summed_over, buffers=buffers,
        )  # fmt: skip
        self.pending.append(pd)
        inflight = sum(q.nbytes() for q in self.pending)
        self.metrics.peak_inflight_bytes = max(self.metrics.peak_inflight_bytes, inflight)
        if self.overlap is not None:  # the outer step of this send, collected a round later
            self.overlap.after_send(pd, share)

    def _step_facts(self, peak: torch.Tensor, g_p: torch.Tensor, u_p: torch.Tensor) -> torch.Tensor:
        """[max|Δ| this rank sends, max|g_p|, max|u_p|] as fp64 on the model's device, no host read;
        ``peak`` is Δ, or a quantized Δ's scales (|code value| <= qmax)."""
        scale = 1.0 if self.quantized is None else self.wire.quant.qmax

        def amax(t: torch.Tensor) -> torch.Tensor:
            return abs_max(t).to(self.device, torch.float64)

        return torch.stack([amax(peak) * scale, amax(g_p), amax(u_p)])

    def _step_fits(self, control: list[float]) -> bool:
        """Whether this sync's outer step surely stays within range, bounded from the summed facts
        of ``_step_facts`` (identical on every rank, so every rank decides alike): the wire sum within
        its dtype, and u_new = μu + Δ̄ and g_new = g − η(Δ̄ + μ·u_new) within half the limit of g's dtype
        and the parameters' (the halves absorb the rounding of every step). False: check the result."""
        A, G, U = (v / self.world for v in control[-self.STEP_FACTS :])  # G, U: the same on every rank
        wire = torch.float32 if self.quantized is not None else self.wire_dtype  # quantized: fp32 sums
        limit = min(torch.finfo(self.frags.master_dtype).max, torch.finfo(self.frags.dtype).max) / 2
        mu = self.outer_momentum
        u_new = mu * U + A if mu else U
        step = (A + mu * u_new if self.nesterov else u_new) if mu else A
        return (
            A * self.world <= torch.finfo(wire).max / 2
            and u_new <= limit
            and G + self.outer_lr * step <= limit
        )

    def _step_failed(self, g_p: torch.Tensor, u_p: torch.Tensor) -> bool:
        """The merged g_p or u_p is not finite, or g_p does not fit the parameters' dtype (x ← g
        could not restart from it). A host read, only where ``_step_fits`` could not vouch."""
        xmax = torch.finfo(self.frags.dtype).max
        return not (bool(torch.isfinite(u_p).all()) and float(g_p.abs().max()) <= xmax)

    def _take_buffers(self, n: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(a full-size set of wire buffers, its tensors cut to a fragment of n elements): a set an
        applied sync left, or a new one; ({}, {}) (the ops allocate) off the CPU, and when the outer
        state is on another device than the model (the payload is copied across on send)."""
        if self.outer_dev.type != "cpu" or self.outer_dev != self.device:
            return {}, {}
        full = self._spare.pop() if self._spare else self._new_buffers()
        q = self.wire.quant
        size = {
            "codes": q.payload_bytes(n) if q is not None else 0,
            "scales": q.num_scales(n, self.wire.block) if q is not None else 0,
        }
        return full, {k: v[: size.get(k, n)] for k, v in full.items()}

    def _new_buffers(self) -> dict[str, torch.Tensor]:
        n, dev, q = self._largest_fragment, self.outer_dev, self.wire.quant
        out = {}
        if q is not None:  # the codes and scales sent, and the average received (runtime.compression)
            out["codes"] = torch.empty(q.payload_bytes(n), dtype=torch.uint8, device=dev)
            out["scales"] = torch.empty(q.num_scales(n, self.wire.block), dtype=torch.float32, device=dev)
            out["result"] = torch.empty(n, dtype=self.wire_dtype, device=dev)
        else:  # Δ, summed in place by the all-reduce (top-k: Δ before its encoding)
            out["delta"] = torch.empty(n, dtype=self.wire_dtype, device=dev)
        if self.sparse is not None:  # the sum of the decoded payloads
            out["result"] = torch.empty(n, dtype=self.wire_dtype, device=dev)
        if self.needs_snapshot:
            out["snapshot"] = torch.empty(n, dtype=self.g.dtype, device=dev)
        return out

    def _wait(self, pd: Pending) -> None:
        if pd.handle is not None and not pd.handle.waited:
            pd.exposed_s += pd.handle.wait()
            pd.in_flight_s = pd.handle.in_flight_s

    def _drain(self) -> None:
        for pd in self.pending:
            self._wait(pd)

    def _finish(self) -> None:
        while self.pending:
            self._apply(self.pending.pop(0), self.step_count)

    def _apply(self, pd: Pending, t: int) -> None:
        if self.overlap is not None:  # its outer step was taken at send: keep the average for the next
            return self.overlap.collect(pd, t)
        self._wait(pd)
        p = pd.fragment
        # the skip decision must be known on the host: read from the pinned mirror, no sync
        control = pd.handle.host_values() if pd.handle is not None else pd.control_host
        t0 = time.perf_counter()
        what = f"{self.method} sync of fragment {p} sent at step {pd.send_step}"
        skipped = self._sync_outcome(control, what)
        with nvtx("merge"):
            g_p, u_p, x_p = self.frags.slice(self.g, p), self.frags.slice(self.u, p), self.frags.x(p)
            if skipped:
                x_p.copy_(self.to_model(g_p))
                if self.residual is not None:  # on every rank: carry no poisoned error forward
                    self.frags.slice(self.residual, p).zero_()
                self._heal_buffers([r for r in range(self.world) if control[r] > 0])
                if self._poisoned():
                    self._restart_poisoned()
            else:
                # as the run that sent it would (a result restored under another wire or world too)
                delta = to_average_(pd.delta, pd.summed_over)
                delta, x_work = self.to_outer(delta), self.to_outer(x_p)
                # near the dtype's limit, keep g and u to restore if the outer step overflows
                kept = None if self._step_fits(control) else (g_p.clone(), u_p.clone())
                self._merge(pd, g_p, u_p, delta, x_work)
                if kept is not None and self._step_failed(g_p, u_p):
                    skipped = True
                    g_p.copy_(kept[0])
                    u_p.copy_(kept[1])
                    x_p.copy_(self.to_model(g_p))
                    if self.residual is not None:  # as at any skip: no error of a dropped Δ carried on
                        self.frags.slice(self.residual, p).zero_()
                    self._overflowed(what)
                else:
                    self._on_result(pd, delta, self._extras(control))
                    self._overflow_streak = 0
                    if x_work is not x_p:
                        x_p.copy_(self.to_model(x_work))
        self.applied_count += 1
        if pd.buffers:  # the collective finished (_wait) and the merge has read them: free for a send
            self._spare.append(pd.buffers)
        self._record_sync(pd, t, t0, fragment=p, skipped=skipped, reason=pd.reason)

    def _merge(
        self, pd: Pending, g_p: torch.Tensor, u_p: torch.Tensor, delta: torch.Tensor, x_work: torch.Tensor
    ) -> None:
        """The receive side of fragment ``pd.fragment``'s sync: the outer step and the merge into x
        (CoCoDC overrides it for its per-tensor λ and its controls of the Taylor term)."""
        ops.outer_merge_(
            g_p,
            u_p,
            delta,
            x_work,
            pd.x_sent,
            lr=self.outer_lr,
            momentum=self.outer_momentum,
            nesterov=self.nesterov,
            **self.merge_kw,
        )

    def _overflowed(self, what: str) -> None:
        """Every rank: the outer step of a finite result overflowed and was undone. Skipped like a
        non-finite sync; on_nonfinite='raise', or max_nonfinite_syncs of them in a row, stop."""
        self._overflow_streak += 1
        msg = (
            f"{what}: every rank sent finite values but the outer step overflowed (g or u not finite, "
            "or g beyond the parameters' dtype); every rank skips this sync with g and u kept, and the "
            "fragment restarts from the last good global"
        )
        if self.on_nonfinite == "raise" or self._overflow_streak >= self.max_nonfinite_syncs:
            raise FloatingPointError(
                msg
                if self.on_nonfinite == "raise"
                else f"{msg}; {self._overflow_streak} syncs in a row "
                "(max_nonfinite_syncs), stopping every rank (check outer_lr and the inner learning rate)"
            )
        self.log.warning(msg)

    def _restart_poisoned(self) -> None:
        """This rank holds non-finite values: restart it entirely from the last good global."""
        self.frags.flat.copy_(self.to_model(self.g))
        if self.residual is not None:
            self.residual.zero_()
        for pd in self.pending:
            if pd.x_sent is not None:
                pd.x_sent.copy_(self.frags.slice(self.g, pd.fragment))
        self._restarted("from the last good global")

    # ----- checkpoint / guard --------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "g": self.g.detach().cpu().clone(),
            "u": self.u.detach().cpu().clone(),
            "applied_count": self.applied_count,
            "pending": [
                {
                    "fragment": pd.fragment,
                    "send_step": pd.send_step,
                    "apply_step": pd.apply_step,
                    "delta": pd.delta.detach().cpu().clone(),
                    "wire_format": pd.wire_format,
                    "summed_over": pd.summed_over,
                    "control": pd.control.detach().cpu().clone(),
                    "x_sent": None if pd.x_sent is None else pd.x_sent.detach().cpu().clone(),
                    "reason": pd.reason,
                }
                for pd in self.pending
            ],
            "schedule": self._schedule_state(),
            "residual": None if self.residual is None else self.residual.detach().cpu().clone(),
            "outer_delay": None if self.overlap is None else self.overlap.state(),
        }

    def _validate_state(self, sd: dict[str, Any]) -> None:
        n, dt = self.frags.numel, self.frags.master_dtype  # the master copy's (float32 for bf16 / fp16 x)
        for key in ("g", "u"):
            expect_tensor(key, sd.get(key), (n,), dt)
        expect_int("applied_count", sd.get("applied_count"), 0)
        pending = sd.get("pending")
        if not isinstance(pending, list) or len(pending) > self.frags.num_fragments:
            raise CheckpointError(
                f"checkpoint entry pending should be a list of at most {self.frags.num_fragments} syncs"
            )
        width = self.FACTS * self.world + self._num_extras() + self.STEP_FACTS
        seen: set[int] = set()
        for i, q in enumerate(pending):
            if not isinstance(q, dict):
                raise CheckpointError(f"checkpoint entry pending[{i}] should be a dict")
            f = expect_int(f"pending[{i}].fragment", q.get("fragment"), 0, self.frags.num_fragments - 1)
            if f in seen:
                raise CheckpointError(f"checkpoint entry pending[{i}]: fragment {f} is in flight twice")
            seen.add(f)
            size = self.frags.sizes()[f]
            send = expect_int(f"pending[{i}].send_step", q.get("send_step"), 0)
            apply = expect_int(f"pending[{i}].apply_step", q.get("apply_step"), send)
            due = self._due_by(f, sd["step"])
            if due is not None and apply > due:
                raise CheckpointError(
                    f"checkpoint entry pending[{i}]: fragment {f}'s sync sent at step {send} lands at step "
                    f"{apply}, after this strategy sends again at step {due}: the checkpoint was written "
                    "with another schedule (sync_every, fragments, fragment_sync_delay); resume it with "
                    "that schedule, or checkpoint when no sync is in flight"
                )
            check_result(f"pending[{i}]", q, "delta", size, dt)  # in the wire format it was sent in
            expect_tensor(f"pending[{i}].control", q.get("control"), (width,), torch.float64)
            if q.get("x_sent") is not None or self.needs_snapshot:
                expect_tensor(f"pending[{i}].x_sent", q.get("x_sent"), (size,), dt)
        if not isinstance(sd.get("schedule"), dict):
            raise CheckpointError("checkpoint entry schedule should be a dict")
        if self.residual is not None:  # error feedback: this worker's residual, the outer state's dtype
            expect_tensor("residual", sd.get("residual"), (n,), self.residual.dtype)
        validate_overlap_state(self, sd)

    def _next_send(self, p: int, after: int) -> int | None:
        """The first step after ``after`` at which this schedule sends fragment p; None where the
        schedule is decided at run time (CoCoDC)."""
        return None

    def _due_by(self, p: int, step: int) -> int | None:
        """The last step at which fragment p's sync, in flight after step ``step``, may land under this
        schedule (a checkpoint's pending results are held to it): the fragment's next send under an
        overlapped outer round, else the next send of any fragment (τ < H/K); None if not known."""
        if self.overlap is not None:
            return self._next_send(p, step)
        sends = [self._next_send(f, step) for f in range(self.frags.num_fragments)]
        return None if None in sends else min(s for s in sends if s is not None)

    def _load_state(self, sd: dict[str, Any]) -> None:
        self.g.copy_(sd["g"])
        self.u.copy_(sd["u"])
        self.applied_count = int(sd["applied_count"])
        self.pending = []
        for q in sd["pending"]:
            x_sent = None if q["x_sent"] is None else q["x_sent"].to(self.outer_dev)
            self.pending.append(
                Pending(
                    int(q["fragment"]),
                    int(q["send_step"]),
                    int(q["apply_step"]),
                    q["delta"].to(self.device),
                    x_sent,
                    q["control"].to(self.device),
                    None,
                    str(q["reason"]),
                    control_host=q["control"].tolist(),
                    wire_format=q["wire_format"],
                    summed_over=int(q["summed_over"]),
                )
            )
        self._load_schedule_state(sd["schedule"])
        if self.residual is not None:
            self.residual.copy_(sd["residual"])
        elif sd.get("residual") is not None:  # saved with error feedback: nothing here carries it on
            self.log.warning(
                "the checkpoint holds error-feedback residuals but this strategy has error_feedback=False: "
                "they are dropped (each rank's quantization error not yet sent, at most one per element)"
            )
        if self.overlap is not None:
            self.overlap.load(sd["outer_delay"])

    def _guard_values(self) -> list[tuple[str, int]]:
        what, shared = ("g", self.g) if self.overlap is None else self.overlap.guarded()
        vals = [
            (f"fragment {p} of {what}", tensor_hash(self.frags.slice(shared, p)))
            for p in range(self.frags.num_fragments)
        ]
        sched = repr(
            (
                self.step_count,
                [(pd.fragment, pd.send_step, pd.apply_step) for pd in self.pending],
                sorted((k, v) for k, v in self._schedule_state().items() if k not in self.local_keys),
            )
        )
        sched_bytes = torch.frombuffer(bytearray(sched.encode()), dtype=torch.uint8)
        vals.append(("schedule state", tensor_hash(sched_bytes)))
        return vals


class DiLoCo(DenseStrategy):
    """DiLoCo (Douillard et al. 2023): every ``sync_every`` inner steps, blocking, all parameters:
    Δ̄ = mean_m (g − x_m); Nesterov outer step u ← μu + Δ̄, g ← g − η(Δ̄ + μu); x ← g.

    One fragment (all parameters), τ = 0. Keywords shared by every strategy: process_group, wan,
    wire_dtype, on_nonfinite ('skip' | 'raise'), max_nonfinite_syncs, timeout_s,
    outer_device ('model' | 'cpu'), metrics_callback, guard_every (see ``Strategy``).
    ``eager=True`` / ``outer_delay='eager' | 'delayed'``: send without waiting and take the outer step
    with the paper's eager Δ̃ or the last average alone (``runtime.eager``)."""

    method = "diloco"

    def __init__(
        self,
        model,
        inner_optimizer,
        *,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        **common: Any,
    ) -> None:
        self.H = integer("sync_every", sync_every, lo=1)
        super().__init__(
            model,
            inner_optimizer,
            num_fragments=1,
            fragment_sync_delay=0,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            nesterov=nesterov,
            **common,
        )
        self._init_buffers()

    def _schedule_fields(self) -> dict[str, Any]:
        return {"sync_every": self.H}

    def _sends_at(self, t: int) -> list[tuple[int, str]]:
        return [(0, "schedule")] if diloco_sends(t, self.H) else []

    def _next_send(self, p: int, after: int) -> int | None:
        return (after // self.H + 1) * self.H


class StreamingDiLoCo(DenseStrategy):
    """Streaming DiLoCo (Douillard et al. 2025): K layer-strided fragments; fragment p is sent after
    inner steps t ≡ ⌊p·H/K⌋ (mod H), t ≥ 1, and applied τ = ``fragment_sync_delay`` steps later with
    x ← α·x_now + (1−α)·g_new (α = ``fragment_update_alpha``; 0 = overwrite, torchft's default).
    Requires τ < ⌊H/K⌋ (the per-fragment period), as torchft does, so a fragment's result is applied
    before the next fragment is sent. ``eager`` / ``outer_delay`` as DiLoCo's, per fragment (τ = 0)."""

    method = "streaming_diloco"

    def __init__(
        self, model, inner_optimizer, *, sync_every: int, num_fragments: int, fragment_sync_delay: int,
        fragment_update_alpha: float = 0.0,
        outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True, **common: Any,
    ) -> None:  # fmt: skip
        self.H, K, tau = fragment_schedule(sync_every, num_fragments, fragment_sync_delay)
        check_streaming_schedule(self.H, K, tau)
        alpha = scalar("fragment_update_alpha", fragment_update_alpha, lo=0.0, hi=1.0)
        super().__init__(
            model, inner_optimizer, num_fragments=K, fragment_sync_delay=tau,
            outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov, merge={"alpha": alpha},
            **common,
        )  # fmt: skip
        self.offsets_in_period = streaming_offsets(self.H, K)
        self._init_buffers()

    def _schedule_fields(self) -> dict[str, Any]:
        return {"sync_every": self.H}

    def _sends_at(self, t: int) -> list[tuple[int, str]]:
        r = t % self.H
        return [(p, "schedule") for p, off in enumerate(self.offsets_in_period) if r == off]

    def _next_send(self, p: int, after: int) -> int | None:
        t = after + 1
        return t + (self.offsets_in_period[p] - t) % self.H
