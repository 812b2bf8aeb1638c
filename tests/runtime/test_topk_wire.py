"""The top-k sparse wire format in the strategies (runtime.topk_wire) on gloo ranks: the all-gather
sum equals the reference codec's payloads decoded by hand in rank order (2 and 4 ranks); DiLoCo
with wire_dtype='topk' equals, step for step, a hand simulation of the workers with the reference
codec (plain SGD outer step and Nesterov); Streaming DiLoCo and CoCoDC take it; the bytes each sync
reports are (M−1) payloads; refusals by name."""

from __future__ import annotations

import os

import pytest
import torch

from lowcomm_kernels.ops import TopKFormat, outer_merge_ref, topk_decode_add_ref, topk_encode_ref
from lowcomm_kernels.runtime.launch import spawn_local
from tests.runtime.rt_topk import Quadratic, payload_values, problem

HERE = os.path.dirname(os.path.abspath(__file__))
TOPK = os.path.join(HERE, "rt_topk.py")
F64 = torch.float64

CASES = [
    {"name": "defaults_short_tail", "k": 64, "chunk": 4096, "bits": 2, "n": 3 * 4096 + 100, "seed": 1},
    {"name": "sign_only", "k": 5, "chunk": 64, "bits": 1, "n": 333, "seed": 2},
    {"name": "four_bits_k_is_chunk", "k": 16, "chunk": 16, "bits": 4, "n": 50, "seed": 3},
]


@pytest.mark.parametrize("M", [2, 4])
def test_allgather_sums_every_ranks_payload_on_every_rank(M):
    res = spawn_local(f"{TOPK}:allgather_cases", M, (CASES,), timeout_s=180)
    for c in CASES:
        f = TopKFormat(c["k"], c["chunk"], c["bits"])
        want = torch.zeros(c["n"], dtype=F64)
        for r in range(M):  # the reference codec, by hand, in rank order
            p, _ = topk_encode_ref(
                payload_values(r, c["n"], c["seed"]), torch.zeros(c["n"], dtype=F64), f, 0.9
            )
            topk_decode_add_ref(want, p, f)
        for r in range(M):
            got = res[r][c["name"]]
            assert torch.equal(got["result"], want), (c["name"], r)
            assert got["control"] == [float(i + 1) for i in range(M)]
            assert got["wire_bytes"] == (M - 1) * f.payload_bytes(c["n"])  # a ring all-gather's, per worker


D1, D2, T, LR = 40, 27, 24, 0.3
VARIANTS = [
    {"name": "diloco_sgd", "cls": "diloco",
     "kw": {"sync_every": 4, "outer_lr": 0.8, "outer_momentum": 0.0, "topk_k": 3, "topk_chunk": 16,
            "ef_beta": 0.9}},
    {"name": "diloco_nesterov", "cls": "diloco",
     "kw": {"sync_every": 4, "outer_lr": 0.7, "outer_momentum": 0.9, "topk_k": 3, "topk_chunk": 16,
            "topk_bits": 1, "ef_beta": 1.0}},
    {"name": "streaming", "cls": "streaming",
     "kw": {"sync_every": 6, "num_fragments": 2, "fragment_sync_delay": 1, "topk_k": 3, "topk_chunk": 16}},
    {"name": "cocodc", "cls": "cocodc",
     "kw": {"sync_every": 6, "num_fragments": 2, "fragment_sync_delay": 1, "syncs_per_period": 2,
            "topk_k": 3, "topk_chunk": 16, "lam_mode": "absolute"}},
]  # fmt: skip


@pytest.fixture(scope="module")
def runs():
    return spawn_local(f"{TOPK}:quadratic_runs", 2, (VARIANTS, D1, D2, T, LR), timeout_s=300)


