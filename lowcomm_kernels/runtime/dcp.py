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
``load_state_dict``: the same checks (method, model, fragments, dtypes and shapes) apply, and a
checkpoint loads into the same ``world_size`` (under ``manager=`` that is ``num_replicas``, the
slot count, so a job resumes with any number of live replicas).
"""

from __future__ import annotations

import io
from typing import Any

import torch

from .checkpoint import CheckpointError

__all__ = ["DCPState"]


class DCPState:
    """A ``torch.distributed.checkpoint.stateful.Stateful`` view of a strategy (see the module doc)."""

    def __init__(self, strategy: Any) -> None:
        from .base import Strategy

        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a lowcomm Strategy, got {type(strategy).__name__}")
        self.strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        sd = dict(self.strategy.state_dict())
        out: dict[str, Any] = {}
        for key in ("g", "u"):
            if isinstance(sd.get(key), torch.Tensor):
                out[key] = sd.pop(key)
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
        self.strategy.load_state_dict(full)
