"""A strategy inside torch.distributed.checkpoint (runtime.dcp.DCPState): save with results pending,
resume into a fresh strategy, and the trajectory goes on exactly as without the interruption; resume
with another number of ranks (up and down), and refuse it where it has no meaning."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from lowcomm_kernels.runtime import StreamingDiLoCo
from lowcomm_kernels.runtime.checkpoint import CheckpointError
from lowcomm_kernels.runtime.dcp import DCPState
from lowcomm_kernels.runtime.launch import spawn_local
from tests.runtime import dcp_worker
from tests.runtime.rt_common import one_rank_world


@pytest.fixture(scope="module")
def group():
    with one_rank_world() as g:
        yield g


def _make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strat = StreamingDiLoCo(
        model, opt, sync_every=4, num_fragments=2, fragment_sync_delay=1, outer_lr=0.7, outer_momentum=0.9
    )
    return model, opt, strat


def _train(model, opt, strat, steps, gen):
    with strat:
        for _ in range(steps):
            loss = model(torch.randn(8, 4, generator=gen)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_dcp_round_trip_with_pending_results(group, tmp_path):
    gen = torch.Generator().manual_seed(1)
    model, opt, strat = _make()
    _train(model, opt, strat, 6, gen)
    assert len(strat.pending) == 1  # a fragment in flight at the save
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "strategy": DCPState(strat)}
    dcp.save(state, checkpoint_id=str(tmp_path))
    gen_state = gen.get_state()
    _train(model, opt, strat, 10, gen)  # the uninterrupted run

    model2, opt2, strat2 = _make()
    loaded = {"model": model2.state_dict(), "opt": opt2.state_dict(), "strategy": DCPState(strat2)}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["opt"])
    assert strat2.step_count == 6 and len(strat2.pending) == 1
    gen.set_state(gen_state)
    _train(model2, opt2, strat2, 10, gen)
    assert torch.equal(strat2.g, strat.g) and torch.equal(strat2.u, strat.u)
    assert torch.equal(strat2.frags.flat, strat.frags.flat)
    strat.close()
    strat2.close()


def test_dcp_refuses_another_model(group, tmp_path):
    model, opt, strat = _make()
    dcp.save({"strategy": DCPState(strat)}, checkpoint_id=str(tmp_path))
    strat.close()
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    o2 = torch.optim.SGD(other.parameters(), lr=0.1)
    s2 = StreamingDiLoCo(
        other, o2, sync_every=4, num_fragments=2, fragment_sync_delay=1, outer_lr=0.7, outer_momentum=0.9
    )
    with pytest.raises(CheckpointException):  # DCP itself refuses a g of another size
        dcp.load({"strategy": DCPState(s2)}, checkpoint_id=str(tmp_path))
    s2.close()


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dcp_worker.py")
STREAMING = {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2}
RESIZE = {
    # name: (class, knobs, saved at)
    # saved at step 5 with fragment 1 in flight (sent at 4, applied at 6)
    "streaming": ("streaming", STREAMING, 5),
    # the same under a quantized wire, whose result arrives averaged (a dense one arrives summed)
    "streaming_int8": ("streaming", {**STREAMING, "wire_dtype": "int8", "quant_block": 16}, 5),
    # saved at step 11 with a fragment in flight
    "cocodc": ("cocodc", {**STREAMING, "syncs_per_period": 4}, 11),
    # saved at step 10, a round end (rounds of 3 + 2 steps)
    "loscar": ("loscar", {"density": 0.4, "local_steps": 3, "overlap_steps": 2}, 10),
}
# error feedback: each rank's residual is its own; saved at step 5 with fragment 1 in flight
EF = {**STREAMING, "wire_dtype": "int4", "quant_block": 16, "error_feedback": True}


# LOSCAR with per-rank local_steps, saved by 2 ranks (refused on another number of ranks, below)
PER_RANK_STEPS = {"density": 0.4, "local_steps": [2, 3], "overlap_steps": 1}


@pytest.fixture(scope="module")
def saved_and_resumed(tmp_path_factory) -> dict:
    """Every RESIZE case saved by one group of 2 ranks (and the per-rank LOSCAR save, and the error
    feedback save, resumed by the same 2 ranks), then the RESIZE cases resumed by one group of 3 (and
    the error feedback save, refused and restarted): two process group starts for all, one after the
    other (each case in its own checkpoint folder). name -> (its folder, the 2 ranks' results, the 3
    ranks'); "per_rank" -> the per-rank LOSCAR save's folder; "ef" -> the 2 ranks' (save, resume) and
    the 3 ranks' (refused, restarted) results."""
    root = tmp_path_factory.mktemp("dcp_resize")
    names = sorted(RESIZE)
    base = {n: {"cls": RESIZE[n][0], "kw": RESIZE[n][1], "path": str(root / n)} for n in names}
    saves = [{**base[n], "steps": RESIZE[n][2], "save": True, "one": 1} for n in names]
    per_rank = {
        "cls": "loscar",
        "kw": PER_RANK_STEPS,
        "path": str(root / "per_rank"),
        "rounds": 3,
        "save": True,
    }
    ef = {"cls": "streaming", "kw": EF, "path": str(root / "ef")}
    ef_runs = [
        {**ef, "steps": 5, "save": True, "one": 1},
        {**ef, "load": True, "one": 1, "after": 4},
        {**ef, "kw": {**EF, "error_feedback": False}, "load": True, "one": 1},  # resumed without it
    ]
    saved = spawn_local(f"{WORKER}:run_all", 2, ([*saves, per_rank, *ef_runs],), timeout_s=480)
    loads = [{**base[n], "load": True, "one": 1, "after": 12} for n in names]
    ef_loads = [{**ef, "load": True, "refused": True}, {**ef, "load": True, "restart_ef": True, "after": 4}]
    up = spawn_local(f"{WORKER}:run_all", 3, ([*loads, *ef_loads],), timeout_s=480)
    out = {n: (base[n]["path"], [r[i] for r in saved], [r[i] for r in up]) for i, n in enumerate(names)}
    out["per_rank"] = per_rank["path"]
    out["ef"] = ([r[-3:] for r in saved], [r[-2:] for r in up])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RESIZE))
