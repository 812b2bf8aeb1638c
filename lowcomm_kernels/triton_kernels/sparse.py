"""Triton sparse_gather / sparse_scatter_merge: LOSCAR's send and receive on a coordinate subset S.

    gather:         out[j] = x[idx[j]]
    scatter-merge:  x[idx[j]] <- avg[j] + β·(x[idx[j]] − sent[j])

Only k-sized buffers and the k touched entries of x move. The scatter writes each x[idx[j]] once
from the program that read it, so it is race-free when idx has no duplicates (the public op
requires idx strictly increasing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import hardware_bf16, launch_elementwise
from .pack import _to_bf16


@triton.jit
def _sparse_gather_kernel(x_ptr, idx_ptr, out_ptr, k, BLOCK: tl.constexpr):
    """out[j] = x[idx[j]] for j < k (idx int64, in range)."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = j < k
    idx = tl.load(idx_ptr + j, mask=mask, other=0)
    tl.store(out_ptr + j, tl.load(x_ptr + idx, mask=mask), mask=mask)


@triton.jit
def _sparse_scatter_merge_kernel(
    x_ptr, idx_ptr, avg_ptr, sent_ptr, k, beta: tl.float64, HW_BF16: tl.constexpr, BLOCK: tl.constexpr
):
    """x[idx[j]] <- avg[j] + β·(x[idx[j]] − sent[j]) for j < k, in sent's dtype (x's, or the
    float32 master of a bf16 / fp16 x, which is widened exactly and written back rounded to nearest
    even once); avg (that dtype or bf16) is widened exactly, β rounded once to that dtype."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = j < k
    idx = tl.load(idx_ptr + j, mask=mask, other=0)
    sent = tl.load(sent_ptr + j, mask=mask, other=0.0)
    dt = sent.dtype
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(dt)
    avg = tl.load(avg_ptr + j, mask=mask, other=0.0).to(dt)
    merged = avg + tl.cast(beta, dt) * (x - sent)
    if x_ptr.dtype.element_ty == tl.bfloat16:
        merged = _to_bf16(merged, HW_BF16)
    elif x_ptr.dtype.element_ty == tl.float16:
        merged = merged.to(tl.float16, fp_downcast_rounding="rtne")
    tl.store(x_ptr + idx, merged, mask=mask)


def launch_sparse_gather(x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """out = x.flatten()[idx]. x: contiguous fp32/fp64; idx: (k,) int64 in [0, x.numel());
    out: contiguous (k,) of x's dtype. Allocates nothing; k == 0 is a no-op."""
    launch_elementwise(_sparse_gather_kernel, x, idx.numel(), x, idx, out, idx.numel())


def launch_sparse_scatter_merge(
    x: torch.Tensor, idx: torch.Tensor, avg: torch.Tensor, sent: torch.Tensor, beta: float
) -> None:
    """x[idx] <- avg + beta·(x[idx] − sent), in place on x. idx: (k,) int64, in range, no
    duplicates; avg: (k,) of x's dtype or bf16; sent: (k,) of x's dtype. Allocates nothing."""
    k = idx.numel()
    launch_elementwise(
        _sparse_scatter_merge_kernel,
        x,
        k,
        x,
        idx,
        avg,
        sent,
        k,
        float(beta),
        HW_BF16=x.dtype == torch.bfloat16 and hardware_bf16(x),
    )
