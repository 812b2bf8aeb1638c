"""bf16 / fp16 models on 2 real gloo ranks: every strategy keeps a float32 master (g, u, snapshots)
and matches the float64 simulation of the same rule (rt_sim with ``outer_dtype=float64``: the
inner steps run on the same bf16 / fp16 model, the outer state is float64, and x is rounded to
nearest even when a merge writes it), the memory report measures the buffers, checkpoints resume
bit for bit.

Tolerances: the runtime's master is float32 where the simulation's is float64, so g agrees to
float32's precision (rtol 1e-5 over a few syncs); x is rounded to the model dtype at each merge,
and the two g's may round to neighbouring values where the exact result is within 1e-7 of a tie,
so x agrees to one ulp of bf16 (2⁻⁷ relative) almost everywhere. A bf16 master instead would put
g off by ~2⁻⁹ relative at the first sync: the g check fails on it (test below).
"""

from __future__ import annotations

import os

import pytest
import torch

from lowcomm_kernels.runtime.launch import spawn_local
from tests.runtime.rt_sim import simulate_dense, simulate_loscar

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rt_workers.py")
M = 2
BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64

SCENARIOS = [
    {"name": "diloco", "cls": "diloco", "T": 30, "dtype": BF16, "kw": {"sync_every": 6}},
    {"name": "streaming", "cls": "streaming", "T": 40, "dtype": BF16,
     "kw": {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2, "fragment_update_alpha": 0.5}},
    {"name": "cocodc", "cls": "cocodc", "T": 48, "dtype": BF16,
     "kw": {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2, "syncs_per_period": 4,
            "lam": 0.5, "lam_mode": "normalized"}},
    {"name": "loscar", "cls": "loscar", "T": 30, "dtype": BF16,
     "kw": {"density": 0.5, "local_steps": 4, "overlap_steps": 2, "seed": 3}},
    {"name": "diloco_fp16", "cls": "diloco", "T": 30, "dtype": F16, "kw": {"sync_every": 6}},
    {"name": "streaming_fp16", "cls": "streaming", "T": 40, "dtype": F16,
     "kw": {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2}},
    # the memory report: the same run in fp32 and bf16, ending with a sync in flight (sent at 36)
    {"name": "mem_fp32", "cls": "streaming", "T": 37, "dtype": F32,
     "kw": {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2}},
    {"name": "mem_bf16", "cls": "streaming", "T": 37, "dtype": BF16,
     "kw": {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2}},
    {"name": "mem_bf16_wire", "cls": "streaming", "T": 37, "dtype": BF16,
     "kw": {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2, "wire_dtype": BF16}},
]


@pytest.fixture(scope="module")
def runs():
    return spawn_local(f"{WORKERS}:run_scenarios", M, (SCENARIOS,), timeout_s=240)


def _sc(name):
    return next(s for s in SCENARIOS if s["name"] == name)


def _dense_kw(sc):
    kw = sc["kw"]
    out = {"H": kw["sync_every"]}
    if sc["cls"] == "diloco":
        return out
    out.update(K=kw["num_fragments"], tau=kw["fragment_sync_delay"])
    if sc["cls"] == "streaming":
        out["alpha"] = kw.get("fragment_update_alpha", 0.0)
    else:
        out.update(N=kw["syncs_per_period"], lam=kw["lam"], lam_mode=kw["lam_mode"])
    return out


def _params_close(run: dict, sim: dict, dtype: torch.dtype) -> None:
    """Every parameter of `dtype`, within one ulp of it of the simulation's (see the docstring), and
    bit-identical in at least 95% of the elements."""
    assert run.keys() == sim.keys()
    eps = torch.finfo(dtype).eps
    same = total = 0
    for k in run:
        a, b = run[k], sim[k]
        assert a.dtype == b.dtype == dtype, (k, a.dtype, b.dtype)
        torch.testing.assert_close(a.double(), b.double(), rtol=eps, atol=eps, msg=lambda m, k=k: f"{k}: {m}")
        same += int((a == b).sum())
        total += a.numel()
    assert same >= 0.95 * total, f"only {same} of {total} elements bit-identical to the simulation"


