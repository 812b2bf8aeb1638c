"""``lowcomm compare --study frontier``: how few bytes DiLoCo can send before its loss moves.

Every configuration is DiLoCo (blocking, every H steps) on the same model, data and seeds, with
one thing changed on the wire or in the outer step:

- **dense formats**: fp32 (the reference), bf16, int4 and E3M0 4-bit (block scales, error feedback);
- **top-k** (SparseLoCo-style): per chunk of C = 4096 values the k largest of the error-feedback
  accumulator, quantized to b bits, all-gathered: k = 64 at 2 bits (the published operating point,
  about 141× fewer bytes than fp32 counting indices and scales), k = 32 at 2 bits (past 256×) and
  k = 64 at 1 bit (the sign); the default Nesterov outer step, and k = 64 with the published outer
  step (plain SGD at lr 1, no momentum: error feedback in place of outer momentum);
- **eager**: fp32, the outer round overlapped with the next inner phase (each worker's own fresh
  outer gradient in place of its stale share of the average).

The table reads each configuration against fp32 DiLoCo seed by seed: the relative change of the
final loss with its 95 % interval and Holm-adjusted p over the family of every configuration
against the reference (declared here, before the runs), and the bytes each worker sent as a
multiple of fp32's. The goals it checks: ≥ 146× fewer bytes at a final loss within +0.5 % of fp32
DiLoCo, a stretch point at ≥ 256×, and eager within +0.5 % of blocking DiLoCo.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import stats
from .report import RunResult
from .spec import TrainSpec
from .studykit import cell, table_head

NAME = "frontier"
REFERENCE = "DiLoCo fp32"
LOSS_GOAL = 0.005  # the final loss within +0.5 % of fp32 DiLoCo
BYTES_GOAL, STRETCH_GOAL = 146.0, 256.0  # fp32 bytes / these bytes


def configs(base: TrainSpec) -> list[tuple[str, TrainSpec]]:
    """The study's configurations, as (label, spec) on ``base``: DiLoCo, one change each."""
    d = base.with_(method="diloco", error_feedback=False, wire_dtype="fp32", outer_delay="none")
    topk = d.with_(wire_dtype="topk", topk_chunk=4096)
    return [
        (REFERENCE, d),
        ("DiLoCo bf16", d.with_(wire_dtype="bf16")),
        ("DiLoCo int4+EF", d.with_(wire_dtype="int4", error_feedback=True)),
        ("DiLoCo fp4_e3m0+EF", d.with_(wire_dtype="fp4_e3m0", error_feedback=True)),
        ("DiLoCo topk k=64 2-bit", topk.with_(topk_k=64, topk_bits=2)),
        ("DiLoCo topk k=32 2-bit", topk.with_(topk_k=32, topk_bits=2)),
        ("DiLoCo topk k=64 1-bit", topk.with_(topk_k=64, topk_bits=1)),
        (
            "DiLoCo topk k=64 2-bit, outer SGD lr 1",
            topk.with_(topk_k=64, topk_bits=2, outer_lr=1.0, outer_momentum=0.0),
        ),
        ("DiLoCo eager fp32", d.with_(outer_delay="eager")),
    ]


def _by_seed(results: list[RunResult], label: str) -> dict[int, RunResult]:
    return {int(r.config.get("seed", 0)): r for r in results if r.name == label}


def _goal(ratio: float, rel: stats.Paired, label: str) -> str:
    """Which goal a configuration meets: its loss must be within LOSS_GOAL of the reference at the
    interval's upper end (not only on average)."""
    if rel.n < 2 or rel.ci_high is None:
        return "too few seeds"
    within = rel.ci_high <= LOSS_GOAL
    if label.startswith("DiLoCo eager"):
        return "eager goal met" if within else "eager goal missed (loss)"
    if ratio >= STRETCH_GOAL:
        return "stretch goal met" if within else "stretch bytes, loss missed"
    if ratio >= BYTES_GOAL:
        return "goal met" if within else "goal bytes, loss missed"
    return "within loss" if within else "loss missed"


def table(name: str, labels: list[str], results: list[RunResult], target: float) -> str:
    """Markdown: per configuration the final loss, its relative change against fp32 DiLoCo (paired by
    seed, Holm over the family), the bytes each worker sent and their ratio to fp32's, and the goal."""
    ref = _by_seed(results, REFERENCE)
    seeds = sorted(ref)
    family = {}
    for label in labels:
        if label != REFERENCE:
            runs = _by_seed(results, label)
            family[label] = stats.paired_diffs(
                [runs[s].final_loss / ref[s].final_loss - 1 for s in seeds if s in runs and ref[s].final_loss]
            )
    family = stats.holm_family(family)
    ref_bytes = sum(r.bytes_sent for r in ref.values()) / max(len(ref), 1)
    lines = table_head(
        target,
        [
            f"final loss vs {REFERENCE} (paired, 95 % interval, Holm p)",
            "bytes sent/worker (MB)",
            "fp32 bytes / these",
            "goal",
        ],
        results,
    )
    for label in labels:
        runs = [r for r in results if r.name == label]
        sent = [r.bytes_sent for r in runs]
        ratio = ref_bytes / (sum(sent) / len(sent)) if sent and sum(sent) else float("nan")
        if label == REFERENCE:
            rel_cell, goal = "(reference)", "-"
        else:
            rel = family[label]
            rel_cell = rel.cell("{:+.2%}")
            goal = _goal(ratio, rel, label)
        lines.append(
            f"| {label} | {len(runs)} | {cell([r.final_loss for r in runs])} | {rel_cell} | "
            f"{cell([b / 1e6 for b in sent], '{:.3f}')} | {ratio:.1f}x | {goal} |"
        )
    lines += [
        "",
        f"goal: ≥ {BYTES_GOAL:g}x fewer bytes than fp32 at a final loss within +{LOSS_GOAL:.1%} of "
        f"{REFERENCE} (the interval's upper end), stretch ≥ {STRETCH_GOAL:g}x; eager: within "
        f"+{LOSS_GOAL:.1%} of blocking DiLoCo. Bytes: what each worker sent (values, indices, scales).",
    ]
    return "\n".join(lines)


def plot(labels: list[str], results: list[RunResult], path: Path) -> None:
    """The frontier: final loss (mean ± std over seeds) against the bytes each worker sent (log
    scale), one point per configuration, with the reference's +0.5 % band."""
    import matplotlib  # optional (the cli extra): only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, label in enumerate(labels):
        runs = [r for r in results if r.name == label]
        if not runs:
            continue
        x = float(np.mean([r.bytes_sent for r in runs])) / 1e6
        y = np.array([r.final_loss for r in runs])
        color = plt.get_cmap("tab10")(i % 10)
        ax.errorbar(x, y.mean(), yerr=y.std(ddof=1) if len(y) > 1 else 0.0, fmt="o", color=color, label=label)
        if label == REFERENCE:
            ax.axhspan(
                y.mean(), y.mean() * (1 + LOSS_GOAL), color=color, alpha=0.15, label="reference +0.5 %"
            )
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per worker (MB, log scale)")
    ax.set_ylabel("final validation loss (nats/byte)")
    ax.set_title("DiLoCo: loss against bytes on the wire")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
