"""Asynchronous collectives for the strategies, with WAN emulation and a timeout on every one.

``Transport.all_reduce(tensors, name=...)`` starts a SUM all-reduce of each tensor over the outer
process group and returns a ``Handle`` at once; ``Handle.wait()`` blocks until the result may be
used and returns the seconds it blocked (the *exposed* communication).

- CPU / gloo: ``dist.all_reduce(async_op=True)``; gloo runs it on its own worker threads.
- CUDA / NCCL: the collective is issued on a dedicated side stream of the tensors' device that
  first waits on an event recorded on that device's compute stream. A small ``host`` tensor (the
  control vector) is then copied into pinned host memory on the side stream, and a completion
  event recorded. ``wait()`` polls that event on the host (bounded by ``timeout_s``, so a dead
  peer is a ``SyncError`` in time, not a kill by NCCL's watchdog minutes later), then makes the
  device's compute stream wait on it. The host thus blocks only for the collective, never for the
  compute stream, and the blocked time is the real exposed communication; ``host_values()`` then
  reads the control vector from pinned memory with no further synchronisation.
- WAN emulation: ``WAN(latency_s, bandwidth_bytes_per_s)`` gives each collective a completion
  deadline ``start + latency + wire_bytes / bandwidth``, where ``start`` is when the link is free
  (collectives queue on one serial link, so bandwidth is shared) and ``wire_bytes`` is what a ring
  all-reduce puts on the wire per worker, 2(M−1)/M × payload. Nothing blocks at send time; at wait
  time only the remaining time until the deadline is slept, and counted as exposed.
- Timeout: every wait is bounded by ``timeout_s``; a failed or timed-out collective (dead peer)
  raises ``SyncError`` naming the sync, never hangs. So is the emulated part: a link on which one
  collective would outlast ``timeout_s`` is refused when the strategy is built
  (``Transport.check_wan``), and a wait whose deadline lies further than ``timeout_s`` ahead
  (collectives queued on the link) raises ``SyncError`` at once instead of sleeping.
- A survivor's exit: on gloo each collective also carries ``timeout_s`` as its own timeout (or the
  group's, when that is shorter). A peer that stops answering would otherwise hold one of gloo's
  threads until the group's timeout (torch's default: 30 minutes), and the process group's
  destructor waits for that thread, so the survivor could not exit. With it a survivor exits about
  ``timeout_s`` after the collective began, whatever gloo group the user made.
- Interpreter exit with syncs in flight (a loop that ended without ``finish()``): every collective
  this module started on gloo, and every worker thread of a compressed wire format
  (``register_engine``), is settled by an ``atexit`` hook: the threads stopped after their queued
  syncs, then each collective waited for, each bounded by its ``timeout_s``. Left to the
  interpreter's teardown, a worker thread that returns from gloo after Python finalised is killed
  by a forced unwind through C++ frames (``std::terminate``: SIGABRT on every rank), and gloo's
  threads may still be inside a collective when their process group is destroyed. The results
  are dropped; only ``finish()`` applies them.
- The tensors of every gloo collective (``start_collective``) stay referenced here until gloo's
  worker thread let go of them, also after the collective completed: if Python dropped them
  first, that thread would have to take the GIL to free their Python objects, and a thread that
  does so after the interpreter began to finalise aborts the process (SIGABRT at exit). At exit
  the hook also waits, the GIL released, until gloo let go of every one of them.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import math
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from ..profiling import nvtx_range

#: seconds a strategy's collective may take before it is a ``SyncError`` (``timeout_s``), by default
DEFAULT_TIMEOUT_S = 300.0


#: the longest ``timeout_s`` (about 31 years): every wait and every gloo collective carries it, and
#: Python's waits (threading.TIMEOUT_MAX, time_t) and datetime.timedelta overflow not far above
MAX_TIMEOUT_S = 1e9


def check_timeout_s(timeout_s: object) -> None:
    """ValueError naming ``timeout_s`` unless it is a number in (0, MAX_TIMEOUT_S]."""
    if not (
        isinstance(timeout_s, (int, float))
        and not isinstance(timeout_s, bool)
        and math.isfinite(timeout_s)
        and 0 < timeout_s <= MAX_TIMEOUT_S
    ):
        raise ValueError(f"timeout_s must be a number in (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout_s!r}")


class SyncError(RuntimeError):
    """A collective of a sync failed or timed out (typically: a peer died). Names the sync."""


#: per-rank slots at the head of a sync's control vector (``Strategy._control``): non-finite count,
#: broken views, schedule point; here so that a transport can fill in an absent replica's point
CONTROL_FACTS = 3


class FailedRound(list):
    """The control values of a fault-tolerant round that did not commit: ``Strategy._sync_outcome``
    skips it on every replica."""

    failed_round = True


class HealedInRound(Exception):
    """Raised by a fault-tolerant transport's ``all_reduce`` when the quorum that opened the round
    healed this replica (it was behind: a link cut and restored). The strategy's state is now the
    peers' as of ``step``; the send that was under way belongs to the old state and is void. The
    strategy's step hook catches it and lets the transport finish the peers' step
    (``finish_heal``)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"healed from a peer inside a round, at step {step}")
        self.step = step


