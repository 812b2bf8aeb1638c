"""What each worker process runs: the plain training loop of the byte-level LM under one method.

The loop is an ordinary PyTorch loop (forward, backward, ``optimizer.step()``); the runtime's
strategy is entered as a context manager around it and hooks the optimizer step, exactly as a user
would use it. The data-parallel baseline instead all-reduces gradients after every backward and
pays the emulated WAN's latency + bytes / bandwidth on each of them (it cannot overlap: the next
step needs the averaged gradient).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from ..profiling import nvtx_range
from ..runtime.launch import send
from ..runtime.sinks import TensorBoardSink
from ..runtime.transport import WAN, Transport
from .corpus import EvalSet, eval_set, sample_batch, worker_shard
from .loop import TrainLoop, every
from .model import TinyLlama, num_parameters
from .report import EvalPoint, RunResult
from .spec import PARAM_DTYPES, TrainSpec
from .strategies import CommTotals, build_strategy


def lr_schedule(spec: TrainSpec) -> Callable[[int], float]:
    """The learning rate of the step after ``t`` steps: a linear warm-up to lr over warmup_steps,
    then a cosine to lr * min_lr_frac at the last step."""

    def lr_at(step: int) -> float:
        if step < spec.warmup_steps:
            f = (step + 1) / spec.warmup_steps
        else:
            span = max(1, spec.steps - spec.warmup_steps)
            progress = min(1.0, (step - spec.warmup_steps) / span)
            f = spec.min_lr_frac + (1 - spec.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))
        return spec.lr * f

    return lr_at


class GradAllReduce:
    """Data-parallel baseline: average gradients over ``group`` after every backward, blocking.

    Uses the runtime's own transport, so the all-reduce completes no earlier than the emulated WAN
    allows (latency + ring wire bytes / bandwidth) and bytes are counted exactly as the runtime
    counts its syncs (2(M-1)/M x payload per worker). Every second of the wait is exposed: the
    next step needs the averaged gradient. Metrics accumulate in ``self.metrics``.
    """

    def __init__(self, model: torch.nn.Module, group: Any, latency_s: float, bandwidth: float) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.transport = Transport(group, device=torch.device("cpu"), wan=WAN(latency_s, bandwidth))
        self.world = self.transport.world
        self.flat = torch.zeros(sum(p.numel() for p in self.params))
        self.metrics = CommTotals()

    def sync_grads(self) -> None:
        with nvtx_range("pack"):
            offset = 0
            for p in self.params:
                n = p.numel()
                if p.grad is None:
                    self.flat[offset : offset + n].zero_()
                else:
                    self.flat[offset : offset + n].copy_(p.grad.reshape(-1))
                offset += n
        handle = self.transport.all_reduce([self.flat], name=f"dp gradient {self.metrics.syncs}")
        self.metrics.exposed_s += handle.wait()
        self.metrics.bytes_sent += handle.wire_bytes
        self.metrics.syncs += 1
        with nvtx_range("merge"):
            self.flat.div_(self.world)
            offset = 0
            for p in self.params:
                n = p.numel()
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(self.flat[offset : offset + n].view_as(p))
                offset += n


#: validation tokens per forward pass. A small model's forward costs mostly per-op overhead, so a
#: batch of few tokens wastes time: on one core of the dev machine, 4,096 tokens was the fastest of
#: 1,024-16,384 for the default model (64 windows of 64 bytes) and within 4 % of the fastest for the
#: cocodc-paper study's 16-byte model (256 windows; 32 windows took 1.9x as long).
EVAL_BATCH_TOKENS = 4096


def eval_batch_windows(seq_len: int) -> int:
    """Validation windows per forward pass for windows of ``seq_len`` bytes (EVAL_BATCH_TOKENS)."""
    return max(1, EVAL_BATCH_TOKENS // seq_len)


#: losses of models every rank held, by (sha256 of the float32 parameters, model config, validation
#: windows, rank, world): the runs of one launch start from the same initial model (same seed),
#: which is then scored once, not once per method. The same computation on the same bytes gives the
#: same number.
_AGREED_LOSSES: dict[tuple, float] = {}


@dataclass
class EvalLosses:
    """One evaluation's losses (nats per byte): ``workers[i]`` of rank i's own parameters and
    ``avg_model`` of the worker-averaged parameters; ``agree``: every rank held bit-identical
    parameters, so the one model was evaluated once (all values equal)."""

    workers: list[float]
    avg_model: float
    agree: bool


@torch.no_grad()
def _windows_loss_sum(model: TinyLlama, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Sum over every target byte of the cross-entropy (nats), accumulated in float64."""
    total = 0.0
    for x, y in batches:
        logits = model(x)
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))
    return total


