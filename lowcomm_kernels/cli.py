"""lowcomm: compare the methods, train one, run the studies, profile a run, run the benchmarks.

Exit codes: 0 success; 2 bad input (one line on stderr, no traceback); 1 a run failed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from .train.errors import UsageError  # noqa: E402  (re-exported for callers)
from .train.spec import LAM_MODES, MERGES, METHODS, SCORES, WIRE_DTYPES


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of usage + message
        raise UsageError(f"{self.prog}: {message}")


# Defaults of the LM comparison; `--quick` swaps in the second set. Measured on the 2-core dev
# machine at load ~5 (README_main_job.md): default 5 min 42 s for the five methods, quick 1 min 34 s.
PRESETS = {
    "default": dict(steps=600, sync_every=50, fragment_sync_delay=5, eval_every=50, eval_batches=8),
    "quick": dict(steps=120, sync_every=20, fragment_sync_delay=3, eval_every=20, eval_batches=4),
}


def _int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _syncs(text: str) -> str | int:
    return "auto" if text == "auto" else _positive_int(text)


def _speeds(text: str) -> tuple[float, ...]:
    return tuple(_float(t) for t in text.split(",") if t.strip())


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Knobs shared by `train`, `compare` and `profile`; None means 'the preset's value'."""
    g = p.add_argument_group("run")
    g.add_argument("--data", help="text file or folder of text files (default: the Python standard library)")
    g.add_argument("--workers", type=_positive_int, default=None, help="worker processes (default 4)")
    g.add_argument("--steps", type=_positive_int, help="inner steps per worker")
    g.add_argument("--batch-size", type=_positive_int, help="sequences per worker per step (default 8)")
    g.add_argument("--seed", type=_int, default=None, help="seed (model init, data order, masks)")
    g.add_argument("--eval-every", type=_positive_int, help="steps between validation evaluations")
    g.add_argument("--eval-batches", type=_positive_int, help="validation batches per evaluation")
    g.add_argument("--out", help="output folder (default runs/<command>-<UTC timestamp>)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    m = p.add_argument_group("model")
    m.add_argument("--dim", type=_positive_int, help="model width (default 64)")
    m.add_argument("--layers", type=_positive_int, help="transformer blocks (default 4)")
    m.add_argument("--heads", type=_positive_int, help="attention heads (default 4)")
    m.add_argument("--mlp-hidden", type=_positive_int, help="SwiGLU hidden size (default 172)")
    m.add_argument("--seq-len", type=_positive_int, help="context length in bytes (default 64)")
    o = p.add_argument_group("optimisation and sync")
    o.add_argument("--lr", type=_float, help="inner AdamW learning rate (default 3e-3)")
    o.add_argument("--weight-decay", type=_float)
    o.add_argument("--warmup", type=_int, dest="warmup_steps", help="linear warm-up steps")
    o.add_argument("--sync-every", type=_positive_int, help="H: inner steps between syncs of a fragment")
    o.add_argument("--outer-lr", type=_float, help="outer Nesterov learning rate (default 0.7)")
    o.add_argument("--outer-momentum", type=_float, help="outer momentum (default 0.9)")
    o.add_argument("--fragments", type=_positive_int, dest="num_fragments", help="K fragments (default 4)")
    o.add_argument("--delay", type=_int, dest="fragment_sync_delay", help="tau: overlap steps")
    o.add_argument("--alpha", type=_float, dest="fragment_update_alpha", help="Streaming DiLoCo merge mix")
    o.add_argument("--lam", type=_float, help="CoCoDC lambda (default 0.5)")
    o.add_argument("--lam-mode", choices=LAM_MODES)
    o.add_argument("--gamma", type=_float, help="CoCoDC link utilisation (default 0.4)")
    o.add_argument("--syncs-per-period", type=_syncs, help="CoCoDC N per H: 'auto' or an int")
    o.add_argument("--score", choices=SCORES, help="CoCoDC fragment choice")
    o.add_argument("--density", type=_float, help="LOSCAR p: fraction of coordinates averaged")
    o.add_argument("--local-steps", type=_positive_int, help="LOSCAR steps before sending")
    o.add_argument("--overlap-steps", type=_int, help="LOSCAR steps while in flight")
    o.add_argument("--merge", choices=MERGES, help="LOSCAR merge")
    o.add_argument("--wire-dtype", choices=WIRE_DTYPES)
    o.add_argument("--worker-speeds", type=_speeds, help="relative step times, e.g. 1,2,3,6")
    w = p.add_argument_group("emulated WAN")
    w.add_argument("--latency-ms", type=_float, help="one-way latency per collective (default 50)")
    w.add_argument("--bandwidth-mbps", type=_float, help="link bandwidth in Mbit/s (default 100)")


_SPEC_FIELDS = (
    "workers steps batch_size seed eval_every eval_batches lr weight_decay warmup_steps sync_every outer_lr "
    "outer_momentum num_fragments fragment_sync_delay fragment_update_alpha lam lam_mode gamma "
    "syncs_per_period "
    "score density local_steps overlap_steps merge wire_dtype worker_speeds"
).split()


def spec_from_args(args: argparse.Namespace, method: str, preset: dict | None = None):
    """A validated TrainSpec: dataclass defaults < preset < explicit command-line values."""
    from .train.model import ModelConfig
    from .train.spec import TrainSpec

    values: dict = dict(preset or {})
    for name in _SPEC_FIELDS:
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    if getattr(args, "latency_ms", None) is not None:
        values["latency_s"] = args.latency_ms / 1e3
    if getattr(args, "bandwidth_mbps", None) is not None:
        values["bandwidth_bytes_per_s"] = args.bandwidth_mbps * 1e6 / 8
    model_kw = {
        k: getattr(args, a)
        for k, a in (
            ("dim", "dim"),
            ("n_layers", "layers"),
            ("n_heads", "heads"),
            ("mlp_hidden", "mlp_hidden"),
            ("seq_len", "seq_len"),
        )
        if getattr(args, a, None) is not None
    }
    values["model"] = ModelConfig(**model_kw)
    values["data"] = getattr(args, "data", None)
    return TrainSpec(method=method, **values)


def out_dir(args: argparse.Namespace, command: str) -> Path:
    if args.out:
        path = Path(args.out)
    else:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{command}-{stamp}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise UsageError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    if not methods:
        raise UsageError("--methods needs at least one method")
    return methods


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lowcomm", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    c = sub.add_parser("compare", help="train every method on the same task and compare (the main job)")
    c.add_argument("--task", choices=("lm", "logreg"), default="lm")
    c.add_argument("--study", help="an open-question study: " + ", ".join(_study_names()))
    c.add_argument("--methods", default=",".join(METHODS), help="comma list of " + ", ".join(METHODS))
    c.add_argument("--quick", action="store_true", help="short runs (about 2 minutes)")
    c.add_argument("--seeds", type=_positive_int, help="seeds per configuration in a study (default 3)")
    c.add_argument(
        "--target", type=_float, help="target validation loss (default: lowest loss all runs reach)"
    )
    add_run_args(c)
    t = sub.add_parser("train", help="train one method with every knob")
    t.add_argument("--method", required=True, choices=METHODS)
    t.add_argument("--target", type=_float, help="target validation loss for the table")
    add_run_args(t)
    pr = sub.add_parser("profile", help="short 2-rank run under torch.profiler: Chrome trace + timeline PNG")
    pr.add_argument("--method", default="cocodc", choices=[m for m in METHODS])
    add_run_args(pr)
    b = sub.add_parser("bench", help="run the microbenchmark suite in bench/ and render bench/RESULTS.md")
    b.add_argument("--bench-dir", help="folder of the benchmarks (default: bench/ of the source checkout)")
    b.add_argument("-k", dest="keyword", help="pytest -k expression to select benchmarks")
    b.add_argument("--out", help="folder for the benchmark JSON (default runs/bench-<timestamp>)")
    b.add_argument("--quick", action="store_true", help="smallest sizes only (a smoke run)")
    b.add_argument("--overlap", action="store_true", help="also run bench/bench_overlap.py (2 and 4 ranks)")
    return p


def _study_names() -> list[str]:
    from .train.studies import STUDIES

    return list(STUDIES)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        from .train import commands

        return commands.dispatch(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    # Run the package's own module object, not this __main__ copy, so there is one set of globals.
    from lowcomm_kernels.cli import main as _main

    sys.exit(_main())
