"""LOSCAR's logistic-regression task: the data and a tiny real run over 2 gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lowcomm_kernels.train.tasks.logreg import (
    VARIANTS,
    LogregConfig,
    a9a_synthetic,
    load_dataset,
    objective,
    optimum,
    run_jobs,
)


def test_a9a_shaped_synthetic_is_deterministic_and_shaped_like_a9a():
    X, y = a9a_synthetic(n=2000)
    X2, y2 = a9a_synthetic(n=2000)
    assert np.array_equal(X, X2) and np.array_equal(y, y2)
    assert X.shape == (2000, 123) and set(np.unique(X)) == {0.0, 1.0}
    assert (X.sum(1) == 14).all()  # one active category in each of the 14 groups
    assert 0.15 < (y > 0).mean() < 0.35  # a9a has ~24% positives


def test_breast_cancer_is_the_bundled_real_dataset():
    X, y = load_dataset("breast_cancer")
    assert X.shape == (569, 31) and torch.all(X[:, -1] == 1)  # + bias column
    assert set(y.tolist()) == {-1.0, 1.0}


def test_optimum_is_below_any_other_point():
    X, y = load_dataset("breast_cancer")
    fstar = optimum(X, y, 1e-4)
    assert fstar < float(objective(torch.zeros(31), X, y, 1e-4))
    assert fstar < float(objective(torch.randn(31) * 0.1, X, y, 1e-4))


@pytest.mark.slow
def test_tiny_run_all_variants_decrease_the_objective():
    cfg = LogregConfig(rounds=4, local_steps=6, overlap_steps=3, eval_every=2)
    jobs = [("breast_cancer", 0.1, v, 0) for v in VARIANTS]
    results = run_jobs(cfg, jobs, workers=2, progress=False)
    assert [r["variant"] for r in results] == list(VARIANTS)
    for r in results:
        rounds = [c[0] for c in r["curve"]]
        assert rounds == [0, 2, 4]
        assert r["curve"][-1][1] < r["curve"][0][1]  # f(x̄) dropped from f(0) = ln 2
        assert r["curve"][-1][1] >= r["fstar"] - 1e-9
        assert r["curve"][-1][2] >= r["curve"][-1][1] - 1e-9  # Jensen: f(mean x_i) <= mean f(x_i)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--final-eval-bytes", "4096"], "--final-eval-bytes"),
        (["--seed", "3"], "--seed"),
        (["--worker-speeds", "1,2,3,6"], "--worker-speeds"),
        (["--latency-ms", "5"], "--latency-ms"),
        (["--dim", "32"], "--dim"),
    ],
)
def test_flags_of_the_training_runs_are_refused_not_ignored(tmp_path, capsys, monkeypatch, argv, flag):
    """--task logreg runs its own fixed setting: a training flag would change nothing, so it is an
    error naming the flag, before any run; the task's own flags still run."""
    from lowcomm_kernels.cli import main
    from lowcomm_kernels.train.tasks import logreg

    class Ran(Exception):
        pass

    def fake_run_jobs(*a, **k):
        raise Ran

    monkeypatch.setattr(logreg, "run_jobs", fake_run_jobs)
    assert main(["compare", "--task", "logreg", *argv, "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert f"{flag} does not apply to --task logreg" in capsys.readouterr().err
    with pytest.raises(Ran):  # the task's own flags reach the runs
        main(["compare", "--task", "logreg", "--quick", "--workers", "2", "--out", str(tmp_path / "y")])
