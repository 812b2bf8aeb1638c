"""The drop-in wrapper shared by every strategy: hooking, timing, metrics, checkpoints, guard.

A strategy wraps ``(model, inner_optimizer)``. The user's loop stays untouched::

    with StreamingDiLoCo(model, opt, sync_every=100, num_fragments=4, fragment_sync_delay=5):
        for batch in data:
            model(batch).mean().backward(); opt.step(); opt.zero_grad()

Entering the context registers ``inner_optimizer.register_step_post_hook``; after every inner
step the strategy polls its in-flight collectives, applies the results that are due, and sends the
fragments that are due (``_advance``, defined by each strategy). Loops that prefer it call
``strategy.step()`` after ``opt.step()`` instead (not both). Leaving the context drains in-flight
collectives (their results stay pending and are applied at their scheduled step if training goes on).

Subclasses implement ``_advance(t)``, ``_drain()``, ``_state()`` / ``_load_state()``,
``_guard_values()`` and ``_config_fields()``; strategies that run under torchft (``manager=``) also
the public heal hooks (``heal_state`` and the ones next to it). Whom a strategy syncs with is its
``membership`` (``runtime.membership``: a fixed process group, or torchft replicas), which it asks
for its transport and agreement, never which kind it is. Everything else lives here, including the
rules that keep a run from failing silently:

- **Joining**: at construction every rank checks that it runs the same configuration and model as
  the others, and that it built its strategies over the group in the same order (``agreement``),
  then takes rank 0's parameters, frozen parameters and buffers.
- **Control vector**: every sync all-reduces, beside its payload, a tiny fp64 vector with one slot
  per rank for that rank's non-finite count and one for "my parameters no longer view the
  strategy's buffer", so every rank learns the same facts at the same sync and acts alike.
- **Non-finite syncs**: skipped on every rank (g and u unchanged); the fragment restarts from the
  last good global, and a rank whose parameters or inner-optimizer state hold non-finite values
  restarts entirely (``_restart_poisoned``) with that state cleared. A rank that contributes
  non-finite values to ``max_nonfinite_syncs`` consecutive syncs stops the job on every rank.
- **Parameter views**: checked at every send and at ``finish()``; a broken view raises on every rank.
- **Checkpoints**: checksummed, every tensor's dtype and shape checked (``checkpoint``).
"""

from __future__ import annotations

import abc
import hashlib
import os
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import get_total_norm

from .._checks import integer
from ..profiling import nvtx_range
from .agreement import broadcast_buffers, module_fields
from .amp import GradScalerError, ScalerCounter, check_scaler, scaler_on_stack, unannounced_scaler_message
from .checkpoint import (
    CheckpointError,
    check_optimizer_state,
    expect_tensor,
    read_checkpoint,
    write_checkpoint,
)
from .compression import DEFAULT_QUANT_BLOCK, QuantizedAllReduce, check_error_feedback, resolve_wire_format
from .fragments import FlatFragments, FragmentSpec
from .log import rank_logger
from .membership import membership_for
from .metrics import RuntimeMetrics, SyncRecord
from .schedule import SPARSE_WIRE_FORMATS
from .sharding import local, refuse_sharded_checkpoint, sharding_fields
from .topk_wire import DEFAULT_EF_BETA, TopKAllGather, TopKWire, check_topk
from .transport import CONTROL_FACTS, DEFAULT_TIMEOUT_S, WAN, HealedInRound, forget_settled

FORMAT_VERSION = 2
NONFINITE_MODES = ("skip", "raise")
_OWNER = "_lowcomm_strategy"  # attribute on each wrapped Parameter: weakref to its strategy

__all__ = ["CheckpointError", "ConsistencyError", "ParameterViewError", "Strategy"]


class ConsistencyError(RuntimeError):
    """Ranks disagree on state that must be identical (g, schedule); names the first differing fragment."""


class ParameterViewError(RuntimeError):
    """A model parameter no longer views the strategy's flat buffer (reassigned after wrapping)."""


