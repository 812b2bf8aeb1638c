"""``lowcomm compare --study cocodc-score``: why CoCoDC's adaptive score sends one fragment far more
often than the others, measured from the scores themselves.

In the ``cocodc-paper`` study CoCoDC's score (the paper's R_p = ‖Δ̄_p‖₂ / I_p) chose fragment 2 in
every score-decided slot of every seed: 99 of its 159 syncs, the other three only when the stale rule
forced them (once per H). One explanation is a feedback loop under noise: if a pseudo-gradient is
mostly the noise of the inner steps, ‖Δ̄_p‖ grows like √I_p, R_p falls like 1/√I_p, and the fragment
sent last (smallest I_p) keeps the highest score. The other is that fragment 2 simply moves the most.
This study tells them apart with every sync's norms recorded (``log_scores``):

- **Noise share.** Each worker's own ‖Δ_p‖ beside the average's ‖Δ̄_p‖: with M workers whose
  pseudo-gradients are signal s plus independent noise of variance σ², E‖Δ̄‖² / E‖Δ‖² =
  (s² + σ²/M) / (s² + σ²), i.e. 1/M for pure noise and 1 for pure signal; the noise share
  σ² / (s² + σ²) = (1 − r) / (1 − 1/M) for the ratio r (from worker 0's own norm; the median over the
  run's syncs).
- **Growth with I.** The exponent a of ‖Δ̄_p‖ ∝ I_p^a (least squares of log ‖Δ̄_p‖ on log I_p
  among the syncs of one fragment within one period of H steps, per run, leaving out each
  fragment's first sync, which covers from step 0): a ≈ 1/2 for noise, 1 for a steady drift.
  Undefined where I_p does not vary within such a group (round-robin).
- **Drift rate per fragment**: the median of ‖Δ̄_p‖ / (I_p·√numel_p), the RMS change of an element
  per step, which says which fragment moves fastest whatever its size.
- **Larger batches** (4× the batch, 3 seeds): less noise per step; if noise drove the choice, the
  concentration on one fragment would fall.
- **The size- and noise-normalised score** ``l2_rms`` (R_p = ‖Δ̄_p‖₂ / √(I_p·numel_p)) beside the
  paper's and round-robin, 5 seeds, the final losses compared by seed (declared contrasts, Holm).

Setup: ``cocodc-paper``'s (``study_cocodc``: 4 workers, H = 100, τ = 5, K = 4, λ = 0.5, N = 8 per
H from the emulated link, the 20,688-parameter LM, 2,000 steps) and its target. Resumable.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from . import study_cocodc
from .report import RunResult
from .spec import TrainSpec
from .stats import contrast_table
from .studykit import Study

NAME = "cocodc-score"
REFERENCE = study_cocodc.REFERENCE  # the paper's score
RMS = "CoCoDC l2_rms score"
ROUND_ROBIN = "CoCoDC round-robin"
BIG_BATCH = "CoCoDC adaptive, 4x batch"
BIG_BATCH_SEEDS = 3  # its runs cost more; it measures the noise share, not a loss contrast
CONTRASTS = [
    ("l2_rms vs the paper's score", RMS, REFERENCE),
    ("round-robin vs the paper's score", ROUND_ROBIN, REFERENCE),
]  # declared before the runs


def configs(base: TrainSpec) -> list[tuple[str, TrainSpec]]:
    coco = base.with_(
        method="cocodc", syncs_per_period="auto", score="l2_global", taylor_control="none", log_scores=True
    )
    return [
        (REFERENCE, coco),
        (RMS, coco.with_(score="l2_rms")),
        (ROUND_ROBIN, coco.with_(score="round_robin")),
        (BIG_BATCH, coco.with_(batch_size=4 * base.batch_size)),
    ]


def seeds_of(label: str, seeds: list[int]) -> list[int]:
    return seeds[:BIG_BATCH_SEEDS] if label == BIG_BATCH else seeds


def _fit_exponent(syncs: list[dict], period: int) -> float | None:
    """Least-squares slope of log ‖Δ̄_p‖ on log I_p with one intercept per fragment and period of
    `period` steps (so that syncs are compared with others of the same fragment at the same stage of
    training: the norms shrink as the learning rate decays); None without any spread of I_p within
    such a group."""
    by: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for s in syncs:
        # a fragment's first sync covers from step 0, the steepest part of training: left out
        if s["norm"] and s["norm"] > 0 and s["covered"] and s["send_step"] - s["covered"] > 0:
            key = (s["fragment"], (s["send_step"] - 1) // period)
            by.setdefault(key, []).append((math.log(s["covered"]), math.log(s["norm"])))
    sxx = sxy = 0.0
    for pts in by.values():
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        sxx += sum((x - mx) ** 2 for x, _ in pts)
        sxy += sum((x - mx) * (y - my) for x, y in pts)
    return sxy / sxx if sxx > 1e-12 else None


def run_facts(run: RunResult) -> dict | None:
    """What one run's score log says (None without one): see the module docstring."""
    log = run.extra.get("score_log")
    if not log or not log.get("syncs"):
        return None
    syncs, numel = log["syncs"], log["numel"]
    workers = int(run.config.get("workers", 1))
    counts = [sum(1 for s in syncs if s["fragment"] == p) for p in range(len(numel))]
    ratios = [(s["norm"] / s["local_norm"]) ** 2 for s in syncs if s.get("local_norm") and s.get("norm")]
    r = statistics.median(ratios) if ratios else None
    noise = None if r is None or workers < 2 else min(1.0, max(0.0, (1 - r) / (1 - 1 / workers)))
    rate = []
    for p, n in enumerate(numel):
        v = [s["norm"] / (s["covered"] * math.sqrt(n)) for s in syncs if s["fragment"] == p and s.get("norm")]
        rate.append(statistics.median(v) if v else None)
    by_score = [c for c in log.get("choices", []) if c["reason"] == "score"]
    top = max(counts)
    return {
        "syncs": len(syncs),
        "counts": counts,
        "top_share": top / len(syncs),
        "score_slots": len(by_score),
        "ratio": r,
        "noise_share": noise,
        "exponent": _fit_exponent(syncs, int(run.config.get("sync_every", 1))),
        "rate": rate,
    }


