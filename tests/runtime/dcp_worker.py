"""Worker for tests/runtime/test_dcp.py: one rank that trains, saves the strategy with
torch.distributed.checkpoint (DCPState) and/or resumes from such a save, on however many ranks
``spawn_local`` starts (or in the test process itself, on its one-rank default group).
Loaded by file path, so imports are absolute."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import lowcomm_kernels.runtime as rt
from lowcomm_kernels.runtime.dcp import DCPState
from tests.runtime.rt_common import inner_step, make_model, make_opt, runtime_warnings

CLASSES = {"diloco": rt.DiLoCo, "streaming": rt.StreamingDiLoCo, "cocodc": rt.CoCoDC, "loscar": rt.LOSCAR}


def _outer(st) -> dict:
    """The replicated global state: g and u (dense) or the round counter (LOSCAR), and the schedule."""
    if isinstance(st, rt.LOSCAR):
        return {"round": st.round, "s": st.s, "step": st.step_count}
    return {
        "g": st.g.clone(),
        "u": st.u.clone(),
        "step": st.step_count,
        "pending": [(pd.fragment, pd.send_step, pd.apply_step) for pd in st.pending],
    }


def _residual(st) -> torch.Tensor | None:
    res = getattr(st, "residual", None)
    return None if res is None else res.clone()


def run(rank: int, world: int, sc: dict) -> dict:
    """Build the strategy (sc: cls, kw); if sc["load"], resume from sc["path"]; train sc["steps"] more
    steps (or, with sc["rounds"], until LOSCAR finished that many rounds); if sc["save"], save to
    sc["path"]; then train sc["after"] more steps. Returns the outer state at each point, and this
    rank's error-feedback residual where it has one. With sc["refused"], a load that fails returns its
    message as out["refused"]; sc["restart_ef"] loads with ``restart_error_feedback=True``. The
    runtime's warnings at the load are out["logged"]."""
    model = make_model(torch.float32)
    opt = make_opt(model)
    st = CLASSES[sc["cls"]](model, opt, **sc["kw"])
    out: dict = {}
    if sc.get("load"):
        strategy = DCPState(st, restart_error_feedback=bool(sc.get("restart_ef")))
        state = {"model": model.state_dict(), "strategy": strategy}
        try:
            with runtime_warnings() as out["logged"]:
                dcp.load(state, checkpoint_id=sc["path"])
        except CheckpointException as e:  # a BaseException: DCP's refusal on every rank
            if not sc.get("refused"):
                raise
            st.close()
            return {"refused": f"{type(e).__name__}: {e}"}
        model.load_state_dict(state["model"])
        out["loaded"] = _outer(st)
        out["x_loaded"] = st.frags.flat.clone()
        out["residual_loaded"] = _residual(st)
    losses = []

    def train(n: int) -> None:
        for _ in range(n):
            losses.append(inner_step(model, opt, rank, st.step_count + 1))
            st.step()

    if sc.get("rounds"):
        while not (st.round == sc["rounds"] and st.at_round_end):
            train(1)
    else:
        train(sc.get("steps", 0))
    if sc.get("save"):
        dcp.save({"model": model.state_dict(), "strategy": DCPState(st)}, checkpoint_id=sc["path"])
        out["saved"] = _outer(st)
        out["residual_saved"] = _residual(st)
    train(sc.get("one", 0))
    out["after_one"] = _outer(st)
    train(sc.get("after", 0))
    out["final"] = _outer(st)
    out["x_final"] = st.frags.flat.clone()
    out["losses"] = losses
    st.close()
    return out


def run_all(rank: int, world: int, scs: list[dict]) -> list[dict]:
    """``run`` for each scenario in turn, on one group (the tests' rank processes start once)."""
    return [run(rank, world, sc) for sc in scs]
