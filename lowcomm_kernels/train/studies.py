"""The CoCoDC review's open questions as runnable studies (``lowcomm compare --study NAME``).

Each study is a list of named configurations of the byte-level LM task, each run with several seeds
(default 3) in one spawn of the workers. It writes ``<study>.md`` (a table of mean +- std over
seeds), ``<study>.png`` (validation loss vs steps, mean with a +-1 std band) and ``results.json``.

- ``matched``: equal sync counts. Streaming DiLoCo at K syncs per H (its default) and at 8 syncs per
  H (sync_every halved, so each of the K=4 fragments goes twice per H), CoCoDC with N=8 and its
  adaptive choice, CoCoDC with N=8 and round-robin choice (= Streaming DiLoCo at 8 + the Taylor
  merge). Streaming@8 vs CoCoDC-RR@8 isolates delay compensation; CoCoDC-RR@8 vs CoCoDC@8 isolates
  adaptive selection.
- ``lambda``: CoCoDC's lambda in {0, 0.1, 0.5, 1.0}, absolute and normalized modes (lambda = 0 is the
  same in both, run once), N fixed at 8 so only the merge changes.
- ``gamma``: CoCoDC with syncs_per_period="auto" and gamma in {0.1, 0.2, 0.4, 0.8} on a 400 ms link:
  how many syncs the measured T_c, T_s and gamma give, and what they buy.
- ``overlap``: overlap depth tau in {1, 5, 10} for Streaming DiLoCo and CoCoDC (N = K syncs so the
  count does not change with tau).
- ``wire``: compressed wire formats. Streaming DiLoCo and CoCoDC with every ``--wire-dtype`` (fp32,
  bf16, and each quantized format with and without error feedback, ``--quant-block`` values per
  scale): final loss and bytes to the target; ``wire_bytes.png`` plots loss against bytes sent.

Every study is resumable: each configuration's runs are saved to ``<out>/runs/`` as soon as they
finish, and a later command with the same ``--out`` and the same flags reuses them.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..runtime.launch import WorkerError
from ..runtime.schedule import WIRE_FORMATS
from . import study_cocodc, study_frontier, study_loscar, study_scale, study_score
from .args import out_dir, spec_from_args, usage_error
from .errors import SpecError, UsageError
from .presets import LM, STUDY_SEEDS
from .provenance import collect
from .report import RunResult, auto_target, write_json
from .runner import report_failure
from .spec import RANGES, TrainSpec
from .stats import contrast_table
from .studykit import (
    Study,
    cell,
    labels_of,
    run_resumable,
    runs_of,
    sittings,
    study_plot,
    table_head,
)
from .tasks.lm import load_checked_corpus


def matched(base: TrainSpec) -> list[tuple[str, TrainSpec]]:
    K, H = base.num_fragments, base.sync_every
    n = 2 * K  # 8 with the default K = 4
    configs = [
        (f"Streaming DiLoCo, {K} syncs/H", base.with_(method="streaming")),
        (
            f"Streaming DiLoCo, {n} syncs/H",
            base.with_(method="streaming", sync_every=max(base.fragment_sync_delay + 1, H // 2)),
        ),
        (f"CoCoDC adaptive, {n} syncs/H", base.with_(method="cocodc", syncs_per_period=n)),
        (
            f"CoCoDC round-robin, {n} syncs/H",
            base.with_(method="cocodc", syncs_per_period=n, score="round_robin"),
        ),
    ]
    return configs


def lam(base: TrainSpec) -> list[tuple[str, TrainSpec]]:
    b = base.with_(method="cocodc", syncs_per_period=2 * base.num_fragments)
    configs = [("lambda=0", b.with_(lam=0.0))]
    for mode in ("absolute", "normalized"):
        configs += [(f"lambda={v:g} {mode}", b.with_(lam=v, lam_mode=mode)) for v in (0.1, 0.5, 1.0)]
    return configs


def gamma(base: TrainSpec) -> list[tuple[str, TrainSpec]]:
    # N = clamp(floor(gamma * H * T_c / T_s), K, H / tau). On the default link (50 ms) a fragment sync
    # takes T_s ~ 60 ms while a step of 4 workers sharing 2 cores takes T_c ~ 60-200 ms, so every
    # gamma would hit the cap H / tau; a 400 ms link puts T_s near the range where gamma decides N.
    # This study is about the measured times, so it measures them (the default is the emulated timing).
    slow = base.with_(
        method="cocodc", syncs_per_period="auto", latency_s=max(base.latency_s, 0.4), cocodc_timing="measured"
    )
    return [(f"gamma={g:g}", slow.with_(gamma=g)) for g in (0.1, 0.2, 0.4, 0.8)]


def overlap(base: TrainSpec) -> list[tuple[str, TrainSpec]]:
    configs = []
    for tau in (1, 5, 10):
        if tau >= base.sync_every // base.num_fragments:  # a fragment's sync must land before its next send
            continue
        configs.append(
            (f"Streaming DiLoCo tau={tau}", base.with_(method="streaming", fragment_sync_delay=tau))
        )
        configs.append(
            (
                f"CoCoDC tau={tau}",
                base.with_(method="cocodc", fragment_sync_delay=tau, syncs_per_period=base.num_fragments),
            )
        )
    return configs


def wire(base: TrainSpec) -> list[tuple[str, TrainSpec]]:
    configs = []
    for method, label in (("streaming", "Streaming DiLoCo"), ("cocodc", "CoCoDC")):
        b = base.with_(method=method, error_feedback=False)
        if method == "cocodc":
            b = b.with_(syncs_per_period=base.num_fragments)  # N = K: the same syncs as Streaming DiLoCo
        for name, target in WIRE_FORMATS.items():
            configs.append((f"{label} {name}", b.with_(wire_dtype=name)))
            if isinstance(target, str):  # a quantized format: also with error feedback
                configs.append((f"{label} {name}+EF", b.with_(wire_dtype=name, error_feedback=True)))
    return configs


# ----- the declared contrasts: (name, a, b), read as a − b in final validation loss, paired by seed;
# each study's list is its family for Holm's correction. Declared here, before any run, from the
# configurations' labels (a label a study did not run drops its contrasts).
Contrasts = Callable[[list[str]], list[tuple[str, str, str]]]


def matched_contrasts(labels: list[str]) -> list[tuple[str, str, str]]:
    """Delay compensation (only the merge differs) and adaptive selection (only the choice differs),
    at the doubled sync count."""
    n = [lb.split(", ")[1] for lb in labels if lb.startswith("CoCoDC adaptive, ")]
    if not n:
        return []
    return [
        ("delay compensation", f"CoCoDC round-robin, {n[0]}", f"Streaming DiLoCo, {n[0]}"),
        ("adaptive selection", f"CoCoDC adaptive, {n[0]}", f"CoCoDC round-robin, {n[0]}"),
    ]


def _against_first(labels: list[str]) -> list[tuple[str, str, str]]:
    """Every configuration against the study's first one (lambda: λ = 0; gamma: the smallest γ)."""
    return [(f"{lb} vs {labels[0]}", lb, labels[0]) for lb in labels[1:]]


