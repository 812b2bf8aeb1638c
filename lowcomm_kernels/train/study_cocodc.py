"""``lowcomm compare --study cocodc-paper``: CoCoDC at the paper's hyperparameters, several seeds, and
controls that isolate its Taylor term, each compared with CoCoDC adaptive seed by seed.

Setup (the paper's): 4 workers, H = 100, tau = 5, K = 4, lambda = 0.5 (normalized per fragment),
gamma = 0.4, N from the emulated link: T_s = latency + ring all-reduce bytes of the mean fragment /
bandwidth, T_c = the emulated step time, which this study sets to T_s / 4.75 so that a fragment sync
lasts just under tau steps (the paper's operating point, tau = T_s / T_c = 5) and
N = floor(gamma * H * T_c / T_s) = floor(0.4 * 100 / 4.75) = floor(8.42) = 8 syncs per H, the
paper's N. 2,000 steps, 5 seeds (``--seeds``), the byte-level LM of ``lowcomm compare`` shrunk
to fit the time budget (dim 16, 4 layers, 2 heads, SwiGLU 43, 16-byte context, batch 8: 20,688
parameters; a step of this model costs mostly per-op overhead, so a smaller one would not be much
cheaper), evaluated every 100 steps on 8,192 validation bytes spread over the validation text (for
the curves and "steps to target") and once more after the last step on 262,144 bytes (the final
losses), on a 10 ms / 1 Gbit/s link (so the emulated waits stay short in wall-clock).

Configurations (``configs``): DiLoCo; Streaming DiLoCo at 4 and at 8 syncs per H (H halved) and at 4
with alpha = 0.5; CoCoDC adaptive (the reference of the paired differences) and round-robin; the
controls beta = 1 with lambda = 0 (local progress only), a flipped sign (+lambda) and a random
direction of the correction's norm; normalized lambda in {0.25, 1, 2, 4} beside 0.5; per-tensor
beside per-fragment normalization; the reference code's l1_local score.

Output: per configuration, final validation loss and steps to ``TARGET_LOSS`` (mean +- std over
seeds), the N chosen per period, and the paired differences (same seed) against CoCoDC adaptive with
their 95 % interval, Student's t (df = pairs - 1), its two-sided p-value and the p-value adjusted by
Holm over each column's family of 14 comparisons (``train.stats``; scipy, '-' without it). Steps to target
pairs only the seeds where both runs reached it. Steps to target are known to the evaluation
interval (100 steps), so paired differences of steps are often equal on every seed: then the
spread is 0, t is infinite and no p-value is given (the cell shows the mean and a spread of 0).

Target: ``TARGET_LOSS`` below was fixed before any run of the study, from one pilot run of CoCoDC
adaptive at seed 1000 (not a seed of the study: 0..4 by default; command below): the pilot's
validation loss (8,192 bytes) at step 1,200 (60 % of the run) was 2.0987, rounded up to 2.10, so
the configurations reach it in the second half of the run, where they separate. (The pilot's
losses: 2.9547 at step 100, 2.2550 at 600, 2.0987 at 1,200, 2.0274 at 1,900, 2.0229 at 2,000, and
2.0276 on 262,144 bytes after the last step.)

Budget (the task: the study at most 2 hours on the 2-core machine). The pilot chose N = 8 in all 20
periods and measured ``cpu_s_all_ranks`` = 174.1 CPU seconds for the whole 2,000-step run (4 ranks:
setup, training, 21 small evaluations and the final one of every worker's model and of the averaged
model: 11.2 s and 13.6 s of wall-clock), 155 s wall for the command while other jobs kept the load
average at 2-4.5. 15 configurations x 5 seeds = 75 runs x 174 CPU s = 13,060 CPU s, about 109
minutes on 2 free cores (wall >= CPU seconds / 2). Measured: the 75 runs of the committed study
took 13,712 CPU seconds of all ranks (135-219 s per run, under load 1-11); ``lowcomm report`` prints
that total from the runs (``elapsed_s`` in results.json is only the last sitting's, which may have
read every run back). Since then a foreach AdamW, validation batches of 4,096 tokens and q and k
rotated in one call made a run cheaper with the same training, bit for bit: ``--seeds 1`` (one seed
of all 15 configurations) took 1,342 s of wall-clock on the idle AVX2 machine and reproduced the
committed seed-0 final losses (docs/data/cocodc-paper-timing), so 5 seeds take about
5 x 1,213 s of runs + 129 s of launches = 103 minutes. Timed in one sitting on a second 2-core
machine (AVX-512; docs/data/cocodc-paper-avx512): 3,632 s for the 75 runs, 70 minutes with the
loscar-regimes study. A worker step of this model is 14.4 ms of one core alone and with 4
processes on 2 cores alike, so any other job on the machine slows the study in proportion (a
nice'd test run beside it cost it 30 %).

    lowcomm train --method cocodc --seed 1000 --steps 2000 --sync-every 100 --delay 5 --fragments 4 \\
        --lam 0.5 --gamma 0.4 --dim 16 --layers 4 --heads 2 --mlp-hidden 43 --seq-len 16 \\
        --eval-every 100 --eval-bytes 8192 --final-eval-bytes 262144 --latency-ms 10 \\
        --bandwidth-mbps 1000 --step-time-ms 2.1575275789473687

``--quick``: 120 steps, H = 40, tau = 2, 2 seeds, target: the lowest loss every run reached (a smoke
run of the whole pipeline, not a result: there N = K = 4, so adaptive, round-robin and l1_local make
the same choices). ``lowcomm compare --study cocodc-paper --quick`` took 962 s on the 2-core machine
while other jobs loaded it. Resumable like every study (``run_resumable``).

Reproducibility: with the emulated timing, two concurrent runs of
``lowcomm train --method cocodc --seed 0 --steps 120 --sync-every 40 --delay 2 --fragments 4 --dim 16
--layers 4 --heads 2 --mlp-hidden 43 --seq-len 16 --eval-every 40 --eval-bytes 1024 --latency-ms 10
--bandwidth-mbps 1000 --step-time-ms 1.5`` chose the same N (4, 4, 4) and fragments and gave
bitwise-equal validation losses at every evaluation (each worker's, their mean and the averaged
model's): gloo's sums over 4 ranks came out the same in both runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

from ..runtime.fragments import plan_fragments
from ..runtime.launch import WorkerError
from ..runtime.transport import ring_wire_bytes
from . import paper_vs_ours, stats
from .args import out_dir, spec_from_args, usage_error
from .errors import SpecError, UsageError
from .model import ModelConfig, TinyLlama
from .provenance import collect
from .report import RunResult, auto_target, write_json
from .runner import report_failure
from .spec import TrainSpec
from .studykit import Study, cell, labels_of, run_resumable, runs_of, sittings, study_plot
from .tasks.lm import load_checked_corpus

NAME = "cocodc-paper"
REFERENCE = "CoCoDC adaptive"  # every paired difference is against this configuration
TARGET_LOSS = 2.10  # from the pilot at seed 1000, before the study's runs (see the module docstring)
SEEDS, QUICK_SEEDS = 5, 2
SYNC_RATIO = 4.75  # T_s / T_c of the emulated timing: N = floor(gamma * H / 4.75) = 8 at H = 100
MODEL = {"dim": 16, "layers": 4, "heads": 2, "mlp_hidden": 43, "seq_len": 16}  # flags of the model
PAPER = dict(
    workers=4, sync_every=100, fragment_sync_delay=5, num_fragments=4, lam=0.5, lam_mode="normalized",
    gamma=0.4, syncs_per_period="auto", cocodc_timing="emulated", latency_s=0.01,
    bandwidth_bytes_per_s=125e6,
)  # fmt: skip
PRESETS = {
    "full": dict(PAPER, steps=2000, eval_every=100, eval_bytes=8_192, final_eval_bytes=262_144),
    "quick": dict(
        PAPER,
        steps=120,
        sync_every=40,
        fragment_sync_delay=2,
        eval_every=40,
        eval_bytes=1_024,
        final_eval_bytes=4_096,
    ),
}


def configs(base: TrainSpec) -> list[tuple[str, TrainSpec]]:
    """The study's configurations, as (label, spec) on ``base`` (the paper's setup)."""
    H = base.sync_every
    coco = base.with_(method="cocodc", syncs_per_period="auto", score="l2_global", taylor_control="none")
    stream = base.with_(method="streaming", fragment_update_alpha=0.0)
    out = [
        ("DiLoCo", base.with_(method="diloco")),
        (f"Streaming DiLoCo, {base.num_fragments} syncs/H", stream),
        (
            f"Streaming DiLoCo, {2 * base.num_fragments} syncs/H",
            stream.with_(sync_every=max(base.fragment_sync_delay + 1, H // 2)),
        ),
        (
            f"Streaming DiLoCo, {base.num_fragments} syncs/H, alpha=0.5",
            stream.with_(fragment_update_alpha=0.5),
        ),
        (REFERENCE, coco),
        ("CoCoDC round-robin", coco.with_(score="round_robin")),
        ("control: beta=1, lambda=0 (local progress only)", coco.with_(lam=0.0)),
        ("control: flipped sign (+lambda)", coco.with_(taylor_control="flip")),
        ("control: random direction, same norm", coco.with_(taylor_control="random")),
    ]
    out += [(f"CoCoDC lambda={v:g}", coco.with_(lam=v)) for v in (0.25, 1.0, 2.0, 4.0) if v != base.lam]
    out += [
        ("CoCoDC per-tensor normalization", coco.with_(lam_mode="normalized_tensor")),
        ("CoCoDC l1_local score", coco.with_(score="l1_local")),
    ]
    return out


def paper_step_time(spec: TrainSpec) -> float:
    """The emulated step time that makes one fragment sync last SYNC_RATIO steps on spec's link."""
    groups = plan_fragments(TinyLlama(spec.model), spec.num_fragments)
    wire = [ring_wire_bytes(4 * sum(p.numel() for p in g), spec.workers) for g in groups]
    t_s = spec.latency_s + sum(wire) / len(wire) / spec.bandwidth_bytes_per_s
    return t_s / SYNC_RATIO


