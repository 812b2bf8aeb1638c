"""Run TrainSpecs on worker processes, with a progress bar per run, and collect the results.

The processes come from the package's one launcher, :func:`lowcomm_kernels.runtime.launch.launch`.
All runs of one command share a single launch (one gloo world of ``workers`` processes running the
specs in turn): starting four Python processes that import torch costs several seconds on two
cores, which would otherwise be paid once per method.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from ..runtime.launch import WorkerError, launch
from .corpus import Corpus
from .report import RunResult
from .spec import TrainSpec
from .worker import run_rank


class _Progress:
    """One tqdm bar per run on stderr (or plain lines when stderr is not a terminal)."""

    def __init__(self, specs: list[TrainSpec], enabled: bool) -> None:
        self.specs = specs
        self.enabled = enabled
        self.bar: Any = None
        self.current = -1
        self.last_loss: float | None = None
        self.tty = sys.stderr.isatty()

    def update(self, run: int, step: int, loss: float | None) -> None:
        if not self.enabled:
            return
        if run != self.current:
            self.close()
            self.current = run
            spec = self.specs[run]
            desc = f"[{run + 1}/{len(self.specs)}] {spec.label}"
            if self.tty:
                from tqdm import tqdm  # optional (the cli extra): only on a terminal

                # A terminal that reports 0 columns/rows (some ptys) would make tqdm hide the bar.
                size = shutil.get_terminal_size((100, 20))
                self.bar = tqdm(
                    total=spec.steps,
                    desc=desc,
                    unit="step",
                    leave=True,
                    ncols=min(size.columns or 100, 120),
                    nrows=max(size.lines, 5),
                )
            else:
                print(f"{desc}: {spec.steps} steps", file=sys.stderr, flush=True)
        if loss is not None:
            self.last_loss = loss
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            if self.last_loss is not None:
                self.bar.set_postfix(val_loss=f"{self.last_loss:.3f}", refresh=False)
        elif loss is not None and step > 0:
            print(
                f"  step {step:>6}/{self.specs[run].steps}  val_loss {loss:.4f}", file=sys.stderr, flush=True
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run_specs(
    specs: list[TrainSpec], corpus: Corpus, *, progress: bool = True, timeout_s: float = 3600.0
) -> list[RunResult]:
    """Run every spec in turn on ``specs[0].workers`` ranks; return rank 0's results in order.
    Raises :class:`~lowcomm_kernels.runtime.launch.WorkerError` when a rank fails (see report_failure)."""
    if not specs:
        raise ValueError("run_specs() needs at least one TrainSpec")
    world = specs[0].workers
    if any(s.workers != world for s in specs):
        raise ValueError("every spec of one launch must use the same number of workers")
    # Share the byte streams once through shared memory instead of pickling them per process.
    train, val = corpus.train.share_memory_(), corpus.val.share_memory_()
    bars = _Progress(specs, progress)
    try:
        per_rank = launch(
            run_rank, world, (specs, train, val), timeout_s=timeout_s, on_message=lambda _, m: bars.update(*m)
        )
    finally:
        bars.close()
    return [RunResult.from_dict(d) for d in per_rank[0]]


def report_failure(exc: WorkerError, out: Path, what: str = "run") -> int:
    """Print the first failed rank as one line (every failure's traceback into ``out/error.txt``);
    return the exit code of a failed run, 1."""
    first = exc.failures[0]
    where = ""
    if any(f.traceback for f in exc.failures):
        (out / "error.txt").write_text(str(exc) + "\n")
        where = f" (traceback in {out / 'error.txt'})"
    print(f"error: {what} failed: worker {first.rank}: {first.summary}{where}", file=sys.stderr)
    return 1
