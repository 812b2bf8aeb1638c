"""What one evaluation of the `lowcomm compare` harness costs, on this machine, as it runs there.

    .venv/bin/python bench/eval_cost.py                     # 4 ranks, 256 KiB and 64 KiB
    .venv/bin/python bench/eval_cost.py --workers 2 --eval-bytes 262144 --repeats 3

Launches ``--workers`` gloo ranks (one thread each, as ``compare`` does), each holding the default
TinyLlama (231k parameters, context 64), and times the harness's own ``evaluate`` (train/worker.py)
on the default validation windows (``eval_set`` of the standard library's validation split) in two
cases: the workers hold different models (seeds differ: each rank scores its own model on every
window and its share of the averaged model's) and the workers hold one model (one scoring, split
between the ranks). A model every rank held is scored once per process (``_AGREED_LOSSES``); the
cache is cleared before each timed call, so the "agree" row is the cost of a first scoring.

Writes ``--out`` (default bench/figures/eval_cost.json: per case the median wall-clock of rank 0 per
call and the CPU seconds of all ranks, with the run's provenance: revision, load, CPU time, command)
and prints its table. ``--render [PATH]`` runs nothing and prints the table of a results file as
docs/results.md shows it (tests/test_bench_renders.py checks that the docs quote it verbatim):

    .venv/bin/python bench/eval_cost.py --render
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lowcomm_kernels.runtime.launch import launch  # noqa: E402
from lowcomm_kernels.train import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LABEL = "bench/figures/eval_cost.json"
PROG = ".venv/bin/python bench/eval_cost.py"


def _rank(rank: int, world: int, eval_bytes: list[int], repeats: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from lowcomm_kernels.train import worker
    from lowcomm_kernels.train.corpus import eval_set, load_corpus
    from lowcomm_kernels.train.model import ModelConfig, TinyLlama

    val = load_corpus(None).val
    group = dist.new_group(backend="gloo")
    rows = []
    for nbytes in eval_bytes:
        windows = eval_set(val, ModelConfig().seq_len, nbytes)
        for case, seed in (("differ", rank), ("agree", 0)):
            torch.manual_seed(seed)
            model = TinyLlama(ModelConfig())
            times, cpus = [], []
            for _ in range(repeats):
                worker._AGREED_LOSSES.clear()
                dist.barrier(group=group)
                t0, c0 = time.perf_counter(), time.process_time()
                out = worker.evaluate(model, TinyLlama(ModelConfig()), windows, group, rank, world)
                times.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            assert out.agree == (case == "agree")
            cpu = torch.tensor([statistics.median(cpus)], dtype=torch.float64)
            dist.all_reduce(cpu, group=group)
            rows.append(
                {
                    "eval_bytes": windows.scored_bytes,
                    "case": case,
                    "wall_s": statistics.median(times),
                    "cpu_s_all_ranks": float(cpu),
                }
            )
    dist.destroy_process_group(group)
    return rows


# What each preset scores (train/presets.py and the harness): step 0 once per launch (every run starts
# from the same model, so the workers agree), then at every eval step data-parallel's workers agree
# and DiLoCo's do (its eval steps are multiples of H, right after a sync), while the three streaming
# methods' workers differ. (preset, validation bytes, eval steps after step 0)
PRESETS = (("`compare --quick`", 65_536, 2), ("`compare`", 262_144, 3))


def preset_cost(result: dict) -> list[str]:
    """Per preset, what its evaluations cost in CPU seconds of all ranks, from the rows."""
    cpu = {(r["eval_bytes"], r["case"]): r["cpu_s_all_ranks"] for r in result["rows"]}
    out = []
    for name, nbytes, evals in PRESETS:
        if (nbytes, "agree") not in cpu or (nbytes, "differ") not in cpu:
            continue
        agree, differ = 1 + 2 * evals, 3 * evals
        total = agree * cpu[nbytes, "agree"] + differ * cpu[nbytes, "differ"]
        out.append(
            f"{name}: {agree} × {cpu[nbytes, 'agree']:.1f} (agree) + {differ} × "
            f"{cpu[nbytes, 'differ']:.1f} (differ) ≈ {total:.0f} CPU s, at least {total / 2:.0f} s "
            "of wall-clock on two cores"
        )
    return out


def source_line(result: dict) -> str:
    """Where the figures come from, as ``lowcomm report`` writes it under its tables."""
    from lowcomm_kernels.train import render

    return render.provenance_line(render.Source(LABEL, Path(LABEL), "eval_cost", result))


def render_markdown(result: dict) -> str:
    """The table (markdown) of a results file, with what the presets' evaluations cost and the
    source line: what docs/results.md shows."""
    c = result["config"]
    lines = [
        f"{c['workers']} ranks, the default TinyLlama and validation windows, the harness's own "
        f"`evaluate`; median of {c['repeats']} call{'s' * (c['repeats'] != 1)} per case:",
        "",
        "| scored bytes | workers' models | wall-clock per evaluation | CPU s, all ranks |",
        "|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['eval_bytes']:,} | {r['case']} | {r['wall_s']:.2f} s | {r['cpu_s_all_ranks']:.1f} |"
        )
    cost = preset_cost(result) if c["workers"] == 4 else []
    if cost:
        lines += ["", "What the presets' evaluations cost, from these rows (CPU s of all ranks):", ""]
        lines += [f"- {x}" for x in cost]
    return "\n".join(lines + ["", source_line(result)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--eval-bytes", type=int, nargs="+", default=[262_144, 65_536])
    ap.add_argument("--repeats", type=int, default=3)
    provenance.results_file_flags(ap, ROOT / LABEL, "the table")
    args = ap.parse_args(argv)
    if args.render is not None:
        print(render_markdown(json.loads(args.render.read_text())))
        return 0
    if args.workers < 1 or args.repeats < 1 or min(args.eval_bytes) < 64:
        ap.error("--workers and --repeats must be >= 1 and every --eval-bytes >= 64 (one window)")
    started = provenance.begin(sys.argv[1:] if argv is None else argv, prog=PROG)
    git = provenance.git_info(ROOT)  # the checkout as the run found it, before the results file is written
    rows = launch(_rank, args.workers, (args.eval_bytes, args.repeats), timeout_s=3600)[0]
    result = {
        "config": {"workers": args.workers, "eval_bytes": args.eval_bytes, "repeats": args.repeats},
        "rows": rows,
        "provenance": {**provenance.collect(started, repo=ROOT), "git": git},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(render_markdown(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
