"""The top-k format's CUDA kernels on a GPU: encode and decode + accumulate of 64M values.

    bash bench/build_cuda.sh build/cuda --install && python3 bench/gpu_topk_bench.py

At the defaults (k 64, chunk 4096, 2 bits), CUDA events, mean of 10 after a warm-up. Their bits
against the reference: tests/gpu/test_topk.py (``pytest -m gpu tests/gpu``). Exits 0 with a note
when there is no GPU or no CUDA library.
"""

from __future__ import annotations

import os
import sys

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lowcomm_kernels import _native  # noqa: E402
from lowcomm_kernels.ops import TopKFormat, topk_decode_add_, topk_encode  # noqa: E402


def timing(dev: torch.device) -> None:
    n = 1 << 26
    d, e = torch.randn(n, device=dev), 0.1 * torch.randn(n, device=dev)
    p = torch.empty(TopKFormat().payload_bytes(n), dtype=torch.uint8, device=dev)
    out = torch.zeros(n, device=dev)
    for name, fn in (
        ("encode", lambda: topk_encode(d, e, payload_out=p, backend="cuda", check_values=False)),
        ("decode + add", lambda: topk_decode_add_(out, p, backend="cuda")),
    ):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 10
        print(f"{name} of 64M values: {ms:.3f} ms, {n / ms / 1e6:.2f} G values/s", flush=True)


def main() -> None:
    if not torch.cuda.is_available() or not _native.cuda_has("lc_topk_encode"):
        print("no GPU or no liblowcomm_cuda with the top-k kernels: nothing timed")
        return
    timing(torch.device("cuda"))


if __name__ == "__main__":
    main()
