"""The link between datacentres: the only shared resource of the simulation.

Each replica reaches the others through one link of ``gbps`` Gbit/s per direction. Collectives are
served one after another in the order they are issued (FIFO): a collective occupies the link for
``wire_bytes / bandwidth`` seconds, and its result is usable ``latency`` after the last byte left.

Cost of a collective of a ``payload`` of bytes per replica among M replicas:

- **all-reduce** (payloads that can be summed: dense, quantized through reduce-scatter + all-gather,
  LOSCAR's shared mask): a ring puts 2(M−1)/M × payload on each replica's link, in 2(M−1) hops;
- **all-gather** (payloads that cannot be summed, e.g. top-k values with each replica's own
  indices): every replica receives the M−1 others' payloads, (M−1) × payload, in M−1 hops.

Latency: ``latency_model="hops"`` charges the one-way latency once per hop (a ring over a WAN);
``"once"`` charges it once per collective, which is what the runtime's emulated WAN does
(``runtime.transport.WAN``), so a simulation of a run of this package is set up with "once".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LATENCY_MODELS = ("hops", "once")
COLLECTIVES = ("all_reduce", "all_gather")

BITS_PER_GBIT = 1e9


@dataclass(frozen=True)
class Link:
    """``gbps``: Gbit/s per replica; ``latency_s``: one-way seconds; ``replicas``: M ≥ 2;
    ``extra_s``: fixed seconds added to every collective's completion (e.g. a fault-tolerant
    quorum round, which rides with each sync)."""

    gbps: float
    latency_s: float = 0.0
    replicas: int = 2
    latency_model: str = "hops"
    extra_s: float = 0.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.gbps, bool)
            or not isinstance(self.gbps, (int, float))
            or not (math.isfinite(self.gbps) and self.gbps > 0)
        ):
            raise ValueError(f"bandwidth must be a finite number of Gbit/s > 0, got {self.gbps!r}")
        for name in ("latency_s", "extra_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 2:
            raise ValueError(f"replicas must be an integer >= 2, got {self.replicas!r}")
        if self.latency_model not in LATENCY_MODELS:
            raise ValueError(f"latency_model must be one of {LATENCY_MODELS}, got {self.latency_model!r}")

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * BITS_PER_GBIT / 8

    def wire_bytes(self, payload: float, collective: str = "all_reduce") -> float:
        """Bytes one replica puts on its link for a collective of ``payload`` bytes per replica."""
        M = self.replicas
        if collective == "all_reduce":
            return 2 * (M - 1) / M * payload
        if collective == "all_gather":
            return (M - 1) * payload
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")

    def hops(self, collective: str = "all_reduce") -> int:
        M = self.replicas
        return 2 * (M - 1) if collective == "all_reduce" else M - 1

    def busy_s(self, payload: float, collective: str = "all_reduce") -> float:
        """Seconds the link is occupied by the collective."""
        return self.wire_bytes(payload, collective) / self.bytes_per_s

    def delay_s(self, collective: str = "all_reduce") -> float:
        """Seconds from the last byte on the link to a usable result (latency and fixed costs)."""
        hops = self.hops(collective) if self.latency_model == "hops" else 1
        return hops * self.latency_s + self.extra_s

    def collective_s(self, payload: float, collective: str = "all_reduce") -> float:
        """Time of one collective on an idle link."""
        return self.busy_s(payload, collective) + self.delay_s(collective)

    def with_gbps(self, gbps: float) -> Link:
        return Link(gbps, self.latency_s, self.replicas, self.latency_model, self.extra_s)
