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
import json
import math
import os
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from ..profiling import nvtx_range
from .corpus import eval_batches, sample_batch, worker_shard
from .model import TinyLlama, num_parameters
from .report import EvalPoint, RunResult
from .spec import TrainSpec
from .strategies import StrategyMetrics, build_strategy


def lr_lambda(spec: TrainSpec):
    """Linear warm-up to lr over warmup_steps, then cosine to lr * min_lr_frac at the last step."""

    def f(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        span = max(1, spec.steps - spec.warmup_steps)
        progress = min(1.0, (step - spec.warmup_steps) / span)
        return spec.min_lr_frac + (1 - spec.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class GradAllReduce:
    """Data-parallel baseline: average gradients over ``group`` after every backward, blocking.

    Uses the runtime's own transport, so the all-reduce completes no earlier than the emulated WAN
    allows (latency + ring wire bytes / bandwidth) and bytes are counted exactly as the runtime
    counts its syncs (2(M-1)/M x payload per worker). Every second of the wait is exposed: the
    next step needs the averaged gradient. Metrics accumulate in ``self.metrics``.
    """

    def __init__(self, model: torch.nn.Module, group: Any, latency_s: float, bandwidth: float) -> None:
        from ..runtime.transport import WAN, Transport

        self.params = [p for p in model.parameters() if p.requires_grad]
        self.transport = Transport(group, device=torch.device("cpu"), wan=WAN(latency_s, bandwidth))
        self.world = self.transport.world
        self.flat = torch.zeros(sum(p.numel() for p in self.params))
        self.metrics = StrategyMetrics()

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


def _average_params(model: torch.nn.Module, group: Any, world: int) -> torch.Tensor:
    vec = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    dist.all_reduce(vec, group=group)
    return vec.div_(world)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, eval_model: TinyLlama, batches: list, group: Any, rank: int, world: int
) -> float:
    """Validation loss of the worker-averaged parameters; ranks split the batches between them.

    Runs on a separate process group so it never interleaves with the strategy's collectives.
    """
    torch.nn.utils.vector_to_parameters(_average_params(model, group, world), eval_model.parameters())
    total = torch.zeros(2, dtype=torch.float64)
    for i in range(rank, len(batches), world):
        x, y = batches[i]
        total[0] += eval_model.loss(x, y).double() * x.numel()
        total[1] += x.numel()
    dist.all_reduce(total, group=group)
    return float(total[0] / total[1])


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


def _profiler(spec: TrainSpec):
    if spec.profile_dir is None:
        return contextlib.nullcontext(None)
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], record_shapes=False)


