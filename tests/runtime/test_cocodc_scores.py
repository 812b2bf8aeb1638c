"""CoCoDC's L2 scores (the paper's ‖Δ̄‖/I and the normalised ‖Δ̄‖/√(I·numel)) and its score log, on
a real training loop of one rank: every choice the schedule made is checked against the norms the log
recorded, and the recorded norms against ‖g − x‖ computed here in float64."""

from __future__ import annotations

import math

import pytest
import torch

from lowcomm_kernels.runtime import CoCoDC

from .rt_common import batch, make_model, one_rank_world


@pytest.fixture(scope="module")
def group():
    with one_rank_world() as g:
        yield g


def _train(group, score: str, steps: int = 96, finish: bool = True):
    torch.manual_seed(0)
    model = make_model(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    st = CoCoDC(
        model, opt, sync_every=24, num_fragments=3, fragment_sync_delay=2, syncs_per_period=8,
        score=score, score_log=True, process_group=group,
    )  # fmt: skip
    for t in range(1, steps + 1):
        x, y = batch(0, t, torch.float32)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        st.step()
    if finish:
        st.finish()
    st.close()
    return st


@pytest.mark.parametrize("score", ["l2_global", "l2_rms"])
def test_every_choice_follows_the_logged_norms(group, score):
    st = _train(group, score)
    log = st.score_records()
    numel, syncs, choices = log["numel"], log["syncs"], log["choices"]
    assert numel == st.frags.sizes() and len(syncs) == st.metrics.num_syncs
    tau = st.tau
    decided = 0
    for c in choices:
        # the score of each fragment: its last sync applied before this choice (none yet: 0)
        want = [0.0] * len(numel)
        for s in syncs:
            if s["send_step"] + tau <= c["step"]:
                div = s["covered"] if score == "l2_global" else math.sqrt(s["covered"] * numel[s["fragment"]])
                want[s["fragment"]] = s["norm"] / div
        assert c["scores"] == pytest.approx(want, rel=1e-12), c
        if c["reason"] == "score":
            busy = {s["fragment"] for s in syncs if s["send_step"] < c["step"] < s["send_step"] + tau}
            free = [p for p in range(len(numel)) if p not in busy]
            assert c["fragment"] == max(free, key=lambda p: (want[p], -p))
            decided += 1
    assert decided >= 5  # the scores, not only the stale and never-sent rules, made choices


def test_the_logged_norms_are_the_pseudo_gradients(group):
    """One rank: the average is this rank's own Δ, so ‖Δ̄‖ (fp32 wire) equals ‖g − x‖ in float64, and
    I is the steps since the fragment's previous send."""
    st = _train(group, "l2_rms")
    syncs = st.score_records()["syncs"]
    last: dict[int, int] = {}
    for s in syncs:
        assert s["local_norm"] is not None and s["local_norm"] > 0
        assert s["norm"] == pytest.approx(s["local_norm"], rel=1e-5)
        assert s["covered"] == s["send_step"] - last.get(s["fragment"], 0)
        last[s["fragment"]] = s["send_step"]
    # the normalised score spread the sends over the fragments (the paper's score may not)
    assert len({s["fragment"] for s in syncs}) == 3


def test_without_score_log_nothing_is_recorded(group):
    torch.manual_seed(0)
    model = make_model(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    st = CoCoDC(model, opt, sync_every=24, num_fragments=3, fragment_sync_delay=2, process_group=group)
    assert st.score_records() is None
    st.close()
    with pytest.raises(TypeError, match="score_log"):
        CoCoDC(
            model,
            opt,
            sync_every=24,
            num_fragments=3,
            fragment_sync_delay=2,
            process_group=group,
            score_log=1,
        )
    st = CoCoDC(model, opt, sync_every=24, num_fragments=3, fragment_sync_delay=2, process_group=group)
    st.close()  # the refused one did not wrap the model


def test_skipped_syncs_are_logged_and_nothing_is_kept_for_them(group):
    """A rank whose parameters turn non-finite skips its syncs: each is logged as skipped with no
    norms, and no local norm outlives the syncs in flight."""
    torch.manual_seed(0)
    model = make_model(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    st = CoCoDC(
        model, opt, sync_every=24, num_fragments=3, fragment_sync_delay=2, syncs_per_period=8,
        score_log=True, process_group=group,
    )  # fmt: skip
    for t in range(1, 61):
        x, y = batch(0, t, torch.float32)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if t == 30:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
        st.step()
        assert set(st._local_norms) <= {(q.fragment, q.send_step) for q in st.pending}
    st.finish()
    syncs = st.score_records()["syncs"]
    skipped = [s for s in syncs if s["skipped"]]
    assert len(syncs) == st.metrics.num_syncs and len(skipped) == st.metrics.num_skipped >= 1
    assert all(s["norm"] is None and s["local_norm"] is None for s in skipped)
    assert not st._local_norms
    st.close()


def test_a_loaded_state_is_marked_and_its_syncs_have_no_local_norm(group, tmp_path):
    st = _train(group, "l2_global", steps=40, finish=False)  # saved with a sync in flight
    sd = st.state_dict()
    torch.manual_seed(0)
    model = make_model(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    fresh = CoCoDC(
        model, opt, sync_every=24, num_fragments=3, fragment_sync_delay=2, syncs_per_period=8,
        score="l2_global", score_log=True, process_group=group,
    )  # fmt: skip
    fresh.load_state_dict(sd)
    assert fresh.score_records()["loads"] == [0]  # before any sync this process logged
    for t in range(fresh.step_count + 1, fresh.step_count + 10):
        x, y = batch(0, t, torch.float32)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        fresh.step()
    fresh.finish()
    restored = {(q["fragment"], q["send_step"]) for q in sd["pending"]}
    assert restored  # the test's point: a sync in flight came with the state
    for s in fresh.score_records()["syncs"]:
        if (s["fragment"], s["send_step"]) in restored:
            assert s["local_norm"] is None
        else:
            assert s["local_norm"] is not None
    fresh.close()
