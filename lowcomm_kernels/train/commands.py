"""The CLI's commands. ``cli.py`` parses; ``args`` turns the arguments into specs; this module runs
them and writes the outputs.

Input problems (bad knob values, missing or empty corpus) become :class:`UsageError` before any
process is spawned, so the user sees one line and exit code 2; failures during a run exit 1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from . import render
from .args import out_dir
from .errors import UsageError
from .extras import check_cli_extras
from .faults import run_faults_command
from .profile import run_profile
from .studies import run_study
from .tasks.lm import run_lm_compare, run_lm_train
from .tasks.logreg import run_logreg_compare
from .tasks.mlp import run_mlp_compare


def _faults(args: argparse.Namespace, command: str) -> bool:
    """Whether --faults is given (``train.faults`` runs the command then); --fault-free needs it."""
    if getattr(args, "faults", None) is None:
        if getattr(args, "fault_free", False):
            raise UsageError("--fault-free goes with --faults (the run it is compared with)")
        return False
    if command == "compare" and (args.study or args.task != "lm"):
        raise UsageError(
            "--faults works with the language-model runs of compare, not --study or --task logreg"
        )
    if getattr(args, "outer_delay", None) not in (None, "none"):  # the runtime refuses it with torchft
        raise UsageError(
            f"--outer-delay {args.outer_delay} (--eager) is not supported with --faults: a torchft replica "
            "that joins would need the stale shares of the average that no replica holds"
        )
    return True


#: ``lowcomm compare --task NAME``: each task's command
TASKS = {"lm": run_lm_compare, "logreg": run_logreg_compare, "mlp": run_mlp_compare}


def cmd_compare(args: argparse.Namespace) -> int:
    if _faults(args, "compare"):
        return run_faults_command(args, "compare")
    if args.tensorboard is not None and (args.study or args.task != "lm"):
        raise UsageError(
            "--tensorboard works with the language-model runs of compare, not --study or --task logreg"
        )
    if args.study:
        return run_study(args)
    return TASKS[args.task](args)


def cmd_train(args: argparse.Namespace) -> int:
    if _faults(args, "train"):
        return run_faults_command(args, "train")
    return run_lm_train(args)


def cmd_profile(args: argparse.Namespace) -> int:
    return run_profile(args)


def _find_bench_dir(explicit: str | None) -> Path:
    if explicit:
        path = Path(explicit)
        if not path.is_dir():
            raise UsageError(f"--bench-dir {path} is not a folder")
        return path
    # The benchmarks live in the source checkout, beside the package (editable installs).
    candidates = [Path(__file__).resolve().parents[2] / "bench", Path.cwd() / "bench"]
    for c in candidates:
        if c.is_dir() and any(c.glob("*.py")):
            return c
    raise UsageError(
        "no bench/ folder found beside the package or in the current directory: the benchmarks ship "
        "with the source checkout, not the wheel; run from a clone (pip install -e .) or pass --bench-dir"
    )


def cmd_bench(args: argparse.Namespace) -> int:
    """pytest-benchmark over bench/bench_ops.py (JSON into --out), optionally the overlap benchmark,
    then bench/render_results.py renders bench/RESULTS.md from them."""
    bench = _find_bench_dir(args.bench_dir)
    out = out_dir(args, "bench")
    json_path = (out / "ops.json").resolve()
    target = bench / "bench_ops.py"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(target if target.is_file() else bench),
        "-q",
        f"--benchmark-json={json_path}",
    ]
    if args.quick:
        cmd.append("--quick")
    if args.keyword:
        cmd += ["-k", args.keyword]
    steps = [cmd]
    overlap = bench / "bench_overlap.py"
    if args.overlap:
        if not overlap.is_file():
            raise UsageError(f"--overlap: {overlap} not found")
        steps.append([sys.executable, str(overlap)])
    render = bench / "render_results.py"
    if render.is_file():
        render_cmd = [sys.executable, str(render), "--ops", str(json_path)]
        if args.quick:  # a smoke run must not replace the committed bench/RESULTS.md
            render_cmd += [
                "--out",
                str((out / "RESULTS.md").resolve()),
                "--png",
                str((out / "ops_bandwidth.png").resolve()),
            ]
        steps.append(render_cmd)
    for step in steps:
        print("running: " + " ".join(step), file=sys.stderr, flush=True)
        rc = subprocess.call(step, cwd=bench.parent)
        if rc != 0:
            print(
                f"error: {Path(step[1 if step[1] != '-m' else 3]).name} failed (exit code {rc})",
                file=sys.stderr,
            )
            return 1
    if not render.is_file():
        print(f"note: {render} not found; raw results are in {json_path}", file=sys.stderr)
    rendered = (out / "RESULTS.md") if args.quick else (bench / "RESULTS.md")
    print(f"benchmark JSON: {json_path}" + (f"; rendered {rendered}" if render.is_file() else ""))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Tables of finished runs from their results.json (or the docs' marked regions re-rendered)."""
    if args.check and not args.update_docs:
        raise UsageError("--check goes with --update-docs")
    if args.update_docs:
        if args.out or args.plot or args.headline or args.paper:
            raise UsageError(
                "--update-docs rewrites the docs in place: it takes no --out, --plot, --headline or --paper"
            )
        docs = [Path(p) for p in args.paths] or render.default_docs()
        stale = render.update_docs(docs, check=args.check)
        verb = "out of date" if args.check else "updated"
        for doc in stale:
            print(f"{verb}: {doc}")
        regions = sum(len(render.MARKER.findall(render.read_doc(d))) for d in docs)
        if not stale:
            names = ", ".join(str(d) for d in docs)
            print(
                f"all {regions} marked regions up to date: {names}"
                if regions
                else f"no marked regions in {names}"
            )
        return 1 if args.check and stale else 0
    if args.plot and not args.out:
        raise UsageError("--plot needs --out: the plots are written beside the markdown file")
    out = Path(args.out) if args.out else None
    if out is not None and out.is_dir():
        raise UsageError(f"--out {out} is a folder; give a markdown file name")
    if out is None:
        text, _ = render.render(args.paths, headlines=args.headline, paper=args.paper)
        print(text, end="")
        return 0
    try:  # every source is checked before the plots and the file are written (render)
        text, plots = render.render(
            args.paths,
            plot_dir=out.parent if args.plot else None,
            headlines=args.headline,
            paper=args.paper,
        )
        if args.plot:  # the images, linked relative to the markdown file
            text += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    except OSError as exc:  # a read-only place, a path through a file, a full disk
        where = f": {exc.filename}" if exc.filename else ""
        raise UsageError(f"--out {out}: cannot write there ({exc.strerror or exc}{where})") from None
    print(f"wrote {out}" + (f" and {len(plots)} plots beside it" if plots else ""))
    return 0


def dispatch(args: argparse.Namespace) -> int:
    check_cli_extras(args)  # a missing plotting or progress-bar package, named before any work
    return {
        "compare": cmd_compare,
        "train": cmd_train,
        "profile": cmd_profile,
        "bench": cmd_bench,
        "report": cmd_report,
    }[args.command](args)
