"""Compressed wire formats for the strategies: the quantized all-reduce and error feedback.

``wire_dtype`` names one of ``schedule.WIRE_FORMATS``: "fp32" / "bf16" send the pseudo-gradient as
a dense tensor (``Transport.all_reduce``, summed in the wire dtype); "int8", "int4", "fp8_e4m3",
"fp8_e5m2", "fp4_e2m1", "fp4_e3m0" send codes plus one fp32 scale per ``quant_block`` elements
(``ops.quantize``) through :class:`QuantizedAllReduce`, which never sums in low precision:

    phase 1  reduce-scatter as an all_to_all: the flat payload is cut into M contiguous chunks of
             whole blocks; rank r receives chunk r of every rank (codes and scales in one uint8 row)
    local    reduce_quantized: dequantize the M copies of chunk r, add them in fp32 in rank order,
             × 1/M (the average), requantize (round to nearest even)
    phase 2  all_gather of the requantized chunks; every rank dequantizes them into the average

Every rank ends with the same averaged Δ̄ (fp32 arithmetic, identical inputs, identical order). Chunks
are block-aligned, so the chunking changes nothing: the result is reduce_quantized of the whole
payload. Bytes on the wire per worker: 2(M−1)/M × (codes + scales), what the WAN emulation charges.

Overlap and ordering: gloo (and NCCL) match collectives by issue order within a process group.
The quantized phases run on a dedicated process group (created collectively at construction) by
one worker thread per strategy that takes the queued syncs FIFO; the strategy issues them in the
same order on every rank, so both phases pair up. The tiny fp64 control vector still travels on
the main group (``Transport.all_reduce``) and carries the WAN charge of the payload, so the
emulated deadline, the timeout and ``host_values()`` behave as for a dense sync. A
:class:`QuantHandle` completes when both have. Every wait is bounded by the transport's
``timeout_s``: a dead peer is a ``SyncError`` on the survivors, never a hang; after a failure the
thread fails every later sync at once (their collectives could no longer pair up).

On CUDA the thread issues its collectives, the reduction and the dequantization on its own side
stream (not the transport's: two communicators' collectives queued on one stream in different
orders on different ranks could deadlock), after an event recorded on the compute stream at send;
a completion event recorded there is polled by ``wait()`` within ``timeout_s``, then the compute
stream waits on it, as in ``Transport.all_reduce``.

Error feedback (``error_feedback=True``): a per-worker residual r_p (the outer state's dtype) per
fragment; each send quantizes e = Δ_p + r_p and keeps r_p ← e − dequant(codes). A skipped sync
(any rank non-finite) zeroes r_p on every rank, so no poisoned value is carried into the next one.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..ops.quantize import FORMATS, QuantFormat, check_block, dequantize, reduce_quantized
from ..ops.quantize import pack_quantized as _pack_quantized
from ..ops.quantize import quantize as _quantize
from ..profiling import nvtx_range
from .checkpoint import CheckpointError, expect_int, expect_tensor
from .schedule import SPARSE_WIRE_FORMATS, WIRE_FORMATS
from .transport import Handle, SyncError, Transport, register_engine, start_collective, wait_until

DEFAULT_QUANT_BLOCK = 128

__all__ = [
    "DEFAULT_QUANT_BLOCK",
    "QuantHandle",
    "QuantizedAllReduce",
    "WireFormat",
    "check_error_feedback",
    "check_quant_block",
    "check_result",
    "check_wire_choice",
    "pack_quantized",
    "quantize",
    "resolve_wire_format",
    "result_form",
    "to_average_",
]


def check_quant_block(quant_block: object, name: str = "quant_block") -> int:
    """The ops' rule for a block (``ops.quantize.check_block``), under the strategy's name for it,
    at construction: a block the ops refuse would otherwise stop every rank at its first sync."""
    return check_block(quant_block, name)


@dataclass(frozen=True)
class WireFormat:
    """What a sync puts on the wire: ``name`` (a key of ``WIRE_FORMATS``), ``dtype`` (the dense wire
    dtype; for a quantized format the dtype of the averaged result, the outer state's) and, for a
    quantized format, ``quant`` (its QuantFormat) and ``block``."""

    name: str
    dtype: torch.dtype
    quant: QuantFormat | None = None
    block: int = DEFAULT_QUANT_BLOCK

    def payload_bytes(self, n: int) -> int:
        """Bytes of one worker's payload for n elements (scales included)."""
        if self.quant is None:
            return n * torch.empty((), dtype=self.dtype).element_size()
        return self.quant.wire_bytes(n, self.block)


def resolve_wire_format(
    wire_dtype: object,
    quant_block: object,
    master_dtype: torch.dtype,
    param_dtype: torch.dtype,
    name: Callable[[str], str] = str,
) -> WireFormat:
    """``wire_dtype`` as given to a strategy: None (the outer state's dtype ``master_dtype``), a
    torch dtype (that one or torch.bfloat16) or a name of ``WIRE_FORMATS``; ``quant_block`` is
    checked whatever the format (a power of two >= 2)."""
    block = check_quant_block(quant_block, name("quant_block"))
    if isinstance(wire_dtype, str):
        if wire_dtype not in WIRE_FORMATS:
            raise ValueError(f"{name('wire_dtype')} must be one of {tuple(WIRE_FORMATS)}, got {wire_dtype!r}")
        target = WIRE_FORMATS[wire_dtype]
        if isinstance(target, str):
            return WireFormat(wire_dtype, master_dtype, FORMATS[target], block)
        wire_dtype = target
    if wire_dtype is None:
        wire_dtype = master_dtype
    if not isinstance(wire_dtype, torch.dtype):
        raise TypeError(
            f"{name('wire_dtype')} must be a name in {tuple(WIRE_FORMATS)}, a torch.dtype or None, "
            f"got {type(wire_dtype).__name__}"
        )
    if wire_dtype not in (master_dtype, torch.bfloat16):
        raise TypeError(
            f"{name('wire_dtype')} must be {master_dtype} (the outer state's dtype for {param_dtype} "
            f"parameters) or torch.bfloat16, got {wire_dtype}"
        )
    label = next(
        (k for k, v in WIRE_FORMATS.items() if v == wire_dtype), str(wire_dtype).replace("torch.", "")
    )
    return WireFormat(label, wire_dtype, None, block)


def check_error_feedback(error_feedback: object, wire: WireFormat, name: Callable[[str], str] = str) -> bool:
    """A bool; True only with a quantized wire format (the dense formats keep no residual)."""
    if not isinstance(error_feedback, bool):
        raise TypeError(f"{name('error_feedback')} must be a bool, got {type(error_feedback).__name__}")
    if error_feedback and wire.quant is None:
        quantized = tuple(k for k, v in WIRE_FORMATS.items() if isinstance(v, str))
        raise ValueError(
            f"{name('error_feedback')}=True needs a quantized {name('wire_dtype')} (one of {quantized}), "
            f"got {wire.name!r}"
        )
    return error_feedback


def check_wire_choice(
    wire_dtype: str, quant_block: object, error_feedback: object, name: Callable[[str], str] = str
) -> WireFormat:
    """What a caller's user typed (a name of ``WIRE_FORMATS``, the block, error feedback on or off),
    checked by the strategies' own rules before any strategy exists."""
    wire = resolve_wire_format(wire_dtype, quant_block, torch.float32, torch.float32, name)
    check_error_feedback(error_feedback, wire, name)
    return wire


def quantize(v: torch.Tensor, wire: WireFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of v in ``wire`` (round to nearest even)."""
    assert wire.quant is not None
    return _quantize(v, wire.quant.name, wire.block)


def pack_quantized(
    g: torch.Tensor,
    x: torch.Tensor,
    wire: WireFormat,
    *,
    residual: torch.Tensor | None,
    snapshot: bool,
    reuse: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(codes, scales, snapshot or None, nonfinite) of Δ = g − x (+ residual, updated in place),
    written into ``reuse``'s "codes", "scales" and "snapshot" buffers where it holds them."""
    assert wire.quant is not None
    reuse = reuse or {}
    snap_out = reuse.get("snapshot") if snapshot else False
    return _pack_quantized(
        g, x, wire.quant.name, wire.block, residual=residual, snapshot_out=snap_out,
        codes_out=reuse.get("codes"), scales_out=reuse.get("scales"),
    )  # fmt: skip


# ----- a sync's result: what it holds, in memory and in checkpoints ----------------------------------
def result_form(wire: WireFormat, world: int) -> tuple[str, int]:
    """(wire_format, summed_over) of a sync's result as it arrives: the format it was sent in, and how
    many ranks' payloads it holds summed. A dense result is the all-reduce's sum over the ``world``
    ranks (gloo has no AVG); a quantized one arrives averaged (1). The average a merge applies is
    result / summed_over (``to_average_``). A sync in flight keeps both, and a checkpoint stores both
    beside the result, so a resume under another wire format or another number of ranks applies it
    exactly as the run that sent it would have."""
    return wire.name, 1 if wire.quant is not None else world


#: the most ranks a result can sum (process groups count their ranks in an int32)
MAX_RANKS = 2**31 - 1


def to_average_(result: torch.Tensor, summed_over: int) -> torch.Tensor:
    """The average of a result of ``result_form``'s ``summed_over`` ranks, in place."""
    return result.div_(summed_over) if summed_over > 1 else result


def result_dtype(wire_format: str, master_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of a result sent in ``wire_format`` (a ``WireFormat.name``) by a strategy whose outer
    state is ``master_dtype``; None when no wire format of such a strategy has that name."""
    target = WIRE_FORMATS.get(wire_format)
    if isinstance(target, str) or wire_format in SPARSE_WIRE_FORMATS:  # into the outer state's dtype
        return master_dtype
    if target is None:  # a dense format named after its dtype (e.g. "float64")
        target = getattr(torch, wire_format, None)
    return target if isinstance(target, torch.dtype) and target in (master_dtype, torch.bfloat16) else None


def check_result(entry: str, q: dict[str, Any], key: str, size: int, master_dtype: torch.dtype) -> None:
    """The in-flight result ``q[key]`` of checkpoint entry ``entry`` and its form (``result_form``):
    CheckpointError naming what does not fit. A checkpoint without the form cannot say whether its
    result is a sum or an average, so it is refused rather than applied at the wrong scale."""
    fmt = q.get("wire_format")
    if not isinstance(fmt, str):
        raise CheckpointError(
            f"checkpoint entry {entry}.wire_format is missing: the checkpoint does not record the wire "
            "format its in-flight result was sent in, nor whether that result is a sum or an average "
            "(written by an older build); resume it with the build and the wire format that wrote it, "
            "and checkpoint there when no sync is in flight"
        )
    dtype = result_dtype(fmt, master_dtype)
    if dtype is None:
        raise CheckpointError(
            f"checkpoint entry {entry}.wire_format is {fmt!r}, not a wire format of this strategy's model"
        )
    # a quantized result arrives averaged (result_form); any other sums at most a process group's
    # ranks (an int32 count): a corrupt count is refused here, not met by the merge's division
    averaged = isinstance(WIRE_FORMATS.get(fmt), str)
    expect_int(f"{entry}.summed_over", q.get("summed_over"), 1, 1 if averaged else MAX_RANKS)
    expect_tensor(f"{entry}.{key}", q.get(key), (size,), dtype)


# ----- the quantized all-reduce ------------------------------------------------------------------


@dataclass
class _Job:
    codes: torch.Tensor
    scales: torch.Tensor
    n: int
    result: torch.Tensor  # filled with the averaged, dequantized payload
    name: str
    ready: Any = None  # CUDA: compute-stream event recorded at send
    done_event: Any = None  # CUDA: recorded on the thread's stream after the last kernel
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class QuantHandle:
    """A quantized sync in flight: the thread's job plus the control vector's ``Handle`` (which
    holds the WAN deadline). Same interface as ``Handle``; ``result`` holds Δ̄ after ``wait()``."""

    def __init__(self, owner: QuantizedAllReduce, job: _Job, control: Handle) -> None:
        self._owner = owner
        self._job = job
        self._control = control
        self.name = control.name
        self.t_send = control.t_send
        self.deadline = control.deadline
        self.wire_bytes = control.wire_bytes
        self.result = job.result
        self.t_complete: float | None = None
        self.waited = False

    def _job_finished(self) -> bool:
        j = self._job
        if not j.done.is_set() or j.error is not None:
            return False
        return j.done_event is None or bool(j.done_event.query())

    def poll(self) -> bool:
        if self.t_complete is not None:
            return True
        if not self._job_finished() or not self._control.poll():
            return False
        self.t_complete = max(time.perf_counter(), self.deadline)
        return True

    def wait(self) -> float:
        if self.waited:
            return 0.0
        t0 = time.perf_counter()
        timeout = self._owner.timeout_s
        with nvtx_range("wait"):
            j = self._job
            if not j.done.wait(timeout):
                raise SyncError(
                    f"{self.name} did not complete within {timeout} s (quantized all-reduce; a peer "
                    "died or the link broke)"
                )
            if j.error is not None:
                if isinstance(j.error, SyncError):
                    raise SyncError(str(j.error)) from j.error
                raise SyncError(f"{self.name} failed: {type(j.error).__name__}: {j.error}") from j.error
            if j.done_event is not None:
                if not wait_until(j.done_event.query, timeout):
                    self._owner.transport.abort()
                    raise SyncError(f"{self.name} did not complete within {timeout} s; NCCL aborted")
                torch.cuda.current_stream(self.result.device).wait_event(j.done_event)
            self._control.wait()  # the control vector, and the emulated WAN deadline
        t1 = time.perf_counter()
        if self.t_complete is None:
            self.t_complete = max(t1 if t1 - t0 > 1e-4 else t0, self.deadline)
        self.waited = True
        return t1 - t0

    def host_values(self) -> list[float]:
        if not self.waited:
            raise RuntimeError(f"{self.name}: host_values() before wait()")
        return self._control.host_values()

    @property
    def in_flight_s(self) -> float:
        end = self.t_complete if self.t_complete is not None else time.perf_counter()
        return max(0.0, end - self.t_send)


class QuantizedAllReduce:
    """Averages quantized payloads over ``transport.group`` (see the module docstring). Collective
    to construct (every rank of the group, same order relative to other group creations)."""

    def __init__(self, transport: Transport, wire: WireFormat) -> None:
        if wire.quant is None:
            raise ValueError(f"wire format {wire.name!r} is not a quantized format")
        self.fmt = wire.quant
        self.block = wire.block
        self._start_engine(transport, "lowcomm-quantized-allreduce")

    def _start_engine(self, transport: Transport, thread_name: str) -> None:
        """The set-up every compressed wire shares: a process group of its own over the transport's
        ranks (collective), a side stream on CUDA, the job queue and the worker thread."""
        self.transport = transport
        self.world, self.rank = transport.world, transport.rank
        self.timeout_s = transport.timeout_s
        self.group: dist.ProcessGroup | None = None
        if self.world > 1:
            _even_group_counts(transport)
            self.group = dist.new_group(
                dist.get_process_group_ranks(transport.group),
                backend=dist.get_backend(transport.group),
                timeout=datetime.timedelta(seconds=self.timeout_s),
                use_local_synchronization=True,
            )
        dev = transport.device
        self._stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._failed: str | None = None
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()
        register_engine(self)  # stopped before the interpreter exits (runtime.transport)

    # ----- the caller's side ---------------------------------------------------------------------
    def start(
        self, codes: torch.Tensor, scales: torch.Tensor, n: int, *, control: torch.Tensor, name: str,
        out_dtype: torch.dtype, out: torch.Tensor | None = None,
    ) -> QuantHandle:  # fmt: skip
        """Queue the average of (codes, scales) of n elements into ``out`` (n elements of out_dtype
        on codes' device, or a new tensor); the control vector is all-reduced now on the main group,
        charged with the quantized payload's bytes."""
        if not self._thread.is_alive():
            raise RuntimeError(f"{name}: the quantized all-reduce was closed")
        payload = codes.numel() * codes.element_size() + scales.numel() * scales.element_size()
        ctl = self.transport.all_reduce([control], name=name, host=control, payload_bytes=payload)
        if out is None:
            out = torch.empty(n, dtype=out_dtype, device=codes.device)
        elif out.shape != (n,) or out.dtype != out_dtype or out.device != codes.device:
            raise ValueError(
                f"{name}: out must be {n} elements of {out_dtype} on {codes.device}, "
                f"got {tuple(out.shape)} {out.dtype} on {out.device}"
            )
        job = _Job(codes, scales, n, out, name)
        if self._stream is not None:
            job.ready = torch.cuda.Event()
            job.ready.record(torch.cuda.current_stream(codes.device))
        self._jobs.put(job)
        return QuantHandle(self, job, ctl)

    def close(self, wait_s: float = 1.0) -> None:
        """Stop the thread after the syncs queued before (a daemon: a thread still blocked on a dead
        peer ends with its own timeout and never holds the process). Waits at most ``wait_s``."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=wait_s)

    def settle(self) -> None:
        """At interpreter exit: stop the thread after its queued syncs, each of whose two phases ends
        within ``timeout_s`` (later ones fail at once after a failure)."""
        self.close(wait_s=2 * self.timeout_s * (self._jobs.qsize() + 1))

    # ----- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._failed is not None:
                job.error = SyncError(
                    f"{job.name} not started: an earlier quantized sync failed ({self._failed})"
                )
                job.done.set()
                continue
            try:
                if self._stream is not None:
                    with torch.cuda.device(self._stream.device), torch.cuda.stream(self._stream):
                        self._stream.wait_event(job.ready)
                        self._reduce(job)
                        job.done_event = torch.cuda.Event()
                        job.done_event.record(self._stream)
                else:
                    self._reduce(job)
            except BaseException as e:  # noqa: BLE001 (handed to the waiting caller)
                self._failed = f"{type(e).__name__}: {e}"
                job.error = e
            job.done.set()

    def layout(self, n: int) -> tuple[int, list[tuple[int, int]]]:
        """(elements per chunk, [(lo, hi) per rank]): whole blocks per chunk, the last ones short
        or empty."""
        nblocks = -(-n // self.block)
        chunk = -(-nblocks // self.world) * self.block
        return chunk, [(min(n, c * chunk), min(n, (c + 1) * chunk)) for c in range(self.world)]

    def _all_gather_rows(self, gathered: torch.Tensor, mine: torch.Tensor, job: _Job) -> None:
        """Every rank's ``mine`` into the rows of ``gathered`` (one row per rank), waited for."""
        rows = list(gathered.unbind(0))
        self._run_collective(
            lambda: dist.all_gather(rows, mine, group=self.group, async_op=True),
            [*rows, mine],
            job,
            "all-gather",
        )

    def _run_collective(
        self, launch: Callable[[], Any], tensors: list[torch.Tensor], job: _Job, phase: str
    ) -> None:
        """Run one collective of the engine's group on ``tensors`` (all it reads and writes) and wait
        for it; on gloo its tensors stay held until gloo let go of them (``start_collective``)."""
        if self._stream is None:
            work = start_collective(launch, tensors, self.timeout_s)
        else:
            work = launch()
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:
            raise SyncError(
                f"{job.name}: {phase} failed (a peer died or the link broke; timeout {self.timeout_s} s): "
                f"{type(e).__name__}: {e}"
            ) from e
        if ok is False:
            raise SyncError(f"{job.name}: {phase} did not complete within {self.timeout_s} s")

    def _reduce(self, job: _Job) -> None:
        f, blk, M, n = self.fmt, self.block, self.world, job.n
        chunk, spans = self.layout(n)
        pb, ns = f.payload_bytes(chunk), f.num_scales(chunk, blk)
        # one uint8 row per chunk: codes, then the fp32 scales' bytes at a 4-byte aligned offset (a
        # chunk of 2-element int8 or 2/4-element int4 blocks has codes of 4k + 2 bytes, and viewing
        # bytes as fp32 needs an offset divisible by 4), so row, and every row's start, is aligned too
        so = -(-pb // 4) * 4
        row = so + 4 * ns
        dev = job.codes.device
        send = torch.zeros(M, row, dtype=torch.uint8, device=dev)
        codes, scales = job.codes.reshape(-1), job.scales.reshape(-1)
        for c, (lo, hi) in enumerate(spans):
            if hi > lo:
                b0, nb = f.payload_bytes(lo), f.payload_bytes(hi - lo)
                s0, nsc = lo // blk, f.num_scales(hi - lo, blk)
                send[c, :nb] = codes[b0 : b0 + nb]
                send[c, so : so + 4 * nsc] = scales[s0 : s0 + nsc].view(torch.uint8)
        if self.group is not None:
            recv = torch.empty_like(send)
            self._run_collective(
                lambda: dist.all_to_all_single(recv, send, group=self.group, async_op=True),
                [recv, send],
                job,
                "reduce-scatter",
            )
        else:
            recv = send
        lo, hi = spans[self.rank]
        mine = torch.zeros(row, dtype=torch.uint8, device=dev)
        if hi > lo:
            L = hi - lo
            nb, nsc = f.payload_bytes(L), f.num_scales(L, blk)
            in_codes = recv[:, :nb].contiguous()
            in_scales = recv[:, so : so + 4 * nsc].contiguous().view(torch.float32)
            rc, rs = reduce_quantized(in_codes, in_scales, f.name, blk, L, scale=1.0 / M)
            mine[:nb] = rc
            mine[so : so + 4 * nsc] = rs.view(torch.uint8)
        if self.group is not None:
            gathered = torch.empty(M, row, dtype=torch.uint8, device=dev)
            self._all_gather_rows(gathered, mine, job)
        else:
            gathered = mine.view(1, row)
        for c, (lo, hi) in enumerate(spans):
            if hi > lo:
                L = hi - lo
                nb, nsc = f.payload_bytes(L), f.num_scales(L, blk)
                rc = gathered[c, :nb]
                rs = gathered[c, so : so + 4 * nsc].contiguous().view(torch.float32)
                dequantize(rc, rs, f.name, blk, L, out=job.result[lo:hi])
        if self._stream is not None:
            for t in (job.codes, job.scales, job.result, send, recv, mine, gathered):
                t.record_stream(self._stream)


def _even_group_counts(transport: Transport) -> None:
    """torch names a group made with ``use_local_synchronization`` after its ranks AND the number of
    groups the calling rank already holds, so ranks that made different numbers of subgroups before
    (a strategy on a subgroup, a ``new_group`` that left some out) would name the engine's group
    differently and never form it (a store timeout). Every rank of the transport learns the largest
    count (one small all-reduce, at construction only), and a rank that holds fewer makes groups of
    itself alone until the counts agree."""
    names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
    if names is None:  # pragma: no cover - a torch without this naming rule
        return
    held = torch.tensor([len(names)], dtype=torch.int64, device=transport.device)
    launch = lambda: dist.all_reduce(held, op=dist.ReduceOp.MAX, group=transport.group, async_op=True)  # noqa: E731
    work = (
        launch() if transport.device.type == "cuda" else start_collective(launch, [held], transport.timeout_s)
    )
    work.wait()
    for _ in range(int(held.item()) - len(names)):
        dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
