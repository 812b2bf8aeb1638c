"""A checkpoint saved with a sync in flight under one wire format and resumed under another: the
in-flight result records what it holds (the wire format it was sent in, and whether it is a sum over
the ranks or already their average), so the resumed run applies it exactly as the run that sent it
would have, bit for bit; a checkpoint that does not record it is refused by name."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from lowcomm_kernels.runtime import StreamingDiLoCo
from lowcomm_kernels.runtime.checkpoint import CheckpointError
from lowcomm_kernels.runtime.launch import spawn_local
from tests.runtime.rt_common import one_rank_world

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rt_wire_resume.py")
# fragment 1: sent at 4, applied at 6
STREAMING = {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2}
LOSCAR = {"density": 0.4, "local_steps": 3, "overlap_steps": 2}  # round 1: sent at 8, merged at 10
CASES = {
    # name: (class, knobs, saved at, applied at, wire at save (+ef: with error feedback), wire at
    # resume[, wire of a second resume])
    "streaming int8 -> fp32": ("streaming", STREAMING, 5, 6, "int8", "fp32"),
    "streaming fp32 -> int8": ("streaming", STREAMING, 5, 6, "fp32", "int8"),
    "streaming bf16 -> int4": ("streaming", STREAMING, 5, 6, "bf16", "int4"),
    "streaming int8 -> fp32 -> int4": ("streaming", STREAMING, 5, 6, "int8", "fp32", "int4"),
    "streaming int8+ef -> fp32": ("streaming", STREAMING, 5, 6, "int8+ef", "fp32"),
    "streaming topk+ef -> topk": ("streaming", STREAMING, 5, 6, "topk+ef", "topk"),
    "streaming topk+ef -> fp32": ("streaming", STREAMING, 5, 6, "topk+ef", "fp32"),
    "loscar int8 -> fp32": ("loscar", LOSCAR, 9, 10, "int8", "fp32"),
    "loscar fp32 -> int8": ("loscar", LOSCAR, 9, 10, "fp32", "int8"),
}


@pytest.fixture(scope="module")
def switched(tmp_path_factory) -> dict:
    """Every case on one group of 2 ranks (one process group start): name -> the 2 ranks' results."""
    scs = []
    for name, (cls, kw, at, applied, save, load, *again) in CASES.items():
        d = tmp_path_factory.mktemp(name.replace(" ", "_").replace(">", ""))
        wire, ef = save.removesuffix("+ef"), save.endswith("+ef")
        sc = {"cls": cls, "kw": kw, "at": at, "applied": applied, "save_wire": wire, "save_ef": ef}
        sc["load_wire"] = load
        scs.append({**sc, "dir": str(d), "resave_wire": again[0] if again else None})
    res = spawn_local(f"{WORKER}:switch_all", 2, (scs,), timeout_s=300)
    return {name: [r[i] for r in res] for i, name in enumerate(CASES)}


@pytest.mark.parametrize("name", list(CASES))
def test_in_flight_result_is_applied_as_sent_under_another_wire(switched, name):
    """The state after the in-flight result's merge equals the uninterrupted run's, bit for bit (a
    dense sum read as an average, or the reverse, is off by the number of ranks)."""
    for r in switched[name]:
        assert r["in_flight"], "the checkpoint should hold a sync in flight"
        assert r["refused"] is None, r["refused"]
        full, resumed = r["full"], r["resumed"]
        assert full["step"] == resumed["step"]
        for k in full:
            if k != "step":
                assert torch.equal(full[k], resumed[k]), (
                    f"{k}: max |diff| {(full[k] - resumed[k]).abs().max()}"
                )
        # residuals saved with error feedback and resumed without it are dropped, never silently
        save, load = CASES[name][4], CASES[name][5]
        dropped = [m for m in r["logged"] if "error-feedback residuals" in m]
        assert len(dropped) == (save.endswith("+ef") and load in ("fp32", "bf16")), r["logged"]


@pytest.fixture(scope="module")
def group():
    with one_rank_world() as g:
        yield g


def test_checkpoint_without_the_result_form_is_refused_by_name(group):
    """An in-flight result whose wire format and scale are not recorded (an older build's checkpoint)
    is refused, naming the entry, before anything changes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    st = StreamingDiLoCo(model, opt, sync_every=4, num_fragments=2, fragment_sync_delay=1)
    for _ in range(2):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        st.step()
    sd = st.state_dict()
    assert (
        sd["pending"] and sd["pending"][0]["wire_format"] == "fp32" and sd["pending"][0]["summed_over"] == 1
    )
    for key, value, match in [
        ("wire_format", None, r"pending\[0\]\.wire_format is missing"),
        ("wire_format", "int3", r"pending\[0\]\.wire_format is 'int3'"),
        ("summed_over", 0, r"pending\[0\]\.summed_over"),
        # beyond any process group's ranks: refused here, not an OverflowError at the merge
        ("summed_over", 10**30, r"pending\[0\]\.summed_over should be an int \[1, 2147483647\]"),
        # a quantized result arrives averaged: one that claims to sum 2 ranks would be halved
        ("wire_format", "int8", r"pending\[0\]\.summed_over should be an int \[1, 1\], got 2"),
    ]:
        bad = {**sd, "pending": [{**sd["pending"][0], key: value}]}
        if key == "wire_format" and value == "int8":
            bad["pending"][0]["summed_over"] = 2
        if value is None:
            del bad["pending"][0][key]
        with pytest.raises(CheckpointError, match=match):
            st.load_state_dict(bad)
    assert st.pending[0].handle is not None  # nothing changed
    st.close()
