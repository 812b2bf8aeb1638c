"""LOSCAR in its own regime: slow workers as step counts, the data split, p = 0, the study's runs."""

from __future__ import annotations

import pytest
import torch

from lowcomm_kernels.cli import main
from lowcomm_kernels.train import study_loscar as sl
from lowcomm_kernels.train.corpus import IID_BLOCK, CorpusError, worker_shard
from lowcomm_kernels.train.errors import SpecError
from lowcomm_kernels.train.spec import TrainSpec
from lowcomm_kernels.train.strategies import CommTotals, build_strategy
from lowcomm_kernels.train.studies import STUDIES
from lowcomm_kernels.train.tasks.mlp import MLPConfig, modeled_time

SLOW = dict(
    method="loscar",
    workers=4,
    steps=64,
    eval_every=16,
    local_steps=14,
    overlap_steps=2,
    worker_speeds=(1.0, 1.0, 1.0, 2.0),
    speed_model="steps",
)


def test_a_2x_slower_loscar_worker_runs_half_the_steps_of_each_round():
    spec = TrainSpec(**SLOW)
    assert spec.rank_step_counts() == ([14, 14, 14, 7], [2, 2, 2, 1])
    for rank, per_round in ((0, 16), (3, 8)):
        active = [t for t in range(1, 65) if spec.steps_on(rank, t)]
        assert len(active) == 4 * per_round
        assert all(t in active for t in (16, 32, 48, 64))  # every rank steps (and merges) at a round end
    slow = [t for t in range(1, 17) if spec.steps_on(3, t)]
    assert slow == [2, 4, 6, 8, 10, 12, 14, 16]  # spread evenly, not bunched at the round's start
    # non-integer speeds: floor(N / c), at least 1; overlap at least 1 when Q >= 1
    odd = TrainSpec(**{**SLOW, "worker_speeds": (2.0, 2.0, 5.0, 60.0)})  # relative 1, 1, 2.5, 30
    assert odd.rank_step_counts() == ([14, 14, 5, 1], [2, 2, 1, 1])


def test_sleep_model_and_other_methods_keep_every_step():
    sleep = TrainSpec(**{**SLOW, "speed_model": "sleep", "steps": 50})  # no round constraint
    assert sleep.rank_step_counts() == ([14] * 4, [2] * 4)
    assert all(sleep.steps_on(3, t) for t in range(1, 51))
    for method in ("dp", "diloco", "streaming"):
        spec = TrainSpec(**{**SLOW, "method": method, "sync_every": 64, "fragment_sync_delay": 2})
        assert all(spec.steps_on(3, t) for t in range(1, 65))  # they wait for the slow worker instead


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(steps=70), "<steps>"),
        (dict(eval_every=20), "<eval_every>"),
        (dict(speed_model="fast"), "<speed_model>"),
        (dict(split="random"), "<split>"),
        (dict(density=-0.1), "<density>"),
    ],
)
def test_bad_knobs_are_named(change, field):
    with pytest.raises(SpecError) as exc:
        TrainSpec(**{**SLOW, **change})
    assert field in exc.value.template


