"""The byte-level language-model task (``--task lm``, the default): the corpus checked against the
specs before any spawn, the specs from the flags, and the runs launched through ``train.runner`` (each
rank runs ``train.worker`` on ``train.model``'s TinyLlama) with their table, results.json and plots."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ...runtime.launch import WorkerError
from .. import presets, provenance
from ..args import out_dir, parse_methods, spec_from_args, with_tensorboard
from ..corpus import Corpus, CorpusError, load_corpus, worker_shard
from ..errors import UsageError
from ..report import RunResult, auto_target, comparison_rows, format_table, plot_curves, write_json
from ..runner import report_failure, run_specs
from ..spec import TrainSpec


def load_checked_corpus(data: str | None, specs: list[TrainSpec]) -> Corpus:
    """The corpus of --data; UsageError when it is missing or too short for the specs' windows (each
    worker samples --seq-len + 1 bytes from its share of the training text), before any spawn."""
    if data is not None and not data.strip():
        raise UsageError(f"--data needs a file or folder, got {data!r}")
    try:
        corpus = load_corpus(data)
    except CorpusError as exc:
        raise UsageError(str(exc)) from None
    for spec in specs:
        try:  # the iid split deals whole blocks: a short text may leave a worker none
            share = worker_shard(corpus.train, 0, spec.workers, spec.split).numel()
        except CorpusError as exc:
            raise UsageError(f"--split {spec.split}: {exc}") from None
        window = spec.model.seq_len + 1
        if share <= window:
            raise UsageError(
                f"--seq-len {spec.model.seq_len} needs more than {window} bytes of training text per "
                f"worker; {corpus.source} gives {share} with --workers {spec.workers}"
            )
        if corpus.val.numel() <= window:
            raise UsageError(
                f"--seq-len {spec.model.seq_len} needs more than {window} bytes of validation text; "
                f"{corpus.source} gives {corpus.val.numel()}"
            )
    return corpus


def build_specs(args: argparse.Namespace, methods: list[str], preset: dict | None) -> list[TrainSpec]:
    return [spec_from_args(args, m, preset) for m in methods]  # UsageError naming the flags


def run_and_report(
    specs: list[TrainSpec], corpus: Corpus, out: Path, *, target: float | None, progress: bool, title: str
) -> tuple[list[RunResult], float]:
    """Launch, then write results.json, table.md and the three plots into ``out``; print the table."""
    t0 = time.perf_counter()
    try:
        results = run_specs(specs, corpus, progress=progress)
    except WorkerError as exc:
        raise SystemExit(report_failure(exc, out)) from None
    elapsed = time.perf_counter() - t0
    tgt = target if target is not None else auto_target(results)
    table = format_table(results, tgt)
    write_json(
        out / "results.json",
        {
            "title": title,
            "corpus": corpus.describe(),
            "target_val_loss": tgt,
            "rows": comparison_rows(results, tgt),
            "runs": [r.to_dict() for r in results],
            "elapsed_s": elapsed,
            "provenance": provenance.collect(),
        },
    )
    (out / "table.md").write_text(f"# {title}\n\n{corpus.describe()}\n\n{table}\n")
    plots = plot_curves(results, out, tgt)
    print(f"\n{title} — {corpus.describe()}\n")
    print(table)
    print(
        f"\nwall-clock of the whole command: {elapsed:.0f} s; "
        f"wrote {out / 'results.json'}, {out / 'table.md'}, " + ", ".join(p.name for p in plots)
    )
    tb = sorted({str(Path(s.tensorboard_dir).parent) for s in specs if s.tensorboard_dir is not None})
    if tb:
        print(f"TensorBoard event files (rank 0 of each run): tensorboard --logdir {tb[0]}")
    return results, tgt


def run_lm_compare(args: argparse.Namespace) -> int:
    """``lowcomm compare`` on the LM task: every ``--methods`` method, one seed."""
    methods = parse_methods(args.methods)
    specs = build_specs(args, methods, presets.LM["quick" if args.quick else "default"])
    corpus = load_checked_corpus(args.data, specs)
    out = out_dir(args, "compare")
    specs = with_tensorboard(args, specs)
    quick = " --quick" if args.quick else ""
    title = f"lowcomm compare{quick}: {specs[0].workers} workers, {specs[0].steps} steps"
    run_and_report(specs, corpus, out, target=args.target, progress=not args.no_progress, title=title)
    return 0


def run_lm_train(args: argparse.Namespace) -> int:
    """``lowcomm train --method M`` on the LM task."""
    specs = build_specs(args, [args.method], presets.LM["default"])
    corpus = load_checked_corpus(args.data, specs)
    out = out_dir(args, f"train-{args.method}")
    specs = with_tensorboard(args, specs)
    title = f"lowcomm train --method {args.method}: {specs[0].workers} workers, {specs[0].steps} steps"
    run_and_report(specs, corpus, out, target=args.target, progress=not args.no_progress, title=title)
    return 0
