"""``lowcomm compare --study frontier``: how few bytes DiLoCo can send before its loss moves.

Every configuration trains the same model on the same data and seeds, with one thing changed on
the wire or in the outer step against blocking fp32 DiLoCo:

- **dense formats** (DiLoCo): fp32 (the reference), bf16, and with block scales and error feedback
  int8, int4, E2M1 4-bit and E3M0 4-bit (the Streaming DiLoCo paper's);
- **top-k** (SparseLoCo-style, DiLoCo): per chunk of C = 4096 values the k largest of the
  error-feedback accumulator, quantized to b bits, all-gathered: k = 64 and k = 32, each at 2 bits and
  at 1 bit (the sign); k = 64 at 2 bits (about 141× fewer bytes than fp32 counting indices and scales)
  is the published operating point, k = 32 goes past 256×; the default Nesterov outer step, and k = 64
  at 2 bits with the published outer step (plain SGD at lr 1, no momentum: error feedback in place of
  outer momentum);
- **LOSCAR's random mask at a matched payload**: LOSCAR with rounds of H steps (N = H, no overlap)
  and the density whose payload per sync is top-k k = 64 at 2 bits's, the same coordinates on every
  worker (no indices on the wire). On the wire LOSCAR's payload is all-reduced (each worker sends
  2(W-1)/W of it) where top-k's is all-gathered (W-1), so at 4 workers LOSCAR sends about half
  top-k's bytes;
- **eager** (DiLoCo): the outer round overlapped with the next inner phase (each worker's own fresh
  outer gradient in place of its stale share of the average), under every dense format. (Top-k
  cannot be eager: the runtime refuses the combination by name.) And, fp32 only, the eager-updates
  paper's baseline: the same overlap with the stale average applied as it is (``outer_delay=
  "delayed"``), compared with eager fp32 seed by seed below the table.

The table reads each configuration against fp32 DiLoCo seed by seed: the relative change of the
final loss with its 95 % interval and Holm-adjusted p over the family of every configuration
against the reference (declared here, before the runs), the bytes each worker sent as a multiple of
fp32's, and the bits per parameter per sync. The goals it checks: ≥ 146× fewer bytes at a final
loss within +0.5 % of fp32 DiLoCo, a stretch point at ≥ 256×, and eager within +0.5 % of blocking
DiLoCo. The plot is the frontier: the loss gap with its interval against the bits per parameter
per sync.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import stats
from .report import RunResult
from .spec import TrainSpec
from .studykit import cell, labels_of, runs_of, table_head

NAME = "frontier"
REFERENCE = "DiLoCo fp32"
LOSS_GOAL = 0.005  # the final loss within +0.5 % of fp32 DiLoCo
BYTES_GOAL, STRETCH_GOAL = 146.0, 256.0  # fp32 bytes / these bytes
PUBLISHED_TOPK = "DiLoCo topk k=64 2-bit"  # SparseLoCo's operating point
DELAYED = "DiLoCo delayed fp32"  # the naive delayed outer update, eager's baseline
EAGER_FP32 = "DiLoCo eager fp32"


DENSE = (
    ("fp32", False),
    ("bf16", False),
    ("int8", True),
    ("int4", True),
    ("fp4_e2m1", True),
    ("fp4_e3m0", True),
)
# top-k k=64 at 2 bits per chunk of 4096: 64 values x 2 bits + 64 indices x 12 bits + a 32-bit scale
# = 928 bits for 4096 fp32 values (131072 bits): LOSCAR sends fp32 values at a shared mask
MATCHED_DENSITY = round((64 * 2 + 64 * 12 + 32) / (4096 * 32), 4)


def _dense_label(wire: str, ef: bool, eager: bool = False) -> str:
    return f"DiLoCo {'eager ' if eager else ''}{wire}{'+EF' if ef else ''}"


def configs(base: TrainSpec) -> list[tuple[str, TrainSpec]]:
    """The study's configurations, as (label, spec) on ``base``: one change each against fp32 DiLoCo."""
    d = base.with_(method="diloco", error_feedback=False, wire_dtype="fp32", outer_delay="none")
    topk = d.with_(wire_dtype="topk", topk_chunk=4096)
    out = [(_dense_label(w, ef), d.with_(wire_dtype=w, error_feedback=ef)) for w, ef in DENSE]
    out += [
        (f"DiLoCo topk k={k} {b}-bit", topk.with_(topk_k=k, topk_bits=b)) for k in (64, 32) for b in (2, 1)
    ]
    out += [
        (
            "DiLoCo topk k=64 2-bit, outer SGD lr 1",
            topk.with_(topk_k=64, topk_bits=2, outer_lr=1.0, outer_momentum=0.0),
        ),
        (
            f"LOSCAR d={MATCHED_DENSITY:g} (payload of topk k=64 2-bit)",
            base.with_(
                method="loscar",
                density=MATCHED_DENSITY,
                local_steps=base.sync_every,
                overlap_steps=0,
                wire_dtype="fp32",
                error_feedback=False,
                outer_delay="none",
            ),
        ),  # fmt: skip
    ]
    out += [(_dense_label(w, ef, eager=True), d.with_(wire_dtype=w, error_feedback=ef, outer_delay="eager"))
            for w, ef in DENSE]  # fmt: skip
    # the eager-updates paper's baseline: the same overlap with the stale average applied as it is
    out.append((DELAYED, d.with_(outer_delay="delayed")))
    return out


