"""lowcomm: compare the methods, train one, run the studies, profile a run, run the benchmarks,
simulate the methods at scale.

Exit codes: 0 success; 2 bad input (one line on stderr, no traceback); 1 a run failed.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .sim import command as simulate
from .train.args import add_tensorboard_flag
from .train.errors import UsageError
from .train.faults import add_fault_flags
from .train.spec import (
    INT_FIELDS,
    LAM_MODES,
    MERGES,
    METHODS,
    OUTER_DELAYS,
    PARAM_DTYPES,
    RANGES,
    SCORES,
    SPEED_MODELS,
    SPLITS,
    TAYLOR_CONTROLS,
    TIMINGS,
    WIRE_DTYPE_NAMES,
)


class _Parser(argparse.ArgumentParser):
    """Raises UsageError instead of printing usage and exiting; a bad flag value comes out of
    parse_args as an ArgumentError (exit_on_error=False) that main() words as '--flag message'."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, exit_on_error=False, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line instead of usage + message
        raise UsageError(f"{self.prog}: {message}")


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _in_range(field: str) -> Callable[[str], int | float]:
    """The type of a numeric TrainSpec knob's flag: the text parsed as the field is (int or float) and
    checked against the field's range, so an error names the flag and the value as typed, before any
    change of units."""
    parse = _integer if field in INT_FIELDS else _float
    allowed = RANGES[field]

    def check(text: str) -> int | float:
        value = parse(text)
        if not allowed.contains(value):
            raise argparse.ArgumentTypeError(f"{allowed.describe()}, got {text}")
        return value

    return check


def _syncs(text: str) -> str | int:
    return "auto" if text == "auto" else _positive_int(text)


