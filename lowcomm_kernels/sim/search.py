"""The two questions: the compute utilisation at a bandwidth, and the bandwidth a utilisation needs.

For a fixed schedule, utilisation never falls when the bandwidth grows (a faster link finishes every
collective no later, and the FIFO link and the waits are monotone in the finish times), so the
bandwidth for a target is found by bisection on log(bandwidth). CoCoDC's adaptive N is the
exception: a faster link raises N (more syncs per period), which can lower the utilisation, so its
curve can rise, fall back below a level and rise again. For it the search first scans a grid of
``SCAN_PER_DECADE`` points per decade and bisects between the first grid point that reaches the
level and the one before it (a dip narrower than one grid step can be missed).

``PAPER_GRID`` is the grid the Streaming DiLoCo paper's table reads from (50 points, logarithmically
spaced from 0.1 to 1000 Gbit/s: every value it prints lies on it); ``grid_reading`` gives what that
table would print for our threshold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from .engine import simulate
from .link import Link
from .methods import Method
from .workload import Workload

CU_LEVELS = (0.5, 0.8, 0.9, 0.95, 0.99)
PAPER_GRID = tuple(float(x) for x in np.logspace(-1, 3, 50))
#: the search's bracket, Gbit/s: 1 kbit/s to 1 Pbit/s
LO_GBPS, HI_GBPS = 1e-6, 1e6
SCAN_PER_DECADE = 8


def utilisation(workload: Workload, method: Method, link: Link, **kw: object) -> float:
    return simulate(workload, method, link, **kw).utilisation  # type: ignore[arg-type]


def bandwidth_for(
    target: float,
    cu_at: Callable[[float], float],
    rel_tol: float = 1e-4,
    monotone: bool = True,
) -> float | None:
    """The smallest bandwidth (Gbit/s) at which ``cu_at(gbps) >= target``, to ``rel_tol``;
    ``LO_GBPS`` when the bracket's low end reaches it already; None when no bandwidth up to
    ``HI_GBPS`` does (latency or fixed costs alone exceed the budget). ``monotone=False``: scan
    first (module docstring)."""
    if not 0 < target < 1:
        raise ValueError(f"a target utilisation must lie in (0, 1), got {target}")
    lo, hi = math.log(LO_GBPS), math.log(HI_GBPS)
    if cu_at(LO_GBPS) >= target:
        return LO_GBPS
    if monotone:
        if cu_at(HI_GBPS) < target:
            return None
    else:
        n = round((hi - lo) / math.log(10) * SCAN_PER_DECADE)
        grid = [lo + (hi - lo) * i / n for i in range(n + 1)]
        first = next((i for i, x in enumerate(grid) if cu_at(math.exp(x)) >= target), None)
        if first is None:
            return None
        lo, hi = grid[first - 1], grid[first]
    while hi - lo > rel_tol:
        mid = 0.5 * (lo + hi)
        if cu_at(math.exp(mid)) >= target:
            hi = mid
        else:
            lo = mid
    return math.exp(hi)


def grid_reading(threshold: float | None, grid: Sequence[float] = PAPER_GRID) -> float | None:
    """The largest grid point below ``threshold``: the reading of the paper's table (on all the rows
    we reproduce exactly, its printed value is the last grid point that does *not* yet reach the
    level); None above the grid's end."""
    if threshold is None or threshold > grid[-1]:
        return None
    below = [g for g in grid if g < threshold]
    return below[-1] if below else grid[0]


def grid_index(gbps: float, grid: Sequence[float] = PAPER_GRID) -> int:
    """The index of the grid point nearest ``gbps`` on a log scale (the paper prints its grid's
    points rounded to one decimal, so a printed value is matched by its nearest point)."""
    return min(range(len(grid)), key=lambda i: abs(math.log(grid[i] / gbps)))


def bandwidth_table(
    workload: Workload,
    method: Method,
    link: Link,
    levels: Sequence[float] = CU_LEVELS,
    **kw: object,
) -> dict[float, float | None]:
    """Gbit/s needed for each utilisation level (None: not reachable at any bandwidth)."""
    cache: dict[float, float] = {}

    def cu_at(gbps: float) -> float:
        if gbps not in cache:
            cache[gbps] = utilisation(workload, method, link.with_gbps(gbps), **kw)
        return cache[gbps]

    monotone = not (method.kind == "cocodc" and method.syncs_per_period == "auto")
    return {level: bandwidth_for(level, cu_at, monotone=monotone) for level in levels}
