"""Configurations a strategy refuses at construction, naming the argument, on every rank, before
anything changes (the model's parameters keep their own storage)."""

from __future__ import annotations

import os

import pytest

from lowcomm_kernels.runtime.launch import spawn_local

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
