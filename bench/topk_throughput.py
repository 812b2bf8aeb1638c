"""The top-k sparse format's throughput: encode (e ← β·e + Δ, select, quantize, pack, subtract) and
decode + accumulate, the native backend against the reference, as ratios within one run.

    OMP_WAIT_POLICY=ACTIVE .venv/bin/python bench/topk_throughput.py [--sizes 16M,64M] [--rounds 5]

Defaults k = 64 per chunk of 4096, 2 bits, β = 0.95, fp32. Each round times the native op and
the reference back to back on the same buffers (the reference every round too, so both see the
same neighbours on a shared machine); the table gives the best of the rounds in G values/s and
the reference's best time over the native op's best.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.workloads import parse_size  # noqa: E402
from lowcomm_kernels import _dispatch  # noqa: E402
from lowcomm_kernels.ops import TopKFormat, topk_decode_add_, topk_encode  # noqa: E402


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(n: int, rounds: int, backend: str) -> dict[str, float]:
    gen = torch.Generator().manual_seed(n)
    delta, e = torch.randn(n, generator=gen), 0.1 * torch.randn(n, generator=gen)
    f = TopKFormat()
    payload = torch.empty(f.payload_bytes(n), dtype=torch.uint8)
    out = torch.zeros(n)
    best = {k: float("inf") for k in ("encode", "encode_ref", "decode", "decode_ref")}
    for _ in range(rounds):  # e drifts from round to round; it stays finite (β < 1, sent values leave it)
        for name, b in (("encode", backend), ("encode_ref", "ref")):
            t = _timed(lambda b=b: topk_encode(delta, e, payload_out=payload, backend=b, check_values=False))
            best[name] = min(best[name], t)
        for name, b in (("decode", backend), ("decode_ref", "ref")):
            best[name] = min(best[name], _timed(lambda b=b: topk_decode_add_(out, payload, backend=b)))
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16M,64M")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    backend = _dispatch.resolve(None, torch.device("cpu"), "lc_topk_encode")
    if backend == "ref":
        sys.exit("the native library is not loaded: nothing to compare with the reference")
    print(f"backend {backend}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    print("| size | encode G values/s | ref | ratio | decode + add G values/s | ref | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for text in args.sizes.split(","):
        n = parse_size(text)
        b = measure(n, args.rounds, backend)
        print(
            f"| {text} | {n / b['encode'] / 1e9:.3f} | {n / b['encode_ref'] / 1e9:.4f} | "
            f"{b['encode_ref'] / b['encode']:.1f}× | {n / b['decode'] / 1e9:.2f} | "
            f"{n / b['decode_ref'] / 1e9:.3f} | {b['decode_ref'] / b['decode']:.1f}× |",
            flush=True,
        )


if __name__ == "__main__":
    main()
