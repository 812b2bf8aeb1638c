"""GPU correctness check: every fused backend on a device against the ``*_ref`` specification.

    python bench/gpu_correctness.py [--device cuda] [--backends triton,cuda] [--json PATH]

Run by bench/gpu_check.sh on a machine with an NVIDIA GPU (the pytest suite in tests/ runs on the
CPU; this is its GPU counterpart, kept in bench/ so that one script does the whole GPU check).
For each backend (default: every non-ref backend available on the device), each op, sizes
0, 1, 7, 4097 and 1000003, fp32 data with fp32 and bf16 wire/average dtypes, and fp64 data:

* pack: delta and snapshot bit-identical to ``pack_ref`` in the same dtype (one rounding of g − x,
  to fp32 or bf16, is deterministic), non-finite count exact (a NaN and an inf are planted);
* outer_merge_: g, u, x against the float64 ref for overwrite / mix / delay-corrected / Taylor /
  normalized-Taylor merges, with and without (Nesterov) momentum;
* mask_indices: equal to the ref computed on the CPU (the same on every device);
* sparse_gather: exact; sparse_scatter_merge_: against the float64 ref;
* fragment_norms: ord 1 and 2, empty segments included, against the float64 ref, and bit-identical
  from call to call.

Tolerances are those of tests/conftest.py (derived there from the maths): elementwise
rtol = atol = 8·eps of the dtype; reductions rtol = eps + 8·√n·eps_fp64. Exit status 1 when any
check fails, 0 when all pass, 0 with a "no GPU" message when the device is a GPU that is absent.
``--device cpu`` runs the same checks on the CPU backends (and, under TRITON_INTERPRET=1, Triton
in fp32: the interpreter's bf16 arithmetic is wrong, docs/design.md), which is how this script is
tested on machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from lowcomm_kernels import _dispatch
from lowcomm_kernels.ops import (
    fragment_norms,
    fragment_norms_ref,
    mask_indices,
    mask_indices_ref,
    outer_merge_,
    outer_merge_ref,
    pack,
    pack_ref,
    sparse_gather,
    sparse_gather_ref,
    sparse_scatter_merge_,
    sparse_scatter_merge_ref,
)

SIZES = (0, 1, 7, 4097, 1000003)
EPS64 = torch.finfo(torch.float64).eps
MERGES = {  # name -> outer_merge_ keywords
    "overwrite": dict(lr=0.7, momentum=0.0, nesterov=False),
    "mix+nesterov": dict(lr=0.7, momentum=0.9, nesterov=True, alpha=0.3),
    "delay-corrected": dict(lr=0.7, momentum=0.9, nesterov=False, beta=1.0),
    "taylor": dict(lr=0.7, momentum=0.9, nesterov=True, alpha=0.2, beta=1.0, lam=0.5),
    "taylor-normalized": dict(lr=0.7, momentum=0.9, nesterov=True, beta=1.0, lam=0.5, lam_mode="normalized"),
}


class CheckFailed(AssertionError):
    pass


def elementwise_close(name: str, actual: torch.Tensor, expected64: torch.Tensor, scale: float = 1.0) -> None:
    """|actual − expected| <= 8·eps·(scale + |expected|) in actual's dtype (tests/conftest.py)."""
    eps = torch.finfo(actual.dtype).eps
    try:
        torch.testing.assert_close(actual.cpu(), expected64.to(actual.dtype).cpu(), rtol=8 * eps,
                                   atol=8 * eps * scale, equal_nan=True)
    except AssertionError as exc:
        raise CheckFailed(f"{name}: {' '.join(str(exc).split()[:45])}") from None


def reduction_close(name: str, actual: torch.Tensor, expected64: torch.Tensor, n: int) -> None:
    rtol = torch.finfo(actual.dtype).eps + 8 * math.sqrt(max(n, 1)) * EPS64
    try:
        torch.testing.assert_close(actual.cpu(), expected64.to(actual.dtype).cpu(), rtol=rtol, atol=0.0)
    except AssertionError as exc:
        raise CheckFailed(f"{name}: {' '.join(str(exc).split()[:40])}") from None


