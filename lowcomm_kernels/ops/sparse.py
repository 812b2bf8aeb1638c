"""sparse_gather / sparse_scatter_merge_: LOSCAR's send and receive on a coordinate subset S.

    gather:         y = x[S]                                   reads k idx + k x; writes k
    scatter-merge:  x[S] <- m̄ + β·(x[S] − y)                   reads k idx, x, m̄, y; writes k

x may be bf16 / fp16: `sent` (and the arithmetic) is then its float32 master dtype, and the merged
value is rounded once into x.

β = 1 is the delay-corrected merge (keep the local progress made while the average was in
flight), β = 0 the overwrite baseline. Only k-sized buffers are touched: no dense copy of x.
"""

from __future__ import annotations

import torch

from .. import _checks, _dispatch
from ..profiling import nvtx_range
from ._common import code, compiling, declare, launch, launcher, native, traced_call, triton
from .quant_format import (
    _FMT_CODE,
    Quantized,
    _check_fmt_block,
    _check_wire,
    as_format,
    as_quantized,
    wire_buffers,
)
from .quant_ref import dequantize_ref
from .quantize import dequantize_launch


def sparse_gather_ref(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The specification of sparse_gather: a new (k,) tensor x.flatten()[idx]."""
    return x.reshape(-1)[idx]


def sparse_scatter_merge_ref(
    x: torch.Tensor, idx: torch.Tensor, avg: torch.Tensor, sent: torch.Tensor, *, beta: float = 1.0
) -> None:
    """The specification of sparse_scatter_merge_, in place on x (contiguous): computed in sent's
    dtype (x's, or the float32 master of a bf16 / fp16 x), rounded once into x."""
    flat = x.view(-1)
    flat[idx] = (avg.to(sent.dtype) + beta * (flat[idx] - sent)).to(x.dtype)


# ---- launchers (k >= 1, checked arguments) ------------------------------------------------------


@launcher("sparse_gather", "ref")
def _(x, idx, out):
    out.copy_(sparse_gather_ref(x, idx))


@launcher("sparse_scatter_merge", "ref")
def _(x, idx, avg, sent, beta):
    sparse_scatter_merge_ref(x, idx, avg, sent, beta=beta)


native("sparse_gather", "lc_sparse_gather", dtype=("x", code), k=("idx", torch.Tensor.numel))
native(
    "sparse_scatter_merge",
    "lc_sparse_scatter_merge",
    dtype=("x", code),
    avg_dtype=("avg", code),
    k=("idx", torch.Tensor.numel),
)
triton("sparse_gather", "sparse", "launch_sparse_gather")
triton("sparse_scatter_merge", "sparse", "launch_sparse_scatter_merge")


# x and idx, as both sparse ops (and the quantized merge) take them; idx's entries: ``_check_idx``.
_X = _checks.Buffer("x", _checks.PARAM_DTYPES)
_IDX = _checks.Buffer("idx", (torch.int64,), dim=1, numel=None)
#: sparse_gather's arguments: out overlaps neither x nor idx (those two are only read).
GATHER = _checks.Contract(
    "lc_sparse_gather",
    _X,
    _IDX,
    _checks.Buffer("out", _checks.like("x"), numel="idx"),
    _checks.Flag("check_values"),
    may_alias=[("x", "idx")],
)
#: sparse_scatter_merge_'s arguments: x, idx, avg and sent pairwise distinct.
SCATTER = _checks.Contract(
    "lc_sparse_scatter_merge",
    _X,
    _IDX,
    _checks.Buffer("avg", _checks.wire_of("x"), numel="idx"),
    _checks.Buffer("sent", _checks.master_of("x"), numel="idx"),
    _checks.Real("beta", lo=0.0),
    _checks.Flag("check_values"),
)
_AVG_WIRE = wire_buffers(prefix="avg.")  # avg as (codes, scales)
#: sparse_scatter_merge_quantized_'s arguments: the scatter's with avg as (codes, scales) of a
#: quantized format (their sizes: ``_check_wire``).
SCATTER_QUANTIZED = _checks.Contract(
    "lc_sparse_scatter_merge_quantized",
    _X,
    _IDX,
    *_AVG_WIRE,
    _checks.Buffer("sent", _checks.master_of("x"), numel="idx"),
    _checks.Real("beta", lo=0.0),
    _checks.Flag("check_values"),
)


def _check_idx(x: torch.Tensor, idx: torch.Tensor, check_values: bool, strictly_increasing: bool) -> None:
    """idx's entries (if check_values: it reads idx on the host)."""
    if check_values:
        _checks.index_values("idx", idx, n=x.numel(), strictly_increasing=strictly_increasing)


def _gather_impl(
    x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, backend: str | None, check_values: bool = True
) -> None:
    """Check, choose the backend, launch: the registered op's body, and the eager path of
    sparse_gather. Every check runs before anything is written."""
    GATHER.check(x=x, idx=idx, out=out, check_values=check_values)
    _check_idx(x, idx, check_values, strictly_increasing=False)
    b = _dispatch.resolve(backend, x.device, "lc_sparse_gather")
    if idx.numel():
        with nvtx_range("sparse_gather"):
            launch("sparse_gather", b, x, idx, out)


def _scatter_merge_impl(
    x: torch.Tensor,
    idx: torch.Tensor,
    avg: torch.Tensor,
    sent: torch.Tensor,
    beta: float,
    backend: str | None,
    check_values: bool = True,
) -> None:
    """Check, choose the backend, launch: the registered op's body, and the eager path of
    sparse_scatter_merge_. Every check runs before anything is written."""
    beta = SCATTER.check(x=x, idx=idx, avg=avg, sent=sent, beta=beta, check_values=check_values)["beta"]
    _check_idx(x, idx, check_values, strictly_increasing=True)
    b = _dispatch.resolve(backend, x.device, "lc_sparse_scatter_merge")
    if idx.numel():
        with nvtx_range("sparse_scatter_merge"):
            launch("sparse_scatter_merge", b, x, idx, avg, sent, beta)


_gather_op = torch.library.custom_op("lowcomm::sparse_gather", _gather_impl, mutates_args=("out",))


@_gather_op.register_fake
def _(x, idx, out, backend, check_values=True):
    GATHER.same_device(x=x, idx=idx, out=out)  # see _common


_scatter_merge_op = torch.library.custom_op(
    "lowcomm::sparse_scatter_merge_", _scatter_merge_impl, mutates_args=("x",)
)


@_scatter_merge_op.register_fake
def _(x, idx, avg, sent, beta, backend, check_values=True):
    SCATTER.same_device(x=x, idx=idx, avg=avg, sent=sent)  # see _common


declare("sparse_gather")
declare("sparse_scatter_merge_")


@torch.no_grad()  # optimizer-style updates: parameters that require grad are fine
def sparse_gather(
    x: torch.Tensor,
    idx: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Gather a coordinate subset: ``out[j] = x.flatten()[idx[j]]``.

    Args:
        x: fp32/fp64, any shape, contiguous. Read only.
        idx: (k,) int64 on x's device, contiguous, every entry in [0, x.numel()); duplicates and
            any order allowed. Read only.
        out: optional (k,) buffer of x's dtype, contiguous, overlapping neither x nor idx. Written.
        backend: 'ref' | 'cpu' | 'triton' | 'cuda' (default by device, see ``_dispatch``).
        check_values: True (the default) checks idx's entries (in range) before anything is
            written, which reads idx on the host: on a GPU the call waits for every kernel queued
            before it. False skips that one check (dtype, device, shape, strides and overlap are
            still checked) for a caller that made idx itself, e.g. with ``mask_indices``; an entry
            out of range is then undefined behaviour (a bad memory access on a GPU).
    Returns:
        out, or a new (k,) tensor of x's dtype.
    Raises:
        TypeError / ValueError naming the argument, before anything is written.
    """
    if out is None:
        _checks.is_tensor("x", x)
        out = torch.empty(_checks.is_tensor("idx", idx).numel(), dtype=x.dtype, device=x.device)
    if compiling():
        traced_call("sparse_gather", x, idx, out, backend, check_values)
    else:
        _gather_impl(x, idx, out, backend, check_values)
    return out


@torch.no_grad()  # optimizer-style updates: parameters that require grad are fine
def sparse_scatter_merge_(
    x: torch.Tensor,
    idx: torch.Tensor,
    avg: torch.Tensor,
    sent: torch.Tensor,
    *,
    beta: float = 1.0,
    backend: str | None = None,
    check_values: bool = True,
) -> None:
    """Merge the average of a coordinate subset into x, in place:

        x[idx[j]] <- avg[j] + beta·(x[idx[j]] − sent[j])

    beta = 1 keeps the local progress made since `sent` was gathered (delay-corrected), beta = 0
    overwrites with the average. Only the k selected elements of x are read and written.

    Args:
        x: fp32/fp64, or bf16/fp16 (whose master dtype is float32), any shape, contiguous.
            Mutated at idx only.
        idx: (k,) int64 on x's device, contiguous, strictly increasing (as mask_indices returns
            it; with a duplicate the result would depend on write order), entries in [0, x.numel()).
        avg: (k,) of x's master dtype or bfloat16 (the narrow wire dtype), contiguous.
            Read only. Or a ``Quantized`` (codes, scales, fmt, block) of k values, dequantized
            inside the merge.
        sent: (k,) of x's master dtype (x's own for fp32/fp64 x), contiguous: x[idx] when it was
            sent. Read only.
        beta: finite, >= 0.
        backend: 'ref' | 'cpu' | 'triton' | 'cuda' (default by device, see ``_dispatch``).
        check_values: True (the default) checks idx's entries (strictly increasing, in range)
            before anything is written, which reads idx on the host: on a GPU the call waits for
            every kernel queued before it. False skips that one check (dtype, device, shape,
            strides and overlap are still checked) for a caller that made idx itself, e.g. with
            ``mask_indices``; a bad entry is then undefined behaviour (a duplicate races, an entry
            out of range is a bad memory access on a GPU).
    x, idx, avg and sent are pairwise distinct buffers (no overlap at all).

    Returns:
        None: the result is x.
    Raises:
        TypeError / ValueError naming the argument, before anything is written.
    """
    if not isinstance(avg, torch.Tensor):  # a quantized avg: sparse_scatter_merge_quantized_ (below)
        kw = {"beta": beta, "backend": backend, "check_values": check_values}
        return sparse_scatter_merge_quantized_(x, idx, avg, sent, **kw)
    if compiling():
        traced_call("sparse_scatter_merge_", x, idx, avg, sent, beta, backend, check_values)
    else:
        _scatter_merge_impl(x, idx, avg, sent, beta, backend, check_values)


# ---- with avg quantized (codes, scales, fmt, block): dequantized inside the merge --------------


def sparse_scatter_merge_quantized_ref(
    x: torch.Tensor, idx: torch.Tensor, avg: Quantized, sent: torch.Tensor, *, beta: float = 1.0
) -> None:
    """``sparse_scatter_merge_ref`` with avg = dequantize_ref(avg) (k values) in sent's dtype (x's
    master dtype)."""
    f = as_format(avg.fmt)
    a = dequantize_ref(avg.codes, avg.scales, f, avg.block, idx.numel(), out_dtype=sent.dtype)
    sparse_scatter_merge_ref(x, idx, a, sent, beta=beta)


@launcher("sparse_scatter_merge_quantized", "ref")
def _(x, idx, codes, scales, fmt, block, sent, beta):
    sparse_scatter_merge_quantized_ref(x, idx, Quantized(codes, scales, fmt, block), sent, beta=beta)


native(
    "sparse_scatter_merge_quantized",
    "lc_sparse_scatter_merge_quantized",
    dtype=("x", code),
    fmt=("fmt", _FMT_CODE.__getitem__),
    k=("idx", torch.Tensor.numel),
)


def _scatter_merge_quantized_impl(
    x: torch.Tensor,
    idx: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: str,
    block: int,
    sent: torch.Tensor,
    beta: float,
    backend: str | None,
    check_values: bool = True,
) -> None:
    f, block = _check_fmt_block(fmt, block)
    tensors = dict(x=x, idx=idx, codes=codes, scales=scales, sent=sent)
    beta = SCATTER_QUANTIZED.check(**tensors, beta=beta, check_values=check_values)["beta"]
    _check_wire(f, block, idx.numel(), codes, scales, _AVG_WIRE)
    _check_idx(x, idx, check_values, strictly_increasing=True)
    b = _dispatch.resolve(backend, x.device, "lc_sparse_scatter_merge_quantized")
    if idx.numel() == 0:
        return
    with nvtx_range("sparse_scatter_merge"):
        if b in ("ref", "cpu", "cuda"):
            launch("sparse_scatter_merge_quantized", b, x, idx, codes, scales, f.name, block, sent, beta)
            return
        avg = torch.empty(idx.numel(), dtype=sent.dtype, device=x.device)  # k values: small
        dequantize_launch(b, codes, scales, avg, f.name, block)
        launch("sparse_scatter_merge", b, x, idx, avg, sent, beta)


_scatter_merge_quantized_op = torch.library.custom_op(
    "lowcomm::sparse_scatter_merge_quantized_", _scatter_merge_quantized_impl, mutates_args=("x",)
)


@_scatter_merge_quantized_op.register_fake
def _(x, idx, codes, scales, fmt, block, sent, beta, backend, check_values=True):
    SCATTER_QUANTIZED.same_device(x=x, idx=idx, codes=codes, scales=scales, sent=sent)


declare("sparse_scatter_merge_quantized_")


@torch.no_grad()
def sparse_scatter_merge_quantized_(
    x: torch.Tensor,
    idx: torch.Tensor,
    avg: Quantized | tuple,
    sent: torch.Tensor,
    *,
    beta: float = 1.0,
    backend: str | None = None,
    check_values: bool = True,
) -> None:
    """``sparse_scatter_merge_`` with avg (k values) given quantized (what it calls for a
    Quantized avg); dequantized inside the merge on the cpu and cuda backends."""
    q = as_quantized(avg, "avg")
    f = as_format(q.fmt)
    args = (x, idx, q.codes, q.scales, f.name, q.block, sent, beta, backend, check_values)
    if compiling():
        traced_call("sparse_scatter_merge_quantized_", *args)
    else:
        _scatter_merge_quantized_impl(*args)
