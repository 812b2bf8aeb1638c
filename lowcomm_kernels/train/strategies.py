"""Build the runtime's strategy for a :class:`TrainSpec` and read its metrics uniformly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..wire_formats import BY_NAME
from .spec import TrainSpec


def _wire_argument(name: str) -> Any:
    """The strategies' ``wire_dtype`` for a name of ``wire_formats.TABLE``: None for fp32 (the outer
    state's own dtype: the CLI's parameters have a float32 master), another dense format's dtype,
    else the name itself (a quantized or sparse format)."""
    spec = BY_NAME.get(name)
    if spec is None or spec.kind != "dense":
        return name
    return None if spec.dtype == torch.float32 else spec.dtype


@dataclass
class CommTotals:
    """What the table needs from any method: payload bytes this worker sent, seconds it was
    blocked on communication, completed syncs, and method-specific extras (JSON-safe)."""

    bytes_sent: float = 0.0
    exposed_s: float = 0.0
    syncs: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def read(cls, strategy: Any) -> CommTotals:
        if strategy is None:  # LOSCAR at p = 0: nothing is ever sent
            return cls()
        m = strategy.metrics
        extra: dict = {"compute_s": float(getattr(m, "compute_s", 0.0))}
        skipped = getattr(m, "num_skipped", None)
        if skipped is not None:
            extra["skipped_syncs"] = int(skipped)
        records = getattr(m, "syncs", None)
        if isinstance(records, list) and records:
            staleness = [r.staleness for r in records if getattr(r, "staleness", None) is not None]
            if staleness:
                extra["mean_staleness"] = float(sum(staleness) / len(staleness))
            # the sync work on the critical path, per sync (``lowcomm_kernels.train.simcheck`` feeds it
            # to the simulator)
            extra["pack_s_mean"] = float(sum(r.pack_s for r in records) / len(records))
            extra["merge_s_mean"] = float(sum(r.merge_s for r in records) / len(records))
            frags = [r.fragment for r in records if getattr(r, "fragment", None) is not None]
            if frags:
                counts: dict[str, int] = {}
                for f in frags:
                    counts[str(f)] = counts.get(str(f), 0) + 1
                extra["syncs_per_fragment"] = counts
        n_history = getattr(strategy, "n_history", None)
        if n_history:  # CoCoDC: the N chosen in each period of H steps
            extra["syncs_per_period"] = [int(n) for n in n_history]
        score_log = strategy.score_records() if hasattr(strategy, "score_records") else None
        if score_log is not None:  # CoCoDC with log_scores: this worker's record
            extra["score_log"] = score_log
        return cls(float(m.bytes_sent), float(m.exposed_comm_s), int(m.num_syncs), extra)


def build_strategy(
    spec: TrainSpec,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    group: Any,
    metrics_callback: Any = None,
    manager: Any = None,
) -> Any:
    """The runtime strategy for ``spec.method`` (not 'dp', which the harness implements itself);
    ``metrics_callback`` receives each SyncRecord (see ``lowcomm_kernels.runtime.sinks``). None for
    LOSCAR at density 0, the no-communication baseline: each worker trains alone. With a torchft
    ``manager`` (``--faults``) it is one of ``spec.workers`` replicas: no fixed group, no emulated WAN."""
    import lowcomm_kernels.runtime as rt

    common: dict[str, Any] = {
        "metrics_callback": metrics_callback,
        "process_group": group,
        "wan": rt.WAN(spec.latency_s, spec.bandwidth_bytes_per_s),
        "wire_dtype": _wire_argument(spec.wire_dtype),
        "quant_block": spec.quant_block,
        "error_feedback": spec.error_feedback,
    }
    if spec.wire_dtype == "topk":  # the sparse format's knobs (runtime.topk_wire)
        common.update(
            topk_k=spec.topk_k, topk_chunk=spec.topk_chunk, topk_bits=spec.topk_bits, ef_beta=spec.ef_beta
        )
    if manager is not None:
        del common["process_group"], common["wan"]
        common.update(manager=manager, num_replicas=spec.workers)
    outer: dict[str, Any] = {"outer_lr": spec.outer_lr, "outer_momentum": spec.outer_momentum}
    if spec.method in ("diloco", "streaming"):  # the methods that take it (TrainSpec refuses the rest)
        outer["outer_delay"] = spec.outer_delay
    if spec.method == "diloco":
        return rt.DiLoCo(model, optimizer, sync_every=spec.sync_every, **outer, **common)
    stream: dict[str, Any] = {
        "sync_every": spec.sync_every,
        "num_fragments": spec.num_fragments,
        "fragment_sync_delay": spec.fragment_sync_delay,
    }
    if spec.method == "streaming":
        return rt.StreamingDiLoCo(
            model, optimizer, fragment_update_alpha=spec.fragment_update_alpha, **stream, **outer, **common
        )
    if spec.method == "cocodc":
        return rt.CoCoDC(
            model,
            optimizer,
            lam=spec.lam,
            lam_mode=spec.lam_mode,
            gamma=spec.gamma,
            syncs_per_period=spec.syncs_per_period,
            score=spec.score,
            timing=spec.cocodc_timing,
            step_time_s=spec.step_time_ms / 1e3,
            timing_link=rt.WAN(spec.latency_s, spec.bandwidth_bytes_per_s),  # the emulated N's link model
            taylor_control=spec.taylor_control,
            control_seed=spec.seed,
            score_log=spec.log_scores,
            **stream,
            **outer,
            **common,
        )
    if spec.method == "loscar":
        if spec.density == 0:
            return None
        local, overlap = spec.rank_step_counts()  # per rank: fewer steps for a slower worker
        return rt.LOSCAR(
            model,
            optimizer,
            density=spec.density,
            local_steps=local,
            overlap_steps=overlap,
            merge=spec.merge,
            seed=spec.seed,
            **common,
        )
    raise ValueError(f"no runtime strategy for method {spec.method!r}")
