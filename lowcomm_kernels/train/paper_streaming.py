"""The Streaming DiLoCo paper's findings beside ours: ``lowcomm report --paper streaming-diloco PATH...``.

The paper: A. Douillard, Y. Donchev et al., *Streaming DiLoCo with overlapping communication: Towards
a Distributed Free Lunch*, arXiv 2501.18512 v1 (30 Jan 2025), https://arxiv.org/abs/2501.18512v1.
Its setting (§3.2, §3.3, supplementary Table 2): Chinchilla-architecture transformers of 35M to 4B
parameters (QK-norm, z-loss 1e-4) trained from scratch on C4 with a sequence length of 1,024 and the
Chinchilla-optimal token budget (700M tokens at 35M, 25B at 1B), M = 2 DiLoCo replicas, AdamW inside,
Nesterov outside (outer lr 0.4 for DiLoCo and Streaming DiLoCo alike), fragments of 3 transformer
layers in the strided pattern, overlap τ = 1 and E3M0 4-bit outer gradients (accumulated in FP32) in
its main experiments, H = 30 or 100; the ablations on a 500M model (11B tokens of C4). One run per
configuration.

Ours: the committed studies that ran the same comparisons on this project's byte-level LM (the
Python standard library's source, 2 or 4 workers, 20,688 to 230,976 parameters, 200 to 2,000 steps,
3 or 5 seeds), named by the study each row reads (:func:`rows`). Every row is a relative effect on the
final loss, method / baseline − 1 (``paper_vs_ours``): for the paper from the numbers of its tables,
for ours per seed (the same seed on both sides, from one results.json) with its 95 % t interval.
Nothing of ours is copied here: the section is rendered from the results files given on the
command line, and a configuration a study no longer runs under its label stops the rendering with
its name.

Where the paper gives no number (its quantization ablation is a figure, its overlap ablation a
figure with a bound in the text) the row carries its words or its bound, and the verdict reads our
interval against 0 or against the bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import paper_vs_ours
from .errors import UsageError
from .spec import METHOD_LABELS
from .studykit import runs_of

NAME = "streaming-diloco"
PAPER = "arXiv 2501.18512 v1"

# ---- the paper's numbers, as printed (each with its table) ----

DP, DILOCO_30, STREAMING_30, STREAMING_100 = (
    "Data-Parallel",
    "DiLoCo H=30",
    "Streaming DiLoCo with overlapped FP4 com., H=30",
    "Streaming DiLoCo with overlapped FP4 com., H=100",
)
#: Table 5 (supplementary): evaluation loss on C4's validation set after the Chinchilla-optimal
#: number of tokens, M = 2 replicas, one run each; model size -> method -> loss. (4B ran only
#: Data-Parallel, 2.25, and Streaming DiLoCo H=100, 2.26; not used here.)
TABLE5_EVAL_LOSS: dict[str, dict[str, float]] = {
    "35M": {DP: 3.51, DILOCO_30: 3.54, STREAMING_30: 3.53, STREAMING_100: 3.56},
    "100M": {DP: 3.19, DILOCO_30: 3.21, STREAMING_30: 3.21, STREAMING_100: 3.22},
    "200M": {DP: 2.97, DILOCO_30: 2.98, STREAMING_30: 2.98, STREAMING_100: 3.00},
    "300M": {DP: 2.80, DILOCO_30: 2.81, STREAMING_30: 2.81, STREAMING_100: 2.83},
    "500M": {DP: 2.67, DILOCO_30: 2.68, STREAMING_30: 2.67, STREAMING_100: 2.69},
    "1B": {DP: 2.49, DILOCO_30: 2.49, STREAMING_30: 2.48, STREAMING_100: 2.50},
}
#: the scale each Table 5 claim is read at: the smallest, the nearest to ours
SCALE = "35M"
#: Table 3 (supplementary, "Which parameters to evaluate?"): evaluation loss of the first replica,
#: of the replicas' average and of the outer (globally shared) parameters
TABLE3_EVAL_LOSS = {"first replica": 2.77, "replicas average": 2.68, "outer parameters": 2.67}
#: §3.3.2 (Figure 8, the 500M ablation, τ from 1 to 20, α = 0 and 0.5): "the degradation in
#: evaluation loss is negligible up to an overlap of 10 inner steps (< 0.2%)"
OVERLAP_BOUND = 0.002
#: §3.3.3 (Figure 11) and §2.4: lowering the outer gradients' precision from float32 to float4
#: "does not affect the performance"; "no sign of performance regression" (no number given)
QUANT_WORDS = "no regression"
#: §3.3.3 (Figure 11): setting some values of the outer gradients to zero (FedDropout, Dare, Top-K)
#: "is significantly worse" (than lowering their precision; no number given)
DROPPING_SOURCE = "§3.3.3, Fig. 11: dropping values 'significantly worse'"

# ---- our configurations, by study (the labels the studies give them) ----

COCODC_PAPER, OVERLAP, WIRE, FRONTIER, MATCHED, COMPARE = (
    "cocodc-paper",
    "overlap",
    "wire",
    "frontier",
    "matched",
    "compare",  # a `lowcomm compare` results.json (no study): one seed of each method
)
STREAM_K, STREAM_2K = "Streaming DiLoCo, 4 syncs/H", "Streaming DiLoCo, 8 syncs/H"

#: what a side of a row reads from a run: the final loss of the workers' own models (mean), of their
#: averaged parameters, or of the first worker's own model
MEASURES = ("final", "averaged model", "first worker")


@dataclass(frozen=True)
class Row:
    """One published comparison and the two configurations of one study that measure it for us.
    ``what`` may name ``{H}`` and ``{H_base}``: the sync_every the two configurations ran with."""

    what: str
    study: str
    method: str
    baseline: str
    paper: float | None
    source: str
    measure: str = "final"
    base_measure: str = "final"
    direction: int = 0  # a claim with no number: the direction the paper states (+1: higher loss)
    words: str = ""
    bound: float | None = None


def _ratio(a: float, b: float) -> float:
    return a / b - 1.0


def _table5(method: str, baseline: str, note: str = "") -> tuple[float, str]:
    """The paper's relative effect at ``SCALE`` and the cell naming its numbers (with the range over
    the scales 35M to 1B); ``note`` follows the table's number."""
    at = TABLE5_EVAL_LOSS[SCALE]
    over = [_ratio(row[method], row[baseline]) for row in TABLE5_EVAL_LOSS.values()]
    first, last = next(iter(TABLE5_EVAL_LOSS)), list(TABLE5_EVAL_LOSS)[-1]
    return _ratio(at[method], at[baseline]), (
        f"Table 5{note}, {SCALE}: {at[method]:.2f} vs {at[baseline]:.2f} "
        f"({first}–{last}: {100 * min(over):+.1f}% to {100 * max(over):+.1f}%)"
    )


