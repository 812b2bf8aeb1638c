"""Eager updates hide a whole round: with an emulated WAN latency L below a round's compute
(H·T_c), the steps never wait; with L above it, the wait at the collection (the fragment's next
send) is counted as exposed communication, about L − H·T_c per sync.

Compute is emulated with ``time.sleep(T_c)`` per step, as in test_overlap."""

from __future__ import annotations

import os

import pytest

from lowcomm_kernels.runtime.launch import spawn_local

# wall-clock assertions: in a parallel run, alone (conftest.py)
pytestmark = pytest.mark.serial

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rt_workers.py")
T_C, H = 0.05, 6  # a round: 300 ms of compute
SCENARIOS = [
    {"name": "hidden", "cls": "diloco", "T": 24, "latency": 0.15, "t_c": T_C,
     "kw": {"sync_every": H, "eager": True}},
    {"name": "streaming_hidden", "cls": "streaming", "T": 24, "latency": 0.15, "t_c": T_C,
     "kw": {"sync_every": 12, "num_fragments": 2, "fragment_sync_delay": 0, "outer_delay": "delayed"}},
    {"name": "late", "cls": "diloco", "T": 24, "latency": 0.6, "t_c": T_C,
     "kw": {"sync_every": H, "eager": True}},
]


@pytest.fixture(scope="module")
def runs():
    return spawn_local(f"{WORKERS}:overlap_run", 2, (SCENARIOS,), timeout_s=240)


@pytest.mark.parametrize("name", ["hidden", "streaming_hidden"])
def test_a_round_hides_the_latency(runs, name):
    for r in runs:
        s = r[name]
        assert s["num_syncs"] >= 2, s  # collected: all but the last round's
        assert min(s["in_flight"]) >= 0.15  # the emulated link really took L...
        # ...but no step waited for it (blocking would wait about L per sync; the margin absorbs a
        # rank that a loaded machine lets fall behind its peer)
        assert s["exposed"] < 0.5 * 0.15 * s["num_syncs"], s


def test_a_late_average_is_exposed_at_its_collection(runs):
    for r in runs:
        s = r["late"]
        assert s["num_syncs"] == 3, s  # sent at 6, 12, 18, 24; the last still in flight
        wait = 0.6 - H * T_C
        assert 0.6 * 3 * wait <= s["exposed"] <= 3 * wait + 0.3, s
