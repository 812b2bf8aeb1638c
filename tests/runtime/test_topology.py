"""4 ranks = 2 regions x 2 data-parallel ranks: DDP inside a region (inner gloo group), the
strategy over the outer group only. Replicas of a region stay identical, g is identical on all four
ranks, and the trajectory equals the float64 simulation of 2 workers whose gradient is the mean
over the region's two data shards (what DDP computes)."""

from __future__ import annotations

import os

import pytest
import torch

from lowcomm_kernels.runtime.launch import spawn_local
from tests.runtime.rt_sim import simulate_dense

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rt_workers.py")


@pytest.mark.slow
def test_two_regions_by_two_data_parallel():
    kw = {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2}
    T = 24
    res = spawn_local(f"{WORKERS}:topology_run", 4, ({"cls": "streaming", "T": T, "kw": kw},), timeout_s=240)
    assert all(r["g_hashes"] == res[0]["g_hashes"] for r in res) and len(res[0]["g_hashes"]) == 5
    for region in range(2):
        a, b = res[2 * region]["params"], res[2 * region + 1]["params"]
        assert all(torch.equal(a[k], b[k]) for k in a), "DP replicas of a region diverged"
    sim = simulate_dense("streaming", 2, T, H=8, K=2, tau=2, data_ranks=[[0, 1], [2, 3]])
    for region in range(2):
        for k, v in sim["params"][region].items():
            torch.testing.assert_close(res[2 * region]["params"][k], v, rtol=1e-9, atol=1e-9)
