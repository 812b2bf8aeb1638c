"""Spawn the worker processes, show a progress bar per run, and collect the results.

All runs of one command share a single spawn (one gloo world of ``workers`` processes running the
specs in turn): starting four Python processes that import torch costs several seconds on two
cores, which would otherwise be paid once per method.
"""

from __future__ import annotations

import queue as queue_mod
import shutil
import socket
import sys
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from .corpus import Corpus
from .report import RunResult
from .spec import TrainSpec
from .worker import worker_entry


class LaunchError(RuntimeError):
    """A worker process failed; the message holds its one-line error, ``details`` its traceback."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                from tqdm import tqdm

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


def launch(
    specs: list[TrainSpec], corpus: Corpus, *, progress: bool = True, timeout_s: float = 3600.0
) -> list[RunResult]:
    """Run every spec on ``specs[0].workers`` spawned gloo ranks; return rank 0's results in order."""
    if not specs:
        raise ValueError("launch() needs at least one TrainSpec")
    world = specs[0].workers
    if any(s.workers != world for s in specs):
        raise ValueError("every spec of one launch must use the same number of workers")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # Share the byte streams once through shared memory instead of pickling them per process.
    train, val = corpus.train.share_memory_(), corpus.val.share_memory_()
    pc = mp.start_processes(
        worker_entry,
        args=(world, free_port(), specs, train, val, q),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    bars = _Progress(specs, progress)
    results: dict[int, RunResult] = {}
    deadline = time.monotonic() + timeout_s
    error: tuple[str, str] | None = None
    try:
        while len(results) < len(specs) and error is None:
            try:
                msg = q.get(timeout=0.5)
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in pc.processes):
                    error = ("a worker process died without reporting an error (killed? out of memory?)", "")
                elif time.monotonic() > deadline:
                    error = (f"runs did not finish within {timeout_s:.0f} s", "")
                continue
            kind = msg[0]
            if kind == "progress":
                bars.update(msg[1], msg[2], msg[3])
            elif kind == "result":
                results[msg[1]] = RunResult.from_dict(msg[2])
            elif kind == "error":
                error = (f"worker {msg[1]}: {msg[2]}", msg[3])
    finally:
        bars.close()
        if error is not None or len(results) < len(specs):
            for p in pc.processes:
                if p.is_alive():
                    p.terminate()
        for p in pc.processes:
            p.join(timeout=30)
    if error is not None:
        raise LaunchError(*error)
    return [results[i] for i in range(len(specs))]


def run_inline(spec: TrainSpec, corpus: Corpus) -> RunResult:
    """Single-process run (world of 1) in this process: used by tests and examples."""
    import torch.distributed as dist

    from .worker import train_one

    if spec.workers != 1:
        raise ValueError("run_inline needs workers=1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        res = train_one(spec, 0, 1, corpus.train, corpus.val, lambda s, v: None)
    finally:
        dist.destroy_process_group()
    assert res is not None
    return res
