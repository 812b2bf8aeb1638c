"""The emulated WAN never waits past timeout_s: a link on which one sync outlasts it is refused when
the strategy is built (naming wan and timeout_s, nothing changed), and a wait whose deadline lies
further ahead raises SyncError at once (it used to sleep for ~30 years, or overflow time.sleep)."""

from __future__ import annotations

import os

import pytest

from lowcomm_kernels.runtime.launch import spawn_local

BOUNDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rt_bounds.py")


@pytest.fixture(scope="module")
def bounds():
    return spawn_local(f"{BOUNDS}:wan_bounds", 2, (), timeout_s=120)


@pytest.mark.parametrize("case", ["diloco_latency", "diloco_bandwidth", "loscar_latency", "loscar_bandwidth"])
def test_a_link_slower_than_the_timeout_is_refused_at_construction(bounds, case):
    for r in (0, 1):
        got = bounds[r][case]
        err = got["error"]
        assert err is not None and err.startswith("ValueError: wan: one collective of"), err
        assert "timeout_s=5" in err and "every sync would time out" in err, err
        assert got["unchanged"] and got["s"] < 5.0, got


def test_the_largest_sync_decides(bounds):
    assert all(bounds[r]["loscar_small_payload_accepted"] for r in (0, 1))


@pytest.mark.parametrize("link", ["latency", "bandwidth"])
def test_a_wait_past_the_timeout_raises_at_once(bounds, link):
    for r in (0, 1):
        got = bounds[r][f"wait_{link}"]
        err = got["error"]
        assert err is not None and err.startswith(f"SyncError: sync on the {link} link: the emulated"), err
        assert "more than timeout_s=5" in err and got["s"] < 5.0, got