def rows() -> list[Row]:
    """The section's comparisons, in the order of the table."""
    vs_diloco, vs_diloco_src = _table5(STREAMING_30, DILOCO_30)
    vs_dp, vs_dp_src = _table5(STREAMING_30, DP)
    longer_h, longer_h_src = _table5(STREAMING_100, STREAMING_30, ", H = 100 vs 30")
    t3 = TABLE3_EVAL_LOSS
    table3 = _ratio(t3["replicas average"], t3["first replica"])
    t3_src = f"Table 3: {t3['replicas average']:.2f} vs {t3['first replica']:.2f}"
    fig8 = f"§3.3.2, Fig. 8: < {100 * OVERLAP_BOUND:.1f}% up to τ = 10"
    return [
        Row(
            "Streaming DiLoCo vs DiLoCo (`cocodc-paper`)",
            COCODC_PAPER,
            STREAM_K,
            "DiLoCo",
            vs_diloco,
            vs_diloco_src,
        ),
        Row(
            "Streaming DiLoCo vs DiLoCo, averaged models (`cocodc-paper`)",
            COCODC_PAPER,
            STREAM_K,
            "DiLoCo",
            vs_diloco,
            vs_diloco_src,
            measure="averaged model",
            base_measure="averaged model",
        ),
        Row(
            "Streaming DiLoCo vs DiLoCo (`compare`)",
            COMPARE,
            METHOD_LABELS["streaming"],
            METHOD_LABELS["diloco"],
            vs_diloco,
            vs_diloco_src,
        ),
        Row(
            "Streaming DiLoCo vs data-parallel (`compare`)",
            COMPARE,
            METHOD_LABELS["streaming"],
            METHOD_LABELS["dp"],
            vs_dp,
            vs_dp_src,
        ),
        Row(
            "Streaming DiLoCo, H = {H} vs {H_base} (`cocodc-paper`)",
            COCODC_PAPER,
            STREAM_K,
            STREAM_2K,
            longer_h,
            longer_h_src,
        ),
        Row(
            "Streaming DiLoCo, H = {H} vs {H_base} (`matched`)",
            MATCHED,
            STREAM_K,
            STREAM_2K,
            longer_h,
            longer_h_src,
        ),
        Row(
            "Streaming DiLoCo, overlap τ = 5 vs 1 (`overlap`)",
            OVERLAP,
            "Streaming DiLoCo tau=5",
            "Streaming DiLoCo tau=1",
            None,
            fig8,
            bound=OVERLAP_BOUND,
        ),
        Row(
            "Streaming DiLoCo, overlap τ = 10 vs 1 (`overlap`)",
            OVERLAP,
            "Streaming DiLoCo tau=10",
            "Streaming DiLoCo tau=1",
            None,
            fig8,
            bound=OVERLAP_BOUND,
        ),
        Row(
            "Streaming DiLoCo, E3M0 4-bit wire vs fp32 (`wire`)",
            WIRE,
            "Streaming DiLoCo fp4_e3m0",
            "Streaming DiLoCo fp32",
            None,
            "§2.4, §3.3.3, Fig. 11",
            words=QUANT_WORDS,
        ),
        Row(
            "DiLoCo, E3M0 4-bit wire with error feedback vs fp32 (`frontier`)",
            FRONTIER,
            "DiLoCo fp4_e3m0+EF",
            "DiLoCo fp32",
            None,
            "§2.4, §3.3.3, Fig. 11",
            words=QUANT_WORDS,
        ),
        Row(
            "DiLoCo, top-k (64 of 4,096 values, 2-bit) with error feedback vs fp32 (`frontier`)",
            FRONTIER,
            "DiLoCo topk k=64 2-bit",
            "DiLoCo fp32",
            None,
            DROPPING_SOURCE,
            direction=1,
        ),
        Row(
            "replicas' average vs first replica, Streaming DiLoCo (`cocodc-paper`)",
            COCODC_PAPER,
            STREAM_K,
            STREAM_K,
            table3,
            t3_src,
            measure="averaged model",
            base_measure="first worker",
        ),
    ]