@dataclass(frozen=True)
class WAN:
    """Emulated wide-area link: one-way ``latency_s`` per collective, ``bandwidth_bytes_per_s``
    per worker (1 Gbit/s = 125e6 bytes/s)."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if not (
            isinstance(self.latency_s, (int, float)) and math.isfinite(self.latency_s) and self.latency_s >= 0
        ):
            raise ValueError(f"latency_s must be a finite number >= 0, got {self.latency_s!r}")
        if not (isinstance(self.bandwidth_bytes_per_s, (int, float)) and self.bandwidth_bytes_per_s > 0):
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}")

    def transfer_s(self, wire_bytes: float) -> float:
        return wire_bytes / float(self.bandwidth_bytes_per_s)

    def collective_s(self, payload_bytes: int, world: int) -> float:
        """Emulated seconds of one all-reduce of ``payload_bytes`` per worker on an idle link: latency
        plus the ring's wire bytes over the bandwidth (0 for a group of one: nothing is emulated)."""
        if world <= 1:
            return 0.0
        return self.latency_s + self.transfer_s(ring_wire_bytes(payload_bytes, world))


def ring_wire_bytes(payload_bytes: int, world: int) -> int:
    """Bytes a ring all-reduce sends per worker: 2(M−1)/M × payload (0 for a group of one)."""
    return 0 if world <= 1 else int(round(2 * (world - 1) * payload_bytes / world))


def wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``done()`` until it is true (True) or ``timeout_s`` passed (False); short spins first,
    then sleeps growing to 1 ms, so a result that is nearly there is not delayed by a sleep."""
    t_end = time.perf_counter() + timeout_s
    pause = 0.0
    while not done():
        if time.perf_counter() >= t_end:
            return done()
        if pause:
            time.sleep(pause)
        pause = min(1e-3, max(2e-5, pause * 2))
    return True


class Handle:
    """One in-flight all-reduce (possibly several tensors). ``wait()`` at most once."""

    def __init__(
        self,
        transport: Transport,
        works: list,
        name: str,
        t_send: float,
        deadline: float,
        wire_bytes: int,
        done_event: torch.cuda.Event | None,
        host: torch.Tensor | None = None,
    ) -> None:
        self._transport = transport
        self._works = works
        self._host = host  # CPU (pinned on CUDA) copy of the reduced control vector
        self.name = name
        self.t_send = t_send
        self.deadline = deadline
        self.wire_bytes = wire_bytes
        self._done_event = done_event
        self.t_complete: float | None = None  # first time the result was known to be usable
        self.waited = False

    def _completed(self) -> bool:
        if self._done_event is not None:
            return self._done_event.query()
        return all(w.is_completed() for w in self._works)

    def poll(self) -> bool:
        """Non-blocking: has the collective completed (and its emulated deadline passed)?"""
        if self.t_complete is not None:
            return True
        now = time.perf_counter()
        if now < self.deadline:
            return False
        try:
            done = self._completed()
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
        tr = self._transport
        if self.deadline - t0 > tr.timeout_s:  # bounded like the collective: no sleep past timeout_s
            raise SyncError(
                f"{self.name}: the emulated WAN completes it {self.deadline - t0:.4g} s from now, more "
                f"than timeout_s={tr.timeout_s:g} (a link this slow, or this many collectives queued "
                "on it, times out)"
            )
        with nvtx_range("wait"):
            if self._done_event is not None:  # CUDA: host waits for the collective only, bounded
                try:
                    ok = wait_until(self._done_event.query, tr.timeout_s)
                except Exception as e:  # an aborted communicator reports through the event
                    raise self._failed(e) from e
                if not ok:
                    tr.abort()
                    raise SyncError(
                        f"{self.name} did not complete within {tr.timeout_s} s (a peer died or "
                        "the link broke); the NCCL communicator was aborted"
                    )
                torch.cuda.current_stream(tr.device).wait_event(self._done_event)
            for w in [] if self._done_event is not None else self._works:
                try:
                    ok = w.wait(timeout=datetime.timedelta(seconds=tr.timeout_s))
                except Exception as e:  # gloo: peer closed / timeout
                    raise self._failed(e) from e
                if ok is False:
                    raise SyncError(f"{self.name} did not complete within {tr.timeout_s} s")
            remaining = self.deadline - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
        t1 = time.perf_counter()
        if self.t_complete is None:
            self.t_complete = max(t1 if t1 - t0 > 1e-4 else t0, self.deadline)
        self.waited = True
        _prune_in_flight()  # completed works hold their tensors: drop them once waited for
        return t1 - t0

    def _failed(self, e: BaseException) -> SyncError:
        return SyncError(
            f"{self.name} failed after {time.perf_counter() - self.t_send:.1f} s (a peer died "
            f"or the link broke; timeout {self._transport.timeout_s} s): "
            f"{type(e).__name__}: {e}"
        )

    def host_values(self) -> list[float]:
        """The reduced ``host`` tensor as Python floats (call after ``wait()``): read from pinned
        memory that the side stream filled before its completion event, so no synchronisation."""
        if not self.waited:
            raise RuntimeError(f"{self.name}: host_values() before wait()")
        if self._host is None:
            raise RuntimeError(f"{self.name}: this collective mirrors no tensor to the host")
        return self._host.tolist()

    @property
    def in_flight_s(self) -> float:
        """Send to completion (as observed by polling / waiting)."""
        end = self.t_complete if self.t_complete is not None else time.perf_counter()
        return max(0.0, end - self.t_send)


class Transport:
    """SUM all-reduces over ``group`` (see the module docstring)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        device: torch.device,
        wan: WAN | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        check_timeout_s(timeout_s)
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
        self._op_timeout = _gloo_op_timeout(group, device, self.timeout_s)

    def check_wan(self, payload_bytes: int) -> None:
        """ValueError naming ``wan`` and ``timeout_s`` when one collective of ``payload_bytes`` (the
        largest a strategy sends) would take longer than ``timeout_s`` on the emulated link: every
        such sync would time out, so the configuration is refused before anything runs."""
        if self.wan is None:
            return
        need = self.wan.collective_s(payload_bytes, self.world)
        if need > self.timeout_s:
            raise ValueError(
                f"wan: one collective of {payload_bytes} payload bytes takes {need:.4g} s on the emulated "
                f"link (latency_s={self.wan.latency_s:g} + "
                f"{ring_wire_bytes(payload_bytes, self.world)} wire bytes / "
                f"bandwidth_bytes_per_s={self.wan.bandwidth_bytes_per_s:g}), more than "
                f"timeout_s={self.timeout_s:g}; every sync would time out"
            )

    def abort(self) -> None:
        """Best effort after a timed-out NCCL collective: abort the communicator so the process can
        exit instead of hanging in NCCL (gloo needs nothing: its waits already timed out)."""
        try:
            backend = self.group._get_backend(self.device)
            abort = getattr(backend, "abort", None)
            if abort is not None:
                abort()
        except Exception:  # noqa: BLE001 (private API, absent or different across versions)
            pass

    def all_reduce(
        self,
        tensors: list[torch.Tensor],
        *,
        name: str,
        payload_bytes: int | None = None,
        host: torch.Tensor | None = None,
    ) -> Handle:
        """Start SUM all-reduces of ``tensors`` (in place). ``payload_bytes`` (default: all of them)
        is what the WAN model charges; tiny control tensors travel beside the payload. ``host``, one
        of ``tensors`` (small), is mirrored to the host after the reduction: ``Handle.host_values()``."""
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
                    works = [self.start_all_reduce(t) for t in tensors]
                    for w in works:
                        w.wait()  # stream-level: orders the side stream after NCCL, no host block
                    for t in tensors:
                        t.record_stream(self._side)
                    mirror = None
                    if host is not None:
                        mirror = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
                        mirror.copy_(host, non_blocking=True)
                    done_event = torch.cuda.Event()
                    done_event.record(self._side)
            else:
                works = [self.start_all_reduce(t) for t in tensors]
                mirror = host  # already on the host; valid once the works completed
        return Handle(self, works, name, now, deadline, wire, done_event, mirror)

    def start_all_reduce(self, t: torch.Tensor) -> dist.Work:
        """An async SUM all-reduce of ``t`` over the group (gloo: with the per-collective timeout)."""
        if self._op_timeout is None:
            return self._start(
                lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True), [t]
            )
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = self._op_timeout
        return self._start(lambda: self.group.allreduce([t], opts), [t])

    def start_broadcast(self, t: torch.Tensor, src: int) -> dist.Work:
        """An async broadcast of ``t`` from group rank ``src`` (gloo: with the per-collective timeout)."""
        if self._op_timeout is None:
            root = dist.get_global_rank(self.group, src)
            return self._start(lambda: dist.broadcast(t, src=root, group=self.group, async_op=True), [t])
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        opts.timeout = self._op_timeout
        return self._start(lambda: self.group.broadcast([t], opts), [t])

    def _start(self, launch: Callable[[], dist.Work], tensors: list[torch.Tensor]) -> dist.Work:
        """``launch()``, settled at interpreter exit if it is still running then and its tensors held
        until gloo let go of them (``start_collective``). NCCL's works are the communicator's
        business (``abort``)."""
        if self._cuda:
            return launch()
        return start_collective(launch, tensors, self.timeout_s)

    def blocking_all_gather(self, t: torch.Tensor, *, name: str) -> list[torch.Tensor]:
        """All-gather of a small tensor with the same timeout (used by the consistency guard)."""
        outs = [torch.empty_like(t) for _ in range(self.world)]
        if self._op_timeout is None:
            work = self._start(lambda: dist.all_gather(outs, t, group=self.group, async_op=True), [*outs, t])
        else:
            opts = AllgatherOptions()
            opts.timeout = self._op_timeout
            work = self._start(lambda: self.group.allgather([outs], [t], opts), [*outs, t])
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:
            raise SyncError(f"{name} failed (a peer died or the link broke): {type(e).__name__}: {e}") from e
        if ok is False:
            raise SyncError(f"{name} did not complete within {self.timeout_s} s")
        return outs


