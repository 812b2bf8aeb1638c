"""A non-convex task: a one-hidden-layer MLP on scikit-learn's bundled digits (``--task mlp``).

Data: ``sklearn.datasets.load_digits`` (1,797 8x8 images of the digits 0-9, shipped inside the
scikit-learn wheel: no download), pixels scaled to [0, 1]. A fixed permutation (seed 0) sends 20% of
the rows to a test set; the training rows are then sorted by label (stable), so that
- ``--split contiguous`` gives worker i the i-th contiguous slice: a few digits each (non-iid, the
  hard case for local methods);
- ``--split iid`` deals the rows round-robin: every worker sees every digit.

Model: 64 -> ``MLPConfig.hidden`` (tanh) -> 10 logits, cross-entropy; every worker starts from the
same initialisation (``--seed``). The inner optimizer is plain SGD at ``--lr`` (constant: the LM's
AdamW, warm-up, cosine schedule, clipping and model knobs do not apply here) for every method, so
methods differ only in what they communicate. Each worker samples its minibatches with its own
generator (seed, rank).

A run is a :class:`~lowcomm_kernels.train.spec.TrainSpec` (method, workers, steps, H, K, tau, p, N,
Q, worker speeds, split, seed); its strategy is the LM harness's (``strategies.build_strategy``) and
the data-parallel baseline is the harness's ``GradAllReduce``. Collectives run on real gloo ranks
with no emulated latency; the link enters only through the time model (:func:`modeled_time`).

Time model (deterministic, in seconds): a step of the fastest worker costs ``MLPConfig.step_time_s``
(an emulated compute time, the same on every machine); a worker with relative speed c costs c times
that; a sync of b payload bytes per worker takes ``latency_s + b / bandwidth_bytes_per_s`` (the
spec's link). Synchronous methods (dp, DiLoCo, Streaming DiLoCo, CoCoDC) run every step on every
worker, so each step takes the slowest worker's time, c_max * T. See :func:`modeled_time` for how
each method overlaps its syncs. The step axis is ticks: steps of the fastest worker (under LOSCAR
with ``--speed-model steps`` a slower worker runs fewer steps in the same ticks).

Evaluation (every ``--eval-every`` ticks, on the test set), as in the LM harness: each worker's own
model's cross-entropy (``val_loss_workers``; their mean is the headline ``val_loss``: LOSCAR never
forms the average) and the worker-averaged parameters' (``val_loss_avg_model``, one uncounted
all-reduce), plus both accuracies (``extra['own_acc']``: mean over workers, ``extra['avg_acc']``).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ...runtime.launch import WorkerError, send
from ..args import out_dir, parse_methods, spec_from_args
from ..loop import TrainLoop, every
from ..provenance import collect
from ..report import EvalPoint, RunResult, auto_target, comparison_rows, format_table, write_json
from ..runner import report_failure
from ..spec import TrainSpec
from ..strategies import CommTotals, build_strategy
from ..worker import GradAllReduce
from .common import LM_ONLY, averaged_and_own, launch_jobs, refuse_flags

TEST_FRACTION = 0.2


@dataclass(frozen=True)
class MLPConfig:
    hidden: int = 64
    #: emulated compute time of one step of the fastest worker, the time model's unit (a model
    #: parameter, not a measurement: every modeled time is a multiple of it plus link time)
    step_time_s: float = 0.01

    def __post_init__(self) -> None:
        if not (isinstance(self.hidden, int) and self.hidden >= 1):
            raise ValueError(f"hidden must be an int >= 1, got {self.hidden!r}")
        if not (isinstance(self.step_time_s, (int, float)) and self.step_time_s > 0):
            raise ValueError(f"step_time_s must be > 0, got {self.step_time_s!r}")


#: `compare --task mlp`: run length and schedule (R = N + Q = 16 ticks, H = K * R so LOSCAR at p = 1/K
#: sends as many bytes per H as Streaming DiLoCo), 4 workers, SGD at lr 0.1, batch 32.
PRESETS: dict[str, dict] = {
    "default": dict(
        workers=4,
        steps=640,
        batch_size=32,
        lr=0.1,
        sync_every=64,
        num_fragments=4,
        fragment_sync_delay=4,
        local_steps=12,
        overlap_steps=4,
        density=0.25,
        eval_every=32,
        latency_s=0.04,
        bandwidth_bytes_per_s=12.5e6,
    ),
    "quick": dict(
        workers=4,
        steps=128,
        batch_size=32,
        lr=0.1,
        sync_every=32,
        num_fragments=4,
        fragment_sync_delay=2,
        local_steps=6,
        overlap_steps=2,
        density=0.25,
        eval_every=32,
        latency_s=0.02,
        bandwidth_bytes_per_s=12.5e6,
    ),
}


def load_digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(X_train, y_train, X_test, y_test): float32 pixels in [0, 1], int64 labels; the training rows
    sorted by label (stable), the split fixed (seed 0)."""
    from sklearn.datasets import load_digits  # optional (the cli extra): only this task needs it

    data = load_digits()
    X = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(y))
    n_test = int(round(TEST_FRACTION * len(y)))
    test, train = perm[:n_test], perm[n_test:]
    train = train[np.argsort(y[train], kind="stable")]
    return (
        torch.from_numpy(X[train]),
        torch.from_numpy(y[train]),
        torch.from_numpy(X[test]),
        torch.from_numpy(y[test]),
    )


