"""The open-question studies: their configurations (the tiny end-to-end study run is in
test_render.py, whose report tests read the same run)."""

from __future__ import annotations

from lowcomm_kernels.train.spec import TrainSpec
from lowcomm_kernels.train.studies import STUDIES

BASE = TrainSpec(steps=300, sync_every=50, num_fragments=4, fragment_sync_delay=5)


def test_matched_study_equalises_sync_counts():
    cfg = dict(STUDIES["matched"](BASE))
    stream8 = cfg["Streaming DiLoCo, 8 syncs/H"]
    coco8 = cfg["CoCoDC adaptive, 8 syncs/H"]
    # Streaming sends K fragments per sync_every: halving it gives 2K = 8 fragment syncs per H = 50
    assert stream8.method == "streaming" and 50 // stream8.sync_every * stream8.num_fragments == 8
    assert coco8.method == "cocodc" and coco8.syncs_per_period == 8 and coco8.sync_every == 50
    assert cfg["Streaming DiLoCo, 4 syncs/H"].sync_every == 50
    rr = [s for label, s in cfg.items() if "round-robin" in label]
    assert all(s.score == "round_robin" and s.syncs_per_period == 8 for s in rr)


def test_lambda_gamma_overlap_grids():
    lam = dict(STUDIES["lambda"](BASE))
    assert len(lam) == 7 and lam["lambda=0"].lam == 0.0
    assert {(s.lam, s.lam_mode) for s in lam.values() if s.lam > 0} == {
        (v, m) for v in (0.1, 0.5, 1.0) for m in ("absolute", "normalized")
    }
    assert all(s.syncs_per_period == 8 for s in lam.values())  # only the merge changes
    gam = dict(STUDIES["gamma"](BASE))
    assert sorted(s.gamma for s in gam.values()) == [0.1, 0.2, 0.4, 0.8]
    assert all(s.syncs_per_period == "auto" for s in gam.values())
    ov = STUDIES["overlap"](BASE)
    assert {s.fragment_sync_delay for _, s in ov} == {1, 5, 10}
    assert {s.method for _, s in ov} == {"streaming", "cocodc"}


def test_study_tables_name_what_the_final_loss_measures():
    from lowcomm_kernels.train.report import EvalPoint, RunResult
    from lowcomm_kernels.train.studies import study_table, wire_table

    def run(basis: str) -> RunResult:
        pts = [EvalPoint(0, 0.0, 0.0, 0.0, 5.5), EvalPoint(10, 1.0, 1e6, 0.1, 2.5, [2.4, 2.6], 2.45, False)]
        return RunResult("fp32", "streaming", {"seed": 0}, pts, val_loss_basis=basis)

    for basis in ("worker models, mean", "averaged model"):
        for text in (study_table("x", ["fp32"], [run(basis)], 2.5), wire_table(["fp32"], [run(basis)], 2.5)):
            assert f"target validation loss ({basis})" in text
            assert f"| configuration | seeds | final val loss ({basis}) |" in text