def bits_per_param_per_sync(r: RunResult) -> float:
    """What one worker sent per parameter per sync, in bits (values, indices, scales)."""
    if not r.syncs or not r.num_params:
        return float("nan")
    return 8.0 * r.bytes_sent / (r.num_params * r.syncs)


def _by_seed(results: list[RunResult], label: str) -> dict[int, RunResult]:
    return {int(r.config.get("seed", 0)): r for r in results if r.name == label}


def _family(labels: list[str], results: list[RunResult]) -> dict[str, stats.Paired]:
    """Each configuration's final loss relative to the reference's, paired by seed, with Holm's
    adjustment over every configuration of the study."""
    ref = _by_seed(results, REFERENCE)
    family = {}
    for label in labels:
        if label != REFERENCE:
            runs = _by_seed(results, label)
            family[label] = stats.paired_diffs(
                [
                    runs[s].final_loss / ref[s].final_loss - 1
                    for s in sorted(ref)
                    if s in runs and ref[s].final_loss
                ]
            )
    return stats.holm_family(family)


def _bits_cell(bits: list[float]) -> str:
    finite = [b for b in bits if np.isfinite(b)]
    return f"{float(np.mean(finite)):.3g}" if finite else "n/a"


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
    family = _family(labels, results)
    ref_bytes = sum(r.bytes_sent for r in ref.values()) / max(len(ref), 1)
    lines = table_head(
        target,
        [
            f"final loss vs {REFERENCE} (paired, 95 % interval, Holm p)",
            "bytes sent/worker (MB)",
            "fp32 bytes / these",
            "bits/param/sync",
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
            f"{cell([b / 1e6 for b in sent], '{:.3f}')} | {ratio:.1f}x | "
            f"{_bits_cell([bits_per_param_per_sync(r) for r in runs])} | {goal} |"
        )
    eager, delayed = _by_seed(results, EAGER_FP32), _by_seed(results, DELAYED)
    if eager and delayed:  # declared with the study: eager against its paper's baseline, one comparison
        both = [s for s in sorted(eager) if s in delayed and delayed[s].final_loss]
        d = stats.paired_diffs([eager[s].final_loss / delayed[s].final_loss - 1 for s in both])
        lines += [
            "",
            f"{EAGER_FP32} against {DELAYED} (the naive delayed update), paired: {d.cell('{:+.2%}')}",
        ]
    lines += [
        "",
        f"goal: ≥ {BYTES_GOAL:g}x fewer bytes than fp32 at a final loss within +{LOSS_GOAL:.1%} of "
        f"{REFERENCE} (the interval's upper end), stretch ≥ {STRETCH_GOAL:g}x; eager: within "
        f"+{LOSS_GOAL:.1%} of blocking DiLoCo. Bytes: what each worker sent (values, indices, scales); "
        "bits/param/sync: those bytes per parameter per sync, i.e. on the wire, not the payload: a ring "
        "all-reduce sends 2(W-1)/W payloads per worker (fp32: 48 bits at 4 workers), top-k's all-gather "
        "W-1 (its payload is sent to every other worker), LOSCAR's sparse all-reduce 2(W-1)/W of its "
        "mask's values.",
    ]
    return "\n".join(lines)


def headline(data: dict) -> str:
    """The study in a few lines for a front page (``lowcomm report --headline``): whether the goal is
    met, the most compression within +0.5 %, the best configuration at ≥ 146×, and eager fp32; each
    with its ratio of bytes and its loss against fp32 DiLoCo (mean and paired 95 % interval)."""
    results = runs_of(data)
    labels = labels_of(results)
    family = _family(labels, results)
    mean_bytes = {lb: float(np.mean([r.bytes_sent for r in results if r.name == lb])) for lb in labels}
    ratio = {lb: mean_bytes[REFERENCE] / b if b else float("nan") for lb, b in mean_bytes.items()}

    def said(label: str, bytes_too: bool = True) -> str:
        p = family[label]
        what = f"{label}, {ratio[label]:.3g}× fewer bytes" if bytes_too else label
        if p.ci_low is None:
            return f"{what}: {p.mean:+.1%} (too few seeds for an interval)"
        return f"{what}: {p.mean:+.1%} [{p.ci_low:+.1%}, {p.ci_high:+.1%}]"

    lossy = [lb for lb in labels if lb != REFERENCE and not lb.startswith("DiLoCo eager")]
    within = [lb for lb in lossy if family[lb].ci_high is not None and family[lb].ci_high <= LOSS_GOAL]
    at_goal = [lb for lb in lossy if ratio[lb] >= BYTES_GOAL and family[lb].n]
    met = [lb for lb in within if ratio[lb] >= BYTES_GOAL]
    seeds = data.get("seeds") or max(sum(r.name == REFERENCE for r in results), 1)
    workers = (data.get("base") or {}).get("workers", "?")
    lines = [
        f"**The compression frontier** (`lowcomm compare --study frontier`: wire formats, top-k, eager "
        f"and LOSCAR's mask on the byte-level LM, {workers} workers, {seeds} seeds; final loss against "
        f"fp32 DiLoCo, mean and paired 95 % "
        f"interval): the goal, ≥ {BYTES_GOAL:g}× fewer bytes at a loss within +{LOSS_GOAL:.1%}, is "
        + (f"**met** by {', '.join(met)}." if met else "**missed** at this scale."),
    ]
    named = set()
    if within:
        named.add(best := max(within, key=ratio.get))
        lines.append(f"Most compression within +{LOSS_GOAL:.1%}: {said(best)}.")
    if at_goal:
        named.add(best := min(at_goal, key=lambda lb: family[lb].mean))
        lines.append(f"Closest at ≥ {BYTES_GOAL:g}×: {said(best)}.")
    if PUBLISHED_TOPK in family and PUBLISHED_TOPK not in named:
        lines.append(f"The published top-k point: {said(PUBLISHED_TOPK)}.")
    if "DiLoCo eager fp32" in family:
        lines.append(f"Eager overlap of a whole outer round: {said('DiLoCo eager fp32', bytes_too=False)}.")
    return " ".join(lines)


def plot(labels: list[str], results: list[RunResult], path: Path) -> None:
    """The frontier: each configuration's final loss gap to fp32 DiLoCo (paired by seed, mean and 95 %
    interval) against the bits per parameter per sync it sent (log scale), with the +0.5 % goal."""
    import matplotlib  # optional (the cli extra): only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    family = _family(labels, results)
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    markers = {"DiLoCo eager": "s", "DiLoCo topk": "^", "LOSCAR": "D"}
    for i, label in enumerate(labels):
        runs = [r for r in results if r.name == label]
        if not runs:
            continue
        bits = [b for b in (bits_per_param_per_sync(r) for r in runs) if np.isfinite(b)]
        if not bits:
            continue
        x = float(np.mean(bits))
        color = plt.get_cmap("tab20")(i % 20)
        marker = next((m for prefix, m in markers.items() if label.startswith(prefix)), "o")
        if label == REFERENCE:
            ax.plot(x, 0.0, marker="*", ms=12, color="k", ls="none", label=f"{label} (reference)")
            continue
        rel = family[label]
        if rel.n == 0:
            continue
        y = 100 * rel.mean
        lo = 100 * rel.ci_low if rel.ci_low is not None else y
        hi = 100 * rel.ci_high if rel.ci_high is not None else y
        ax.errorbar(x, y, yerr=[[y - lo], [hi - y]], fmt=marker, color=color, capsize=3, label=label)
    ax.axhspan(
        -100 * LOSS_GOAL,
        100 * LOSS_GOAL,
        color="tab:green",
        alpha=0.12,
        label="within ±0.5 % (goal: ≤ +0.5 %)",
    )
    ax.axhline(0.0, color="k", lw=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("bits per parameter per sync, per worker (log scale; fp32 = 32)")
    ax.set_ylabel("final loss vs fp32 DiLoCo (%, paired by seed, 95 % interval)")
    ax.set_title("The compression frontier: loss gap against bits on the wire")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
