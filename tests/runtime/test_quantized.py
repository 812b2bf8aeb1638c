"""Quantized wire formats: the quantized all-reduce on 2 and 4 gloo ranks and every strategy with an
8-bit and a 4-bit format against the float64 simulation extended with the same quantizer
(rt_sim.quantized_mean over the ops.quantize references); error feedback; a dead peer; bad input."""

from __future__ import annotations

import os

import pytest
import torch

from lowcomm_kernels.ops import FORMATS, dequantize_ref, quantize_ref, reduce_quantized_ref
from lowcomm_kernels.runtime import DiLoCo
from lowcomm_kernels.runtime.compression import resolve_wire_format
from lowcomm_kernels.runtime.launch import spawn_local
from lowcomm_kernels.runtime.transport import ring_wire_bytes
from tests.runtime.rt_common import inner_step, make_model, make_opt, one_rank_world
from tests.runtime.rt_quant import payload
from tests.runtime.rt_sim import SimWire, simulate_dense, simulate_loscar

HERE = os.path.dirname(os.path.abspath(__file__))
QUANT = os.path.join(HERE, "rt_quant.py")
WORKERS = os.path.join(HERE, "rt_workers.py")
F64 = torch.float64

# n: one short last chunk (1000 over 4 x 64-blocks), fewer blocks than ranks (empty chunks), an odd n
# with 4-bit codes (a half byte at the end)
CASES = [
    {"name": "int8_1000", "fmt": "int8", "block": 64, "n": 1000, "seed": 1},
    {"name": "int4_odd", "fmt": "int4", "block": 16, "n": 333, "seed": 2},
    {"name": "fp8_e4m3_tiny", "fmt": "fp8_e4m3", "block": 128, "n": 100, "seed": 3},
    {"name": "fp8_e5m2", "fmt": "fp8_e5m2", "block": 32, "n": 777, "seed": 4},
    {"name": "fp4_e3m0_odd", "fmt": "fp4_e3m0", "block": 32, "n": 555, "seed": 6},
    {"name": "fp4_e2m1_wan", "fmt": "fp4_e2m1", "block": 64, "n": 4096, "seed": 5, "latency": 0.3},  # last
]


def _expected(case: dict, M: int) -> torch.Tensor:
    """The spec, written out: quantize each rank's payload, reduce_quantized_ref of all of it at
    once (no chunks) with scale 1/M, dequantize."""
    n, fmt, block = case["n"], case["fmt"], case["block"]
    qs = [quantize_ref(payload(r, n, case["seed"]), fmt, block) for r in range(M)]
    codes, scales = torch.stack([c for c, _ in qs]), torch.stack([s for _, s in qs])
    rc, rs = reduce_quantized_ref(codes, scales, fmt, block, n, scale=1.0 / M)
    return dequantize_ref(rc, rs, fmt, block, n)


@pytest.mark.parametrize("M", [2, 4])
def test_quantized_allreduce_equals_the_reference_on_every_rank(M):
    res = spawn_local(f"{QUANT}:allreduce_cases", M, (CASES,), timeout_s=180)
    for case in CASES:
        want = _expected(case, M)
        f = FORMATS[case["fmt"]]
        payload_bytes = f.payload_bytes(case["n"]) + 4 * f.num_scales(case["n"], case["block"])
        for r in range(M):
            got = res[r][case["name"]]
            assert torch.equal(got["result"], want), (case["name"], r)
            assert got["control"] == [float(i + 1) for i in range(M)]  # the control vector, summed
            assert got["wire_bytes"] == ring_wire_bytes(payload_bytes, M)  # 2(M−1)/M × (codes + scales)
            assert got["thread_stopped"]


@pytest.mark.serial  # times the exposed wait: in a parallel run, alone (conftest.py)
def test_quantized_sync_overlaps_like_the_dense_one():
    """With an emulated 0.3 s latency, poll() right after the send is False and wait() blocks for the
    rest of the latency (the exposed time), as Transport.all_reduce's handles do."""
    res = spawn_local(f"{QUANT}:allreduce_cases", 2, ([CASES[-1]],), timeout_s=120)
    for r in range(2):
        got = res[r]["fp4_e2m1_wan"]
        assert got["polled_early"] is False
        assert 0.2 < got["exposed"] < 2.0 and got["in_flight_s"] >= 0.3 - 1e-3


