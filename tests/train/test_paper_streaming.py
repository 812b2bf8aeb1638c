"""The Streaming DiLoCo paper beside ours (``lowcomm report --paper streaming-diloco``): every row names
configurations the studies run and the committed files hold, the paper's effects are its tables'
ratios, ours the per-seed ratios, and the section renders from the files given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowcomm_kernels.train import paper_streaming, paper_vs_ours, render
from lowcomm_kernels.train.errors import UsageError
from lowcomm_kernels.train.report import EvalPoint, RunResult
from lowcomm_kernels.train.spec import METHOD_LABELS, TrainSpec
from lowcomm_kernels.train.studies import STUDIES
from lowcomm_kernels.train.studykit import labels_of, runs_of

ROOT = Path(__file__).resolve().parents[2]
#: the committed results each study of the section is read from (as the docs' marker names them)
DATA = {s: ROOT / "docs" / "data" / s / "results.json" for s in paper_streaming.studies()}


def _committed(study: str) -> dict:
    return json.loads(DATA[study].read_text(encoding="utf-8"))


def _configured_labels(study: str, data: dict) -> list[str]:
    """The labels the study's code gives its configurations on the committed run's base; for
    ``lowcomm compare`` the methods' labels."""
    if study == paper_streaming.COMPARE:
        return list(METHOD_LABELS.values())
    b = data["base"]
    base = TrainSpec(
        steps=b["steps"],
        sync_every=b["sync_every"],
        num_fragments=b["num_fragments"],
        fragment_sync_delay=b["fragment_sync_delay"],
        workers=b["workers"],
    )
    return [label for label, _ in STUDIES[study](base)]


@pytest.mark.parametrize("row", paper_streaming.rows(), ids=lambda r: r.what)
def test_every_row_names_configurations_the_study_runs_and_the_committed_file_holds(row):
    data = _committed(row.study)
    assert data.get("study", paper_streaming.COMPARE) == row.study
    configured, committed = _configured_labels(row.study, data), labels_of(runs_of(data))
    for label in (row.method, row.baseline):
        assert label in configured, f"{row.study} no longer configures {label!r}: {configured}"
        assert label in committed, f"{DATA[row.study]} holds no {label!r}"
    assert row.measure in paper_streaming.MEASURES and row.base_measure in paper_streaming.MEASURES
    # the paper's side: a number, a bound, words or a direction
    assert (row.paper is None) == (row.bound is not None or bool(row.words) or row.direction != 0)


def test_the_papers_effects_are_its_tables_ratios():
    rows = {r.what: r for r in paper_streaming.rows()}
    t5 = paper_streaming.TABLE5_EVAL_LOSS["35M"]
    assert t5[paper_streaming.STREAMING_30] == 3.53 and t5[paper_streaming.DILOCO_30] == 3.54
    r = rows["Streaming DiLoCo vs DiLoCo (`cocodc-paper`)"]
    assert r.paper == pytest.approx(3.53 / 3.54 - 1) and (r.method, r.baseline) == (
        paper_streaming.STREAM_K,
        "DiLoCo",
    )
    assert "3.53 vs 3.54" in r.source and "35M–1B: -0.4% to +0.0%" in r.source
    r = rows["Streaming DiLoCo vs data-parallel (`compare`)"]
    assert r.paper == pytest.approx(3.53 / 3.51 - 1) and r.baseline == METHOD_LABELS["dp"]
    r = rows["Streaming DiLoCo, H = {H} vs {H_base} (`cocodc-paper`)"]
    assert r.paper == pytest.approx(3.56 / 3.53 - 1)
    r = rows["replicas' average vs first replica, Streaming DiLoCo (`cocodc-paper`)"]
    assert r.paper == pytest.approx(2.68 / 2.77 - 1) and (r.measure, r.base_measure) == (
        "averaged model",
        "first worker",
    )
    taus = [r for r in rows.values() if r.study == paper_streaming.OVERLAP]
    assert len(taus) == 2 and all(r.bound == 0.002 and r.paper is None for r in taus)


def _run(name: str, seed: int, loss: float, sync_every: int = 50, workers=None, avg=None) -> RunResult:
    final = {
        "eval_bytes_scored": 1024,
        "val_loss": loss,
        "val_loss_workers": workers or [loss] * 4,
        "val_loss_avg_model": loss if avg is None else avg,
    }
    return RunResult(
        name,
        "streaming",
        {"seed": seed, "sync_every": sync_every},
        points=[EvalPoint(0, 0.0, 0.0, 0.0, 5.0)],
        final_eval=final,
    )


