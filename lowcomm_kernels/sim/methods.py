"""The methods as the runtime schedules them: which layers each sync carries, when it is sent and when
its result is needed.

A sync sent after inner step t with overlap τ is needed before step t + τ + 1 (τ = 0: blocking, as
DiLoCo). The send steps come from the runtime's own schedule rules (``runtime.schedule``:
``diloco_sends``, ``streaming_offsets``, ``cocodc_slot``, ``cocodc_auto_syncs``) and the bytes from
its own wire formats (``runtime.compression.resolve_wire_format``), so the simulator and the runtime
cannot drift apart.

- ``data-parallel``: every step, every layer's gradient (τ = 0).
- ``diloco``: every H steps, every layer's outer gradient (τ = 0 unless ``overlap`` is set).
- ``eager=True`` (diloco, streaming with τ = 0): a sync's result is needed a whole period later, at
  the fragment's next send (``runtime.eager``: the outer step at the send uses this worker's own
  fresh outer gradient and the average of the previous round). The naive delayed update has the
  same timeline.
- ``streaming``: K fragments of layers in the strided pattern (fragment p holds layers p, p + K,
  p + 2K, …), fragment p sent after steps t ≡ ⌊p·H/K⌋ (mod H), needed τ steps later.
- ``cocodc``: the same fragments, N sends per H steps in evenly spaced slots, N = clamp(⌊γ·H·T_c /
  T_s⌋, K, ⌊H/τ⌋) from the step time T_c and the simulated time T_s of one fragment's sync on an
  idle link (or ``syncs_per_period`` fixed); the fragment at each slot in round-robin order (the
  score's choice is not modelled). When K does not divide N the fragment order repeats only every
  K / gcd(N, K) periods, which is the schedule's period (``schedule_period``).
- wire ``topk`` (any method but LOSCAR and eager): per chunk the k largest values of the
  error-feedback buffer with their indices; ranks pick different indices, so the runtime
  all-gathers the payloads: (M − 1) × payload on each replica's link, in M − 1 hops.
- ``loscar``: rounds of H steps, a shared random mask of k = ⌈p·d⌉ coordinates of the whole model
  sent after step H − τ of each round and merged at its end (no indices travel: the mask comes from
  a shared seed). The runtime gathers the k values after the optimizer step, so LOSCAR's sync is one
  collective at the end of the step, never layer by layer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from ..runtime.compression import DEFAULT_QUANT_BLOCK, check_quant_block, resolve_wire_format
from ..runtime.schedule import (
    SPARSE_WIRE_FORMATS,
    WIRE_FORMATS,
    cocodc_auto_syncs,
    cocodc_max_syncs,
    cocodc_slot,
    diloco_sends,
    streaming_offsets,
)
from ..runtime.topk_wire import TopKFormat, check_topk
from .link import Link
from .workload import Workload

KINDS = ("data-parallel", "diloco", "streaming", "cocodc", "loscar")
#: the longest period simulated (a simulation covers three periods, their sends one by one)
MAX_SYNC_EVERY = 1_000_000
#: the most syncs one simulation may send (CoCoDC's N reaches H/τ on a fast link)
MAX_SYNCS = 100_000

#: wire formats the simulator knows beyond the runtime's: bits per value, no scales. The Streaming
#: DiLoCo paper's FP4 is E3M0 (1 sign, 3 exponent, 0 mantissa bits) and gives no scale overhead:
#: "fp4_e3m0_noscale" counts it so; "fp4_e3m0" is the runtime's format, its block scales counted.
SIM_ONLY_FORMATS = {"fp4_e3m0_noscale": 4}
WIRES = (*WIRE_FORMATS, *SPARSE_WIRE_FORMATS, *SIM_ONLY_FORMATS)
#: the runtime's top-k defaults (k values per chunk, chunk, bits per value)
TOPK_DEFAULT = (TopKFormat().k, TopKFormat().chunk, TopKFormat().bits)


@functools.lru_cache(maxsize=4096)  # the same few layer sizes, asked for at every sync
def wire_bytes(
    wire: str, values: int, quant_block: int = DEFAULT_QUANT_BLOCK, topk: tuple[int, int, int] = TOPK_DEFAULT
) -> float:
    """Bytes one replica's payload of ``values`` values takes in ``wire`` (scales included; for
    ``topk``, its scales, indices and values, as the runtime packs them)."""
    if wire in SIM_ONLY_FORMATS:
        return SIM_ONLY_FORMATS[wire] * values / 8
    if wire in SPARSE_WIRE_FORMATS:
        fmt, _ = check_topk(*topk, 0.0)
        return float(fmt.payload_bytes(values))
    fmt = resolve_wire_format(wire, quant_block, torch.float32, torch.float32)
    return float(fmt.payload_bytes(values))


@dataclass(frozen=True)
class Sync:
    """One sync: sent after step ``step``, needed before step ``need_step``; ``layers`` it carries
    with ``payload`` bytes per replica for each (``whole``: one collective at the end of the step
    instead of one per layer as each layer's gradient is ready)."""

    step: int
    need_step: int
    layers: tuple[int, ...]
    payload: tuple[float, ...]
    whole: bool = False
    collective: str = "all_reduce"


def _int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    return v


@dataclass(frozen=True)
class Method:
    """A method and its knobs (see the module docstring). ``sync_every`` is H; ``overlap`` is τ;
    streaming and CoCoDC fragments are ``layers_per_fragment`` layers each (the paper's 3), or
    exactly ``num_fragments`` when given."""

    kind: str
    sync_every: int = 100
    overlap: int = 0
    layers_per_fragment: int = 3
    num_fragments: int | None = None
    wire: str = "fp32"
    quant_block: int = DEFAULT_QUANT_BLOCK
    density: float = 1.0
    gamma: float = 0.4
    syncs_per_period: int | str = "auto"
    eager: bool = False  # the average needed at the fragment's next send (runtime.eager)
    topk: tuple[int, int, int] = TOPK_DEFAULT  # wire "topk": (k, chunk, bits)
    label: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"method must be one of {KINDS}, got {self.kind!r}")
        _int("sync_every", self.sync_every, 1)
        if self.sync_every > MAX_SYNC_EVERY:
            raise ValueError(
                f"sync_every must be <= {MAX_SYNC_EVERY:,} (steps per period), got {self.sync_every}"
            )
        _int("overlap", self.overlap, 0)
        _int("layers_per_fragment", self.layers_per_fragment, 1)
        if self.num_fragments is not None:
            _int("num_fragments", self.num_fragments, 1)
        if self.wire not in WIRES:
            raise ValueError(f"wire must be one of {WIRES}, got {self.wire!r}")
        check_quant_block(self.quant_block)
        if not (isinstance(self.topk, tuple) and len(self.topk) == 3):
            raise ValueError(f"topk must be (k, chunk, bits), got {self.topk!r}")
        check_topk(*self.topk, 0.0)
        if self.wire in SPARSE_WIRE_FORMATS and self.kind == "loscar":
            raise ValueError("loscar takes no topk wire: its shared random mask sparsifies already")
        if self.wire in SPARSE_WIRE_FORMATS and self.eager:
            raise ValueError("eager updates take no topk wire (the runtime refuses it)")
        if not (isinstance(self.density, (int, float)) and 0 < self.density <= 1):
            raise ValueError(f"density must be in (0, 1], got {self.density!r}")
        if not (isinstance(self.gamma, (int, float)) and math.isfinite(self.gamma) and self.gamma > 0):
            raise ValueError(f"gamma must be a finite number > 0, got {self.gamma!r}")
        if self.syncs_per_period != "auto":
            _int("syncs_per_period", self.syncs_per_period, 1)
        H, tau = self.sync_every, self.overlap
        if self.kind == "data-parallel" and tau:
            raise ValueError("data-parallel takes no overlap: every step needs the averaged gradient")
        if not isinstance(self.eager, bool):
            raise ValueError(f"eager must be a bool, got {self.eager!r}")
        if self.eager and (self.kind not in ("diloco", "streaming") or tau):
            raise ValueError(
                f"eager overlaps a whole period: diloco or streaming with overlap 0, got {self.kind} "
                f"with overlap={tau}"
            )
        if self.kind in ("diloco", "loscar") and tau >= H:
            raise ValueError(f"overlap={tau} must be < sync_every={H} (a result lands before the next send)")

    @property
    def name(self) -> str:
        return self.label or self.kind

    def fragments(self, workload: Workload) -> list[tuple[int, ...]]:
        """Layer indices (0-based) of each fragment, strided: fragment p holds p, p + K, p + 2K, …"""
        L = workload.layers
        if self.kind in ("data-parallel", "diloco", "loscar"):
            return [tuple(range(L))]
        K = self.num_fragments if self.num_fragments is not None else -(-L // self.layers_per_fragment)
        if K > L:
            raise ValueError(f"num_fragments={K} must be <= the model's {L} layers")
        return [tuple(range(p, L, K)) for p in range(K)]

    def validate(self, workload: Workload) -> None:
        """The checks that need the workload (the runtime's own rules, where it has them)."""
        K, H, tau = len(self.fragments(workload)), self.sync_every, self.overlap
        if self.kind == "streaming":
            if K > H:
                raise ValueError(f"{K} fragments need sync_every >= {K} (one send slot each), got {H}")
            if tau >= H // K:
                raise ValueError(
                    f"overlap={tau} must be < sync_every // fragments = {H // K}, so each fragment's "
                    "result lands before the next fragment is sent"
                )
        if self.kind == "cocodc":
            if tau * K > H:
                raise ValueError(f"overlap x fragments = {tau * K} must be <= sync_every={H}")
            n_max = cocodc_max_syncs(H, tau)
            if self.syncs_per_period != "auto" and not K <= int(self.syncs_per_period) <= n_max:
                raise ValueError(f"syncs_per_period must lie in [{K}, {n_max}], got {self.syncs_per_period}")
            n = n_max if self.syncs_per_period == "auto" else int(self.syncs_per_period)
            if 3 * n > MAX_SYNCS:  # before a search that would simulate up to N syncs per period
                raise ValueError(
                    f"up to {n:,} syncs per period (sync_every // overlap) make more than {MAX_SYNCS:,} "
                    "to simulate over three periods: use a shorter sync_every or a longer overlap"
                )

    def period(self) -> int:
        return 1 if self.kind == "data-parallel" else self.sync_every

    def schedule_period(self, workload: Workload, link: Link) -> int:
        """Steps after which the whole schedule (send steps and the fragment of each) repeats: a
        period, or for CoCoDC's round-robin K / gcd(N, K) periods."""
        if self.kind != "cocodc":
            return self.period()
        K = len(self.fragments(workload))
        return self.sync_every * (K // math.gcd(self.cocodc_syncs(workload, link), K))

    def payload(self, workload: Workload, layers: tuple[int, ...]) -> tuple[float, ...]:
        share = self.density if self.kind == "loscar" else 1.0
        return tuple(
            wire_bytes(
                self.wire, max(1, math.ceil(share * workload.layer_params[l])), self.quant_block, self.topk
            )
            for l in layers
        )

    def cocodc_syncs(self, workload: Workload, link: Link) -> int:
        """N per period: fixed, or CoCoDC's rule from T_c = the step time and T_s = the mean
        fragment's sync on an idle link."""
        frags = self.fragments(workload)
        K, H = len(frags), self.sync_every
        if self.syncs_per_period != "auto":
            return int(self.syncs_per_period)
        mean = sum(sum(self.payload(workload, f)) for f in frags) / K
        return cocodc_auto_syncs(
            self.gamma, H, workload.step_s, link.collective_s(mean), K, cocodc_max_syncs(H, self.overlap)
        )

    def period_sends(self, workload: Workload, link: Link) -> list[int]:
        """The steps s = 1..P of one period after which a sync is sent, in order (the schedule
        repeats every period; the fragment of each send is :meth:`syncs`'s business). Closed forms
        of the runtime's rules, each checked against the rule itself at the steps it gives."""
        frags = self.fragments(workload)
        H, tau = self.sync_every, self.overlap
        if self.kind == "data-parallel":
            sends = [1]
        elif self.kind == "diloco":
            sends = [H]
            assert diloco_sends(H, H)
        elif self.kind == "streaming":  # fragment p after t ≡ offset (mod H): s = offset, or H for 0
            sends = sorted(off or H for off in streaming_offsets(H, len(frags)))
        elif self.kind == "cocodc":  # the N slots: s_j = ⌈j·H/N⌉, j = 1..N
            n = self.cocodc_syncs(workload, link)
            sends = [-(-j * H // n) for j in range(1, n + 1)]
            assert all(cocodc_slot(s, n, H) for s in sends)
        else:  # loscar: after step H − τ of each round (its local steps), merged at the round's end
            sends = [H - tau]
        return sends

    def syncs(self, workload: Workload, link: Link, steps: int) -> list[Sync]:
        """Every sync sent in steps 1..``steps``, in send order."""
        self.validate(workload)
        frags = self.fragments(workload)
        P = self.period()
        tau = self.sync_every if self.eager else self.overlap  # eager: collected at the next send
        sends = self.period_sends(workload, link)
        count = len(sends) * -(-steps // P)
        if count > MAX_SYNCS:
            raise ValueError(
                f"{self.name}: {len(sends):,} syncs per period of {P:,} steps make {count:,} to simulate, "
                f"more than {MAX_SYNCS:,}: use a shorter sync_every or a longer overlap"
            )
        if self.kind == "streaming":  # which fragment at which step: the staggered offsets, in order
            offsets = streaming_offsets(self.sync_every, len(frags))
            order = sorted(range(len(frags)), key=lambda p: offsets[p] or self.sync_every)
        out: list[Sync] = []
        nxt = 0  # CoCoDC: round-robin over the fragments; the others: one fragment per slot
        for start in range(0, steps, P):
            for i, s in enumerate(sends):
                t = start + s
                if t > steps:
                    break
                if self.kind == "streaming":
                    p = order[i]
                else:
                    p, nxt = nxt, (nxt + 1) % len(frags)
                out.append(
                    Sync(t, t + tau + 1, frags[p], self.payload(workload, frags[p]), self.kind == "loscar",
                         "all_gather" if self.wire in SPARSE_WIRE_FORMATS else "all_reduce")
                )  # fmt: skip
        return out

    def with_(self, **changes: object) -> Method:
        return replace(self, **changes)  # type: ignore[arg-type]
