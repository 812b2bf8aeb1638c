"""The registered ops on the GPU: ``torch.library.opcheck`` and one ``torch.compile`` against eager.

The CPU suite runs tests/ops/test_registration.py on CPU tensors only; these run the same checks on
the device:

* opcheck (schema, fake tensors, autograd registration, AOT dispatch with dynamic shapes) of every
  ``torch.ops.lowcomm`` op, per backend and dtype, on the samples of tests/ops/test_registration.py
  moved to the device;
* one ``torch.compile(fullgraph=True)`` over a function that calls every op, against the same
  function in eager, outputs and in-place updates compared.
"""

from __future__ import annotations

import pytest
import torch

from lowcomm_kernels import ops as lk
from tests.gpu import _env
from tests.ops.test_registration import _samples

pytestmark = pytest.mark.gpu

OPS = ("pack", "outer_merge_", "mask_indices", "sparse_gather", "sparse_scatter_merge_", "fragment_norms")


def all_ops(g, u, x, x_sent, delta_avg, buf, offsets):
    """tests/ops/test_registration.py's ``_all_ops``, with the mask made on the data's device."""
    delta, snap, nonfinite = lk.pack(g, x)
    lk.outer_merge_(g, u, delta_avg, x, x_sent, lr=0.7, momentum=0.9, alpha=0.1, beta=1.0, lam=0.2)
    idx = lk.mask_indices(7, 3, x.numel(), 64, device=x.device)
    y = lk.sparse_gather(x, idx)
    lk.sparse_scatter_merge_(x, idx, y * 0.5, y + 1.0, beta=1.0)
    return delta, snap, nonfinite, idx, y, lk.fragment_norms(buf, offsets, ord=2)


@pytest.mark.parametrize("backend", _env.BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("op", OPS)
def test_opcheck_on_the_device(op, dtype, backend, gpu_device):
    _env.require(backend)

    def moved(a):
        if isinstance(a, torch.Tensor):
            return a.to(gpu_device)
        return gpu_device if isinstance(a, torch.device) else a

    for args in _samples(op, backend, dtype):
        torch.library.opcheck(getattr(torch.ops.lowcomm, op).default, tuple(map(moved, args)))


def test_compiled_fullgraph_matches_eager(gpu_device):
    if gpu_device.type != "cuda":  # ~20 s, and the CPU suite has it
        pytest.skip("on the CPU: tests/ops/test_registration.py::test_compile_fullgraph_all_ops")
    gen = torch.Generator().manual_seed(1)
    n = 4099
    inputs = [torch.randn(n, generator=gen) for _ in range(4)] + [
        0.1 * torch.randn(n, generator=gen),
        torch.randn(n, generator=gen),
        torch.tensor([0, 1000, 1000, 4099]),
    ]
    eager_in = [t.to(gpu_device, copy=True) for t in inputs]
    comp_in = [t.to(gpu_device, copy=True) for t in inputs]
    want = all_ops(*eager_in)
    torch._dynamo.reset()
    got = torch.compile(all_ops, fullgraph=True)(*comp_in)
    names = ["delta", "snapshot", "nonfinite", "idx", "y", "norms", "g", "u", "x"]
    for name, a, e in zip(names, [*got, *comp_in[:3]], [*want, *eager_in[:3]], strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=lambda m, k=name: f"{k}: {m}")
