"""The top-k sparse wire format in the strategies (``wire_dtype="topk"``): error feedback, all-gather.

Each worker keeps an error-feedback buffer e per fragment (the strategy's residual, the outer
state's dtype) and sends, per chunk of ``topk_chunk`` values, the ``topk_k`` largest entries of
e ← β·e + Δ in ``topk_bits`` bits (``ops.topk``: the format and its byte count); what was sent
leaves e. Workers pick different indices, so the payloads cannot be summed on the wire:

    all-gather   every rank receives the M packed payloads (its own included), one uint8 row each
    decode       result ← 0; for r = 0..M−1: topk_decode_add_(result, payload_r)   (rank order)

so every rank holds the same sum, in the outer state's dtype. The strategy's apply step divides it
by M (as it divides a dense all-reduce's sum) and takes its outer step on that average: with
``outer_momentum=0`` that is the plain SGD step of SparseLoCo (error feedback in place of outer
momentum); the default keeps the Nesterov step.

Overlap and ordering are the quantized all-reduce's (``compression.QuantizedAllReduce``): the
all-gather runs on a process group of its own, issued by one worker thread that takes the queued
syncs in order, while the control vector goes over the main group; ``wait()`` is bounded by
``timeout_s``. Bytes: in a ring all-gather each worker sends and receives (M−1) payloads of
P bytes; the emulated WAN and the metrics charge exactly that, (M−1)·P, per sync.

A chunk with a non-finite value is sent with a NaN scale and counted in the sync's non-finite
facts, so every rank skips that sync and zeroes the fragment's e (as for quantized error feedback).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import ops
from .._checks import scalar
from ..ops.topk import TopKFormat, check_format, topk_decode_add_, topk_encode
from .compression import DEFAULT_QUANT_BLOCK, QuantHandle, QuantizedAllReduce, _Job
from .schedule import SPARSE_WIRE_FORMATS
from .transport import Transport

DEFAULT_EF_BETA = 0.95
NAME = SPARSE_WIRE_FORMATS[0]

__all__ = ["DEFAULT_EF_BETA", "TopKAllGather", "TopKWire", "check_topk"]


def check_topk(
    topk_k: object, topk_chunk: object, topk_bits: object, ef_beta: object, name=str
) -> tuple[TopKFormat, float]:
    """The top-k knobs, checked whatever the wire format (as quant_block is): (format, β)."""
    k, chunk, bits = check_format(
        topk_k,
        topk_chunk,
        topk_bits,
        name=lambda a: name({"k": "topk_k", "chunk": "topk_chunk"}.get(a, "topk_bits")),
    )
    beta = scalar(name("ef_beta"), ef_beta, lo=0.0, hi=1.0)
    return TopKFormat(k, chunk, bits), beta


@dataclasses.dataclass(frozen=True)
class TopKWire:
    """``wire_dtype="topk"`` as a strategy holds it: the format, e's decay β, the dtype of the
    result (the outer state's) and the group size. Answers what the strategies ask of any wire
    format (``name``, ``dtype``, ``quant`` None, ``payload_bytes``)."""

    fmt: TopKFormat
    beta: float
    dtype: torch.dtype
    world: int
    name: str = NAME
    quant: None = None
    block: int = DEFAULT_QUANT_BLOCK  # unused; the strategies' agreement lists it for every format

    def sent_bytes(self, n: int) -> int:
        """One worker's payload for a fragment of n values: scales, indices and values."""
        return self.fmt.payload_bytes(n)

    def payload_bytes(self, n: int) -> float:
        """The payload a ring all-reduce would need to cost what this all-gather costs: the link
        model charges 2(M−1)/M × it per worker, which is (M−1) × ``sent_bytes(n)``."""
        return self.world * self.sent_bytes(n) / 2


def encode(
    wire: TopKWire,
    g: torch.Tensor,
    x: torch.Tensor,
    e: torch.Tensor,
    *,
    snapshot: bool,
    reuse: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(payload, snapshot or None, non-finite count, the payload's scales) of Δ = g − x through e
    (updated in place); Δ and the snapshot go into ``reuse``'s "delta" / "snapshot" when it has them."""
    reuse = reuse or {}
    snap_out = reuse.get("snapshot") if snapshot else False
    delta, snap, nf_delta = ops.pack(
        g, x, wire_dtype=g.dtype, delta_out=reuse.get("delta"), snapshot_out=snap_out
    )
    f = wire.fmt
    payload, nf = topk_encode(delta, e, k=f.k, chunk=f.chunk, bits=f.bits, beta=wire.beta, check_values=False)
    scales = payload[: 4 * f.num_chunks(g.numel())].view(torch.float32)
    return payload, snap, nf + nf_delta, scales


class TopKAllGather(QuantizedAllReduce):
    """Sums the M workers' top-k payloads of a fragment on every rank (module docstring): the
    quantized all-reduce's thread, group and handle, with an all-gather and decodes in place of
    its two phases. Collective to construct."""

    def __init__(self, transport: Transport, wire: TopKWire) -> None:
        self.wire = wire  # the base's set-up without its quantized format
        self._start_engine(transport, "lowcomm-topk-allgather")

    def start(
        self, payload: torch.Tensor, n: int, *, control: torch.Tensor, name: str, out_dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> QuantHandle:  # fmt: skip
        """Queue the sum of every rank's payload of n values into ``out`` (or a new tensor); the
        control vector is all-reduced now on the main group, charged with the all-gather's bytes."""
        if not self._thread.is_alive():
            raise RuntimeError(f"{name}: the top-k all-gather was closed")
        ctl = self.transport.all_reduce(
            [control], name=name, host=control, payload_bytes=self.wire.payload_bytes(n)
        )
        if out is None:
            out = torch.empty(n, dtype=out_dtype, device=payload.device)
        job = _Job(payload, payload[:0], n, out, name)
        if self._stream is not None:
            job.ready = torch.cuda.Event()
            job.ready.record(torch.cuda.current_stream(payload.device))
        self._jobs.put(job)
        return QuantHandle(self, job, ctl)

    def _reduce(self, job: _Job) -> None:
        f, payload = self.wire.fmt, job.codes
        if self.group is not None:
            gathered = torch.empty(self.world, payload.numel(), dtype=torch.uint8, device=payload.device)
            self._all_gather_rows(gathered, payload, job)
        else:
            gathered = payload.view(1, -1)
        job.result.zero_()
        for r in range(gathered.shape[0]):
            topk_decode_add_(job.result, gathered[r], k=f.k, chunk=f.chunk, bits=f.bits)
        if self._stream is not None:
            for t in (job.codes, job.result, gathered):
                t.record_stream(self._stream)
