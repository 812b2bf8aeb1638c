"""`lowcomm compare --study frontier`: its configurations, its table's reading of the goals, and a
real run of its extreme configurations on a tiny model."""

from __future__ import annotations

import pytest

from lowcomm_kernels.train import study_frontier
from lowcomm_kernels.train.report import EvalPoint, RunResult
from lowcomm_kernels.train.spec import TrainSpec
from lowcomm_kernels.train.study_frontier import REFERENCE, configs, table

BASE = TrainSpec(steps=200, sync_every=20, workers=2)


def test_every_configuration_is_diloco_with_one_change():
    cfg = dict(configs(BASE))
    assert len(cfg) == 9 and all(s.method == "diloco" for s in cfg.values())
    ref = cfg[REFERENCE]
    assert (ref.wire_dtype, ref.error_feedback, ref.outer_delay) == ("fp32", False, "none")
    topk = {k: s for k, s in cfg.items() if s.wire_dtype == "topk"}
    assert {(s.topk_k, s.topk_bits) for s in topk.values()} == {(64, 2), (32, 2), (64, 1)}
    sgd = cfg["DiLoCo topk k=64 2-bit, outer SGD lr 1"]
    assert (sgd.outer_lr, sgd.outer_momentum) == (1.0, 0.0)
    assert cfg["DiLoCo eager fp32"].outer_delay == "eager"
    for spec in cfg.values():
        spec.validate()  # a bad combination (e.g. a knob the method refuses) fails here


def _run(label: str, seed: int, loss: float, sent: float) -> RunResult:
    return RunResult(label, "diloco", {"seed": seed}, [EvalPoint(200, 1.0, sent, 0.0, loss)], bytes_sent=sent)


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
    assert rows[REFERENCE].endswith("| 1.0x | - |")
    assert "| 150.0x | goal met |" in rows["DiLoCo topk k=64 2-bit"]
    assert "| 300.0x | stretch bytes, loss missed |" in rows["DiLoCo topk k=32 2-bit"]
    assert rows["DiLoCo int4+EF"].endswith("| loss missed |")
    assert rows["DiLoCo eager fp32"].endswith("| eager goal met |")
    assert "Holm p=" in rows["DiLoCo topk k=32 2-bit"]


@pytest.mark.slow
def test_the_extreme_configurations_run_and_send_what_the_table_says(tmp_path):
    from lowcomm_kernels.train.corpus import load_corpus
    from lowcomm_kernels.train.model import ModelConfig
    from lowcomm_kernels.train.studykit import run_resumable

    tiny = TrainSpec(
        workers=2, steps=8, batch_size=2, sync_every=4, eval_every=4, eval_bytes=256, warmup_steps=1,
        latency_s=0.001, model=ModelConfig(dim=32, n_layers=2, n_heads=2, mlp_hidden=64, seq_len=16),
    )  # fmt: skip
    pick = {REFERENCE, "DiLoCo topk k=32 2-bit"}
    cfg = [(label, [spec.with_(name=label)]) for label, spec in configs(tiny) if label in pick]
    corpus = load_corpus(None, max_train_bytes=200_000, max_val_bytes=50_000)
    results = run_resumable(cfg, corpus, tmp_path, progress=False)
    by = {r.name: r for r in results}
    ratio = by[REFERENCE].bytes_sent / by["DiLoCo topk k=32 2-bit"].bytes_sent
    assert ratio > 100  # 2 syncs of a ~30k-parameter model: fp32 against 32 of 4096 at 2 bits + indices
    md = table("frontier", [REFERENCE, "DiLoCo topk k=32 2-bit"], results, 9.0)
    assert f"{ratio:.1f}x" in md and "too few seeds" in md  # one seed: no interval, no verdict
    assert study_frontier.NAME == "frontier"
