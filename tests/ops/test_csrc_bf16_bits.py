"""The bf16 wire written by the cpu backend is torch's CPU conversion byte for byte (NaN, ±inf,
overflow to inf, subnormals, ties), as csrc/include/lowcomm/kernels.h documents: every NaN becomes
0xFFFF, the bits of torch's vectorised conversion. For float64 data torch converts its < 16-element
per-thread leftovers through a scalar path that writes 0x7FC0 for NaN instead, so float64 NaN bits
are compared on lengths torch converts in whole vectors on one thread."""

from __future__ import annotations

import pytest
import torch

from lowcomm_kernels import _dispatch
from lowcomm_kernels.ops import pack

pytestmark = pytest.mark.op("pack")


def _cpu_or_skip() -> None:
    if not _dispatch.available("cpu", torch.device("cpu"), "lc_pack"):
        pytest.skip("the native CPU library is not built")


def _f32(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


# float32 bit patterns of every class the conversion treats differently
SPECIAL_F32 = _f32([
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC12345,  # NaNs
    0x7F800000, 0xFF800000,  # ±inf
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F7FC000,  # overflow to inf / largest finite bf16
    0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x00017FFF, 0x007FFFFF, 0x807FFFFF,  # subnormal
    0x00800000,  # the smallest normal
    0x00000000, 0x80000000,  # ±0
    0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # ties to even, either side of a tie
]).tolist()


def _with_specials(n: int, dtype: torch.dtype, rng: torch.Generator) -> torch.Tensor:
    """n values: random bit patterns (every class, as float32) with the specials at random places."""
    raw = torch.randint(-(2**31), 2**31, (n,), generator=rng, dtype=torch.int64).to(torch.int32)
    g = raw.view(torch.float32).to(dtype)
    picks = torch.randint(0, n, (min(n, 4 * len(SPECIAL_F32)),), generator=rng)
    specials = torch.tensor(SPECIAL_F32 * 4, dtype=torch.float32)[: len(picks)].to(dtype)
    g[picks] = specials
    head = min(n, len(SPECIAL_F32))
    g[:head] = torch.tensor(SPECIAL_F32, dtype=torch.float32)[:head].to(dtype)
    return g


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).to(torch.int32) & 0xFFFF


# n: scalar tails, one vector, the parallel region, and the streaming-store path (>= 4M fp32)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 300_001, (1 << 22) + 37])
@pytest.mark.parametrize("x_kind", ["zero", "random"])
def test_f32_wire_bits_are_torch_cpu(n, x_kind, rng):
    _cpu_or_skip()
    g = _with_specials(n, torch.float32, rng)
    x = torch.zeros(n) if x_kind == "zero" else torch.randn(n, generator=rng) * 1e30
    delta, _, nonfinite = pack(g, x, wire_dtype=torch.bfloat16, backend="cpu")
    expected = (g - x).to(torch.bfloat16)
    assert torch.equal(_bits(delta), _bits(expected)), "bf16 bytes differ from torch's conversion"
    assert int(nonfinite) == int((~torch.isfinite(expected)).sum())
    if n >= 16:
        assert bool((_bits(delta)[torch.isnan(expected)] == 0xFFFF).all()), "NaN is 0xFFFF on the CPU"


@pytest.mark.parametrize("n", [16, 1024, 16 * 1023])
def test_f64_wire_bits_are_torch_cpu(n, rng):
    """float64 data: two roundings (to float32, then to bf16) as torch; NaN 0xFFFF, as torch's
    vectorised path (whole 16-element vectors on one thread here: n % 16 == 0, n < 32768)."""
    _cpu_or_skip()
    g = _with_specials(n, torch.float64, rng)
    g[n // 2:] = torch.randn(n - n // 2, generator=rng, dtype=torch.float64) * torch.tensor(
        [1e-300, 1e-45, 1e-40, 1e38, 3.4e38, 1e300, 1.0, 1 + 2.0**-8 + 2.0**-30], dtype=torch.float64
    ).repeat((n - n // 2 + 7) // 8)[: n - n // 2]
    x = torch.zeros(n, dtype=torch.float64)
    delta, _, _ = pack(g, x, wire_dtype=torch.bfloat16, backend="cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = (g - x).to(torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(_bits(delta), _bits(expected))


def test_f64_nan_is_0xffff_at_any_length(rng):
    """Lengths torch splits into a scalar tail: the cpu backend still writes 0xFFFF (torch's tail
    writes 0x7FC0 there), and every other value matches torch's bits."""
    _cpu_or_skip()
    for n in (1, 7, 17, 1001):
        g = _with_specials(n, torch.float64, rng)
        delta, _, _ = pack(g, torch.zeros_like(g), wire_dtype=torch.bfloat16, backend="cpu")
        expected = g.to(torch.bfloat16)
        nan = torch.isnan(expected)
        assert bool((_bits(delta)[nan] == 0xFFFF).all())
        assert torch.equal(_bits(delta)[~nan], _bits(expected)[~nan])
