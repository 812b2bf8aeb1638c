"""Rerun one saved run of a resumable study on this machine and print its evaluations beside the saved ones.

    python tools/rerun_saved_run.py docs/data/cocodc-scale/runs/000.json [--run 0] [--until 500]

A maintenance tool of the source tree (not part of the installed package). A study's saved part
(``runs/NNN.json``) holds each run's full configuration and its evaluation losses; this trains the
same configuration (the same seed, data order and emulated link) with the code of this checkout and
prints, at every evaluation, the loss now, the saved loss and whether the two are equal to the last
bit. It stops after the evaluation at step ``--until`` (default: the whole run).

What it tells: whether a part made elsewhere (another revision, another machine) is the same
computation as a part made here. torch's CPU kernels (and the BLAS under them) round the last bits
differently on different CPUs, so one seeded run can match at step 0 and drift from the first steps
on; a study whose parts come from two machines then pairs seeds across them, which adds variance to
its paired differences (the trajectories differ as if perturbed) and no bias that seeds cannot
average out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from lowcomm_kernels.runtime.launch import launch
from lowcomm_kernels.train.corpus import load_corpus
from lowcomm_kernels.train.provenance import cpu_model, git_info, torch_cpu_capability
from lowcomm_kernels.train.spec import TrainSpec
from lowcomm_kernels.train.worker import run_rank


class _Stop(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", type=Path, help="a saved part: a study's runs/NNN.json")
    p.add_argument("--run", type=int, default=0, help="which run of the part (default 0)")
    p.add_argument("--until", type=int, default=None, help="stop after the evaluation at this step")
    args = p.parse_args(argv)
    try:
        doc = json.loads(args.part.read_text())
        run = doc["runs"][args.run]
        spec = TrainSpec.from_dict(run["config"])
        saved = {p["step"]: p["val_loss"] for p in run["points"]}
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:  # SpecError too
        print(f"error: {args.part}: not a saved part with a run {args.run} ({exc})", file=sys.stderr)
        return 2
    made = doc.get("made_by") or {}
    print(f"{args.part} run {args.run}: {spec.label}, seed {spec.seed}, {spec.steps} steps")
    rev, machine = str(made.get("revision"))[:10], made.get("machine", "not recorded")
    print(f"  saved by revision {rev} at {made.get('utc')}, machine {machine}")
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    g = git_info()
    code = f"revision {str(g['revision'])[:10]} ({'with uncommitted changes' if g['dirty'] else 'clean'})"
    print(f"  rerun here: {code}, {cpu_model()} ({torch_cpu_capability()}), ATEN_CPU_CAPABILITY={forced}")
    corpus = load_corpus(spec.data)

    def on_message(_rank: int, msg: tuple) -> None:
        _, step, loss = msg
        if loss is None:
            return
        then = saved.get(step)
        verdict = (
            "no saved point"
            if then is None
            else "equal"
            if loss == then
            else f"differs by {loss - then:+.3g}"
        )
        print(f"  step {step:>6}: now {loss!r}  saved {then!r}  {verdict}", flush=True)
        if args.until is not None and step >= args.until:
            raise _Stop

    try:
        launch(
            run_rank,
            spec.workers,
            ([spec], corpus.train.share_memory_(), corpus.val.share_memory_()),
            on_message=on_message,
        )
    except _Stop:
        print(f"  stopped after step {args.until}")
    return 0


if __name__ == "__main__":  # the launcher spawns workers that import this file: keep the guard
    sys.exit(main())
