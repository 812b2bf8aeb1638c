"""Asynchronous collectives for the strategies, with WAN emulation and a timeout on every one.

``Transport.all_reduce(tensors, name=...)`` starts a SUM all-reduce of each tensor over the outer
process group and returns a ``Handle`` at once; ``Handle.wait()`` blocks until the result may be
used and returns the seconds it blocked (the *exposed* communication).

- CPU / gloo: ``dist.all_reduce(async_op=True)``; gloo runs it on its own worker threads.
- CUDA / NCCL: the collective is issued on a dedicated side stream that first waits on an event
  recorded on the compute stream; ``wait()`` makes the *compute stream* wait on the side stream's
  completion event, so there is no host synchronisation on the hot path (exposed time on the host
  is then ~0; the GPU timeline in Nsight shows the real stall).
- WAN emulation: ``WAN(latency_s, bandwidth_bytes_per_s)`` gives each collective a completion
  deadline ``start + latency + wire_bytes / bandwidth``, where ``start`` is when the link is free
  (collectives queue on one serial link, so bandwidth is shared) and ``wire_bytes`` is what a ring
  all-reduce puts on the wire per worker, 2(M−1)/M × payload. Nothing blocks at send time; at wait
  time only the remaining time until the deadline is slept, and counted as exposed.
- Timeout: every wait is bounded by ``timeout_s``; a failed or timed-out collective (dead peer)
  raises ``SyncError`` naming the sync, never hangs.
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..profiling import nvtx_range


class SyncError(RuntimeError):
    """A collective of a sync failed or timed out (typically: a peer died). Names the sync."""


@dataclass(frozen=True)
class WAN:
    """Emulated wide-area link: one-way ``latency_s`` per collective, ``bandwidth_bytes_per_s``
    per worker (1 Gbit/s = 125e6 bytes/s)."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if not (isinstance(self.latency_s, (int, float)) and math.isfinite(self.latency_s)
                and self.latency_s >= 0):
            raise ValueError(f"latency_s must be a finite number >= 0, got {self.latency_s!r}")
        if not (isinstance(self.bandwidth_bytes_per_s, (int, float)) and self.bandwidth_bytes_per_s > 0):
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}")

    def transfer_s(self, wire_bytes: int) -> float:
        return wire_bytes / float(self.bandwidth_bytes_per_s)


def ring_wire_bytes(payload_bytes: int, world: int) -> int:
    """Bytes a ring all-reduce sends per worker: 2(M−1)/M × payload (0 for a group of one)."""
    return 0 if world <= 1 else int(round(2 * (world - 1) * payload_bytes / world))


class Handle:
    """One in-flight all-reduce (possibly several tensors). ``wait()`` at most once."""

    def __init__(self, transport: Transport, works: list, name: str, t_send: float, deadline: float,
                 wire_bytes: int, done_event: torch.cuda.Event | None) -> None:
        self._transport = transport
        self._works = works
        self.name = name
        self.t_send = t_send
        self.deadline = deadline
        self.wire_bytes = wire_bytes
        self._done_event = done_event
        self.t_complete: float | None = None  # first time the result was known to be usable
        self.waited = False

    def poll(self) -> bool:
        """Non-blocking: has the collective completed (and its emulated deadline passed)?"""
        if self.t_complete is not None:
            return True
        now = time.perf_counter()
        if now < self.deadline:
            return False
        try:
            done = all(w.is_completed() for w in self._works)
        except Exception:  # a failed work: let wait() raise the named error
            return False
        if done:
            self.t_complete = now
        return done

    def wait(self) -> float:
        """Block until the result may be used; return the seconds spent blocked (exposed)."""
        if self.waited:
            return 0.0
        t0 = time.perf_counter()
        with nvtx_range("wait"):
            timeout = datetime.timedelta(seconds=self._transport.timeout_s)
            # CUDA: the side stream already waits on NCCL; a dead peer is caught by NCCL's watchdog
            # (the process group's timeout), so only the stream ordering is needed here.
            for w in ([] if self._done_event is not None else self._works):
                try:
                    ok = w.wait(timeout=timeout)
                except Exception as e:  # gloo: peer closed / timeout; NCCL: aborted communicator
                    raise SyncError(f"{self.name} failed after {time.perf_counter() - self.t_send:.1f} s "
                                    f"(a peer died or the link broke; "
                                    f"timeout {self._transport.timeout_s} s): "
                                    f"{type(e).__name__}: {e}") from e
                if ok is False:
                    raise SyncError(f"{self.name} did not complete within {self._transport.timeout_s} s")
            if self._done_event is not None:  # CUDA: order the compute stream after the collective
                torch.cuda.current_stream().wait_event(self._done_event)
            remaining = self.deadline - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
        t1 = time.perf_counter()
        if self.t_complete is None:
            self.t_complete = max(t1 if t1 - t0 > 1e-4 else t0, self.deadline)
        self.waited = True
        return t1 - t0

    @property
    def in_flight_s(self) -> float:
        """Send to completion (as observed by polling / waiting)."""
        end = self.t_complete if self.t_complete is not None else time.perf_counter()
        return max(0.0, end - self.t_send)


class Transport:
    """SUM all-reduces over ``group`` (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, *, device: torch.device, wan: WAN | None = None,
                 timeout_s: float = 300.0) -> None:
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        if wan is not None and not isinstance(wan, WAN):
            raise TypeError(f"wan must be a WAN or None, got {type(wan).__name__}")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = device
        self.wan = wan
        self.timeout_s = float(timeout_s)
        self._link_free_at = 0.0
        self._cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device=device) if self._cuda else None

    def all_reduce(self, tensors: list[torch.Tensor], *, name: str,
                   payload_bytes: int | None = None) -> Handle:
        """Start SUM all-reduces of ``tensors`` (in place). ``payload_bytes`` (default: all of them)
        is what the WAN model charges; tiny control tensors travel beside the payload."""
        if payload_bytes is None:
            payload_bytes = sum(t.numel() * t.element_size() for t in tensors)
        wire = ring_wire_bytes(payload_bytes, self.world)
        now = time.perf_counter()
        deadline = now
        if self.wan is not None and self.world > 1:
            start = max(now, self._link_free_at)
            self._link_free_at = start + self.wan.transfer_s(wire)
            deadline = self._link_free_at + self.wan.latency_s
        with nvtx_range("comm"):
            done_event = None
            if self._cuda:
                assert self._side is not None
                # Side stream: wait for the producer (pack on the compute stream), then reduce.
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._side):
                    self._side.wait_event(ready)
                    works = [dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                             for t in tensors]
                    for w in works:
                        w.wait()  # stream-level: orders the side stream after NCCL, no host block
                    for t in tensors:
                        t.record_stream(self._side)
                    done_event = torch.cuda.Event()
                    done_event.record(self._side)
            else:
                works = [dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                         for t in tensors]
        return Handle(self, works, name, now, deadline, wire, done_event)

    def blocking_all_gather(self, t: torch.Tensor, *, name: str) -> list[torch.Tensor]:
        """All-gather of a small tensor with the same timeout (used by the consistency guard)."""
        outs = [torch.empty_like(t) for _ in range(self.world)]
        work = dist.all_gather(outs, t, group=self.group, async_op=True)
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:
            raise SyncError(f"{name} failed (a peer died or the link broke): {type(e).__name__}: {e}") from e
        if ok is False:
            raise SyncError(f"{name} did not complete within {self.timeout_s} s")
        return outs
