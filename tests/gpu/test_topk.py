"""The top-k format's native kernels on the device: bit for bit against the reference.

fp32 data (decode into fp32 and fp64), short last chunks, k = chunk, 1 / 2 / 4 bits, β = 0.95 and 1,
and non-finite chunks. The timing of encode and decode + accumulate at 64M values is
bench/gpu_topk_bench.py.
"""

from __future__ import annotations

import pytest
import torch

from lowcomm_kernels.ops import TopKFormat, topk_decode_add_, topk_encode
from lowcomm_kernels.ops.topk import topk_decode_add_ref, topk_encode_ref
from tests.gpu import _env

pytestmark = pytest.mark.gpu

CASES = [(3 * 4096 + 77, 64, 4096, 2), (4096, 64, 4096, 1), (1001, 7, 100, 1), (999, 16, 64, 4),
         (37, 5, 16, 2), (40, 16, 16, 2), (3, 5, 8, 2), (1, 1, 2, 1), (65537, 300, 1000, 2),
         (1 << 20, 64, 4096, 2), (5000, 4096, 4096, 2)]  # fmt: skip
BACKENDS = list(_env.BACKENDS)  # triton (triton_kernels/topk.py) and cuda (csrc/cuda/topk.cu)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", [0.95, 1.0])
@pytest.mark.parametrize(
    ("n", "k", "chunk", "bits"), CASES, ids=[f"n{c[0]}-k{c[1]}-chunk{c[2]}-bits{c[3]}" for c in CASES]
)
def test_encode_and_decode_are_the_reference_bits(n, k, chunk, bits, beta, backend, gpu_device):
    _env.require(backend, "lc_topk_encode")
    f = TopKFormat(k, chunk, bits)
    gen = torch.Generator().manual_seed(n + k)
    d = torch.randn(n, generator=gen, dtype=torch.float64) ** 3
    d[torch.rand(n, generator=gen) < 0.2] = 0.0
    d[torch.rand(n, generator=gen) < 0.1] = 0.75
    d = d.float()
    e0 = 0.1 * torch.randn(n, generator=gen)
    e_ref = e0.clone()
    p_ref, nf_ref = topk_encode_ref(d, e_ref, f, beta)
    e_dev = e0.to(gpu_device)
    p_dev, nf_dev = topk_encode(
        d.to(gpu_device), e_dev, k=k, chunk=chunk, bits=bits, beta=beta, backend=backend, check_values=False
    )
    assert torch.equal(p_dev.cpu(), p_ref), "payload"
    assert int(nf_dev) == int(nf_ref), "non-finite count"
    assert torch.equal(e_dev.cpu().view(torch.int32), e_ref.view(torch.int32)), "error feedback e"
    for out_dtype in (torch.float32, torch.float64):
        o = torch.randn(n, generator=gen, dtype=out_dtype)
        o_ref, o_dev = o.clone(), o.to(gpu_device)
        topk_decode_add_ref(o_ref, p_ref, f)
        topk_decode_add_(o_dev, p_ref.to(gpu_device), k=k, chunk=chunk, bits=bits, backend=backend)
        assert torch.equal(o_dev.cpu(), o_ref), f"decode + add into {out_dtype}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_chunks(backend, gpu_device):
    _env.require(backend, "lc_topk_encode")
    d = torch.randn(50, generator=torch.Generator().manual_seed(0))
    d[3], d[25] = float("inf"), float("nan")
    e_ref = torch.zeros(50)
    p_ref, nf_ref = topk_encode_ref(d, e_ref, TopKFormat(4, 16, 2), 0.95)
    e_dev = torch.zeros(50, device=gpu_device)
    p_dev, nf_dev = topk_encode(d.to(gpu_device), e_dev, k=4, chunk=16, backend=backend, check_values=False)
    assert torch.equal(p_dev.cpu(), p_ref)
    assert int(nf_dev) == int(nf_ref) == 2
    assert torch.equal(e_dev.cpu().nan_to_num(), e_ref.nan_to_num())
