"""The registered ops: torch.library.opcheck for every torch.ops.lowcomm.* op on every backend,
and one torch.compile(fullgraph=True) over a function that uses them all, against eager."""

from __future__ import annotations

import pytest
import torch

import lowcomm_kernels.ops as lk
from lowcomm_kernels import _dispatch


def _samples(op: str, backend: str, dtype: torch.dtype):
    """(args, kwargs) lists for torch.ops.lowcomm.<op>; several per op to cover optional inputs."""
    gen = torch.Generator().manual_seed(0)

    def r(n: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(n, generator=gen, dtype=torch.float64).to(dt)

    n = 37
    if op == "pack":
        return [
            (r(n), r(n), torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype), backend),
            (r(n), r(n), torch.empty(n, dtype=torch.bfloat16), None, backend),
        ]
    if op == "outer_merge_":
        return [
            (r(n), r(n), r(n), r(n), r(n), 0.7, 0.9, True, 0.1, 1.0, 0.3, "absolute", backend),
            (
                r(n),
                r(n),
                r(n, torch.bfloat16),
                r(n),
                r(n),
                0.7,
                0.9,
                False,
                0.0,
                1.0,
                0.5,
                "normalized",
                backend,
            ),
            (r(n), r(n), r(n), r(n), None, 1.0, 0.0, True, 0.0, 0.0, 0.0, "absolute", backend),
        ]
    if op == "mask_indices":
        return [(3, 4, 1000, 17, torch.device("cpu"), backend), (3, 4, 5, 0, torch.device("cpu"), backend)]
    idx = torch.tensor([0, 3, 4, 20, 36])
    if op == "sparse_gather":
        return [(r(n), idx, torch.empty(5, dtype=dtype), backend)]
    if op == "sparse_scatter_merge_":
        return [(r(n), idx, r(5), r(5), 1.0, backend), (r(n), idx, r(5, torch.bfloat16), r(5), 0.5, backend)]
    if op == "fragment_norms":
        return [(r(n), torch.tensor([0, 10, 10, 37]), 2, backend), (r(n), torch.tensor([0, 37]), 1, backend)]
    raise AssertionError(op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_opcheck(op_name, backend, dtype):
    """Schema (declared mutations are the only ones), fake tensor, autograd registration, and AOT
    dispatch (dynamic shapes) checks of torch.library.opcheck."""
    for args in _samples(op_name, backend, dtype):
        torch.library.opcheck(getattr(torch.ops.lowcomm, op_name).default, args)


def _all_ops(g, u, x, x_sent, delta_avg, buf, offsets):
    delta, snap, nonfinite = lk.pack(g, x)
    lk.outer_merge_(g, u, delta_avg, x, x_sent, lr=0.7, momentum=0.9, alpha=0.1, beta=1.0, lam=0.2)
    idx = lk.mask_indices(7, 3, x.numel(), 64)
    y = lk.sparse_gather(x, idx)
    lk.sparse_scatter_merge_(x, idx, y * 0.5, y + 1.0, beta=1.0)
    norms = lk.fragment_norms(buf, offsets, ord=2)
    return delta, snap, nonfinite, idx, y, norms


@pytest.mark.slow
def test_compile_fullgraph_all_ops(close):
    """One compile (the first costs ~20 s) over every op, on the default backend, against eager."""
    gen = torch.Generator().manual_seed(1)
    n = 4099
    inputs = [torch.randn(n, generator=gen) for _ in range(4)] + [
        0.1 * torch.randn(n, generator=gen),
        torch.randn(n, generator=gen),
        torch.tensor([0, 1000, 1000, 4099]),
    ]
    eager_in = [t.clone() for t in inputs]
    compiled_in = [t.clone() for t in inputs]
    expected = _all_ops(*eager_in)
    torch._dynamo.reset()
    got = torch.compile(_all_ops, fullgraph=True)(*compiled_in)
    for name, a, b in zip(
        ["delta", "snapshot", "nonfinite", "idx", "y", "norms"], got, expected, strict=True
    ):
        if a.dtype == torch.int64:
            assert torch.equal(a, b), name
        else:
            close.assert_close(
                a, b, kind="reduction" if name == "norms" else "elementwise", scale=8.0, msg=name
            )
    for name, a, b in zip("gux", compiled_in[:3], eager_in[:3], strict=True):
        close.assert_close(a, b, scale=8.0, msg=f"mutated {name}")
    assert _dispatch.resolve(None, torch.device("cpu"), "lc_pack") in ("cpu", "ref")
