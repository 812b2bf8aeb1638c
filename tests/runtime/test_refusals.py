"""Configurations a strategy refuses at construction, naming the argument, on every rank, before
anything changes (the model's parameters keep their own storage)."""

from __future__ import annotations

import os

import pytest
import torch

import lowcomm_kernels.runtime as rt
from lowcomm_kernels.runtime.launch import spawn_local
from tests.runtime.rt_common import make_model, make_opt, one_rank_world

REFUSALS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rt_refusals.py")


@pytest.mark.parametrize("world", [1, 2])
def test_a_meta_device_model_is_refused_by_name(world):
    """It used to fail on Tensor.item() in the join on 2 ranks and train on 1 until its first sync."""
    res = spawn_local(f"{REFUSALS}:meta_models", world, (), timeout_s=120)
    for r in range(world):
        meta = "is on the meta device and holds no values to synchronise"
        assert res[r]["all_meta"].startswith(f"ValueError: model: parameter 'inp.weight' {meta}"), res[r]
        assert res[r]["frozen_meta"].startswith(f"ValueError: model: parameter 'blocks.0.weight' {meta}")
        assert res[r]["all_meta_unchanged"] and res[r]["frozen_meta_unchanged"], res[r]


# (strategy, knobs, error) of values the first sync (its ops) used to refuse, on every rank
FIRST_SYNC = {
    "loscar_seed_2**64": ("LOSCAR", {"seed": 2**64, "density": 0.5, "local_steps": 2, "overlap_steps": 1},
                          "ValueError: seed must be in [0, 9223372036854775807] (a non-negative int64"),
    "quant_block_2**50": ("DiLoCo", {"sync_every": 2, "wire_dtype": "int8", "quant_block": 2**50},
                          "ValueError: quant_block must be <= 2**40, got 1125899906842624"),
}


@pytest.mark.parametrize("case", sorted(FIRST_SYNC))
def test_ranges_of_the_ops_are_checked_at_construction(case):
    cls, kw, words = FIRST_SYNC[case]
    with one_rank_world():
        model = make_model(torch.float32)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(ValueError) as err:
            getattr(rt, cls)(model, make_opt(model), **kw)
        assert f"{type(err.value).__name__}: {err.value}".startswith(words), str(err.value)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


MERGE_KNOBS = [  # (strategy, knobs besides its schedule, the knob named)
    ("DiLoCo", {"alpha": 0.5}, "alpha"),  # it used to turn DiLoCo's x <- g_new into a mix silently
    ("DiLoCo", {"lam": 0.5, "lam_mode": "normalized"}, "lam"),
    ("DiLoCo", {"beta": 1.0}, "beta"),
    ("StreamingDiLoCo", {"lam": 0.5}, "lam"),
    ("StreamingDiLoCo", {"alpha": 0.5}, "alpha"),  # its own is fragment_update_alpha
    ("CoCoDC", {"alpha": 0.5, "syncs_per_period": 2}, "alpha"),
]
SCHEDULES = {
    "DiLoCo": {"sync_every": 4},
    "StreamingDiLoCo": {"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 1},
    "CoCoDC": {"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 1},
}


@pytest.mark.parametrize(("cls", "kw", "knob"), MERGE_KNOBS)
def test_another_methods_merge_knob_is_refused_by_name(cls, kw, knob):
    with one_rank_world():
        model = make_model(torch.float32)
        with pytest.raises(TypeError, match=f"^{cls} takes no {knob}: that merge knob is set by "):
            getattr(rt, cls)(model, make_opt(model), **SCHEDULES[cls], **kw)
        getattr(rt, cls)(model, make_opt(model), **SCHEDULES[cls]).close()  # nothing was left wrapped