def _flat_float32(model: torch.nn.Module) -> torch.Tensor:
    # evaluated in float32 whatever the parameters' dtype (--param-dtype bf16 / fp16 widen exactly)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().to(torch.float32, copy=True)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, eval_model: TinyLlama, windows: EvalSet, group: Any, rank: int, world: int
) -> EvalLosses:
    """Validation losses of every worker's own model and of the worker-averaged model.

    Every rank scores its own parameters on all of ``windows`` (each worker's loss is on the same
    bytes). The averaged parameters come from one all-reduce on ``group`` (a separate process group,
    so it never interleaves with the strategy's collectives, and is not counted as traffic) and the
    ranks split its windows between them. When every rank holds bit-identical parameters (step 0,
    data-parallel, DiLoCo right after a sync) that one model is scored once, split between the
    ranks, and is every worker's model and the average; a model already scored in this process
    (the initial model of an earlier run of the same launch) is not scored again.
    """
    own = _flat_float32(model)
    ref = own.clone()
    dist.broadcast(ref, src=dist.get_global_rank(group, 0), group=group)
    same = torch.tensor([int(torch.equal(own, ref))], dtype=torch.int32)
    dist.all_reduce(same, op=dist.ReduceOp.MIN, group=group)
    agree = bool(same.item())
    key = None
    if agree:  # the same key on every rank, so every rank hits or misses together
        digest = hashlib.sha256(own.numpy().tobytes()).hexdigest()
        # the model's shape too: n_heads or rope_base change the function, not the parameters' bytes
        text = windows.text
        where = (text.data_ptr(), text.numel(), windows.seq_len, windows.n_windows)
        key = (digest, eval_model.cfg, *where, rank, world)
        if key in _AGREED_LOSSES:
            return EvalLosses([_AGREED_LOSSES[key]] * world, _AGREED_LOSSES[key], True)
    total = torch.zeros(1 + world, dtype=torch.float64)  # [averaged model's share, each rank's own]
    if agree:
        torch.nn.utils.vector_to_parameters(own, eval_model.parameters())
    else:
        dist.all_reduce(ref.copy_(own), group=group)
        torch.nn.utils.vector_to_parameters(ref.div_(world), eval_model.parameters())
    total[0] = _windows_loss_sum(
        eval_model, windows.batches(windows.rank_range(rank, world), eval_batch_windows(windows.seq_len))
    )
    if not agree:
        torch.nn.utils.vector_to_parameters(own, eval_model.parameters())
        total[1 + rank] = _windows_loss_sum(
            eval_model, windows.batches(range(windows.n_windows), eval_batch_windows(windows.seq_len))
        )
    dist.all_reduce(total, group=group)
    n = windows.scored_bytes
    avg = float(total[0]) / n
    workers = [avg] * world if agree else [float(v) / n for v in total[1:]]
    if key is not None:
        if len(_AGREED_LOSSES) >= 64:
            _AGREED_LOSSES.pop(next(iter(_AGREED_LOSSES)))
        _AGREED_LOSSES[key] = avg
    return EvalLosses(workers, avg, agree)


def slim_trace(path: str, min_us: float = 1000.0) -> None:
    """Rewrite a Chrome trace keeping metadata, every ``lowcomm/*`` range and ops of >= min_us.

    A full CPU trace of 40 steps of the tiny model is ~50 MB of sub-millisecond aten ops; the
    timeline needs only the phases, so the kept trace is a few hundred kB.
    """
    with open(path) as f:
        doc = json.load(f)
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    keep = [
        e
        for e in events
        if e.get("ph") == "M"
        or str(e.get("name", "")).startswith("lowcomm/")
        or float(e.get("dur", 0)) >= min_us
    ]
    if isinstance(doc, dict):
        doc["traceEvents"] = keep
    else:
        doc = keep
    with open(path, "w") as f:
        json.dump(doc, f)


def _tensorboard_sink(spec: TrainSpec) -> Any:
    if spec.tensorboard_dir is None:
        return None
    return TensorBoardSink(spec.tensorboard_dir)


def _profiler(spec: TrainSpec):
    if spec.profile_dir is None:
        return contextlib.nullcontext(None)
    return profile(activities=[ProfilerActivity.CPU], record_shapes=False)