# Blocks of 2 (8-bit codes) and 2 or 4 (4-bit codes) give chunks whose codes take 4k + 2 bytes on
# 2 or 4 ranks; the scales that follow them in the byte row must still start 4-byte aligned.
SMALL_BLOCK_CASES = [
    {"name": "int8_block2", "fmt": "int8", "block": 2, "n": 18, "seed": 6},
    {"name": "fp8_block2", "fmt": "fp8_e5m2", "block": 2, "n": 1002, "seed": 7},
    {"name": "int4_block4_odd", "fmt": "int4", "block": 4, "n": 37, "seed": 8},
    {"name": "fp4_block2", "fmt": "fp4_e2m1", "block": 2, "n": 101, "seed": 9},
]


@pytest.mark.parametrize("M", [2, 4])
def test_small_blocks_average_like_the_reference(M):
    res = spawn_local(f"{QUANT}:allreduce_cases", M, (SMALL_BLOCK_CASES,), timeout_s=180)
    for case in SMALL_BLOCK_CASES:
        want = _expected(case, M)
        for r in range(M):
            assert torch.equal(res[r][case["name"]]["result"], want), (case["name"], M, r)


@pytest.mark.parametrize(("fmt", "block"), [("int8", 2), ("int4", 2), ("int4", 4), ("fp4_e2m1", 4)])
def test_small_blocks_sync_every_model_size(fmt, block):
    """A documented block of 2 or 4 used to crash every rank at its first sync for most model sizes
    ("storage_offset() must be divisible by 4"): DiLoCo syncs models of 1 to 8 widths."""
    with one_rank_world():
        for width in range(1, 9):
            model = make_model(torch.float32, width=width, blocks=1)
            opt = make_opt(model)
            st = DiLoCo(model, opt, sync_every=1, wire_dtype=fmt, quant_block=block)
            try:
                for t in (1, 2):
                    inner_step(model, opt, 0, t)
                    st.step()
                assert st.metrics.num_syncs == 2 and st.metrics.num_skipped == 0, width
                assert torch.isfinite(st.g).all(), width
            finally:
                st.close()


# ----- every strategy against the simulation -----------------------------------------------------
DENSE = {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2}
COCO = {**DENSE, "syncs_per_period": 4, "lam": 0.5, "lam_mode": "normalized"}
SCENARIOS = [
    {"name": "diloco_int8", "cls": "diloco", "T": 24, "kw": {"sync_every": 6, "wire_dtype": "int8"}},
    {
        "name": "diloco_int4",
        "cls": "diloco",
        "T": 24,
        "kw": {"sync_every": 6, "wire_dtype": "int4", "quant_block": 32},
    },
    {"name": "streaming_int8", "cls": "streaming", "T": 40, "kw": {**DENSE, "wire_dtype": "int8"}},
    {
        "name": "streaming_fp4",
        "cls": "streaming",
        "T": 40,
        "kw": {**DENSE, "wire_dtype": "fp4_e2m1", "quant_block": 16},
    },
    {
        "name": "streaming_int4_ef",
        "cls": "streaming",
        "T": 40,
        "kw": {**DENSE, "wire_dtype": "int4", "quant_block": 16, "error_feedback": True},
    },
    {"name": "cocodc_int8", "cls": "cocodc", "T": 48, "kw": {**COCO, "wire_dtype": "int8"}},
    {
        "name": "cocodc_int4_ef",
        "cls": "cocodc",
        "T": 48,
        "kw": {**COCO, "wire_dtype": "int4", "quant_block": 16, "error_feedback": True},
    },
    {
        "name": "cocodc_fp8_l1",
        "cls": "cocodc",
        "T": 40,
        "kw": {**COCO, "score": "l1_local", "wire_dtype": "fp8_e4m3"},
    },
    {
        "name": "loscar_int8",
        "cls": "loscar",
        "T": 30,
        "kw": {"density": 0.5, "local_steps": 4, "overlap_steps": 2, "seed": 3, "wire_dtype": "int8"},
    },
    {
        "name": "loscar_fp4",
        "cls": "loscar",
        "T": 30,
        "kw": {
            "density": 0.5,
            "local_steps": 4,
            "overlap_steps": 2,
            "seed": 3,
            "wire_dtype": "fp4_e2m1",
            "quant_block": 16,
        },
    },
    {
        "name": "nan_skip_int4_ef",
        "cls": "diloco",
        "T": 24,
        "inject_nan": (1, 12),
        "kw": {"sync_every": 6, "wire_dtype": "int4", "quant_block": 32, "error_feedback": True},
    },
    {"name": "streaming_fp32", "cls": "streaming", "T": 40, "kw": dict(DENSE)},
]