def _hand_made() -> dict[str, dict]:
    """Every label of the section at loss 2.0 on seeds 0 and 1, except a few with known ratios."""
    runs: dict[str, dict[tuple[str, int], RunResult]] = {}
    for row in paper_streaming.rows():
        seeds = (0,) if row.study == paper_streaming.COMPARE else (0, 1)
        for label in (row.method, row.baseline):
            for s in seeds:
                h = 25 if label == paper_streaming.STREAM_2K else 50
                runs.setdefault(row.study, {})[label, s] = _run(label, s, 2.0, sync_every=h)
    ov = runs[paper_streaming.OVERLAP]
    ov["Streaming DiLoCo tau=5", 0] = _run("Streaming DiLoCo tau=5", 0, 2.2)  # +10 %
    ov["Streaming DiLoCo tau=5", 1] = _run("Streaming DiLoCo tau=5", 1, 2.22)  # +11 %
    ov["Streaming DiLoCo tau=10", 0] = _run("Streaming DiLoCo tau=10", 0, 2.002)  # +0.1 %
    ov["Streaming DiLoCo tau=10", 1] = _run("Streaming DiLoCo tau=10", 1, 2.002)
    cp = runs[paper_streaming.COCODC_PAPER]
    for s, (first, avg) in enumerate(((2.5, 2.0), (2.0, 1.8))):  # averaged / first − 1: −20 %, −10 %
        cp[paper_streaming.STREAM_K, s] = _run(
            paper_streaming.STREAM_K, s, 2.0, workers=[first, 2.0, 2.0, 2.0], avg=avg
        )
    cmp_ = runs[paper_streaming.COMPARE]
    cmp_[METHOD_LABELS["dp"], 0] = _run(METHOD_LABELS["dp"], 0, 1.6)  # 2.0 / 1.6 − 1 = +25 %, one seed
    out = {}
    for study, by in runs.items():
        data = {"runs": [r.to_dict() for r in by.values()]}
        if study != paper_streaming.COMPARE:
            data["study"] = study
        out[study] = data
    return out


def _row(md: str, what: str) -> str:
    (line,) = [ln for ln in md.splitlines() if ln.startswith(f"| {what} |")]
    return line


def test_ours_is_the_mean_per_seed_ratio_read_against_the_papers_value_or_bound():
    md = paper_streaming.section(_hand_made())
    tau5 = _row(md, "Streaming DiLoCo, overlap τ = 5 vs 1 (`overlap`)")
    expected = paper_vs_ours.relative([2.2, 2.22], [2.0, 2.0])
    assert expected.mean == pytest.approx(0.105) and expected.ci_low > 0.002  # beyond the bound
    cell = f"| {100 * expected.mean:+.1f}% [{100 * expected.ci_low:+.1f}%, {100 * expected.ci_high:+.1f}%] |"
    assert cell in tau5 and "| a cost < 0.2% |" in tau5 and "| 2 |" in tau5
    assert tau5.endswith("| outside the paper's bound |")
    tau10 = _row(md, "Streaming DiLoCo, overlap τ = 10 vs 1 (`overlap`)")
    assert "| +0.1% [+0.1%, +0.1%] |" in tau10 and tau10.endswith("| within the paper's bound |")
    avg = _row(md, "replicas' average vs first replica, Streaming DiLoCo (`cocodc-paper`)")
    assert "| -15.0% [" in avg and "| -3.2% |" in avg and "| Table 3: 2.68 vs 2.77 |" in avg
    dp = _row(md, "Streaming DiLoCo vs data-parallel (`compare`)")
    assert "| +25.0% | 1 | too few seeds |" in dp  # one seed: no interval, no verdict
    same = _row(md, "Streaming DiLoCo vs DiLoCo (`cocodc-paper`)")
    assert "| +0.0% [+0.0%, +0.0%] | 2 |" in same
    assert "| Streaming DiLoCo, H = 50 vs 25 (`matched`) |" in md  # H from the runs' configs


@pytest.mark.parametrize(
    "lo, hi, expected",
    [
        (-0.001, 0.0015, "within the paper's bound"),
        (0.004, 0.012, "outside the paper's bound"),
        (-0.012, -0.004, "within the paper's bound"),  # a bound on a cost: an improvement is within
        (-0.006, 0.03, "not resolved"),
    ],
)
def test_a_bound_is_read_against_the_interval(lo, hi, expected):
    ours = paper_vs_ours.stats.Paired(3, (lo + hi) / 2, 0.1, 1.0, 2, 0.5, lo, hi, None, None)
    assert paper_vs_ours.verdict(ours, None, bound=0.002) == expected


def test_a_missing_study_or_a_renamed_configuration_is_named():
    sources = _hand_made()
    del sources[paper_streaming.WIRE]
    with pytest.raises(UsageError, match="not given: wire"):
        paper_streaming.section(sources)
    sources = _hand_made()
    runs = sources[paper_streaming.OVERLAP]["runs"]
    for r in runs:
        r["name"] = r["name"].replace("tau=", "τ=")
    with pytest.raises(ValueError, match="no configuration 'Streaming DiLoCo tau=5'"):
        paper_streaming.section(sources)


def test_a_marker_can_ask_for_a_paper_and_the_section_renders_from_the_committed_files():
    paths, heads, paper = render._marker_args("lowcomm report --paper streaming-diloco a b", "doc:1")
    assert (paths, heads, paper) == (["a", "b"], False, "streaming-diloco")
    with pytest.raises(UsageError, match="paths only"):
        render._marker_args("lowcomm report --paper streaming-diloco", "doc:1")
    labels = [str(p.parent.relative_to(ROOT)) for p in DATA.values()]
    text, plots = render.render(labels, base=ROOT, paper=paper_streaming.NAME)
    assert plots == [] and text.count("\n| ") == len(paper_streaming.rows()) + 1  # head + rows
    assert "Sources: `docs/data/" in text
    with pytest.raises(UsageError, match="no such paper section"):
        render.render(labels, base=ROOT, paper="nope")
    with pytest.raises(UsageError, match="two results files of overlap"):
        render.render([*labels, "docs/data/overlap"], base=ROOT, paper=paper_streaming.NAME)