def test_dcp_resumes_with_another_number_of_ranks(group, saved_and_resumed, name):
    """Saved by 2 ranks, resumed by 3 (spawned) and by 1 (this process): the resumed global state is
    the saved one, a result pending at the save is applied with the same average, dense or quantized,
    and training goes on with every rank holding the same global state."""
    cls, kw, at = RESIZE[name]
    path, saved, up = saved_and_resumed[name]
    base = {"cls": cls, "kw": kw, "path": path}
    ref = saved[0]["saved"]
    assert ref["step"] == at
    if cls != "loscar":
        assert ref["pending"], "the save should hold a result in flight"
    down = [dcp_worker.run(0, 1, {**base, "load": True, "one": 1, "after": 12})]
    for res in (up, down):
        for r in res:
            loaded = r["loaded"]
            if cls == "loscar":
                assert loaded == ref
                assert torch.isfinite(r["x_final"]).all()
                assert r["final"]["round"] > ref["round"]
            else:
                assert torch.equal(loaded["g"], ref["g"]) and torch.equal(loaded["u"], ref["u"])
                assert loaded["step"] == ref["step"] and loaded["pending"] == ref["pending"]
                # the pending result, sent by 2 ranks, is applied with their average by 3 ranks or 1:
                # g and u after the next step are the 2-rank run's, bit for bit
                for k in ("g", "u"):
                    assert torch.equal(r["after_one"][k], saved[0]["after_one"][k]), k
                assert not torch.equal(r["final"]["g"], ref["g"])  # training went on
                assert torch.isfinite(r["final"]["g"]).all()
            assert r["final"]["step"] == at + 13
        first = res[0]["final"]
        for r in res[1:]:  # the global state stays replicated on the new number of ranks
            for k, v in first.items():
                assert torch.equal(v, r["final"][k]) if isinstance(v, torch.Tensor) else v == r["final"][k]


@pytest.mark.slow
def test_dcp_refuses_per_rank_loscar_steps_on_another_number_of_ranks(group, saved_and_resumed):
    """LOSCAR with per-rank local_steps cannot resume on another number of ranks: the error names
    local_steps."""
    kw, path = PER_RANK_STEPS, saved_and_resumed["per_rank"]
    with pytest.raises(CheckpointError, match="local_steps"):
        dcp_worker.run(0, 1, {"cls": "loscar", "kw": {**kw, "local_steps": 2}, "path": path, "load": True})


@pytest.mark.slow
def test_dcp_restores_each_ranks_error_feedback_residual(saved_and_resumed):
    """With error feedback, every rank resumes with its own residual (DCP keeps one copy of a tensor
    that has the same name on every rank: each rank would get one rank's residual), and the result in
    flight at the save is applied as in the uninterrupted run."""
    (save0, load0, _), (save1, load1, _) = saved_and_resumed["ef"][0]
    assert not torch.equal(save0["residual_saved"], save1["residual_saved"])  # per-rank state
    for save, load in ((save0, load0), (save1, load1)):
        assert torch.equal(load["residual_loaded"], save["residual_saved"])
        for k in ("g", "u"):
            assert torch.equal(load["loaded"][k], save["saved"][k]), k
            assert torch.equal(load["after_one"][k], save["after_one"][k]), k


@pytest.mark.slow
def test_dcp_resume_without_error_feedback_says_it_drops_the_residuals(saved_and_resumed):
    """Saved with error feedback, resumed without it on the same ranks: the result in flight is applied
    as in the uninterrupted run, and each rank logs that its residual is dropped."""
    for save, _, plain in saved_and_resumed["ef"][0]:
        assert plain["residual_loaded"] is None
        assert any("error-feedback residuals" in m for m in plain["logged"]), plain["logged"]
        for k in ("g", "u"):
            assert torch.equal(plain["after_one"][k], save["after_one"][k]), k


@pytest.mark.slow
def test_dcp_error_feedback_on_another_number_of_ranks_is_refused_or_restarted(saved_and_resumed):
    """Another number of ranks has no residual of its own: dcp.load refuses, naming the entry, unless
    the load restarts error feedback (residuals from zero); then training goes on."""
    for refused, restarted in saved_and_resumed["ef"][1]:
        assert "error_feedback_residual_by_rank" in refused["refused"], refused["refused"]
        assert not restarted["residual_loaded"].any()
        assert restarted["final"]["step"] == 5 + 4 and torch.isfinite(restarted["final"]["g"]).all()
