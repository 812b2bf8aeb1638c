"""Every preset of the CLI in one place: how long each command's runs are and how often they evaluate.

A run's knobs come from three layers: :class:`~lowcomm_kernels.train.spec.TrainSpec`'s defaults
(whose run length is :data:`DEFAULT` here) < the command's preset < the flags the user typed.
"""

from __future__ import annotations

# TrainSpec's defaults for the length of a run, and `lowcomm compare` / `lowcomm train` without --quick.
DEFAULT = dict(steps=600, sync_every=50, fragment_sync_delay=5, eval_every=50)

# The language-model presets, by name. Measured on the 2-core dev machine at load ~5: `compare`
# takes 5 min 42 s for the five methods with "default", 1 min 34 s with "quick".
LM: dict[str, dict] = {
    "default": DEFAULT,
    "quick": dict(steps=120, sync_every=20, fragment_sync_delay=3, eval_every=20),
    # `compare --study`: shorter runs than `compare`, since a study multiplies configurations by seeds
    "study": dict(steps=300, sync_every=50, fragment_sync_delay=5, eval_every=25),
    "study-quick": dict(steps=100, sync_every=25, fragment_sync_delay=2, eval_every=25),
    # `profile`: a short 2-rank run, small enough that the traces of every rank stay readable
    "profile": dict(workers=2, steps=40, sync_every=20, fragment_sync_delay=3, eval_every=40),
}
STUDY_SEEDS = 3  # seeds per configuration of a study, unless --seeds

# `compare --task logreg`: rounds of the fixed wall-clock length R, seeds per configuration, workers.
LOGREG: dict[str, dict] = {
    "default": dict(rounds=60, seeds=3, workers=4),
    "quick": dict(rounds=20, seeds=1, workers=4),
}
