"""Mixed precision without desync: a torch.amp.GradScaler skips optimizer.step() on the rank whose
gradients hold inf, and only there. With ``grad_scaler=`` (or ``strategy.step()`` every iteration)
every rank still counts every iteration: 2 gloo ranks sync at the same steps, agree after each
sync, and follow the float64 simulation in which the skipping worker leaves that step out. A
GradScaler the strategy was not given raises ``GradScalerError`` on every rank, before any
collective; ranks that disagree on whether a scaler is given stop at construction.
"""

from __future__ import annotations

import os

import pytest
import torch

from lowcomm_kernels.runtime.launch import spawn_local
from tests.runtime.rt_sim import simulate_dense, simulate_loscar

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rt_amp.py")
M = 2

STREAMING = {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2}
LOSCAR = {"density": 0.4, "local_steps": 3, "overlap_steps": 1, "merge": "overwrite", "seed": 5}
SCENARIOS = [
    {"name": "diloco", "cls": "diloco", "T": 30, "kw": {"sync_every": 6},
     "inf_at": {(1, 4), (1, 5), (0, 13)}},
    {"name": "streaming", "cls": "streaming", "T": 40, "kw": STREAMING, "inf_at": {(1, 3), (0, 9), (1, 18)}},
    {"name": "cocodc", "cls": "cocodc", "T": 48, "inf_at": {(0, 2), (1, 11)},
     "kw": {**STREAMING, "syncs_per_period": 4, "lam": 0.5, "lam_mode": "normalized"}},
    {"name": "loscar", "cls": "loscar", "T": 32, "kw": LOSCAR, "inf_at": {(1, 2), (1, 7), (0, 8), (0, 14)}},
    {"name": "fused_adam", "cls": "streaming", "T": 24, "kw": STREAMING, "fused": True,
     "inf_at": {(0, 5), (1, 6), (1, 7)}},
    {"name": "manual", "cls": "diloco", "T": 18, "kw": {"sync_every": 6}, "mode": "manual",
     "inf_at": {(1, 2), (1, 3)}},
    {"name": "unannounced", "cls": "diloco", "T": 12, "kw": {"sync_every": 6}, "mode": "unannounced",
     "inf_at": {(1, 1)}},
    {"name": "other_scaler", "cls": "diloco", "T": 12, "kw": {"sync_every": 6}, "mode": "other_scaler",
     "inf_at": set()},
    {"name": "given_on_rank0", "cls": "diloco", "T": 12, "kw": {"sync_every": 6}, "mode": "given_on_rank0",
     "inf_at": set()},
]


@pytest.fixture(scope="module")
def runs():
    return spawn_local(f"{WORKER}:amp_run", M, (SCENARIOS,), timeout_s=240)


def _sc(name):
    return next(s for s in SCENARIOS if s["name"] == name)


def _skips(sc):
    return {(m, t) for m, t in sc["inf_at"]}


def _check_in_step(runs, name):
    sc = _sc(name)
    r0, r1 = runs[0][name], runs[1][name]
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    assert r0["steps"] == r1["steps"] == sc["T"]  # skipped iterations counted too
    for m in range(M):
        if sc.get("mode", "with") == "with":  # the scaler really skipped on this rank only
            assert runs[m][name]["skipped_steps"] == sorted(t for r, t in sc["inf_at"] if r == m)
        assert not runs[m][name]["scaler_step_wrapped"]  # restored on leaving the context
    # same syncs (fragment, round, send step, apply step, skipped) and the same synced values
    assert [r[:5] for r in r0["records"]] == [r[:5] for r in r1["records"]] and r0["records"]
    assert [r[5][0] for r in r0["records"]] == [r[5][0] for r in r1["records"]]
    return r0, r1


def _close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-9, atol=1e-9, msg=lambda s, k=k: f"{k}: {s}")


@pytest.mark.parametrize("name", ["diloco", "streaming", "cocodc", "manual"])
def test_dense_ranks_sync_together_and_match_simulation(runs, name):
    sc = _sc(name)
    r0, r1 = _check_in_step(runs, name)
    if sc["cls"] != "cocodc":  # α = 0, no correction: after each sync x_p = g_p on every rank
        for m in range(M):
            assert all(g == x for *_, (g, x) in runs[m][name]["records"])
    assert not any(r[4] for r in r0["records"])  # inf gradients are skipped steps, not skipped syncs
    kw = sc["kw"]
    extra = {"H": kw["sync_every"]}
    if sc["cls"] != "diloco":
        extra.update(K=kw["num_fragments"], tau=kw["fragment_sync_delay"])
    if sc["cls"] == "cocodc":
        extra.update(N=kw["syncs_per_period"], lam=kw["lam"], lam_mode=kw["lam_mode"])
    sim = simulate_dense(sc["cls"], M, sc["T"], skip=_skips(sc), **extra)
    tau = extra.get("tau", 0)
    assert [(r[0], r[2]) for r in r0["records"]] == [(p, t) for p, t, _ in sim["sends"] if t + tau <= sc["T"]]
    for m in range(M):
        _close(runs[m][name]["params"], sim["params"][m])


def test_loscar_rounds_stay_paired_and_match_simulation(runs):
    sc = _sc("loscar")
    r0, r1 = _check_in_step(runs, "loscar")
    rounds = sc["T"] // (LOSCAR["local_steps"] + LOSCAR["overlap_steps"])
    assert [r[1] for r in r0["records"]] == list(range(rounds))
    # overwrite: x[S] = mean over ranks of y[S] after the merge, identical on both ranks
    assert [r[5] for r in r0["records"]] == [r[5] for r in r1["records"]]
    sim = simulate_loscar(M, rounds, density=LOSCAR["density"], local_steps=[3, 3], overlap_steps=[1, 1],
                          merge="overwrite", seed=LOSCAR["seed"], skip=_skips(sc))
    for m in range(M):
        _close(runs[m]["loscar"]["params"], sim["params"][m])


def test_scaler_not_given_raises_on_every_rank_before_any_sync(runs):
    for name, says in (("unannounced", "was not given"), ("other_scaler", "a different")):
        for m in range(M):
            r = runs[m][name]
            assert r["error"] is not None and r["error"].startswith("GradScalerError"), r["error"]
            assert says in r["error"] and "grad_scaler=scaler" in r["error"]
            assert r["records"] == [] and r["steps"] == 0  # raised before the strategy advanced


def test_ranks_disagreeing_on_grad_scaler_stop_at_construction(runs):
    for m in range(M):
        err = runs[m]["given_on_rank0"]["error"]
        assert err is not None and err.startswith("ConfigMismatchError") and "grad_scaler given" in err, err


def test_fused_optimizer_counts_each_iteration_once(runs):
    """A fused optimizer is stepped by the scaler every iteration (it skips inside its kernel), so
    its hook runs every iteration and the wrapper adds nothing: T steps, not T + skips."""
    r0, r1 = _check_in_step(runs, "fused_adam")
    assert [(r[0], r[2]) for r in r0["records"]] == [(1, 4), (0, 8), (1, 12), (0, 16), (1, 20)]
    for m in range(M):
        assert all(g == x for *_, (g, x) in runs[m]["fused_adam"]["records"])
