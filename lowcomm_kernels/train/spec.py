"""Every knob of one training run, validated in one place.

A :class:`TrainSpec` is what the CLI builds from its arguments and what each worker process
receives (it pickles), so a run is fully described by it and it is saved beside the results.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .model import ModelConfig

# CLI names of the methods, in the order the comparison shows them.
METHODS = ("dp", "diloco", "streaming", "cocodc", "loscar")
METHOD_LABELS = {
    "dp": "data-parallel (every step)",
    "diloco": "DiLoCo",
    "streaming": "Streaming DiLoCo",
    "cocodc": "CoCoDC",
    "loscar": "LOSCAR",
}
LAM_MODES = ("absolute", "normalized")
MERGES = ("delay_corrected", "overwrite")
SCORES = ("l2_global", "l1_local", "round_robin")
WIRE_DTYPES = ("fp32", "bf16")


@dataclass
class TrainSpec:
    """One run of the byte-level LM across ``workers`` gloo ranks.

    Communication model: every collective on the emulated WAN completes no earlier than
    ``latency_s + bytes / bandwidth_bytes_per_s`` after it was issued.
    """

    method: str = "diloco"
    workers: int = 4
    steps: int = 600
    batch_size: int = 8
    model: ModelConfig = field(default_factory=ModelConfig)
    # inner AdamW with linear warm-up then cosine decay to lr * min_lr_frac
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 40
    min_lr_frac: float = 0.1
    grad_clip: float = 1.0
    # outer optimizer and schedules (docs/algorithms.md symbols in comments)
    sync_every: int = 50  # H
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    num_fragments: int = 4  # K
    fragment_sync_delay: int = 5  # tau
    fragment_update_alpha: float = 0.0  # alpha (Streaming DiLoCo mix)
    lam: float = 0.5
    lam_mode: str = "normalized"
    gamma: float = 0.4
    syncs_per_period: str | int = "auto"  # N
    score: str = "l2_global"
    density: float = 0.25  # LOSCAR p
    local_steps: int | None = None  # LOSCAR N_i; None -> sync_every // num_fragments - overlap
    overlap_steps: int | None = None  # LOSCAR Q; None -> fragment_sync_delay
    merge: str = "delay_corrected"
    worker_speeds: tuple[float, ...] | None = None  # relative step times (heterogeneous LOSCAR)
    wire_dtype: str = "fp32"
    # emulated WAN
    latency_s: float = 0.05
    bandwidth_bytes_per_s: float = 12.5e6  # 100 Mbit/s
    # data and evaluation
    data: str | None = None  # None: the Python standard library
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 8
    name: str | None = None  # label in tables; default from the method
    profile_dir: str | None = None  # set by `lowcomm profile`: write a torch.profiler trace per rank

    def __post_init__(self) -> None:
        self.validate()

    @property
    def label(self) -> str:
        return self.name or METHOD_LABELS.get(self.method, self.method)

    def resolved_local_steps(self) -> int:
        """LOSCAR's N. By default a round (N + Q steps) lasts H / K steps, so with density p = 1/K
        LOSCAR sends as many bytes per H steps as Streaming DiLoCo (one full model)."""
        if self.local_steps is not None:
            return self.local_steps
        return max(1, self.sync_every // self.num_fragments - self.resolved_overlap_steps())

    def resolved_overlap_steps(self) -> int:
        return self.overlap_steps if self.overlap_steps is not None else self.fragment_sync_delay

    def validate(self) -> None:
        """Raise ValueError naming the first bad knob (the CLI prints it and exits with 2)."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        need(self.method in METHODS, f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        need(isinstance(self.workers, int) and self.workers >= 1, f"workers must be >= 1, got {self.workers}")
        for name in ("steps", "batch_size", "sync_every", "num_fragments", "eval_every", "eval_batches"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 1, f"{name} must be an int >= 1, got {v!r}")
        need(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        need(
            self.fragment_sync_delay >= 0, f"fragment_sync_delay must be >= 0, got {self.fragment_sync_delay}"
        )
        for name in ("lr", "outer_lr", "bandwidth_bytes_per_s"):
            v = getattr(self, name)
            need(v > 0, f"{name} must be > 0, got {v}")
        for name in ("latency_s", "weight_decay", "outer_momentum", "lam", "gamma", "grad_clip"):
            v = getattr(self, name)
            need(v >= 0, f"{name} must be >= 0, got {v}")
        need(
            0.0 <= self.fragment_update_alpha <= 1.0,
            f"fragment_update_alpha must be in [0, 1], got {self.fragment_update_alpha}",
        )
        need(0.0 < self.min_lr_frac <= 1.0, f"min_lr_frac must be in (0, 1], got {self.min_lr_frac}")
        need(0.0 < self.density <= 1.0, f"density must be in (0, 1], got {self.density}")
        need(self.lam_mode in LAM_MODES, f"lam_mode must be one of {LAM_MODES}, got {self.lam_mode!r}")
        need(self.merge in MERGES, f"merge must be one of {MERGES}, got {self.merge!r}")
        need(self.score in SCORES, f"score must be one of {SCORES}, got {self.score!r}")
        need(
            self.wire_dtype in WIRE_DTYPES,
            f"wire_dtype must be one of {WIRE_DTYPES}, got {self.wire_dtype!r}",
        )
        need(
            self.syncs_per_period == "auto"
            or (isinstance(self.syncs_per_period, int) and self.syncs_per_period >= 1),
            f"syncs_per_period must be 'auto' or an int >= 1, got {self.syncs_per_period!r}",
        )
        # The runtime's schedule constraints, checked here so bad input fails before any spawn.
        K, H, tau = self.num_fragments, self.sync_every, self.fragment_sync_delay
        if self.method == "streaming":
            need(K <= H, f"fragments ({K}) must be <= sync_every ({H})")
            need(
                tau < H // K,
                f"delay ({tau}) must be < sync_every // fragments = {H // K} (the per-fragment period)",
            )
        if self.method == "cocodc":
            need(tau * K <= H, f"delay x fragments ({tau * K}) must be <= sync_every ({H})")
            if isinstance(self.syncs_per_period, int):
                n_max = H if tau == 0 else H // tau
                need(
                    K <= self.syncs_per_period <= n_max,
                    f"syncs_per_period ({self.syncs_per_period}) must lie in [fragments={K}, "
                    f"sync_every // delay = {n_max}]",
                )
        if self.local_steps is not None:
            need(self.local_steps >= 1, f"local_steps must be >= 1, got {self.local_steps}")
        if self.overlap_steps is not None:
            need(self.overlap_steps >= 0, f"overlap_steps must be >= 0, got {self.overlap_steps}")
        if self.worker_speeds is not None:
            need(
                len(self.worker_speeds) == self.workers and all(s > 0 for s in self.worker_speeds),
                f"worker_speeds needs {self.workers} positive values, got {self.worker_speeds}",
            )

    def with_(self, **changes: Any) -> TrainSpec:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["label"] = self.label
        return d