def shard_rows(n: int, rank: int, world: int, split: str) -> torch.Tensor:
    """Row indices of ``rank``'s share of ``n`` label-sorted rows: disjoint, deterministic."""
    if split == "contiguous":
        return torch.arange(rank * n // world, (rank + 1) * n // world)
    if split == "iid":
        return torch.arange(rank, n, world)
    raise ValueError(f"split must be 'contiguous' or 'iid', got {split!r}")


def make_model(cfg: MLPConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initial model on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(64, cfg.hidden), torch.nn.Tanh(), torch.nn.Linear(cfg.hidden, 10)
    )


def sync_seconds(spec: TrainSpec, payload_bytes: float) -> float:
    """The link's time for one sync of ``payload_bytes`` per worker."""
    return spec.latency_s + payload_bytes / spec.bandwidth_bytes_per_s


def modeled_time(spec: TrainSpec, cfg: MLPConfig, ticks: int, syncs: int, bytes_sent: float) -> float:
    """Seconds the run takes after ``ticks`` ticks with ``syncs`` syncs of ``bytes_sent`` payload bytes
    in all (per worker), under the module's time model, T = cfg.step_time_s, c_i = relative speeds:

    - dp: every step waits for the slowest worker and then for the gradient all-reduce:
      ticks * c_max * T + syncs * s.
    - DiLoCo: blocking syncs: ticks * c_max * T + syncs * s.
    - Streaming DiLoCo, CoCoDC: a fragment's sync overlaps tau steps:
      ticks * c_max * T + syncs * max(0, s - tau * c_max * T).
    - LOSCAR: a round ends when every worker has merged. Worker i sends after c_i N_i T; the
      all-reduce completes s after the last send; worker i merges at max(c_i (N_i + Q_i) T, that):
      the round takes the max over i. At p = 0 (no communication) a round is R * T.
    s is one sync's link time (latency + bytes per sync / bandwidth).
    """
    T, cs = cfg.step_time_s, spec.relative_speeds()
    s = sync_seconds(spec, bytes_sent / syncs) if syncs else 0.0
    if spec.method == "loscar":
        R = spec.round_steps()
        if spec.density == 0:
            return ticks * T
        local, overlap = spec.rank_step_counts()
        all_sent = max(c * n * T for c, n in zip(cs, local, strict=True))
        round_s = max(max(c * (n + q) * T, all_sent + s) for c, n, q in zip(cs, local, overlap, strict=True))
        return (ticks // R) * round_s + (ticks % R) * T
    compute = ticks * max(cs) * T
    if spec.method in ("dp", "diloco"):
        return compute + syncs * s
    return compute + syncs * max(0.0, s - spec.fragment_sync_delay * max(cs) * T)


def _eval(
    model: torch.nn.Module, X: torch.Tensor, y: torch.Tensor, group: object
) -> tuple[float, list[float], float, list[float]]:
    """(loss of the averaged model, each worker's own loss, accuracy of the averaged model, each
    worker's own accuracy)."""

    def loss(m: torch.nn.Module) -> float:
        return float(torch.nn.functional.cross_entropy(m(X), y))

    def acc(m: torch.nn.Module) -> float:
        return float((m(X).argmax(1) == y).double().mean())

    avg_loss, own_loss = averaged_and_own(model, loss, group)
    avg_acc, own_acc = averaged_and_own(model, acc, group)
    return avg_loss, own_loss, avg_acc, own_acc


def run_one(
    spec: TrainSpec, cfg: MLPConfig, data: tuple, rank: int, world: int, group: object, eval_group: object
) -> RunResult:
    """One run of ``spec`` on this rank (every rank returns the same RunResult)."""
    Xtr, ytr, Xte, yte = data
    model = make_model(cfg, spec.seed)
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr)
    # real collectives without emulated waits: the link enters through modeled_time only
    fast = spec.with_(latency_s=0.0, bandwidth_bytes_per_s=1e15)
    dp = GradAllReduce(model, group, 0.0, 1e15) if spec.method == "dp" else None
    strategy = None if dp is not None else build_strategy(fast, model, opt, group)
    rows = shard_rows(Xtr.shape[0], rank, world, spec.split)
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + rank)
    result = RunResult(
        spec.label, spec.method, spec.to_dict(), num_params=sum(p.numel() for p in model.parameters())
    )
    avg_acc, own_acc, syncs_at, steps_run = [], [], [], 0
    cpu0 = time.process_time()

    def totals() -> CommTotals:
        return dp.metrics if dp is not None else CommTotals.read(strategy)

    def record(tick: int) -> None:
        avg_l, own_l, avg_a, own_a = _eval(model, Xte, yte, eval_group)
        m = totals()
        t = modeled_time(spec, cfg, tick, m.syncs, m.bytes_sent)
        point = EvalPoint(tick, t, m.bytes_sent, m.exposed_s, sum(own_l) / world, own_l, avg_l)
        point.workers_agree = len(set(own_l)) == 1 and own_l[0] == avg_l
        result.points.append(point)
        syncs_at.append(m.syncs)
        avg_acc.append(avg_a)
        own_acc.append(sum(own_a) / world)

    def batch_loss() -> torch.Tensor:
        nonlocal steps_run
        steps_run += 1
        i = rows[torch.randint(0, rows.numel(), (spec.batch_size,), generator=gen)]
        return torch.nn.functional.cross_entropy(model(Xtr[i]), ytr[i])

    loop = TrainLoop(
        model,
        opt,
        batch_loss,
        spec.steps,
        record,
        every(spec.eval_every, spec.steps),
        grad_sync=dp,
        steps_on=lambda tick: spec.steps_on(rank, tick),  # a slower LOSCAR worker's fewer local steps
    )
    t0 = time.perf_counter()
    with strategy if strategy is not None else contextlib.nullcontext():  # none: dp, LOSCAR at p = 0
        loop.run()
    m = totals()
    mine = torch.tensor([steps_run, time.process_time() - cpu0], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=eval_group)
    result.train_wall_s = modeled_time(spec, cfg, spec.steps, m.syncs, m.bytes_sent)
    result.bytes_sent, result.exposed_s, result.syncs = m.bytes_sent, m.exposed_s, m.syncs
    result.extra = dict(
        m.extra,
        avg_acc=avg_acc,
        own_acc=own_acc,
        syncs_at=syncs_at,
        steps_per_rank=[int(g[0]) for g in gathered],
        cpu_s_all_ranks=float(sum(g[1] for g in gathered)),
        real_wall_s=time.perf_counter() - t0,
        time_model=dict(step_time_s=cfg.step_time_s, speeds=spec.relative_speeds()),
    )
    return result


