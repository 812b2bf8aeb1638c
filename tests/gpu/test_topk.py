"""The top-k format's CUDA kernels on a GPU: bit for bit against the reference, then their time.

    bash bench/build_cuda.sh build/cuda --install && python3 bench/gpu_topk_check.py

fp32 (decode into fp32 and fp64), short last chunks, k = chunk, 1 / 2 / 4 bits, β = 0.95 and 1,
non-finite chunks; then encode and decode + accumulate of 64M values at the defaults (CUDA events,
mean of 10). Exits 1 if any case differs; 0 with a note when there is no GPU or no CUDA library.
"""

from __future__ import annotations

import os
import sys

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lowcomm_kernels import _native  # noqa: E402
from lowcomm_kernels.ops import TopKFormat, topk_decode_add_, topk_encode  # noqa: E402
from lowcomm_kernels.ops.topk import topk_decode_add_ref, topk_encode_ref  # noqa: E402

CASES = [(3 * 4096 + 77, 64, 4096, 2), (4096, 64, 4096, 1), (1001, 7, 100, 1), (999, 16, 64, 4),
         (37, 5, 16, 2), (40, 16, 16, 2), (3, 5, 8, 2), (1, 1, 2, 1), (65537, 300, 1000, 2),
         (1 << 20, 64, 4096, 2), (5000, 4096, 4096, 2)]  # fmt: skip


def check(dev: torch.device) -> int:
    fails = 0
    for n, k, chunk, bits in CASES:
        f = TopKFormat(k, chunk, bits)
        gen = torch.Generator().manual_seed(n + k)
        d = torch.randn(n, generator=gen, dtype=torch.float64) ** 3
        d[torch.rand(n, generator=gen) < 0.2] = 0.0
        d[torch.rand(n, generator=gen) < 0.1] = 0.75
        d = d.float()
        e0 = 0.1 * torch.randn(n, generator=gen)
        for beta in (0.95, 1.0):
            e_ref = e0.clone()
            p_ref, nf_ref = topk_encode_ref(d, e_ref, f, beta)
            e_gpu = e0.to(dev)
            p_gpu, nf_gpu = topk_encode(
                d.to(dev), e_gpu, k=k, chunk=chunk, bits=bits, beta=beta, backend="cuda", check_values=False
            )
            ok = torch.equal(p_gpu.cpu(), p_ref) and int(nf_gpu) == int(nf_ref)
            ok = ok and torch.equal(e_gpu.cpu().view(torch.int32), e_ref.view(torch.int32))
            for out_dtype in (torch.float32, torch.float64):
                o = torch.randn(n, generator=gen, dtype=out_dtype)
                o_ref, o_gpu = o.clone(), o.to(dev)
                topk_decode_add_ref(o_ref, p_ref, f)
                topk_decode_add_(o_gpu, p_ref.to(dev), k=k, chunk=chunk, bits=bits, backend="cuda")
                ok = ok and torch.equal(o_gpu.cpu(), o_ref)
            print(
                ("ok  " if ok else "FAIL"), f"n={n} k={k} chunk={chunk} bits={bits} beta={beta}", flush=True
            )
            fails += not ok
    d = torch.randn(50)
    d[3], d[25] = float("inf"), float("nan")
    e_ref = torch.zeros(50)
    p_ref, nf_ref = topk_encode_ref(d, e_ref, TopKFormat(4, 16, 2), 0.95)
    e_gpu = torch.zeros(50, device=dev)
    p_gpu, nf_gpu = topk_encode(d.to(dev), e_gpu, k=4, chunk=16, backend="cuda", check_values=False)
    ok = torch.equal(p_gpu.cpu(), p_ref) and int(nf_gpu) == int(nf_ref) == 2
    ok = ok and torch.equal(e_gpu.cpu().nan_to_num(), e_ref.nan_to_num())
    print(("ok  " if ok else "FAIL"), "non-finite chunks", flush=True)
    return fails + (not ok)


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
        print("no GPU or no liblowcomm_cuda with the top-k kernels: nothing checked")
        return
    dev = torch.device("cuda")
    fails = check(dev)
    timing(dev)
    print(f"{fails} case(s) differ from the reference")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