class RankRun:
    """One run of ``spec`` on this rank, in three parts: set up (``__init__``), the training loop
    (:meth:`train`), and :meth:`finish` (totals, profile files, the process groups torn down).

    ``report(step, val_loss | None)`` is called on rank 0 for the progress bar.
    """

    def __init__(
        self,
        spec: TrainSpec,
        rank: int,
        world: int,
        train_data: torch.Tensor,
        val_data: torch.Tensor,
        report: Any,
    ) -> None:
        self.spec, self.rank, self.world, self.report = spec, rank, world, report
        self.t_setup = time.perf_counter()
        self.cpu0 = time.process_time()
        torch.manual_seed(spec.seed)  # identical initial model on every rank
        self.model = TinyLlama(spec.model).to(PARAM_DTYPES[spec.param_dtype])
        self.eval_model = TinyLlama(spec.model)
        # foreach: one kernel per op over all tensors. PyTorch picks the per-tensor loop on CPU; for the
        # small models here that loop cost 4.2 ms of a 16.5 ms step against 2.6 ms, with bitwise the
        # same parameters in fp32 and bf16 (fp16 differs in the last bits: a different rounding order).
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=spec.lr,
            betas=(0.9, 0.95),
            weight_decay=spec.weight_decay,
            foreach=True,
        )
        self.train_group = dist.new_group(backend="gloo")
        self.eval_group = dist.new_group(backend="gloo")
        self.shard = worker_shard(train_data, rank, world, spec.split)
        self.windows = eval_set(val_data, spec.model.seq_len, spec.eval_bytes)
        self.final_windows = (
            eval_set(val_data, spec.model.seq_len, spec.final_eval_bytes) if spec.final_eval_bytes else None
        )
        self.gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + rank)
        self.dp = (
            GradAllReduce(self.model, self.train_group, spec.latency_s, spec.bandwidth_bytes_per_s)
            if spec.method == "dp"
            else None
        )
        # --tensorboard: rank 0 writes its loss per step, the validation loss and its sync records
        self.tb = _tensorboard_sink(spec) if rank == 0 else None
        self.strategy = (
            None
            if self.dp is not None
            else build_strategy(spec, self.model, self.optimizer, self.train_group, self.tb)
        )
        self.progress_every = max(1, spec.steps // 100)
        # The learning rate is set on the optimizer's param_groups before each step: the runtime may
        # re-home parameters into flat buffers, but the optimizer object stays the user's.
        self.loop = TrainLoop(
            self.model,
            self.optimizer,
            self.batch_loss,
            spec.steps,
            self.evaluate,
            every(spec.eval_every, spec.steps),
            grad_sync=self.dp,
            grad_clip=spec.grad_clip,
            lr_at=lr_schedule(spec),
            speed=spec.step_stretch(rank),
            link_wait_s=self.exposed_s,
            steps_on=lambda tick: spec.steps_on(rank, tick),  # speed_model 'steps': a slower worker idles
            after_step=self.after_step,
            after_tick=self.after_tick,
        )
        self.result = RunResult(
            spec.label,
            spec.method,
            spec.to_dict(),
            num_params=num_parameters(self.model),
            eval_bytes_scored=self.windows.scored_bytes,
        )
        self.final_eval_s = 0.0
        self.prof: Any = None
        dist.barrier(group=self.eval_group)

    def totals(self) -> CommTotals:
        return self.dp.metrics if self.dp is not None else CommTotals.read(self.strategy)

    def evaluate(self, step: int) -> None:
        elapsed = self.loop.elapsed()
        losses = evaluate(self.model, self.eval_model, self.windows, self.eval_group, self.rank, self.world)
        loss = statistics.fmean(losses.workers)  # the headline: the mean of the workers' own models
        m = self.totals()
        self.result.points.append(
            EvalPoint(
                step,
                elapsed,
                m.bytes_sent,
                m.exposed_s,
                loss,
                val_loss_workers=losses.workers,
                val_loss_avg_model=losses.avg_model,
                workers_agree=losses.agree,
            )
        )
        if self.tb is not None:
            self.tb.add_scalar("val/loss", loss, step)
            self.tb.add_scalar("val/loss_avg_model", losses.avg_model, step)
            self.tb.add_scalar("val/loss_worker_min", min(losses.workers), step)
            self.tb.add_scalar("val/loss_worker_max", max(losses.workers), step)
        if self.rank == 0:
            self.report(step, loss)

    def exposed_s(self) -> float:
        """Seconds this rank has waited on the link so far (a slow worker's stretch leaves them out:
        a slower processor does not make the link slower)."""
        if self.dp is not None:
            return self.dp.metrics.exposed_s
        return float(self.strategy.metrics.exposed_comm_s) if self.strategy is not None else 0.0

    def batch_loss(self) -> torch.Tensor:
        x, y = sample_batch(self.shard, self.spec.batch_size, self.spec.model.seq_len, self.gen)
        return self.model.loss(x, y)

    def after_step(self, step: int, loss: torch.Tensor) -> None:
        if self.tb is not None:
            self.tb.add_scalar("train/loss", loss.item(), step)
            self.tb.add_scalar("train/lr", self.optimizer.param_groups[0]["lr"], step)

    def after_tick(self, step: int, evaluated: bool) -> None:
        if self.rank == 0 and not evaluated and step % self.progress_every == 0:
            self.report(step, None)

    def train(self) -> None:
        """The training loop (train/loop.py), inside the strategy's context (and the profiler's)."""
        spec = self.spec
        ctx = self.strategy if self.strategy is not None else contextlib.nullcontext()
        with _profiler(spec) as self.prof, ctx:
            self.loop.run()
            if self.final_windows is not None:
                self.final_evaluate()

    def final_evaluate(self) -> None:
        """The evaluation on final_eval_bytes after the last step (after t_end: not training time)."""
        t0 = time.perf_counter()
        windows = self.final_windows
        losses = evaluate(self.model, self.eval_model, windows, self.eval_group, self.rank, self.world)
        self.result.final_eval = dict(
            eval_bytes_scored=windows.scored_bytes,
            val_loss=statistics.fmean(losses.workers),
            val_loss_workers=losses.workers,
            val_loss_avg_model=losses.avg_model,
        )
        self.final_eval_s = time.perf_counter() - t0

    def finish(self) -> RunResult | None:
        """Totals into the result, the profiler's files written, this run's groups destroyed; rank 0
        returns the RunResult, other ranks None."""
        spec, result = self.spec, self.result
        m = self.totals()
        result.train_wall_s = self.loop.train_wall_s
        result.bytes_sent, result.exposed_s, result.syncs = m.bytes_sent, m.exposed_s, m.syncs
        # CPU seconds of all ranks together (setup, training, evaluation): with C cores free, the run
        # needs at least cpu_s / C seconds of wall-clock, whatever the machine's load was.
        cpu = torch.tensor([time.process_time() - self.cpu0], dtype=torch.float64)
        dist.all_reduce(cpu, group=self.eval_group)
        result.extra = dict(
            m.extra,
            eval_s=self.loop.eval_s,
            final_eval_s=self.final_eval_s,
            setup_s=self.loop.t_start - self.t_setup,
            cpu_s_all_ranks=float(cpu),
        )
        if self.prof is not None and spec.profile_dir is not None:
            os.makedirs(spec.profile_dir, exist_ok=True)
            trace = os.path.join(spec.profile_dir, f"trace_rank{self.rank}.json")
            self.prof.export_chrome_trace(trace)
            slim_trace(trace)
            records = (
                [] if self.strategy is None else [dataclasses.asdict(r) for r in self.strategy.metrics.syncs]
            )
            with open(os.path.join(spec.profile_dir, f"syncs_rank{self.rank}.json"), "w") as f:
                json.dump(records, f)
        self.close_tensorboard()
        dist.destroy_process_group(self.train_group)
        dist.destroy_process_group(self.eval_group)
        return result if self.rank == 0 else None

    def close_tensorboard(self) -> None:
        if self.tb is not None:
            self.tb.close()


def train_one(
    spec: TrainSpec, rank: int, world: int, train_data: torch.Tensor, val_data: torch.Tensor, report: Any
) -> RunResult | None:
    """Train ``spec`` on this rank; rank 0 returns the RunResult, other ranks None.

    report(step, val_loss | None) is called on rank 0 for the progress bar.
    """
    run = RankRun(spec, rank, world, train_data, val_data, report)
    try:
        run.train()
    finally:  # what was logged before a failure stays readable
        run.close_tensorboard()
    return run.finish()


def run_rank(
    rank: int, world: int, specs: list[TrainSpec], train_data: torch.Tensor, val_data: torch.Tensor
) -> list[dict] | None:
    """A worker process's body under :func:`lowcomm_kernels.runtime.launch.launch` (which joined the
    gloo group): every spec in turn; rank 0 returns their results as dicts, progress goes by send()."""
    results = []
    for i, spec in enumerate(specs):
        res = train_one(spec, rank, world, train_data, val_data, lambda s, v, i=i: send((i, s, v)))
        if res is not None:
            results.append(res.to_dict())
    return results if rank == 0 else None
