"""``lowcomm compare --study cocodc-scale``: the headline contrasts of the cocodc-paper study on a
model 11× larger with 8× the context, with ten seeds, so that effects the small study could not
resolve can show.

Why: at 20,688 parameters and a 16-byte context (``cocodc-paper``) the paired differences between
CoCoDC, its round-robin variant, Streaming DiLoCo at matched syncs and DiLoCo had standard
deviations of 0.004–0.016 nats/byte over 5 seeds, so the study could not detect effects below about
0.01–0.03, and none of its 14 comparisons survived Holm's correction.

Setup: the paper's schedule as in ``study_cocodc`` (4 workers, H = 100, τ = 5, K = 4, λ = 0.5
normalized, γ = 0.4, N = 8 syncs per H from the emulated link, 2,000 steps, a 10 ms / 1 Gbit/s link)
on the default LM of ``lowcomm compare`` (dim 64, 4 layers, 4 heads, SwiGLU 172: 230,976
parameters) with a 128-byte context, batch 8, evaluated every 100 steps on 16 KiB and after the
last step on 256 KiB.

Configurations (the headline contrasts): DiLoCo; Streaming DiLoCo at CoCoDC's sync count (8 per H:
H halved), with α = 0 and α = 0.5; CoCoDC as published (adaptive, the paper's score); CoCoDC
round-robin at the same N.

Declared before the runs (``CONTRASTS``, final loss of the workers' own models, paired by seed,
Holm over the five): the Taylor term with the adaptive choice against Streaming DiLoCo at the same
syncs; the Taylor term alone (round-robin) against the same; adaptive against round-robin; keeping
local progress (α = 0.5 against 0); CoCoDC against DiLoCo. Steps to a target are secondary: the
target is the lowest loss every run reached (post hoc).

What the design can detect, said before the runs: with n = 10 pairs a two-sided t test at α = 0.05
has 80 % power for a true paired difference of (t₀.₉₇₅,₉ + t₀.₈,₉)·s/√10 = 0.995·s, s the paired
standard deviation. So it detects 0.01 nats/byte where s ≤ 0.010. At 20,688 parameters s was
0.004–0.016; a larger model's seeds usually spread less, but that is the question, and the table
prints each contrast's own detectable effect. Holm over five raises the bar for all but the
strongest contrast.

Budget: a 200-step pilot of CoCoDC at seed 1000 (not a study seed) cost 48.6 CPU seconds of all
ranks (setup, 3 evaluations, training), so a 2,000-step run costs about 430 CPU s and the 50 runs
about 21,500 CPU s: 6 CPU hours, 3 hours of wall-clock on two free cores. The runner saves each
configuration's finished runs (``run_resumable``): a sitting may stop at any time and the next one
continue; the results say which code and machine made each part.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from . import study_cocodc
from .report import RunResult
from .spec import TrainSpec
from .stats import contrast_pairs, contrast_table, pairs_to_detect
from .studykit import Study

NAME = "cocodc-scale"
REFERENCE = study_cocodc.REFERENCE
DILOCO = "DiLoCo"
STREAM = "Streaming DiLoCo, 8 syncs/H"
STREAM_MIX = "Streaming DiLoCo, 8 syncs/H, alpha=0.5"
ROUND_ROBIN = "CoCoDC round-robin"
MODEL = {"dim": 64, "layers": 4, "heads": 4, "mlp_hidden": 172, "seq_len": 128}
PRESETS = {
    "full": dict(study_cocodc.PAPER, steps=2000, eval_every=100, eval_bytes=16_384, final_eval_bytes=262_144),
    "quick": study_cocodc.PRESETS["quick"],
}
SETUP = study_cocodc.Setup(
    MODEL, PRESETS, seeds=10, quick_seeds=2, target=math.nan, target_from="", seeds_per_part=5
)  # all five configurations at 5 seeds first, then the other 5: a partial study is still paired
CONTRASTS = [
    ("Taylor term + adaptive choice vs Streaming at the same syncs", REFERENCE, STREAM),
    ("Taylor term alone (round-robin) vs Streaming at the same syncs", ROUND_ROBIN, STREAM),
    ("adaptive vs round-robin choice", REFERENCE, ROUND_ROBIN),
    ("keeping local progress: alpha 0.5 vs 0", STREAM_MIX, STREAM),
    ("CoCoDC as published vs DiLoCo", REFERENCE, DILOCO),
]  # declared before the runs
GOAL = 0.01  # nats/byte: the smallest paired effect the study was sized to detect


def configs(base: TrainSpec) -> list[tuple[str, TrainSpec]]:
    coco = base.with_(method="cocodc", syncs_per_period="auto", score="l2_global", taylor_control="none")
    stream = base.with_(method="streaming", fragment_update_alpha=0.0, sync_every=base.sync_every // 2)
    return [
        (DILOCO, base.with_(method="diloco")),
        (STREAM, stream),
        (STREAM_MIX, stream.with_(fragment_update_alpha=0.5)),
        (REFERENCE, coco),
        (ROUND_ROBIN, coco.with_(score="round_robin")),
    ]


def tables(labels: list[str], results: list[RunResult], target: float, seeds: list[int]) -> tuple[str, dict]:
    """Each configuration against CoCoDC as published (study_cocodc's table, without the paper's
    columns), then the declared contrasts."""
    md, paired = study_cocodc.table(labels, results, target, seeds, paper=False)
    contrasts = [c for c in CONTRASTS if c[1] in labels and c[2] in labels]
    declared = contrast_table(contrasts, results)
    return f"{md}\n\n{declared}\n\n{detection_table(contrasts, results)}", paired


def detection_table(contrasts: list[tuple[str, str, str]], results: list[RunResult]) -> str:
    """For each declared contrast: the spread of its paired differences, the smallest effect these
    pairs detect, and how many pairs (and CPU hours, at the runs' measured cost) would detect GOAL."""
    cpu = [r.extra["cpu_s_all_ranks"] for r in results if "cpu_s_all_ranks" in (r.extra or {})]
    per_run = sum(cpu) / len(cpu) if cpu else math.nan
    lines = [
        f"What the design detects (goal: a paired effect of {GOAL} nats/byte at 80 % power, two-sided "
        f"t at 0.05, before Holm; a run cost {per_run:,.0f} CPU s of all ranks on average):",
        "",
        "| contrast | pairs | paired std | smallest detectable | pairs for the goal | CPU hours for them, "
        "both configurations |",
        "|---|---|---|---|---|---|",
    ]
    for name, (_, _, d) in contrast_pairs(contrasts, results).items():
        if d.n < 2:
            continue
        need = pairs_to_detect(d.std, GOAL)
        det = "-" if d.detectable is None else f"{d.detectable:.4f}"
        hours = "-" if need is None or per_run != per_run else f"{2 * need * per_run / 3600:.1f}"
        lines.append(f"| {name} | {d.n} | {d.std:.4f} | {det} | {need or '-'} | {hours} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``lowcomm compare --study cocodc-scale [--quick] [--seeds N]``."""
    return study_cocodc.run_paper_setup(args, NAME, configs, tables, setup=SETUP)


def render(data: dict, plot_dir: Path | None, prefix: str) -> tuple[str, list[Path]]:
    return study_cocodc.render_paper_setup(NAME, tables, data, plot_dir, prefix)


STUDY = Study(NAME, configs, run, render)