def _gloo_op_timeout(
    group: dist.ProcessGroup, device: torch.device, timeout_s: float
) -> datetime.timedelta | None:
    """The timeout each collective carries on a gloo group: ``timeout_s``, or the group's own when
    that is shorter (see the module docstring). None on other backends (NCCL: ``Transport.abort``)."""
    try:
        backend = group._get_backend(device)
    except Exception:  # noqa: BLE001 (private API, absent or different across versions)
        return None
    gloo = getattr(dist, "ProcessGroupGloo", None)  # absent from builds without gloo
    if gloo is None or not isinstance(backend, gloo):
        return None
    mine = datetime.timedelta(seconds=timeout_s)
    own = getattr(getattr(backend, "options", None), "_timeout", None)
    return min(mine, own) if isinstance(own, datetime.timedelta) and own > datetime.timedelta(0) else mine


# ----- interpreter exit (see the module docstring) ----------------------------------------------
#: after a collective completed, how long its tensors may stay held waiting for gloo's worker thread to
#: let go of them (it does so within microseconds of completing; a loaded machine may delay that)
RELEASE_GRACE_S = 1.0
#: at interpreter exit, how long to wait for gloo's threads to let go of completed collectives
EXIT_RELEASE_S = 2.0


@dataclass
class _Collective:
    """A gloo collective started here: its Work until it completed, and the tensors it reads and
    writes with their reference counts before it started."""

    work: dist.Work | None
    tensors: tuple[torch.Tensor, ...]
    before: tuple[int, ...]
    timeout_s: float
    done_at: float = math.inf

    def released(self) -> bool:
        """Whether gloo let go of the tensors (its Work, and the worker thread that ran it)."""
        return all(t._use_count() <= b for t, b in zip(self.tensors, self.before, strict=True))


