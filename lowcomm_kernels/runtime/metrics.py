"""What the runtime measures: per sync and per inner step.

Definitions (all per worker, wall clock from ``time.perf_counter``):
- compute: time between the end of the runtime's previous hook and the start of this one, i.e. the
  user's forward/backward/optimizer step (plus data loading). On a GPU that is host enqueue time;
  ``device_step_s`` holds the device time between the hooks (CUDA events on the compute stream,
  read once completed), which is what CoCoDC's T_c uses there. NVTX ranges are host ranges: in
  Nsight Systems read the device's kernels under them.
- exposed: time the runtime blocked waiting for a collective (including emulated WAN delay).
  With perfect overlap it is 0; blocking DiLoCo exposes the whole sync.
- in flight: from send to when the result was first known to be usable (polled every step).
- staleness: inner steps between send and apply (= fragment_sync_delay for the dense methods,
  overlap_steps for LOSCAR).
- bytes: what a ring all-reduce of the payload puts on the wire per worker, 2(M−1)/M × payload;
  for a quantized wire format the payload is codes + scales (runtime.compression).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SyncRecord:
    """One sync. ``fragment`` is -1 for LOSCAR's sparse round (``round`` holds its index)."""

    fragment: int
    send_step: int
    apply_step: int
    bytes: int
    in_flight_s: float
    exposed_s: float
    staleness: int
    skipped: bool = False
    reason: str = "schedule"  # CoCoDC: stale | never_sent | score; others: schedule
    round: int = -1
    pack_s: float = 0.0
    merge_s: float = 0.0


@dataclass
class RuntimeMetrics:
    """Counters and records of one strategy (see the module docstring for the definitions)."""

    steps: int = 0
    compute_s: float = 0.0
    exposed_comm_s: float = 0.0
    overhead_s: float = 0.0  # pack + merge + bookkeeping on the critical path, excluding waits
    bytes_sent: int = 0
    num_syncs: int = 0
    num_skipped: int = 0
    syncs: list[SyncRecord] = field(default_factory=list)
    step_compute_s: list[float] = field(default_factory=list)
    device_step_s: list[float] = field(default_factory=list)  # CUDA: device time between hooks
    extra_memory_bytes: int = 0  # persistent buffers held over plain training (g, u, ...)
    residual_bytes: int = 0  # error feedback's residual (part of extra_memory_bytes)
    peak_inflight_bytes: int = 0  # largest sum of transient buffers of in-flight syncs
    recovery_bytes: int = 0  # dense broadcasts that restarted a poisoned LOSCAR rank from a healthy one

    def exposed_fraction(self) -> float:
        """Exposed communication as a fraction of total step time (compute + overhead + exposed)."""
        total = self.compute_s + self.overhead_s + self.exposed_comm_s
        return self.exposed_comm_s / total if total > 0 else 0.0
