"""Every knob of one training run, validated in one place.

A :class:`TrainSpec` is what the CLI builds from its arguments and what each worker process
receives (it pickles), so a run is fully described by it and it is saved beside the results.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

from ..runtime import compression, eager, schedule, topk_wire
from ..runtime.transport import DEFAULT_TIMEOUT_S, WAN
from .corpus import DEFAULT_EVAL_BYTES
from .errors import SpecError
from .model import ModelConfig, parameter_count
from .presets import DEFAULT

# CLI names of the methods, in the order the comparison shows them.
METHODS = ("dp", "diloco", "streaming", "cocodc", "loscar")
METHOD_LABELS = {
    "dp": "data-parallel (every step)",
    "diloco": "DiLoCo",
    "streaming": "Streaming DiLoCo",
    "cocodc": "CoCoDC",
    "loscar": "LOSCAR",
}
# The choice sets are the runtime's (one owner): CoCoDC's lambda modes and fragment scores,
# LOSCAR's merges, and the names of the wire formats.
LAM_MODES = tuple(schedule.LAM_MODES)
MERGES = tuple(schedule.LOSCAR_MERGES)
SCORES = tuple(schedule.SCORES)
TIMINGS = tuple(schedule.TIMINGS)  # how CoCoDC's adaptive N gets its step and sync times
TAYLOR_CONTROLS = tuple(schedule.TAYLOR_CONTROLS)  # CoCoDC's controls of the Taylor term
WIRE_DTYPE_NAMES = (*schedule.WIRE_FORMATS, *schedule.SPARSE_WIRE_FORMATS)
OUTER_DELAYS = tuple(eager.OUTER_DELAYS)  # the outer step overlapped with the next round, or not
#: the methods that take an outer_delay other than 'none', and their runtime classes
OUTER_DELAY_METHODS = {"diloco": "DiLoCo", "streaming": "StreamingDiLoCo"}
#: the model's parameter dtype (bf16 / fp16: the strategies keep a float32 outer master)
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: how worker_speeds slow a worker: 'sleep' stretches each of its steps (every worker runs the same
#: steps); 'steps' gives a c x slower LOSCAR worker c x fewer steps per round (other methods cannot
#: leave a worker behind, so their slow worker still sleeps and the others wait for it at each sync;
#: see TrainSpec.step_stretch, and --task mlp's time model)
SPEED_MODELS = ("sleep", "steps")
#: how the training text is shared out: contiguous slices of the sorted files' concatenation (each
#: worker reads other files: non-iid) or interleaved blocks of IID_BLOCK bytes (every worker reads
#: every part of the text)
SPLITS = ("contiguous", "iid")


def _marked(field: str) -> str:
    return f"<{field}>"  # how SpecError marks a field in its message


@dataclass(frozen=True)
class Range:
    """Allowed values of a numeric knob: ``lo`` to ``hi`` (None: unbounded), ends included unless open."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def describe(self) -> str:
        def num(v: float | None) -> str:
            return f"{v:g}" if isinstance(v, float) else str(v)

        if self.hi is None:
            return f"must be {'>' if self.lo_open else '>='} {num(self.lo)}"
        if self.lo is None:
            return f"must be {'<' if self.hi_open else '<='} {num(self.hi)}"
        left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        return f"must be in {left}{num(self.lo)}, {num(self.hi)}{right}"