def _check_run(runs, name):
    r0, r1 = runs[0][name], runs[1][name]
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    assert r0["num_syncs"] > 0
    if r0["g"] is not None:
        assert r0["g"].dtype == F32, "the outer state is the float32 master"
        assert r0["g_hashes"] == r1["g_hashes"], "g differs between ranks after a sync"


@pytest.mark.parametrize("name", ["diloco", "streaming", "cocodc", "diloco_fp16", "streaming_fp16"])
def test_dense_low_precision_matches_the_simulation(runs, name):
    sc = _sc(name)
    _check_run(runs, name)
    sim = simulate_dense(sc["cls"], M, sc["T"], dtype=sc["dtype"], outer_dtype=F64, **_dense_kw(sc))
    g = torch.cat(sim["g"])  # fragment order = the flat buffer's
    torch.testing.assert_close(runs[0][name]["g"].double(), g, rtol=1e-5, atol=1e-6)
    for m in range(M):
        _params_close(runs[m][name]["params"], sim["params"][m], sc["dtype"])


def test_a_bf16_master_would_fail_the_g_check(runs):
    """The g comparison above can fail: the same simulation with a bf16 outer state (g, u, the
    merge in bf16) is off by far more than its tolerance."""
    sc = _sc("diloco")
    sim = simulate_dense("diloco", M, sc["T"], dtype=BF16, outer_dtype=BF16, **_dense_kw(sc))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(runs[0]["diloco"]["g"].double(), torch.cat(sim["g"]).double(),
                                   rtol=1e-5, atol=1e-6)


def test_loscar_low_precision_matches_the_simulation(runs):
    sc = _sc("loscar")
    _check_run(runs, "loscar")
    kw = sc["kw"]
    rounds = sc["T"] // (kw["local_steps"] + kw["overlap_steps"])
    sim = simulate_loscar(M, rounds, density=kw["density"], local_steps=[kw["local_steps"]] * M,
                          overlap_steps=[kw["overlap_steps"]] * M, merge="delay_corrected",
                          seed=kw["seed"], dtype=BF16, outer_dtype=F64)
    for m in range(M):
        _params_close(runs[m]["loscar"]["params"], sim["params"][m], BF16)


def test_memory_per_param_is_measured_from_the_buffers(runs):
    """float32 master g and u: 8 bytes per parameter whatever the model dtype; the parameters
    themselves 4 (fp32) or 2 (bf16) bytes. In flight at the end (one fragment of the two): the
    wire Δ (float32 or bf16) and the float32 control vector."""
    mem = {n: runs[0][n]["memory"] for n in ("mem_fp32", "mem_bf16", "mem_bf16_wire")}
    assert mem["mem_fp32"]["params"] == 4.0 and mem["mem_bf16"]["params"] == 2.0
    for m in mem.values():
        assert m["outer_state"] == 8.0, m
        assert m["extra"] == pytest.approx(m["outer_state"] + m["in_flight"] + m["spare"], rel=1e-12)
    d = runs[0]["mem_bf16"]["d"]
    half = mem["mem_bf16"]["in_flight"] * d  # bytes in flight: Δ of one fragment + control
    assert mem["mem_fp32"]["in_flight"] == mem["mem_bf16"]["in_flight"] > 0
    # a bf16 wire halves the Δ bytes: the difference is 2 bytes per element of the fragment
    diff = round((mem["mem_bf16"]["in_flight"] - mem["mem_bf16_wire"]["in_flight"]) * d)
    assert 0 < diff < half and diff % 2 == 0
    # LOSCAR holds no dense copy
    assert runs[0]["loscar"]["memory"]["outer_state"] == 0.0


@pytest.mark.parametrize("cls,kw,at", [
    ("streaming", {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2}, 5),
    ("loscar", {"density": 0.4, "local_steps": 3, "overlap_steps": 2}, 9),
])
def test_bf16_resume_is_bit_identical(tmp_path, cls, kw, at):
    sc = {"name": cls, "cls": cls, "T": 22, "kw": kw, "ckpt_at": at, "ckpt_dir": str(tmp_path), "dtype": BF16}
    res = spawn_local(f"{WORKERS}:resume_pair", 2, (sc,), timeout_s=180)
    for r in res:
        assert r["full"]["error"] is None and r["resumed"]["error"] is None
        for k, v in r["full"]["params"].items():
            assert v.dtype == BF16 and torch.equal(v, r["resumed"]["params"][k]), k