@pytest.fixture(scope="module")
def runs():
    return spawn_local(f"{WORKERS}:run_scenarios", 2, (SCENARIOS,), timeout_s=300)


def _sc(name):
    return next(s for s in SCENARIOS if s["name"] == name)


def _wire(sc):
    kw = sc["kw"]
    return SimWire(kw["wire_dtype"], kw.get("quant_block", 128), kw.get("error_feedback", False))


def _close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(
            a[k].to(F64), b[k].to(F64), rtol=tol, atol=tol, msg=lambda m, k=k: f"{k}: {m}"
        )


def _dense_kw(sc):
    kw = sc["kw"]
    out = {"H": kw["sync_every"]}
    if sc["cls"] == "diloco":
        return out
    out.update(K=kw["num_fragments"], tau=kw["fragment_sync_delay"])
    if sc["cls"] == "cocodc":
        out.update(N=kw["syncs_per_period"], lam=kw["lam"], lam_mode=kw["lam_mode"])
    return out


@pytest.mark.parametrize(
    "name",
    [
        "diloco_int8",
        "diloco_int4",
        "streaming_int8",
        "streaming_fp4",
        "streaming_int4_ef",
        "cocodc_int8",
        "cocodc_int4_ef",
    ],
)
def test_dense_strategies_match_the_quantized_simulation(runs, name):
    sc = _sc(name)
    r0, r1 = runs[0][name], runs[1][name]
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    assert r0["g_hashes"] == r1["g_hashes"] and r0["num_syncs"] > 0  # g identical on both ranks
    sim = simulate_dense(sc["cls"], 2, sc["T"], wire=_wire(sc), **_dense_kw(sc))
    for m in range(2):
        _close(runs[m][name]["params"], sim["params"][m], 1e-9)
    tau = _dense_kw(sc).get("tau", 0)
    sends = [(f, s, reason) for f, s, _, _, reason, _ in r0["records"]]
    assert sends == [(p, t, why) for p, t, why in sim["sends"] if t + tau <= sc["T"]]


def test_cocodc_l1_local_scores_still_rank_fragments_identically(runs):
    """l1_local scores come from each rank's own g − x, summed beside the sync: the ranks pick the
    same fragments and some pick is made by score, with the payload quantized."""
    a = [(r[0], r[1], r[4]) for r in runs[0]["cocodc_fp8_l1"]["records"]]
    b = [(r[0], r[1], r[4]) for r in runs[1]["cocodc_fp8_l1"]["records"]]
    assert a == b and "score" in [x[2] for x in a]
    assert runs[0]["cocodc_fp8_l1"]["g_hashes"] == runs[1]["cocodc_fp8_l1"]["g_hashes"]


@pytest.mark.parametrize("name", ["loscar_int8", "loscar_fp4"])
def test_loscar_matches_the_quantized_simulation(runs, name):
    sc = _sc(name)
    kw = sc["kw"]
    sim = simulate_loscar(
        2,
        5,
        density=kw["density"],
        local_steps=[4, 4],
        overlap_steps=[2, 2],
        merge="delay_corrected",
        seed=kw["seed"],
        wire=_wire(sc),
    )
    for m in range(2):
        assert runs[m][name]["error"] is None
        _close(runs[m][name]["params"], sim["params"][m], 1e-9)


