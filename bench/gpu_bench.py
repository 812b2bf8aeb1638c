"""Check, then time, every op on a GPU per backend against a device copy of the same bytes.

    python bench/gpu_bench.py [--sizes 64M] [--check-n 10007] [--backends triton,cuda] [--compile]
                              [--budget-s 80] [--out-md PATH] [--out-json PATH]

Run by bench/gpu_check.sh. The workloads (buffers, bytes counted once, ref / fused callables) are
those of the CPU suite (workloads.py). Before anything is timed, every (workload, fused backend) is
run once at ``--check-n`` elements on fresh buffers next to the ref on identical buffers, and its
outputs (returned tensors and the buffers it updates in place) must match the ref's: a fast wrong
kernel is a failure, not a row (fp32 within 1e-5, bf16 within one bf16 ulp, integers exact).
Rows per (workload, size): ``copy_`` (torch ``dst.copy_(src)`` on the device moving the op's byte
count, half read and half written: on a GPU this is a plain device-to-device copy at the memory
roofline), ``ref`` (eager ``*_ref``), optionally
``compile`` (torch.compile(ref), ``--compile``: inductor takes minutes to compile ten workloads),
and one row per fused backend that implements the op (``triton``, ``cuda``).

Timing: CUDA events around each call, best of N. Before each call the L2 cache is flushed (a
256 MB write) and the stream is kept busy with ``torch.cuda._sleep`` so that the host-side cost of
launching (argument checks, ctypes, ~10-30 µs) overlaps the sleep instead of being timed: the
figure is the device time of the op. An op that synchronises with the host inside (the normalized
Taylor merge reads two sums) pays that sync, as it would in use. Target (docs/design.md): >= 85% of
the device copy bandwidth for pack and outer_merge at >= 16M elements (a measurement: reported, not
gating). Rows not started within ``--budget-s`` are left out and the report says so.
``--device cpu`` checks and times the CPU backends with perf_counter instead (tests this script).
Exit status 1 when a result check failed or a fused backend raised.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402

from lowcomm_kernels import _dispatch  # noqa: E402

HERE = Path(__file__).resolve().parent
GPU_SIZES = "64M"
# preallocated outputs: only the fused call writes them (its returned values are compared instead)
OUTPUT_KEYS = {"delta", "snap", "out", "codes_out", "scales_out"}
TARGET_PCT, TARGET_MIN_N = 85.0, 16 << 20
BUDGET_S, MIN_REPS, MAX_REPS = 0.25, 5, 100
SLEEP_CYCLES = 200_000  # ~0.1 ms at 2 GHz: longer than the host needs to enqueue one op
FLUSH_BYTES = 256 << 20


class Timer:
    """Best-of-N seconds of one call: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, dev: torch.device, max_reps: int = MAX_REPS) -> None:
        self.dev, self.max_reps = dev, max_reps
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev) if dev.type == "cuda" else None

    def once(self, fn: Callable[[], object]) -> float:
        if self.dev.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        assert self.flush is not None
        self.flush.zero_()
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def best(self, fn: Callable[[], object]) -> tuple[float, int]:
        for _ in range(2):  # JIT compilation, caches, first-touch
            fn()
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        one = self.once(fn)
        reps = int(min(self.max_reps, max(min(MIN_REPS, self.max_reps), BUDGET_S / max(one, 1e-7))))
        return min([one] + [self.once(fn) for _ in range(reps - 1)]), reps


def fused_backends(w: workloads.Workload, dev: torch.device, wanted: list[str] | None) -> list[str]:
    names = wanted or ["triton", "cuda", "cpu"]
    return [b for b in names if _dispatch.available(b, dev, w.entry)]


def time_copy(op_bytes: int, dev: torch.device, timer: Timer) -> dict:
    """Device copy_ moving op_bytes (half read, half written); its buffers die on return, before
    the op's own buffers are allocated (at 256M elements they are GBs each)."""
    src, dst = workloads.copy_buffers(op_bytes, dev)
    t, reps = timer.best(lambda: dst.copy_(src))
    return dict(bytes=2 * src.numel(), time=t, reps=reps)


