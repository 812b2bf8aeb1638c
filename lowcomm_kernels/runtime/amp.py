"""Mixed precision with ``torch.amp.GradScaler``: every rank counts the same iterations.

A GradScaler skips ``optimizer.step()`` when it finds inf/NaN gradients, and it finds them on some
ranks and not on others (each rank has its own batch and its own scale). The strategy advances its
schedule in the inner optimizer's step post-hook, which does not run on a skipped step, so the
skipping rank's step count would fall behind: the ranks would send their syncs at different
iterations, and the last sync of the faster rank would find no partner (a ``SyncError`` after the
timeout on one rank only).

So a strategy that runs under a GradScaler counts *iterations*, stepped or skipped:

- ``with strategy:`` and ``grad_scaler=scaler``: while the context is active, the scaler's
  ``step`` is wrapped on the instance (the class is untouched); a ``scaler.step(inner_optimizer)``
  that returns without the optimizer's post-hook having run was skipped, and the wrapper advances
  the strategy for it. Fused optimizers (``_step_supports_amp_scaling``) are always stepped by the
  scaler and skip inside their kernel, so their hook runs every iteration and nothing is added.
- ``strategy.step()`` called by the loop once per iteration (after ``scaler.update()``), outside
  ``with strategy:``: counts every call, needs nothing else.

A loop that steps the inner optimizer through a GradScaler the strategy was not given (inside
``with strategy:``) is found at its first stepped iteration: the hook sees GradScaler's
``_maybe_opt_step`` on the call stack and raises ``GradScalerError`` before the strategy advances,
so no collective has been issued and every rank raises at its own first stepped iteration (no
rank waits on a peer). Whether a scaler was given is part of the cross-rank agreement.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType

import torch

__all__ = ["GradScalerError", "ScalerCounter", "scaler_on_stack"]

_SEARCH_FRAMES = 8  # hook <- Optimizer wrapper(s) <- GradScaler._maybe_opt_step: 2-4 frames up


class GradScalerError(RuntimeError):
    """The inner optimizer is stepped through a GradScaler the strategy does not count."""


def check_scaler(grad_scaler: object) -> torch.amp.GradScaler | None:
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(
            f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}"
        )
    return grad_scaler


def scaler_on_stack() -> torch.amp.GradScaler | None:
    """The GradScaler whose ``step`` is calling the inner optimizer right now, or None. Called from
    the optimizer's post-hook; compares code objects (cheap), reads locals only on a match."""
    target = torch.amp.GradScaler._maybe_opt_step.__code__
    f: FrameType | None = sys._getframe(1)
    for _ in range(_SEARCH_FRAMES):
        if f is None:
            return None
        if f.f_code is target:
            found = f.f_locals.get("self")
            return found if isinstance(found, torch.amp.GradScaler) else None
        f = f.f_back
    return None


def unannounced_scaler_message(found: torch.amp.GradScaler, given: torch.amp.GradScaler | None) -> str:
    which = (
        "a torch.amp.GradScaler that this strategy was not given"
        if given is None
        else ("a different torch.amp.GradScaler than the grad_scaler this strategy was given")
    )
    return (
        f"inner_optimizer is being stepped by {which}. A GradScaler skips optimizer.step() on a rank "
        "whose gradients hold inf/NaN, and the strategy would not count that iteration there: the "
        "ranks would sync at different iterations. Pass grad_scaler=scaler to the strategy (it then "
        "counts skipped steps too), or call strategy.step() once per iteration after "
        "scaler.update() instead of using `with strategy:`."
    )


class ScalerCounter:
    """Wraps ``scaler.step`` on the instance while installed: a call for ``optimizer`` during which
    the optimizer's post-hook did not run (``hook_ran`` unchanged) calls ``on_skipped()``."""

    def __init__(
        self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, on_skipped: Callable[[], None]
    ) -> None:
        self.scaler = scaler
        self.optimizer = optimizer
        self.on_skipped = on_skipped
        self.hook_ran = 0  # bumped by the strategy's optimizer hook
        self._wrapper: Callable[..., object] | None = None

    def install(self) -> None:
        if "step" in vars(self.scaler):
            raise ValueError(
                "grad_scaler: its step() is already wrapped (is another strategy active with the "
                "same scaler?); one active strategy per GradScaler"
            )
        original = self.scaler.step  # the bound class method

        def step(optimizer: torch.optim.Optimizer, *args: object, **kwargs: object) -> object:
            before = self.hook_ran
            out = original(optimizer, *args, **kwargs)
            if optimizer is self.optimizer and self.hook_ran == before:
                self.on_skipped()  # found inf/NaN: the step was skipped, the iteration still counts
            return out

        self._wrapper = step
        self.scaler.step = step  # type: ignore[method-assign,assignment]

    def uninstall(self) -> None:
        if self._wrapper is not None and vars(self.scaler).get("step") is self._wrapper:
            del self.scaler.step
        self._wrapper = None
