"""The Triton top-k codec (triton_kernels/topk.py) on CPU, through Triton's interpreter
(TRITON_INTERPRET=1), against the specification of ops/topk.py.

Fresh random fp32 inputs, bit-identical payloads, error buffers and non-finite counts: odd sizes
(a short last chunk), chunks that are and are not powers of two, k = 1 and k = chunk, k past a short
last chunk, bits 1 / 2 / 4, ties (repeated magnitudes, ± the same value, all-zero chunks), chunks
longer than one tile (the tiled path, forced by a small interpreter tile), non-finite chunks
(check_values=False); decode adds into fp32 and fp64 buffers bit for bit as the reference does;
fp64 encode on 'triton' is the reference. Sizes are small: the interpreter runs each program in
Python (~0.1 s per chunk for the 31 threshold passes).

TRITON_INTERPRET is set only while this module runs, by its `kernels` fixture (as in
test_triton_interpret.py, which explains why not at import).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: the Triton backend cannot be tested")

from lowcomm_kernels import _dispatch
from lowcomm_kernels.ops import TopKFormat, topk_decode_add_, topk_encode, topk_encode_ref
from lowcomm_kernels.ops.topk import topk_decode_add_ref

KERNEL_MODULES = ("_launch", "topk")
numpy_overflow_ok = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def _forget() -> None:
    for name in KERNEL_MODULES:
        sys.modules.pop(f"lowcomm_kernels.triton_kernels.{name}", None)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """The top-k kernel module, decorated under the interpreter, for this module only."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        _forget()
        mod = importlib.import_module("lowcomm_kernels.triton_kernels.topk")
        assert _dispatch.resolve("triton", torch.device("cpu")) == "triton"
        yield mod
    finally:
        _forget()
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int64)


def _check_encode(delta, e, k, chunk, bits, beta=0.9, check_values=True):
    """Encode on 'triton' and with the reference from the same e: identical bits everywhere."""
    e_tri, e_ref = e.clone(), e.clone()
    p_tri, nf_tri = topk_encode(
        delta, e_tri, k=k, chunk=chunk, bits=bits, beta=beta, backend="triton", check_values=check_values
    )
    p_ref, nf_ref = topk_encode_ref(delta, e_ref, TopKFormat(k, chunk, bits), beta)
    assert torch.equal(p_tri, p_ref), f"payload differs at bytes {(p_tri != p_ref).nonzero().flatten()[:8]}"
    assert torch.equal(_bits(e_tri), _bits(e_ref)), (
        f"e differs at {(_bits(e_tri) != _bits(e_ref)).nonzero().flatten()[:8]}"
    )
    assert nf_tri.dtype == torch.int64 and int(nf_tri) == int(nf_ref)
    return p_ref, int(nf_ref)


def _check_decode(payload, n, k, chunk, bits, rng):
    fmt = TopKFormat(k, chunk, bits)
    for dtype in (torch.float32, torch.float64):
        out = torch.randn(n, generator=rng, dtype=dtype)
        ref = out.clone()
        topk_decode_add_(out, payload, k=k, chunk=chunk, bits=bits, backend="triton")
        topk_decode_add_ref(ref, payload, fmt)
        assert torch.equal(_bits(out), _bits(ref)), f"decode into {dtype} differs"


# (n, k, chunk, bits): short last chunks, chunks not a power of two, k = 1, k = chunk, k past a
# short last chunk, the smallest chunk, one value, several index widths
SHAPES = [
    (37, 5, 16, 2),
    (307, 7, 100, 1),
    (999, 16, 64, 4),
    (40, 16, 16, 2),
    (3, 5, 8, 2),
    (1, 1, 2, 1),
    (260, 1, 50, 4),
    (130, 64, 64, 1),
    (70, 33, 33, 4),
    (9001, 70, 3000, 2),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-k{}-C{}-b{}".format(*s))
def test_encode_and_decode_match_the_reference(shape, rng):
    n, k, chunk, bits = shape
    delta = torch.randn(n, generator=rng) * 3
    e = torch.randn(n, generator=rng)
    payload, _ = _check_encode(delta, e, k, chunk, bits)
    _check_decode(payload, n, k, chunk, bits, rng)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_ties_zeros_and_signs(bits, rng):
    """Repeated magnitudes (ties go to the lower index), ± the same value, whole chunks of zeros
    and of ±0, a chunk of one repeated value, k = chunk on all of it."""
    n, chunk = 5 * 24 + 9, 24
    e = torch.zeros(n)
    e[chunk : 2 * chunk] = torch.randint(0, 3, (chunk,), generator=rng).float()  # few levels
    e[2 * chunk : 3 * chunk] = torch.where(torch.rand(chunk, generator=rng) < 0.5, -1.5, 1.5)
    e[3 * chunk : 4 * chunk] = -0.0
    e[4 * chunk :] = 0.25
    delta = torch.zeros(n)
    for k in (1, 5, chunk):
        payload, _ = _check_encode(delta, e, k, chunk, bits, beta=1.0)
        _check_decode(payload, n, k, chunk, bits, rng)


def test_chunks_longer_than_a_tile(kernels, monkeypatch, rng):
    """The tiled path (a chunk over several tiles, e read back per pass), with ties across tiles."""
    monkeypatch.setattr(kernels, "INTERPRET_TILE", 32)
    n, chunk = 2 * 100 + 41, 100
    e = torch.randn(n, generator=rng)
    e[::7] = 2.0  # ties spread over the tiles of each chunk
    delta = torch.randn(n, generator=rng) * 0.5
    for k, bits in ((9, 2), (20, 1), (100, 4)):
        payload, _ = _check_encode(delta, e, k, chunk, bits)
        _check_decode(payload, n, k, chunk, bits, rng)


@numpy_overflow_ok
@pytest.mark.parametrize("one_tile", [True, False], ids=["one-tile", "tiled"])
def test_non_finite_chunks_are_not_encoded(kernels, monkeypatch, one_tile, rng):
    if not one_tile:
        monkeypatch.setattr(kernels, "INTERPRET_TILE", 16)
    n, chunk, k = 4 * 40 + 7, 40, 6
    delta = torch.randn(n, generator=rng)
    e = torch.randn(n, generator=rng)
    delta[3], delta[50], e[51], e[n - 1] = float("nan"), float("inf"), float("-inf"), float("nan")
    for bits in (1, 2):
        _, nf = _check_encode(delta, e, k, chunk, bits, check_values=False)
        assert nf == 4


def test_fp64_runs_the_reference_on_triton(rng):
    n, k, chunk, bits = 101, 4, 32, 2
    delta = torch.randn(n, generator=rng, dtype=torch.float64)
    e = torch.randn(n, generator=rng, dtype=torch.float64)
    e_tri, e_ref = e.clone(), e.clone()
    p_tri, _ = topk_encode(delta, e_tri, k=k, chunk=chunk, bits=bits, backend="triton")
    p_ref, _ = topk_encode_ref(delta, e_ref, TopKFormat(k, chunk, bits), 0.95)
    assert torch.equal(p_tri, p_ref) and torch.equal(_bits(e_tri), _bits(e_ref))
