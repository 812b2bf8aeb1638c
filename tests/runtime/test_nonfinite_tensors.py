"""``nonfinite_tensors``, the check every sync runs over the inner optimizer's state and the model's
buffers: how many tensors hold a NaN or an inf, against the definition (``isfinite(v).all()``) on
fresh random lists: every floating dtype, odd sizes, 0-d tensors, and finite values so large that
the fused 2-norm pass overflows (those must not count)."""

from __future__ import annotations

import pytest
import torch

from lowcomm_kernels.runtime import base
from lowcomm_kernels.runtime.base import nonfinite_tensors

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
BAD = (float("nan"), float("inf"), float("-inf"))


def _expected(tensors: list[torch.Tensor]) -> int:
    return sum(not bool(torch.isfinite(v).all()) for v in tensors)


def _random_list(gen: torch.Generator, n: int) -> list[torch.Tensor]:
    out = []
    for _ in range(n):
        dtype = DTYPES[int(torch.randint(len(DTYPES), (), generator=gen))]
        shape = (
            () if torch.rand((), generator=gen) < 0.2 else (int(torch.randint(1, 3000, (), generator=gen)),)
        )
        out.append(torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_counts_the_tensors_holding_a_nan_or_an_inf(seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = _random_list(gen, 12)
    for i in torch.randperm(len(tensors), generator=gen)[: seed % 4].tolist():
        v = tensors[i].view(-1)
        for _ in range(1 + seed % 3):  # one or more non-finite values, anywhere in the tensor
            v[int(torch.randint(v.numel(), (), generator=gen))] = BAD[
                int(torch.randint(3, (), generator=gen))
            ]
    got = nonfinite_tensors(tensors, torch.device("cpu"))
    assert got.dtype == torch.float64 and got.dim() == 0
    assert int(got) == _expected(tensors) == min(seed % 4, len(tensors))


@pytest.mark.parametrize(
    "huge",
    [torch.full((7,), 1e30), torch.full((3,), 6.0e4, dtype=torch.float16),
     torch.full((5,), 1e38, dtype=torch.bfloat16), torch.full((2,), 1e20)],
)  # fmt: skip
def test_finite_values_that_overflow_the_fused_pass_do_not_count(huge):
    """Their squares pass the dtype's range, so the total norm is inf: each tensor is then read
    exactly, and only a real NaN or inf counts."""
    assert not bool(torch.isfinite(torch.nn.utils.get_total_norm([huge])))
    assert int(nonfinite_tensors([huge, torch.randn(5)], torch.device("cpu"))) == 0
    bad = torch.randn(4)
    bad[2] = float("nan")
    assert int(nonfinite_tensors([huge, bad, torch.randn(5)], torch.device("cpu"))) == 1


def test_an_all_finite_list_is_one_fused_pass(monkeypatch):
    """The exact per-tensor pass runs only when the fused one is not finite."""
    calls = []
    real = base.abs_max
    monkeypatch.setattr(base, "abs_max", lambda t: calls.append(t) or real(t))
    gen = torch.Generator().manual_seed(7)
    tensors = _random_list(gen, 20)
    assert int(nonfinite_tensors(tensors, torch.device("cpu"))) == 0 and not calls
    tensors[3].view(-1)[0] = float("inf")
    assert int(nonfinite_tensors(tensors, torch.device("cpu"))) == 1 and len(calls) == len(tensors)


def test_no_tensors_is_zero():
    got = nonfinite_tensors([], torch.device("cpu"))
    assert got.dtype == torch.float64 and int(got) == 0
