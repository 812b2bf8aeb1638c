"""A strategy inside a user's ``torch.distributed.checkpoint`` (DCP) save: ``DCPState(strategy)``.

DCP loads *in place* into a template built from the live object's ``state_dict()``, so every key of
the saved state must exist in the template. The strategy's own ``state_dict()`` has a variable part
(the pending results: a list whose length depends on the step) and therefore loads with DCP only
when both sides hold the same number of pending results. ``DCPState`` gives DCP a fixed layout::

    {"g": tensor, "u": tensor, "rest": bytes}   # rest: everything else, torch.save'd

    dcp.save({"model": model.state_dict(), "strategy": DCPState(strategy)}, checkpoint_id=path)
    dcp.load({"model": model.state_dict(), "strategy": DCPState(strategy)}, checkpoint_id=path)

g and u are replicated on every rank (same fully-qualified names everywhere, so DCP stores them
once and any number of ranks can read them back). ``load_state_dict`` goes through the strategy's
``load_state_dict``: the same checks (method, model, fragments, dtypes and shapes) apply.

Another number of ranks. A checkpoint written by R ranks (or under ``manager=`` with
``num_replicas=R``) resumes with R' ≠ R, up or down: the outer state (g, u, the schedule, the
pending results) is replicated, so it is the same for any R'. A pending result records what it holds
(a sum over R ranks, or a quantized wire's average) and is applied as the R ranks would have applied
it, bit for bit. What depends on R is adapted on load: the summed extras of its control vector
(CoCoDC's timings and scores, the bounds of the outer step) are rescaled to R';
its per-rank facts (non-finite counts, broken views, schedule points) become R' slots carrying the
same decision: a result that the R ranks would have skipped is skipped by the R' ranks too. LOSCAR
resumes with another number of ranks only with the same ``local_steps`` / ``overlap_steps`` on every
rank and at a round end (no round in flight); per-rank lists raise ``CheckpointError`` naming them.
Per-rank tensors (the model's parameters between syncs, a pending snapshot) are stored once by DCP
like any tensor with the same name on every rank, so every resumed rank starts from one rank's copy.

Error feedback. Each rank's residual (its own quantization error, owed to later syncs) is per-rank
state that no other rank's copy may replace: it is saved as ``error_feedback_residual_by_rank``, a
DTensor with one row per rank, so DCP stores every rank's row and each resumed rank reads back its
own. On another number of ranks no row belongs to a given rank: ``dcp.load`` refuses, on every rank
and before anything is loaded, with DCP's size mismatch naming that entry (and a checkpoint saved
without error feedback, loaded into a strategy with it, with DCP's missing key naming it). To resume
anyway, load through ``DCPState(strategy, restart_error_feedback=True)``: the residuals restart from
zero, with a warning, as at the start of a run (what is lost: at most one quantization error per
rank, never applied).
"""

from __future__ import annotations

import io
from typing import Any

import torch

from .checkpoint import CheckpointError
from .eager import refuse_replicated_save

__all__ = ["DCPState"]


#: the DCP entry of the error-feedback residuals: one row per rank (see the module doc)
RESIDUALS = "error_feedback_residual_by_rank"


class DCPState:
    """A ``torch.distributed.checkpoint.stateful.Stateful`` view of a strategy (see the module doc).
    ``restart_error_feedback=True`` (for a load) leaves the saved error-feedback residuals out: every
    rank's residual restarts from zero, with a warning; the way to resume such a run on another
    number of ranks."""

    def __init__(self, strategy: Any, *, restart_error_feedback: bool = False) -> None:
        from .base import Strategy

        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a lowcomm Strategy, got {type(strategy).__name__}")
        if not isinstance(restart_error_feedback, bool):
            raise TypeError(
                f"restart_error_feedback must be a bool, got {type(restart_error_feedback).__name__}"
            )
        self.strategy = strategy
        self.restart_error_feedback = restart_error_feedback
        refuse_replicated_save(strategy, "DCPState")  # eager replicas hold state of their own

    def state_dict(self) -> dict[str, Any]:
        sd = dict(self.strategy.state_dict())
        out: dict[str, Any] = {}
        for key in ("g", "u"):
            if isinstance(sd.get(key), torch.Tensor):
                out[key] = sd.pop(key)
        residual = sd.get("residual")  # per rank: never in the bytes, which DCP keeps once
        if isinstance(residual, torch.Tensor):
            sd["residual"] = RESIDUALS  # a load without error feedback learns that it drops them
            if not self.restart_error_feedback:
                out[RESIDUALS] = _by_rank(residual, self.strategy)
        buf = io.BytesIO()
        torch.save(sd, buf)
        out["rest"] = buf.getvalue()
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        rest = sd.get("rest")
        if not isinstance(rest, (bytes, bytearray)):
            raise CheckpointError("DCP checkpoint entry rest should be bytes (was it written by DCPState?)")
        full = torch.load(io.BytesIO(rest), weights_only=True)
        if not isinstance(full, dict):
            raise CheckpointError("DCP checkpoint entry rest should hold a dict")
        for key in ("g", "u"):
            if key in sd:
                full[key] = sd[key]
        # (without error feedback here, saved residuals are dropped: the strategy's load warns)
        if getattr(self.strategy, "residual", None) is not None:
            if RESIDUALS in sd:  # this rank's own row
                full["residual"] = sd[RESIDUALS].to_local()[0]
            else:
                full["residual"] = torch.zeros_like(self.strategy.residual, device="cpu")
                self.strategy.log.warning(
                    "DCP load with restart_error_feedback=True: the error-feedback residual restarts at zero"
                )
        skipped = _resize(full, self.strategy)
        self.strategy.load_state_dict(full)
        if skipped:
            from .transport import FailedRound

            pending = getattr(self.strategy, "pending", [])
            for i in skipped:  # a result the saved ranks would have skipped: skipped by these ranks too
                pd = pending[i]
                pd.control_host = FailedRound(pd.control_host)


