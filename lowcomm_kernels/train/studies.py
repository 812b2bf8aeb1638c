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
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

from .report import RunResult, auto_target, mean_std, val_loss_basis
from .spec import RANGES, TrainSpec


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
    from ..runtime.schedule import WIRE_FORMATS

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


def loscar_regimes(base: TrainSpec) -> list[tuple[str, TrainSpec]]:
    from .study_loscar import configs  # on the digits MLP: see study_loscar.py

    return configs(base)


def cocodc_paper(base: TrainSpec) -> list[tuple[str, TrainSpec]]:
    from .study_cocodc import configs  # the paper's setup and the Taylor-term controls: see study_cocodc.py

    return configs(base)


STUDIES: dict[str, Callable[[TrainSpec], list[tuple[str, TrainSpec]]]] = {
    "matched": matched,
    "lambda": lam,
    "gamma": gamma,
    "overlap": overlap,
    "wire": wire,
    "loscar-regimes": loscar_regimes,
    "cocodc-paper": cocodc_paper,
}


def _cell(values: list, fmt: str = "{:.4f}") -> str:
    """'mean ± std' over the seeds' values that exist (None: the run never got there), or n/a."""
    m, s = mean_std([v for v in values if v is not None])
    return "n/a" if math.isnan(m) else f"{fmt.format(m)} ± {fmt.format(s)}"