def _by_seed(results: list[RunResult], label: str, seeds: list[int]) -> list[RunResult | None]:
    runs = {r.config.get("seed"): r for r in results if r.name == label}
    return [runs.get(s) for s in seeds]


def _n_cell(runs: list[RunResult | None]) -> str:
    ns = sorted({n for r in runs if r is not None for n in r.extra.get("syncs_per_period", [])})
    return ",".join(str(n) for n in ns) if ns else "-"


def table(
    labels: list[str], results: list[RunResult], target: float, seeds: list[int], paper: bool = True
) -> tuple[str, dict]:
    """Markdown and the paired statistics (JSON-safe) of the study (``paper``: with the paper's
    headline effects beside ours, for this study's configurations)."""
    head = [
        "configuration", "seeds", "final val loss (own models)", "final, averaged model*",
        "steps to target (reached)", "N per period", "syncs",
        f"final loss − {REFERENCE} (paired)", f"steps to target − {REFERENCE} (paired)",
    ]  # fmt: skip
    lines = [
        f"target validation loss {target:.4f} (the workers' own models, mean); paired differences: "
        "same seed, mean [95 % interval] (t with df = pairs − 1, two-sided p, Holm-adjusted p over "
        f"the {len(labels) - 1} comparisons of the column)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    ref = _by_seed(results, REFERENCE, seeds)
    ref_final = [r.final_loss if r else None for r in ref]
    ref_steps = [_steps(r, target) for r in ref]
    stats_out: dict = {}
    # two families declared before the runs, each every configuration against the reference, Holm
    # over the whole family: final loss, and steps to target
    others = [label for label in labels if label != REFERENCE]
    runs_of = {label: _by_seed(results, label, seeds) for label in others}
    final_family = stats.holm_family(
        {k: stats.paired([r.final_loss if r else None for r in v], ref_final) for k, v in runs_of.items()}
    )
    steps_family = stats.holm_family(
        {k: stats.paired([_steps(r, target) for r in v], ref_steps) for k, v in runs_of.items()}
    )
    for label in labels:
        runs = _by_seed(results, label, seeds)
        done = [r for r in runs if r is not None]
        final = [r.final_loss if r else None for r in runs]
        steps = [_steps(r, target) for r in runs]
        reached = sum(s is not None for s in steps)
        if label == REFERENCE:
            d_final = d_steps = "(reference)"
        else:
            pf, ps = final_family[label], steps_family[label]
            stats_out[label] = {
                "final_loss": dataclasses.asdict(pf),
                "steps_to_target": dataclasses.asdict(ps),
            }
            d_final, d_steps = pf.cell(), ps.cell("{:+.0f}")
        lines.append(
            "| "
            + " | ".join(
                [
                    label,
                    str(len(done)),
                    cell(final),
                    cell([_avg_model_final(r) for r in runs]),
                    f"{cell(steps, '{:.0f}')} ({reached}/{len(done)})",
                    _n_cell(runs),
                    cell([float(r.syncs) for r in done], "{:.0f}"),
                    d_final,
                    d_steps,
                ]
            )
            + " |"
        )
    lines += [
        "",
        "final val loss (own models): the mean of the workers' own models' losses (what each worker "
        "holds); * the workers' parameters averaged by one all-reduce that is not counted in any byte or "
        "sync column (no worker holds that model between syncs, except DiLoCo's right after one).",
    ]
    if paper:
        lines += [
            "",
            "**The paper's headline effects beside ours** (relative effects; see below the table)",
            "",
        ]
        lines.append(paper_section(labels, results, target, seeds))
    return "\n".join(lines), stats_out


# The paper's Table (150M LLaMA on C4, 4 workers, H = 100, tau = 5, K = 4, lambda = 0.5, gamma = 0.4):
# steps to validation perplexity 20 and the final validation perplexity, one run each.
PAPER_TABLE = {
    "CoCoDC": (10_292, 18.0357),
    "Streaming DiLoCo": (13_021, 18.6457),
    "DiLoCo": (10_821, 18.1608),
}


def paper_claims(labels: list[str]) -> list[paper_vs_ours.Claim]:
    """The paper's comparisons, mapped to this study's configurations: its Streaming DiLoCo is ours
    at K syncs per H (alpha = 0); the pairing at CoCoDC's own sync count is the one it did not run."""
    streams = sorted(
        (int(lb.split(", ")[1].split()[0]), lb)
        for lb in labels
        if lb.startswith("Streaming DiLoCo, ") and lb.endswith(" syncs/H")
    )
    ours = {"CoCoDC": REFERENCE, "DiLoCo": "DiLoCo", "Streaming DiLoCo": streams[0][1] if streams else ""}
    out = []
    for a, b in (("CoCoDC", "Streaming DiLoCo"), ("CoCoDC", "DiLoCo"), ("Streaming DiLoCo", "DiLoCo")):
        (sa, pa), (sb, pb) = PAPER_TABLE[a], PAPER_TABLE[b]
        out.append(
            paper_vs_ours.Claim(
                f"{a} vs {b}", "steps to target", sa / sb - 1, f"{sa:,} vs {sb:,} steps", ours[a], ours[b]
            )
        )
        out.append(
            paper_vs_ours.Claim(
                f"{a} vs {b}",
                "final loss",
                math.log(pa) / math.log(pb) - 1,
                f"ppl {pa} vs {pb}",
                ours[a],
                ours[b],
            )
        )
    if len(streams) > 1:  # the review's question: the same number of syncs as CoCoDC
        for metric in ("steps to target", "final loss"):
            what = f"CoCoDC vs Streaming DiLoCo at {streams[-1][0]} syncs/H"
            out.append(paper_vs_ours.Claim(what, metric, None, "not run", REFERENCE, streams[-1][1]))
    return out


def paper_section(labels: list[str], results: list[RunResult], target: float, seeds: list[int]) -> str:
    """The paper's headline effects beside ours (paper_vs_ours.table), from this study's runs."""

    def metric(label: str, name: str) -> list[float | None]:
        runs = _by_seed(results, label, seeds)
        if name == "final loss":
            return [r.final_loss if r else None for r in runs]
        return [_steps(r, target) for r in runs]

    claims = [c for c in paper_claims(labels) if c.method in labels and c.baseline in labels]
    ours = {}
    for c in claims:
        ours[(c.what, c.metric)] = paper_vs_ours.relative(
            metric(c.method, c.metric), metric(c.baseline, c.metric)
        )
    return paper_vs_ours.table(claims, ours, "the paper (one run)")


def _avg_model_final(run: RunResult | None) -> float | None:
    """The final evaluation's loss of the workers' averaged parameters (None when not recorded)."""
    fe = run.final_eval if run is not None else None
    v = (fe or {}).get("val_loss_avg_model")
    return float(v) if v is not None else None


def study_header(name: str, base: dict, n_seeds: int, corpus: str, how: str) -> str:
    """The line above the table. ``base``: the study's base TrainSpec as a dict (results.json stores
    it under "base"), ``how``: where the target came from (results.json: "target_from")."""
    mc = base["model"]
    return (
        f"study `{name}`: {base['workers']} workers, {base['steps']} steps, H={base['sync_every']}, "
        f"K={base['num_fragments']}, tau={base['fragment_sync_delay']}, lambda={base['lam']:g} "
        f"({base['lam_mode']}), gamma={base['gamma']:g}, emulated step {base['step_time_ms']:.3f} ms on a "
        f"{base['latency_s'] * 1e3:g} ms / {base['bandwidth_bytes_per_s'] * 8 / 1e6:g} Mbit/s link, "
        f"{n_seeds} seeds, model dim={mc['dim']} layers={mc['n_layers']} seq_len={mc['seq_len']}; "
        f"validation: {base.get('eval_bytes', 0):,} bytes every {base['eval_every']} steps (curves, steps "
        f"to target), final losses on {base.get('final_eval_bytes') or base.get('eval_bytes', 0):,} bytes; "
        f"{corpus}; target: {how}"
    )


def _steps(run: RunResult | None, target: float) -> float | None:
    hit = run.first_reaching(target) if run is not None else None
    return float(hit.step) if hit is not None else None


#: (labels, runs, seeds, target) -> the study's markdown and its paired statistics (JSON-safe)
Tables = Callable[[list[str], list[RunResult], float, list[int]], tuple[str, dict]]


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a study on the paper's schedule runs: the model (flags), the run presets ("full",
    "quick"), seeds by default, the target (NaN: the lowest loss every run reached), and how many
    seeds one saved part holds."""

    model: dict
    presets: dict
    seeds: int
    quick_seeds: int
    target: float
    target_from: str
    seeds_per_part: int | None = None  # seeds per launch and saved part (None: all at once)

    def spec(self, preset: str = "full") -> TrainSpec:
        """The study's base TrainSpec without command-line flags (the emulated step time aside)."""
        m = self.model
        model = ModelConfig(
            dim=m["dim"],
            n_layers=m["layers"],
            n_heads=m["heads"],
            mlp_hidden=m["mlp_hidden"],
            seq_len=m["seq_len"],
        )
        return TrainSpec(method="cocodc", model=model, **self.presets[preset])


