"""Table, target and plot helpers of the comparison report."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lowcomm_kernels.train.report import (
    EvalPoint,
    RunResult,
    auto_target,
    comparison_rows,
    format_table,
    mean_std,
    plot_curves,
)


def _run(name: str, losses: list[float], bytes_per_step: float) -> RunResult:
    """Two workers 0.1 either side of each headline loss; the averaged model 0.05 below it."""
    pts = [
        EvalPoint(
            step=10 * i,
            wall_s=1.0 * i,
            bytes_sent=bytes_per_step * 10 * i,
            exposed_s=0.1 * i,
            val_loss=v,
            val_loss_workers=[v - 0.1, v + 0.1],
            val_loss_avg_model=v - 0.05,
            workers_agree=False,
        )
        for i, v in enumerate(losses)
    ]
    return RunResult(
        name,
        name,
        {},
        pts,
        train_wall_s=pts[-1].wall_s,
        bytes_sent=pts[-1].bytes_sent,
        exposed_s=pts[-1].exposed_s,
        syncs=3,
    )


def test_auto_target_is_the_lowest_loss_every_run_reached():
    a = _run("a", [5.0, 3.0, 2.0, 2.5], 100)
    b = _run("b", [5.0, 4.0, 2.8, 2.6], 10)
    assert auto_target([a, b]) == 2.6
    rows = {r["method"]: r for r in comparison_rows([a, b], 2.6)}
    assert rows["a"]["steps_to_target"] == 20 and rows["b"]["steps_to_target"] == 30
    assert rows["a"]["bytes_to_target"] == 100 * 20
    assert math.isclose(rows["b"]["final_val_ppl"], math.exp(2.6))
    assert rows["a"]["final_val_loss"] == 2.5  # final, not best


def test_table_marks_unreached_target_and_has_every_field():
    a = _run("a", [5.0, 3.0], 1)
    text = format_table([a], 1.0)
    for field in (
        "steps to target",
        "final val loss (worker models, mean)",
        "worker min / max",
        "averaged model*",
        "final ppl",
        "wall-clock",
        "bytes sent/worker",
        "exposed comm",
    ):
        assert field in text
    assert "not reached" in text


def test_roundtrip_and_plots(tmp_path: Path):
    a = _run("a", [5.0, 3.0, 2.0], 100)
    assert RunResult.from_dict(a.to_dict()) == a
    paths = plot_curves([a], tmp_path, 2.5)
    assert [p.name for p in paths] == [
        "val_loss_vs_steps.png",
        "val_loss_vs_wallclock.png",
        "val_loss_vs_bytes.png",
    ]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_mean_std():
    assert mean_std([1.0, 3.0]) == (2.0, math.sqrt(2.0))
    assert mean_std([4.0]) == (4.0, 0.0)
    assert all(math.isnan(v) for v in mean_std([]))


def test_rows_and_table_report_each_worker_and_the_averaged_model():
    a = _run("a", [5.0, 3.0, 2.5], 100)
    (row,) = comparison_rows([a], 2.6)
    assert row["val_loss_basis"] == "worker models, mean"
    assert row["final_val_loss"] == 2.5
    assert row["final_val_loss_workers"] == [2.4, 2.6]
    assert (row["final_val_loss_workers_min"], row["final_val_loss_workers_max"]) == (2.4, 2.6)
    assert row["final_val_loss_avg_model"] == 2.45
    text = format_table([a], 2.6)
    head = next(line for line in text.splitlines() if line.startswith("| method"))
    cells = [c.strip() for c in head.strip("|").split("|")]
    assert cells[4:7] == ["final val loss (worker models, mean)", "worker min / max", "averaged model*"]
    body = next(line for line in text.splitlines() if line.startswith("| a "))
    assert [c.strip() for c in body.strip("|").split("|")][4:7] == ["2.5000", "2.4000 / 2.6000", "2.4500"]
    assert "target validation loss (worker models, mean)" in text
    assert "* the workers' parameters averaged by one all-reduce" in text and "not counted" in text


def test_json_holds_every_worker_value_and_roundtrips_through_json(tmp_path: Path):
    a = _run("a", [5.0, 3.0], 10)
    a.eval_bytes_scored = 262_144
    d = json.loads(json.dumps(a.to_dict()))
    assert d["val_loss_basis"] == "worker models, mean" and d["eval_bytes_scored"] == 262_144
    assert d["points"][-1]["val_loss_workers"] == [2.9, 3.1]
    assert d["points"][-1]["val_loss_avg_model"] == 2.95 and d["points"][-1]["workers_agree"] is False
    assert RunResult.from_dict(d) == a and d["eval_windows"] == "spread"
    assert "262,144 bytes scored per evaluation" in format_table([a], 3.0)
    assert "from the start of the validation text" not in format_table([a], 3.0)
    del d["eval_windows"]  # written after the windows were spread, before they were recorded
    assert RunResult.from_dict(d).eval_windows == "spread"
    del d["final_eval"]  # a file written before the windows were spread over the text
    old = RunResult.from_dict(d)
    assert old.eval_windows == "start" and "windows from the start of the validation text" in format_table(
        [old], 3.0
    )


def test_results_json_from_before_per_worker_evaluation_still_loads():
    """An older file: points with val_loss only, which was then the averaged model's loss."""
    old = {
        "name": "DiLoCo",
        "method": "diloco",
        "config": {"eval_batches": 8},
        "points": [
            {"step": 0, "wall_s": 0.0, "bytes_sent": 0.0, "exposed_s": 0.0, "val_loss": 5.5},
            {"step": 50, "wall_s": 4.0, "bytes_sent": 1e6, "exposed_s": 0.3, "val_loss": 2.5},
        ],
        "train_wall_s": 4.0,
        "bytes_sent": 1e6,
        "exposed_s": 0.3,
        "syncs": 1,
        "num_params": 231_000,
        "extra": {},
        "final_loss": 2.5,
    }
    r = RunResult.from_dict(old)
    assert r.val_loss_basis == "averaged model" and r.final_loss == 2.5 and r.eval_bytes_scored == 0
    assert r.points[-1].val_loss_avg_model == 2.5 and r.points[-1].val_loss_workers == []
    (row,) = comparison_rows([r], 2.5)
    assert row["final_val_loss_workers_min"] is None and row["final_val_loss_avg_model"] == 2.5
    text = format_table([r], 2.5)
    assert "final val loss (averaged model)" in text and "| n/a | 2.5000 |" in text
    mixed = format_table([r, _run("a", [5.0, 2.4], 1)], 2.5)
    assert "differs between runs: averaged model, worker models, mean" in mixed


def test_a_run_config_reads_back_as_the_spec_that_wrote_it():
    """TrainSpec.from_dict inverts to_dict through JSON (the model, tuples from lists, the label
    derived again); an unknown field is a SpecError naming it, not a quiet default."""
    import json

    import pytest

    from lowcomm_kernels.train.errors import SpecError
    from lowcomm_kernels.train.model import ModelConfig
    from lowcomm_kernels.train.spec import TrainSpec

    spec = TrainSpec(
        method="loscar",
        workers=4,
        steps=48,
        model=ModelConfig(dim=32, n_layers=2, n_heads=2, mlp_hidden=86, seq_len=32),
        worker_speeds=(1.0, 1.0, 2.0, 2.0),
        name="slow pair",
    )
    back = TrainSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert back == spec and back.label == "slow pair" and back.worker_speeds == (1.0, 1.0, 2.0, 2.0)
    with pytest.raises(SpecError, match="no_such_knob"):
        TrainSpec.from_dict({**spec.to_dict(), "no_such_knob": 1})
