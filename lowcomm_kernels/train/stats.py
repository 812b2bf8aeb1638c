"""The statistics of every study, in one place: paired differences by seed, their 95 % interval, the
t test and an exact sign test, Holm's correction over a declared family of comparisons, and the
smallest effect a comparison could have detected.

- **Paired difference** d_s = a_s − b_s over the seeds s both configurations ran (never by position):
  mean d̄, sample std s, t = d̄ / (s/√n) with df = n − 1, two-sided p, and the 95 % interval
  d̄ ± t_{0.975, n−1}·s/√n.
- **Sign test**: the exact two-sided binomial p of the number of positive differences among the
  non-zero ones (no assumption of normality; with 5 pairs it cannot go below 2/2⁵ = 0.0625).
- **Holm**: over a family of m comparisons with p-values sorted p_(1) ≤ … ≤ p_(m), the adjusted
  p_(i) = max_{j≤i} min(1, (m − j + 1)·p_(j)). A family is declared in the study's code before its
  runs; comparisons chosen after seeing the data are labelled post hoc.
- **Smallest detectable effect** (for a null result): the true paired difference that a two-sided
  t test at α = 0.05 would detect with 80 % power, (t_{0.975, n−1} + t_{0.8, n−1})·s/√n; and, for
  a goal effect, the pairs that would reach it at the measured s (``pairs_to_detect``).

The t distribution comes from scipy (a dependency of scikit-learn, which the CLI's tasks use); where
it is missing, the p-values, intervals and detectable effects are None and rendered as '-'.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace


def _t():
    try:
        from scipy import stats  # optional: the p-values are '-' without it
    except ImportError:  # pragma: no cover - scipy comes with scikit-learn in the dev and cli setups
        return None
    return stats.t


@dataclass(frozen=True)
class Paired:
    """Paired differences (see the module docstring). ``p_holm`` is filled by :func:`holm_family`."""

    n: int
    mean: float
    std: float
    t: float
    df: int
    p: float | None
    ci_low: float | None
    ci_high: float | None
    sign_p: float | None
    detectable: float | None
    p_holm: float | None = None

    def cell(self, fmt: str = "{:+.4f}") -> str:
        """'mean [95 % interval] (t, p, Holm p)' for a table."""
        if self.n == 0:
            return "n/a"
        if self.n == 1:
            return f"{fmt.format(self.mean)} (1 pair)"
        ci = "" if self.ci_low is None else f" [{fmt.format(self.ci_low)}, {fmt.format(self.ci_high)}]"
        p = "-" if self.p is None else f"{self.p:.3g}"
        holm = "" if self.p_holm is None else f", Holm p={self.p_holm:.3g}"
        return f"{fmt.format(self.mean)}{ci} (t={self.t:.2f}, p={p}{holm})"


def sign_test(diffs: Sequence[float]) -> float | None:
    """Exact two-sided sign test of the non-zero differences (None when there are none)."""
    nz = [d for d in diffs if d != 0]
    n = len(nz)
    if n == 0:
        return None
    k = min(sum(d > 0 for d in nz), sum(d < 0 for d in nz))
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_diffs(diffs: Sequence[float]) -> Paired:
    """The statistics of paired differences."""
    d = [float(x) for x in diffs]
    n = len(d)
    if n == 0:
        return Paired(0, math.nan, math.nan, math.nan, 0, None, None, None, None, None)
    mean = statistics.fmean(d)
    if n == 1:
        return Paired(1, mean, math.nan, math.nan, 0, None, None, None, sign_test(d), None)
    std, df, se = statistics.stdev(d), n - 1, statistics.stdev(d) / math.sqrt(n)
    dist = _t()
    q975 = None if dist is None else float(dist.ppf(0.975, df))
    ci = (None, None) if q975 is None else (mean - q975 * se, mean + q975 * se)
    detectable = None if dist is None else (q975 + float(dist.ppf(0.8, df))) * se
    if std == 0.0:  # every pair differs by the same amount: no spread to test against
        t = 0.0 if mean == 0.0 else math.copysign(math.inf, mean)
        p = 1.0 if mean == 0.0 else None
    else:
        t = mean / se
        p = None if dist is None else float(2.0 * dist.sf(abs(t), df))
    return Paired(n, mean, std, t, df, p, ci[0], ci[1], sign_test(d), detectable)


def pairs_to_detect(std: float, effect: float, most: int = 10_000) -> int | None:
    """The fewest pairs n at which a paired difference of standard deviation ``std`` has a smallest
    detectable effect (t_{0.975, n−1} + t_{0.8, n−1})·std/√n of at most ``effect``; None without
    scipy or when more than ``most`` would be needed."""
    dist = _t()
    if dist is None or not std == std:
        return None
    if std == 0.0:
        return 2

    def detectable(n: int) -> float:
        return (float(dist.ppf(0.975, n - 1)) + float(dist.ppf(0.8, n - 1))) * std / math.sqrt(n)

    lo, hi = 2, 2
    while detectable(hi) > effect:  # detectable(n) falls with n: double, then bisect
        lo, hi = hi, hi * 2
        if hi > most:
            return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if detectable(mid) > effect else (lo, mid)
    return lo


def paired(values: Sequence[float | None], reference: Sequence[float | None]) -> Paired:
    """``values`` − ``reference``, entry by entry (the same index is the same seed); a None on either
    side drops that pair."""
    return paired_diffs(
        [a - b for a, b in zip(values, reference, strict=True) if a is not None and b is not None]
    )


def holm(ps: Sequence[float | None]) -> list[float | None]:
    """Holm-adjusted p-values of a family (a None stays None and does not count)."""
    present = sorted((p, i) for i, p in enumerate(ps) if p is not None)
    m = len(present)
    out: list[float | None] = [None] * len(ps)
    running = 0.0
    for j, (p, i) in enumerate(present):
        running = max(running, min(1.0, (m - j) * p))
        out[i] = running
    return out


def holm_family(family: dict[str, Paired]) -> dict[str, Paired]:
    """The same comparisons with ``p_holm`` filled in over the whole family."""
    names = list(family)
    adjusted = holm([family[k].p for k in names])
    return {k: replace(family[k], p_holm=a) for k, a in zip(names, adjusted, strict=True)}


def contrast_pairs(contrasts: list[tuple[str, str, str]], results: Sequence) -> dict[str, tuple]:
    """name -> (label a, label b, Paired a − b) of each contrast ((name, label a, label b)) with at
    least one seed both ran, from the runs' per-seed final losses. ``results``: RunResults (name,
    config["seed"], final_loss)."""
    finals = {(r.name, int(r.config.get("seed", 0))): r.final_loss for r in results}
    family = {}
    for name, a, b in contrasts:
        seeds = sorted(s for (lb, s) in finals if lb == b and (a, s) in finals)
        if seeds:
            family[name] = (a, b, paired_diffs([finals[a, s] - finals[b, s] for s in seeds]))
    return family


def contrast_table(contrasts: list[tuple[str, str, str]], results: Sequence) -> str:
    """The declared contrasts of a study ((name, label a, label b) each) from its runs' per-seed final
    losses, with Holm over the family, the sign test and, for each, the smallest paired effect the
    design detects. ``results``: RunResults (name, config["seed"], final_loss)."""
    family = contrast_pairs(contrasts, results)
    if not family:
        return ""
    held = holm_family({k: v[2] for k, v in family.items()})
    lines = [
        f"Declared contrasts (a − b in final validation loss, nats/byte, paired by seed; Holm over these "
        f"{len(held)}):",
        "",
        "| contrast | a − b | pairs | difference [95 % interval] (t, p, Holm p) | sign test p "
        "| smallest detectable |",
        "|---|---|---|---|---|---|",
    ]
    for name, (a, b, _) in family.items():
        d = held[name]
        sign = "-" if d.sign_p is None else f"{d.sign_p:.3g}"
        det = "-" if d.detectable is None or d.detectable != d.detectable else f"{d.detectable:.4f}"
        lines.append(f"| {name} | {a} − {b} | {d.n} | {d.cell()} | {sign} | {det} |")
    return "\n".join(lines)
