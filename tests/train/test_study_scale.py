"""The cocodc-scale study: the headline contrasts of cocodc-paper on the larger model, declared
before the runs, each pairing configurations the study runs, at matched sync counts."""

from __future__ import annotations

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
