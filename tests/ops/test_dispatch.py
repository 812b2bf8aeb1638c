"""Backend choice as the ops see it: the default by device, LOWCOMM_BACKEND and backend= overrides,
no silent fallback, and the package working on `ref` (with one warning) when the native library
cannot be loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lowcomm_kernels import _dispatch
from lowcomm_kernels.ops import pack

CPU = torch.device("cpu")


def test_default_on_cpu_is_native_when_built():
    expected = "cpu" if _dispatch.available("cpu", CPU, "lc_pack") else "ref"
    assert _dispatch.resolve(None, CPU, "lc_pack") == expected


def test_environment_override_and_argument_wins(monkeypatch):
    monkeypatch.setenv("LOWCOMM_BACKEND", "ref")
    assert _dispatch.resolve(None, CPU, "lc_pack") == "ref"
    if _dispatch.available("cpu", CPU, "lc_pack"):
        assert _dispatch.resolve("cpu", CPU, "lc_pack") == "cpu"


def test_bad_environment_value_is_an_error(monkeypatch, close):
    monkeypatch.setenv("LOWCOMM_BACKEND", "fastest")
    g = torch.randn(8)
    close.assert_rejected(lambda: pack(g, g.clone()), ValueError, "LOWCOMM_BACKEND", [g])


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_unavailable_backend_is_an_error_not_a_fallback(backend, monkeypatch, close):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g, x, d = torch.randn(8), torch.randn(8), torch.full((8,), 7.0)
    close.assert_rejected(lambda: pack(g, x, delta_out=d, backend=backend), ValueError, "backend", [g, x, d])


_CHILD = r"""
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
    from lowcomm_kernels import _dispatch
    from lowcomm_kernels.ops import pack, fragment_norms, mask_indices
    g, x = torch.arange(6.0), torch.ones(6)
    delta, snap, nf = pack(g, x)
    norms = fragment_norms(g, torch.tensor([0, 3, 6]))
    idx = mask_indices(1, 2, 100, 5)
    delta2, _, _ = pack(g, x)
print(json.dumps({
    "backend": _dispatch.resolve(None, torch.device("cpu"), "lc_pack"),
    "delta": delta.tolist(), "norms": norms.tolist(), "k": idx.numel(),
    "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
}))
"""


@pytest.mark.slow
def test_missing_native_library_falls_back_to_ref_with_one_warning(tmp_path):
    env = dict(os.environ, LOWCOMM_NATIVE_LIB=str(tmp_path / "liblowcomm_cpu_missing.so"))
    env.pop("LOWCOMM_BACKEND", None)
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["backend"] == "ref"
    assert out["delta"] == [-1.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    assert out["norms"] == pytest.approx([5.0**0.5, 50.0**0.5], rel=1e-7) and out["k"] == 5
    native = [w for w in out["warnings"] if "lowcomm_kernels" in w]
    assert len(native) == 1 and "ref" in native[0], out["warnings"]


def test_every_kernel_has_a_launcher_on_every_backend():
    """The launcher table (ops/_common.py) is complete: resolve() may return any backend."""
    from lowcomm_kernels import _config
    from lowcomm_kernels.ops._common import LAUNCHERS, launch

    kernels = {kernel for kernel, _ in LAUNCHERS}
    fused_merges = {"outer_merge_quantized", "sparse_scatter_merge_quantized"}
    assert kernels == {"pack", "outer_merge", "taylor_norms", "mask_perm", "sparse_gather",
                       "sparse_scatter_merge", "fragment_norms", "pack_quantized", "dequantize",
                       "reduce_quantized", "topk_encode", "topk_decode_add"} | fused_merges
    # The merges with a quantized average have no Triton kernel: on 'triton' they dequantize (a
    # Triton launch) and run the dense Triton merge, never launching these two.
    missing = {(k, "triton") for k in fused_merges}
    assert {(k, b) for k in kernels for b in _config.BACKENDS} - missing == set(LAUNCHERS)
    with pytest.raises(ValueError, match="backend 'numpy' has no launcher for pack"):
        launch("pack", "numpy")
