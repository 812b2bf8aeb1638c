"""Worker for tests/runtime/test_checkpoint_wire.py: a checkpoint saved with a sync in flight under
one wire format, resumed under another. The in-flight result must be applied exactly as the run
that sent it would have applied it. Loaded by file path, so imports are absolute."""

from __future__ import annotations

import os

import torch

import lowcomm_kernels.runtime as rt
from tests.runtime.rt_common import inner_step, make_model, make_opt, runtime_warnings

CLASSES = {"streaming": rt.StreamingDiLoCo, "loscar": rt.LOSCAR}


def _build(cls: str, kw: dict, wire: str, ef: bool = False):
    model = make_model(torch.float32)
    opt = make_opt(model)
    return model, opt, CLASSES[cls](model, opt, wire_dtype=wire, quant_block=16, error_feedback=ef, **kw)


def _state(st) -> dict:
    out = {"x": st.frags.flat.detach().clone(), "step": st.step_count}
    if hasattr(st, "g"):
        out.update(g=st.g.detach().clone(), u=st.u.detach().clone())
    return out


def _train(model, opt, st, rank: int, upto: int) -> None:
    for t in range(st.step_count + 1, upto + 1):
        inner_step(model, opt, rank, t)
        st.step()


def switch(rank: int, world: int, sc: dict) -> dict:
    """Train under sc["save_wire"] to step sc["at"] (a sync in flight), checkpoint, go on to step
    sc["applied"] (its result applied, nothing else sent): the uninterrupted state. Then a fresh
    strategy under sc["load_wire"] loads the checkpoint and trains to the same step: the resumed state.
    With sc["resave_wire"], the resumed strategy saves again at once and a third one, under that wire,
    resumes from the second checkpoint instead; sc["save_ef"] saves with error feedback. A refusal is
    returned as its message; the runtime's warnings at the load as "logged"."""
    path = os.path.join(sc["dir"], f"rank{rank}.pt")
    model, opt, st = _build(sc["cls"], sc["kw"], sc["save_wire"], bool(sc.get("save_ef")))
    _train(model, opt, st, rank, sc["at"])
    in_flight = bool(getattr(st, "pending", None) or getattr(st, "inflight", None))
    st.save_checkpoint(path)
    _train(model, opt, st, rank, sc["applied"])
    full = _state(st)
    st.close()
    model, opt, st = _build(sc["cls"], sc["kw"], sc["load_wire"])
    try:
        with runtime_warnings() as logged:
            st.load_checkpoint(path)
    except rt.CheckpointError as e:
        st.close()
        return {"in_flight": in_flight, "full": full, "refused": str(e)}
    if sc.get("resave_wire"):  # a restored result saved again keeps what it holds
        path = os.path.join(sc["dir"], f"again{rank}.pt")
        st.save_checkpoint(path)
        st.close()
        model, opt, st = _build(sc["cls"], sc["kw"], sc["resave_wire"])
        st.load_checkpoint(path)
    _train(model, opt, st, rank, sc["applied"])
    resumed = _state(st)
    st.close()
    return {"in_flight": in_flight, "full": full, "resumed": resumed, "refused": None, "logged": logged}


def switch_all(rank: int, world: int, scs: list[dict]) -> list[dict]:
    """``switch`` for each scenario in turn, on one group (the ranks start once)."""
    return [switch(rank, world, sc) for sc in scs]