def measure_one(w: workloads.Workload, n: int, dev: torch.device, timer: Timer, wanted: list[str] | None,
                compiled: dict[tuple[str, int | None], Callable] | None) -> list[dict]:
    """The rows of one (workload, size): copy_, ref, [compile,] then each fused backend."""
    base = dict(workload=w.name, op=w.op, n=n, size=workloads.size_label(n), bytes=w.nbytes(n))
    rows = [dict(base, impl="copy_", **time_copy(w.nbytes(n), dev, timer))]
    b = w.setup(n, dev)
    impls: list[tuple[str, Callable[[], object]]] = [("ref", lambda: w.ref(b))]
    if compiled is not None:
        key = (w.name, None if w.compile_dynamic else n)
        fn = compiled.setdefault(key, torch.compile(w.compile_target, dynamic=w.compile_dynamic))
        args = w.compile_args(b)
        impls.append(("compile", lambda: fn(**args)))
    for backend in fused_backends(w, dev, wanted):
        impls.append((backend, lambda backend=backend: w.fused(b, backend)))
    for impl, call in impls:
        try:
            t, reps = timer.best(call)
            rows.append(dict(base, impl=impl, time=t, reps=reps))
        except Exception as exc:  # record it: a backend that cannot run is a finding
            rows.append(dict(base, impl=impl, error=f"{type(exc).__name__}: {exc}"[:300]))
        print(f"{w.name:30s} {workloads.size_label(n):>5s} {impl:8s} "
              f"{rows[-1].get('time', float('nan')) * 1e3:9.3f} ms", flush=True)
    return rows


def same(name: str, got: object, want: object) -> None:
    """got matches want (tensors, or tuples of them): see the module docstring for the tolerances."""
    gs = list(got) if isinstance(got, (tuple, list)) else [got]
    ws = list(want) if isinstance(want, (tuple, list)) else [want]
    if len(gs) != len(ws):
        raise AssertionError(f"{name}: {len(gs)} outputs, the ref has {len(ws)}")
    for i, (g, w) in enumerate(zip(gs, ws, strict=True)):
        if not isinstance(w, torch.Tensor):
            continue
        tol = {torch.bfloat16: 2.0**-7, torch.float32: 1e-5, torch.float64: 1e-12}.get(w.dtype, 0.0)
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, equal_nan=True,
                                   msg=lambda m, i=i: f"{name}[{i}]: {m}")


def check_results(dev: torch.device, n: int, wanted: list[str] | None) -> list[dict]:
    """Each (workload, fused backend) once at n elements against the ref on identical buffers."""
    rows = []
    for w in workloads.WORKLOADS:
        for backend in fused_backends(w, dev, wanted):
            row = dict(workload=w.name, op=w.op, n=n, impl=backend)
            try:
                a, b = w.setup(n, dev), w.setup(n, dev)  # seeded by n: identical
                want, got = w.ref(a), w.fused(b, backend)
                if want is not None and got is not None:
                    same("returned", got, want)
                for k in sorted(set(a) - OUTPUT_KEYS):
                    same(f"buffer {k}", b[k], a[k])
                row["check"] = "pass"
            except Exception as exc:  # a mismatch or a crash: the backend is wrong here
                row["check"] = f"FAIL: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                print(f"gpu_bench: {w.name} {backend} n={n}: {row['check']}", flush=True)
            rows.append(row)
    return rows


def measure(dev: torch.device, sizes: list[int], wanted: list[str] | None, compile_ref: bool,
            deadline: float = float("inf"), max_reps: int = MAX_REPS) -> list[dict]:
    timer = Timer(dev, max_reps)
    compiled: dict[tuple[str, int | None], Callable] | None = {} if compile_ref else None
    rows: list[dict] = []
    for w in workloads.WORKLOADS:
        for n in sizes:
            if time.perf_counter() > deadline:
                rows.append(dict(workload=w.name, op=w.op, n=n, size=workloads.size_label(n), impl="—",
                                 error="not timed: time budget"))
                continue
            rows += measure_one(w, n, dev, timer, wanted, compiled)
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    derive(rows)
    return rows


def derive(rows: list[dict]) -> None:
    groups: dict[tuple[str, int], dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["n"]), {})[r["impl"]] = r
    for g in groups.values():
        copy, ref = g.get("copy_"), g.get("ref")
        for r in g.values():
            if "time" not in r:
                continue
            r["gbps"] = r["bytes"] / r["time"] / 1e9
            r["pct_copy"] = 100 * r["gbps"] / copy["gbps"] if copy and "gbps" in copy else None
            r["vs_ref"] = ref["time"] / r["time"] if ref and "time" in ref else None


def fmt_time(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} µs"


