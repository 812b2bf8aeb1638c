"""The outer step overlapped with the next round (``outer_delay`` 'eager' and 'delayed') on 3 gloo
ranks against a float64 simulation of the rule written out below; M = 1 eager is plain DiLoCo;
checkpoints resume it exactly; the guard passes although g differs between replicas; bad input is
refused by name."""

from __future__ import annotations

import os

import pytest
import torch

import lowcomm_kernels.runtime as rt
from lowcomm_kernels.ops import dequantize_ref, quantize_ref, reduce_quantized_ref
from lowcomm_kernels.runtime.checkpoint import CheckpointError
from lowcomm_kernels.runtime.eager import check_outer_delay
from lowcomm_kernels.runtime.launch import spawn_local
from tests.runtime.rt_common import inner_step, make_model, make_opt, one_rank_world
from tests.runtime.rt_sim import SimWire, Workers, outer_sgd

HERE = os.path.dirname(os.path.abspath(__file__))
EAGER = os.path.join(HERE, "rt_eager.py")
M = 3
F64 = torch.float64


def simulate_overlap(mode: str, M: int, T: int, *, H: int, K: int = 1, alpha: float = 0.0, outer_lr=0.7,
                     outer_mu=0.9, wire: SimWire | None = None) -> dict:
    """The rule, plainly: every worker keeps its own g and u. After step t, for each fragment p sent
    at t (DiLoCo: t ≡ 0 mod H; Streaming: t ≡ ⌊pH/K⌋ mod H): the average sent a round ago has
    arrived (Δ^(t−1), 0 before the first); worker m sends Δ_m^(t) = g_m − x_m (as it goes on the
    wire: quantized after error feedback) and steps with
        eager:   Δ̃ = Δ^(t−1) + (Δ_m^(t) − Δ_m^(t−1)) / M       delayed: Δ̃ = Δ^(t−1)
    then x_m ← α·x_m + (1−α)·g_m."""
    W = Workers(M, K)
    g = [[W.get(m, p) for p in range(K)] for m in range(M)]
    u = [[torch.zeros_like(v) for v in g[0]] for _ in range(M)]
    own = [[torch.zeros_like(v) for v in g[0]] for _ in range(M)]  # Δ_m^(t−1)
    res = [[torch.zeros_like(v) for v in g[0]] for _ in range(M)]  # error feedback
    arrived = [torch.zeros_like(v) for v in g[0]]  # Δ^(t−1)
    in_flight = [None] * K
    for t in range(1, T + 1):
        for m in range(M):
            W.step(m, t)
        for p in range(K):
            if t % H != (p * H) // K:
                continue
            if in_flight[p] is not None:
                arrived[p] = in_flight[p]
            sent = [g[m][p] - W.get(m, p) for m in range(M)]
            if wire is None:
                in_flight[p] = sum(sent) / M
            else:  # each worker's payload as dequantized codes; their mean requantized
                codes, scales = [], []
                for m in range(M):
                    e = sent[m] + res[m][p] if wire.error_feedback else sent[m]
                    c, s = quantize_ref(e, wire.fmt, wire.block)
                    sent[m] = dequantize_ref(c, s, wire.fmt, wire.block, e.numel(), out_dtype=F64)
                    if wire.error_feedback:
                        res[m][p] = e - sent[m]
                    codes.append(c)
                    scales.append(s)
                rc, rs = reduce_quantized_ref(torch.stack(codes), torch.stack(scales), wire.fmt, wire.block,
                                              sent[0].numel(), scale=1.0 / M)
                in_flight[p] = dequantize_ref(rc, rs, wire.fmt, wire.block, sent[0].numel(), out_dtype=F64)
            for m in range(M):
                d = arrived[p] + (sent[m] - own[m][p]) / M if mode == "eager" else arrived[p]
                g[m][p], u[m][p] = outer_sgd(g[m][p], u[m][p], d, outer_lr, outer_mu)
                W.put(m, p, alpha * W.get(m, p) + (1 - alpha) * g[m][p])
                own[m][p] = sent[m]
    return {"params": [W.named(m) for m in range(M)]}


