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


@pytest.mark.parametrize("timeout_s", [1e12, 1e14, 1e300, True])
def test_a_timeout_beyond_what_a_wait_can_carry_is_refused_by_name(timeout_s):
    """timeout_s above MAX_TIMEOUT_S (or a bool) is a ValueError naming it when the strategy is built
    (it was accepted and raised OverflowError at the first sync's wait for 1e12, and an unnamed
    OverflowError from datetime at construction for 1e14 and more)."""
    import torch

    import lowcomm_kernels.runtime as rt
    from tests.runtime.rt_common import make_model, make_opt, one_rank_world

    with one_rank_world():
        model = make_model(torch.float32)
        with pytest.raises(ValueError, match=r"timeout_s must be a number in \(0, 1e\+09\] seconds"):
            rt.DiLoCo(model, make_opt(model), sync_every=2, timeout_s=timeout_s)


@pytest.mark.parametrize("timeout_s", [float("nan"), -1.0, 0, 1e12])
def test_the_torchft_transport_checks_timeout_s_too(timeout_s):
    """The torchft transport checks timeout_s by the same rule (it took any value)."""
    pytest.importorskip("torchft")
    import torch

    from lowcomm_kernels.runtime.ft import FTTransport

    class Manager:
        _replica_id = "replica0"

    with pytest.raises(ValueError, match="timeout_s must be a number"):
        FTTransport(Manager(), 2, device=torch.device("cpu"), timeout_s=timeout_s)