def _mean_range(values: list[float | None], fmt: str) -> str:
    v = [x for x in values if x is not None]
    if not v:
        return "-"
    if len(v) == 1:
        return fmt.format(v[0])
    return f"{fmt.format(sum(v) / len(v))} ({fmt.format(min(v))} … {fmt.format(max(v))})"


def tables(labels: list[str], results: list[RunResult], target: float, seeds: list[int]) -> tuple[str, dict]:
    """The score facts per configuration (mean and range over seeds) and the declared contrasts."""
    head = [
        "configuration", "seeds", "syncs per fragment (mean)", "most-sent fragment's share",
        "‖Δ̄‖² / ‖Δ_worker‖² (median)", "noise share σ²/(s²+σ²)", "exponent a of ‖Δ̄‖ ∝ I^a",
        "RMS drift per element-step, per fragment (×1e-4)", "final val loss (own models)",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    facts_out: dict = {}
    for label in labels:
        runs = [r for r in results if r.name == label]
        facts = [f for f in (run_facts(r) for r in runs) if f is not None]
        facts_out[label] = facts
        if not facts:
            lines.append(f"| {label} | {len(runs)} | no score log | | | | | | |")
            continue
        k = len(facts[0]["counts"])
        counts = " / ".join(f"{sum(f['counts'][p] for f in facts) / len(facts):.0f}" for p in range(k))
        rates = " / ".join(
            _mean_range(
                [None if f["rate"][p] is None else f["rate"][p] * 1e4 for f in facts], "{:.2f}"
            ).split(" ")[0]
            for p in range(k)
        )
        lines.append(
            "| "
            + " | ".join(
                [
                    label,
                    str(len(facts)),
                    counts,
                    _mean_range([f["top_share"] for f in facts], "{:.2f}"),
                    _mean_range([f["ratio"] for f in facts], "{:.3f}"),
                    _mean_range([f["noise_share"] for f in facts], "{:.3f}"),
                    _mean_range([f["exponent"] for f in facts], "{:.2f}"),
                    rates,
                    _mean_range([r.final_loss for r in runs], "{:.4f}"),
                ]
            )
            + " |"
        )
    lines += [
        "",
        "Per configuration: mean over seeds (range in brackets). Ratios and rates from worker 0's "
        "record; the noise share from the ratio r as (1 − r) / (1 − 1/M) with M workers; the exponent "
        "from each run's syncs with one intercept per fragment and period of H steps.",
        "",
        contrast_table([c for c in CONTRASTS if c[1] in labels and c[2] in labels], results),
    ]
    return "\n".join(lines), {"facts": facts_out}


def run(args: argparse.Namespace) -> int:
    """``lowcomm compare --study cocodc-score [--quick] [--seeds N]``."""
    return study_cocodc.run_paper_setup(args, NAME, configs, tables, seeds_of)


def render(data: dict, plot_dir: Path | None, prefix: str) -> tuple[str, list[Path]]:
    return study_cocodc.render_paper_setup(NAME, tables, data, plot_dir, prefix)


STUDY = Study(NAME, configs, run, render)
