"""Results of training runs: the comparison table, JSON and plots.

A run records one :class:`EvalPoint` per evaluation. Everything in the table is derived from these
points, so the JSON holds all a reader needs to recompute it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import reprlib
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: what a run's headline validation loss (``EvalPoint.val_loss``, the final loss, the target) measures
WORKER_MEAN = "worker models, mean"
#: the same for results.json files written before each worker's own model was evaluated
AVERAGED_MODEL = "averaged model"
#: the averaging all-reduce behind ``val_loss_avg_model``, as the table's footnote names it
AVERAGING_NOTE = (
    "the workers' parameters averaged by one all-reduce on a separate process group, not counted in "
    "bytes sent or exposed comm; no worker holds this model unless all of them just synced every "
    "parameter (LOSCAR's workers never do)"
)


@dataclass
class EvalPoint:
    """State of a run after ``step`` inner steps.

    wall_s: training wall-clock since the first step (evaluation time excluded).
    bytes_sent: payload bytes this worker has put on the (emulated) WAN so far (rank 0's count).
    exposed_s: seconds rank 0 spent blocked waiting for communication so far.
    val_loss: the headline, mean next-byte cross-entropy (nats) on the fixed validation windows:
    the mean over workers of ``val_loss_workers`` (in results.json written before those were
    measured: the averaged model's loss; ``RunResult.val_loss_basis`` says which).
    val_loss_workers: each worker's own model's loss, in rank order (empty in older files).
    val_loss_avg_model: the loss of the worker-averaged parameters (see :data:`AVERAGING_NOTE`).
    workers_agree: every worker held bit-identical parameters, so one evaluation served all (then
    every value above is the same number); None in older files.
    """

    step: int
    wall_s: float
    bytes_sent: float
    exposed_s: float
    val_loss: float
    val_loss_workers: list[float] = field(default_factory=list)
    val_loss_avg_model: float | None = None
    workers_agree: bool | None = None

    @property
    def val_loss_workers_min(self) -> float | None:
        return min(self.val_loss_workers) if self.val_loss_workers else None

    @property
    def val_loss_workers_max(self) -> float | None:
        return max(self.val_loss_workers) if self.val_loss_workers else None


@dataclass
class RunResult:
    name: str
    method: str
    config: dict
    points: list[EvalPoint] = field(default_factory=list)
    train_wall_s: float = 0.0
    bytes_sent: float = 0.0
    exposed_s: float = 0.0
    syncs: int = 0
    num_params: int = 0
    extra: dict = field(default_factory=dict)
    val_loss_basis: str = WORKER_MEAN  # what EvalPoint.val_loss measures: WORKER_MEAN or AVERAGED_MODEL
    eval_bytes_scored: int = 0  # target bytes per evaluation (0: not recorded, older files)
    # the evaluation after the last step on TrainSpec.final_eval_bytes (None: none was asked for):
    # eval_bytes_scored, val_loss (the same basis as the points'), val_loss_workers, val_loss_avg_model
    final_eval: dict | None = None
    # where the validation windows lie: "spread" evenly over the text (corpus.EvalSet), or "start":
    # the text's first bytes, as files made before the windows were spread say (read as such)
    eval_windows: str = "spread"

    @property
    def final_loss(self) -> float:
        """The final evaluation's loss when there was one, else the last point's."""
        if self.final_eval is not None:
            return float(self.final_eval["val_loss"])
        return self.points[-1].val_loss if self.points else math.nan

    @property
    def best_loss(self) -> float:
        return min((p.val_loss for p in self.points), default=math.nan)

    def first_reaching(self, target: float) -> EvalPoint | None:
        """First evaluation with val_loss <= target (None if never reached)."""
        return next((p for p in self.points if p.val_loss <= target), None)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["final_loss"] = self.final_loss
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RunResult:
        """Inverse of :meth:`to_dict`; also reads results.json written before per-worker evaluation
        (points with only ``val_loss``, which was then the averaged model's loss)."""
        d = dict(d)
        d.pop("final_loss", None)
        # the windows were spread over the text in the same change that added final_eval: a file
        # with final_eval but no eval_windows used spread windows, one without either the start
        d.setdefault("eval_windows", "spread" if "final_eval" in d else "start")
        points = [dict(p) for p in d.get("points", [])]
        legacy = "val_loss_basis" not in d
        if legacy:
            d["val_loss_basis"] = AVERAGED_MODEL
            for p in points:
                p.setdefault("val_loss_avg_model", p.get("val_loss"))
        _check_types(cls, d)
        for i, p in enumerate(points):
            _check_types(EvalPoint, p, f"points[{i}].")
        final = d.get("final_eval")
        if final is not None and not (
            _IS["int"](final.get("eval_bytes_scored")) and _IS["float"](final.get("val_loss"))
        ):
            raise TypeError(
                f"final_eval should hold eval_bytes_scored (int) and val_loss, got {_short(final)}"
            )
        d["points"] = [EvalPoint(**p) for p in points]
        return cls(**d)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: what each annotation of EvalPoint's and RunResult's fields admits in a results.json read back
_IS = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": _number,
    "dict": lambda v: isinstance(v, dict),
    "list[EvalPoint]": lambda v: isinstance(v, list),  # each point is checked on its own
    "list[float]": lambda v: isinstance(v, list) and all(_number(x) for x in v),
    "float | None": lambda v: v is None or _number(v),
    "bool | None": lambda v: v is None or isinstance(v, bool),
    "dict | None": lambda v: v is None or isinstance(v, dict),
}


def _short(v: object) -> str:
    return reprlib.repr(v)


def _check_types(cls: type, d: dict, where: str = "") -> None:
    """TypeError naming the first field of ``cls`` in ``d`` whose value is not of its annotated type:
    a malformed results.json is refused by name, never rendered into a table."""
    for f in dataclasses.fields(cls):
        if f.name in d and not _IS[str(f.type)](d[f.name]):
            raise TypeError(f"{where}{f.name} should be {f.type}, got {_short(d[f.name])}")


def auto_target(results: list[RunResult]) -> float:
    """The lowest validation loss that every run reached: max over runs of each run's best loss.

    With this target every method has a finite 'steps to target', and the method that got there
    first is the one that learns fastest up to the level the slowest method attains.
    """
    losses = [r.best_loss for r in results if r.points]
    return max(losses) if losses else math.nan


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def val_loss_basis(results: list[RunResult]) -> str:
    """What the headline loss of ``results`` measures (one basis, or a note that they differ)."""
    bases = sorted({r.val_loss_basis for r in results})
    return bases[0] if len(bases) == 1 else "differs between runs: " + ", ".join(bases)


def comparison_rows(results: list[RunResult], target: float) -> list[dict]:
    """One dict per run with the table's fields (numbers, not strings)."""
    rows = []
    for r in results:
        hit = r.first_reaching(target)
        last = r.points[-1] if r.points else None
        fin = r.final_eval
        workers = list(fin["val_loss_workers"]) if fin else list(last.val_loss_workers) if last else []
        rows.append(
            {
                "method": r.name,
                "val_loss_basis": r.val_loss_basis,
                "steps_to_target": hit.step if hit else None,
                "wall_to_target_s": hit.wall_s if hit else None,
                "bytes_to_target": hit.bytes_sent if hit else None,
                "final_val_loss": r.final_loss,
                "final_val_loss_workers": workers,
                "final_val_loss_workers_min": min(workers) if workers else None,
                "final_val_loss_workers_max": max(workers) if workers else None,
                "final_val_loss_avg_model": fin["val_loss_avg_model"]
                if fin
                else last.val_loss_avg_model
                if last
                else None,
                "final_val_ppl": math.exp(r.final_loss) if math.isfinite(r.final_loss) else math.nan,
                "wall_clock_s": r.train_wall_s,
                "bytes_sent_per_worker": r.bytes_sent,
                "exposed_comm_s": r.exposed_s,
                "exposed_comm_frac": r.exposed_s / r.train_wall_s if r.train_wall_s > 0 else 0.0,
                "syncs": r.syncs,
                "syncs_per_period": r.extra.get("syncs_per_period"),  # CoCoDC: N of each period
                "eval_bytes_scored": r.eval_bytes_scored,
                "final_eval_bytes_scored": fin["eval_bytes_scored"] if fin else r.eval_bytes_scored,
            }
        )
    return rows


def table_header(basis: str = WORKER_MEAN) -> tuple[str, ...]:
    """The comparison table's column names; the headline loss column names its ``basis``."""
    return (
        "method",
        "steps to target",
        "wall to target",
        "bytes to target",
        f"final val loss ({basis})",
        "worker min / max",
        "averaged model*",
        "final ppl",
        "wall-clock",
        "bytes sent/worker",
        "exposed comm",
        "syncs",
    )


TABLE_HEADER = table_header()


def _opt(value: float | None, fmt: str) -> str:
    return "not reached" if value is None else fmt.format(value)


def _loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _n_per_period(history: list[int] | None) -> str:
    """CoCoDC's N per period, run-length encoded: ' (N: 4x1, 8x19)'; '' for other methods."""
    if not history:
        return ""
    runs: list[list[int]] = []
    for n in history:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return " (N: " + ", ".join(f"{n}x{c}" for n, c in runs) + ")"


def format_table(results: list[RunResult], target: float) -> str:
    """Markdown table (also readable as plain text in a terminal), its footnote below it."""
    basis = val_loss_basis(results)
    header = table_header(basis)
    scored = sorted({r.eval_bytes_scored for r in results if r.eval_bytes_scored})
    scored_text = (
        "validation: " + " / ".join(f"{n:,}" for n in scored) + " bytes scored per evaluation; "
        if scored
        else ""
    )
    if any(r.eval_windows == "start" for r in results):
        scored_text += (
            "windows from the start of the validation text (a file made before they were spread over it); "
        )
    final = sorted({r.final_eval["eval_bytes_scored"] for r in results if r.final_eval})
    if final:
        which = "" if all(r.final_eval for r in results) else " of the runs that had one"
        scored_text += (
            f"final losses{which} from one more evaluation after the last step on "
            + " / ".join(f"{n:,}" for n in final)
            + " bytes; "
        )
    lines = [
        f"target validation loss ({basis}): {target:.4f} nats/byte (ppl {math.exp(target):.3f})",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    for row in comparison_rows(results, target):
        lo, hi = row["final_val_loss_workers_min"], row["final_val_loss_workers_max"]
        cells = [
            row["method"],
            _opt(row["steps_to_target"], "{:d}"),
            _opt(row["wall_to_target_s"], "{:.1f} s"),
            "not reached" if row["bytes_to_target"] is None else fmt_bytes(row["bytes_to_target"]),
            f"{row['final_val_loss']:.4f}",
            "n/a" if lo is None or hi is None else f"{lo:.4f} / {hi:.4f}",
            _loss(row["final_val_loss_avg_model"]),
            f"{row['final_val_ppl']:.3f}",
            f"{row['wall_clock_s']:.1f} s",
            fmt_bytes(row["bytes_sent_per_worker"]),
            f"{row['exposed_comm_s']:.2f} s ({100 * row['exposed_comm_frac']:.0f}%)",
            str(row["syncs"]) + _n_per_period(row["syncs_per_period"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"{scored_text}target and 'to target' columns use the {basis} loss.",
        f"* {AVERAGING_NOTE}.",
    ]
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def plot_curves(
    results: list[RunResult], out_dir: Path, target: float | None = None, prefix: str = ""
) -> list[Path]:
    """val loss vs steps, vs wall-clock and vs bytes sent: three PNGs, one line per run."""
    import matplotlib  # optional (the cli extra): only when a plot is drawn

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    written = []
    axes_def = (
        ("steps", "inner steps", lambda p: p.step, False),
        ("wallclock", "training wall-clock (s)", lambda p: p.wall_s, False),
        ("bytes", "bytes sent per worker", lambda p: p.bytes_sent, True),
    )
    for key, label, getx, logx in axes_def:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for r in results:
            pts = [p for p in r.points if not (logx and p.bytes_sent <= 0)]
            if not pts:
                continue
            ax.plot([getx(p) for p in pts], [p.val_loss for p in pts], marker=".", label=r.name)
        if target is not None and math.isfinite(target):
            ax.axhline(target, color="grey", ls=":", lw=1, label="target")
        # Zoom past the initial loss (ln 256 ~ 5.5 at step 0), which would flatten every difference.
        later = [p.val_loss for r in results for p in r.points[1:] if math.isfinite(p.val_loss)]
        if later:
            lo, hi = min(later), max(p.val_loss for r in results for p in r.points[1:2])
            ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel(f"validation loss (nats/byte, {val_loss_basis(results)})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{prefix}val_loss_vs_{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return math.nan, math.nan
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


FAULT_HEADER = (
    "run",
    "syncs committed",
    "syncs failed",
    "kill -> next committed sync",
    "returned worker healed at",
    "waited for its start",
    "final val loss",
    "fault-free final",
    "difference",
)


def format_fault_table(results: list[RunResult]) -> str:
    """One row per run with faults: the rounds worker 0 saw, the recovery times, how long worker 0
    waited at return steps for the new process to start (part of its wall-clock) and the final loss
    against the fault-free twin (when --fault-free ran it)."""
    lines = [
        "fault tolerance (rounds as worker 0 saw them; its own parameters evaluated):",
        "",
        "| " + " | ".join(FAULT_HEADER) + " |",
        "|" + "|".join("---" for _ in FAULT_HEADER) + "|",
    ]
    for r in results:
        f = r.extra.get("faults")
        if not f or not f["events"]:
            continue
        rec = ", ".join("-" if s is None else f"{s:.2f} s" for s in f["kill_to_next_commit_s"]) or "-"
        healed = ", ".join(
            f"w{e['worker']}: step {e['healed_at']}"
            if e.get("healed_at") is not None
            else f"w{e['worker']}: not healed"
            for e in f["events"]
            if e["kind"] == "return"
        )
        twin = f.get("fault_free_final_loss")
        cells = [
            r.name,
            str(f["syncs_committed"]),
            str(f["syncs_failed"]),
            rec,
            healed or "-",
            f"{r.extra.get('waited_for_returns_s', 0.0):.1f} s",
            f"{r.final_loss:.4f}",
            "not run (--fault-free)" if twin is None else f"{twin:.4f}",
            "-" if twin is None else f"{r.final_loss - twin:+.4f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
