"""A paper's headline effect beside ours, as relative effects with an interval.

A paper reports one number per method (steps to a target, a final loss); we run several seeds.
Each claim here is a ratio "method vs baseline − 1", so that a 150M-parameter model trained on
C4 and our small byte-level model can be put in one column:

- **steps to the target**: steps(method) / steps(baseline) − 1;
- **final loss**: loss(method) / loss(baseline) − 1. For a paper that reports perplexity this is
  ln ppl(method) / ln ppl(baseline) − 1 (the loss is ln ppl). A relative change of the loss does
  not depend on the unit the loss is counted in (nats per token or per byte), which a relative
  change of the perplexity would.

Ours is the mean of the per-seed ratios with its 95 % t interval (stats.paired_diffs over the
seeds both configurations ran). The verdict reads the interval against 0 and the paper's value:

- "reproduces": the interval excludes 0 on the paper's side and contains the paper's value;
- "same direction, smaller/larger": it excludes 0 on the paper's side, not the paper's value;
- "not resolved": it contains both 0 and the paper's value (too few seeds or too small an effect);
- "paper's effect excluded": it contains 0 but not the paper's value;
- "opposite direction": it excludes 0 on the other side.

A paper that states a direction without a number (a figure's reading) is read by the direction
alone: "same direction", "not separated from 0" or "opposite direction". A paper that states only a
bound on a cost (``bound``: "a degradation of less than 0.2 %") is read one-sided: "within the
paper's bound" (the whole interval below +bound, an improvement included), "outside the paper's
bound" (the whole interval above it) or "not resolved" (the interval reaches across it).

The claims were chosen after our runs were made (the papers' headline comparisons, not a
selection by our outcome); the intervals are per claim, not corrected for their number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from . import stats


@dataclass(frozen=True)
class Claim:
    """One published comparison: ``method`` against ``baseline`` on ``metric``."""

    what: str  # the comparison, in words
    metric: str  # "steps to target" or "final loss"
    paper: float | None  # the paper's relative effect; None: the paper did not measure it
    source: str  # the paper's own numbers the ratio comes from
    method: str  # our configuration's label
    baseline: str  # our baseline's label
    direction: int = 0  # for a claim with no number (paper None): -1 lower, +1 higher, 0 none
    words: str = ""  # what the paper says when it gives no number and no direction ("about the same")
    bound: float | None = None  # for a claim with no number: the paper's bound on a cost, effect < bound


def relative(values: Sequence[float | None], reference: Sequence[float | None]) -> stats.Paired:
    """Per-seed value / reference − 1 (same index = same seed; a None or a zero reference drops
    the pair), summarised as paired differences from 0."""
    return stats.paired_diffs(
        [a / b - 1.0 for a, b in zip(values, reference, strict=True) if a is not None and b]
    )


def verdict(ours: stats.Paired, paper: float | None, direction: int = 0, bound: float | None = None) -> str:
    """How our interval reads against 0 and the paper's value, or only its direction (or its bound)
    when the paper gives no number (see the module docstring)."""
    if ours.n < 2 or ours.ci_low is None or ours.ci_high is None:
        return "too few seeds"
    lo, hi = ours.ci_low, ours.ci_high
    if paper is None and bound is not None:  # a bound on a cost: one-sided
        if hi <= bound:
            return "within the paper's bound"
        return "outside the paper's bound" if lo > bound else "not resolved"
    if paper is None:
        if lo <= 0 <= hi:
            return "not separated from 0"
        if direction == 0:
            return "separated from 0"
        return "same direction" if (lo > 0) == (direction > 0) else "opposite direction"
    if lo <= 0 <= hi:
        return "not resolved" if lo <= paper <= hi else "paper's effect excluded"
    if (lo > 0) != (paper > 0) or paper == 0:
        return "opposite direction"
    if lo <= paper <= hi:
        return "reproduces"
    return (
        "same direction, smaller" if abs(hi if paper > 0 else lo) < abs(paper) else "same direction, larger"
    )


_WORDS = {-1: "lower", 1: "higher"}  # a claim's direction when the paper gives no number


def _no_number(c: Claim) -> str:
    """The paper's cell of a claim without a number: its bound, its direction or 'not measured'."""
    if c.bound is not None:
        return f"a cost < {100 * c.bound:.1f}%"
    return _WORDS.get(c.direction, "not measured")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.1f}%"


def table(claims: Sequence[Claim], ours: dict[tuple[str, str], stats.Paired], paper_name: str) -> str:
    """Markdown: one row per claim. ``ours`` maps a claim's (what, metric) to our relative effect."""
    head = (
        "comparison",
        "metric",
        f"{paper_name}",
        "from (the paper's numbers or figure)",
        "ours: mean [95 % interval]",
        "seeds",
        "verdict",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in claims:
        o = ours[c.what, c.metric]
        cell = "n/a" if o.n == 0 else _pct(o.mean)
        if o.ci_low is not None and o.ci_high is not None:
            cell += f" [{_pct(o.ci_low)}, {_pct(o.ci_high)}]"
        paper = _pct(c.paper) if c.paper is not None else (c.words or _no_number(c))
        v = verdict(o, c.paper, c.direction, c.bound)
        lines.append(f"| {c.what} | {c.metric} | {paper} | {c.source} | {cell} | {o.n} | {v} |")
    return "\n".join(lines)