_in_flight: list[_Collective] = []  # gloo collectives started here and not yet let go of
_in_flight_lock = threading.Lock()  # the main thread and the compressed wires' worker threads start them
_engines: weakref.WeakSet[Any] = weakref.WeakSet()  # objects with a worker thread and settle()


def start_collective(
    launch: Callable[[], dist.Work], tensors: list[torch.Tensor], timeout_s: float
) -> dist.Work:
    """Start a gloo collective (``launch()``) on ``tensors`` (every tensor it reads or writes) and keep
    the tensors referenced here until gloo let go of them.

    Why: a tensor whose Python object is dropped while C++ still holds it is kept alive by C++,
    which must then take the GIL to free the Python object. gloo's worker thread drops a completed
    collective (and so its tensors) a moment after the waiting thread woke up; if that moment falls
    after the interpreter began to finalise, taking the GIL ends the thread by a forced unwind
    through C++ destructors: ``std::terminate`` (SIGABRT at exit: a bare all-reduce whose tensor
    Python dropped, completed by a late peer as the script ended, aborted 4 times in 57 runs here).
    Held here, the tensors' last reference is always Python's, dropped with the GIL, after gloo's."""
    before = tuple(t._use_count() for t in tensors)
    work = launch()
    with _in_flight_lock:
        _prune_in_flight()
        _in_flight.append(_Collective(work, tuple(tensors), before, timeout_s))
    return work


def _prune_in_flight() -> None:
    """Drop the collectives gloo let go of (or completed longer than ``RELEASE_GRACE_S`` ago); the
    caller holds ``_in_flight_lock``."""
    now = time.monotonic()
    keep = []
    for c in _in_flight:
        if c.work is not None and c.work.is_completed():
            c.work, c.done_at = None, now
        if c.work is None and (c.released() or now - c.done_at > RELEASE_GRACE_S):
            continue
        keep.append(c)
    _in_flight[:] = keep


def forget_settled() -> None:
    """Drop the collectives that have completed from the exit list now. Called when a strategy has
    waited for all of them (``drain``, ``finish``, ``close``): a completed Work kept in this
    module's list until interpreter exit outlives a process group the user destroys before exiting,
    and releasing it that late made about one exit in ten abort (SIGABRT/SIGSEGV in a gloo thread)."""
    with _in_flight_lock:
        _prune_in_flight()


def register_engine(engine: Any) -> None:
    """Have ``engine.settle()`` (stop the worker thread after its queued syncs, bounded) called at
    interpreter exit, before the collectives are waited for."""
    _engines.add(engine)


@atexit.register
def _settle_at_exit() -> None:
    for engine in list(_engines):
        engine.settle()
    with _in_flight_lock:
        started = list(_in_flight)
        _in_flight.clear()
    # the user destroyed the process group(s): waiting on a Work of a destroyed gloo group aborted
    # about one exit in ten; there is nothing left to settle on them
    if dist.is_initialized():
        for c in started:
            if c.work is not None:
                try:
                    c.work.wait(timeout=datetime.timedelta(seconds=c.timeout_s))
                except Exception:  # noqa: BLE001 (failed or timed out: nothing more to wait for)
                    pass
    for c in started:
        c.work = None
    # sleep (the GIL released) until gloo's threads let go of the tensors (``start_collective``)
    t_end = time.monotonic() + EXIT_RELEASE_S
    while any(not c.released() for c in started) and time.monotonic() < t_end:
        time.sleep(0.001)
    held = [c.tensors for c in started if not c.released()]
    if held:  # a collective still running (a dead peer): its tensors are never freed, so no thread
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(held))  # of gloo's needs the GIL for them