# Numeric knobs and their ranges, the one table that both TrainSpec.validate and the CLI's flags check
# (a flag in other units, --latency-ms and --bandwidth-mbps, is a positive multiple of its field, so
# a bound of 0 holds in either unit).
POSITIVE, NON_NEGATIVE = Range(0, lo_open=True), Range(0)
RANGES: dict[str, Range] = {
    "workers": Range(1),
    "steps": Range(1),
    "batch_size": Range(1),
    "sync_every": Range(1),
    "num_fragments": Range(1),
    "eval_every": Range(1),
    "eval_bytes": Range(1),
    "final_eval_bytes": NON_NEGATIVE,
    "warmup_steps": NON_NEGATIVE,
    "fragment_sync_delay": NON_NEGATIVE,
    "local_steps": Range(1),
    "overlap_steps": NON_NEGATIVE,
    "seed": Range(0, 2**32 - 1),  # the data order's generator is seeded with seed * 1_000_003 + rank
    "lr": POSITIVE,
    "step_time_ms": POSITIVE,
    "outer_lr": POSITIVE,
    "bandwidth_bytes_per_s": POSITIVE,
    "latency_s": NON_NEGATIVE,
    "weight_decay": NON_NEGATIVE,
    "outer_momentum": NON_NEGATIVE,
    "lam": NON_NEGATIVE,
    "gamma": NON_NEGATIVE,
    "grad_clip": NON_NEGATIVE,
    "fragment_update_alpha": Range(0, 1),
    "min_lr_frac": Range(0, 1, lo_open=True),
    "density": Range(0, 1),  # LOSCAR p; 0: no communication (each worker trains alone)
}
INT_FIELDS = (
    "workers steps batch_size sync_every num_fragments eval_every eval_bytes final_eval_bytes warmup_steps "
    "fragment_sync_delay local_steps overlap_steps seed"
).split()
OPTIONAL_FIELDS = ("local_steps", "overlap_steps")  # None: derived (resolved_local_steps/_overlap_steps)