def _table_head(target: float, columns: list[str], results: list[RunResult]) -> list[str]:
    """A study table's first lines: the target, then the header of configuration, seeds, final
    val loss (naming what it measures: report.val_loss_basis) and `columns`."""
    basis = val_loss_basis(results)
    head = ["configuration", "seeds", f"final val loss ({basis})", *columns]
    return [
        f"target validation loss ({basis}) {target:.4f} (the lowest loss every run reached)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]


def wire_table(labels: list[str], results: list[RunResult], target: float) -> str:
    """Markdown for the wire study: loss and bytes, against the fp32 configuration of each method."""
    lines = _table_head(
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
            f"| {label} | {len(runs)} | {_cell([r.final_loss for r in runs])} | "
            f"{_cell([h.bytes_sent / 1e6 if h else None for h in hits], '{:.3f}')} | "
            f"{_cell([b / 1e6 for b in sent], '{:.3f}')} | {ratio:.2f}x |"
        )
    return "\n".join(lines)


def wire_plot(labels: list[str], results: list[RunResult], path: Path) -> None:
    """Validation loss against bytes sent per worker, mean over seeds, one panel per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

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


def run_resumable(
    configs: list[tuple[str, list[TrainSpec]]],
    corpus: object,
    folder: Path,
    progress: bool,
    run: Callable[[list[TrainSpec]], list[RunResult]] | None = None,
) -> list[RunResult]:
    """Run each configuration's specs in one launch and save its results to ``folder`` at once; a
    configuration whose file holds results of exactly these specs is read back instead of run.
    ``run`` runs one configuration's specs (default: the LM task on ``corpus``). Each file also
    records the code that made it (``made_by``: git revision, uncommitted-changes digest, UTC time,
    load), so a study completed in several sittings says whether its parts ran the same code
    (:func:`sittings`); reusing a part made by other code prints a warning."""
    from .report import write_json
    from .runner import run_specs

    folder.mkdir(parents=True, exist_ok=True)
    results: list[RunResult] = []
    for i, (label, specs) in enumerate(configs):
        key = [json.dumps(dataclasses.asdict(s), sort_keys=True, default=str) for s in specs]
        path = folder / f"{i:03d}.json"
        if path.exists():
            saved = json.loads(path.read_text())
            if saved.get("specs") == key:
                results += [RunResult.from_dict(d) for d in saved["runs"]]
                print(f"reusing {label} ({len(specs)} runs) from {path}")
                then, now = _code_id(saved.get("made_by")), _code_id(_made_by())
                if then != now:
                    print(f"  warning: made by {_code_text(then)}; this checkout is {_code_text(now)}")
                continue
        made_by = _made_by()  # at launch: the workers import the code on disk now
        if run is None:
            done = run_specs(specs, corpus, progress=progress)  # type: ignore[arg-type]
        else:
            done = run(specs)
        doc = {"label": label, "specs": key, "made_by": made_by, "runs": [r.to_dict() for r in done]}
        after = _made_by()
        if _code_id(after) != _code_id(made_by):  # the checkout changed while the part ran
            doc["code_changed_during_run"] = after
            print(f"  warning: the checkout changed while {label} ran: {_code_text(_code_id(after))}")
        write_json(path, doc)
        results += done
    return results


def _made_by() -> dict:
    import datetime as dt
    import os

    from .provenance import git_info

    g = git_info()
    try:
        load = [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        load = None
    utc = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "revision": g["revision"],
        "dirty": g["dirty"],
        "diff_sha256": g["diff_sha256"],
        "utc": utc,
        "load": load,
    }


def _code_id(made_by: dict | None) -> tuple:
    """(revision, diff digest) of a part; (None, None) when not recorded (files of older versions)."""
    made_by = made_by or {}
    return (made_by.get("revision"), made_by.get("diff_sha256"))


def _code_text(code: tuple) -> str:
    rev, diff = code
    if rev is None:
        return "code not recorded"
    return f"revision {rev[:10]}" + (f" + uncommitted changes {diff[:10]}" if diff else "")


def sittings(folder: Path, parts: int | None = None) -> list[dict]:
    """The distinct codes that made the parts in ``folder`` (each: revision, diff_sha256, the part
    files it made, its first and last UTC time); more than one means the study mixes code versions.
    ``parts``: only the first ``parts`` files (000.json ...), the study's configurations, not files left
    by an earlier, longer list; a part whose checkout changed while it ran counts under both codes."""
    out: dict[tuple, dict] = {}
    paths = (
        sorted(folder.glob("*.json")) if parts is None else [folder / f"{i:03d}.json" for i in range(parts)]
    )
    for path in (p for p in paths if p.exists()):
        doc = json.loads(path.read_text())
        for made_by in filter(None, [doc.get("made_by", {}), doc.get("code_changed_during_run")]):
            _add_sitting(out, path.name, made_by)
        if "made_by" not in doc:
            _add_sitting(out, path.name, None)
    return list(out.values())


def _add_sitting(out: dict[tuple, dict], name: str, made_by: dict | None) -> None:
    code = _code_id(made_by)
    entry = out.setdefault(
        code, {"revision": code[0], "diff_sha256": code[1], "parts": [], "first_utc": None, "last_utc": None}
    )
    if name not in entry["parts"]:
        entry["parts"].append(name)
    utc = (made_by or {}).get("utc")
    if utc is not None:
        entry["first_utc"] = min(filter(None, [entry["first_utc"], utc]))
        entry["last_utc"] = max(filter(None, [entry["last_utc"], utc]))


def study_table(name: str, labels: list[str], results: list[RunResult], target: float) -> str:
    """Markdown: per configuration, mean +- std over seeds of the headline numbers."""
    lines = _table_head(
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
                    _cell([r.final_loss for r in runs]),
                    _cell([h.step if h else None for h in hits], "{:.0f}"),
                    _cell([h.wall_s if h else None for h in hits], "{:.1f}"),
                    _cell([float(r.syncs) for r in runs], "{:.0f}"),
                    _cell([r.bytes_sent / 1e6 for r in runs], "{:.2f}"),
                    _cell([r.exposed_s for r in runs], "{:.2f}"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def study_plot(name: str, labels: list[str], results: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    many = len(labels) > 8  # then: legend beside the axes, fainter bands, a line style per 10 colours
    fig, ax = plt.subplots(figsize=(10.5, 4.8) if many else (7, 4.4))
    for i, label in enumerate(labels):
        runs = [r for r in results if r.name == label and r.points]
        if not runs:
            continue
        n = min(len(r.points) for r in runs)
        steps = [p.step for p in runs[0].points[:n]]
        losses = np.array([[p.val_loss for p in r.points[:n]] for r in runs])
        m, s = losses.mean(0), losses.std(0, ddof=1) if len(runs) > 1 else np.zeros(n)
        style = ("-", "--", ":")[(i // 10) % 3]  # the default cycle has 10 colours
        (line,) = ax.plot(steps[1:], m[1:], style, label=label)  # skip step 0 (initial loss ~5.5) for scale
        band = 0.06 if many else 0.15
        ax.fill_between(steps[1:], (m - s)[1:], (m + s)[1:], color=line.get_color(), alpha=band)
    # Zoom on the second half of the run, where the configurations separate (full curves: results.json).
    late = [p.val_loss for r in results for p in r.points if p.step >= r.points[-1].step // 2]
    if late:
        lo, hi = min(late), max(late)
        ax.set_ylim(lo - 0.1 * (hi - lo), hi + 0.1 * (hi - lo))
        ax.set_xlim(results[0].points[-1].step // 2, results[0].points[-1].step)
    ax.set_xlabel("inner steps")
    ax.set_ylabel("validation loss (nats/byte), mean ± std")
    ax.set_title(f"study: {name}")
    ax.grid(alpha=0.3)
    if many:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def study_header(study: str, base: dict, seeds: int, corpus: str) -> str:
    """The line above a study's table. ``base``: the study's base TrainSpec as a dict (results.json
    stores it under "base")."""
    mc = base["model"]
    return (
        f"study `{study}`: {base['workers']} workers, {base['steps']} steps, H={base['sync_every']}, "
        f"K={base['num_fragments']}, tau={base['fragment_sync_delay']}, {seeds} seeds, model dim={mc['dim']} "
        f"layers={mc['n_layers']} seq_len={mc['seq_len']}, quant_block={base['quant_block']}; {corpus}"
    )


def run_study(args: argparse.Namespace) -> int:
    from ..runtime.launch import WorkerError
    from .args import out_dir, spec_from_args, usage_error
    from .commands import load_checked_corpus
    from .errors import SpecError, UsageError
    from .presets import LM, STUDY_SEEDS
    from .provenance import collect
    from .report import write_json
    from .runner import report_failure

    if args.study not in STUDIES:
        raise UsageError(f"unknown study {args.study!r}; choose from {', '.join(STUDIES)}")
    if args.study == "loscar-regimes":
        from .study_loscar import run_loscar_regimes

        return run_loscar_regimes(args)
    if args.study == "cocodc-paper":
        from .study_cocodc import run_cocodc_paper

        return run_cocodc_paper(args)
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
        configs = STUDIES[args.study](base)
        specs = [spec.with_(name=label, seed=base.seed + s) for label, spec in configs for s in range(seeds)]
    except SpecError as exc:
        raise usage_error(exc) from None
    labels = [label for label, _ in configs]
    corpus = load_checked_corpus(args.data, specs)
    out = out_dir(args, f"study-{args.study}")
    t0 = time.perf_counter()
    groups = [(label, [s for s in specs if s.name == label]) for label in labels]
    try:
        results = run_resumable(groups, corpus, out / "runs", progress=not args.no_progress)
    except WorkerError as exc:
        return report_failure(exc, out, "study")
    target = args.target if args.target is not None else auto_target(results)
    if args.study == "wire":
        table = wire_table(labels, results, target)
        wire_plot(labels, results, out / "wire_bytes.png")
    else:
        table = study_table(args.study, labels, results, target)
    cmd = (
        f"lowcomm compare --study {args.study}"
        + (" --quick" if args.quick else "")
        + (f" --seeds {args.seeds}" if args.seeds else "")
    )
    header = study_header(args.study, dataclasses.asdict(base), seeds, corpus.describe())
    (out / f"{args.study}.md").write_text(f"# {header}\n\nCommand: `{cmd}`\n\n{table}\n")
    study_plot(args.study, labels, results, out / f"{args.study}.png")
    write_json(
        out / "results.json",
        {
            "study": args.study,
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
        f"\nwrote {out / (args.study + '.md')}, {out / (args.study + '.png')}, {out / 'results.json'} "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    return 0