def studies() -> list[str]:
    """The results files the section reads, by study name ("compare" for `lowcomm compare`)."""
    return list(dict.fromkeys(r.study for r in rows()))


def _value(run, measure: str) -> float | None:
    final = run.final_eval or {}
    if measure == "final":
        return run.final_loss
    if measure == "averaged model":
        v = final.get("val_loss_avg_model")
        return None if v is None else float(v)
    if measure == "first worker":
        workers = final.get("val_loss_workers") or []
        return float(workers[0]) if workers else None
    raise ValueError(f"unknown measure {measure!r}; one of {', '.join(MEASURES)}")


def _by_seed(data: dict, study: str, label: str, measure: str) -> dict[int, float | None]:
    runs = [r for r in runs_of(data) if r.name == label]
    if not runs:
        raise ValueError(f"the {study} results hold no configuration {label!r}")
    return {int(r.config.get("seed", 0)): _value(r, measure) for r in runs}


def _sync_every(data: dict, label: str) -> int:
    return int(next(r.config["sync_every"] for r in runs_of(data) if r.name == label))


def section(sources: dict[str, dict]) -> str:
    """Markdown: the paper's findings beside ours. ``sources``: each results.json's dict by its study
    name ("compare" for a `lowcomm compare` file); every study of :func:`studies` must be there."""
    missing = [s for s in studies() if s not in sources]
    if missing:
        raise UsageError(
            f"--paper {NAME} reads the results of {', '.join(studies())}; not given: {', '.join(missing)}"
        )
    claims, ours = [], {}
    for row in rows():
        data = sources[row.study]
        a = _by_seed(data, row.study, row.method, row.measure)
        b = _by_seed(data, row.study, row.baseline, row.base_measure)
        seeds = sorted(set(a) | set(b))
        what = row.what.format(H=_sync_every(data, row.method), H_base=_sync_every(data, row.baseline))
        claim = paper_vs_ours.Claim(
            what,
            "final loss",
            row.paper,
            row.source,
            row.method,
            row.baseline,
            row.direction,
            words=row.words,
            bound=row.bound,
        )
        claims.append(claim)
        ours[what, claim.metric] = paper_vs_ours.relative(
            [a.get(s) for s in seeds], [b.get(s) for s in seeds]
        )
    head = (
        f"**The Streaming DiLoCo paper's findings beside ours** ({PAPER}; relative effects on the final "
        "loss, method / baseline − 1: the paper's from its tables at one run each, ours per seed with "
        "the 95 % interval; the study each row reads in brackets)"
    )
    return f"{head}\n\n{paper_vs_ours.table(claims, ours, 'the paper (one run)')}"
