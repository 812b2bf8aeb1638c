"""CoCoDC (Zhu et al. 2025): Streaming DiLoCo + Taylor delay compensation + adaptive transmission.

Merge (β = 1, λ): x ← g_new + v − λ_eff·v⊙v⊙D with v = x_now − x_sent, D = g_new − x_sent
(``lam_mode="normalized"``: λ_eff = λ·‖v‖/‖v⊙v⊙D‖ per fragment, done inside ``outer_merge_``;
``"normalized_tensor"``: one λ_eff per parameter tensor of the fragment, as the reference code
normalizes: one ``outer_merge_`` per tensor, each a contiguous slice; ``"absolute"``: λ as given).
Controls of the Taylor term (``taylor_control``; slow paths through ``outer_merge_control_ref``):
``"flip"`` adds the correction instead of subtracting it; ``"random"`` replaces it by a random
direction of the same norm (standard normal, seeded by ``control_seed``, the fragment and the send
step, so every rank draws the same). β = 1 with λ = 0 (local progress only) is ``lam=0``.

Send slots: N syncs per period of H steps. Period P covers steps P·H+1 .. (P+1)·H; with s = t − P·H
a slot falls after step t when ⌊s·N/H⌋ > ⌊(s−1)·N/H⌋ (N evenly spaced slots, the last at s = H).
N is fixed per period: ``syncs_per_period=int``, or "auto": N = clamp(⌊γ·H·T_c/T_s⌋, K, ⌊H/τ⌋).
``timing="emulated"`` (the default when a link model is known: ``timing_link``, else the emulated
``wan``): T_c = ``step_time_s`` and T_s = latency + ring all-reduce wire bytes of the mean fragment
/ bandwidth (the emulated link's own model), so N depends on the configuration only and a seeded run
is reproducible. ``timing="measured"`` (the default without either): T_c (inner step) and T_s
(fragment sync in flight) measured on every rank and averaged through the control all-reduce, so
every rank computes the same N (N = K until a measurement has arrived). ``n_history`` holds the N
of every period.

Which fragment at a slot, among those not in flight: (1) stale: last sent ≥ H steps ago, oldest
first; (2) never sent, lowest index; (3) argmax_p R_p, ties to the lowest index. Scores:
``l2_global`` (the paper's): R_p = ‖Δ̄_p‖₂ / I_p from the averaged pseudo-gradient of p's last sync,
I_p = steps that sync covered (send step − previous send step of p); ``l2_rms``: R_p = ‖Δ̄_p‖₂ /
√(I_p·numel_p), the same norm per √step and per √element. Where Δ̄ is mostly noise of the inner
steps (a random walk: ‖Δ̄_p‖ ∝ √(I_p·numel_p)) the paper's score is ∝ 1/√I_p and favours the
fragment sent most recently, which then keeps winning; ``l2_rms`` is flat in I_p and size for
noise, and grows like √I_p for a steady drift (docs/algorithms.md); ``l1_local`` (the reference code's score):
R_p = Σ_ranks ‖g_p − x_p‖₁ / (I_p·numel_p), the mean absolute local change per element and per
step, I_p = steps since p's last send (t at the first), measured at each send for every fragment
and all-reduced beside that sync. Both come from values identical on every rank, so every rank
picks the same fragment. ``round_robin`` (for matched-sync studies: delay compensation without
adaptive selection) replaces (2)-(3) by a fixed cycle 0, 1, .., K−1, 0, .. that skips fragments in
flight; rule (1) still comes first.

``score_log=True`` records, per sync, the fragment, I_p, ‖Δ̄_p‖₂ and this rank's own ‖Δ_p‖₂ (before
the average: with M ranks of independent noise, ‖Δ̄‖² / ‖Δ‖² is about 1/M for pure noise and 1 for
pure signal), and per send slot every fragment's score and steps since its last send
(``score_records()``): diagnostics only, not checkpointed, one extra pass over the fragment per
send. With a compressed wire (quantized with error feedback, top-k) the averaged norm is of what
was sent (Δ + the carried error, sparsified), the local one of Δ alone: the ratio then does not
measure the workers' agreement.

Under torchft with a replica of several ranks (``manager=``, ``Manager(world_size=n)``, the model
replicated inside the replica), each rank's measured timings and scores are reduced with the same rank
of the other replicas only, so the ranks of one replica could disagree: at every period start and
every send slot each rank takes group rank 0's N and choice (``runtime.ft.ReplicaGroup``).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from .. import ops
from .._checks import integer, scalar
from ..ops.outer_merge import outer_merge_control_ref
from .checkpoint import CheckpointError, expect_int
from .dense import DenseStrategy, Pending
from .host import DeviceToHost
from .schedule import (
    DEFAULT_STEP_TIME_S,
    LAM_MODES,
    SCORES,
    TAYLOR_CONTROLS,
    TIMINGS,
    check_cocodc_schedule,
    cocodc_auto_syncs,
    cocodc_max_syncs,
    cocodc_slot,
    fragment_schedule,
)
from .sharding import check_sharded_cocodc
from .transport import WAN, ring_wire_bytes


class CoCoDC(DenseStrategy):
    """See the module docstring. Requires τ·K ≤ H (each fragment fits once per period)."""

    method = "cocodc"
    needs_snapshot = True
    local_keys = ("ts_last",)

    def __init__(
        self, model, inner_optimizer, *, sync_every: int, num_fragments: int, fragment_sync_delay: int,
        lam: float = 0.5, lam_mode: str = "normalized", gamma: float = 0.4,
        syncs_per_period: str | int = "auto", score: str = "l2_global",
        timing: str | None = None, step_time_s: float = DEFAULT_STEP_TIME_S, timing_link: WAN | None = None,
        taylor_control: str = "none", control_seed: int = 0, score_log: bool = False,
        outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True, **common: Any,
    ) -> None:  # fmt: skip
        H, K, tau = fragment_schedule(sync_every, num_fragments, fragment_sync_delay)
        self.H = H
        if not isinstance(syncs_per_period, str):
            integer("syncs_per_period", syncs_per_period, lo=1)
        check_cocodc_schedule(H, K, tau, syncs_per_period)
        self.n_max = cocodc_max_syncs(H, tau)
        self.auto = syncs_per_period == "auto"
        lam = scalar("lam", lam, lo=0.0)
        if lam_mode not in LAM_MODES:
            raise ValueError(f"lam_mode must be one of {LAM_MODES}, got {lam_mode!r}")
        self.gamma = scalar("gamma", gamma, lo=0.0, lo_open=True)
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        self.score = score
        if not isinstance(score_log, bool):
            raise TypeError(f"score_log must be a bool, got {type(score_log).__name__}")
        if timing_link is not None and not isinstance(timing_link, WAN):
            raise TypeError(f"timing_link must be a WAN or None, got {type(timing_link).__name__}")
        self.timing_link = timing_link if timing_link is not None else common.get("wan")
        if timing is None:
            timing = "emulated" if self.timing_link is not None else "measured"
        if timing not in TIMINGS:
            raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
        if timing == "emulated" and self.timing_link is None:
            raise ValueError(
                "timing='emulated' needs a link model to compute T_s: pass wan=WAN(...) or "
                "timing_link=WAN(...), or timing='measured' to measure T_c and T_s instead"
            )
        self.timing = timing
        self.step_time_s = scalar("step_time_s", step_time_s, lo=0.0, lo_open=True)
        if taylor_control not in TAYLOR_CONTROLS:
            raise ValueError(f"taylor_control must be one of {TAYLOR_CONTROLS}, got {taylor_control!r}")
        self.taylor_control = taylor_control
        self.control_seed = integer("control_seed", control_seed, lo=0)
        self.lam_mode = lam_mode
        check_sharded_cocodc(model, score, syncs_per_period, lam_mode)
        super().__init__(
            model, inner_optimizer, num_fragments=K, fragment_sync_delay=tau,
            outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
            merge={"beta": 1.0, "lam": lam, "lam_mode": lam_mode}, **common,
        )  # fmt: skip
        self.K = K
        self.N = K if self.auto else int(syncs_per_period)
        self.last_send = [-1] * K  # step of the last send of each fragment (-1: never)
        self.prev_send = [0] * K  # step of the send before it (start of the interval it covered)
        self.scores = [0.0] * K
        self.T_c = 0.0  # agreed (rank-averaged) inner-step time
        self.T_s = 0.0  # agreed fragment-sync time in flight
        self._tc_sum, self._tc_n = 0.0, 0  # local, since the last send
        self._ts_last = 0.0  # local, last measured in-flight time
        self.n_history: list[int] = []
        self._rr_next = 0  # round_robin: the next fragment in the cycle
        self._offsets_all = self.frags.offsets.to(self.outer_dev)
        # [0, size_p] per fragment, made once (no host-to-device copy per sync)
        self._whole = [
            torch.tensor([0, n], dtype=torch.int64, device=self.outer_dev) for n in self.frags.sizes()
        ]
        # l2 scores' norms not yet read, with the divisor that makes the score
        self._norms_due: dict[int, tuple[DeviceToHost, float]] = {}
        self._score_log: dict[str, list] | None = (
            {"syncs": [], "choices": [], "loads": [], "numel": list(self.frags.sizes())}
            if score_log
            else None
        )
        # score_log: (p, send step) -> this rank's ‖Δ_p‖ of a sync in flight (None: a healed replay)
        self._local_norms: dict[tuple[int, int], DeviceToHost | None] = {}
        self._log_settled = 0  # score_log: syncs before this index hold floats, not device reads
        self._tensor_bounds = [
            self.frags.tensor_bounds(p) if lam_mode == "normalized_tensor" else [0, n]
            for p, n in enumerate(self.frags.sizes())
        ]
        self._init_buffers()
        if self.auto and self.timing == "emulated":
            wan = self.timing_link
            assert wan is not None  # checked above: emulated timing needs a link model
            wire = [ring_wire_bytes(self.wire.payload_bytes(n), self.world) for n in self.frags.sizes()]
            self.T_c = self.step_time_s
            self.T_s = wan.latency_s + wan.transfer_s(sum(wire) / len(wire))
            self.N = self._period_n()

    # ----- schedule ------------------------------------------------------------------------------
    def _period_n(self) -> int:
        if not self.auto or self.T_s <= 0 or self.T_c <= 0:
            return self.N
        return cocodc_auto_syncs(self.gamma, self.H, self.T_c, self.T_s, self.K, self.n_max)

    def choose(self, t: int) -> tuple[int, str] | None:
        """The fragment for a send slot after step t (see the module docstring), or None."""
        self._resolve_scores()
        busy = {pd.fragment for pd in self.pending}
        free = [p for p in range(self.K) if p not in busy]
        if not free:
            return None
        stale = [p for p in free if self.last_send[p] >= 0 and t - self.last_send[p] >= self.H]
        if stale:
            return min(stale, key=lambda p: (self.last_send[p], p)), "stale"
        if self.score == "round_robin":
            p = next(q % self.K for q in range(self._rr_next, self._rr_next + self.K) if q % self.K in free)
            return p, "round_robin"
        never = [p for p in free if self.last_send[p] < 0]
        if never:
            return never[0], "never_sent"
        best = max(free, key=lambda p: (self.scores[p], -p))
        return best, "score"

    def _sends_at(self, t: int) -> list[tuple[int, str]]:
        s = (t - 1) % self.H + 1
        n = self._period_n() if s == 1 else self.N
        slot = cocodc_slot(s, n, self.H)
        choice = self.choose(t) if slot else None
        group = getattr(self.transport, "replica_group", None)
        if group is not None and (s == 1 or slot):
            # runtime.ft, a replica of several ranks: every rank takes group rank 0's N and choice
            # (the others' slots between two period starts follow from the agreed N)
            n, choice = group.agree_decision(t, n, choice)
        if s == 1:
            self.N = n
            self.n_history.append(n)
        if choice is None:
            return []
        p = choice[0]
        if self._score_log is not None:
            since = [t - q if q >= 0 else None for q in self.last_send]
            self._score_log["choices"].append(
                {"step": t, "fragment": p, "reason": choice[1], "scores": list(self.scores), "since": since}
            )
        self._rr_next = (p + 1) % self.K
        self.prev_send[p] = max(self.last_send[p], 0)
        self.last_send[p] = t
        return [choice]

    def _replayed_sends(self, t: int) -> list[tuple[int, str]]:
        # the peers chose (and recorded in the healed state) the fragments of step t before their
        # state was read; choosing again would pick another one (a choice mutates the schedule)
        return [(p, "healed") for p in range(len(self.last_send)) if self.last_send[p] == t]

    def _send(self, p: int, t: int, reason: str) -> None:
        if self._score_log is not None:  # this rank's own ‖Δ_p‖ = ‖g_p − x_p‖, before the average
            local = None  # a healed replay: this rank did not train the steps that sync covers
            if reason != "healed":
                g_p = self.frags.slice(self.g, p)
                diff = g_p - self.to_outer(self.frags.x(p)).to(g_p.dtype)
                local = DeviceToHost(torch.linalg.vector_norm(diff, dtype=torch.float64).reshape(1))
            self._local_norms[(p, t)] = local
        super()._send(p, t, reason)

    def _record_sync(self, pd: Any, t: int, t0: float, **fields: Any) -> None:
        super()._record_sync(pd, t, t0, **fields)
        if self._score_log is None:
            return
        if fields.get("skipped"):  # no result to score: logged as skipped, with no norms
            self._local_norms.pop((pd.fragment, pd.send_step), None)
            self._score_log["syncs"].append(
                {"fragment": pd.fragment, "send_step": pd.send_step, "covered": None, "norm": None,
                 "local_norm": None, "skipped": True}
            )  # fmt: skip
        # only syncs still in flight keep their local norm (a rollback drops its syncs unapplied)
        live = {(q.fragment, q.send_step) for q in self.pending}
        for key in [k for k in self._local_norms if k not in live]:
            del self._local_norms[key]

    def _advance(self, t: int) -> None:
        samples = self.new_compute_samples()  # device time on a GPU, not host enqueue time
        self._tc_sum += sum(samples)
        self._tc_n += len(samples)
        super()._advance(t)

    # ----- values all-reduced beside each sync ---------------------------------------------------
    def _control_extras(self, p: int, t: int) -> tuple[list[float], torch.Tensor | None]:
        tc = self._tc_sum / self._tc_n if self._tc_n else 0.0
        self._tc_sum, self._tc_n = 0.0, 0
        norms = None
        if self.score == "l1_local":  # stays on the device, reduced beside the sync
            x_all = self.to_outer(self.frags.flat)
            diff, _, _ = ops.pack(self.g, x_all, snapshot_out=False)  # g − x for every fragment, one pass
            # R_q = ‖g_q − x_q‖₁ / (I_q·numel_q); p's last send was already moved to t by the schedule
            div = [
                max(1, t - (self.prev_send[q] if q == p else max(self.last_send[q], 0))) * n
                for q, n in enumerate(self.frags.sizes())
            ]
            norms = ops.fragment_norms(diff, self._offsets_all, ord=1, check_values=False).to(
                self.device, torch.float64
            ) / torch.tensor(div, dtype=torch.float64, device=self.device)
        return [tc, self._ts_last], norms

    def _num_extras(self) -> int:
        return 2 + (self.K if self.score == "l1_local" else 0)

    def _schedule_fields(self) -> dict[str, Any]:
        return {
            "sync_every": self.H,
            "syncs_per_period": "auto" if self.auto else self.N,
            "gamma": self.gamma,
            "score": self.score,
            "timing": self.timing,
            "step_time_s": self.step_time_s,
            "taylor_control": self.taylor_control,
            "control_seed": self.control_seed,
        }

    def _on_result(self, pd: Pending, delta_avg: torch.Tensor, control: list[float]) -> None:
        if pd.handle is not None:
            self._ts_last = pd.handle.in_flight_s
        if self.world > 0 and self.timing == "measured":
            tc, ts = control[0] / self.world, control[1] / self.world
            if tc > 0:
                self.T_c = tc
            if ts > 0:
                self.T_s = ts
        p = pd.fragment
        covered = max(1, pd.send_step - self._covered_from(pd))
        norm = None
        if self.score in ("l2_global", "l2_rms") or self._score_log is not None:
            # ‖Δ̄_p‖₂, computed on the device now and read on the host at the next choice
            d = delta_avg if delta_avg.dtype != torch.bfloat16 else delta_avg.to(self.g.dtype)
            norm = DeviceToHost(ops.fragment_norms(d, self._whole[p], ord=2, check_values=False).double())
        if self._score_log is not None:
            local = self._local_norms.pop((p, pd.send_step), None)
            self._score_log["syncs"].append(
                {
                    "fragment": p,
                    "send_step": pd.send_step,
                    "covered": covered,
                    "norm": norm,
                    "local_norm": local,
                    "skipped": False,
                }
            )
        if self.score == "l2_global":  # R_p = ‖Δ̄_p‖₂ / I_p
            self._norms_due[p] = (norm, float(covered))
        elif self.score == "l2_rms":  # R_p = ‖Δ̄_p‖₂ / √(I_p·numel_p)
            self._norms_due[p] = (norm, math.sqrt(covered * self.frags.sizes()[p]))
        elif self.score == "l1_local":
            self.scores = list(control[2 : 2 + self.K])

    def _merge(
        self, pd: Pending, g_p: torch.Tensor, u_p: torch.Tensor, delta: torch.Tensor, x_work: torch.Tensor
    ) -> None:
        """The outer step and the merge, per parameter tensor for ``normalized_tensor`` (the outer
        step and the merge are elementwise, so only λ_eff's scope changes) and through the control
        path for a ``taylor_control``."""
        if self.lam_mode != "normalized_tensor" and self.taylor_control == "none":
            return super()._merge(pd, g_p, u_p, delta, x_work)
        kw: dict[str, Any] = {
            "lr": self.outer_lr,
            "momentum": self.outer_momentum,
            "nesterov": self.nesterov,
            **self.merge_kw,
            "lam_mode": "absolute" if self.lam_mode == "absolute" else "normalized",
        }
        direction = None
        if self.taylor_control == "random":
            gen = torch.Generator().manual_seed(
                (self.control_seed * 1_000_003 + pd.fragment) * 1_000_003 + pd.send_step
            )
            direction = torch.randn(g_p.numel(), generator=gen, dtype=torch.float64)
        bounds = self._tensor_bounds[pd.fragment]
        assert pd.x_sent is not None  # CoCoDC's merge always reads the snapshot (needs_snapshot)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            if a == b:
                continue
            parts = (g_p[a:b], u_p[a:b], delta[a:b], x_work[a:b], pd.x_sent[a:b])
            if self.taylor_control == "none":
                ops.outer_merge_(*parts, **kw)
            else:
                d = None if direction is None else direction[a:b]
                outer_merge_control_ref(*parts, **kw, control=self.taylor_control, direction=d)

    def _resolve_scores(self) -> None:
        for p, (norm, divisor) in self._norms_due.items():
            self.scores[p] = norm.values()[0] / divisor
        self._norms_due.clear()
        self._settle_log()

    def _settle_log(self) -> None:
        """score_log: the device reads of the logged syncs turned into floats (read at the next
        choice, as the scores are, so a run holds a few pending reads, not one per sync)."""
        if self._score_log is None:
            return
        syncs = self._score_log["syncs"]
        for r in syncs[self._log_settled :]:
            for key in ("norm", "local_norm"):
                if isinstance(r[key], DeviceToHost):
                    r[key] = float(r[key].values()[0])
        self._log_settled = len(syncs)

    def score_records(self) -> dict[str, list] | None:
        """``score_log=True``: {"numel": per fragment, "syncs": [{fragment, send_step, covered, norm,
        local_norm, skipped}], "choices": [{step, fragment, reason, scores, since}], "loads": [for
        each state load (checkpoint, heal), the number of syncs logged before it]} (a JSON-safe
        copy; see the module docstring); None without it. A sync whose send this process did not
        make (restored from a checkpoint, or replayed by a heal) has local_norm None; a skipped sync
        has no norms."""
        if self._score_log is None:
            return None
        self._settle_log()
        return copy.deepcopy(self._score_log)

    def _covered_from(self, pd: Pending) -> int:
        # prev_send was updated at send time; the pending sync is the latest send of its fragment.
        return self.prev_send[pd.fragment] if self.last_send[pd.fragment] == pd.send_step else 0

    # ----- checkpoint ----------------------------------------------------------------------------
    def _schedule_state(self) -> dict[str, Any]:
        self._resolve_scores()
        return {
            "N": self.N,
            "last_send": list(self.last_send),
            "prev_send": list(self.prev_send),
            "scores": list(self.scores),
            "T_c": self.T_c,
            "T_s": self.T_s,
            "ts_last": self._ts_last,
            "rr_next": self._rr_next,
        }

    def _validate_state(self, sd: dict[str, Any]) -> None:
        super()._validate_state(sd)
        sch = sd["schedule"]
        expect_int("schedule.N", sch.get("N"), self.K, self.n_max)
        expect_int("schedule.rr_next", sch.get("rr_next"), 0, self.K - 1)
        for key, lo in (("last_send", -1), ("prev_send", 0)):
            vals = sch.get(key)
            if not isinstance(vals, list) or len(vals) != self.K:
                raise CheckpointError(f"checkpoint entry schedule.{key} should be a list of {self.K} ints")
            for i, v in enumerate(vals):
                expect_int(f"schedule.{key}[{i}]", v, lo)
        scores = sch.get("scores")
        if (
            not isinstance(scores, list)
            or len(scores) != self.K
            or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in scores)
        ):
            raise CheckpointError(f"checkpoint entry schedule.scores should be {self.K} finite numbers >= 0")
        for key in ("T_c", "T_s", "ts_last"):
            v = sch.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise CheckpointError(
                    f"checkpoint entry schedule.{key} should be a finite number >= 0, got {v!r}"
                )

    def _load_schedule_state(self, sd: dict[str, Any]) -> None:
        self._local_norms.clear()  # the syncs in flight are the loaded state's, sent by another run
        if self._score_log is not None:
            self._score_log["loads"].append(len(self._score_log["syncs"]))
        self.N = int(sd["N"])
        self.last_send = [int(v) for v in sd["last_send"]]
        self.prev_send = [int(v) for v in sd["prev_send"]]
        self.scores = [float(v) for v in sd["scores"]]
        self.T_c, self.T_s, self._ts_last = float(sd["T_c"]), float(sd["T_s"]), float(sd["ts_last"])
        self._rr_next = int(sd["rr_next"])
