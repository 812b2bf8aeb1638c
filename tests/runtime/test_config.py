"""Bad configuration is a clear error at construction; a group of size 1 is valid and
trains exactly like the float64 simulation with M = 1."""

from __future__ import annotations

import os

import pytest
import torch

from lowcomm_kernels.runtime import WAN
from lowcomm_kernels.runtime.launch import spawn_local
from tests.runtime.rt_sim import simulate_dense, simulate_loscar

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rt_workers.py")

SIZE1 = [
    {"name": "diloco", "cls": "diloco", "T": 12, "kw": {"sync_every": 4}},
    {"name": "streaming", "cls": "streaming", "T": 16,
     "kw": {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2}},
    {"name": "cocodc", "cls": "cocodc", "T": 16,
     "kw": {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2, "syncs_per_period": 4}},
    {"name": "loscar", "cls": "loscar", "T": 12,
     "kw": {"density": 0.5, "local_steps": 2, "overlap_steps": 1}},
]

EXPECTED = {  # case -> (exception type, words the message must contain)
    "too_many_fragments": ("ValueError", "num_fragments=5"),
    "delay_ge_period": ("ValueError", "fragment_sync_delay=4"),
    "cocodc_delay_too_long": ("ValueError", "fragment_sync_delay=5"),
    "cocodc_n_out_of_range": ("ValueError", "syncs_per_period=5"),
    "density_zero": ("ValueError", "density"),
    "density_above_one": ("ValueError", "density"),
    "density_nan": ("ValueError", "density must be finite"),
    "local_steps_wrong_len": ("ValueError", "local_steps"),
    "mixed_devices": ("ValueError", "mixed devices"),
    "no_trainable": ("ValueError", "no trainable parameters"),
    "mixed_dtype_params": ("TypeError", "one dtype of float32, float64, bfloat16, float16"),
    "bf16_params_f16_wire": ("TypeError", "wire_dtype must be torch.float32 (the outer state's dtype for "
                             "torch.bfloat16 parameters)"),
    "bad_wire_dtype": ("TypeError", "wire_dtype"),
    "bad_on_nonfinite": ("ValueError", "on_nonfinite"),
    "sync_every_zero": ("ValueError", "sync_every"),
    "bad_timeout": ("ValueError", "timeout_s"),
    "uninitialised": ("ValueError", "not initialised"),
}


@pytest.fixture(scope="module")
def result():
    return spawn_local(f"{WORKERS}:config_errors", 1, (SIZE1,), timeout_s=180)[0]


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_configuration_is_a_clear_error(result, case):
    err = result["errors"][case]
    etype, words = EXPECTED[case]
    assert err.startswith(etype + ":") and words in err, err


def test_group_of_size_one_trains_like_the_simulation(result):
    runs = result["runs"]
    for sc in SIZE1:
        r = runs[sc["name"]]
        assert r["error"] is None and r["num_syncs"] > 0 and r["bytes_sent"] == 0
        if sc["cls"] == "loscar":
            sim = simulate_loscar(1, 4, density=0.5, local_steps=[2], overlap_steps=[1],
                                  merge="delay_corrected", seed=0)
        else:
            kw = sc["kw"]
            extra = {} if sc["cls"] == "diloco" else {"K": 2, "tau": 2}
            if sc["cls"] == "cocodc":
                extra["N"] = 4
            sim = simulate_dense(sc["cls"], 1, sc["T"], H=kw["sync_every"], **extra)
        for k, v in sim["params"][0].items():
            torch.testing.assert_close(r["params"][k].to(torch.float64), v, rtol=2e-5, atol=2e-5)


def test_wan_rejects_bad_values():
    with pytest.raises(ValueError, match="latency_s"):
        WAN(-1.0, 1e9)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        WAN(0.05, 0)


def test_finish_applies_pending_results_now(result):
    f = result["finish"]
    # one sync applied on schedule, the pending one applied by finish(); overwrite merge: x_0 = g_0
    assert (f["before"], f["after"], f["pending"], f["x_equals_g"]) == (1, 2, 0, True)
