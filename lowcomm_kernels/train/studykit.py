"""What every study shares: the :class:`Study` entry that ``train.studies`` tables by name (its
configurations, its command and how ``lowcomm report`` renders its results.json), resumable runs saved
per configuration with the code that made them, the mean ± std cells and the loss-vs-steps plot."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .provenance import cpu_model, git_info, torch_cpu_capability
from .report import RunResult, mean_std, val_loss_basis, write_json
from .runner import run_specs
from .spec import TrainSpec

#: a study's configurations on a base spec: (label, spec) in table order
Configs = Callable[[TrainSpec], list[tuple[str, TrainSpec]]]
#: a results.json's dict, the folder for plots (None: no plots) and the plots' file-name prefix ->
#: (markdown, the plots written)
Renderer = Callable[[dict, "Path | None", str], tuple[str, list[Path]]]


@dataclass(frozen=True)
class Study:
    """One study of ``lowcomm compare --study NAME``, as ``train.studies.STUDIES`` holds it:
    ``configs`` (what it runs), ``run`` (the command: parsed arguments -> exit code) and ``render``
    (``lowcomm report``'s markdown and plots of its results.json), and optionally ``headline`` (a few
    lines of it for a front page). Calling it gives its configurations."""

    name: str
    configs: Configs
    run: Callable[[argparse.Namespace], int]
    render: Renderer
    # a short reading of its results.json for a front page (``lowcomm report --headline``), if it has one
    headline: Callable[[dict], str] | None = None

    def __call__(self, base: TrainSpec) -> list[tuple[str, TrainSpec]]:
        return self.configs(base)


def runs_of(data: dict) -> list[RunResult]:
    """The runs of a results.json's dict."""
    return [RunResult.from_dict(r) for r in data["runs"]]


def labels_of(results: list[RunResult]) -> list[str]:
    """The configurations' labels of ``results``, in order of first appearance."""
    return list(dict.fromkeys(r.name for r in results))


def cell(values: list, fmt: str = "{:.4f}") -> str:
    """'mean ± std' over the seeds' values that exist (None: the run never got there), or n/a."""
    m, s = mean_std([v for v in values if v is not None])
    return "n/a" if math.isnan(m) else f"{fmt.format(m)} ± {fmt.format(s)}"


def table_head(target: float, columns: list[str], results: list[RunResult]) -> list[str]:
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
    records the code and machine that made it (``made_by``: git revision, uncommitted-changes digest,
    UTC time, load, CPU model and torch's CPU capability), so a study completed in several sittings
    says whether its parts ran the same code on the same kind of machine (:func:`sittings`; another
    CPU rounds the last bits of some kernels differently, so seeded runs drift apart); reusing a
    part made by other code prints a warning."""
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
        "machine": {"cpu_model": cpu_model(), "torch_cpu_capability": torch_cpu_capability()},
    }


def _machine(made_by: dict | None) -> str | None:
    """'CPU model (torch CPU capability)' of a part; None when the part did not record it."""
    m = (made_by or {}).get("machine")
    if not isinstance(m, dict) or not (m.get("cpu_model") or m.get("torch_cpu_capability")):
        return None
    return f"{m.get('cpu_model') or 'unknown CPU'} ({m.get('torch_cpu_capability') or 'capability unknown'})"


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
    """The distinct codes and machines that made the parts in ``folder`` (each: revision,
    diff_sha256, machine (None: not recorded), the part files it made, its first and last UTC time);
    more than one means the study mixes code versions or machines.
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
    code, machine = _code_id(made_by), _machine(made_by)
    entry = out.setdefault(
        (*code, machine),
        {
            "revision": code[0],
            "diff_sha256": code[1],
            "machine": machine,
            "parts": [],
            "first_utc": None,
            "last_utc": None,
        },
    )
    if name not in entry["parts"]:
        entry["parts"].append(name)
    utc = (made_by or {}).get("utc")
    if utc is not None:
        entry["first_utc"] = min(filter(None, [entry["first_utc"], utc]))
        entry["last_utc"] = max(filter(None, [entry["last_utc"], utc]))


def study_plot(name: str, labels: list[str], results: list[RunResult], path: Path) -> None:
    import matplotlib  # optional (the cli extra): only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