def train_one(
    spec: TrainSpec, rank: int, world: int, train_data: torch.Tensor, val_data: torch.Tensor, report: Any
) -> RunResult | None:
    """Train ``spec`` on this rank; rank 0 returns the RunResult, other ranks None.

    report(step, val_loss | None) is called on rank 0 for the progress bar.
    """
    t_setup = time.perf_counter()
    cpu0 = time.process_time()
    torch.manual_seed(spec.seed)  # identical initial model on every rank
    model = TinyLlama(spec.model)
    eval_model = TinyLlama(spec.model)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=spec.weight_decay
    )
    train_group = dist.new_group(backend="gloo")
    eval_group = dist.new_group(backend="gloo")
    shard = worker_shard(train_data, rank, world)
    batches = eval_batches(val_data, spec.eval_batches, spec.batch_size, spec.model.seq_len)
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + rank)

    dp = (
        GradAllReduce(model, train_group, spec.latency_s, spec.bandwidth_bytes_per_s)
        if spec.method == "dp"
        else None
    )
    strategy = None if dp is not None else build_strategy(spec, model, optimizer, train_group, rank)
    # The scheduler is created after the strategy: the runtime may re-home parameters into flat
    # buffers, but the optimizer object (and its param_groups' lr) stays the user's.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec))
    speed = spec.worker_speeds[rank] if spec.worker_speeds else 1.0

    result = RunResult(spec.label, spec.method, spec.to_dict(), num_params=num_parameters(model))
    eval_s = 0.0
    progress_every = max(1, spec.steps // 100)

    def metrics_now() -> StrategyMetrics:
        return dp.metrics if dp is not None else StrategyMetrics.read(strategy)

    def do_eval(step: int, t_start: float) -> None:
        nonlocal eval_s
        t0 = time.perf_counter()
        loss = evaluate(model, eval_model, batches, eval_group, rank, world)
        m = metrics_now()
        result.points.append(EvalPoint(step, t0 - t_start - eval_s, m.bytes_sent, m.exposed_s, loss))
        eval_s += time.perf_counter() - t0
        if rank == 0:
            report(step, loss)

    dist.barrier(group=eval_group)
    ctx = strategy if strategy is not None else contextlib.nullcontext()

    def compute_range() -> contextlib.AbstractContextManager:
        # The runtime marks lowcomm/compute itself (between two optimizer hooks); the harness marks
        # it only for the data-parallel baseline, which runs without a strategy.
        return nvtx_range("compute") if dp is not None else contextlib.nullcontext()

    with _profiler(spec) as prof, ctx:
        t_start = time.perf_counter()
        do_eval(0, t_start)
        for step in range(1, spec.steps + 1):
            t_step = time.perf_counter()
            with compute_range():
                x, y = sample_batch(shard, spec.batch_size, spec.model.seq_len, gen)
                loss = model.loss(x, y)
                loss.backward()
            if dp is not None:
                dp.sync_grads()
            with compute_range():
                if spec.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
                optimizer.step()  # the strategy's hook runs here (sends, merges)
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            if speed != 1.0:  # emulate a slower worker: stretch its step time
                time.sleep(max(0.0, (speed - 1.0) * (time.perf_counter() - t_step)))
            if step % spec.eval_every == 0 or step == spec.steps:
                do_eval(step, t_start)
            elif rank == 0 and step % progress_every == 0:
                report(step, None)
        t_end = time.perf_counter()
    m = metrics_now()
    result.train_wall_s = t_end - t_start - eval_s
    result.bytes_sent, result.exposed_s, result.syncs = m.bytes_sent, m.exposed_s, m.syncs
    # CPU seconds of all ranks together (setup, training, evaluation): with C cores free, the run
    # needs at least cpu_s / C seconds of wall-clock, whatever the machine's load was.
    cpu = torch.tensor([time.process_time() - cpu0], dtype=torch.float64)
    dist.all_reduce(cpu, group=eval_group)
    result.extra = dict(m.extra, eval_s=eval_s, setup_s=t_start - t_setup, cpu_s_all_ranks=float(cpu))
    if prof is not None and spec.profile_dir is not None:
        os.makedirs(spec.profile_dir, exist_ok=True)
        trace = os.path.join(spec.profile_dir, f"trace_rank{rank}.json")
        prof.export_chrome_trace(trace)
        slim_trace(trace)
        records = [] if strategy is None else [dataclasses.asdict(r) for r in strategy.metrics.syncs]
        with open(os.path.join(spec.profile_dir, f"syncs_rank{rank}.json"), "w") as f:
            json.dump(records, f)
    dist.destroy_process_group(train_group)
    dist.destroy_process_group(eval_group)
    return result if rank == 0 else None


def worker_entry(
    rank: int,
    world: int,
    port: int,
    specs: list[TrainSpec],
    train_data: torch.Tensor,
    val_data: torch.Tensor,
    queue: Any,
) -> None:
    """Process entry for torch.multiprocessing: run every spec in turn on one gloo process group."""
    torch.set_num_threads(1)  # 4 workers share 2 cores: oversubscribed threads only thrash
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        for i, spec in enumerate(specs):
            res = train_one(
                spec, rank, world, train_data, val_data, lambda s, v, i=i: queue.put(("progress", i, s, v))
            )
            if res is not None:
                queue.put(("result", i, res.to_dict()))
        dist.destroy_process_group()
    except BaseException as exc:  # report, then let the launcher tear the group down
        queue.put(("error", rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        raise