def identical(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    a, e = actual.cpu(), expected.cpu()
    if a.dtype != e.dtype or a.shape != e.shape:
        raise CheckFailed(f"{name}: dtype/shape {a.dtype}{tuple(a.shape)} != {e.dtype}{tuple(e.shape)}")
    same = (a == e) | (a.isnan() & e.isnan()) if a.is_floating_point() else (a == e)
    if not bool(same.all()):
        bad = (~same).nonzero()[0].item()
        raise CheckFailed(f"{name}: {int((~same).sum())} of {a.numel()} differ, first at {bad}: "
                          f"{a.reshape(-1)[bad].item()!r} != {e.reshape(-1)[bad].item()!r}")


def rand(n: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator,
         scale: float = 1.0) -> torch.Tensor:
    return (torch.rand(n, dtype=torch.float64, generator=gen) * 2 - 1).mul_(scale).to(dtype).to(device)


# ------------------------------------------------------------------------------------- checks
def check_pack(backend: str, n: int, dtype: torch.dtype, wire: torch.dtype, dev: torch.device,
               gen: torch.Generator) -> None:
    g, x = rand(n, dtype, dev, gen), rand(n, dtype, dev, gen)
    if n >= 2:  # plant one NaN and one inf: the count must see both
        g[0], x[n - 1] = float("nan"), float("inf")
    d_ref, s_ref, nf_ref = pack_ref(g, x, wire_dtype=wire)
    delta, snap, nonfinite = pack(g, x, wire_dtype=wire, backend=backend)
    identical("delta", delta, d_ref)
    identical("snapshot", snap, s_ref)
    identical("nonfinite", nonfinite, nf_ref)
    delta2, snap2, _ = pack(g, x, wire_dtype=wire, snapshot_out=False, backend=backend)
    identical("delta (no snapshot)", delta2, d_ref)
    if snap2 is not None:
        raise CheckFailed("snapshot_out=False returned a snapshot")


def check_outer_merge(backend: str, n: int, dtype: torch.dtype, avg: torch.dtype, dev: torch.device,
                      gen: torch.Generator) -> None:
    for mode, kw in MERGES.items():
        g, u = rand(n, dtype, dev, gen), rand(n, dtype, dev, gen, 0.1)
        d = rand(n, dtype, dev, gen, 0.1).to(avg)
        x_sent = g + rand(n, dtype, dev, gen, 0.05)
        x = x_sent + rand(n, dtype, dev, gen, 0.05)
        ref = [t.double() for t in (g, u, d, x, x_sent)]
        outer_merge_ref(*ref, **kw)
        outer_merge_(g, u, d, x, x_sent, backend=backend, **kw)
        for name, got, want in zip("gux", (g, u, x), (ref[0], ref[1], ref[3]), strict=True):
            elementwise_close(f"{mode}: {name}", got, want)


def check_mask(backend: str, n: int, dev: torch.device) -> None:
    for k in sorted({0, min(n, 1), n // 3, n // 100, n}):
        for seed, rnd in ((0, 0), (1234, 7)):
            got = mask_indices(seed, rnd, n, k, device=dev, backend=backend)
            identical(f"k={k} seed={seed} round={rnd}", got, mask_indices_ref(seed, rnd, n, k, device="cpu"))


def check_sparse(backend: str, n: int, dtype: torch.dtype, avg: torch.dtype, dev: torch.device,
                 gen: torch.Generator) -> None:
    if n == 0:
        return  # no index exists in [0, 0)
    k = max(1, n // 10)
    idx = mask_indices_ref(5, 3, n, k, device="cpu").to(dev)
    x = rand(n, dtype, dev, gen)
    identical("gather", sparse_gather(x, idx, backend=backend), sparse_gather_ref(x, idx))
    dup = torch.cat([idx, idx[:3]])  # gather allows duplicates
    identical("gather (duplicates)", sparse_gather(x, dup, backend=backend), sparse_gather_ref(x, dup))
    for beta in (0.0, 1.0, 0.5):
        a, sent = rand(k, dtype, dev, gen, 0.1).to(avg), rand(k, dtype, dev, gen, 0.1)
        x_ref = x.double()
        sparse_scatter_merge_ref(x_ref, idx, a.double(), sent.double(), beta=beta)
        sparse_scatter_merge_(x, idx, a, sent, beta=beta, backend=backend)
        elementwise_close(f"scatter_merge beta={beta}", x, x_ref)


def check_norms(backend: str, n: int, dtype: torch.dtype, dev: torch.device, gen: torch.Generator) -> None:
    buf = rand(n, dtype, dev, gen)
    cuts = sorted(torch.randint(0, n + 1, (6,), generator=gen).tolist())
    offsets = torch.tensor([0, 0, *cuts, n, n], dtype=torch.int64, device=dev)  # empty first/last segments
    for ord_ in (1, 2):
        got = fragment_norms(buf, offsets, ord=ord_, backend=backend)
        reduction_close(f"ord={ord_}", got, fragment_norms_ref(buf.double(), offsets, ord=ord_), n)
        identical(f"ord={ord_} repeat", fragment_norms(buf, offsets, ord=ord_, backend=backend), got)


# ------------------------------------------------------------------------------------- driver
def plan(backend: str, dev: torch.device, sizes: tuple[int, ...], gen: torch.Generator,
         bf16_ok: bool) -> list[tuple[str, str, Callable[[], None] | None, str]]:
    """(op, case, thunk or None when skipped, skip reason)."""
    f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16
    dtypes = [(f32, f32, "fp32"), (f32, bf16, "fp32/bf16"), (f64, f64, "fp64")]
    out: list[tuple[str, str, Callable[[], None] | None, str]] = []
    for n in sizes:
        for dt, low, label in dtypes:
            skip = "" if (low is not bf16 or bf16_ok) else "bf16 is wrong in the Triton interpreter"
            case = f"n={n} {label}"
            out.append(("pack", case, None if skip else
                        (lambda n=n, dt=dt, low=low: check_pack(backend, n, dt, low, dev, gen)), skip))
            out.append(("outer_merge_", case, None if skip else
                        (lambda n=n, dt=dt, low=low: check_outer_merge(backend, n, dt, low, dev, gen)), skip))
            out.append(("sparse", case, None if skip else
                        (lambda n=n, dt=dt, low=low: check_sparse(backend, n, dt, low, dev, gen)), skip))
            if low is dt:
                out.append(("fragment_norms", case,
                            lambda n=n, dt=dt: check_norms(backend, n, dt, dev, gen), ""))
        out.append(("mask_indices", f"n={n}", lambda n=n: check_mask(backend, n, dev), ""))
    return out


def default_backends(dev: torch.device) -> list[str]:
    return [b for b in _dispatch.available_backends(dev) if b != "ref"]


def run(dev: torch.device, backends: list[str], sizes: tuple[int, ...], seed: int) -> list[dict]:
    results = []
    for backend in backends:
        bf16_ok = not (backend == "triton" and dev.type != "cuda")
        gen = torch.Generator().manual_seed(seed)
        for op, case, thunk, skip in plan(backend, dev, sizes, gen, bf16_ok):
            t0 = time.perf_counter()
            if thunk is None:
                status, detail = "skip", skip
            else:
                try:
                    thunk()
                    status, detail = "pass", ""
                except CheckFailed as exc:
                    status, detail = "FAIL", str(exc)
                except Exception as exc:  # a crash is a failure too, with its traceback's last line
                    where = traceback.format_exc().splitlines()[-3].strip()
                    status, detail = "FAIL", f"{type(exc).__name__}: {exc} @ {where}"
            results.append(dict(backend=backend, op=op, case=case, status=status, detail=detail[:600],
                                seconds=round(time.perf_counter() - t0, 3)))
            if status == "FAIL":
                print(f"FAIL {backend:6s} {op:15s} {case}: {detail[:300]}", flush=True)
    return results


def summary_md(results: list[dict], dev_name: str) -> str:
    lines = [f"Correctness on {dev_name} (`bench/gpu_correctness.py`): each backend against the `*_ref` "
             "specification, sizes 0/1/7/4097/1000003, fp32 (fp32 and bf16 wire/average) and fp64.", "",
             "| backend | op | pass | fail | skip |", "| --- | --- | --- | --- | --- |"]
    keys = sorted({(r["backend"], r["op"]) for r in results})
    for b, op in keys:
        rs = [r for r in results if (r["backend"], r["op"]) == (b, op)]
        count = {s: sum(r["status"] == s for r in rs) for s in ("pass", "FAIL", "skip")}
        lines.append(f"| {b} | {op} | {count['pass']} | {count['FAIL']} | {count['skip']} |")
    fails = [r for r in results if r["status"] == "FAIL"]
    if fails:
        lines += ["", "Failures:", ""]
        lines += [f"- {r['backend']} {r['op']} {r['case']}: {r['detail'][:300]}" for r in fails]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda",
                    help="cuda (default) or cpu (tests this script without a GPU)")
    ap.add_argument("--backends", default=None,
                    help="comma-separated (default: every non-ref backend available)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated element counts")
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument("--json", type=Path, default=None, help="write the per-check results here")
    ap.add_argument("--md", type=Path, default=None, help="write a markdown summary here")
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_correctness: no GPU (torch {torch.__version__} sees no CUDA device): nothing checked")
        return 0
    backends = args.backends.split(",") if args.backends else default_backends(dev)
    for b in backends:
        if not _dispatch.available(b, dev):
            print(f"gpu_correctness: backend {b!r} is not available on {dev}", file=sys.stderr)
            return 2
    if not backends:
        print(f"gpu_correctness: no fused backend available on {dev}", file=sys.stderr)
        return 2
    sizes = tuple(int(s) for s in args.sizes.split(","))
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({dev})"
    print(f"gpu_correctness: {dev_name}, backends {backends}, sizes {sizes}", flush=True)
    t0 = time.perf_counter()
    results = run(dev, backends, sizes, args.seed)
    fails = sum(r["status"] == "FAIL" for r in results)
    md = summary_md(results, dev_name)
    print(md)
    print(f"gpu_correctness: {len(results)} checks, {fails} failed, {time.perf_counter() - t0:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(device=dev_name, backends=backends, results=results), indent=1))
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(md)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