def _rank(rank: int, world: int, cfg: MLPConfig, specs: list[TrainSpec]) -> list[dict] | None:
    """A worker process's body: every spec in turn; rank 0 sends each finished run's index and
    returns the results as dicts."""
    data = load_digits_split()
    results = []
    for i, spec in enumerate(specs):
        group, eval_group = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
        res = run_one(spec, cfg, data, rank, world, group, eval_group)
        dist.destroy_process_group(group)
        dist.destroy_process_group(eval_group)
        if rank == 0:
            results.append(res.to_dict())
            send(i)
    return results if rank == 0 else None


def run_mlp_specs(
    specs: list[TrainSpec], cfg: MLPConfig | None = None, *, progress: bool = True
) -> list[RunResult]:
    """Every spec in turn on ``specs[0].workers`` ranks (one spawn); rank 0's results in order.
    Raises :class:`~lowcomm_kernels.runtime.launch.WorkerError` when a rank fails."""
    if not specs:
        raise ValueError("run_mlp_specs() needs at least one TrainSpec")
    world = specs[0].workers
    if any(s.workers != world for s in specs):
        raise ValueError("every spec of one launch must use the same number of workers")
    dicts = launch_jobs(_rank, (cfg or MLPConfig(), specs), len(specs), world, progress, "mlp runs")
    return [RunResult.from_dict(d) for d in dicts]


