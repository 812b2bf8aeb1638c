"""Table, target and plot helpers of the comparison report."""

from __future__ import annotations

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
    pts = [
        EvalPoint(
            step=10 * i, wall_s=1.0 * i, bytes_sent=bytes_per_step * 10 * i, exposed_s=0.1 * i, val_loss=v
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
        "final val loss",
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
