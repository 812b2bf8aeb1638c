"""The cocodc-score study: its configurations, and what it reads from a score log, on logs whose
answer is known (pure noise, pure drift)."""

from __future__ import annotations

import math

import pytest

from lowcomm_kernels.train.errors import SpecError
from lowcomm_kernels.train.report import RunResult
from lowcomm_kernels.train.spec import TrainSpec
from lowcomm_kernels.train.studies import STUDIES
from lowcomm_kernels.train.study_cocodc import PAPER_SETUP
from lowcomm_kernels.train.study_score import (
    BIG_BATCH,
    REFERENCE,
    RMS,
    ROUND_ROBIN,
    run_facts,
    seeds_of,
    tables,
)

FULL = PAPER_SETUP.spec()


def test_the_study_logs_the_scores_of_the_papers_setup():
    cfgs = dict(STUDIES["cocodc-score"](FULL))
    assert list(cfgs) == [REFERENCE, RMS, ROUND_ROBIN, BIG_BATCH]
    assert all(s.log_scores and s.method == "cocodc" for s in cfgs.values())
    assert (cfgs[REFERENCE].score, cfgs[RMS].score, cfgs[ROUND_ROBIN].score) == (
        "l2_global",
        "l2_rms",
        "round_robin",
    )
    assert cfgs[BIG_BATCH].batch_size == 4 * FULL.batch_size and cfgs[BIG_BATCH].score == "l2_global"
    assert seeds_of(BIG_BATCH, [0, 1, 2, 3, 4]) == [0, 1, 2] and seeds_of(RMS, [0, 1, 2, 3, 4]) == [
        0,
        1,
        2,
        3,
        4,
    ]


def test_log_scores_is_refused_for_a_method_without_scores():
    with pytest.raises(SpecError, match="log_scores"):
        TrainSpec(method="streaming", log_scores=True)
    with pytest.raises(SpecError, match="log_scores"):
        TrainSpec(method="cocodc", log_scores="yes")


def _run(label: str, seed: int, syncs: list[dict], numel: list[int], workers: int = 4) -> RunResult:
    log = {"numel": numel, "syncs": syncs, "choices": []}
    return RunResult(
        name=label, method="cocodc", config={"seed": seed, "workers": workers, "sync_every": 1000},
        extra={"score_log": log}, final_eval={"val_loss": 2.0 + 0.01 * seed},
    )  # fmt: skip


def test_pure_noise_reads_as_noise_and_a_drift_as_signal():
    numel = [100, 400]
    M = 4
    # noise: ‖Δ_worker‖ = σ√(I·n), the average of M independent ones is 1/√M of it, ‖Δ̄‖ ∝ I^0.5
    noise = [
        {
            "fragment": p,
            "send_step": 10 * i,
            "covered": I,
            "norm": math.sqrt(I * n / M),
            "local_norm": math.sqrt(I * n),
        }
        for i, (p, I) in enumerate([(0, 4), (1, 9), (0, 16), (1, 25), (0, 36), (1, 49)])
        for n in [numel[p]]
    ]
    f = run_facts(_run("a", 0, noise, numel, M))
    assert f["ratio"] == pytest.approx(1 / M) and f["noise_share"] == pytest.approx(1.0)
    assert f["exponent"] == pytest.approx(0.5)
    assert f["counts"] == [3, 3] and f["top_share"] == pytest.approx(0.5)
    # drift: every worker moves alike, r per element-step, ‖Δ̄‖ = r·I·√n
    rates = [1e-3, 3e-3]
    drift = [
        {"fragment": p, "send_step": 100 + 10 * i, "covered": I, "norm": rates[p] * I * math.sqrt(numel[p]),
         "local_norm": rates[p] * I * math.sqrt(numel[p])}
        for i, (p, I) in enumerate([(0, 5), (1, 7), (1, 3), (0, 11), (1, 2)])
    ]  # fmt: skip
    f = run_facts(_run("b", 0, drift, numel, M))
    assert f["ratio"] == pytest.approx(1.0) and f["noise_share"] == pytest.approx(0.0)
    assert f["exponent"] == pytest.approx(1.0)
    assert f["rate"] == pytest.approx(rates)
    assert f["counts"] == [2, 3] and f["top_share"] == pytest.approx(0.6)


def test_the_table_shows_each_configuration_and_the_declared_contrasts():
    numel = [10, 10]
    sync = {"fragment": 0, "send_step": 5, "covered": 5, "norm": 1.0, "local_norm": 1.0}
    runs = [_run(lb, s, [sync], numel) for lb in (REFERENCE, RMS, ROUND_ROBIN) for s in range(3)]
    runs.append(
        RunResult(name=BIG_BATCH, method="cocodc", config={"seed": 0}, final_eval={"val_loss": 1.9})
    )  # no log
    md, out = tables([REFERENCE, RMS, ROUND_ROBIN, BIG_BATCH], runs, 2.1, [0, 1, 2])
    assert f"| {BIG_BATCH} | 1 | no score log |" in md
    assert "l2_rms vs the paper's score" in md and "round-robin vs the paper's score" in md
    assert len(out["facts"][REFERENCE]) == 3 and out["facts"][BIG_BATCH] == []


def test_the_exponent_compares_syncs_within_one_period_only():
    """Norms that shrink from period to period (a decaying learning rate) while growing like √I
    within each: the fit reads 1/2, not the trend across periods."""
    numel = [100]
    syncs = []
    for period, scale in enumerate([8.0, 4.0, 2.0, 1.0]):
        for k, I in enumerate([4, 16, 64]):
            step = 1000 * period + 10 * k + 1
            syncs.append(
                {
                    "fragment": 0,
                    "send_step": step,
                    "covered": I,
                    "norm": scale * math.sqrt(I),
                    "local_norm": None,
                }
            )
    f = run_facts(_run("c", 0, syncs, numel))
    assert f["exponent"] == pytest.approx(0.5) and f["ratio"] is None and f["noise_share"] is None