def _within_method(labels: list[str], sep: str, base: str) -> list[tuple[str, str, str]]:
    """Each label "<method><sep><value>" against "<method><sep><base>", when the study ran that one."""
    out = []
    for lb in labels:
        method, value = lb.rsplit(sep, 1)
        ref = f"{method}{sep}{base}"
        if value != base and ref in labels:
            key = sep.strip()  # "tau=" for " tau=", nothing for a space
            out.append((f"{method}: {key}{value} vs {key}{base}", lb, ref))
    return out


def overlap_contrasts(labels: list[str]) -> list[tuple[str, str, str]]:
    """Each deeper overlap against τ = 1 of the same method."""
    return _within_method(labels, " tau=", "1")


def wire_contrasts(labels: list[str]) -> list[tuple[str, str, str]]:
    """Each wire format against fp32 with the same method."""
    return _within_method(labels, " ", "fp32")


def wire_table(labels: list[str], results: list[RunResult], target: float) -> str:
    """Markdown for the wire study: loss and bytes, against the fp32 configuration of each method."""
    lines = table_head(
        target, ["bytes/worker to target (MB)", "bytes sent/worker (MB)", "fp32 bytes / these"], results
    )
    for label in labels:
        runs = [r for r in results if r.name == label]
        ref_label = label.rsplit(" ", 1)[0] + " fp32"
        ref = [r.bytes_sent for r in results if r.name == ref_label]

        hits = [r.first_reaching(target) for r in runs]
        sent = [r.bytes_sent for r in runs]
        ratio = sum(ref) / sum(sent) if ref and sum(sent) else float("nan")
        lines.append(
            f"| {label} | {len(runs)} | {cell([r.final_loss for r in runs])} | "
            f"{cell([h.bytes_sent / 1e6 if h else None for h in hits], '{:.3f}')} | "
            f"{cell([b / 1e6 for b in sent], '{:.3f}')} | {ratio:.2f}x |"
        )
    return "\n".join(lines)


