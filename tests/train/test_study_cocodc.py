"""The cocodc-paper study: its configurations against the paper's setup, the emulated N it gets, the
paired t statistics on known numbers and the table built from runs."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lowcomm_kernels.train.report import EvalPoint, RunResult
from lowcomm_kernels.train.spec import TrainSpec
from lowcomm_kernels.train.studies import STUDIES
from lowcomm_kernels.train.study_cocodc import (
    PAPER_SETUP,
    REFERENCE,
    TARGET_LOSS,
    configs,
    paper_step_time,
    table,
)

FULL = PAPER_SETUP.spec()


def test_the_study_is_registered_and_runs_the_papers_setup():
    assert STUDIES["cocodc-paper"](FULL) == configs(FULL)
    assert (FULL.workers, FULL.sync_every, FULL.fragment_sync_delay, FULL.num_fragments) == (4, 100, 5, 4)
    assert (FULL.lam, FULL.lam_mode, FULL.gamma, FULL.cocodc_timing) == (0.5, "normalized", 0.4, "emulated")
    assert FULL.steps >= 2000
    assert math.isfinite(TARGET_LOSS)  # declared before the runs


def test_configurations_change_one_thing_each_against_cocodc_adaptive():
    cfg = dict(configs(FULL))
    assert len(cfg) == 15
    ref = cfg[REFERENCE]
    assert (ref.method, ref.syncs_per_period, ref.score, ref.taylor_control) == (
        "cocodc",
        "auto",
        "l2_global",
        "none",
    )

    def changed(spec: TrainSpec) -> dict:
        a, b = dataclasses.asdict(spec), dataclasses.asdict(ref)
        return {k: a[k] for k in a if a[k] != b[k]}

    assert changed(cfg["CoCoDC round-robin"]) == {"score": "round_robin"}
    assert changed(cfg["control: beta=1, lambda=0 (local progress only)"]) == {"lam": 0.0}
    assert changed(cfg["control: flipped sign (+lambda)"]) == {"taylor_control": "flip"}
    assert changed(cfg["control: random direction, same norm"]) == {"taylor_control": "random"}
    assert changed(cfg["CoCoDC per-tensor normalization"]) == {"lam_mode": "normalized_tensor"}
    assert changed(cfg["CoCoDC l1_local score"]) == {"score": "l1_local"}
    lams = sorted(s.lam for label, s in cfg.items() if label.startswith("CoCoDC lambda="))
    assert lams == [0.25, 1.0, 2.0, 4.0]  # with the reference's 0.5: {0.25, 0.5, 1, 2, 4}
    assert cfg["DiLoCo"].method == "diloco"
    s4, s8 = cfg["Streaming DiLoCo, 4 syncs/H"], cfg["Streaming DiLoCo, 8 syncs/H"]
    assert s4.method == s8.method == "streaming"
    assert s4.sync_every == 100 and s8.sync_every == 50  # K = 4 fragments per sync_every
    assert cfg["Streaming DiLoCo, 4 syncs/H, alpha=0.5"].fragment_update_alpha == 0.5
    assert s4.fragment_update_alpha == 0.0


def test_the_emulated_step_time_gives_the_papers_n():
    """N = floor(gamma * H * T_c / T_s) with the study's T_c: 8, inside [K, H / tau] = [4, 20]."""
    from lowcomm_kernels.runtime.fragments import plan_fragments
    from lowcomm_kernels.runtime.transport import ring_wire_bytes
    from lowcomm_kernels.train.model import TinyLlama

    sizes = [sum(p.numel() for p in g) for g in plan_fragments(TinyLlama(FULL.model), 4)]
    t_s = 0.01 + sum(ring_wire_bytes(4 * n, 4) for n in sizes) / 4 / 125e6
    t_c = paper_step_time(FULL)
    assert math.floor(0.4 * 100 * t_c / t_s) == 8
    assert 4.5 < t_s / t_c < 5.0  # a sync lasts just under tau = 5 steps


def _run(label: str, seed: int, losses: list[float]) -> RunResult:
    pts = [EvalPoint(100 * i, 0.0, 0.0, 0.0, v) for i, v in enumerate(losses)]
    return RunResult(label, "cocodc", {"seed": seed}, pts, extra={"syncs_per_period": [8, 8]})


def test_table_pairs_runs_by_seed():
    results = [
        _run(REFERENCE, 0, [5.0, 3.0, 2.0]),
        _run(REFERENCE, 1, [5.0, 2.9, 2.1]),
        _run("control", 1, [5.0, 3.5, 2.4]),  # listed out of seed order: pairing is by seed
        _run("control", 0, [5.0, 3.4, 2.2]),
    ]
    md, paired = table([REFERENCE, "control"], results, 3.0, [0, 1])
    pf = paired["control"]["final_loss"]
    assert pf["n"] == 2 and pf["mean"] == pytest.approx(0.25) and pf["std"] == pytest.approx(math.sqrt(0.005))
    ps = paired["control"]["steps_to_target"]  # reference reaches 3.0 at step 100, the control at 200
    assert ps["n"] == 2 and ps["mean"] == pytest.approx(100.0) and ps["t"] == math.inf and ps["p"] is None
    assert "| control | 2 |" in md and "(reference)" in md and "| 8 |" in md


def test_the_comparison_table_shows_cocodcs_n_per_period():
    from lowcomm_kernels.train.report import format_table

    coco = _run("CoCoDC", 0, [5.0, 3.0])
    coco.extra["syncs_per_period"] = [4, 8, 8]
    coco.syncs = 20
    other = RunResult("DiLoCo", "diloco", {"seed": 0}, [EvalPoint(0, 0.0, 0.0, 0.0, 5.0)], syncs=3)
    md = format_table([coco, other], 4.0)
    assert "| 20 (N: 4x1, 8x2) |" in md and "| 3 |" in md