PAPER_SETUP = Setup(
    MODEL,
    PRESETS,
    SEEDS,
    QUICK_SEEDS,
    TARGET_LOSS,
    "declared in study_cocodc.py from a pilot at another seed",
)


def run_paper_setup(
    args: argparse.Namespace,
    name: str,
    configs_of: Callable[[TrainSpec], list[tuple[str, TrainSpec]]],
    tables: Tables,
    seeds_of: Callable[[str, list[int]], list[int]] = lambda label, seeds: seeds,
    setup: Setup = PAPER_SETUP,
) -> int:
    """A study on the paper's schedule (``setup``: by default this module's model, presets and
    target; the emulated step time that gives N = 8), resumable: ``configs_of`` gives (label, spec)
    on the base, ``seeds_of`` the seeds a configuration runs (default: all), ``tables`` the markdown
    of the results. Writes NAME.md, NAME.png and results.json to the output folder."""
    if args.task != "lm":
        raise UsageError("--study runs on the language-model task (--task lm)")
    args = argparse.Namespace(**vars(args))
    for flag, value in setup.model.items():  # the study's model unless the flags say otherwise
        if getattr(args, flag, None) is None:
            setattr(args, flag, value)
    base = spec_from_args(args, "cocodc", setup.presets["quick" if args.quick else "full"])
    if getattr(args, "step_time_ms", None) is None:
        base = base.with_(step_time_ms=paper_step_time(base) * 1e3)
    n_seeds = args.seeds or (setup.quick_seeds if args.quick else setup.seeds)
    seeds = [base.seed + s for s in range(n_seeds)]
    if seeds[-1] > 2**32 - 1:
        raise UsageError(
            f"--seed {base.seed} with --seeds {n_seeds} needs seed {seeds[-1]}; the largest is {2**32 - 1}"
        )
    try:
        cfgs = configs_of(base)
        # one launch (and one saved part) per configuration and chunk of seeds, chunk by chunk: a
        # sitting that stops early leaves every configuration at the same seeds
        chunk = setup.seeds_per_part or len(seeds)
        parts = [seeds[i : i + chunk] for i in range(0, len(seeds), chunk)]
        groups = [
            (label, [spec.with_(name=label, seed=s) for s in part if s in seeds_of(label, seeds)])
            for part in parts
            for label, spec in cfgs
        ]
        groups = [(label, specs) for label, specs in groups if specs]
    except SpecError as exc:
        raise usage_error(exc) from None
    labels = [label for label, _ in cfgs]
    corpus = load_checked_corpus(args.data, [s for _, specs in groups for s in specs])
    out = out_dir(args, f"study-{name}")
    t0 = time.perf_counter()
    try:
        results = run_resumable(groups, corpus, out / "runs", progress=not args.no_progress)
    except WorkerError as exc:
        return report_failure(exc, out, "study")
    if args.target is not None:
        target, how = args.target, "--target"
    elif args.quick or math.isnan(setup.target):
        target, how = auto_target(results), "the lowest loss every run reached"
    else:
        target, how = setup.target, setup.target_from
    md, paired = tables(labels, results, target, seeds)
    cmd = (
        f"lowcomm compare --study {name}"
        + (" --quick" if args.quick else "")
        + (f" --seeds {args.seeds}" if args.seeds else "")
    )
    header = study_header(name, dataclasses.asdict(base), n_seeds, corpus.describe(), how)
    (out / f"{name}.md").write_text(f"# {header}\n\nCommand: `{cmd}`\n\n{md}\n")
    study_plot(name, labels, results, out / f"{name}.png")
    write_json(
        out / "results.json",
        {
            "study": name,
            "command": cmd,
            "target_val_loss": target,
            "target_from": how,
            "reference": REFERENCE,
            "paired": paired,
            "corpus": corpus.describe(),
            "base": dataclasses.asdict(base),
            "seeds": seeds,
            "runs": [r.to_dict() for r in results],
            "elapsed_s": time.perf_counter() - t0,
            "provenance": collect(),
            "sittings": sittings(out / "runs", len(groups)),  # the code that made each saved part
        },
    )
    print(f"\n{header}\n\n{md}")
    wrote = f"{out / (name + '.md')}, {out / (name + '.png')}, {out / 'results.json'}"
    print(f"\nwrote {wrote} ({time.perf_counter() - t0:.0f} s)")
    return 0