def wire_plot(labels: list[str], results: list[RunResult], path: Path) -> None:
    """Validation loss against bytes sent per worker, mean over seeds, one panel per method."""
    import matplotlib  # optional (the cli extra): only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(label.rsplit(" ", 1)[0] for label in labels))  # in order
    formats = list(dict.fromkeys(label.rsplit(" ", 1)[1].removesuffix("+EF") for label in labels))
    colors = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(formats)}  # +EF: same colour, dashed
    fig, axes = plt.subplots(1, len(methods), figsize=(6.5 * len(methods), 4.6), squeeze=False)
    for ax, method in zip(axes[0], methods, strict=True):
        for label in [lb for lb in labels if lb.rsplit(" ", 1)[0] == method]:
            runs = [r for r in results if r.name == label and r.points]
            if not runs:
                continue
            n = min(len(r.points) for r in runs)
            x = np.array([[p.bytes_sent for p in r.points[:n]] for r in runs]).mean(0) / 1e6
            y = np.array([[p.val_loss for p in r.points[:n]] for r in runs]).mean(0)
            fmt = label.rsplit(" ", 1)[1]
            style = "--" if fmt.endswith("+EF") else "-"
            ax.plot(x[1:], y[1:], label=fmt, color=colors[fmt.removesuffix("+EF")], linestyle=style)
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent per worker (MB, log scale)")
        ax.set_ylabel("validation loss (nats/byte), mean over seeds")
        ax.set_title(method)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def study_table(name: str, labels: list[str], results: list[RunResult], target: float) -> str:
    """Markdown: per configuration, mean +- std over seeds of the headline numbers."""
    lines = table_head(
        target,
        [
            "steps to target",
            "wall-clock to target (s)",
            "syncs",
            "bytes sent/worker (MB)",
            "exposed comm (s)",
        ],
        results,
    )
    for label in labels:
        runs = [r for r in results if r.name == label]

        hits = [r.first_reaching(target) for r in runs]
        lines.append(
            "| "
            + " | ".join(
                [
                    label,
                    str(len(runs)),
                    cell([r.final_loss for r in runs]),
                    cell([h.step if h else None for h in hits], "{:.0f}"),
                    cell([h.wall_s if h else None for h in hits], "{:.1f}"),
                    cell([float(r.syncs) for r in runs], "{:.0f}"),
                    cell([r.bytes_sent / 1e6 for r in runs], "{:.2f}"),
                    cell([r.exposed_s for r in runs], "{:.2f}"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def study_header(study: str, base: dict, seeds: int, corpus: str) -> str:
    """The line above a study's table. ``base``: the study's base TrainSpec as a dict (results.json
    stores it under "base")."""
    mc = base["model"]
    return (
        f"study `{study}`: {base['workers']} workers, {base['steps']} steps, H={base['sync_every']}, "
        f"K={base['num_fragments']}, tau={base['fragment_sync_delay']}, {seeds} seeds, model dim={mc['dim']} "
        f"layers={mc['n_layers']} seq_len={mc['seq_len']}, quant_block={base['quant_block']}; {corpus}"
    )


@dataclass(frozen=True)
class LMStudy:
    """A study of the byte-level LM task that the common command runs and ``lowcomm report`` renders:
    its table (``table(name, labels, results, target)``), the loss-vs-steps plot and, if given,
    ``extra_plot`` (file stem, ``plot(labels, results, path)``)."""

    name: str
    configs: Callable[[TrainSpec], list[tuple[str, TrainSpec]]]
    table: Callable[[str, list[str], list[RunResult], float], str]
    extra_plot: tuple[str, Callable[[list[str], list[RunResult], Path], None]] | None = None
    contrasts: Contrasts | None = None

    def full_table(self, labels: list[str], results: list[RunResult], target: float) -> str:
        """The study's table and, below it, its declared contrasts."""
        table = self.table(self.name, labels, results, target)
        extra = contrast_table(self.contrasts(labels), results) if self.contrasts else ""
        return f"{table}\n\n{extra}" if extra else table

    def run(self, args: argparse.Namespace) -> int:
        """``lowcomm compare --study NAME``: every configuration with ``--seeds`` seeds, resumable."""
        if args.task != "lm":
            raise UsageError("--study runs on the language-model task (--task lm)")
        base = spec_from_args(args, "cocodc", LM["study-quick" if args.quick else "study"])
        seeds = args.seeds or STUDY_SEEDS
        last_seed, max_seed = base.seed + seeds - 1, RANGES["seed"].hi
        if max_seed is not None and last_seed > max_seed:
            raise UsageError(
                f"--seed {base.seed} with --seeds {seeds} needs seed {last_seed}; the largest is {max_seed}"
            )
        try:  # a configuration of the study may not fit the flags given
            configs = self.configs(base)
            specs = [
                spec.with_(name=label, seed=base.seed + s) for label, spec in configs for s in range(seeds)
            ]
        except SpecError as exc:
            raise usage_error(exc) from None
        labels = [label for label, _ in configs]
        corpus = load_checked_corpus(args.data, specs)
        out = out_dir(args, f"study-{self.name}")
        t0 = time.perf_counter()
        groups = [(label, [s for s in specs if s.name == label]) for label in labels]
        try:
            results = run_resumable(groups, corpus, out / "runs", progress=not args.no_progress)
        except WorkerError as exc:
            return report_failure(exc, out, "study")
        target = args.target if args.target is not None else auto_target(results)
        table = self.full_table(labels, results, target)
        if self.extra_plot is not None:
            stem, plot = self.extra_plot
            plot(labels, results, out / f"{stem}.png")
        cmd = (
            f"lowcomm compare --study {self.name}"
            + (" --quick" if args.quick else "")
            + (f" --seeds {args.seeds}" if args.seeds else "")
        )
        header = study_header(self.name, dataclasses.asdict(base), seeds, corpus.describe())
        (out / f"{self.name}.md").write_text(f"# {header}\n\nCommand: `{cmd}`\n\n{table}\n")
        study_plot(self.name, labels, results, out / f"{self.name}.png")
        write_json(
            out / "results.json",
            {
                "study": self.name,
                "command": cmd,
                "corpus": corpus.describe(),
                "base": dataclasses.asdict(base),
                "seeds": seeds,
                "target_val_loss": target,
                "runs": [r.to_dict() for r in results],
                "elapsed_s": time.perf_counter() - t0,
                "provenance": collect(),
                "sittings": sittings(out / "runs", len(groups)),  # the code that made each saved part
            },
        )
        print(f"\n{header}\n\n{table}")
        print(
            f"\nwrote {out / (self.name + '.md')}, {out / (self.name + '.png')}, {out / 'results.json'} "
            f"({time.perf_counter() - t0:.0f} s)"
        )
        return 0

    def render(self, data: dict, plot_dir: Path | None, prefix: str) -> tuple[str, list[Path]]:
        """``lowcomm report`` of the study's results.json: its header, table and (with ``plot_dir``) plots."""
        results = runs_of(data)
        labels, target = labels_of(results), float(data["target_val_loss"])
        seeds = data.get("seeds") or max((sum(r.name == lb for r in results) for lb in labels), default=0)
        base = data.get("base") or (results[0].config if results else None)
        if isinstance(base, dict) and isinstance(base.get("model"), dict):
            header = study_header(self.name, base, seeds, data.get("corpus", "corpus not recorded"))
        else:
            header = f"study `{self.name}`"
        table = self.full_table(labels, results, target)
        body = f"**{header}**\n\nCommand: `{data.get('command', 'not recorded')}`\n\n{table}"
        plots: list[Path] = []
        if plot_dir:
            plots.append(plot_dir / f"{prefix}_{self.name}.png")
            study_plot(self.name, labels, results, plots[-1])
            if self.extra_plot is not None:
                stem, plot = self.extra_plot
                plots.append(plot_dir / f"{prefix}_{stem}.png")
                plot(labels, results, plots[-1])
        return body, plots


def _lm_study(
    name: str,
    configs: Callable[[TrainSpec], list[tuple[str, TrainSpec]]],
    table: Callable[[str, list[str], list[RunResult], float], str] = study_table,
    extra_plot: tuple[str, Callable[[list[str], list[RunResult], Path], None]] | None = None,
    headline: Callable[[dict], str] | None = None,
    contrasts: Contrasts | None = None,
) -> Study:
    lm = LMStudy(name, configs, table, extra_plot, contrasts)
    return Study(name, configs, lm.run, lm.render, headline)


def _wire_table(name: str, labels: list[str], results: list[RunResult], target: float) -> str:
    return wire_table(labels, results, target)


#: every study of ``lowcomm compare --study``, by name: the one place the CLI, the command and
#: ``lowcomm report`` look a study up
STUDIES: dict[str, Study] = {
    s.name: s
    for s in (
        _lm_study("matched", matched, contrasts=matched_contrasts),
        _lm_study("lambda", lam, contrasts=_against_first),
        _lm_study("gamma", gamma, contrasts=_against_first),
        _lm_study("overlap", overlap, contrasts=overlap_contrasts),
        _lm_study(
            "wire", wire, table=_wire_table, extra_plot=("wire_bytes", wire_plot), contrasts=wire_contrasts
        ),
        # DiLoCo's loss against its bytes: top-k, 4-bit, eager (see study_frontier.py)
        _lm_study(
            "frontier",
            study_frontier.configs,
            table=study_frontier.table,
            extra_plot=("frontier", study_frontier.plot),
            headline=study_frontier.headline,
        ),
        study_loscar.STUDY,  # on the digits MLP: see study_loscar.py
        study_cocodc.STUDY,  # the paper's setup and the Taylor-term controls: see study_cocodc.py
        study_score.STUDY,  # why CoCoDC's score keeps choosing one fragment: see study_score.py
        study_scale.STUDY,  # the headline contrasts on an 11x larger model, 10 seeds: see study_scale.py
    )
}


def run_study(args: argparse.Namespace) -> int:
    """``lowcomm compare --study NAME``: the study's own command."""
    if args.study not in STUDIES:
        raise UsageError(f"unknown study {args.study!r}; choose from {', '.join(STUDIES)}")
    return STUDIES[args.study].run(args)