def test_true_wire_bytes_are_reported(runs):
    """Bytes per worker and sync = 2(M−1)/M × (codes + scales), = codes + scales for M = 2: int8 with
    128-blocks is 1 + 4/128 bytes per value, 4-bit with 16-blocks 0.5 + 4/16, float64 8."""
    sizes = _fragment_sizes(runs)
    for name, per_frag in (
        ("streaming_fp32", lambda n: 8 * n),  # a float64 model: the dense wire is float64
        ("streaming_int8", lambda n: FORMATS["int8"].wire_bytes(n, 128)),
        ("streaming_fp4", lambda n: FORMATS["fp4_e2m1"].wire_bytes(n, 16)),
    ):
        r = runs[0][name]
        assert r["num_syncs"] > 4
        assert r["bytes_sent"] == sum(per_frag(sizes[f]) for f, *_ in r["records"]), name
    ratio = runs[0]["streaming_fp32"]["bytes_sent"] / runs[0]["streaming_fp4"]["bytes_sent"]
    assert ratio > 8 / (0.5 + 4 / 16) - 0.5  # ~10.7x fewer bytes than float64, scales included


def _fragment_sizes(runs) -> list[int]:
    from lowcomm_kernels.runtime.fragments import FlatFragments
    from tests.runtime.rt_common import make_model

    return FlatFragments(make_model(F64), 2, None).sizes()


def test_nonfinite_sync_is_skipped_and_clears_the_residual(runs):
    r0, r1 = runs[0]["nan_skip_int4_ef"], runs[1]["nan_skip_int4_ef"]
    assert r0["error"] is None and r1["error"] is None
    assert [(f, s) for f, s, _, sk, _, _ in r0["records"] if sk] == [(0, 12)]
    assert r0["g_hashes"] == r1["g_hashes"]
    sc = _sc("nan_skip_int4_ef")
    sim = simulate_dense("diloco", 2, 24, H=6, inject_nan=(1, 12), wire=_wire(sc))
    assert sim["skipped"] == [(0, 12)]
    for m in range(2):
        assert all(torch.isfinite(v).all() for v in runs[m]["nan_skip_int4_ef"]["params"].values())
        _close(runs[m]["nan_skip_int4_ef"]["params"], sim["params"][m], 1e-9)


def test_error_feedback_memory_is_reported(runs):
    mem = runs[0]["streaming_int4_ef"]["memory"]
    plain = runs[0]["streaming_int8"]["memory"]
    assert mem["outer_state"] == plain["outer_state"] + 8  # one float64 residual per parameter


# ----- error feedback on a quadratic ---------------------------------------------------------------
def test_error_feedback_lands_nearer_the_unquantized_trajectory():
    variants = [
        {"name": "fp32", "kw": {}},
        {"name": "int4", "kw": {"wire_dtype": "int4", "quant_block": 64}},
        {"name": "int4_ef", "kw": {"wire_dtype": "int4", "quant_block": 64, "error_feedback": True}},
    ]
    res = spawn_local(f"{QUANT}:quadratic_runs", 2, (variants, 256, 120, 4), timeout_s=180)[0]
    ref = res["fp32"]["traj"]
    dist = {k: float((res[k]["traj"] - ref).norm(dim=1).mean()) for k in ("int4", "int4_ef")}
    final = {k: float((res[k]["traj"][-1] - res["optimum"]).norm()) for k in ("fp32", "int4", "int4_ef")}
    print("mean distance to the fp32 trajectory:", dist, "final distance to the optimum:", final)
    assert dist["int4_ef"] < 0.5 * dist["int4"], dist
    assert final["int4_ef"] < 0.5 * final["int4"], final
    assert res["int4_ef"]["residual_bytes"] == 256 * 4 and res["int4"]["residual_bytes"] == 0


@pytest.mark.slow
def test_error_feedback_residual_is_checkpointed(tmp_path):
    res = spawn_local(f"{QUANT}:checkpoint_residual", 2, (str(tmp_path),), timeout_s=180)
    for r in range(2):
        assert res[r]["restored"] and res[r]["residual_nonzero"]
        for k, v in res[r]["full"].items():
            assert torch.equal(v, res[r]["resumed"][k]), k
        assert res[r]["refused"] is not None and "residual" in res[r]["refused"], res[r]["refused"]


