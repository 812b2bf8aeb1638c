"""Overlap is real: with an emulated WAN latency L and τ·T_c ≥ L, the steps between send and apply
take about the compute time, not compute + L; blocking DiLoCo pays ≈ L per sync.

Compute is emulated with ``time.sleep(T_c)`` per step so the timing does not depend on how busy the
shared CPU is (sleeping needs no core), and the margins are several times the scheduler noise.
"""

from __future__ import annotations

import os

import pytest

from lowcomm_kernels.runtime.launch import spawn_local

# wall-clock assertions: in a parallel run, alone (conftest.py)
pytestmark = pytest.mark.serial

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rt_workers.py")
L, T_C = 0.15, 0.05  # latency 150 ms; 50 ms per inner step; τ = 7 -> τ·T_c = 350 ms ≥ L

SCENARIOS = [
    {"name": "diloco", "cls": "diloco", "T": 24, "latency": L, "t_c": T_C, "kw": {"sync_every": 6}},
    {"name": "streaming", "cls": "streaming", "T": 24, "latency": L, "t_c": T_C,
     "kw": {"sync_every": 16, "num_fragments": 2, "fragment_sync_delay": 7}},
    {"name": "loscar", "cls": "loscar", "T": 24, "latency": L, "t_c": T_C,
     "kw": {"density": 0.5, "local_steps": 4, "overlap_steps": 8}},
]


@pytest.fixture(scope="module")
def runs():
    return spawn_local(f"{WORKERS}:overlap_run", 2, (SCENARIOS,), timeout_s=240)


def test_blocking_diloco_exposes_the_latency(runs):
    for r in runs:
        d = r["diloco"]
        assert d["num_syncs"] == 4
        assert d["exposed"] >= 0.8 * 4 * L, d  # every sync blocked for ~L
        assert min(d["in_flight"]) >= L


@pytest.mark.parametrize("name", ["streaming", "loscar"])
def test_overlapped_sync_hides_the_latency(runs, name):
    for r in runs:
        s = r[name]
        assert s["num_syncs"] >= 2, s
        assert min(s["in_flight"]) >= L  # the emulated link really took L...
        assert s["exposed"] < 0.25 * L * s["num_syncs"], s  # ...but the steps did not wait for it
        # wall time ≈ compute, not compute + L per sync
        assert s["wall"] < s["compute"] + 0.5 * L * s["num_syncs"] + 0.5, s
