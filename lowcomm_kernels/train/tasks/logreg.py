"""LOSCAR's setting: logistic regression, heterogeneous workers, sparse averaging (``--task logreg``).

Datasets
- ``breast_cancer``: scikit-learn's bundled Wisconsin breast-cancer data (569 x 30, real data
  shipped inside the scikit-learn wheel), standardised.
- ``a9a_synthetic``: a SYNTHETIC set shaped like LIBSVM's a9a (32,561 rows, 123 binary features,
  exactly 14 ones per row from 14 one-hot groups, ~24% positives). a9a itself is a download, so we
  generate a deterministic stand-in (numpy seed 0) with labels from a planted logistic model. Its
  numbers are not a9a's numbers.

Protocol (docs/algorithms.md, LOSCAR-SGD): 4 workers with relative step times (1, 2, 3, 6). A round has
a fixed wall-clock length R; a worker c x slower runs c x fewer steps in it: N_i = N / c_i local
steps before sending, Q_i = Q / c_i while the sparse all-reduce is in flight. Variants:
- delay-corrected: merge x[S] <- mean(y[S]) + (z[S] - y[S])
- overwrite: x[S] <- mean(y[S])
- blocking: no overlap (Q_i = 0): the worker idles while the sync is in flight, so in the same
  round length it runs only N_i steps (then merges with nothing to correct).
Time is counted in rounds (units of R); the collectives run over real gloo ranks but with no
emulated latency, since R is the same for all variants by construction.
Objective: regularised logistic loss f(x) = mean log(1 + exp(-y a.x)) + (l2/2)|x|^2 of the
worker-averaged model on the whole training set, reported as the gap f - f* (f* by L-BFGS).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ...runtime import LOSCAR
from ...runtime.launch import WorkerError, send
from .. import paper_vs_ours
from ..args import _SPEC_FIELDS, check_workers, out_dir
from ..loop import TrainLoop
from ..presets import LOGREG
from ..provenance import collect
from ..report import mean_std, write_json
from ..runner import report_failure
from .common import averaged_and_own, launch_jobs, refuse_flags

SPEEDS = (1, 2, 3, 6)
DENSITIES = (0.001, 0.01, 0.1, 1.0)
VARIANTS = ("delay_corrected", "overwrite", "blocking")
DATASETS = ("breast_cancer", "a9a_synthetic")
# breast_cancer: standardised 31 columns, |a|^2 ~ 31; a9a-shaped: 15 ones per row, |a|^2 = 15.
LR = {"breast_cancer": 0.1, "a9a_synthetic": 0.3}


@dataclass
class LogregConfig:
    rounds: int = LOGREG["default"]["rounds"]
    local_steps: int = 12  # N for the fastest worker (divisible by every speed)
    overlap_steps: int = 6  # Q for the fastest worker
    batch_size: int = 16
    lr: dict | None = None  # per dataset; default LR below (about 1/L of a minibatch for each dataset)
    l2: float = 1e-4
    eval_every: int = 5


def a9a_synthetic(n: int = 32561, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic a9a-shaped data: X (n, 123) float32 in {0, 1} with 14 ones per row, y in {-1, 1}."""
    rng = np.random.default_rng(seed)
    # 14 categorical groups whose sizes sum to 123 (a9a's one-hot encoding of the Adult census fields)
    sizes = np.array([9, 16, 16, 7, 15, 6, 5, 2, 2, 3, 3, 4, 7, 28])
    assert sizes.sum() == 123
    X = np.zeros((n, 123), dtype=np.float32)
    start = 0
    for s in sizes:
        p = rng.dirichlet(np.full(s, 0.5))  # skewed category frequencies, as in census data
        X[np.arange(n), start + rng.choice(s, size=n, p=p)] = 1.0
        start += s
    w = rng.normal(0, 1.0, 123)
    logits = X @ w
    logits = logits - np.quantile(logits, 0.76) + rng.normal(0, 0.5, n)  # ~24% positives
    y = np.where(logits > 0, 1.0, -1.0).astype(np.float32)
    return X, y