# ----- failures ------------------------------------------------------------------------------------
def _peer_fault(tmp_path, kw: dict, kill_at: int, **extra) -> list:
    """Streaming DiLoCo on 2 ranks over 24 steps under ``kw``; rank 1 killed (or, with hang=True,
    hung) at step ``kill_at``: each rank's result (None for the dead one)."""
    sc = {"cls": "streaming", "T": 24, "kw": kw, "dtype": torch.float32, "ckpt_dir": str(tmp_path),
          "ckpt_every": 100, "victim": 1, "kill_at": kill_at, **extra}  # fmt: skip
    return spawn_local(f"{WORKERS}:killed_run", 2, (sc,), timeout_s=120, allow_dead=(1,))


@pytest.mark.slow
def test_killed_peer_during_a_quantized_sync_is_a_sync_error_in_time(tmp_path):
    kw = {
        "sync_every": 6,
        "num_fragments": 2,
        "fragment_sync_delay": 1,
        "timeout_s": 10.0,
        "wire_dtype": "int4",
        "quant_block": 32,
        "error_feedback": True,
    }
    res = _peer_fault(tmp_path, kw, kill_at=9)
    assert res[1] is None
    err = res[0]["error"]
    assert err is not None and err.startswith("SyncError") and "fragment" in err, err
    assert res[0]["after_kill_s"] < kw["timeout_s"] + 5, res[0]


@pytest.mark.slow
def test_hung_peer_during_a_quantized_sync_times_out(tmp_path):
    kw = {
        "sync_every": 6,
        "num_fragments": 2,
        "fragment_sync_delay": 1,
        "timeout_s": 3.0,
        "wire_dtype": "int8",
    }
    res = _peer_fault(tmp_path, kw, kill_at=8, hang=True)
    err = res[0]["error"]
    assert err is not None and err.startswith("SyncError") and "fragment" in err, err
    assert kw["timeout_s"] - 0.5 <= res[0]["after_kill_s"] < 2 * kw["timeout_s"] + 10, res[0]


def test_bad_wire_configurations_are_refused_naming_the_argument():
    res = spawn_local(f"{QUANT}:bad_configs", 1, (), timeout_s=120)[0]
    assert res["unknown_format"].startswith("ValueError: wire_dtype must be one of"), res
    assert "'int3'" in res["unknown_format"]
    for name in ("block_not_pow2", "block_one"):
        assert res[name].startswith("ValueError: quant_block must be a power of two"), res[name]
    assert res["block_bool"].startswith("TypeError: quant_block"), res["block_bool"]
    assert res["ef_dense_wire"].startswith("ValueError: error_feedback=True needs a quantized"), res
    assert res["ef_not_bool"].startswith("TypeError: error_feedback"), res
    assert res["ef_loscar"].startswith("ValueError: error_feedback"), res


def test_resolve_wire_format_names_every_choice():
    w = resolve_wire_format("fp4_e2m1", 32, torch.float32, torch.float32)
    assert w.quant is FORMATS["fp4_e2m1"] and w.block == 32 and w.dtype == torch.float32
    assert w.payload_bytes(1000) == 500 + 4 * 32
    assert resolve_wire_format(None, 128, torch.float32, torch.float32).name == "fp32"
    assert resolve_wire_format("bf16", 128, torch.float32, torch.float32).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="wire_dtype must be one of"):
        resolve_wire_format("fp16", 128, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="my_block must be a power of two"):
        resolve_wire_format("int8", 96, torch.float32, torch.float32, name=lambda n: f"my_{n.split('_')[1]}")


@pytest.mark.parametrize("wire", ["int8", "topk"])
def test_a_compressed_wire_forms_after_ranks_made_uneven_subgroups(wire):
    """torch names the wire's own group after the number of groups each rank holds: a rank that made
    an extra subgroup first must not leave the strategy waiting on a group the others named otherwise
    (it timed out in the store before)."""
    res = spawn_local(f"{QUANT}:after_uneven_subgroups", 2, (wire,), timeout_s=120)
    assert res[0]["syncs"] == res[1]["syncs"] == 2
    assert torch.equal(res[0]["params"], res[1]["params"])  # the same average applied on both ranks
