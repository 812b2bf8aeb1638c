"""The non-convex digits MLP task (``compare --task mlp``): data, shards, real runs on 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lowcomm_kernels.cli import main
from lowcomm_kernels.train.spec import TrainSpec
from lowcomm_kernels.train.tasks.mlp import PRESETS, load_digits_split, run_mlp_specs, shard_rows


def test_digits_split_is_fixed_and_sorted_by_label():
    Xtr, ytr, Xte, yte = load_digits_split()
    assert Xtr.shape[1] == 64 and Xtr.shape[0] + Xte.shape[0] == 1797
    assert Xte.shape[0] == round(0.2 * 1797) and 0.0 <= float(Xtr.min()) and float(Xtr.max()) <= 1.0
    assert torch.all(ytr[1:] >= ytr[:-1])  # label-sorted: contiguous shares are non-iid
    again = load_digits_split()
    assert all(torch.equal(a, b) for a, b in zip((Xtr, ytr, Xte, yte), again, strict=True))


@pytest.mark.parametrize("split", ["contiguous", "iid"])
def test_shards_are_disjoint_and_cover_the_rows(split):
    _, ytr, _, _ = load_digits_split()
    n = ytr.numel()
    shards = [shard_rows(n, r, 4, split) for r in range(4)]
    rows = torch.cat(shards)
    assert rows.unique().numel() == rows.numel() == n
    digits = [ytr[s].unique().numel() for s in shards]
    if split == "iid":
        assert digits == [10] * 4
    else:
        assert max(digits) <= 4  # each worker sees a few digits only


@pytest.mark.slow
def test_mlp_trains_and_p0_sends_nothing_on_two_workers():
    p = {**PRESETS["quick"], "workers": 2, "steps": 96, "eval_every": 32, "split": "iid"}
    base = TrainSpec(method="loscar", **p)
    specs = [
        base.with_(method="dp"),
        base,
        base.with_(density=0.0, name="p0"),
        base.with_(worker_speeds=(1.0, 2.0), speed_model="steps", name="slow"),
    ]
    dp, loscar, p0, slow = run_mlp_specs(specs, progress=False)
    for r in (dp, loscar, p0, slow):
        losses = [pt.val_loss for pt in r.points]
        assert [pt.step for pt in r.points] == [0, 32, 64, 96]
        assert losses[-1] < 0.7 * losses[0], (r.name, losses)  # ln 10 = 2.30 at the start
    assert p0.bytes_sent == 0 and p0.syncs == 0 and p0.points[-1].bytes_sent == 0
    assert p0.points[-1].val_loss_workers[0] != p0.points[-1].val_loss_workers[1]  # two separate models
    assert loscar.syncs == 96 // 8 and loscar.bytes_sent > 0
    assert dp.points[-1].workers_agree  # the same averaged gradient on both workers
    # a 2x slower LOSCAR worker: 3 + 1 steps in each round of 6 + 2 ticks
    assert slow.extra["steps_per_rank"] == [96, 48] and slow.syncs == 12
    # time model: LOSCAR's rounds overlap the 20 ms link, dp pays it on each of its 96 steps
    link = 0.02 + loscar.bytes_sent / loscar.syncs / 12.5e6  # latency + one round's bytes / bandwidth
    assert loscar.train_wall_s == pytest.approx(12 * max(8 * 0.01, 6 * 0.01 + link))
    assert dp.train_wall_s > loscar.train_wall_s + 96 * 0.02


@pytest.mark.slow
@pytest.mark.study  # the whole study, 40 runs twice: CI runs it in its own step (pytest -m study)
def test_loscar_regimes_quick_study_writes_its_tables(tmp_path: Path):
    out = tmp_path / "study"
    argv = ["compare", "--study", "loscar-regimes", "--quick", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    text = (out / "loscar-regimes.md").read_text()
    assert (out / "loscar-regimes.png").read_bytes().startswith(b"\x89PNG")
    assert "Paired by seed" in text and text.count("| one 2x slower, long delay, contiguous |") >= 5
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["rows"]) == 40 and len(doc["runs"]) == 20 * 2
    assert all(len(r["own_loss_at_budget"]) == 2 for r in doc["rows"])
    assert main(argv) == 0  # resumed: every launch read back from out/runs and out/tune
    again = json.loads((out / "results.json").read_text())
    assert [r["own_loss_at_budget"] for r in again["rows"]] == [r["own_loss_at_budget"] for r in doc["rows"]]


@pytest.mark.slow
def test_compare_task_mlp_writes_the_table(tmp_path: Path, capsys):
    out = tmp_path / "cmp"
    argv = ["compare", "--task", "mlp", "--quick", "--workers", "2", "--methods", "diloco,loscar"]
    assert main([*argv, "--density", "0", "--no-progress", "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in doc["rows"]] == ["DiLoCo", "LOSCAR"]
    loscar = doc["runs"][1]
    assert loscar["config"]["density"] == 0 and loscar["bytes_sent"] == 0  # p = 0: each worker alone
    assert doc["runs"][0]["syncs"] == 128 // 32 and "modeled seconds" in (out / "table.md").read_text()
