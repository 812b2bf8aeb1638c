"""study_loscar.reference_run, LOSCAR re-implemented in one process without the runtime, is the
harness's LOSCAR run: the same final losses on the digits MLP (contiguous split, p = 1/4 and p = 1),
so the study's LOSCAR numbers are those of the algorithm as specified."""

from __future__ import annotations

import pytest

from lowcomm_kernels.train import study_loscar as sl
from lowcomm_kernels.train.tasks.mlp import MLPConfig, run_mlp_specs


@pytest.mark.slow
def test_the_reference_run_matches_the_harness():
    cfg = MLPConfig()
    base = sl.base_spec(True, cfg)  # 4 rounds of R = 16
    row = sl.row_spec(base, sl.Regime("homogeneous", "short", "contiguous"), "loscar", {}, cfg)
    spec = sl.run_spec(row)
    specs = [spec.with_(name="p=1/4"), spec.with_(density=1.0, merge="overwrite", name="p=1 overwrite")]
    harness = run_mlp_specs(specs, cfg, progress=False)
    rounds = base.steps // sl.R
    for run, kw in zip(harness, [dict(), dict(density=1.0, beta=0.0)], strict=True):
        own, avg = sl.reference_run(**kw, rounds=rounds)
        assert run.final_loss == pytest.approx(own, rel=1e-6)
        assert run.points[-1].val_loss_avg_model == pytest.approx(avg, rel=1e-6)
    # and the merge's step is what it says: half a step leaves the workers further apart
    assert sl.reference_run(step=0.5, rounds=rounds)[0] > sl.reference_run(rounds=rounds)[0]
