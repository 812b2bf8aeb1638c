"""What one evaluation of the `lowcomm compare` harness costs, on this machine, as it runs there.

    .venv/bin/python bench/eval_cost.py                     # 4 ranks, 256 KiB and 64 KiB
    .venv/bin/python bench/eval_cost.py --workers 2 --eval-bytes 262144 --repeats 3

Launches ``--workers`` gloo ranks (one thread each, as ``compare`` does), each holding the default
TinyLlama (231k parameters, context 64), and times the harness's own ``evaluate`` (train/worker.py)
on the default validation windows (``eval_set`` of the standard library's validation split) in two
cases: the workers hold different models (seeds differ: each rank scores its own model on every
window and its share of the averaged model's) and the workers hold one model (one scoring, split
between the ranks). A model every rank held is scored once per process (``_AGREED_LOSSES``); the
cache is cleared before each timed call, so the "agree" row is the cost of a first scoring. Prints
the median wall-clock of rank 0 per call, the load average before and after, and the CPU seconds
of all ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lowcomm_kernels.runtime.launch import launch  # noqa: E402


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--eval-bytes", type=int, nargs="+", default=[262_144, 65_536])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.workers < 1 or args.repeats < 1 or min(args.eval_bytes) < 64:
        ap.error("--workers and --repeats must be >= 1 and every --eval-bytes >= 64 (one window)")
    load0 = os.getloadavg()[0]
    rows = launch(_rank, args.workers, (args.eval_bytes, args.repeats), timeout_s=3600)[0]
    load1 = os.getloadavg()[0]
    print(f"{args.workers} ranks, median of {args.repeats}; load average {load0:.1f} -> {load1:.1f}")
    print("| scored bytes | workers' models | wall-clock per evaluation | CPU s, all ranks |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['eval_bytes']:,} | {r['case']} | {r['wall_s']:.2f} s | {r['cpu_s_all_ranks']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