STREAM = {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 0}
SCENARIOS = [
    {"name": "diloco_eager", "cls": "diloco", "T": 25, "kw": {"sync_every": 5, "eager": True}},
    {"name": "diloco_delayed", "cls": "diloco", "T": 25, "kw": {"sync_every": 5, "outer_delay": "delayed"}},
    {"name": "streaming_eager", "cls": "streaming", "T": 40,
     "kw": {**STREAM, "fragment_update_alpha": 0.5, "outer_delay": "eager"}},
    {"name": "streaming_delayed", "cls": "streaming", "T": 36,
     "kw": {"sync_every": 9, "num_fragments": 3, "fragment_sync_delay": 0, "outer_delay": "delayed"}},
    {"name": "diloco_eager_bf16", "cls": "diloco", "T": 20, "dtype": torch.float32,
     "kw": {"sync_every": 5, "eager": True, "wire_dtype": torch.bfloat16}},
    {"name": "streaming_eager_int4_ef", "cls": "streaming", "T": 40,
     "kw": {**STREAM, "eager": True, "wire_dtype": "int4", "quant_block": 16, "error_feedback": True}},
    {"name": "diloco_eager_int8", "cls": "diloco", "T": 20,
     "kw": {"sync_every": 5, "eager": True, "wire_dtype": "int8"}},
    {"name": "eager_guard", "cls": "streaming", "T": 24, "kw": {**STREAM, "eager": True, "guard_every": 1}},
    {"name": "delayed_guard", "cls": "diloco", "T": 12, "kw": {"sync_every": 3, "outer_delay": "delayed",
                                                                  "guard_every": 1}},
    {"name": "eager_nan", "cls": "diloco", "T": 30, "inject_nan": (1, 12),
     "kw": {"sync_every": 6, "eager": True}},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    resume = {"name": "resume", "cls": "streaming", "T": 40, "ckpt_at": 19,
              "ckpt_dir": str(tmp_path_factory.mktemp("eager_ckpt")),
              "kw": {**STREAM, "eager": True, "wire_dtype": "int8", "error_feedback": True}}
    return spawn_local(f"{EAGER}:eager_runs", M, (SCENARIOS, resume), timeout_s=300)


def _sc(name):
    return next(s for s in SCENARIOS if s["name"] == name)


def _close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k].to(F64), b[k].to(F64), rtol=tol, atol=tol,
                                   msg=lambda m, k=k: f"{k}: {m}")


def _ok(runs, name):
    for r in range(M):
        assert runs[r][name]["error"] is None, (r, runs[r][name]["error"])


def _sim(name, **extra):
    sc = _sc(name)
    kw = sc["kw"]
    mode = "eager" if kw.get("eager") else kw["outer_delay"]
    frag = {} if sc["cls"] == "diloco" else {"K": kw["num_fragments"],
                                             "alpha": kw.get("fragment_update_alpha", 0.0)}
    return simulate_overlap(mode, M, sc["T"], H=kw["sync_every"], **frag, **extra)


@pytest.mark.parametrize("name", ["diloco_eager", "diloco_delayed", "streaming_eager", "streaming_delayed"])
def test_matches_the_float64_simulation(runs, name):
    _ok(runs, name)
    sim = _sim(name)
    for m in range(M):
        _close(runs[m][name]["params"], sim["params"][m], 1e-9)


@pytest.mark.parametrize("name,fmt,block,ef", [("streaming_eager_int4_ef", "int4", 16, True),
                                               ("diloco_eager_int8", "int8", 128, False)])
def test_quantized_share_is_what_was_sent(runs, name, fmt, block, ef):
    """Δ_m is this worker's dequantized payload (after error feedback), the average the requantized
    mean: the simulation quantizes likewise."""
    _ok(runs, name)
    sim = _sim(name, wire=SimWire(fmt, block, ef))
    for m in range(M):
        _close(runs[m][name]["params"], sim["params"][m], 1e-9)


def test_bf16_wire_stays_close(runs):
    """Δ_m is the bf16-rounded Δ the worker sent: the float64 rule within bf16 rounding."""
    _ok(runs, "diloco_eager_bf16")
    sim = _sim("diloco_eager_bf16")
    for m in range(M):
        _close(runs[m]["diloco_eager_bf16"]["params"], sim["params"][m], 2e-2)


def test_sends_and_collections(runs):
    """Each sync is collected at the fragment's next send (staleness H); the last ones stay in flight."""
    recs = runs[0]["streaming_eager"]["records"]  # (fragment, send, apply, skipped, reason, round)
    assert [(f, s, a) for f, s, a, *_ in recs] == [
        (f, s, s + 8) for s in range(1, 40) for f in (0, 1) if s % 8 == (f * 8) // 2 and s + 8 <= 40
    ]


def test_guard_checks_the_averages_not_g(runs):
    """With guard_every=1 the eager run raises nothing although the replicas' g differ; under
    'delayed' every replica applies the same averages, so g stays identical."""
    _ok(runs, "eager_guard")
    _ok(runs, "delayed_guard")
    assert not torch.equal(runs[0]["eager_guard"]["g"], runs[1]["eager_guard"]["g"])
    assert runs[0]["delayed_guard"]["g_hashes"] == runs[1]["delayed_guard"]["g_hashes"]
    assert torch.equal(runs[0]["delayed_guard"]["g"], runs[2]["delayed_guard"]["g"])