def _by_rank(residual: torch.Tensor, strategy: Any) -> Any:
    """This rank's residual as its row of a DTensor of one row per rank of the strategy's group: DCP
    stores every rank's row, and a load reads back each rank's own."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(strategy.group, "cpu")
    n = residual.numel()
    return DTensor.from_local(
        residual.reshape(1, n), mesh, [Shard(0)], run_check=False, shape=(strategy.world, n), stride=(n, 1)
    )


def _resize(full: dict[str, Any], strategy: Any) -> list[int]:
    """Adapt a state saved by another number of ranks to ``strategy.world`` in place (see the module
    docstring); returns the indices of the pending results to skip. Nothing when the sizes match."""
    shape = full.get("shape")
    if not isinstance(shape, dict) or not isinstance(shape.get("world_size"), int):
        return []  # the strategy's own checks name what is wrong
    old, new = int(shape["world_size"]), strategy.world
    if old == new or old < 1:
        return []
    if "local_steps" in full:  # LOSCAR
        steps, overlap = full.get("local_steps"), full.get("overlap_steps")
        if not isinstance(steps, list) or not isinstance(overlap, list) or not steps or not overlap:
            raise CheckpointError("checkpoint entries local_steps / overlap_steps should be lists")
        if len(set(steps)) > 1 or len(set(overlap)) > 1:
            raise CheckpointError(
                f"local_steps / overlap_steps: the checkpoint has per-rank lists {steps} / {overlap} for "
                f"{old} ranks; a LOSCAR run with per-rank steps resumes only with the same {old} ranks "
                "(one value per rank has no meaning for another number of ranks)"
            )
        if full.get("inflight") is not None:
            raise CheckpointError(
                f"the LOSCAR checkpoint was saved with round {full['inflight'].get('round')} in flight "
                f"by {old} ranks; to resume with {new} ranks save at a round end "
                "(when strategy.at_round_end is True)"
            )
        full["local_steps"], full["overlap_steps"] = [steps[0]] * new, [overlap[0]] * new
    pending = full.get("pending")
    skip: list[int] = []
    facts = strategy.FACTS
    for i, q in enumerate(pending if isinstance(pending, list) else []):
        control = q.get("control") if isinstance(q, dict) else None
        if not isinstance(control, torch.Tensor) or control.numel() < facts * old:
            raise CheckpointError(f"checkpoint entry pending[{i}].control should hold {facts * old} facts")
        points = control[2 * old : 3 * old]
        if not bool((points == points[0]).all()):
            raise CheckpointError(
                f"checkpoint entry pending[{i}]: its {old} ranks sent it at different points of their "
                "schedules; it cannot be resumed (with any number of ranks)"
            )
        out = torch.zeros(facts * new + control.numel() - facts * old, dtype=control.dtype)
        out[2 * new : 3 * new] = points[0]
        out[facts * new :] = control[facts * old :] * (new / old)
        if bool((control[: 2 * old] > 0).any()):  # non-finite values or broken views: a skipped sync
            skip.append(i)
        q["control"] = out
        # the result itself is left as it is: it records how many ranks it sums (summed_over), so
        # the merge takes the same average that the saved ranks would have (compression.result_form)
    shape["world_size"] = new
    return skip
