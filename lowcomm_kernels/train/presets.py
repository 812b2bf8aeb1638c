"""Every preset of the CLI in one place: how long each command's runs are and how often they evaluate.

A run's knobs come from three layers: :class:`~lowcomm_kernels.train.spec.TrainSpec`'s defaults
(whose run length is :data:`DEFAULT` here) < the command's preset < the flags the user typed.
"""

from __future__ import annotations

# TrainSpec's defaults for the length of a run, and `lowcomm compare` / `lowcomm train` without --quick.
# An evaluation scores every worker's own model on TrainSpec.eval_bytes (256 KiB) of validation text.
# Scoring four differing models (each rank 4,096 + 1,024 windows) is about five times the work of one
# model (data-parallel always, DiLoCo right after a sync, every method at step 0): `bench/eval_cost.py`
# measures both (bench/figures/eval_cost.json, rendered in docs/results.md). So evaluations are few, at
# multiples of H.
DEFAULT = dict(steps=600, sync_every=50, fragment_sync_delay=5, eval_every=200)

#: validation bytes of the smoke presets (quick, the studies): 64 KiB (quick scored 2 KiB of the
#: averaged model before), so that `compare --quick` stays within about 1.5x of its old time; the
#: tables print the bytes scored
SMOKE_EVAL_BYTES = 65_536

# The language-model presets, by name. Timings of `compare` with each: docs/results.md (time budget).
LM: dict[str, dict] = {
    "default": DEFAULT,
    "quick": dict(
        steps=120, sync_every=20, fragment_sync_delay=3, eval_every=60, eval_bytes=SMOKE_EVAL_BYTES
    ),
    # `compare --study`: shorter runs than `compare`, since a study multiplies configurations by seeds
    "study": dict(
        steps=300, sync_every=50, fragment_sync_delay=5, eval_every=100, eval_bytes=SMOKE_EVAL_BYTES
    ),
    "study-quick": dict(
        steps=100, sync_every=25, fragment_sync_delay=2, eval_every=50, eval_bytes=SMOKE_EVAL_BYTES
    ),
    # `profile`: a short 2-rank run, small enough that the traces of every rank stay readable (and
    # not filled by the evaluation: 16 KiB)
    "profile": dict(
        workers=2, steps=40, sync_every=20, fragment_sync_delay=3, eval_every=40, eval_bytes=16_384
    ),
}
STUDY_SEEDS = 3  # seeds per configuration of a study, unless --seeds

# `compare --task logreg`: rounds of the fixed wall-clock length R, seeds per configuration, workers.
LOGREG: dict[str, dict] = {
    "default": dict(rounds=60, seeds=3, workers=4),
    "quick": dict(rounds=20, seeds=1, workers=4),
}
