"""`lowcomm compare --study frontier`: its configurations, its table's reading of the goals, and a
real run of its extreme configurations on a tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lowcomm_kernels.train import study_frontier
from lowcomm_kernels.train.report import EvalPoint, RunResult
from lowcomm_kernels.train.spec import TrainSpec
from lowcomm_kernels.train.study_frontier import REFERENCE, configs, table

BASE = TrainSpec(steps=200, sync_every=20, workers=2)


def test_every_configuration_is_one_change_against_fp32_diloco():
    cfg = dict(configs(BASE))
    assert len(cfg) == 19
    ref = cfg[REFERENCE]
    assert (ref.method, ref.wire_dtype, ref.error_feedback, ref.outer_delay) == (
        "diloco",
        "fp32",
        False,
        "none",
    )
    dense = {"fp32", "bf16", "int8", "int4", "fp4_e2m1", "fp4_e3m0"}
    blocking = {s.wire_dtype for s in cfg.values() if s.method == "diloco" and s.outer_delay == "none"}
    eager = {s.wire_dtype for s in cfg.values() if s.outer_delay == "eager"}
    assert blocking == dense | {"topk"} and eager == dense  # every dense format with and without eager
    delayed = [(s.wire_dtype, s.error_feedback) for s in cfg.values() if s.outer_delay == "delayed"]
    assert delayed == [("fp32", False)]  # eager's baseline, the naive delayed update, at fp32
    assert all(
        s.error_feedback == (s.wire_dtype not in ("fp32", "bf16", "topk"))
        for s in cfg.values()
        if s.method == "diloco"
    )
    topk = {k: s for k, s in cfg.items() if s.wire_dtype == "topk"}
    lr = BASE.outer_lr
    assert sorted((s.topk_k, s.topk_bits, s.outer_lr) for s in topk.values()) == [
        (32, 1, lr), (32, 2, lr), (64, 1, lr), (64, 2, lr), (64, 2, 1.0)
    ]  # fmt: skip
    sgd = cfg["DiLoCo topk k=64 2-bit, outer SGD lr 1"]
    assert (sgd.outer_lr, sgd.outer_momentum) == (1.0, 0.0)
    # LOSCAR at the bytes of top-k k=64 2-bit: fp32 values at a shared mask, one round per H steps
    (loscar,) = [s for s in cfg.values() if s.method == "loscar"]
    assert loscar.density == pytest.approx((64 * 2 + 64 * 12 + 32) / (4096 * 32), abs=1e-4)
    assert (loscar.local_steps, loscar.overlap_steps) == (BASE.sync_every, 0)
    for spec in cfg.values():
        spec.validate()  # a bad combination (e.g. a knob the method refuses) fails here


def test_bits_per_parameter_per_sync():
    r = RunResult("x", "diloco", {}, bytes_sent=4 * 1000 * 10, syncs=10, num_params=1000)
    assert study_frontier.bits_per_param_per_sync(r) == 32.0  # fp32: 32 bits per parameter per sync
    assert math.isnan(study_frontier.bits_per_param_per_sync(RunResult("x", "diloco", {})))  # no syncs


def _run(label: str, seed: int, loss: float, sent: float) -> RunResult:
    # 10 syncs of 3.75M parameters: fp32's 150 MB is 32 bits per parameter per sync
    point = EvalPoint(200, 1.0, sent, 0.0, loss)
    return RunResult(
        label, "diloco", {"seed": seed}, [point], bytes_sent=sent, syncs=10, num_params=3_750_000
    )


def test_the_table_reads_the_goals_from_the_interval_not_the_mean():
    ref = [_run(REFERENCE, s, 2.0 + 0.01 * s, 150e6) for s in range(3)]
    # ~150x fewer bytes, loss within 0.1 % on every seed: the goal is met
    good = [_run("DiLoCo topk k=64 2-bit", s, (2.0 + 0.01 * s) * (1.001 + 0.0001 * s), 1e6) for s in range(3)]
    # ~300x fewer bytes, loss 2 % worse: the stretch bytes but not the loss
    bad = [_run("DiLoCo topk k=32 2-bit", s, (2.0 + 0.01 * s) * (1.02 + 0.001 * s), 0.5e6) for s in range(3)]
    # the mean inside +0.5 % but an interval reaching past it: missed (the upper end decides)
    wide = [_run("DiLoCo int4+EF", s, (2.0 + 0.01 * s) * (1 + [-0.01, 0.0, 0.02][s]), 20e6) for s in range(3)]
    eager = [_run("DiLoCo eager fp32", s, (2.0 + 0.01 * s) * 0.999, 150e6) for s in range(3)]
    labels = [
        REFERENCE,
        "DiLoCo topk k=64 2-bit",
        "DiLoCo topk k=32 2-bit",
        "DiLoCo int4+EF",
        "DiLoCo eager fp32",
    ]
    md = table("frontier", labels, ref + good + bad + wide + eager, 2.5)
    rows = {
        line.split(" | ")[0].lstrip("| "): line for line in md.splitlines() if line.startswith("| DiLoCo")
    }
    assert rows[REFERENCE].endswith("| 1.0x | 32 | - |")
    assert "| 150.0x | 0.213 | goal met |" in rows["DiLoCo topk k=64 2-bit"]
    assert "| 300.0x | 0.107 | stretch bytes, loss missed |" in rows["DiLoCo topk k=32 2-bit"]
    assert rows["DiLoCo int4+EF"].endswith("| loss missed |")
    assert rows["DiLoCo eager fp32"].endswith("| eager goal met |")
    assert "Holm p=" in rows["DiLoCo topk k=32 2-bit"]
    assert "against DiLoCo delayed" not in md  # no delayed runs: no comparison line
    # eager against the naive delayed update, paired by seed: 0.999 / 1.01 - 1 on every seed
    delayed = [_run("DiLoCo delayed fp32", s, (2.0 + 0.01 * s) * 1.01, 150e6) for s in (2, 0, 1)]
    md = table("frontier", [*labels, "DiLoCo delayed fp32"], ref + good + bad + wide + eager + delayed, 2.5)
    (line,) = [ln for ln in md.splitlines() if ln.startswith("DiLoCo eager fp32 against DiLoCo delayed")]
    assert f"{0.999 / 1.01 - 1:+.2%}" in line


@pytest.mark.slow
def test_the_extreme_configurations_run_and_send_what_the_table_says(tmp_path):
    from lowcomm_kernels.train.corpus import load_corpus
    from lowcomm_kernels.train.model import ModelConfig
    from lowcomm_kernels.train.studykit import run_resumable

    tiny = TrainSpec(
        workers=2, steps=8, batch_size=2, sync_every=4, eval_every=4, eval_bytes=256, warmup_steps=1,
        latency_s=0.001, model=ModelConfig(dim=32, n_layers=2, n_heads=2, mlp_hidden=64, seq_len=16),
    )  # fmt: skip
    matched = f"LOSCAR d={study_frontier.MATCHED_DENSITY:g} (payload of topk k=64 2-bit)"
    pick = {REFERENCE, "DiLoCo topk k=32 2-bit", "DiLoCo topk k=64 2-bit", matched}
    cfg = [(label, [spec.with_(name=label)]) for label, spec in configs(tiny) if label in pick]
    corpus = load_corpus(None, max_train_bytes=200_000, max_val_bytes=50_000)
    results = run_resumable(cfg, corpus, tmp_path, progress=False)
    by = {r.name: r for r in results}
    ratio = by[REFERENCE].bytes_sent / by["DiLoCo topk k=32 2-bit"].bytes_sent
    assert ratio > 100  # 2 syncs of a ~30k-parameter model: fp32 against 32 of 4096 at 2 bits + indices
    # LOSCAR's random mask sends about the bytes of top-k k=64 at 2 bits (its matched point)
    assert 0.7 < by[matched].bytes_sent / by["DiLoCo topk k=64 2-bit"].bytes_sent < 1.4
    assert by[matched].syncs == by[REFERENCE].syncs == 2  # one round per H steps, as DiLoCo's syncs
    md = table("frontier", [REFERENCE, "DiLoCo topk k=32 2-bit"], results, 9.0)
    assert f"{ratio:.1f}x" in md and "too few seeds" in md  # one seed: no interval, no verdict
    assert study_frontier.NAME == "frontier"


def _data(runs: list[RunResult]) -> dict:
    return {"study": "frontier", "seeds": 3, "base": {"workers": 4}, "runs": [r.to_dict() for r in runs]}


def test_the_headline_says_whether_the_goal_is_met_with_intervals():
    ref = [_run(REFERENCE, s, 2.0 + 0.01 * s, 150e6) for s in range(3)]
    int4 = [_run("DiLoCo int4+EF", s, (2.0 + 0.01 * s) * (1.001 + 0.0001 * s), 20e6) for s in range(3)]
    topk = [_run("DiLoCo topk k=64 2-bit", s, (2.0 + 0.01 * s) * (1.02 + 0.001 * s), 1e6) for s in range(3)]
    eager = [_run("DiLoCo eager fp32", s, (2.0 + 0.01 * s) * 1.05, 150e6) for s in range(3)]
    text = study_frontier.headline(_data(ref + int4 + topk + eager))
    assert "4 workers, 3 seeds" in text and "is **missed** at this scale" in text
    assert "Most compression within +0.5%: DiLoCo int4+EF, 7.5× fewer bytes: +0.1% [" in text
    assert "Closest at ≥ 146×: DiLoCo topk k=64 2-bit, 150× fewer bytes: +2.1% [" in text
    assert "Eager overlap of a whole outer round: DiLoCo eager fp32: +5.0% [" in text
    # top-k within +0.5 % on every seed: the goal is met, by name
    good = [_run("DiLoCo topk k=64 2-bit", s, (2.0 + 0.01 * s) * (1.001 + 0.0001 * s), 1e6) for s in range(3)]
    text = study_frontier.headline(_data(ref + good))
    assert "is **met** by DiLoCo topk k=64 2-bit." in text


def test_a_headline_marker_renders_and_other_files_are_refused(tmp_path, capsys):
    from lowcomm_kernels.cli import main
    from lowcomm_kernels.train import render

    ref = [_run(REFERENCE, s, 2.0 + 0.01 * s, 150e6) for s in range(3)]
    topk = [_run("DiLoCo topk k=64 2-bit", s, (2.0 + 0.01 * s) * (1.02 + 0.001 * s), 1e6) for s in range(3)]
    (tmp_path / "pyproject.toml").write_text("")
    run = tmp_path / "runs" / "frontier"
    run.mkdir(parents=True)
    data = dict(_data(ref + topk), target_val_loss=2.5, command="lowcomm compare --study frontier")
    (run / "results.json").write_text(json.dumps(data))
    doc = tmp_path / "page.md"
    doc.write_text("<!-- report: lowcomm report --headline runs/frontier -->\nold\n<!-- /report -->\n")
    assert main(["report", "--update-docs", str(doc)]) == 0
    body = doc.read_text()
    assert (
        "**The compression frontier**" in body
        and "Source: `runs/frontier`" in body
        and "| DiLoCo" not in body
    )
    assert main(["report", "--update-docs", "--check", str(doc)]) == 0
    text, _ = render.render(["runs/frontier"], base=tmp_path, headlines=True)
    assert text in body
    # a results file of another kind (here the committed main-job run) is refused by name
    root = Path(__file__).resolve().parents[2]
    capsys.readouterr()
    assert main(["report", "--headline", str(root / "docs" / "data" / "compare")]) == 2
    assert "--headline reads a study that has one (frontier)" in capsys.readouterr().err
