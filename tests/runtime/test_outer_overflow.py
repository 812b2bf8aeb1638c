"""Every rank's pseudo-gradient is finite, but their sum or the outer step (momentum) overflows: the
sync is skipped on every rank with a warning, g and u exactly as before it, the fragment restarts
from them, and training goes on finite. Before, g turned non-finite without a skip (and a later
"restart from the last good global" restarted from it)."""

from __future__ import annotations

import os

import pytest
import torch

from lowcomm_kernels.runtime.launch import spawn_local
from tests.runtime.rt_overflow import AT, H

OVERFLOW = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rt_overflow.py")

CASES = {  # ranks, strategy, knobs, what is subtracted from x before the send at AT, syncs skipped
    # 2e38 on each of 2 ranks: the fp32 wire's sum overflows (no momentum)
    "sum_fp32": (2, "diloco", {"outer_momentum": 0.0}, 2e38, 1),
    "sum_int8": (2, "diloco", {"outer_momentum": 0.0, "wire_dtype": "int8"}, 2e38, 1),
    # 3e38 on one rank: Δ̄ + μ·u_new = 3e38 (1 + 0.9) overflows in the Nesterov step
    "momentum": (1, "diloco", {"outer_momentum": 0.9}, 3e38, 1),
    "momentum_bf16_wire": (1, "diloco", {"outer_momentum": 0.9, "wire_dtype": torch.bfloat16}, 3e38, 1),
    # fragment 0's outer step overflows; the inner step run while it is in flight (τ = 1) turns x
    # non-finite, so fragment 1's next sync is skipped as a non-finite one and the ranks restart
    "streaming": (2, "streaming", {"num_fragments": 2, "fragment_sync_delay": 1}, 3e38, 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_overflowing_outer_step_is_skipped_with_g_and_u_kept(case):
    world, cls, kw, huge, n_skipped = CASES[case]
    res = spawn_local(f"{OVERFLOW}:overflow_run", world, (cls, kw, huge), timeout_s=120)
    for r in range(world):
        got = res[r]
        assert got["error"] is None, got["error"]
        assert torch.equal(got["g_after"], got["g_before"]) and torch.equal(got["u_after"], got["u_before"])
        assert got["finite"], "g or x is not finite at the end"
        skipped = [send for send, s in got["skipped"] if s]
        assert len(skipped) == n_skipped and AT - H < skipped[0] <= AT, got["skipped"]
        assert sum("the outer step overflowed" in w for w in got["warnings"]) == 1, got["warnings"]
        if cls == "diloco":  # the fragment restarted from the kept g (DiLoCo: all of x)
            assert torch.equal(got["x_after"], got["g_before"])
        assert torch.equal(got["g_final"], res[0]["g_final"])  # the same on every rank


def test_overflowing_syncs_in_a_row_stop_every_rank():
    """outer_lr so large that every sync overflows: stop after max_nonfinite_syncs, not skip forever."""
    kw = {"outer_lr": 1e41, "max_nonfinite_syncs": 2}
    res = spawn_local(f"{OVERFLOW}:overflow_run", 2, ("diloco", kw, 0.0), timeout_s=120)
    for r in range(2):
        err = res[r]["error"]
        assert err is not None and err.startswith("FloatingPointError") and "2 syncs in a row" in err, err