def run_mlp_compare(args: argparse.Namespace) -> int:
    """`lowcomm compare --task mlp`: every --methods method on the digits MLP, one seed, the
    comparison table of the LM task (wall-clock = the time model's seconds)."""
    refuse_flags(args, LM_ONLY, "--task mlp (the digits MLP)")
    preset = PRESETS["quick" if args.quick else "default"]
    specs = [spec_from_args(args, m, preset) for m in parse_methods(args.methods)]
    cfg = MLPConfig()
    out = out_dir(args, "compare-mlp")
    t0 = time.perf_counter()
    try:
        results = run_mlp_specs(specs, cfg, progress=not args.no_progress)
    except WorkerError as exc:
        return report_failure(exc, out)
    target = args.target if args.target is not None else auto_target(results)
    table = format_table(results, target).replace("nats/byte", "nats (test cross-entropy)")
    s = specs[0]
    title = (
        f"lowcomm compare --task mlp{' --quick' if args.quick else ''}: digits MLP, {s.workers} workers, "
        f"{s.steps} ticks, split {s.split}; wall-clock = modeled seconds (step {cfg.step_time_s} s, "
        f"link {s.latency_s * 1e3:g} ms + bytes / {s.bandwidth_bytes_per_s * 8 / 1e6:g} Mbit/s); exposed "
        "comm = the real gloo waits on this machine"
    )
    own = "\n".join(
        f"- {r.name}: workers' own models' final loss {r.final_loss:.4f}, "
        f"accuracy {r.extra['own_acc'][-1]:.3f} (averaged model {r.extra['avg_acc'][-1]:.3f})"
        for r in results
    )
    (out / "table.md").write_text(f"# {title}\n\n{table}\n\n{own}\n")
    write_json(
        out / "results.json",
        {
            "title": title,
            "target_val_loss": target,
            "rows": comparison_rows(results, target),
            "runs": [r.to_dict() for r in results],
            "mlp": cfg.__dict__,
            "elapsed_s": time.perf_counter() - t0,
            "provenance": collect(),
        },
    )
    print(f"{title}\n\n{table}\n\n{own}\nwrote {out / 'table.md'}, {out / 'results.json'}")
    return 0