def _speeds(text: str) -> tuple[float, ...]:
    values = tuple(_float(t) for t in text.split(",") if t.strip())
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"needs positive numbers separated by commas, got {text!r}")
    return values


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Knobs shared by `train`, `compare` and `profile`; None means 'the preset's value'."""

    def knob(group: Any, flag: str, field: str, help: str | None = None, same_units: bool = True) -> None:
        # a flag in other units than its field keeps its own dest (args.latency_ms for latency_s)
        group.add_argument(flag, type=_in_range(field), dest=field if same_units else None, help=help)

    g = p.add_argument_group("run")
    g.add_argument("--data", help="text file or folder of text files (default: the Python standard library)")
    knob(g, "--workers", "workers", "worker processes (default 4)")
    knob(g, "--steps", "steps", "inner steps per worker")
    knob(g, "--batch-size", "batch_size", "sequences per worker per step (default 8)")
    knob(g, "--seed", "seed", "seed (model init, data order, masks)")
    knob(g, "--eval-every", "eval_every", "steps between validation evaluations")
    knob(
        g,
        "--eval-bytes",
        "eval_bytes",
        "validation bytes scored per evaluation, in non-overlapping --seq-len windows spread evenly "
        "over the validation text (default 262144; all of it when shorter)",
    )
    knob(
        g,
        "--final-eval-bytes",
        "final_eval_bytes",
        "after the last step, one more evaluation on this many validation bytes, reported as the "
        "final loss (default 0: none, the last --eval-bytes evaluation is final)",
    )
    g.add_argument("--out", help="output folder (default runs/<command>-<UTC timestamp>)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument(
        "--oversubscribe",
        action="store_true",
        help="start --workers even beyond what this machine's cores and memory are estimated to hold",
    )
    m = p.add_argument_group("model")
    m.add_argument("--dim", type=_positive_int, help="model width (default 64)")
    m.add_argument("--layers", type=_positive_int, help="transformer blocks (default 4)")
    m.add_argument("--heads", type=_positive_int, help="attention heads (default 4)")
    m.add_argument("--mlp-hidden", type=_positive_int, help="SwiGLU hidden size (default 172)")
    m.add_argument("--seq-len", type=_positive_int, help="context length in bytes (default 64)")
    o = p.add_argument_group("optimisation and sync")
    knob(o, "--lr", "lr", "inner AdamW learning rate (default 3e-3)")
    knob(o, "--weight-decay", "weight_decay")
    knob(o, "--warmup", "warmup_steps", "linear warm-up steps")
    knob(o, "--sync-every", "sync_every", "H: inner steps between syncs of a fragment")
    knob(o, "--outer-lr", "outer_lr", "outer Nesterov learning rate (default 0.7)")
    knob(o, "--outer-momentum", "outer_momentum", "outer momentum (default 0.9)")
    knob(o, "--fragments", "num_fragments", "K fragments (default 4)")
    knob(o, "--delay", "fragment_sync_delay", "tau: overlap steps")
    knob(o, "--alpha", "fragment_update_alpha", "Streaming DiLoCo merge mix")
    knob(o, "--lam", "lam", "CoCoDC lambda (default 0.5)")
    o.add_argument("--lam-mode", choices=LAM_MODES)
    knob(o, "--gamma", "gamma", "CoCoDC link utilisation (default 0.4)")
    o.add_argument("--syncs-per-period", type=_syncs, help="CoCoDC N per H: 'auto' or an int")
    o.add_argument(
        "--score",
        choices=SCORES,
        help="CoCoDC fragment choice: l2_global (the paper's, |avg delta| / steps), l2_rms "
        "(|avg delta| / sqrt(steps x elements): no bias toward the fragment sent last when the "
        "pseudo-gradient is mostly noise), l1_local (the reference code's), round_robin",
    )
    o.add_argument(
        "--log-scores",
        action="store_true",
        default=None,
        help="CoCoDC: record every sync's pseudo-gradient norms and every choice's scores in the "
        "run's results (extra.score_log)",
    )
    o.add_argument(
        "--cocodc-timing",
        choices=TIMINGS,
        help="CoCoDC's adaptive N from the emulated link and --step-time-ms (default, reproducible) "
        "or from step and sync times measured at run time",
    )
    knob(o, "--step-time-ms", "step_time_ms", "CoCoDC's emulated inner step time (default 20)")
    o.add_argument(
        "--taylor-control",
        choices=TAYLOR_CONTROLS,
        help="CoCoDC control of the Taylor term: flip its sign, or a random direction of its norm",
    )
    knob(o, "--density", "density", "LOSCAR p: fraction of coordinates averaged")
    knob(o, "--local-steps", "local_steps", "LOSCAR steps before sending")
    knob(o, "--overlap-steps", "overlap_steps", "LOSCAR steps while in flight")
    o.add_argument("--merge", choices=MERGES, help="LOSCAR merge")
    o.add_argument(
        "--wire-dtype",
        choices=WIRE_DTYPE_NAMES,
        help="what a sync sends: fp32, bf16, codes + an fp32 scale per block (int8, int4, fp8, fp4), or "
        "topk: per chunk the k largest entries of the error-feedback-accumulated delta, all-gathered",
    )
    o.add_argument("--quant-block", type=_positive_int, help="values per scale, quantized wire (default 128)")
    o.add_argument("--topk-k", type=_positive_int, help="topk wire: entries sent per chunk (default 64)")
    o.add_argument("--topk-chunk", type=_positive_int, help="topk wire: values per chunk (default 4096)")
    o.add_argument("--topk-bits", type=int, choices=(1, 2, 4), help="topk wire: bits per value (default 2)")
    o.add_argument(
        "--ef-beta",
        type=float,
        help="topk wire: decay of the error-feedback buffer, in [0, 1] (default 0.95)",
    )
    o.add_argument(
        "--error-feedback",
        action="store_true",
        default=None,
        help="quantized wire: carry each worker's quantization error into its next sync",
    )
    # one or the other: given both, argparse's last-one-wins would silently drop one of them
    delay = o.add_mutually_exclusive_group()
    delay.add_argument(
        "--outer-delay",
        choices=OUTER_DELAYS,
        help="DiLoCo / Streaming DiLoCo: 'eager' sends at the round's end without waiting and steps with "
        "this worker's fresh outer gradient in place of its stale share of the last average; 'delayed' "
        "steps with the last average alone (the naive baseline); 'none' (default) blocks as the method does",
    )
    delay.add_argument(
        "--eager",
        dest="outer_delay",
        action="store_const",
        const="eager",
        help="short for --outer-delay eager",
    )
    o.add_argument(
        "--param-dtype",
        choices=tuple(PARAM_DTYPES),
        help="model parameters' dtype (bf16/fp16: fp32 outer master)",
    )
    o.add_argument("--worker-speeds", type=_speeds, help="relative step times, e.g. 1,2,3,6")
    o.add_argument(
        "--speed-model",
        choices=SPEED_MODELS,
        help="what --worker-speeds do: 'sleep' (default) stretches a slow worker's steps; 'steps' gives "
        "a c x slower LOSCAR worker floor(N/c) local steps per round (other methods cannot: their slow "
        "worker's steps are stretched and the others wait for it)",
    )
    g.add_argument(
        "--split",
        choices=SPLITS,
        help="training text per worker: 'contiguous' (default) slices of the sorted files, so each "
        "worker reads other files (non-iid); 'iid' interleaved 4 KiB blocks of the whole text",
    )
    w = p.add_argument_group("emulated WAN")
    knob(w, "--latency-ms", "latency_s", "one-way latency per collective (default 50)", same_units=False)
    knob(w, "--bandwidth-mbps", "bandwidth_bytes_per_s", "link bandwidth in Mbit/s (default 100)", False)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lowcomm", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    c = sub.add_parser("compare", help="train every method on the same task and compare (the main job)")
    c.add_argument(
        "--task",
        choices=("lm", "logreg", "mlp"),
        default="lm",
        help="lm: byte-level language model; logreg: LOSCAR's convex setting; mlp: a non-convex MLP "
        "on scikit-learn's bundled digits",
    )
    c.add_argument("--study", help="an open-question study: " + ", ".join(_study_names()))
    c.add_argument("--methods", default=",".join(METHODS), help="comma list of " + ", ".join(METHODS))
    c.add_argument("--quick", action="store_true", help="short runs (about 2 minutes)")
    c.add_argument("--seeds", type=_positive_int, help="seeds per configuration in a study (default 3)")
    c.add_argument(
        "--target", type=_float, help="target validation loss (default: lowest loss all runs reach)"
    )
    add_run_args(c)
    add_tensorboard_flag(c)
    add_fault_flags(c, baseline=True)
    t = sub.add_parser("train", help="train one method with every knob")
    t.add_argument("--method", required=True, choices=METHODS)
    t.add_argument("--target", type=_float, help="target validation loss for the table")
    add_run_args(t)
    add_tensorboard_flag(t)
    add_fault_flags(t, baseline=True)
    pr = sub.add_parser("profile", help="short 2-rank run under torch.profiler: Chrome trace + timeline PNG")
    pr.add_argument("--method", default="cocodc", choices=[m for m in METHODS])
    add_run_args(pr)
    add_fault_flags(pr, baseline=False)
    b = sub.add_parser("bench", help="run the microbenchmark suite in bench/ and render bench/RESULTS.md")
    b.add_argument("--bench-dir", help="folder of the benchmarks (default: bench/ of the source checkout)")
    b.add_argument("-k", dest="keyword", help="pytest -k expression to select benchmarks")
    b.add_argument("--out", help="folder for the benchmark JSON (default runs/bench-<timestamp>)")
    b.add_argument("--quick", action="store_true", help="smallest sizes only (a smoke run)")
    b.add_argument("--overlap", action="store_true", help="also run bench/bench_overlap.py (2 and 4 ranks)")
    r = sub.add_parser(
        "report", help="render the tables (and plots) of finished runs from their results.json files"
    )
    r.add_argument("paths", nargs="*", metavar="RUN", help="run folders or results.json files")
    r.add_argument("--out", help="write the markdown to this file (default: print it)")
    r.add_argument("--plot", action="store_true", help="also draw each run's plots beside --out")
    r.add_argument(
        "--headline",
        action="store_true",
        help="a study's few-line headline in place of its tables (frontier)",
    )
    r.add_argument(
        "--paper",
        metavar="NAME",
        help="a paper's findings beside ours from all the RUN files (streaming-diloco)",
    )
    r.add_argument(
        "--update-docs",
        action="store_true",
        help="re-render the marked regions (<!-- report: lowcomm report RUN... -->) of the RUN "
        "arguments taken as markdown files (default: README.md, docs/results.md and docs/simulator.md "
        "of the checkout)",
    )
    r.add_argument(
        "--check", action="store_true", help="with --update-docs: only report stale regions (exit 1)"
    )
    simulate.add_parser(sub)
    return p


def _study_names() -> list[str]:
    from .train.studies import STUDIES

    return list(STUDIES)


def main(argv: Sequence[str] | None = None) -> int:
    from .train import commands, provenance

    provenance.begin(None if argv is None else list(argv))  # results files record the command from here
    try:
        args = build_parser().parse_args(argv)
        if args.command == "simulate":  # numpy and the runtime's schedule rules only: no workers
            return simulate.run(args, provenance=provenance.collect)
        return commands.dispatch(args)
    except argparse.ArgumentError as exc:  # a flag's value: "--latency-ms must be >= 0, got -1"
        print(
            f"error: {exc.argument_name} {exc.message}" if exc.argument_name else f"error: {exc}",
            file=sys.stderr,
        )
        return 2
    except (UsageError, simulate.SimUsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
