"""The one training loop: every task (the byte LM, the digits MLP, logistic regression) and the
fault-injection runs on torchft replicas train through :class:`TrainLoop`.

It is the plain PyTorch loop a user writes (draw a batch, forward, backward, ``optimizer.step()``);
the caller enters the runtime's strategy (and a profiler) around :meth:`TrainLoop.run`, and the
strategy's optimizer hook does the syncs, as in a user's program. What the tasks differ in is given
as data (schedule, clipping, speed) or as callbacks (the batch, the evaluation, what to report).

Ticks: one tick is one step of the fastest worker. A worker may sit a tick out (``steps_on``: a
slower LOSCAR worker makes fewer local steps per round), and a torchft replica that healed jumps
to its peers' step (``position``). Evaluations are collective, so they happen at the same ticks on
every rank, stepped or not.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..profiling import nvtx_range


def stretch_s(speed: float, elapsed_s: float, link_wait_s: float) -> float:
    """How long a worker ``speed`` x slower than measured sleeps after a step that took
    ``elapsed_s``, of which ``link_wait_s`` waiting on the link: (speed - 1) x its compute only, since
    a slower processor does not make the link slower."""
    return max(0.0, (speed - 1.0) * (elapsed_s - link_wait_s))


def every(n: int, last: int) -> Callable[[int], bool]:
    """Evaluation ticks: every ``n``-th tick and the ``last``."""
    return lambda tick: tick % n == 0 or tick == last


def _no_wait() -> float:
    return 0.0


@dataclass
class TrainLoop:
    """``steps`` ticks of ``model`` under ``optimizer`` on this rank.

    - ``batch_loss()`` draws this rank's next batch and returns its loss (a scalar tensor).
    - ``evaluate(tick)`` is collective; it runs at tick 0 (unless ``evaluate_first`` is False: a
      replica that returns after a failure) and at every tick where ``eval_at(tick)``. Its time is
      not training time (``eval_s``); ``elapsed()`` inside it gives the training seconds so far.
    - ``grad_sync``: the data-parallel baseline's gradient all-reduce (``sync_grads()``) between the
      backward and the optimizer step; None under a runtime strategy (its hook syncs).
    - ``lr_at(t)``: the learning rate of the step that follows ``t`` ticks (set on every parameter
      group before it); None keeps the optimizer's own.
    - ``speed`` > 1: sleep after each step so it takes ``speed`` x its compute (``link_wait_s()``:
      seconds waited on the link so far, left out of the stretch).
    - ``after_step(tick, loss)`` after each optimizer step; ``after_tick(tick, evaluated)`` at the
      end of every tick this worker stepped (progress, fault injection).
    - Everything ``evaluate`` does (the losses, and what it logs or sends about them) counts as
      evaluation time, not training time.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch_loss: Callable[[], torch.Tensor]
    steps: int
    evaluate: Callable[[int], None]
    eval_at: Callable[[int], bool]
    evaluate_first: bool = True
    grad_sync: Any = None
    grad_clip: float = 0.0
    lr_at: Callable[[int], float] | None = None
    speed: float = 1.0
    link_wait_s: Callable[[], float] = _no_wait
    steps_on: Callable[[int], bool] | None = None
    position: Callable[[int], int] | None = None
    after_step: Callable[[int, torch.Tensor], None] | None = None
    after_tick: Callable[[int, bool], None] | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    eval_s: float = 0.0

    def elapsed(self) -> float:
        """Training seconds so far (wall-clock since the start, evaluations left out)."""
        return time.perf_counter() - self.t_start - self.eval_s

    @property
    def train_wall_s(self) -> float:
        return self.t_end - self.t_start - self.eval_s

    def _evaluate(self, tick: int) -> None:
        t0 = time.perf_counter()
        self.evaluate(tick)
        self.eval_s += time.perf_counter() - t0

    def _compute(self) -> contextlib.AbstractContextManager:
        # A runtime strategy marks lowcomm/compute itself (between two optimizer hooks); the loop
        # marks it only for the data-parallel baseline, which runs without one.
        return nvtx_range("compute") if self.grad_sync is not None else contextlib.nullcontext()

    def step(self, done: int) -> torch.Tensor:
        """One optimizer step after ``done`` ticks; returns the batch's loss."""
        if self.lr_at is not None:
            lr = self.lr_at(done)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        with self._compute():
            loss = self.batch_loss()
            loss.backward()
        if self.grad_sync is not None:
            self.grad_sync.sync_grads()
        with self._compute():
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()  # the strategy's hook runs here (sends, merges, a heal)
            self.optimizer.zero_grad(set_to_none=True)
        return loss

    def run(self) -> None:
        self.t_start = time.perf_counter()
        if self.evaluate_first:
            self._evaluate(0)
        done = 0
        while done < self.steps:
            tick = done + 1
            if self.steps_on is not None and not self.steps_on(tick):
                done = tick  # this worker sits the tick out
                stepped = False
            else:
                stretch = self.speed != 1.0  # only then the step's times are read
                t0, wait0 = (time.perf_counter(), self.link_wait_s()) if stretch else (0.0, 0.0)
                loss = self.step(done)
                done = self.position(tick) if self.position is not None else tick
                stepped = True
                if self.after_step is not None:
                    self.after_step(done, loss)
                if stretch:  # emulate a slower worker
                    elapsed = time.perf_counter() - t0
                    time.sleep(stretch_s(self.speed, elapsed, self.link_wait_s() - wait0))
            evaluated = self.eval_at(done)
            if evaluated:
                self._evaluate(done)
            if stepped and self.after_tick is not None:
                self.after_tick(done, evaluated)
        self.t_end = time.perf_counter()