def test_bad_split_flag_exits_2_before_any_run(capsys, tmp_path):
    assert main(["compare", "--split", "shuffled", "--out", str(tmp_path)]) == 2
    assert "--split" in capsys.readouterr().err
    rc = main(
        [
            "compare",
            "--workers",
            "4",
            "--steps",
            "70",
            "--speed-model",
            "steps",
            "--methods",
            "loscar",
            "--local-steps",
            "14",
            "--overlap-steps",
            "2",
            "--worker-speeds",
            "1,1,1,2",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 2 and "--steps must be a multiple of a LOSCAR round" in capsys.readouterr().err


def test_iid_and_contiguous_splits_are_disjoint_and_deterministic():
    data = torch.arange(10 * IID_BLOCK * 4 + 123)  # positions stand in for bytes
    for split in ("contiguous", "iid"):
        shards = [worker_shard(data, r, 4, split) for r in range(4)]
        assert all(torch.equal(s, worker_shard(data, r, 4, split)) for r, s in enumerate(shards))
        seen = torch.cat(shards)
        assert seen.unique().numel() == seen.numel()  # disjoint
        assert len({s.numel() for s in shards}) == 1
    contiguous = [worker_shard(data, r, 4, "contiguous") for r in range(4)]
    iid = [worker_shard(data, r, 4, "iid") for r in range(4)]
    span = data.numel()
    # contiguous: each worker holds a quarter of the stream; iid: each worker reads all of it
    assert all(int(s.max() - s.min()) < span // 4 for s in contiguous)
    assert all(int(s.min()) < IID_BLOCK * 4 and int(s.max()) > span - 2 * IID_BLOCK * 4 for s in iid)
    assert torch.equal(
        iid[1][:IID_BLOCK], torch.arange(IID_BLOCK, 2 * IID_BLOCK)
    )  # whole blocks, dealt in turn
    with pytest.raises(CorpusError, match="iid split needs"):
        worker_shard(torch.arange(IID_BLOCK), 0, 4, "iid")


def test_p0_builds_no_strategy_and_counts_nothing():
    spec = TrainSpec(method="loscar", workers=1, density=0.0, steps=4, eval_every=4)
    model = torch.nn.Linear(3, 1)
    assert build_strategy(spec, model, torch.optim.SGD(model.parameters(), lr=0.1), None) is None
    t = CommTotals.read(None)
    assert (t.bytes_sent, t.syncs, t.exposed_s) == (0.0, 0, 0.0)


def test_time_model_charges_the_slowest_worker_and_hides_overlapped_syncs():
    cfg = MLPConfig(step_time_s=0.01)
    loscar = TrainSpec(**SLOW, latency_s=0.02, bandwidth_bytes_per_s=1e15)
    # R = 16 ticks; the slow worker sends after 2 * 7 steps = 0.14 s, the sync lands 0.02 s later,
    # its last step ends at 2 * 8 * 0.01 = 0.16 s: rounds of 0.16 s, as long as the fast worker's
    assert modeled_time(loscar, cfg, 64, 4, 4.0) == pytest.approx(4 * 0.16)
    long = loscar.with_(latency_s=0.1)  # now the sync is exposed: 0.14 + 0.1 per round
    assert modeled_time(long, cfg, 64, 4, 4.0) == pytest.approx(4 * 0.24)
    assert modeled_time(loscar.with_(density=0.0), cfg, 64, 0, 0.0) == pytest.approx(0.64)
    diloco = loscar.with_(method="diloco", sync_every=64)
    assert modeled_time(diloco, cfg, 64, 1, 4.0) == pytest.approx(64 * 2 * 0.01 + 0.02)
    stream = loscar.with_(method="streaming", sync_every=64, num_fragments=4, fragment_sync_delay=2)
    assert modeled_time(stream, cfg, 64, 4, 4.0) == pytest.approx(64 * 2 * 0.01)  # 0.02 s < 2 slow steps
    dp = loscar.with_(method="dp", worker_speeds=None)
    assert modeled_time(dp, cfg, 64, 64, 64.0) == pytest.approx(64 * 0.01 + 64 * 0.02)


def test_study_configuration_list():
    cfg = MLPConfig()
    base = sl.base_spec(False, cfg)
    rows = sl.rows(base, {}, cfg)
    assert len(rows) == 8 * 5 and len(STUDIES["loscar-regimes"](TrainSpec())) == 40
    assert {(rg.speeds, rg.delay, rg.split) for rg, _, _ in rows} == {
        (s, d, p) for s in sl.SPEEDS for d in sl.DELAYS for p in ("iid", "contiguous")
    }
    for rg, method, spec in rows:
        assert spec.steps == 64 * sl.R and spec.round_steps() == sl.R
        N, Q = sl.DELAYS[rg.delay]
        assert spec.latency_s == pytest.approx(Q * cfg.step_time_s)
        if method in ("loscar", "p0"):
            assert spec.density == (0.0 if method == "p0" else 0.25)
            local, _ = spec.rank_step_counts()
            assert local == ([N] * 4 if rg.speeds == "homogeneous" else [N] * 3 + [N // 2])
        if method == "streaming":
            assert spec.fragment_sync_delay == Q and spec.sync_every == sl.K * sl.R
    # runs shared between rows: 2 dp + 2 DiLoCo + 4 Streaming + 8 LOSCAR + 4 p = 0 per seed
    launches = sl.study_configs(base, {}, [0, 1, 2, 3, 4], cfg)
    per_method = {label: len(specs) for label, specs in launches}
    assert per_method == {
        sl.LABELS["loscar"]: 8 * 5,
        sl.LABELS["streaming"]: 4 * 5,
        sl.LABELS["diloco"]: 2 * 5,
        sl.LABELS["dp"]: 2 * 5,
        sl.LABELS["p0"]: 4 * 5,
    }
    names = [s.name for _, specs in launches for s in specs]
    assert len(set(names)) == len(names)
    for _, specs in launches:
        assert all(s.latency_s == 0.0 for s in specs)  # the link enters the time model only
    tuning = sl.tuning_configs(base, sl.OUTER_LRS["full"], cfg)
    assert len(tuning[0][1]) == 2 * 3 * len(sl.TUNE_SEEDS)
    assert not set(sl.TUNE_SEEDS) & set(range(5))


def test_study_refuses_the_logreg_task(capsys, tmp_path):
    assert main(["compare", "--study", "loscar-regimes", "--task", "logreg", "--out", str(tmp_path)]) == 2
    assert "digits MLP" in capsys.readouterr().err
    assert main(["compare", "--study", "loscar-regimes", "--workers", "2", "--out", str(tmp_path)]) == 2
    assert "--workers does not apply to --study loscar-regimes" in capsys.readouterr().err
    assert main(["compare", "--study", "loscar-regimes", "--seed", "98", "--out", str(tmp_path)]) == 2
    assert "tuning seeds" in capsys.readouterr().err
    assert main(["compare", "--task", "mlp", "--seq-len", "8", "--out", str(tmp_path)]) == 2
    assert "--seq-len does not apply to --task mlp" in capsys.readouterr().err


@pytest.mark.slow
def test_lm_loscar_with_a_2x_slower_worker_and_the_iid_split(tmp_path):
    """The LM harness: the slow rank idles on half the ticks, yet both ranks meet at every round's
    merge and at every evaluation (no collective is left unpaired)."""
    import json

    out = tmp_path / "lm"
    argv = ["train", "--method", "loscar", "--workers", "2", "--steps", "8", "--eval-every", "4"]
    argv += ["--eval-bytes", "512", "--batch-size", "2", "--dim", "16", "--layers", "1", "--heads", "2"]
    argv += ["--mlp-hidden", "32", "--seq-len", "16", "--local-steps", "3", "--overlap-steps", "1"]
    argv += ["--worker-speeds", "1,2", "--speed-model", "steps", "--split", "iid", "--latency-ms", "1"]
    assert main([*argv, "--no-progress", "--out", str(out)]) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["syncs"] == 2 and [p["step"] for p in run["points"]] == [0, 4, 8]
    assert run["config"]["split"] == "iid" and run["config"]["speed_model"] == "steps"


def test_last_period_loss_averages_the_evaluations_of_the_last_H_ticks():
    """The own-model loss over DiLoCo's last period (after tick steps - H), not at its last sync only."""
    from lowcomm_kernels.train.report import EvalPoint, RunResult
    from lowcomm_kernels.train.study_loscar import base_spec, last_period_loss

    base = base_spec(False, MLPConfig())
    H, end = base.sync_every, base.steps
    losses = {t: (0.1 if t == end else 1.0 + t / end) for t in range(0, end + 1, 16)}
    run = RunResult("r", "diloco", {}, [EvalPoint(t, 0.0, 0.0, 0.0, v) for t, v in losses.items()])
    window = [v for t, v in losses.items() if t > end - H]
    assert len(window) == H // 16 and last_period_loss(run, base) == sum(window) / len(window)
    assert last_period_loss(run, base) > run.final_loss  # the sync at the last tick flatters


@pytest.mark.parametrize("method", ["diloco", "streaming", "cocodc", "dp", "loscar"])
@pytest.mark.parametrize("model", ["sleep", "steps"])
def test_a_slow_worker_is_slow_in_time_unless_loscar_gives_it_fewer_steps(method, model):
    """Under 'steps' only LOSCAR runs fewer steps on a slow worker; every other method cannot, so its
    slow worker's steps are stretched in wall-clock and the others wait for it (never a free ride)."""
    spec = TrainSpec(**{**SLOW, "method": method, "speed_model": model})
    fewer = method == "loscar" and model == "steps"
    assert [spec.step_stretch(r) for r in range(4)] == ([1.0] * 4 if fewer else [1.0, 1.0, 1.0, 2.0])
    ticks = range(1, spec.round_steps() + 1) if method == "loscar" else range(1, 17)
    assert all(spec.steps_on(0, t) for t in ticks)
    assert (
        sum(spec.steps_on(3, t) for t in ticks) < len(ticks)
        if fewer
        else all(spec.steps_on(3, t) for t in ticks)
    )
    assert TrainSpec(method=method).step_stretch(0) == 1.0  # no worker_speeds: no stretch


def test_a_slow_worker_is_slow_in_compute_not_on_the_link():
    """The stretch multiplies the step's compute only: a step that spent 0.3 s of its 0.31 s waiting
    on the link sleeps (c - 1) x 0.01 s, not (c - 1) x 0.31 s (the link is no slower for it)."""
    from lowcomm_kernels.train.loop import stretch_s

    assert stretch_s(3.0, 0.31, 0.30) == pytest.approx(0.02)
    assert stretch_s(3.0, 0.31, 0.0) == pytest.approx(0.62)
    assert stretch_s(1.0, 0.31, 0.0) == 0.0 and stretch_s(2.0, 0.1, 0.2) == 0.0  # never negative


def test_every_method_is_scored_at_the_same_modeled_time():
    """The committed study's rows: each run is scored at its last evaluation within the declared
    time budget (the study's ticks at the fastest worker's speed, nothing on the link), never later;
    with one worker 2x slower the dense methods, whose every step waits for it, are scored after
    about half their steps while LOSCAR (whose slow worker falls behind) uses nearly all its ticks."""
    import json
    from pathlib import Path

    from lowcomm_kernels.train import study_loscar as sl

    data = json.loads(
        (Path(__file__).resolve().parents[2] / "docs/data/loscar-regimes/results.json").read_text()
    )
    saved = sl.from_results(data)
    budget = sl.time_budget(saved.base, saved.cfg)
    assert budget == saved.base.steps * saved.cfg.step_time_s
    by_name = {r.name: r for r in saved.results}
    for _, _, row in sl.rows(saved.base, saved.outer_lr, saved.cfg):
        for s in saved.seeds:
            run = by_name[f"{sl.run_key(sl.run_spec(row))} seed={s}"]
            times = sl.retime(run, row, saved.cfg)
            i = sl.scored_index(times, budget)
            assert times[i] <= budget * (1 + 1e-9) and (i + 1 == len(times) or times[i + 1] > budget)
    _, records = sl.summarise(saved.base, saved.outer_lr, saved.seeds, saved.results, saved.cfg)
    steps = {(r["regime"], r["method"]): set(r["steps_scored"]) for r in records}
    for delay in ("short", "long"):
        slow = f"one 2x slower, {delay} delay, iid"
        assert max(steps[slow, "loscar"]) >= 1000
        assert all(400 < st <= 512 for m in ("diloco", "streaming") for st in steps[slow, m])
    assert sl.scored_index([1.0, 2.0, 3.0], 2.0) == 1 and sl.scored_index([5.0], 1.0) == 0
