"""Workers for the overlapped outer round (test_eager), run on spawned gloo ranks.

Loaded by file path, so imports are absolute. Results are plain Python / CPU tensors.
"""

from __future__ import annotations

from tests.runtime.rt_workers import resume_pair, run_one


def eager_runs(rank: int, world: int, scenarios: list[dict], resume: dict) -> dict:
    """Every scenario from scratch (run_one), then an uninterrupted run beside one resumed from
    its checkpoint (resume_pair)."""
    out = {}
    for sc in scenarios:
        res = run_one(rank, sc)
        res.pop("_strategy")
        out[sc["name"]] = res
    out["resume"] = resume_pair(rank, world, resume)
    return out
