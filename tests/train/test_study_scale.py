"""The cocodc-scale study: the headline contrasts of cocodc-paper on the larger model, declared
before the runs, each pairing configurations the study runs, at matched sync counts."""

from __future__ import annotations

import statistics

from lowcomm_kernels.train.model import parameter_count
from lowcomm_kernels.train.studies import STUDIES
from lowcomm_kernels.train.study_scale import CONTRASTS, SETUP, tables

FULL = SETUP.spec()


def test_the_model_is_ten_times_the_small_study_and_ten_seeds_run():
    assert parameter_count(FULL.model) >= 10 * 20_688 and FULL.model.seq_len >= 128
    assert SETUP.seeds == 10


def test_every_declared_contrast_pairs_two_configurations_at_matched_syncs():
    cfgs = dict(STUDIES["cocodc-scale"](FULL))
    for _, a, b in CONTRASTS:
        assert a in cfgs and b in cfgs
    coco, stream = cfgs["CoCoDC adaptive"], cfgs["Streaming DiLoCo, 8 syncs/H"]
    # CoCoDC's N = 8 per H against Streaming's K fragments per H/2: the same syncs per H
    assert stream.num_fragments * coco.sync_every // stream.sync_every == 8
    assert cfgs["Streaming DiLoCo, 8 syncs/H, alpha=0.5"].fragment_update_alpha == 0.5
    assert cfgs["CoCoDC round-robin"].score == "round_robin" and coco.score == "l2_global"


def test_the_table_has_no_columns_of_the_papers_own_numbers():
    md, _ = tables([a for a, _ in STUDIES["cocodc-scale"](FULL)], [], 2.0, [0])
    assert "paper" not in md.lower()


def test_the_detection_table_says_how_many_pairs_reach_the_goal():
    """From fake finals with a known paired spread: the smallest detectable effect of these pairs
    and the pairs at which it falls to the goal (0.01), with the CPU hours at the runs' cost."""
    from lowcomm_kernels.train.report import RunResult
    from lowcomm_kernels.train.stats import pairs_to_detect
    from lowcomm_kernels.train.study_scale import GOAL, detection_table

    a, b = CONTRASTS[2][1], CONTRASTS[2][2]  # adaptive vs round-robin
    diffs = [0.01, -0.01, 0.02, 0.0, 0.005]
    runs = []
    for seed, d in enumerate(diffs):
        for label, loss in ((a, 1.4 + d), (b, 1.4)):
            r = RunResult(label, "cocodc", {"seed": seed})
            r.final_eval = {"val_loss": loss}
            r.extra = {"cpu_s_all_ranks": 360.0}
            runs.append(r)
    md = detection_table([CONTRASTS[2]], runs)
    row = next(line for line in md.splitlines() if line.startswith(f"| {CONTRASTS[2][0]} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    std = statistics.stdev(diffs)
    need = pairs_to_detect(float(cells[2]), GOAL)
    assert cells[1] == "5" and abs(float(cells[2]) - std) < 1e-4
    assert cells[4] == str(need) and need > 5
    assert cells[5] == f"{2 * need * 360 / 3600:.1f}"
    assert "360 CPU s" in md