def test_nonfinite_share_is_skipped_everywhere(runs):
    """Rank 1's x holds a NaN at its send step 12: it skips its own outer step; its sync is skipped
    by every rank when collected at 18; training goes on finite."""
    _ok(runs, "eager_nan")
    for r in range(M):
        res = runs[r]["eager_nan"]
        assert res["num_skipped"] == 1
        assert [s for _, s, _, skipped, *_ in res["records"] if skipped] == [12]
        assert all(torch.isfinite(v).all() for v in res["params"].values())
        assert torch.isfinite(res["g"]).all()


def test_checkpoint_resumes_exactly(runs):
    """A checkpoint mid-round (step 19, the int8 + error feedback syncs of both fragments in flight)
    resumes to the uninterrupted run's parameters bit for bit."""
    for r in range(M):
        res = runs[r]["resume"]
        assert res["full"]["error"] is None and res["resumed"]["error"] is None
        assert res["start"] == 19
        for k, v in res["full"]["params"].items():
            assert torch.equal(v, res["resumed"]["params"][k]), k


# ----- one rank: the identity with plain DiLoCo, refusals ------------------------------------------
def _train(cls, T, **kw):
    model = make_model()
    opt = make_opt(model)
    st = cls(model, opt, **kw)
    try:
        for t in range(1, T + 1):
            inner_step(model, opt, 0, t)
            st.step()
        return {k: v.detach().clone() for k, v in model.named_parameters()}, st.state_dict()
    finally:
        st.close()


@pytest.mark.parametrize("cls,kw", [(rt.DiLoCo, {"sync_every": 4}),
                                    (rt.StreamingDiLoCo, {**STREAM, "fragment_update_alpha": 0.3})])
def test_one_worker_eager_is_the_method_without_delay(cls, kw):
    """M = 1: Δ̃ = Δ^(t−1) − Δ^(t−1) + Δ^(t) = Δ^(t), exactly (the runtime subtracts the stale
    shares first): the parameters equal the method's without overlap, bit for bit."""
    with one_rank_world():
        plain, _ = _train(cls, 20, **kw)
        eager, _ = _train(cls, 20, eager=True, **kw)
    for k in plain:
        assert torch.equal(plain[k], eager[k]), k


def test_checkpoint_of_another_mode_is_refused():
    with one_rank_world():
        _, sd = _train(rt.DiLoCo, 6, sync_every=3, eager=True)
        model = make_model()
        st = rt.DiLoCo(model, make_opt(model), sync_every=3)
        try:
            words = "outer_delay='eager' but this strategy has outer_delay='none'"
            with pytest.raises(CheckpointError, match=words):
                st.load_state_dict(sd)
        finally:
            st.close()


def test_dcp_refuses_eager_by_name():
    """DCP keeps one copy of a tensor saved under the same name on every rank: eager replicas' g, u
    and own shares would be replaced by one rank's. The delayed baseline's state is replicated."""
    from lowcomm_kernels.runtime.dcp import DCPState

    with one_rank_world():
        for mode, refused in (("eager", True), ("delayed", False)):
            model = make_model()
            st = rt.DiLoCo(model, make_opt(model), sync_every=3, outer_delay=mode)
            try:
                if refused:
                    words = "DCPState does not support outer_delay='eager'"
                    with pytest.raises(CheckpointError, match=words):
                        DCPState(st)
                else:
                    DCPState(st)
            finally:
                st.close()


def test_malformed_outer_delay_entry_is_refused():
    with one_rank_world():
        _, sd = _train(rt.DiLoCo, 6, sync_every=3, eager=True)
        model = make_model()
        st = rt.DiLoCo(model, make_opt(model), sync_every=3, eager=True)
        try:
            with pytest.raises(CheckpointError, match="outer_delay should be None or a dict"):
                st.load_state_dict({**sd, "outer_delay": "eager"})
            with pytest.raises(CheckpointError, match="outer_delay.own"):
                st.load_state_dict({**sd, "outer_delay": {**sd["outer_delay"], "own": None}})
            st.load_state_dict(sd)
        finally:
            st.close()


