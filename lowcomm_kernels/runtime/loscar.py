"""LOSCAR-SGD (Maziane et al. 2026): sparse, overlapped, delay-corrected local SGD.

Round r on worker i (docs/algorithms.md): from x_i run N_i local steps; y_i = x_i[S_r] is sent; run Q_i
more steps while the all-reduce is in flight; z_i = x_i; then with m̄ = mean_i y_i[S_r]

    delay_corrected:  x_i[j] ← m̄_j + (z_i[j] − y_i[j])   for j ∈ S_r
    overwrite:        x_i[j] ← m̄_j                       for j ∈ S_r
                      x_i[j] = z_i[j]                      for j ∉ S_r

S_r = ``mask_indices(seed, r, d, k)``, k = ⌈density·d⌉: the same on every worker, fresh each round,
derived from the shared seed so no indices travel. Only k-sized buffers are allocated per round
(indices, the sent values y, the wire buffer); there is no global copy g.

Heterogeneous workers: ``local_steps`` and ``overlap_steps`` may be per-rank lists. Every rank
issues exactly one all-reduce (plus its tiny control vector) per round, in round order, so the
collectives always pair up whatever each rank's step counts are: a faster rank simply waits at its
merge (counted as exposed).

Non-finite values: each rank checks its WHOLE x at send (its L1 norm, one read of x per round),
not only y, so a poisoned rank is found even where the mask did not look. If any
rank has some, every rank skips that round's merge, and since LOSCAR keeps no global copy to
restart from, each poisoned rank is restarted from the parameters of the lowest-numbered healthy
rank (one broadcast of d values, counted in ``metrics.recovery_bytes``) with its inner-optimizer
state cleared; healthy ranks keep their own x. With ``on_nonfinite="raise"`` every rank raises;
if every rank is poisoned, every rank raises (nothing finite is left to restart from).

Under torchft (``manager=``, runtime.ft) each round is one blocking torchft round; a round that did not
commit is skipped everywhere (each replica keeps its own x), a poisoned replica raises instead of being
restarted over a fixed group, and a returning replica heals from a peer's ``heal_state()``.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import ops
from .._checks import integer, scalar
from ..ops.mask_indices import check_key
from .base import Strategy, nvtx, tensor_hash
from .checkpoint import CheckpointError, expect_int, expect_tensor
from .compression import check_result, quantize, result_form, to_average_
from .schedule import LOSCAR_MERGES
from .transport import Handle, SyncError


@dataclass
class _SparsePending:
    round: int
    send_step: int
    idx: torch.Tensor  # (k,) int64, sorted
    sent: torch.Tensor  # (k,) y = x[S] at send
    wire: torch.Tensor  # (k,) wire dtype: summed in place by a dense all-reduce, averaged by a quantized one
    control: torch.Tensor  # fp64 per-rank facts (Strategy._control): non-finite counts of x, views
    handle: Handle | None
    pack_s: float = 0.0
    exposed_s: float = 0.0
    in_flight_s: float = 0.0
    wire_bytes: int = 0
    control_host: list[float] | None = None  # restored from a checkpoint: the reduced control
    # what wire holds (compression.result_form): its wire format, and how many ranks' y it sums
    wire_format: str = ""
    summed_over: int = 1


def _per_rank(name: str, value: int | Sequence[int], world: int, rank: int, lo: int) -> tuple[int, list[int]]:
    if isinstance(value, (list, tuple)):
        if len(value) != world:
            raise ValueError(
                f"{name} lists {len(value)} values but the process group has {world} ranks "
                "(give one per rank, or a single int)"
            )
        vals = [integer(f"{name}[{i}]", v, lo=lo) for i, v in enumerate(value)]
    else:
        vals = [integer(name, value, lo=lo)] * world
    return vals[rank], vals


class LOSCAR(Strategy):
    """See the module docstring. The inner optimizer is the user's (plain SGD in the paper)."""

    method = "loscar"

    def __init__(
        self,
        model,
        inner_optimizer,
        *,
        density: float,
        local_steps: int | Sequence[int],
        overlap_steps: int | Sequence[int],
        merge: str = "delay_corrected",
        seed: int = 0,
        **common: Any,
    ) -> None:
        self.density = scalar("density", density, lo=0.0, hi=1.0, lo_open=True)
        if merge not in LOSCAR_MERGES:
            raise ValueError(f"merge must be one of {tuple(LOSCAR_MERGES)}, got {merge!r}")
        self.merge = merge
        self.seed = check_key("seed", seed)  # the masks' rule, here rather than at the first round
        if common.get("error_feedback"):
            raise ValueError(
                "error_feedback=True is not supported by LOSCAR: it sends parameter values on a fresh "
                "random mask every round, so a residual would need d-sized state (LOSCAR keeps k-sized "
                "buffers only)"
            )
        super().__init__(model, inner_optimizer, num_fragments=1, **common)
        self.N_i, self.local_steps = _per_rank("local_steps", local_steps, self.world, self.rank, 1)
        self.Q_i, self.overlap_steps = _per_rank("overlap_steps", overlap_steps, self.world, self.rank, 0)
        self.d = self.frags.numel
        self.k = max(1, math.ceil(self.density * self.d))
        self._join_group()
        self.round = 0
        self.s = 0  # inner steps into the current round
        self.inflight: _SparsePending | None = None
        self.last_idx: torch.Tensor | None = None  # S_r of the last merged round (inspection, tests)
        self.metrics.extra_memory_bytes = 0  # no persistent copy: only k-sized buffers per round

    def _largest_sync(self) -> int:
        return self.k

    def _advance(self, t: int) -> None:
        if self.inflight is not None and self.inflight.handle is not None:
            self.inflight.handle.poll()
        self.s += 1
        if self.s == self.N_i:
            self._send(t)
        self._merge_if_due(t)

    def _merge_if_due(self, t: int) -> None:
        if self.s == self.N_i + self.Q_i:
            self._apply(t)
            self.round += 1
            self.s = 0

    def replay(self, t: int) -> None:
        """The rest of step t from this round's send point: the peers served the heal there (or
        before the first round, when nothing of step t is left)."""
        if self.s != self.N_i:  # healed before the first round: nothing of step t is left
            return
        self._send(t)
        self._merge_if_due(t)

    def _send(self, t: int) -> None:
        t0 = time.perf_counter()
        x = self.frags.flat
        with nvtx("pack"):
            idx = ops.mask_indices(self.seed, self.round, self.d, self.k, device=x.device)
            sent = ops.sparse_gather(x, idx, check_values=False)  # idx is ours: no host read
            sent = sent.to(self.frags.master_dtype)  # kept in the master dtype (float32 for a bf16 / fp16 x)
            if self.quantized is not None:  # the k values as codes + scales (runtime.compression)
                codes, scales = quantize(sent, self.wire)
            else:
                wire = sent.to(self.wire_dtype, copy=True)  # all-reduced in place; `sent` kept for the merge
            # poisoned anywhere in x: its L1 norm is not finite (one read of x, no d-sized temporary)
            whole = ops.fragment_norms(x, self.frags.offsets, ord=1, check_values=False)
            bad = (~torch.isfinite(sent)).sum() + (~torch.isfinite(whole)).sum()
            bad = bad.to(torch.float64) + self._hidden_nonfinite(x for grp in self.frags.params for x in grp)
            control = self._control(bad.to(torch.float64), self.round, [])
        pack_s = time.perf_counter() - t0
        name = f"LOSCAR sync of round {self.round} sent at step {t}"
        if self.quantized is not None:  # averaged on arrival into handle.result (wire dtype)
            handle = self.quantized.start(
                codes, scales, self.k, control=control, name=name, out_dtype=self.wire_dtype
            )
            wire = handle.result
        else:
            handle = self.transport.all_reduce(
                [wire, control], name=name, host=control, payload_bytes=wire.numel() * wire.element_size()
            )
        fmt, summed_over = result_form(self.wire, self.world)
        self.inflight = _SparsePending(
            self.round, t, idx, sent, wire, control, handle, pack_s, wire_bytes=handle.wire_bytes,
            wire_format=fmt, summed_over=summed_over,
        )  # fmt: skip
        nbytes = sum(b.numel() * b.element_size() for b in (idx, sent, wire, control))
        self.metrics.peak_inflight_bytes = max(self.metrics.peak_inflight_bytes, nbytes)

    def _wait(self) -> None:
        pd = self.inflight
        if pd is not None and pd.handle is not None and not pd.handle.waited:
            pd.exposed_s += pd.handle.wait()
            pd.in_flight_s = pd.handle.in_flight_s

    def _drain(self) -> None:
        self._wait()

    def _finish(self) -> None:
        if self.inflight is not None:
            self._apply(self.step_count)
            self.round += 1
            self.s = 0

    def _apply(self, t: int) -> None:
        self._wait()
        pd = self.inflight
        assert pd is not None
        self.inflight = None
        self.last_idx = pd.idx
        t0 = time.perf_counter()
        control = pd.handle.host_values() if pd.handle is not None else pd.control_host
        skipped = self._sync_outcome(control, f"LOSCAR sync of round {pd.round} sent at step {pd.send_step}")
        if skipped:
            if self.membership.fixed_group:
                self._heal([r for r in range(self.world) if control[r] > 0], pd.round)
            elif not getattr(control, "failed_round", False) and self._poisoned():
                # under torchft there is no fixed group to restart from a peer over: this replica
                # stops, and restarted it heals from a healthy peer (runtime.ft); the others go on
                raise FloatingPointError(
                    f"LOSCAR round {pd.round}: this replica holds non-finite parameters or "
                    "inner-optimizer state; it stops (restart it: it heals from a healthy replica)"
                )
            # a round that did not commit: every replica keeps its own x (x[S] not averaged this round)
        else:
            with nvtx("merge"):
                ops.sparse_scatter_merge_(
                    self.frags.flat,
                    pd.idx,
                    to_average_(pd.wire, pd.summed_over),  # as the run that sent it would
                    pd.sent,
                    beta=LOSCAR_MERGES[self.merge],
                    check_values=False,  # idx came from mask_indices: no host read of it
                )
        self._record_sync(pd, t, t0, fragment=-1, skipped=skipped, round=pd.round)

    def _heal(self, poisoned: list[int], rnd: int) -> None:
        """Every rank: poisoned ranks take the parameters of the lowest healthy rank (collective)."""
        healthy = [r for r in range(self.world) if r not in poisoned]
        if not healthy:
            raise FloatingPointError(
                f"LOSCAR round {rnd}: every rank holds non-finite parameters and LOSCAR "
                "keeps no global copy to restart from; stopping every rank"
            )
        src = healthy[0]
        x = self.frags.flat
        buf = x if self.rank in poisoned or self.rank == src else torch.empty_like(x)
        work = self.transport.start_broadcast(buf, src)
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.transport.timeout_s))
        except Exception as e:
            raise SyncError(
                f"LOSCAR round {rnd}: restarting rank(s) {poisoned} from rank {src} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        if ok is False:
            raise SyncError(
                f"LOSCAR round {rnd}: restarting rank(s) {poisoned} from rank {src} did not "
                f"complete within {self.transport.timeout_s} s"
            )
        self.metrics.recovery_bytes += x.numel() * x.element_size()
        self._heal_buffers(poisoned)
        if self.rank in poisoned:
            self._restarted(f"from rank {src}'s parameters (LOSCAR round {rnd})")

    def _config_fields(self) -> dict[str, Any]:
        return {
            "density": self.density,
            "k": self.k,
            "merge": self.merge,
            "seed": self.seed,
            "local_steps (per rank)": list(self.local_steps),
            "overlap_steps (per rank)": list(self.overlap_steps),
        }

    # ----- checkpoint / guard --------------------------------------------------------------------
    @property
    def heterogeneous(self) -> bool:
        return len(set(self.local_steps)) > 1 or len(set(self.overlap_steps)) > 1

    @property
    def at_round_end(self) -> bool:
        """True right after a round's merge: a consistent cut for checkpoints with heterogeneous ranks."""
        return self.s == 0 and self.inflight is None

    def _state(self) -> dict[str, Any]:
        if self.heterogeneous and not self.at_round_end:
            # Ranks with different step counts are in different rounds at the same step; a cut that
            # is consistent across ranks exists only at round ends (each rank at its own step).
            raise CheckpointError(
                "LOSCAR with per-rank local_steps/overlap_steps can be checkpointed only "
                "at a round end (when strategy.at_round_end is True on every rank)"
            )
        pd = self.inflight
        inflight = (
            None
            if pd is None
            else {
                "round": pd.round,
                "send_step": pd.send_step,
                "sent": pd.sent.detach().cpu().clone(),
                "wire": pd.wire.detach().cpu().clone(),
                "wire_format": pd.wire_format,
                "summed_over": pd.summed_over,
                "control": pd.control.detach().cpu().clone(),
            }
        )
        return {
            "round": self.round,
            "s": self.s,
            "seed": self.seed,
            "k": self.k,
            "inflight": inflight,
            "local_steps": list(self.local_steps),
            "overlap_steps": list(self.overlap_steps),
        }

    def _validate_state(self, sd: dict[str, Any]) -> None:
        for key in ("round", "s", "seed", "k"):
            expect_int(key, sd.get(key), 0)
        if sd["seed"] != self.seed or sd["k"] != self.k:  # another mask sequence (k: the density)
            raise CheckpointError(
                f"checkpoint has seed={sd['seed']}, k={sd['k']} but this LOSCAR has "
                f"seed={self.seed}, k={self.k} (density={self.density:g})"
            )
        if sd.get("local_steps") != list(self.local_steps) or sd.get("overlap_steps") != list(
            self.overlap_steps
        ):
            raise CheckpointError(
                f"checkpoint has local_steps={sd.get('local_steps')!r}, "
                f"overlap_steps={sd.get('overlap_steps')!r} but this LOSCAR has "
                f"{list(self.local_steps)}, {list(self.overlap_steps)}"
            )
        q = sd.get("inflight")
        if q is not None:
            if not isinstance(q, dict):
                raise CheckpointError("checkpoint entry inflight should be a dict or None")
            expect_int("inflight.round", q.get("round"), 0)
            expect_int("inflight.send_step", q.get("send_step"), 0)
            expect_tensor("inflight.sent", q.get("sent"), (self.k,), self.frags.master_dtype)
            check_result("inflight", q, "wire", self.k, self.frags.master_dtype)  # as it was sent
            expect_tensor("inflight.control", q.get("control"), (self.FACTS * self.world,), torch.float64)

    def _load_state(self, sd: dict[str, Any]) -> None:
        self.round, self.s = int(sd["round"]), int(sd["s"])
        q = sd["inflight"]
        if q is None:
            self.inflight = None
        else:
            dev = self.frags.device
            idx = ops.mask_indices(self.seed, int(q["round"]), self.d, self.k, device=dev)
            self.inflight = _SparsePending(
                int(q["round"]),
                int(q["send_step"]),
                idx,
                q["sent"].to(dev),
                q["wire"].to(dev),
                q["control"].to(dev),
                None,
                control_host=q["control"].tolist(),
                wire_format=q["wire_format"],
                summed_over=int(q["summed_over"]),
            )

    # ----- healing under torchft (runtime.ft) ---------------------------------------------------
    def heal_state(self) -> dict[str, Any]:
        """What a healthy replica sends one that heals (LOSCAR keeps no global copy): its own
        parameters x, its step and round, and whether it stands at the round's send point. Peers
        serve it from inside a quorum, i.e. at their first step or at a round's send, when no round
        is in flight."""
        at_send = self.s == self.N_i and self.step_count > 0
        if self.inflight is not None or not (at_send or self.s == 0):
            raise RuntimeError(
                f"LOSCAR heal state requested at step {self.step_count} (round {self.round}, "
                f"{self.s} steps in): only at a round's send point or before the first round"
            )
        return {
            "step": self.step_count,
            "round": self.round,
            "at_send": at_send,
            "seed": self.seed,
            "k": self.k,
            "x": self.frags.flat.detach().cpu().clone(),
        }

    def load_heal_state(self, sd: dict[str, Any]) -> str:
        """Take a healthy peer's ``heal_state()``: its x, step and round; this replica then stands at
        the same point of the round (its own send point under per-replica local_steps)."""
        if not isinstance(sd, dict):
            raise CheckpointError("LOSCAR heal state should be a dict")
        step, rnd = expect_int("step", sd.get("step"), 0), expect_int("round", sd.get("round"), 0)
        if sd.get("seed") != self.seed or sd.get("k") != self.k:
            raise CheckpointError(
                f"heal state has seed={sd.get('seed')!r}, k={sd.get('k')!r} but this LOSCAR has "
                f"seed={self.seed}, k={self.k}"
            )
        expect_tensor("x", sd.get("x"), (self.d,), self.frags.dtype)
        with torch.no_grad():
            self.frags.flat.copy_(sd["x"].to(self.frags.device))
        self.inflight = None
        self.round, self.s = rnd, self.N_i if sd.get("at_send") else 0
        self.step_count = step
        self.metrics.steps = step
        return "the peer's parameters"

    def _guard_values(self) -> list[tuple[str, int]]:
        sched = torch.tensor([self.round, self.seed, self.k, self.d], dtype=torch.int64)
        idx = ops.mask_indices(self.seed, self.round, self.d, self.k, device=self.frags.device)
        return [
            ("LOSCAR round / seed / k", tensor_hash(sched)),
            (f"mask of round {self.round}", tensor_hash(idx)),
        ]