def load_dataset(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(X (n, d) float32 with a trailing bias column of ones, y (n,) float32 in {-1, 1})."""
    if name == "breast_cancer":
        from sklearn.datasets import load_breast_cancer  # optional (the cli extra): only this dataset

        data = load_breast_cancer()
        X = data.data.astype(np.float64)
        X = ((X - X.mean(0)) / X.std(0)).astype(np.float32)
        y = np.where(data.target == 1, 1.0, -1.0).astype(np.float32)
    elif name == "a9a_synthetic":
        X, y = a9a_synthetic()
    else:
        raise ValueError(f"unknown dataset {name!r}; choose from {DATASETS}")
    X = np.concatenate([X, np.ones((X.shape[0], 1), np.float32)], axis=1)
    return torch.from_numpy(X), torch.from_numpy(y)


def objective(w: torch.Tensor, X: torch.Tensor, y: torch.Tensor, l2: float) -> torch.Tensor:
    """f(w) = mean softplus(-y * X w) + l2/2 |w|^2 (float64 for an accurate gap)."""
    w, X, y = w.double(), X.double(), y.double()
    return torch.nn.functional.softplus(-y * (X @ w)).mean() + 0.5 * l2 * w.dot(w)


def optimum(X: torch.Tensor, y: torch.Tensor, l2: float) -> float:
    w = torch.zeros(X.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS(
        [w],
        lr=1.0,
        max_iter=500,
        tolerance_grad=1e-12,
        tolerance_change=1e-15,
        history_size=50,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        f = objective(w, X, y, l2)
        f.backward()
        return f

    for _ in range(5):
        opt.step(closure)
    return float(objective(w.detach(), X, y, l2))


def run_one(
    cfg: LogregConfig,
    dataset: str,
    X: torch.Tensor,
    y: torch.Tensor,
    density: float,
    variant: str,
    seed: int,
    rank: int,
    world: int,
    group: object,
    eval_group: object,
) -> list[tuple[int, float, float]]:
    """One LOSCAR run on this rank; returns [(round, f(mean_i x_i))] (identical on all ranks)."""
    speeds = SPEEDS if world == len(SPEEDS) else tuple(SPEEDS[i % len(SPEEDS)] for i in range(world))
    local = [max(1, cfg.local_steps // c) for c in speeds]
    overlap = [0 if variant == "blocking" else max(1, cfg.overlap_steps // c) for c in speeds]
    torch.manual_seed(seed)
    model = torch.nn.Linear(X.shape[1], 1, bias=False)  # the bias is X's ones column
    torch.nn.init.zeros_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=(cfg.lr or LR)[dataset], weight_decay=cfg.l2)
    strategy = LOSCAR(
        model,
        opt,
        density=density,
        local_steps=local,
        overlap_steps=overlap,
        merge="overwrite" if variant == "overwrite" else "delay_corrected",
        seed=seed,
        process_group=group,
    )
    shard = torch.arange(rank, X.shape[0], world)  # iid split: interleaved rows
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    steps_per_round = local[rank] + overlap[rank]
    curve = []

    def record(r: int) -> None:
        avg, own = averaged_and_own(
            model, lambda m: float(objective(model.weight.reshape(-1), X, y, cfg.l2)), eval_group
        )
        curve.append((r, avg, sum(own) / len(own)))

    def batch_loss() -> torch.Tensor:
        i = shard[torch.randint(0, shard.numel(), (cfg.batch_size,), generator=gen)]
        return torch.nn.functional.softplus(-y[i] * model(X[i]).reshape(-1)).mean()

    # this rank's ticks are its own steps: rounds of steps_per_round (fewer on a slower worker), and
    # the evaluations (collective) at the ends of the same rounds on every rank
    def round_end(tick: int) -> bool:
        r, within = divmod(tick, steps_per_round)
        return within == 0 and (r % cfg.eval_every == 0 or r == cfg.rounds)

    loop = TrainLoop(
        model,
        opt,
        batch_loss,
        cfg.rounds * steps_per_round,
        lambda tick: record(tick // steps_per_round),
        round_end,
    )
    with strategy:
        loop.run()
    return curve


def _rank(rank: int, world: int, cfg: LogregConfig, jobs: list) -> list[dict] | None:
    """A worker process's body under :func:`lowcomm_kernels.runtime.launch.launch`: every job in
    turn; rank 0 sends the index of each finished job (the progress bar) and returns the results."""
    data = {}
    results = []
    for i, (ds, density, variant, seed) in enumerate(jobs):
        if ds not in data:
            X, y = load_dataset(ds)
            data[ds] = (X, y, optimum(X, y, cfg.l2) if rank == 0 else math.nan)
        X, y, fstar = data[ds]
        group, eval_group = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
        curve = run_one(cfg, ds, X, y, density, variant, seed, rank, world, group, eval_group)
        dist.destroy_process_group(group)
        dist.destroy_process_group(eval_group)
        if rank == 0:
            results.append(
                {
                    "dataset": ds,
                    "density": density,
                    "variant": variant,
                    "seed": seed,
                    "fstar": fstar,
                    "curve": curve,
                }
            )
            send(i)
    return results if rank == 0 else None


def run_jobs(cfg: LogregConfig, jobs: list, workers: int, progress: bool) -> list[dict]:
    """Every job on ``workers`` ranks; raises :class:`~lowcomm_kernels.runtime.launch.WorkerError`."""
    return launch_jobs(_rank, (cfg, jobs), len(jobs), workers, progress, "logreg runs")


def summarise(results: list[dict]) -> str:
    """Markdown: per dataset, final gaps (mean +- std over seeds) per density x variant: of the
    averaged model f(x̄) - f* and, after '/', the mean over workers of f(x_i) - f*."""

    def cell(values: list[float]) -> str:
        m, s = mean_std(values)
        return "n/a" if math.isnan(m) else f"{m:.4f} ± {s:.4f}"

    lines = []
    for ds in dict.fromkeys(r["dataset"] for r in results):
        lines += [
            f"### {ds}" + (" (SYNTHETIC a9a-shaped data, not a9a)" if ds == "a9a_synthetic" else ""),
            "",
            "cells: f(x̄) − f* of the averaged model / mean over workers of f(x_i) − f*",
            "",
            "| density p | " + " | ".join(VARIANTS) + " |",
            "|---|" + "---|" * len(VARIANTS),
        ]
        for p in dict.fromkeys(r["density"] for r in results if r["dataset"] == ds):
            cells = []
            for v in VARIANTS:
                runs = [r for r in results if r["dataset"] == ds and r["density"] == p and r["variant"] == v]
                avg = cell([r["curve"][-1][1] - r["fstar"] for r in runs])
                own = cell([r["curve"][-1][2] - r["fstar"] for r in runs])
                cells.append(f"{avg} / {own}")
            lines.append(f"| {p:g} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["**The paper's findings beside ours** (relative change of the averaged model's final gap)", ""]
    lines += [paper_section(results), ""]
    return "\n".join(lines)


def _gaps(results: list[dict], ds: str, density: float, variant: str) -> dict[int, float]:
    """Seed -> the averaged model's final gap f(x̄) − f*."""
    return {
        int(r["seed"]): r["curve"][-1][1] - r["fstar"]
        for r in results
        if r["dataset"] == ds and r["density"] == density and r["variant"] == variant
    }


def paper_section(results: list[dict]) -> str:
    """The paper's findings (read from its figures: a direction, no number) beside our relative
    effects, per dataset: the delay-corrected merge against overwrite (at the densest and the
    sparsest p run), overlap against blocking, and p = 0.001 against p = 1 (the paper: the loss
    trajectory is kept, i.e. no direction claimed)."""
    claims, ours = [], {}
    for ds in dict.fromkeys(r["dataset"] for r in results):
        ps = sorted({r["density"] for r in results if r["dataset"] == ds})
        dense, sparse, dc = ps[-1], ps[0], "delay_corrected"
        rows = [  # (what, (p, variant) against (p, variant), the paper's direction, its words, where)
            (
                f"delay-corrected vs overwrite, p = {dense:g}",
                (dense, dc),
                (dense, "overwrite"),
                -1,
                "",
                "Fig. 1a, 1c",
            ),
            (
                f"delay-corrected vs overwrite, p = {sparse:g}",
                (sparse, dc),
                (sparse, "overwrite"),
                -1,
                "",
                "Fig. 1a, 1c",
            ),
            (
                f"overlap (delay-corrected) vs blocking, p = {dense:g}",
                (dense, dc),
                (dense, "blocking"),
                -1,
                "",
                "Fig. 1a",
            ),
            (
                f"p = {sparse:g} vs p = {dense:g} (delay-corrected)",
                (sparse, dc),
                (dense, dc),
                0,
                "about the same",
                "Fig. 8",
            ),
        ]
        for what, (pa, va), (pb, vb), direction, words, where in rows:
            what = f"{ds}: {what}"
            a, b = _gaps(results, ds, pa, va), _gaps(results, ds, pb, vb)
            seeds = sorted(set(a) & set(b))
            claims.append(
                paper_vs_ours.Claim(what, "final gap", None, f"{where} (a9a)", va, vb, direction, words)
            )
            ours[what, "final gap"] = paper_vs_ours.relative([a[s] for s in seeds], [b[s] for s in seeds])
    return paper_vs_ours.table(claims, ours, "the paper")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib  # optional (the cli extra): only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    densities = list(dict.fromkeys(r["density"] for r in results))
    fig, axes = plt.subplots(
        len(datasets),
        len(densities),
        figsize=(3.2 * len(densities), 2.8 * len(datasets)),
        squeeze=False,
        sharex=True,
    )
    for a, ds in enumerate(datasets):
        for b, p in enumerate(densities):
            ax = axes[a][b]
            for v in VARIANTS:
                runs = [r for r in results if r["dataset"] == ds and r["density"] == p and r["variant"] == v]
                if not runs:
                    continue
                rounds = [c[0] for c in runs[0]["curve"]]
                gaps = np.array([[c[1] - r["fstar"] for c in r["curve"]] for r in runs])
                own = np.array([[c[2] - r["fstar"] for c in r["curve"]] for r in runs])
                (line,) = ax.plot(rounds, np.maximum(gaps.mean(0), 1e-8), label=f"{v} (x̄)")
                ax.plot(
                    rounds,
                    np.maximum(own.mean(0), 1e-8),
                    ls="--",
                    color=line.get_color(),
                    label=f"{v} (workers' own)",
                )
            ax.set_yscale("log")
            ax.set_title(f"{ds}, p={p:g}", fontsize=9)
            ax.grid(alpha=0.3)
            if a == len(datasets) - 1:
                ax.set_xlabel("round (fixed wall-clock R)")
            if b == 0:
                ax.set_ylabel("f(x̄) − f*")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def logreg_header(config: dict, speeds: tuple[int, ...] | list[int], seeds: int) -> str:
    """The line above the logreg table: workers and their speeds, rounds, N, Q and seeds. ``config``:
    a :class:`LogregConfig`'s fields (as results.json stores them)."""
    return (
        f"LOSCAR logistic regression: {len(speeds)} workers with relative step times {tuple(speeds)}, "
        f"{config['rounds']} rounds, N={config['local_steps']}, Q={config['overlap_steps']} for the "
        f"fastest worker, {seeds} seed(s); final gaps, mean ± std over seeds"
    )


def run_logreg_compare(args: argparse.Namespace) -> int:
    # its own fixed setting: the flags of the training runs would be silently ignored
    model_and_link = "data dim layers heads mlp_hidden seq_len latency_ms bandwidth_mbps target".split()
    refuse_flags(args, [f for f in _SPEC_FIELDS if f != "workers"] + model_and_link, "--task logreg")
    preset = LOGREG["quick" if args.quick else "default"]
    cfg = LogregConfig(rounds=preset["rounds"])
    workers = args.workers or preset["workers"]
    check_workers(args, workers)
    seeds = args.seeds or preset["seeds"]
    jobs = [(ds, p, v, s) for ds in DATASETS for p in DENSITIES for v in VARIANTS for s in range(seeds)]
    out = out_dir(args, "compare-logreg")
    t0 = time.perf_counter()
    try:
        results = run_jobs(cfg, jobs, workers, not args.no_progress)
    except WorkerError as exc:
        return report_failure(exc, out)
    table = summarise(results)
    header = logreg_header(cfg.__dict__, SPEEDS[:workers], seeds)
    (out / "table.md").write_text(
        f"# {header}\n\nCommand: `lowcomm compare --task logreg"
        f"{' --quick' if args.quick else ''}`\n\n{table}\n"
    )
    write_json(
        out / "results.json",
        {
            "config": cfg.__dict__,
            "lr": cfg.lr or LR,
            "speeds": SPEEDS,
            "workers": workers,
            "seeds": seeds,
            "runs": results,
            "elapsed_s": time.perf_counter() - t0,
            "provenance": collect(),
        },
    )
    plot(results, out / "logreg_gap_vs_round.png")
    print(header + "\n\n" + table)
    print(
        f"wrote {out / 'table.md'}, {out / 'results.json'}, {out / 'logreg_gap_vs_round.png'} "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    return 0
