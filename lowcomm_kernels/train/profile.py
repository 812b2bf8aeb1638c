"""``lowcomm profile``: a short 2-rank run under torch.profiler, drawn as a per-rank timeline.

Each worker records a Chrome trace (``trace_rank<r>.json``, open it in chrome://tracing or
https://ui.perfetto.dev) and the runtime's per-sync records (``syncs_rank<r>.json``). The picture
(``timeline_rank<r>.png``, and ``timeline.png`` with every rank; drawn by ``train.timeline``) has one
row per phase, from the ``lowcomm/*`` ranges that :func:`lowcomm_kernels.profiling.nvtx_range` emits:

- compute: the harness's forward/backward/optimizer step (``lowcomm/compute``)
- pack, merge, wait: the runtime's own ranges (wait = exposed communication)
- quorum, heal (``lowcomm profile --faults``, torchft replicas): each round's quorum and a returning
  replica's heal (``lowcomm/quorum``, ``lowcomm/heal`` from ``runtime.ft``); rows shown when recorded
- comm in flight: from the issue of each all-reduce (``lowcomm/comm``) until its result was usable,
  using the in-flight time the runtime measured for that sync (records paired with issues in send
  order).
"""

from __future__ import annotations

import argparse
import time

from .args import out_dir
from .faults import run_faults_profile
from .presets import LM
from .tasks.lm import build_specs, load_checked_corpus, run_and_report
from .timeline import draw, load_intervals


def run_profile(args: argparse.Namespace) -> int:
    if getattr(args, "faults", None) is not None:
        return run_faults_profile(args)
    specs = build_specs(args, [args.method], LM["profile"])
    out = out_dir(args, f"profile-{args.method}")
    spec = specs[0].with_(profile_dir=str(out.resolve()))
    corpus = load_checked_corpus(args.data, specs)
    t0 = time.perf_counter()
    run_and_report(
        [spec],
        corpus,
        out,
        target=None,
        progress=not args.no_progress,
        title=f"lowcomm profile --method {args.method}: {spec.workers} ranks, {spec.steps} steps",
    )
    per_rank = []
    for r in range(spec.workers):
        spans = load_intervals(out / f"trace_rank{r}.json", out / f"syncs_rank{r}.json")
        per_rank.append(spans)
        draw(
            [spans],
            out / f"timeline_rank{r}.png",
            f"{spec.label}, rank {r}: latency {spec.latency_s * 1e3:.0f} ms, "
            f"{spec.bandwidth_bytes_per_s * 8 / 1e6:.0f} Mbit/s, tau={spec.fragment_sync_delay}",
        )
    draw(
        per_rank,
        out / "timeline.png",
        f"{spec.label}: {spec.workers} ranks, latency {spec.latency_s * 1e3:.0f} ms, "
        f"{spec.bandwidth_bytes_per_s * 8 / 1e6:.0f} Mbit/s, H={spec.sync_every}, "
        f"tau={spec.fragment_sync_delay}",
    )
    counts = {k: len(v) for k, v in per_rank[0].items()}
    print(f"timeline ranges on rank 0: {counts}")
    print(
        f"wrote {out / 'timeline.png'}, timeline_rank<r>.png and Chrome traces trace_rank<r>.json "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    return 0