def tensor_hash(t: torch.Tensor) -> int:
    """63-bit hash of a tensor's bytes (identical bytes on every rank -> identical hash)."""
    data = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def abs_max(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a 0-d tensor of t's dtype, NaN if t holds a NaN (0 for an empty t): the value of
    ``torch.linalg.vector_norm(t, ord=inf)``, bit for bit, in a min/max pass. On the CPU the
    inf-norm is a scalar loop: 22 ms for 2.4M fp32 values on one thread, where ``aminmax`` takes
    0.25 ms; the sync path's finiteness checks and overflow bounds read three to five of these per
    fragment, which made them cost more than the rest of a sync."""
    if t.numel() == 0:
        return t.new_zeros(())
    lo, hi = torch.aminmax(t)
    return torch.maximum(hi.abs(), lo.abs())


def nonfinite_tensors(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """How many of ``tensors`` hold a NaN or an inf, as a 0-d float64 tensor on ``device``.

    On the CPU, one fused pass over all of them first: their total 2-norm is finite exactly when
    every value is, unless the sum of squares passes the dtype's range (values past about 1e19), so
    only a total that is not finite sends each tensor through the exact min/max pass. The check runs
    at every sync: for the AdamW state of 4.7M parameters, two replicas on two cores, it took 3.8 ms
    where a min/max pass per tensor took 5.3 ms. Off the CPU a host read would stall the stream:
    every tensor takes the min/max pass there, which a GPU does in microseconds."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    if not tensors:
        return total
    if all(v.device.type == "cpu" for v in tensors) and bool(torch.isfinite(get_total_norm(tensors))):
        return total
    for v in tensors:
        # max |v| is inf or NaN exactly when v holds a non-finite value; a reduction, so no
        # temporary the size of v (LOSCAR promises k-sized buffers only)
        total += (~torch.isfinite(abs_max(v))).to(device, torch.float64)
    return total


class Strategy(abc.ABC):
    """Base class: see the module docstring. ``method`` names the algorithm in checkpoints."""

    method = "base"

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        num_fragments: int,
        fragments: FragmentSpec = None,
        process_group: dist.ProcessGroup | None = None,
        wan: WAN | None = None,
        wire_dtype: torch.dtype | None = None,
        on_nonfinite: str = "skip",
        max_nonfinite_syncs: int = 3,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        outer_device: str = "model",
        metrics_callback: Callable[[SyncRecord], None] | None = None,
        guard_every: int = 0,
        grad_scaler: torch.amp.GradScaler | None = None,
        quant_block: int = DEFAULT_QUANT_BLOCK,
        error_feedback: bool = False,
        topk_k: int = 64,
        topk_chunk: int = 4096,
        topk_bits: int = 2,
        ef_beta: float = DEFAULT_EF_BETA,
        manager: Any = None,
        num_replicas: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner_optimizer).__name__}"
            )
        if on_nonfinite not in NONFINITE_MODES:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_MODES}, got {on_nonfinite!r}")
        if outer_device not in ("model", "cpu"):
            raise ValueError(f"outer_device must be 'model' or 'cpu', got {outer_device!r}")
        if metrics_callback is not None and not callable(metrics_callback):
            raise TypeError("metrics_callback must be callable or None")
        self.guard_every = integer("guard_every", guard_every, lo=0)
        # with a GradScaler, count iterations (stepped or skipped), not optimizer steps (runtime.amp)
        self.grad_scaler = check_scaler(grad_scaler)
        self._scaler_counter: ScalerCounter | None = None
        self.max_nonfinite_syncs = integer("max_nonfinite_syncs", max_nonfinite_syncs, lo=1)
        integer("num_fragments", num_fragments, lo=1)
        # who this strategy syncs with: a fixed process group, or torchft replicas that come and go
        # (manager=); the strategy asks it, never which kind it is (runtime.membership)
        self.manager = manager
        if manager is not None and type(self).replay is Strategy.replay:  # refused now, not at a heal
            raise TypeError(
                f"{type(self).__name__} cannot run under a torchft manager: it does not define replay(t), "
                "how a replica that heals inside the peers' step finishes that step"
            )
        self.membership = membership_for(
            process_group=process_group, wan=wan, manager=manager, num_replicas=num_replicas
        )
        self.model = model
        self.inner_optimizer = inner_optimizer
        _refuse_second_wrap(model)
        self.frags = FlatFragments(model, num_fragments, fragments)
        _check_optimizer_covers(inner_optimizer, model, self.frags)
        for grp in self.frags.params:
            for p in grp:
                setattr(p, _OWNER, weakref.ref(self))
        dtype = self.frags.master_dtype  # the outer state's: float32 for bf16 / fp16 parameters
        # a name of schedule.WIRE_FORMATS or a dtype; a quantized format's averaged result arrives in
        # the outer state's dtype, which wire_dtype then names (runtime.compression)
        # "topk" (runtime.topk_wire) always keeps its error-feedback buffer; its knobs are checked
        # whatever the format, as quant_block is
        topk = check_topk(topk_k, topk_chunk, topk_bits, ef_beta)
        is_topk = isinstance(wire_dtype, str) and wire_dtype in SPARSE_WIRE_FORMATS
        if is_topk and self.method == "loscar":
            raise ValueError(
                "wire_dtype='topk' is not supported by LOSCAR: it already sends a sparse subset of the "
                "parameters (its mask), and a top-k selection of that subset needs d-sized error feedback"
            )
        if is_topk and not self.membership.fixed_group:
            raise ValueError(
                "wire_dtype='topk' is not supported with a torchft manager (an all-gather per sync)"
            )
        self.wire = resolve_wire_format(None if is_topk else wire_dtype, quant_block, dtype, self.frags.dtype)
        self.error_feedback = check_error_feedback(error_feedback, self.wire) if not is_topk else True
        self.sparse: TopKAllGather | None = None  # started once the ranks agreed (_join_group)
        self.quantized: QuantizedAllReduce | None = None  # started once the ranks agreed (_join_group)
        self.wire_dtype = self.wire.dtype  # resolve_wire_format checked it (the dense rule's owner)
        self.on_nonfinite = on_nonfinite
        self.device = self.frags.device
        # g and u may live on the CPU to save accelerator memory; ops then run on the CPU.
        self.outer_dev = torch.device("cpu") if outer_device == "cpu" else self.device
        self.transport = self.membership.transport(device=self.device, timeout_s=timeout_s)
        self.group = self.transport.group  # None without a fixed group
        self.world = self.transport.world
        self.rank = self.transport.rank
        if is_topk:
            self.wire = TopKWire(topk[0], topk[1], dtype, self.world)
        self.log = rank_logger(self.rank)
        self.metrics = RuntimeMetrics()
        self.metrics_callback = metrics_callback
        self.step_count = 0
        self._hook: Any = None  # torch.utils.hooks.RemovableHandle while active
        self._compute_range: Any = None  # open lowcomm/compute range between two hooks
        self._last_end = time.perf_counter()
        self._applied_since_guard = 0
        self._nonfinite_streak = [0] * self.world  # consecutive syncs each rank made non-finite
        self._view_problem: str | None = None  # this rank's broken parameter view, found at the last send
        self._step_events: list[Any] = []  # CUDA: compute-stream events at the hooks, not yet timed
        self._samples_seen = 0
        self._restarted_this_step = False  # restarted after a skipped sync, no inner step since

    # ----- joining the group ---------------------------------------------------------------------
    def _join_group(self) -> None:
        """Agree on the configuration and model with every rank, then start from rank 0's state.
        Call at the end of a subclass constructor, after its own checks (before any other
        collective: a mismatch must be named before it can break a collective)."""
        fields: dict[str, Any] = {
            "method": self.method,
            "process group size": self.world,
            "wire_dtype": str(self.wire_dtype),
            "wire format": self.wire.name,
            "quant_block": self.wire.block,
            "error_feedback": self.error_feedback,
            "parameter dtype": str(self.frags.dtype),
            "outer state dtype": str(self.frags.master_dtype),
            "on_nonfinite": self.on_nonfinite,
            "max_nonfinite_syncs": self.max_nonfinite_syncs,
            "guard_every": self.guard_every,
            "grad_scaler given": self.grad_scaler is not None,
            "number of fragments": self.frags.num_fragments,
        }
        if isinstance(self.wire, TopKWire):
            f = self.wire.fmt
            fields["top-k format (k, chunk, bits, ef_beta)"] = [f.k, f.chunk, f.bits, self.wire.beta]
        fields.update({k: _plain(v) for k, v in self._config_fields().items()})
        fields.update(module_fields(self.model, self.frags.names))
        fields.update(sharding_fields(self.model))  # replicas must hold the same shard of each DTensor
        fields["fragment sizes"] = self.frags.sizes()
        # the layout of the flat buffer: same names and shapes in another order would average
        # one parameter with another
        fields["parameter order in the flat buffer"] = [n for grp in self.frags.names for n in grp]
        # a link on which the largest sync outlasts timeout_s would time out at every sync
        self.transport.check_wan(self.wire.payload_bytes(self._largest_sync()))
        # a fixed group agrees and takes rank 0's state now; torchft registers the heal hooks and
        # refuses what needs a fixed group (it agrees and heals at quorums)
        self.membership.join(self, fields)
        if self.wire.quant is not None:  # collective: a process group of its own (runtime.compression)
            self.quantized = QuantizedAllReduce(self.transport, self.wire)
        if isinstance(self.wire, TopKWire):  # collective: a process group of its own (runtime.topk_wire)
            self.sparse = TopKAllGather(self.transport, self.wire)

    def _largest_sync(self) -> int:
        """Elements of the largest payload one sync sends (a whole fragment; LOSCAR: k)."""
        return max(self.frags.sizes(), default=0)

    @abc.abstractmethod
    def _config_fields(self) -> dict[str, Any]:
        """Every knob of this strategy that must be identical on all ranks (name -> value)."""

    def close(self) -> None:
        """Release the model so it can be wrapped again (the parameters keep viewing the buffer)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._remove_scaler_counter()
        self._close_compute_range()
        if self.quantized is not None:
            self.quantized.close()
        if self.sparse is not None:
            self.sparse.close()
        forget_settled()
        for grp in self.frags.params:
            for p in grp:
                if getattr(p, _OWNER, None) is not None and getattr(p, _OWNER)() is self:
                    delattr(p, _OWNER)

    # ----- control vector: per-rank facts all-reduced beside every sync ----------------------------
    FACTS = CONTROL_FACTS  # per-rank slots: non-finite count, broken views, schedule point

    def _control(
        self,
        nonfinite: torch.Tensor,
        point: int,
        extras: list[float],
        device_extras: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp64 [non-finite count by rank (world), broken views by rank (world), schedule point by
        rank (world), extras..., device_extras...]; this rank fills its own slots, the SUM all-reduce
        gives everyone everyone's. ``point`` is where this sync sits in the schedule (the send step
        of a dense sync, the round of a LOSCAR round): equal on every rank unless their schedules
        drifted. Built on the host (pinned) and copied without blocking; ``nonfinite`` and
        ``device_extras`` stay on the device: no host synchronisation."""
        w, head = self.world, self.FACTS * self.world
        self._view_problem = self.frags.broken_view(self.model)
        n_dev = 0 if device_extras is None else device_extras.numel()
        host = torch.zeros(
            head + len(extras) + n_dev, dtype=torch.float64, pin_memory=self.device.type == "cuda"
        )
        if self._restarted_this_step:
            host[self.rank] = -1.0  # no evidence yet (see _sync_outcome)
        if self._view_problem is not None:
            host[w + self.rank] = 1.0
        host[2 * w + self.rank] = float(point)
        if extras:
            host[head : head + len(extras)] = torch.tensor(extras, dtype=torch.float64)
        control = host.to(self.device, non_blocking=True)
        if not self._restarted_this_step:
            control[self.rank] = nonfinite
        if device_extras is not None:
            control[head + len(extras) :] = device_extras.reshape(-1)
        return control

    def _extras(self, control: list[float]) -> list[float]:
        return control[self.FACTS * self.world :]

    def _sync_outcome(self, control: list[float], what: str) -> bool:
        """Act on the per-rank facts of one sync (identical on every rank): raise on every rank if
        a rank's parameter views broke or a rank stayed non-finite too long; warn and return True
        (skip) if any rank sent non-finite values; False when the sync is good."""
        if getattr(control, "failed_round", False):  # runtime.ft: the round did not commit
            self.log.warning(f"{what}: the fault-tolerant round did not commit; every replica skips it")
            return True
        w = self.world
        points = [int(v) for v in control[2 * w : 3 * w]]
        if any(v != points[0] for v in points):
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(points))
            raise ConsistencyError(
                f"{what}: the ranks sent this sync at different points of their schedules ({shown}); "
                "every rank stops. Did a rank skip strategy.step() (e.g. only when a GradScaler "
                "stepped: call it every iteration, or pass grad_scaler=), call strategy.step() twice, "
                "or resume from a checkpoint of another step?"
            )
        broken = [r for r in range(w) if control[w + r] > 0]
        if broken:
            mine = f" On this rank: {self._view_problem.rstrip('.')}." if self._view_problem else ""
            raise ParameterViewError(
                f"{what}: the model parameters of rank(s) {broken} no longer view the "
                "strategy's buffer, so they would silently stop being synchronised; "
                f"every rank stops.{mine} Move or convert the model before wrapping it."
            )
        # count < 0: the rank restarted in this very step and sent its reset state, which says
        # nothing about whether it is still broken, so its streak neither grows nor resets
        counts = control[:w]
        bad = [r for r in range(w) if counts[r] > 0]
        for r in range(w):
            if counts[r] >= 0:
                self._nonfinite_streak[r] = self._nonfinite_streak[r] + 1 if counts[r] > 0 else 0
        if not bad:
            return False
        total = int(sum(c for c in counts if c > 0))
        msg = (
            f"{what}: non-finite values from rank(s) {bad} ({total} counted); every rank skips this "
            "sync, and a rank holding non-finite values restarts (see the failure model)"
        )
        if self.on_nonfinite == "raise":
            raise FloatingPointError(msg)
        stuck = [r for r in bad if self._nonfinite_streak[r] >= self.max_nonfinite_syncs]
        if stuck:
            raise FloatingPointError(
                f"{what}: rank(s) {stuck} sent non-finite values in "
                f"{self.max_nonfinite_syncs} consecutive syncs even after restarting "
                "from the last good global; stopping every rank instead of training on "
                "(check the data and learning rate of those ranks; the limit is "
                "max_nonfinite_syncs)"
            )
        self.log.warning(msg)
        return True

    def _hidden_state(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Floating tensors a sync does not carry but training reads: the inner optimizer's state of
        ``params`` and the model's buffers (e.g. BatchNorm running statistics)."""
        out = [b for b in self.model.buffers() if b.is_floating_point()]
        for p in params:
            st = self.inner_optimizer.state.get(p)
            if isinstance(st, dict):
                # a DTensor parameter's state is sharded like it: its local shard, no communication
                out += [local(v) for v in st.values() if isinstance(v, torch.Tensor)]
        out = [v for v in out if v.is_floating_point()]
        return [v for v in out if v.numel() > 0]

    def _hidden_nonfinite(self, params: Iterable[torch.Tensor]) -> torch.Tensor:
        """How many tensors of ``_hidden_state(params)`` hold a non-finite value, as a 0-d float64
        tensor on the model's device (no host read off the CPU)."""
        return nonfinite_tensors(self._hidden_state(params), self.device)

    def _heal_buffers(self, bad: list[int]) -> None:
        """After a skipped sync, on every rank (collective): ranks that sent non-finite values take
        the floating buffers of the lowest rank that did not (buffers are not in g, so the last good
        global cannot restore them). Nothing to do without floating buffers or a healthy rank."""
        if not self.membership.fixed_group:  # no group to broadcast over
            return
        healthy = [r for r in range(self.world) if r not in bad]
        if self.world == 1 or not healthy or not any(b.is_floating_point() for b in self.model.buffers()):
            return
        broadcast_buffers(self.transport, self.model, healthy[0], take=self.rank in bad)

    def _poisoned(self) -> bool:
        """Does this rank hold non-finite parameters, inner-optimizer state or buffers? (Checked only
        after a skipped sync, so its cost does not matter.)"""
        if not bool(torch.isfinite(self.frags.flat).all()):
            return True
        every = (p for grp in self.frags.params for p in grp)
        return any(not bool(torch.isfinite(v).all()) for v in self._hidden_state(every))

    def _restarted(self, source: str) -> None:
        """This rank's parameters were just replaced by good ones from ``source``: clear all of its
        inner-optimizer state (it may hold the non-finite values) and say so."""
        self._clear_inner_state(p for grp in self.frags.params for p in grp)
        self.log.warning(
            f"held non-finite parameters or inner-optimizer state at step {self.step_count}: "
            f"restarted {source}, inner-optimizer state cleared"
        )

    def _clear_inner_state(self, params: Iterable[torch.Tensor]) -> None:
        """Forget the inner optimizer's per-parameter state (momentum, Adam moments and step) for
        ``params``. Optimizers that follow torch's convention (state created lazily in
        ``optimizer.state[p]`` on the first step that sees p) start those parameters afresh."""
        for p in params:
            self.inner_optimizer.state.pop(p, None)
        self._restarted_this_step = True

    # ----- healing: the hooks a membership without a fixed group calls (runtime.ft) -----------------
    # Replicas come and go; one that joins or returns takes a healthy peer's state. The membership
    # calls only these public hooks, so a strategy's internals may change without breaking healing.

    def heal_state(self) -> dict[str, Any]:
        """What a healthy replica sends one that heals (anything ``torch.save`` writes). Called from
        inside a quorum, i.e. at the replica's first step or at a send, when no sync is in flight.
        Default: ``state_dict()``, the state every replica shares."""
        return self.state_dict()

    def load_heal_state(self, sd: dict[str, Any]) -> str:
        """Take a peer's ``heal_state()``, parameters included, so that this replica stands where
        the peer stood. Returns what the parameters were set to (for the log). The membership then
        clears the inner-optimizer state (``clear_inner_state``) and lets the strategy ``replay``
        the rest of the peer's step."""
        self.load_state_dict(sd)
        return "the peer's state"

    def replay(self, t: int) -> None:
        """Finish step t as the healthy peers run it, right after a heal: their sends of step t
        that are not pending yet (the transport sends them without contributing, so the round they
        open pairs up with the peers'), then the results due at t. Each strategy says how: a heal
        lands inside the peers' step, which only the strategy's schedule knows. A strategy that does
        not define it is refused at construction under a manager."""
        raise NotImplementedError(f"{self.method} does not support replicas that heal (manager=)")

    def restart_from_shared(self) -> None:
        """At a fresh start, on a replica that joined without healing: start its first step as a
        healed replica does (e.g. parameters from the shared global copy, inner state cleared), so
        every replica starts alike. Default: nothing (no shared copy)."""
        return None

    def clear_inner_state(self) -> None:
        """Forget the inner optimizer's per-parameter state of every parameter: after a heal the
        parameters are a peer's, and momentum built on this replica's old ones would not fit."""
        self._clear_inner_state(p for grp in self.frags.params for p in grp)

    # ----- buffers -------------------------------------------------------------------------------
    def _outer_buffer(self) -> torch.Tensor:
        """A zeroed buffer laid out like the flat parameters, on the outer device (pinned CPU if the
        model is on a GPU)."""
        # g and u never cross PCIe (the ops run where they live), so they are not pinned; the buffers
        # that do cross go through ``to_outer`` / ``to_model`` below.
        return torch.zeros(self.frags.numel, dtype=self.frags.master_dtype, device=self.outer_dev)

    def memory_per_param(self) -> dict[str, float]:
        """Bytes per trainable parameter, measured from the buffers held now (each storage counted
        once, its allocated bytes): ``params``, the flat buffer the model's parameters view;
        ``outer_state``, the persistent state (g and u: the master copy and outer momentum; the
        error-feedback residual);
        ``in_flight``, the buffers of the syncs in flight now (wire payloads, snapshots, control
        vectors); ``spare``, the wire buffers applied syncs left for later sends (as many sets as
        syncs were in flight at once); ``extra`` = outer_state + in_flight + spare, what the
        strategy adds to plain training."""
        n = max(self.frags.numel, 1)

        def nbytes(ts: Iterable[Any]) -> int:
            seen: dict[tuple[str, int], int] = {}
            for t in ts:
                if isinstance(t, torch.Tensor) and t.numel():
                    s = t.untyped_storage()
                    seen[(str(t.device), s.data_ptr())] = s.nbytes()
            return sum(seen.values())

        outer = nbytes(getattr(self, name, None) for name in ("g", "u", "residual"))
        pending = [*getattr(self, "pending", []), getattr(self, "inflight", None)]
        in_flight = nbytes(
            v
            for pd in pending
            if pd is not None
            for v in [*vars(pd).values(), *getattr(pd, "buffers", {}).values()]
        )
        spare = nbytes(v for full in getattr(self, "_spare", []) for v in full.values())
        return {
            "params": nbytes([self.frags.flat]) / n,
            "outer_state": outer / n,
            "in_flight": in_flight / n,
            "spare": spare / n,
            "extra": (outer + in_flight + spare) / n,
        }

    def to_outer(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (on the model's device) on the outer device. GPU -> CPU goes through pinned memory;
        the CPU op that reads it next needs the data, so this waits for the compute stream: keeping
        the outer state on the CPU trades that wait for accelerator memory."""
        if self.outer_dev == self.device:
            return t
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return buf

    def to_model(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (on the outer device) on the model's device: pinned, copied without blocking."""
        if t.device == self.device:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    # ----- the user-facing loop API --------------------------------------------------------------
    def __enter__(self) -> Strategy:
        if self._hook is not None:
            raise RuntimeError("this strategy is already active (nested `with`?)")
        self._last_end = time.perf_counter()
        if self.grad_scaler is not None:
            self._scaler_counter = ScalerCounter(self.grad_scaler, self.inner_optimizer, self._on_step)
            self._scaler_counter.install()
        self._hook = self.inner_optimizer.register_step_post_hook(
            lambda opt, args, kwargs: self._on_optimizer_step()
        )
        self._open_compute_range()
        return self

    def _on_optimizer_step(self) -> None:
        found = scaler_on_stack()
        if found is not None and found is not self.grad_scaler:
            # before advancing: no collective issued, so each rank raises on its own (no waiting)
            raise GradScalerError(unannounced_scaler_message(found, self.grad_scaler))
        if self._scaler_counter is not None:
            self._scaler_counter.hook_ran += 1
        self._on_step()

    def _remove_scaler_counter(self) -> None:
        if self._scaler_counter is not None:
            self._scaler_counter.uninstall()
            self._scaler_counter = None

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close_compute_range()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._remove_scaler_counter()
        if exc_type is None:
            self.drain()

    def step(self) -> None:
        """Call once per iteration when not using ``with strategy:``: after ``inner_optimizer.step()``,
        or, with a GradScaler, after ``scaler.update()`` whether or not the scaler stepped."""
        if self._hook is not None:
            raise RuntimeError(
                "strategy.step() called inside `with strategy:`; the optimizer hook "
                "already advances the strategy (use one or the other)"
            )
        self._on_step()

    def _open_compute_range(self) -> None:
        # lowcomm/compute spans the user's code between two hooks (forward, backward, inner step).
        self._close_compute_range()
        self._compute_range = nvtx_range("compute")
        self._compute_range.__enter__()

    def _close_compute_range(self) -> None:
        cm = getattr(self, "_compute_range", None)
        self._compute_range = None
        if cm is not None:
            cm.__exit__(None, None, None)

    def _on_step(self) -> None:
        t0 = time.perf_counter()
        self._close_compute_range()
        self.membership.before_step(self)  # torchft: the first quorum, at the first step
        compute = t0 - self._last_end
        self.step_count += 1
        self.metrics.steps = self.step_count
        self._restarted_this_step = False
        self.metrics.compute_s += compute
        self.metrics.step_compute_s.append(compute)
        self._mark_device_step()
        with torch.no_grad():
            exposed_before = self.metrics.exposed_comm_s
            try:
                self._advance(self.step_count)
            except HealedInRound as healed:  # torchft: a returning replica healed mid-step
                self.membership.finish_heal(self, healed.step)
            if self.guard_every and self._applied_since_guard >= self.guard_every:
                self._applied_since_guard = 0
                self.check_consistency()
        t1 = time.perf_counter()
        self.metrics.overhead_s += max(0.0, (t1 - t0) - (self.metrics.exposed_comm_s - exposed_before))
        self._last_end = t1
        self._open_compute_range()

    def _mark_device_step(self) -> None:
        """On a GPU the host runs ahead of the device, so host time between hooks is enqueue time,
        not compute time. Record an event on the compute stream at every hook and turn each pair of
        completed events into a device step time (read only once the later event has completed,
        found by polling: no synchronisation)."""
        if self.device.type != "cuda":
            return
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        self._step_events.append(ev)
        while len(self._step_events) >= 2 and self._step_events[1].query():
            first = self._step_events.pop(0)
            self.metrics.device_step_s.append(first.elapsed_time(self._step_events[0]) / 1e3)

    def new_compute_samples(self) -> list[float]:
        """Per-step compute times measured since the last call: host time between hooks on the CPU,
        device time between hook events on a GPU (see ``_mark_device_step``)."""
        samples = self.metrics.device_step_s if self.device.type == "cuda" else self.metrics.step_compute_s
        new = samples[self._samples_seen :]
        self._samples_seen = len(samples)
        return new

    def _record_sync(self, pd: Any, t: int, t0: float, **fields: Any) -> None:
        """Record the sync ``pd`` (a dense or sparse pending sync) applied after step t; its merge
        started at ``t0`` (perf_counter)."""
        self._record(
            SyncRecord(
                send_step=pd.send_step,
                apply_step=t,
                bytes=pd.wire_bytes,
                in_flight_s=pd.in_flight_s,
                exposed_s=pd.exposed_s,
                staleness=t - pd.send_step,
                pack_s=pd.pack_s,
                merge_s=time.perf_counter() - t0,
                **fields,
            )
        )

    def _record(self, rec: SyncRecord) -> None:
        m = self.metrics
        m.syncs.append(rec)
        m.num_syncs += 1
        m.num_skipped += int(rec.skipped)
        m.bytes_sent += rec.bytes
        m.exposed_comm_s += rec.exposed_s
        self._applied_since_guard += 1
        if self.metrics_callback is not None:
            self.metrics_callback(rec)

    # ----- subclass interface --------------------------------------------------------------------
    @abc.abstractmethod
    def _advance(self, t: int) -> None:
        """Defined by each strategy."""

    @abc.abstractmethod
    def _drain(self) -> None:
        """Defined by each strategy."""

    @abc.abstractmethod
    def _state(self) -> dict[str, Any]:
        """Defined by each strategy."""

    @abc.abstractmethod
    def _load_state(self, sd: dict[str, Any]) -> None:
        """Defined by each strategy."""

    @abc.abstractmethod
    def _guard_values(self) -> list[tuple[str, int]]:
        """Defined by each strategy."""

    def finish(self) -> None:
        """End of training: wait for and apply every in-flight sync NOW (earlier than scheduled), so
        the parameters include the last results. Collective; call on every rank at the same step.
        Then checks that this rank's parameters still view the strategy's buffer: a parameter
        reassigned since the last send raises ``ParameterViewError`` here, on the rank where it
        happened (the other ranks' results are complete; a further collective here could pair with
        a peer's in-flight sync when ranks ran different numbers of rounds)."""
        with torch.no_grad():
            self._finish()
        forget_settled()
        problem = self.frags.broken_view(self.model)
        if problem is not None:
            raise ParameterViewError(
                f"{self.method} finish at step {self.step_count}: {problem}; the last "
                "results did not reach the model on this rank"
            )

    @abc.abstractmethod
    def _finish(self) -> None:
        """Defined by each strategy."""

    def drain(self) -> None:
        """Wait for every in-flight collective. Results stay pending and are applied at their
        scheduled step, so draining never changes the trajectory."""
        with torch.no_grad():
            self._drain()
        forget_settled()

    # ----- consistency guard ---------------------------------------------------------------------
    def check_consistency(self) -> None:
        """All-gather a hash of each piece of shared state; raise ConsistencyError naming the first
        piece (fragment of g, or schedule state) that differs between ranks. Collective: every rank
        of the group must call it at the same point (``guard_every=`` does this for you)."""
        named = self._guard_values()
        mine = torch.tensor([h for _, h in named], dtype=torch.int64)
        if self.device.type == "cuda":
            mine = mine.to(self.device)
        outs = self.transport.blocking_all_gather(mine, name=f"consistency guard at step {self.step_count}")
        table = torch.stack([o.cpu() for o in outs])  # (world, pieces)
        for j, (what, _) in enumerate(named):
            col = table[:, j]
            if not bool((col == col[0]).all()):
                raise ConsistencyError(
                    f"ranks disagree on {what} at step {self.step_count} (hashes by rank: {col.tolist()})"
                )

    # ----- checkpoints ---------------------------------------------------------------------------
    def shape(self) -> dict[str, Any]:
        """What a checkpoint must match to be loaded into this strategy."""
        return {
            "method": self.method,
            "fragments": self.frags.num_fragments,
            "world_size": self.world,
            "param_count": self.frags.numel,
            "fragment_sizes": self.frags.sizes(),
        }

    def state_dict(self) -> dict[str, Any]:
        """g, u, pending results and schedule state (drains in-flight collectives first). Tensors
        are CPU clones; everything is loadable with ``torch.load(weights_only=True)``."""
        self.drain()
        return {
            "format_version": FORMAT_VERSION,
            "shape": self.shape(),
            "step": self.step_count,
            **self._state(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore ``state_dict()``. Every tensor's dtype and shape is checked before anything is
        changed; ``CheckpointError`` names the first entry that does not fit."""
        self._validate(sd)
        self.drain()
        self._apply_state(sd)

    def _apply_state(self, sd: dict[str, Any]) -> None:
        """Restore a validated ``state_dict()`` (no in-flight collective): nothing here refuses."""
        with torch.no_grad():
            self._load_state(sd)
        self.step_count = sd["step"]
        self.metrics.steps = self.step_count

    def _validate(self, sd: object) -> None:
        """Everything ``load_state_dict`` will read, checked before anything changes."""
        self._check_shape(sd)
        assert isinstance(sd, dict)
        step = sd.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint entry step should be an int >= 0, got {step!r}")
        self._validate_state(sd)

    @abc.abstractmethod
    def _validate_state(self, sd: dict[str, Any]) -> None:
        """Raise CheckpointError if any entry of ``sd`` has the wrong type, dtype or shape."""

    def _check_shape(self, sd: object) -> None:
        if not isinstance(sd, dict) or "format_version" not in sd or "shape" not in sd:
            raise CheckpointError("not a lowcomm strategy state (missing format_version / shape)")
        if sd["format_version"] != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint format version {sd['format_version']} is not supported "
                f"(this build reads version {FORMAT_VERSION})"
            )
        mine, theirs = self.shape(), sd["shape"]
        if not isinstance(theirs, dict):
            raise CheckpointError("checkpoint entry shape should be a dict")
        for key in mine:
            if theirs.get(key) != mine[key]:
                raise CheckpointError(
                    f"checkpoint {key} is {theirs.get(key)!r} but this strategy has "
                    f"{mine[key]!r}; a checkpoint loads only into the same method, "
                    "fragments, world size and model"
                )

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write strategy + model + inner-optimizer state of THIS rank to ``path`` atomically and
        with a checksum (see ``runtime.checkpoint``). One file per rank."""
        refuse_sharded_checkpoint(self.model, "save_checkpoint")
        obj = {
            "format_version": FORMAT_VERSION,
            "shape": self.shape(),
            "strategy": self.state_dict(),
            "model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.inner_optimizer.state_dict(),
            "optimizer_type": _qualname(self.inner_optimizer),
            "rank": self.rank,  # the file is this rank's: its parameters, residual, results in flight
        }
        write_checkpoint(obj, path)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore what ``save_checkpoint`` wrote. Refuses, with ``CheckpointError`` and nothing
        changed, a file that fails its checksum, belongs to another method, model or world size,
        holds a tensor of the wrong dtype or shape, or was written with another inner optimizer or
        with optimizer state that does not fit its parameters, or was written by another rank of the
        group: everything is checked first, then the model, the inner optimizer and the strategy are
        loaded."""
        refuse_sharded_checkpoint(self.model, "load_checkpoint")
        obj = read_checkpoint(path)
        self._check_shape(obj)
        written_by = obj.get("rank", self.rank)  # (files of older builds do not say)
        if written_by != self.rank:
            raise CheckpointError(
                f"checkpoint was written by rank {written_by!r} but this is rank {self.rank}: a checkpoint "
                "file holds one rank's state (its parameters, inner optimizer, results in flight, error-"
                "feedback residual); load each rank's own file"
            )
        self._validate(obj.get("strategy"))
        want = _qualname(self.inner_optimizer)
        if obj.get("optimizer_type") != want:
            raise CheckpointError(
                f"checkpoint was written with inner optimizer "
                f"{obj.get('optimizer_type')!r} "
                f"but this strategy wraps {want!r}"
            )
        model_sd = obj.get("model")
        if not isinstance(model_sd, dict):
            raise CheckpointError("checkpoint entry model should be a dict")
        mine = self.model.state_dict()
        if set(model_sd) != set(mine):
            extra, missing = sorted(set(model_sd) - set(mine)), sorted(set(mine) - set(model_sd))
            raise CheckpointError(
                f"checkpoint model entries do not match this model "
                f"(unexpected: {extra[:5]}, "
                f"missing: {missing[:5]})"
            )
        for k, v in mine.items():
            expect_tensor(f"model[{k!r}]", model_sd[k], tuple(v.shape), v.dtype)
        names = {id(p): n for n, p in self.model.named_parameters()}
        check_optimizer_state(obj.get("optimizer"), self.inner_optimizer, names)
        self.frags.check_views(self.model)  # the model loads into the views: they must still hold
        self.drain()  # may raise SyncError (a dead peer): still before any change
        # checked: from here on nothing refuses
        with torch.no_grad():
            self.model.load_state_dict(model_sd)  # copies into the flat views, in place
        self.inner_optimizer.load_state_dict(obj["optimizer"])
        self._apply_state(obj["strategy"])


def _qualname(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _plain(v: object) -> object:
    """Configuration values as plain, comparable Python data (dtypes and devices as strings)."""
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, (torch.dtype, torch.device)):
        return str(v)
    return v


def _check_optimizer_covers(opt: torch.optim.Optimizer, model: nn.Module, frags: FlatFragments) -> None:
    """The inner optimizer must step exactly the model's trainable parameters: one it does not hold
    would be synchronised but never trained, one outside the model trained but never synchronised."""
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    for grp, names in zip(frags.params, frags.names, strict=True):
        for p, n in zip(grp, names, strict=True):
            if id(p) not in held:
                raise ValueError(
                    f"inner_optimizer does not hold the model's trainable parameter {n!r}; build the "
                    "optimizer over model.parameters() (freeze a parameter with requires_grad_(False))"
                )
    in_model = {id(p) for p in model.parameters()}
    if any(id(p) not in in_model for group in opt.param_groups for p in group["params"]):
        raise ValueError(
            "inner_optimizer holds parameters that are not the model's; build it over model.parameters()"
        )


def _refuse_second_wrap(model: nn.Module) -> None:
    for n, p in model.named_parameters():
        ref = getattr(p, _OWNER, None)
        owner = ref() if ref is not None else None
        if owner is not None:
            raise ValueError(
                f"model is already wrapped by a {type(owner).__name__} strategy "
                f"(parameter {n!r}); "
                "a second strategy would leave the first one synchronising an orphaned "
                "buffer. Call first_strategy.close() before wrapping the model again."
            )


def nvtx(name: str):
    """Shorthand so strategy code reads ``with nvtx("pack"):``."""
    return nvtx_range(name)
