"""Render bench/RESULTS.md (and bench/ops_bandwidth.png) from the benchmark JSON.

    .venv/bin/python bench/render_results.py [--ops bench/figures/ops.json] [--out bench/RESULTS.md]
    .venv/bin/python bench/render_results.py --ops full.json --ops quantized.json   # several runs

The default JSON, bench/figures/ops.json, is committed beside RESULTS.md (written by
``pytest bench/bench_ops.py --benchmark-json bench/figures/ops.json``, statistics only), so every
verdict can be recomputed from the tree.

With several --ops files, each (workload, size) comes whole from the last file that measured it
(its rows are never mixed across runs, so every ratio stays within one run), and the machine
section lists every run with its command and load.

Per op and size: best-of-N time, GB/s from the bytes the op must move (each buffer counted once),
% of the memcpy row of the same bytes measured in the same run, speed-up over eager ref and over
torch.compile(ref), and, for pack and outer_merge at >= 16M elements, a verdict against the targets
(>= 80% of memcpy, >= 3x eager ref, not slower than torch.compile(ref); docs/design.md). The
verdict is taken on medians, not bests: the % of memcpy and the speed-up over compile on the
median over interleaved rounds of the same round's time ratio, the speed-up over eager ref on the
ratio of the two rows' medians (see ``headline``). Ops with no memcpy target (selection- or
compute-bound: the sparse rows, mask_indices, the top-k codec) get no verdict, and say so.

Two sections come from other scripts. The overlap section is what ``bench/bench_overlap.py --render``
prints from its committed bench/figures/overlap.json (the tables docs/results.md shows, with their
source line). The GPU section is bench/results/gpu.md (gpu_check.sh), included verbatim when present:
bench/results/ is not committed, so when that file is absent the section already in RESULTS.md is
kept as it was.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OPS = HERE / "figures" / "ops.json"  # committed: the raw figures RESULTS.md is rendered from
TARGET_MIN_N = 16 << 20
TARGET_PCT, TARGET_VS_REF, TARGET_VS_COMPILE = 80.0, 3.0, 1.0
YMAX_PCT = 160.0
# compute- / selection-bound ops: a % of memcpy near zero on the chart would say nothing about them
NOT_CHARTED = ("mask_indices", "topk_encode", "topk_decode_add_")
IMPL_LABEL = {"memcpy_nt": "memcpy (nt stores)", "torch_copy": "torch copy_", "ref": "ref (eager)",
              "compile": "torch.compile(ref)", "fused": "fused"}
INCLUDES = {  # marker -> (file, what to say while it has never been measured)
    "overlap": ("overlap.md", "Not measured yet: `bench/bench_overlap.py` writes "
                              "bench/figures/overlap.json."),
    "gpu": ("gpu.md", "Not measured yet: no GPU was available where this was rendered. Run "
                      "`bash bench/gpu_check.sh` on a machine with an NVIDIA GPU (it builds the CUDA "
                      "library, checks Triton and CUDA against the ref, times every op against a device "
                      "copy and writes bench/results/gpu.md), then re-render."),
}


READING = [
    "## How to read the rows", "",
    "- **ref (eager)** is the `*_ref` function exactly as written: pack and sparse_gather allocate their "
    "outputs on every call, and an allocation above glibc's mmap threshold (32 MB at most) comes back "
    "as fresh pages that are faulted in and zeroed on first touch, which is part of what eager code pays. "
    "**torch.compile(ref)** and **fused** write into preallocated outputs "
    "(inductor stores straight into them), so the comparison with compile is kernel against kernel.",
    "- **outer_merge/normalized** needs a read-only reduction pass (5 reads) before the fused pass; bytes "
    "are still counted once (32 B/element), so its ceiling is 32/52 = 62% of memcpy. No target applies.",
    "- **sparse rows** move k = density·n elements at random addresses: a 4-byte read costs a 64-byte "
    "line, so GB/s of useful bytes is far below memcpy by construction. **mask_indices** is hash + sort "
    "(compute-bound); its GB/s counts only the k int64 written. No target applies to either.",
    "- **topk_encode / topk_decode_add_** (the top-k sparse codec) are selection-bound, not bandwidth "
    "ops: encode selects every chunk's k largest |e| (then quantizes, packs and subtracts what was sent), "
    "decode scatters k values per chunk at data-dependent addresses. Their GB/s counts the bytes listed "
    "in each op's note (encode: Δ, e read and written, the payload; decode: the payload and the touched "
    "values only), so % of memcpy is context, not a target: no verdict. Read their speed-up over ref "
    "and torch.compile(ref).",
    "- **Scheduler ticks**: every parallel region (torch, inductor and the native library share one "
    "libgomp) waits for its second thread; on this 2-vCPU VM a worker that is asleep or was "
    "descheduled by another engineer's process costs a scheduler tick (~4 ms). `OMP_WAIT_POLICY=ACTIVE` "
    "(see the command) keeps workers spinning and removes most of these; rows of a few MB that still "
    "read ~4 ms with an absurdly low GB/s (even memcpy rows) are such ticks in every round, i.e. "
    "neighbours' load, not kernel time. They do not affect the ≥ 16M target rows (tens of ms).",
    "- At **1M** elements the buffers (4 MB each) partly live in cache, so % of memcpy can pass 100%; the "
    "targets are defined at ≥ 16M, where every row streams from DRAM.",
    "",
]


def size_label(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def fmt_time(s: float) -> str:
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


Rows = dict[tuple[str, int], dict[str, dict]]


def load_rows(path: Path) -> tuple[dict, Rows, dict[tuple[str, int], dict]]:
    """(the JSON, {(workload, n): {impl: {time, gbps, bytes, backend, rounds}}},
    {(workload, n): the interleaved measurement's extra_info})."""
    data = json.loads(path.read_text())
    rows: dict[tuple[str, int], dict[str, dict]] = {}
    inter: dict[tuple[str, int], dict] = {}
    for b in data["benchmarks"]:
        info = b.get("extra_info") or {}
        if "workload" not in info or b.get("stats") is None:
            continue
        if info.get("impl") == "interleaved":
            inter[(info["workload"], int(info["n"]))] = info
            continue
        t = float(b["stats"]["min"])
        rows.setdefault((info["workload"], int(info["n"])), {})[info["impl"]] = dict(
            time=t, median=float(b["stats"].get("median", t)), bytes=int(info["bytes"]),
            gbps=info["bytes"] / t / 1e9, backend=info.get("backend"), rounds=int(b["stats"]["rounds"]))
    return data, rows, inter


Key = tuple[str, int]


def load_runs(paths: list[Path]) -> tuple[dict, Rows, dict[Key, dict], dict[Key, str]]:
    """load_rows over several runs: (the first run's JSON with every run's workloads and notes, the
    rows, the interleaved measurements, {(workload, n): the command of the run its rows come from}).
    A (workload, size) measured by several runs is taken whole from the last one."""
    merged: dict = {}
    rows: Rows = {}
    inter: dict[tuple[str, int], dict] = {}
    commands: dict[tuple[str, int], str] = {}
    for path in paths:
        data, r, i = load_rows(path)
        lc = data.get("lowcomm", {})
        if not merged:
            merged = dict(data, lowcomm=dict(lc, workloads=dict(lc.get("workloads", {})),
                                             notes=list(lc.get("notes", []))))
        else:
            for name, meta in lc.get("workloads", {}).items():
                merged["lowcomm"]["workloads"].setdefault(name, meta)
            merged["lowcomm"]["notes"] += lc.get("notes", [])
        for key in set(r) | set(i):
            rows.pop(key, None)
            inter.pop(key, None)
            commands[key] = lc.get("command", "?")
        rows.update(r)
        inter.update(i)
    return merged, rows, inter, commands


def derive(rows: dict[str, dict]) -> dict[str, object]:
    """Adds pct (of the memcpy row), vs_ref, vs_compile to each op row; returns the baseline used."""
    base = rows.get("memcpy_nt") or rows.get("torch_copy")
    base_name = "memcpy_nt" if "memcpy_nt" in rows else ("torch_copy" if base else None)
    for r in rows.values():
        r["pct"] = 100.0 * r["gbps"] / base["gbps"] if base else None
        r["vs_ref"] = rows["ref"]["time"] / r["time"] if "ref" in rows else None
        r["vs_compile"] = rows["compile"]["time"] / r["time"] if "compile" in rows else None
    return {"name": base_name, "row": base}


def verdict(r: dict, target_pct: float = TARGET_PCT) -> tuple[str, list[str]]:
    checks = [("% of memcpy", r.get("pct"), target_pct, "{:.0f}% (≥ " + f"{target_pct:.0f}%)"),
              ("vs ref", r.get("vs_ref"), TARGET_VS_REF, "{:.1f}x ref (≥ 3x)"),
              ("vs compile", r.get("vs_compile"), TARGET_VS_COMPILE, "{:.2f}x compile (≥ 1x)")]
    parts, ok = [], True
    for _, value, floor, fmt in checks:
        if value is None:
            parts.append("n/a")
            ok = False
            continue
        hit = value >= floor
        ok &= hit
        parts.append(("✅ " if hit else "❌ ") + _shown_apart(fmt, value, floor))
    return ("PASS" if ok else "MISS"), parts


def _shown_apart(fmt: str, value: float, floor: float) -> str:
    """``fmt`` of ``value`` with as many more decimals (up to 3) as it takes not to print a value just
    under the floor as the floor itself ("❌ 90% (≥ 90%)" for 89.6 %)."""
    digits = int(re.search(r"\{:\.(\d)f\}", fmt)[1])
    for extra in range(4):
        finer = fmt.replace("{:." + str(digits) + "f}", "{:." + str(digits + extra) + "f}", 1)
        if value >= floor or finer.format(value) != finer.format(floor):
            break
    return finer.format(value)


def pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}%"


def ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def machine_section(runs: list[tuple[dict, Path]]) -> list[str]:
    """The machine (from the first run) and, per run, its time, load, versions and command."""
    shown = lambda p: p.relative_to(HERE.parent) if p.is_relative_to(HERE.parent) else p  # noqa: E731
    three = lambda la: " / ".join(f"{x:.2f}" for x in la)  # noqa: E731
    mi0 = runs[0][0].get("machine_info", {}).get("lowcomm", {})
    out = [
        "## Machine and run" + ("s" if len(runs) > 1 else ""),
        "",
        f"- CPU: {mi0.get('cpu_model', '?')}, {mi0.get('logical_cpus', '?')} logical CPUs "
        f"({mi0.get('cpu_flags', '')}); {mi0.get('threads', '?')} threads (torch and OpenMP)",
        "- The machine is shared with other engineers: absolute figures move with their load, ratios "
        "within one run are the comparable quantity.",
    ]
    for data, path in runs:
        mi = data.get("machine_info", {}).get("lowcomm", {})
        lc = data.get("lowcomm", {})
        v = mi.get("versions", {})
        la0, la1 = mi.get("loadavg_start"), lc.get("loadavg_end")
        load = f"{three(la0)} at start, {three(la1)} at end (1 / 5 / 15 min)" if la0 and la1 else "?"
        out += [
            f"- Run {data.get('datetime', '?')} UTC (`{shown(path)}`): load average {load}; memcpy row: "
            f"{mi.get('memcpy', '?')}; torch {v.get('torch', '?')}, triton {v.get('triton', '?')}, "
            f"python {v.get('python', '?')}, lowcomm_kernels {v.get('lowcomm_kernels', '?')} "
            f"({v.get('native', '?')}), git {v.get('git', '?')}"
            + ("" if "git_dirty_files" not in v else " (clean)" if not v["git_dirty_files"]
               else f" + uncommitted changes in {v['git_dirty_files']} tracked files"),
            f"  - Command: `{lc.get('command', '?')}`",
        ]
    default = [DEFAULT_OPS]
    ops = "" if [p for _, p in runs] == default else "".join(f" --ops {shown(p)}" for _, p in runs)
    return out + [f"- Rendered with `.venv/bin/python bench/render_results.py{ops}`", ""]


# The estimators of the targets table. The verdict's are the column headers' (COLUMN_EST); a cell
# whose JSON lacks the per-round data names the one it fell back to.
BEST, SAME_ROUND, MEDIANS = "best of N", "same-round median", "ratio of medians"
COLUMN_EST = {"pct": SAME_ROUND, "vs_ref": MEDIANS, "vs_compile": SAME_ROUND}


def interleaved_row(info: dict, seq: dict[str, dict]) -> dict:
    """The fused row's figures from an interleaved measurement. Shown, not judged: the bests (time,
    GB/s, memcpy GB/s, pct_best). Judged, with their estimator in ``est``: pct and vs_compile, the
    medians over rounds of the same round's time ratio (memcpy / fused; compile / fused over the
    rounds with compile), from the per-round ratios or else the recorded medians; vs_ref, the eager
    ref's sequential row's median over the fused op's interleaved median (eager ref takes seconds
    per call at these sizes, too slow to interleave). An older JSON without a figure's same-round
    data falls back to the ratio of medians, then to the bests, and ``est`` says which."""
    best, med = info["interleaved"], info.get("interleaved_median", {})
    base = "memcpy_nt" if "memcpy_nt" in best else "torch_copy"
    t = best["fused"]
    gbps, base_gbps = info["bytes"] / t / 1e9, info["memcpy_bytes"] / best[base] / 1e9
    weight = info["bytes"] / info["memcpy_bytes"]  # x (memcpy time / fused time) = fraction of its GB/s
    est: dict[str, str] = {}
    if info.get("paired_ratios"):
        pct, est["pct"] = 100 * statistics.median(info["paired_ratios"]) * weight, SAME_ROUND
    elif info.get("paired_pct_median") is not None:
        pct, est["pct"] = float(info["paired_pct_median"]), SAME_ROUND
    else:
        pct, est["pct"] = 100 * gbps / base_gbps, BEST
    if info.get("paired_compile_ratios"):
        vs_compile, est["vs_compile"] = statistics.median(info["paired_compile_ratios"]), SAME_ROUND
    elif info.get("paired_vs_compile_median") is not None:
        vs_compile, est["vs_compile"] = float(info["paired_vs_compile_median"]), SAME_ROUND
    elif "compile" in med and "fused" in med:
        vs_compile, est["vs_compile"] = med["compile"] / med["fused"], MEDIANS
    else:
        vs_compile, est["vs_compile"] = best["compile"] / t, BEST
    ref, vs_ref = seq.get("ref"), None
    est["vs_ref"] = MEDIANS
    if ref is not None and "fused" in med:
        vs_ref = ref["median"] / med["fused"]
    elif ref is not None:
        vs_ref, est["vs_ref"] = ref["time"] / t, BEST
    return dict(time=t, gbps=gbps, base_gbps=base_gbps, pct_best=100 * gbps / base_gbps, pct=pct,
                vs_compile=vs_compile, vs_ref=vs_ref, est=est, how=interleaved_how(info))


def sequential_row(r: dict[str, dict]) -> dict:
    """The fused row's figures where no interleaved measurement exists: the bests shown, the
    verdict on the ratios of the rows' medians (each row ran on its own: no same-round pairs)."""
    f, base = r["fused"], r.get("memcpy_nt") or r.get("torch_copy")
    med_gbps = lambda x: x["bytes"] / x["median"] / 1e9  # noqa: E731
    return dict(time=f["time"], gbps=f["gbps"], base_gbps=base["gbps"] if base else None,
                pct_best=f.get("pct"), pct=100 * med_gbps(f) / med_gbps(base) if base else None,
                vs_ref=r["ref"]["median"] / f["median"] if "ref" in r else None,
                vs_compile=r["compile"]["median"] / f["median"] if "compile" in r else None,
                est=dict.fromkeys(COLUMN_EST, MEDIANS),
                how="sequential rows (no interleaved measurement): ratios of their medians")


def interleaved_how(info: dict) -> str:
    """The measured column of an interleaved row: its rounds (and those that called compile)."""
    how = f"interleaved, {info['rounds']} rounds"
    if "compile_rounds" in info:
        how += f" ({info['compile_rounds']} with compile)"
    return how


def no_verdict(data: dict, rows: dict, inter: dict) -> list[str]:
    """The workloads of this run that no target applies to, each with its reason."""
    wl = data.get("lowcomm", {}).get("workloads", {})
    measured = {name for name, _ in set(rows) | set(inter)}
    names = [name for name, meta in wl.items() if not meta.get("target") and name in measured]
    if not names:
        return []
    return ["No verdict, no memcpy target (the per-op tables below, and *How to read the rows*):", ""] + [
        f"- {name}: {wl[name].get('no_target') or 'no target defined'}" for name in names] + [""]


def headline(data: dict, rows: dict, inter: dict) -> list[str]:
    out = ["## Targets: pack and outer_merge_ at ≥ 16M fp32 elements, fused CPU backend", "",
           "The quantized wire formats (pack_quantized, outer_merge/…-avg) are held to ≥ 90% of the "
           "memcpy, the others to ≥ 80%.", "",
           "Measured interleaved (`test_interleaved`): each round calls the nt memcpy and the fused op "
           "once each, in alternating order, and torch.compile(ref) on an evenly spread subset of the "
           "rounds, so load from the other engineers on this shared machine hits them alike. **The "
           "verdict is taken on medians, not on the best of N.** *% of memcpy* is the median over rounds "
           "of the memcpy / fused time ratio of the same round, as % of the memcpy's bandwidth; *vs "
           "torch.compile(ref)* is the median, over the rounds that called it, of the compile / fused "
           "time ratio of the same round; *vs eager ref* is the eager ref row's median time over the "
           "fused op's median in the interleaved rounds (the ref row is sequential: eager ref takes "
           "seconds per call at these sizes, too slow to interleave). A best of N can pair the op's "
           "quietest round with a memcpy caught in a neighbour's burst and pass a row that most rounds "
           "fail; the bests stay visible in the columns marked *best of N*, which the verdict does not "
           "use. Where no interleaved measurement exists the verdict uses the ratios of the sequential "
           "rows' medians (not same-round: the last column says so), and a cell whose JSON lacks a "
           "figure's per-round data names the estimator it fell back to.", "",
           "| workload | size | fused, best of N | GB/s, best of N | memcpy GB/s, best of N "
           "| % of memcpy, best of N (not judged) | % of memcpy, same-round median "
           "| vs eager ref, ratio of medians | vs torch.compile(ref), same-round median | verdict "
           "| measured |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    wl = data.get("lowcomm", {}).get("workloads", {})
    any_row = False
    order = {name: i for i, name in enumerate(wl)}
    for name, n in sorted(set(rows) | set(inter), key=lambda k: (order.get(k[0], 99), k[1])):
        r = rows.get((name, n), {})
        measured = "fused" in r or (name, n) in inter
        if not wl.get(name, {}).get("target") or n < TARGET_MIN_N or not measured:
            continue
        f = interleaved_row(inter[(name, n)], r) if (name, n) in inter else sequential_row(r)
        v, parts = verdict(f, wl[name].get("target_pct", TARGET_PCT))
        for i, key in enumerate(("pct", "vs_ref", "vs_compile")):
            if f["est"][key] != COLUMN_EST[key] and parts[i] != "n/a":
                parts[i] += f" ({f['est'][key]})"
        base_gbps = f"{f['base_gbps']:.1f}" if f.get("base_gbps") else "—"
        out.append(f"| {name} | {size_label(n)} | {fmt_time(f['time'])} | {f['gbps']:.1f} | {base_gbps} "
                   f"| {pct(f.get('pct_best'))} | {parts[0]} | {parts[1]} | {parts[2]} | **{v}** "
                   f"| {f['how']} |")
        any_row = True
    if not any_row:
        out.append("| (no size ≥ 16M in this run: the targets are not evaluated) | | | | | | | | | | |")
    return out + [""] + no_verdict(data, rows, inter)


def op_tables(data: dict, rows: dict, commands: dict[tuple[str, int], str]) -> list[str]:
    wl = data.get("lowcomm", {}).get("workloads", {})
    out = ["## Per op", "",
           "time = best of N rounds (N in the last column); GB/s = bytes the op must move (each buffer "
           "counted once) / time; % of memcpy = GB/s / GB/s of the non-temporal-store copy of the same "
           "bytes in the same run; speed-ups are time ratios (> 1: faster).", ""]
    names = list(wl) + sorted({k[0] for k in rows} - set(wl))
    for name in names:
        sizes = sorted(n for (w, n) in rows if w == name)
        if not sizes:
            continue
        meta = wl.get(name, {})
        cmds = " and ".join(f"`{c}`" for c in dict.fromkeys(commands.get((name, n), "?") for n in sizes))
        out += [f"### {name}", "", f"{meta.get('note', '')}. Command: {cmds}", ""]
        if meta.get("no_target"):
            out += [f"No memcpy target, no verdict: {meta['no_target']}; % of memcpy is context only.", ""]
        out += [
                "| size | bytes | impl | time | GB/s | % of memcpy | vs ref | vs compile | rounds |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for n in sizes:
            r = rows[(name, n)]
            for impl in ("memcpy_nt", "torch_copy", "ref", "compile", "fused"):
                if impl not in r:
                    continue
                x = r[impl]
                label = IMPL_LABEL[impl] + (f" [{x['backend']}]" if x.get("backend") else "")
                if impl == "fused" and x.get("backend") == "ref":
                    label += " ⚠ native backend missing"
                show_ratio = impl in ("compile", "fused", "ref")
                vs_ref = ratio(x["vs_ref"]) if show_ratio else "—"
                vs_compile = ratio(x["vs_compile"]) if show_ratio else "—"
                out.append(f"| {size_label(n)} | {x['bytes'] / 1e6:.1f} MB | {label} | "
                           f"{fmt_time(x['time'])} | {x['gbps']:.1f} | {pct(x['pct'])} | {vs_ref} | "
                           f"{vs_compile} | {x['rounds']} |")
        out.append("")
    notes = data.get("lowcomm", {}).get("notes", [])
    if notes:
        out += ["### Rows that did not run", ""] + [f"- {n}" for n in notes] + [""]
    return out


def memcpy_summary(rows: dict, inter: dict) -> list[str]:
    """nt copy vs torch copy_ per size, from the rows with the largest byte count per size."""
    best: dict[int, dict] = {}
    for (_, n), r in rows.items():
        if "memcpy_nt" not in r or "torch_copy" not in r:
            continue
        if r["memcpy_nt"]["bytes"] > best.get(n, {}).get("bytes", 0):
            best[n] = {"bytes": r["memcpy_nt"]["bytes"], "nt": r["memcpy_nt"]["gbps"],
                       "cp": r["torch_copy"]["gbps"]}
    if not best and any("memcpy_nt" in i.get("interleaved", {}) for i in inter.values()):
        return ["The memcpy rows of this run are the interleaved ones (the targets table): a copy with "
                "non-temporal stores (`lc_copy_nt`) of the same bytes as each op.", ""]
    if not best:
        return ["⚠ **No non-temporal memcpy row in this run** (the native library lacked `lc_copy_nt`): "
                "% of memcpy is taken against torch `copy_`, which understates the roofline.", ""]
    out = ["## The memcpy row", "",
           "The roofline is a copy with non-temporal stores (`lc_copy_nt`): torch's `copy_` pays a hidden "
           "read-for-ownership of the destination and shows only part of the memory system's limit "
           "(docs/design.md, \"The memory roofline on a CPU\"). Largest copy of each size in this run:", "",
           "| size | copy bytes (read + write) | nt copy GB/s | torch copy_ GB/s | copy_ / nt |",
           "| --- | --- | --- | --- | --- |"]
    for n in sorted(best):
        b = best[n]
        out.append(f"| {size_label(n)} | {b['bytes'] / 1e6:.0f} MB | {b['nt']:.1f} | {b['cp']:.1f} | "
                   f"{100 * b['cp'] / b['nt']:.0f}% |")
    return out + [""]


def overlap_section() -> str | None:
    """The overlap tables as ``bench/bench_overlap.py --render`` prints them from its committed
    results file (None while there is none)."""
    path = HERE / "figures" / "overlap.json"
    if not path.exists():
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_overlap", HERE / "bench_overlap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.render_markdown(json.loads(path.read_text()))


def include(marker: str, previous: str) -> list[str]:
    fname, missing = INCLUDES[marker]
    path = HERE / "results" / fname
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    rendered = overlap_section() if marker == "overlap" else None
    if rendered is not None:
        body = rendered
    elif path.exists():
        body = path.read_text().strip()
    else:
        m = re.search(re.escape(begin) + r"\n(.*?)\n?" + re.escape(end), previous, re.S)
        kept = m.group(1).strip() if m else ""
        body = kept if kept and not kept.startswith("Not measured yet") else missing  # keep real tables only
    return [begin, body, end, ""]


def chart(rows: dict, data: dict, out: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart", file=sys.stderr)
        return False
    wl = list(data.get("lowcomm", {}).get("workloads", {})) or sorted({k[0] for k in rows})
    names = [w for w in wl if w.split("/")[0] not in NOT_CHARTED and any(k[0] == w for k in rows)]
    sizes = sorted({n for (_, n) in rows})
    if not sizes:  # only interleaved measurements (e.g. a `-k interleaved` run): nothing to chart
        return False
    impls = [("ref", "#bbbbbb"), ("compile", "#6a9fd8"), ("fused", "#d8792a")]
    fig, axes = plt.subplots(len(sizes), 1, figsize=(12, 3.2 * len(sizes)), squeeze=False, sharey=True)
    width = 0.8 / len(impls)
    for ax, n in zip(axes[:, 0], sizes, strict=True):
        for j, (impl, color) in enumerate(impls):
            vals = [rows.get((w, n), {}).get(impl, {}).get("pct") or 0.0 for w in names]
            xs = [i + (j - 1) * width for i in range(len(names))]
            bars = ax.bar(xs, vals, width, label=IMPL_LABEL[impl], color=color)
            if impl == "fused":
                labels = [f"{v:.0f}" if v <= YMAX_PCT else "" for v in vals]
                ax.bar_label(bars, labels=labels, fontsize=7, padding=1)
                for x, v in zip(xs, vals, strict=True):
                    if v > YMAX_PCT:
                        ax.text(x, YMAX_PCT * 0.97, f"{v:.0f}", ha="center", va="top", fontsize=7)
        ax.axhline(TARGET_PCT, color="k", ls="--", lw=0.8)
        ax.set_ylim(0, YMAX_PCT)  # in-cache small sizes can read > 100%; labels keep the true value
        ax.set_title(f"{size_label(n)} fp32 elements", fontsize=10)
        ax.set_ylabel("% of nt memcpy")
        short = [w.replace("sparse_", "").replace("/", "\n") for w in names]  # fit under the bars
        ax.set_xticks(range(len(names)), short, fontsize=8)
    axes[0, 0].legend(fontsize=8, ncols=3, loc="upper right")
    fig.suptitle("Bandwidth as % of a non-temporal memcpy of the same bytes (dashed: the 80% target)",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def render(ops: Path | list[Path], out: Path, png: Path) -> str:
    previous = out.read_text() if out.exists() else ""
    paths = [ops] if isinstance(ops, Path) else list(ops)
    data, rows, inter, commands = load_runs(paths)
    for r in rows.values():
        derive(r)
    lines = ["# Benchmark results", "",
             f"Rendered {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC by `bench/render_results.py`. "
             "CPU suite: `bench/bench_ops.py` (pytest-benchmark); GPU: `bench/gpu_check.sh`; overlap: "
             "`bench/bench_overlap.py`.", ""]
    lines += machine_section([(json.loads(p.read_text()), p) for p in paths])
    lines += headline(data, rows, inter)
    if chart(rows, data, png):
        rel = png.relative_to(out.parent) if png.is_relative_to(out.parent) else png
        lines += [f"![% of memcpy per op]({rel})", ""]
    lines += memcpy_summary(rows, inter)
    lines += READING
    lines += op_tables(data, rows, commands)
    lines += ["## Overlap of communication with compute (runtime)", ""] + include("overlap", previous)
    lines += ["## GPU", ""] + include("gpu", previous)
    out.write_text("\n".join(lines).rstrip() + "\n")
    return out.read_text()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=Path, action="append",
                    help="pytest-benchmark JSON (repeat for several runs; the later wins per workload and "
                         "size); default bench/figures/ops.json (committed)")
    ap.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    ap.add_argument("--png", type=Path, default=HERE / "ops_bandwidth.png")
    args = ap.parse_args(argv)
    ops = args.ops or [DEFAULT_OPS]
    for p in ops:
        if not p.exists():
            print(f"--ops {p} not found: run `OMP_WAIT_POLICY=ACTIVE .venv/bin/python -m pytest -q "
                  f"bench/bench_ops.py --benchmark-json {p}` first", file=sys.stderr)
            return 2
    render([p.resolve() for p in ops], args.out.resolve(), args.png.resolve())
    print(f"wrote {args.out} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
