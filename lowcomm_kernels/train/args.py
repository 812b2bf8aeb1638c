"""From the command line's arguments to what a command runs: TrainSpecs, methods, the output folder.

``cli.py`` builds the parser and dispatches; the commands call these. Every problem is a
:class:`UsageError` worded in the flags the user typed (the CLI prints it as one line, exit code 2),
raised before any worker starts.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import tempfile
from pathlib import Path

from . import provenance
from .errors import SpecError, UsageError
from .model import ModelConfig, parameter_count
from .spec import METHODS, TrainSpec

# TrainSpec fields set by a flag of the same name (its dest); the model's and the WAN's are below.
_SPEC_FIELDS = (
    "workers steps batch_size seed eval_every eval_bytes final_eval_bytes lr weight_decay warmup_steps "
    "sync_every outer_lr outer_momentum num_fragments fragment_sync_delay fragment_update_alpha lam "
    "lam_mode gamma "
    "syncs_per_period quant_block error_feedback cocodc_timing step_time_ms taylor_control "
    "score density local_steps overlap_steps merge wire_dtype param_dtype worker_speeds speed_model split "
    "outer_delay topk_k topk_chunk topk_bits ef_beta log_scores"
).split()


# The flag of each TrainSpec / ModelConfig field, for errors (SpecError.render) in the user's words.
FLAGS: dict[str, str] = {
    **{name: "--" + name.replace("_", "-") for name in _SPEC_FIELDS},
    "warmup_steps": "--warmup",
    "num_fragments": "--fragments",
    "fragment_sync_delay": "--delay",
    "fragment_update_alpha": "--alpha",
    "latency_s": "--latency-ms",
    "bandwidth_bytes_per_s": "--bandwidth-mbps",
    "ModelConfig.dim": "--dim",
    "ModelConfig.n_layers": "--layers",
    "ModelConfig.n_heads": "--heads",
    "ModelConfig.mlp_hidden": "--mlp-hidden",
    "ModelConfig.seq_len": "--seq-len",
}


def usage_error(exc: SpecError) -> UsageError:
    """The spec's error with the flags in place of the field names."""
    return UsageError(exc.render(FLAGS))


def spec_from_args(args: argparse.Namespace, method: str, preset: dict | None = None) -> TrainSpec:
    """A validated TrainSpec: dataclass defaults < preset < explicit command-line values.
    Raises :class:`UsageError` naming the flags of the bad knobs."""
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
    try:
        values["model"] = ModelConfig(**model_kw)
        values["data"] = getattr(args, "data", None)
        spec = TrainSpec(method=method, **values)
    except SpecError as exc:
        raise usage_error(exc) from None
    # params, grads, two Adam moments, g, u, a snapshot and the wire payload, in fp32
    check_workers(args, spec.workers, 8 * 4 * parameter_count(spec.model))
    return spec


#: worker processes per usable core beyond which a run is refused: each runs one thread, so 8 per
#: core already make every step 8x slower, and thousands exhaust memory long before they start
WORKERS_PER_CORE = 8
#: memory of one worker before its model: torch and this package imported, a gloo group (a worker
#: holds 270 MB resident on the 2-core development machine, part of it shared libraries)
WORKER_BASE_BYTES = 200 * 2**20


def check_workers(args: argparse.Namespace, workers: int, model_bytes: int = 0) -> None:
    """A UsageError naming --workers, before any spawn, when this machine cannot hold ``workers``
    processes: more than WORKERS_PER_CORE per usable core, or more memory than is available
    (WORKER_BASE_BYTES + ``model_bytes`` each, a lower estimate). --oversubscribe starts them anyway."""
    if getattr(args, "oversubscribe", False):
        return
    cores = provenance.usable_cores() or os.cpu_count() or 1
    avail = provenance.available_memory_bytes()
    each = WORKER_BASE_BYTES + model_bytes
    most = WORKERS_PER_CORE * cores
    if avail is not None:
        most = min(most, max(1, avail // each))
    if workers > most:
        memory = "" if avail is None else f" and {avail / 2**30:.1f} GiB of available memory"
        raise UsageError(
            f"--workers {workers}: this machine has {cores} usable cores{memory}, enough for at most "
            f"{most} worker processes ({WORKERS_PER_CORE} per core, about {each / 2**20:.0f} MiB each); "
            "use fewer, or --oversubscribe to start them anyway"
        )


def out_dir(args: argparse.Namespace, command: str) -> Path:
    """The output folder, created; a UsageError naming --out when it cannot be a writable folder
    (an existing file, a read-only place), so that bad input fails before any worker starts."""
    if args.out is not None:
        if not args.out.strip():
            raise UsageError(f"--out needs a folder, got {args.out!r}")
        path, name = Path(args.out), f"--out {args.out}"
    else:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{command}-{stamp}"
        name = f"output folder {path} (choose another with --out)"
    if path.exists() and not path.is_dir():
        raise UsageError(f"{name} is an existing file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{name}: cannot create the folder ({exc.strerror or exc})") from None
    try:  # a file, since permission bits tell root nothing (a read-only mount, /proc)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".lowcomm-write-check-"):
            pass
    except OSError as exc:
        raise UsageError(f"{name}: cannot write files in the folder ({exc.strerror or exc})") from None
    return path


def add_tensorboard_flag(p: argparse.ArgumentParser) -> None:
    """``--tensorboard DIR`` (train, compare): rank 0 of each run writes event files to DIR/<method>."""
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="write TensorBoard event files (rank 0's training loss per step, validation loss, "
        "sync records) into DIR/<method>; needs the tensorboard extra",
    )


def with_tensorboard(args: argparse.Namespace, specs: list[TrainSpec]) -> list[TrainSpec]:
    """``specs`` with ``tensorboard_dir`` = DIR/<method> when --tensorboard DIR is given (each spec
    must be a different method), the folders created. A UsageError, before any worker starts, when
    DIR cannot be a writable folder or a run's subfolder already holds event files (the curves of
    two runs would mix). Whether tensorboard is installed is checked first (``extras``)."""
    text = getattr(args, "tensorboard", None)
    if text is None:
        return specs
    if not text.strip():
        raise UsageError(f"--tensorboard needs a folder, got {text!r}")
    methods = [s.method for s in specs]
    if len(set(methods)) != len(methods):
        raise UsageError(f"--tensorboard writes one folder per method; these runs repeat one: {methods}")
    root = Path(text)
    if root.exists() and not root.is_dir():
        raise UsageError(f"--tensorboard {text} is an existing file, not a folder")
    for spec in specs:
        run = root / spec.method
        if run.is_dir() and any(run.glob("*tfevents*")):
            raise UsageError(
                f"--tensorboard {text}: {run} already holds TensorBoard event files of an earlier run; "
                "choose another folder"
            )
    out = []
    for spec in specs:
        run = root / spec.method
        try:
            run.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=run, prefix=".lowcomm-write-check-"):
                pass
        except OSError as exc:
            raise UsageError(
                f"--tensorboard {text}: cannot write into {run} ({exc.strerror or exc})"
            ) from None
        out.append(spec.with_(tensorboard_dir=str(run)))
    return out


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise UsageError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    if not methods:
        raise UsageError("--methods needs at least one method")
    return methods