def device_info(dev: torch.device) -> list[str]:
    if dev.type != "cuda":
        return [f"- Device: CPU (`--device cpu`: a test of this script, not a GPU measurement), "
                f"{torch.get_num_threads()} threads"]
    p = torch.cuda.get_device_properties(dev)
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = "not importable"
    return [f"- Device: {p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB, "
            f"{p.multi_processor_count} SMs",
            f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton {tv}"]


def render_md(rows: list[dict], checks: list[dict], dev: torch.device, command: str) -> str:
    lines = [f"Bandwidth run of {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, `{command}` "
             "(via `bash bench/gpu_check.sh`).", ""] + device_info(dev) + [""]
    bad = [c for c in checks if c["check"] != "pass"]
    lines += [f"Result check at n = {checks[0]['n'] if checks else '—'}: {len(checks) - len(bad)} of "
              f"{len(checks)} (workload, backend) pairs match the ref."] + [
        f"- {c['workload']} {c['impl']}: {c['check']}" for c in bad] + [""]
    fused = [r for r in rows if r["impl"] not in ("copy_", "ref", "compile") and "gbps" in r]
    target = [r for r in fused if r["op"] in ("pack", "outer_merge_") and r["n"] >= TARGET_MIN_N
              and "normalized" not in r["workload"]]
    if target:
        lines += [f"Target: ≥ {TARGET_PCT:.0f}% of the device copy bandwidth (pack, outer_merge_, ≥ 16M).",
                  "",
                  "| workload | size | backend | time | GB/s | % of copy_ | vs ref | verdict |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in target:
            ok = r["pct_copy"] is not None and r["pct_copy"] >= TARGET_PCT
            lines.append(f"| {r['workload']} | {r['size']} | {r['impl']} | {fmt_time(r['time'])} | "
                         f"{r['gbps']:.0f} | {r['pct_copy']:.0f}% | {r['vs_ref']:.1f}x | "
                         f"{'PASS' if ok else 'MISS'} |")
        lines.append("")
    lines += ["Per op: time = best of N (CUDA events, L2 flushed, launch overhead hidden); GB/s from the "
              "bytes the op must move, each buffer counted once; % of the device `copy_` of the same "
              "bytes.", "",
              "| workload | size | impl | time | GB/s | % of copy_ | vs ref | N |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r and "time" not in r:
            lines.append(f"| {r['workload']} | {r['size']} | {r['impl']} | error: {r['error'][:120]} "
                         "| | | | |")
            continue
        pct = f"{r['pct_copy']:.0f}%" if r.get("pct_copy") is not None else "—"
        vs = f"{r['vs_ref']:.1f}x" if r.get("vs_ref") is not None and r["impl"] != "copy_" else "—"
        lines.append(f"| {r['workload']} | {r['size']} | {r['impl']} | {fmt_time(r['time'])} | "
                     f"{r['gbps']:.1f} | {pct} | {vs} | {r['reps']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default=None, help=f"default {GPU_SIZES} on a GPU, 64K on a CPU")
    ap.add_argument("--check-n", type=int, default=10007, help="size of the result check (odd on purpose)")
    ap.add_argument("--backends", default=None,
                    help="comma-separated fused backends (default: all available)")
    ap.add_argument("--compile", action="store_true", help="add torch.compile(ref) rows (slow to compile)")
    ap.add_argument("--max-reps", type=int, default=MAX_REPS, help="at most this many timed calls per row")
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="time no row after this many seconds")
    ap.add_argument("--out-md", type=Path, default=HERE / "results" / "gpu_bench.md")
    ap.add_argument("--out-json", type=Path, default=HERE / "results" / "gpu_bench.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_bench: no GPU (torch {torch.__version__} sees no CUDA device): nothing timed")
        return 0
    size_text = args.sizes or (GPU_SIZES if dev.type == "cuda" else "64K")
    sizes = [workloads.parse_size(s) for s in size_text.split(",")]
    wanted = args.backends.split(",") if args.backends else None
    command = "python bench/gpu_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    checks = check_results(dev, args.check_n, wanted)
    rows = measure(dev, sizes, wanted, args.compile, t0 + args.budget_s, args.max_reps)
    md = render_md(rows, checks, dev, command.strip())
    failed = [c for c in checks if c["check"] != "pass"]
    errors = [r for r in rows if "error" in r and r["impl"] not in ("ref", "compile", "—")]
    raw = json.dumps(dict(command=command, checks=checks, rows=rows, failed_checks=len(failed),
                          errors=len(errors), untimed=sum(r["impl"] == "—" for r in rows)), indent=1)
    for path, text in ((args.out_md, md), (args.out_json, raw)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(md)
    print(f"gpu_bench: {len(checks) - len(failed)}/{len(checks)} result checks pass; wrote {args.out_md} "
          f"and {args.out_json} ({time.perf_counter() - t0:.1f} s)")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