def _simulate_diloco(M: int, kw: dict) -> list[torch.Tensor]:
    """DiLoCo with the reference codec, by hand: M workers' SGD steps, every H steps Δ_r = g − x_r
    through each worker's e_r, the payloads decoded and summed in rank order, / M, the outer step
    (outer_merge_ref), x_r ← g. Every worker's parameters after every step."""
    a, b_all = problem(M, D1 + D2)
    f = TopKFormat(kw["topk_k"], kw["topk_chunk"], kw.get("topk_bits", 2))
    models = [Quadratic(D1, D2) for _ in range(M)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    g, u = torch.zeros(D1 + D2, dtype=F64), torch.zeros(D1 + D2, dtype=F64)
    e = [torch.zeros(D1 + D2, dtype=F64) for _ in range(M)]
    traj = [[] for _ in range(M)]
    for t in range(1, T + 1):
        for r in range(M):
            x = torch.cat([models[r].x1, models[r].x2])
            (0.5 * (a * (x - b_all[r]) ** 2).sum()).backward()
            opts[r].step()
            opts[r].zero_grad()
        if t % kw["sync_every"] == 0:
            total = torch.zeros(D1 + D2, dtype=F64)
            for r in range(M):
                x = torch.cat([models[r].x1, models[r].x2]).detach()
                p, nf = topk_encode_ref(g - x, e[r], f, kw["ef_beta"])
                assert int(nf) == 0
                topk_decode_add_ref(total, p, f)
            x = torch.zeros(D1 + D2, dtype=F64)  # overwritten with g (alpha = 0)
            outer_merge_ref(g, u, total.div_(M), x, lr=kw["outer_lr"], momentum=kw["outer_momentum"])
            for m in models:
                with torch.no_grad():
                    m.x1.copy_(x[:D1])
                    m.x2.copy_(x[D1:])
        for r in range(M):
            traj[r].append(torch.cat([models[r].x1, models[r].x2]).detach().clone())
    return [torch.stack(tr) for tr in traj]


@pytest.mark.parametrize("name", ["diloco_sgd", "diloco_nesterov"])
def test_diloco_equals_the_reference_codec_by_hand(runs, name):
    kw = next(v["kw"] for v in VARIANTS if v["name"] == name)
    want = _simulate_diloco(2, kw)
    for r in range(2):
        assert torch.equal(runs[r][name]["traj"], want[r]), (name, r)  # bit for bit


@pytest.mark.parametrize("name", [v["name"] for v in VARIANTS])
def test_every_sync_reports_the_bytes_of_an_allgather(runs, name):
    """(M − 1) × the payload of the synced fragment: what a worker sends (and receives) per sync."""
    kw = next(v["kw"] for v in VARIANTS if v["name"] == name)
    sizes = [D1 + D2] if kw.get("num_fragments", 1) == 1 else [D1, D2]
    for r in range(2):
        got = runs[r][name]
        assert got["bytes"], name
        f = TopKFormat(kw["topk_k"], kw["topk_chunk"], kw.get("topk_bits", 2))
        for frag, nbytes in zip(got["fragments"], got["bytes"], strict=True):
            assert nbytes == (2 - 1) * f.payload_bytes(sizes[frag])
        assert got["bytes_sent"] == sum(got["bytes"])


@pytest.mark.parametrize("name", ["streaming", "cocodc"])
def test_other_strategies_agree_across_ranks_and_make_progress(runs, name):
    g0, g1 = runs[0][name]["g"], runs[1][name]["g"]
    assert torch.equal(g0, g1)
    a, b_all = problem(2, D1 + D2)
    optimum = b_all.mean(0)
    start = optimum.norm()
    assert float((g0 - optimum).norm()) < 0.9 * float(start), name


def test_bad_configurations_are_refused_by_name():
    res = spawn_local(f"{TOPK}:bad_configs", 1, (), timeout_s=120)[0]
    assert res["k_past_chunk"].startswith("ValueError: topk_k must be in [1, 32]"), res
    assert res["bits_3"].startswith("ValueError: topk_bits must be one of (1, 2, 4)"), res
    assert res["beta_past_1"].startswith("ValueError: ef_beta must be <= 1"), res
    assert res["chunk_1"].startswith("ValueError: topk_chunk must be in [2,"), res
    assert res["loscar"].startswith("ValueError: wire_dtype='topk' is not supported by LOSCAR"), res