def render_paper_setup(
    name: str, tables: Tables, data: dict, plot_dir: Path | None, prefix: str
) -> tuple[str, list[Path]]:
    """``lowcomm report`` of a study made by :func:`run_paper_setup`: its header and tables (and with
    ``plot_dir`` the loss-vs-steps plot)."""
    results = runs_of(data)
    labels, seeds = labels_of(results), [int(s) for s in data["seeds"]]
    header = study_header(name, data["base"], len(seeds), str(data["corpus"]), str(data["target_from"]))
    md, _ = tables(labels, results, float(data["target_val_loss"]), seeds)
    plots: list[Path] = []
    if plot_dir:
        plots.append(plot_dir / f"{prefix}_{name}.png")
        study_plot(name, labels, results, plots[-1])
    return f"**{header}**\n\nCommand: `{data['command']}`\n\n{md}", plots


def run_cocodc_paper(args: argparse.Namespace) -> int:
    """The study's command: ``lowcomm compare --study cocodc-paper [--quick] [--seeds N] [flags]``."""
    return run_paper_setup(args, NAME, configs, table)


def render(data: dict, plot_dir: Path | None, prefix: str) -> tuple[str, list[Path]]:
    """``lowcomm report`` of the study's results.json."""
    return render_paper_setup(NAME, table, data, plot_dir, prefix)


STUDY = Study(NAME, configs, run_cocodc_paper, render)