@pytest.mark.parametrize("build,exc,words", [
    (lambda m, o: rt.DiLoCo(m, o, sync_every=3, outer_delay="eagre"), ValueError,
     "outer_delay must be one of"),
    (lambda m, o: rt.DiLoCo(m, o, sync_every=3, eager="yes"), TypeError, "eager must be a bool"),
    (lambda m, o: rt.DiLoCo(m, o, sync_every=3, eager=True, outer_delay="delayed"), ValueError,
     "eager=True asks for outer_delay 'eager' but outer_delay is 'delayed'"),
    (lambda m, o: rt.StreamingDiLoCo(m, o, sync_every=8, num_fragments=2, fragment_sync_delay=1, eager=True),
     ValueError, "fragment_sync_delay must be 0, got 1"),
    (lambda m, o: rt.CoCoDC(m, o, sync_every=8, num_fragments=2, fragment_sync_delay=2, syncs_per_period=4,
                            outer_delay="delayed"), ValueError, "CoCoDC takes no outer_delay='delayed'"),
    (lambda m, o: rt.LOSCAR(m, o, density=0.5, local_steps=2, overlap_steps=1, eager=True), TypeError,
     "eager"),
    (lambda m, o: rt.DiLoCo(m, o, sync_every=3, wire_dtype="topk", eager=True), ValueError,
     "outer_delay='eager' is not supported with wire_dtype='topk'"),
])
def test_bad_input_refused_by_name(build, exc, words):
    with one_rank_world():
        model = make_model()
        with pytest.raises(exc, match=words):
            build(model, make_opt(model))


def test_torchft_refused_by_name():
    """The check every dense strategy runs before it touches a torchft Manager."""
    with pytest.raises(ValueError, match="outer_delay='eager' is not supported with a torchft Manager"):
        check_outer_delay("eager", "DiLoCo", fragment_sync_delay=0, ft=True)
    check_outer_delay("none", "DiLoCo", fragment_sync_delay=0, ft=True)  # nothing to refuse


# ----- the CLI's run specification --------------------------------------------------------------
def test_spec_takes_it_for_diloco_and_streaming_only():
    from lowcomm_kernels.train.errors import SpecError
    from lowcomm_kernels.train.spec import TrainSpec

    TrainSpec(method="diloco", outer_delay="eager")
    TrainSpec(method="streaming", outer_delay="delayed", fragment_sync_delay=0)
    for method in ("dp", "cocodc", "loscar"):
        with pytest.raises(SpecError, match=r"outer_delay 'eager' is not supported by"):
            TrainSpec(method=method, outer_delay="eager")
    with pytest.raises(SpecError, match=r"fragment_sync_delay must be 0, got 3"):
        TrainSpec(method="streaming", outer_delay="eager", fragment_sync_delay=3)
    with pytest.raises(SpecError, match=r"outer_delay must be one of"):
        TrainSpec(method="diloco", outer_delay="lazy")
    with pytest.raises(SpecError, match=r"outer_delay='eager' is not supported with wire_dtype='topk'"):
        TrainSpec(method="diloco", outer_delay="eager", wire_dtype="topk")


def test_cli_flags_reach_the_strategy():
    """--eager and --outer-delay set TrainSpec.outer_delay, in the flags' words when refused;
    build_strategy hands it to the runtime."""
    from lowcomm_kernels.cli import build_parser
    from lowcomm_kernels.train.args import spec_from_args
    from lowcomm_kernels.train.errors import UsageError
    from lowcomm_kernels.train.strategies import build_strategy

    p = build_parser()
    args = p.parse_args(["train", "--method", "diloco", "--eager", "--workers", "1"])
    spec = spec_from_args(args, "diloco")
    assert spec.outer_delay == "eager"
    args = p.parse_args(["train", "--method", "cocodc", "--outer-delay", "delayed", "--workers", "1"])
    with pytest.raises(UsageError, match="--outer-delay 'delayed' is not supported by CoCoDC"):
        spec_from_args(args, "cocodc")
    with one_rank_world() as group:
        model = make_model()
        st = build_strategy(spec.with_(sync_every=3), model, make_opt(model), group)
        try:
            assert st.outer_delay == "eager" and st.overlap is not None
        finally:
            st.close()


@pytest.mark.parametrize(
    "flags", [["--eager", "--outer-delay", "delayed"], ["--outer-delay", "none", "--eager"]]
)
def test_cli_refuses_eager_beside_outer_delay(flags):
    """--eager with --outer-delay is a usage error naming both (before, the later flag silently won:
    --eager --outer-delay delayed trained the delayed baseline, which the runtime's eager=True with
    outer_delay='delayed' refuses)."""
    import argparse

    from lowcomm_kernels.cli import build_parser

    with pytest.raises(argparse.ArgumentError, match="not allowed with") as e:
        build_parser().parse_args(["train", "--method", "diloco", *flags])
    assert "--eager" in str(e.value) and "--outer-delay" in str(e.value)