@dataclass
class TrainSpec:
    """One run of the byte-level LM across ``workers`` gloo ranks.

    Communication model: every collective on the emulated WAN completes no earlier than
    ``latency_s + bytes / bandwidth_bytes_per_s`` after it was issued.
    """

    method: str = "diloco"
    workers: int = 4
    steps: int = DEFAULT["steps"]
    batch_size: int = 8
    model: ModelConfig = field(default_factory=ModelConfig)
    # inner AdamW with linear warm-up then cosine decay to lr * min_lr_frac
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 40
    min_lr_frac: float = 0.1
    grad_clip: float = 1.0
    # outer optimizer and schedules (docs/algorithms.md symbols in comments)
    sync_every: int = DEFAULT["sync_every"]  # H
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    num_fragments: int = 4  # K
    fragment_sync_delay: int = DEFAULT["fragment_sync_delay"]  # tau
    fragment_update_alpha: float = 0.0  # alpha (Streaming DiLoCo mix)
    # DiLoCo / Streaming DiLoCo: 'eager' or 'delayed' overlap a whole outer round (runtime.eager)
    outer_delay: str = "none"
    lam: float = 0.5
    lam_mode: str = "normalized"
    gamma: float = 0.4
    syncs_per_period: str | int = "auto"  # N
    score: str = "l2_global"
    log_scores: bool = False  # CoCoDC: record every sync's norms and every choice's scores (score_log)
    # CoCoDC's adaptive N: T_c and T_s from the emulated link and this emulated step time (reproducible),
    # or measured at run time ('measured')
    cocodc_timing: str = "emulated"
    step_time_ms: float = schedule.DEFAULT_STEP_TIME_S * 1e3
    taylor_control: str = "none"  # CoCoDC control of the Taylor term: 'flip' its sign, 'random' direction
    density: float = 0.25  # LOSCAR p
    local_steps: int | None = None  # LOSCAR N_i; None -> sync_every // num_fragments - overlap
    overlap_steps: int | None = None  # LOSCAR Q; None -> fragment_sync_delay
    merge: str = "delay_corrected"
    worker_speeds: tuple[float, ...] | None = None  # relative step times (heterogeneous LOSCAR)
    speed_model: str = "sleep"  # what worker_speeds do: see SPEED_MODELS
    split: str = "contiguous"  # how the training text is shared out between workers: see SPLITS
    wire_dtype: str = "fp32"
    quant_block: int = compression.DEFAULT_QUANT_BLOCK  # elements per scale of a quantized wire_dtype
    error_feedback: bool = False  # quantized wire_dtype: feed each worker's quantization error back
    # wire_dtype 'topk' (always with error feedback): k largest of each chunk, bits per value, e's decay
    topk_k: int = 64
    topk_chunk: int = 4096
    topk_bits: int = 2
    ef_beta: float = topk_wire.DEFAULT_EF_BETA
    param_dtype: str = "fp32"
    # emulated WAN
    latency_s: float = 0.05
    bandwidth_bytes_per_s: float = 12.5e6  # 100 Mbit/s
    # data and evaluation
    data: str | None = None  # None: the Python standard library
    seed: int = 0
    eval_every: int = DEFAULT["eval_every"]
    # validation bytes scored per evaluation: non-overlapping seq_len windows spread evenly over the
    # validation text, eval_bytes target bytes (all of the text when shorter); see corpus.EvalSet
    eval_bytes: int = DEFAULT_EVAL_BYTES
    # > 0: after the last step, one more evaluation on this many bytes (RunResult.final_eval), so
    # that frequent evaluations can be small while the final loss rests on a large sample; 0: none
    final_eval_bytes: int = 0
    name: str | None = None  # label in tables; default from the method
    profile_dir: str | None = None  # set by `lowcomm profile`: write a torch.profiler trace per rank
    tensorboard_dir: str | None = None  # --tensorboard: rank 0 writes TensorBoard event files here

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

    def relative_speeds(self) -> list[float]:
        """Each worker's step time over the fastest one's (c_i >= 1; all 1 without worker_speeds)."""
        speeds = self.worker_speeds or (1.0,) * self.workers
        fastest = min(speeds)
        return [s / fastest for s in speeds]

    def rank_step_counts(self) -> tuple[list[int], list[int]]:
        """LOSCAR's per-rank (N_i, Q_i). With speed_model 'steps' a worker c x slower than the
        fastest runs N_i = max(1, floor(N / c)) steps before sending and Q_i = floor(Q / c) (at
        least 1 when Q >= 1, so an overlapped round stays overlapped) while the sync is in flight;
        otherwise every rank runs N and Q."""
        N, Q = self.resolved_local_steps(), self.resolved_overlap_steps()
        if self.speed_model != "steps":
            return [N] * self.workers, [Q] * self.workers
        cs = self.relative_speeds()
        local = [max(1, math.floor(N / c + 1e-9)) for c in cs]
        overlap = [0 if Q == 0 else max(1, math.floor(Q / c + 1e-9)) for c in cs]
        return local, overlap

    def round_steps(self) -> int:
        """A LOSCAR round in ticks (steps of the fastest worker): N + Q."""
        return self.resolved_local_steps() + self.resolved_overlap_steps()

    def step_stretch(self, rank: int) -> float:
        """The factor by which the LM harness stretches ``rank``'s steps in wall-clock (it sleeps
        (factor - 1) x its step time): worker_speeds[rank] with speed_model 'sleep', and also with
        'steps' for every method but LOSCAR, which cannot let a slow worker run fewer steps, so it
        must be slow in time for the others to wait for it; 1 for LOSCAR under 'steps' (fewer steps
        instead, see steps_on) and without worker_speeds."""
        if not self.worker_speeds or (self.method == "loscar" and self.speed_model == "steps"):
            return 1.0
        return float(self.worker_speeds[rank])

    def steps_on(self, rank: int, tick: int) -> bool:
        """Whether ``rank`` runs an inner step at ``tick`` (1-based; a tick is one step of the fastest
        worker). Always, except for LOSCAR with speed_model 'steps': a rank with n = N_i + Q_i steps
        per round of R = N + Q ticks spreads them evenly over the round, its last on the round's last
        tick, so every rank ends a round (and merges) on the same tick."""
        if self.method != "loscar" or self.speed_model != "steps":
            return True
        local, overlap = self.rank_step_counts()
        n, R = local[rank] + overlap[rank], self.round_steps()
        t = (tick - 1) % R + 1
        return (t * n) // R > ((t - 1) * n) // R

    def validate(self) -> None:
        """Raise :class:`SpecError` naming the first bad knob as ``<field>`` (the CLI shows its flag
        and exits with 2)."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise SpecError(msg)

        need(self.method in METHODS, f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        for name in INT_FIELDS:
            v = getattr(self, name)
            if v is None and name in OPTIONAL_FIELDS:
                continue
            need(isinstance(v, int) and not isinstance(v, bool), f"<{name}> must be an int, got {v!r}")
        for name, allowed in RANGES.items():
            v = getattr(self, name)
            if v is None and name in OPTIONAL_FIELDS:
                continue
            need(allowed.contains(v), f"<{name}> {allowed.describe()}, got {v!r}")
        need(self.lam_mode in LAM_MODES, f"<lam_mode> must be one of {LAM_MODES}, got {self.lam_mode!r}")
        need(self.merge in MERGES, f"<merge> must be one of {MERGES}, got {self.merge!r}")
        need(self.score in SCORES, f"<score> must be one of {SCORES}, got {self.score!r}")
        need(
            self.cocodc_timing in TIMINGS,
            f"<cocodc_timing> must be one of {TIMINGS}, got {self.cocodc_timing!r}",
        )
        need(
            self.taylor_control in TAYLOR_CONTROLS,
            f"<taylor_control> must be one of {TAYLOR_CONTROLS}, got {self.taylor_control!r}",
        )
        need(
            self.wire_dtype in WIRE_DTYPE_NAMES,
            f"<wire_dtype> must be one of {WIRE_DTYPE_NAMES}, got {self.wire_dtype!r}",
        )
        try:  # the strategies' own rules for the block, error feedback and the top-k knobs
            topk = topk_wire.check_topk(
                self.topk_k, self.topk_chunk, self.topk_bits, self.ef_beta, name=_marked
            )
            if self.wire_dtype in schedule.SPARSE_WIRE_FORMATS:
                wire = topk_wire.TopKWire(*topk, torch.float32, self.workers)
            else:
                wire = compression.check_wire_choice(
                    self.wire_dtype, self.quant_block, self.error_feedback, name=_marked
                )
        except (TypeError, ValueError) as exc:
            raise SpecError(str(exc)) from None
        need(
            not (self.wire_dtype in schedule.SPARSE_WIRE_FORMATS and self.method == "loscar"),
            f"<wire_dtype> {self.wire_dtype} is not supported by LOSCAR (it already sends a sparse subset); "
            "leave it out of the methods",
        )
        self._check_link(wire)
        need(
            not (self.error_feedback and self.method == "loscar"),
            "<error_feedback> is not supported by LOSCAR (its mask changes every round); leave it out "
            "of the methods",
        )
        need(
            self.param_dtype in PARAM_DTYPES,
            f"<param_dtype> must be one of {tuple(PARAM_DTYPES)}, got {self.param_dtype!r}",
        )
        need(
            self.final_eval_bytes == 0 or self.final_eval_bytes >= self.model.seq_len,
            f"<final_eval_bytes> must be 0 (none) or at least one window of <ModelConfig.seq_len> = "
            f"{self.model.seq_len} bytes, got {self.final_eval_bytes}",
        )
        need(
            self.eval_bytes >= self.model.seq_len,
            f"<eval_bytes> must be at least one window of <ModelConfig.seq_len> = {self.model.seq_len} "
            f"bytes, got {self.eval_bytes}",
        )
        need(
            self.syncs_per_period == "auto"
            or (isinstance(self.syncs_per_period, int) and self.syncs_per_period >= 1),
            f"<syncs_per_period> must be 'auto' or an int >= 1, got {self.syncs_per_period!r}",
        )
        # The runtime's schedule constraints (its own checks), here so bad input fails before any spawn.
        K, H, tau = self.num_fragments, self.sync_every, self.fragment_sync_delay
        try:
            if self.method == "streaming":
                schedule.check_streaming_schedule(H, K, tau, name=_marked)
            if self.method == "cocodc":
                schedule.check_cocodc_schedule(H, K, tau, self.syncs_per_period, name=_marked)
        except ValueError as exc:
            raise SpecError(str(exc)) from None
        self._check_outer_delay()
        if self.worker_speeds is not None:
            need(
                len(self.worker_speeds) == self.workers and all(s > 0 for s in self.worker_speeds),
                f"<worker_speeds> needs <workers> = {self.workers} positive values, "
                f"got {','.join(f'{s:g}' for s in self.worker_speeds)}",
            )
        need(
            self.speed_model in SPEED_MODELS,
            f"<speed_model> must be one of {SPEED_MODELS}, got {self.speed_model!r}",
        )
        need(self.split in SPLITS, f"<split> must be one of {SPLITS}, got {self.split!r}")
        need(
            isinstance(self.log_scores, bool), f"<log_scores> must be true or false, got {self.log_scores!r}"
        )
        need(
            not self.log_scores or self.method == "cocodc",
            f"<log_scores> records CoCoDC's fragment scores; method {self.method!r} has none",
        )
        if self.method == "loscar" and self.speed_model == "steps":
            # ranks evaluate together (a collective): only at a round end has every rank merged
            R = self.round_steps()
            for name in ("steps", "eval_every"):
                need(
                    getattr(self, name) % R == 0,
                    f"<{name}> must be a multiple of a LOSCAR round (N + Q = {R} steps) with "
                    f"<speed_model> 'steps', got {getattr(self, name)}",
                )

    def _check_outer_delay(self) -> None:
        """The runtime's rule (runtime.eager.check_outer_delay) for the methods that take an
        overlapped outer step; the others refuse any mode but 'none' by name."""
        if self.outer_delay not in OUTER_DELAYS:
            raise SpecError(f"<outer_delay> must be one of {OUTER_DELAYS}, got {self.outer_delay!r}")
        if self.outer_delay == "none":
            return
        if self.method not in OUTER_DELAY_METHODS:
            raise SpecError(
                f"<outer_delay> {self.outer_delay!r} is not supported by {METHOD_LABELS[self.method]}: "
                f"only {' and '.join(METHOD_LABELS[m] for m in OUTER_DELAY_METHODS)} overlap a whole "
                "outer round"
            )
        tau = self.fragment_sync_delay if self.method == "streaming" else 0
        try:
            eager.check_outer_delay(
                self.outer_delay, OUTER_DELAY_METHODS[self.method], fragment_sync_delay=tau, ft=False,
                wire_dtype=self.wire_dtype, name=_marked,
            )  # fmt: skip
        except ValueError as exc:
            raise SpecError(str(exc)) from None

    def _check_link(self, wire: compression.WireFormat) -> None:
        """The runtime refuses a link on which one sync outlasts its timeout (Transport.check_wan);
        the same rule here, naming the flags, before any worker starts. The payload is a lower bound
        of this run's largest sync (a fragment holds at least 1/K of the model), so nothing that
        could run is refused."""
        P = parameter_count(self.model)
        if self.method == "dp":  # the fp32 gradient, every step
            n, nbytes = P, 4 * P
        else:
            n = {"diloco": P, "loscar": math.ceil(self.density * P)}.get(
                self.method, -(-P // self.num_fragments)
            )
            nbytes = wire.payload_bytes(n) if n else 0
        try:
            secs = WAN(self.latency_s, self.bandwidth_bytes_per_s).collective_s(nbytes, self.workers)
        except ValueError as exc:
            raise SpecError(f"<latency_s> / <bandwidth_bytes_per_s>: {exc}") from None
        if n and secs > DEFAULT_TIMEOUT_S:
            raise SpecError(
                f"<latency_s> {self.latency_s * 1e3:g} ms and <bandwidth_bytes_per_s> "
                f"{self.bandwidth_bytes_per_s * 8 / 1e6:g} Mbit/s: one sync of {nbytes} payload bytes "
                f"with <workers> {self.workers} takes {secs:.4g} s on the emulated link, more than "
                f"the runtime's timeout of {DEFAULT_TIMEOUT_S:g} s"
            )

    def with_(self, **changes: Any) -> TrainSpec:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["label"] = self.label
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainSpec:
        """The spec :meth:`to_dict` wrote (a results file's run config), validated: the label is
        derived again, JSON's lists become the tuples they were. A field this version does not know
        is a SpecError naming it."""
        d = dict(d)
        d.pop("label", None)
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise SpecError(f"unknown run-config fields {unknown} (made by another version?)")
        if isinstance(d.get("model"), dict):
            d["model"] = ModelConfig(**d["model"])
        if isinstance(d.get("worker_speeds"), list):
            d["worker_speeds"] = tuple(d["worker_speeds"])
        return cls(**d)
