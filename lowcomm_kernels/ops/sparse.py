"""sparse_gather / sparse_scatter_merge_: LOSCAR's send and receive on a coordinate subset S.

    gather:         y = x[S]                                   reads k idx + k x; writes k
    scatter-merge:  x[S] <- m̄ + β·(x[S] − y)                   reads k idx, x, m̄, y; writes k

β = 1 is the delay-corrected merge (keep the local progress made while the average was in
flight), β = 0 the overwrite baseline. Only k-sized buffers are touched: no dense copy of x.
"""

from __future__ import annotations

import torch

from .. import _checks, _dispatch
from ..profiling import nvtx_range
from ._common import code, compiling, cpu_call, cuda_call, declare, ptr, traced_call


def sparse_gather_ref(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1)[idx]


def sparse_scatter_merge_ref(x: torch.Tensor, idx: torch.Tensor, avg: torch.Tensor, sent: torch.Tensor, *,
                             beta: float = 1.0) -> None:
    flat = x.view(-1)
    flat[idx] = avg.to(x.dtype) + beta * (flat[idx] - sent)


def _gather_launch(x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, backend: str) -> None:
    if idx.numel() == 0:
        return
    with nvtx_range("sparse_gather"):
        if backend == "ref":
            out.copy_(sparse_gather_ref(x, idx))
        elif backend == "cpu":
            cpu_call("lc_sparse_gather", code(x), ptr(x), ptr(idx), idx.numel(), ptr(out))
        elif backend == "cuda":
            cuda_call("lc_sparse_gather", x.device, code(x), ptr(x), ptr(idx), idx.numel(), ptr(out))
        elif backend == "triton":
            from ..triton_kernels.sparse import launch_sparse_gather
            launch_sparse_gather(x, idx, out)
        else:  # pragma: no cover
            raise ValueError(f"unknown backend {backend!r}")


def _scatter_merge_launch(x, idx, avg, sent, beta: float, backend: str) -> None:
    if idx.numel() == 0:
        return
    with nvtx_range("sparse_scatter_merge"):
        if backend == "ref":
            sparse_scatter_merge_ref(x, idx, avg, sent, beta=beta)
        elif backend == "cpu":
            cpu_call("lc_sparse_scatter_merge", code(x), code(avg), ptr(x), ptr(idx), idx.numel(), ptr(avg),
                     ptr(sent), beta)
        elif backend == "cuda":
            cuda_call("lc_sparse_scatter_merge", x.device, code(x), code(avg), ptr(x), ptr(idx), idx.numel(),
                      ptr(avg), ptr(sent), beta)
        elif backend == "triton":
            from ..triton_kernels.sparse import launch_sparse_scatter_merge
            launch_sparse_scatter_merge(x, idx, avg, sent, beta)
        else:  # pragma: no cover
            raise ValueError(f"unknown backend {backend!r}")


def _gather_impl(x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, backend: str | None) -> None:
    """Check, choose the backend, launch: the registered op's body, and the eager path of
    sparse_gather. Every check runs before anything is written."""
    _checks.tensor("x", x, dtypes=_checks.FLOAT_DTYPES)
    idx = _checks.index("idx", idx, n=x.numel(), device=x.device, strictly_increasing=False)
    _checks.tensor("out", out, dtypes=(x.dtype,))
    _checks.same_device("x", x, out=out)
    _checks.same_numel("idx", idx, out=out)
    _checks.no_alias([("out", out, "x", x), ("out", out, "idx", idx)])
    _gather_launch(x, idx, out, _dispatch.resolve(backend, x.device, "lc_sparse_gather"))


def _scatter_merge_impl(x: torch.Tensor, idx: torch.Tensor, avg: torch.Tensor, sent: torch.Tensor,
                        beta: float, backend: str | None) -> None:
    """Check, choose the backend, launch: the registered op's body, and the eager path of
    sparse_scatter_merge_. Every check runs before anything is written."""
    _checks.tensor("x", x, dtypes=_checks.FLOAT_DTYPES)
    idx = _checks.index("idx", idx, n=x.numel(), device=x.device, strictly_increasing=True)
    _checks.tensor("avg", avg, dtypes=(x.dtype, torch.bfloat16))
    _checks.tensor("sent", sent, dtypes=(x.dtype,))
    _checks.same_device("x", x, avg=avg, sent=sent)
    _checks.same_numel("idx", idx, avg=avg, sent=sent)
    beta = _checks.scalar("beta", beta, lo=0.0)
    _checks.distinct({"x": x, "idx": idx, "avg": avg, "sent": sent})
    b = _dispatch.resolve(backend, x.device, "lc_sparse_scatter_merge")
    _scatter_merge_launch(x, idx, avg, sent, beta, b)


@torch.library.custom_op("lowcomm::sparse_gather", mutates_args=("out",))
def _gather_op(x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, backend: str | None) -> None:
    _gather_impl(x, idx, out, backend)


@_gather_op.register_fake
def _(x, idx, out, backend):
    _checks.same_device("x", x, idx=idx, out=out)  # see _common


@torch.library.custom_op("lowcomm::sparse_scatter_merge_", mutates_args=("x",))
def _scatter_merge_op(x: torch.Tensor, idx: torch.Tensor, avg: torch.Tensor, sent: torch.Tensor, beta: float,
                      backend: str | None) -> None:
    _scatter_merge_impl(x, idx, avg, sent, beta, backend)


@_scatter_merge_op.register_fake
def _(x, idx, avg, sent, beta, backend):
    _checks.same_device("x", x, idx=idx, avg=avg, sent=sent)  # see _common


declare("sparse_gather")
declare("sparse_scatter_merge_")


@torch.no_grad()  # optimizer-style updates: parameters that require grad are fine
def sparse_gather(x: torch.Tensor, idx: torch.Tensor, *, out: torch.Tensor | None = None,
                  backend: str | None = None) -> torch.Tensor:
    """y = x.flatten()[idx]. x: fp32/fp64 contiguous; idx: 1-D int64 in [0, x.numel()) (duplicates
    allowed); out: optional (k,) buffer of x's dtype that must not alias x or idx."""
    if out is None:
        _checks.is_tensor("x", x)
        out = torch.empty(_checks.is_tensor("idx", idx).numel(), dtype=x.dtype, device=x.device)
    if compiling():
        traced_call("sparse_gather", x, idx, out, backend)
    else:
        _gather_impl(x, idx, out, backend)
    return out


@torch.no_grad()  # optimizer-style updates: parameters that require grad are fine
def sparse_scatter_merge_(x: torch.Tensor, idx: torch.Tensor, avg: torch.Tensor, sent: torch.Tensor, *,
                          beta: float = 1.0, backend: str | None = None) -> None:
    """x[idx] <- avg + beta·(x[idx] − sent), in place on x.

    idx must be strictly increasing (as mask_indices returns it): with a duplicate the result
    would depend on write order. avg: (k,) of x's dtype or bfloat16; sent: (k,) of x's dtype;
    neither may alias x. beta finite and >= 0."""
    if compiling():
        traced_call("sparse_scatter_merge_", x, idx, avg, sent, beta, backend)
    else:
        _scatter_merge_impl(x, idx, avg, sent, beta, backend)
