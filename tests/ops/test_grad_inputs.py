"""Tensors that require grad (an nn.Parameter passed straight in): every backend behaves the same
way, as torch.optim does: the public ops run under no_grad, the in-place update happens with the
values of the ref on detached copies, and no output carries autograd history (pack's go on the
wire)."""

from __future__ import annotations

import pytest
import torch

from lowcomm_kernels.ops import (
    outer_merge_,
    outer_merge_ref,
    pack,
    sparse_scatter_merge_,
    sparse_scatter_merge_ref,
)


@pytest.mark.op("outer_merge_")
def test_outer_merge_on_a_parameter(backend, rng, close):
    n = 64
    g = torch.nn.Parameter(torch.randn(n, generator=rng))
    u, x, xs, d = (torch.randn(n, generator=rng) for _ in range(4))
    ref = [g.detach().clone(), u.clone(), d.clone(), x.clone(), xs.clone()]
    kw = dict(lr=0.7, momentum=0.9, beta=1.0, lam=0.1)
    outer_merge_(g, u, d, x, xs, backend=backend, **kw)
    outer_merge_ref(*ref, **kw)
    close.assert_close(g.detach(), ref[0], scale=8.0)
    close.assert_close(u, ref[1], scale=8.0)
    close.assert_close(x, ref[3], scale=8.0)
    assert g.grad_fn is None and x.grad_fn is None and not x.requires_grad


@pytest.mark.op("sparse_scatter_merge_")
def test_scatter_merge_on_a_parameter(backend, rng, close):
    x = torch.nn.Parameter(torch.randn(100, generator=rng))
    idx = torch.tensor([3, 50, 99])
    avg, sent = torch.randn(3, generator=rng), torch.randn(3, generator=rng)
    expected = x.detach().clone()
    sparse_scatter_merge_ref(expected, idx, avg, sent, beta=1.0)
    sparse_scatter_merge_(x, idx, avg, sent, backend=backend)
    assert x.grad_fn is None
    close.assert_close(x.detach(), expected)


@pytest.mark.op("pack")
def test_pack_outputs_carry_no_autograd_history(backend):
    g = torch.nn.Parameter(torch.randn(16))
    delta, snap, _ = pack(g, torch.randn(16), backend=backend)
    assert not delta.requires_grad and delta.grad_fn is None and not snap.requires_grad
