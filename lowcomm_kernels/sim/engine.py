"""The discrete-event simulation of one replica's timeline and the shared link.

Each inner step is the DAG of ``Workload``: forward nodes 1..L, then backward nodes L..1
(activations, then weights; no activations node for layer 1), every node ``node_s`` long. A sync's
collectives enter the link FIFO when their data is ready and complete ``Link.delay_s`` after their
last byte; the compute waits only where it needs a result:

- ``layerwise=True`` (the Streaming DiLoCo paper's simulator): one collective per layer, issued as
  soon as that layer's backward w.r.t. its weights is done, so reductions overlap the rest of the
  backward; the forward of layer l in the step that needs the result waits for layer l's collective.
- ``layerwise=False`` (what this package's runtime does): one collective per sync, issued after the
  optimizer step; its result is waited for and merged at the end of step send + τ, in the runtime's
  order: the results due at a step before that step's sends, a blocking (τ = 0) sync right after
  its own send.

Only the steps that send or need a sync are simulated node by node (numpy over the layers); the
others advance the clock by the step time, since nothing they do can wait. With the link FIFO, the
forward's waits and the link's queue are both running maxima: with need times n_l and node time f,
the forward of layer l ends at f·l + max(t0, max_{j≤l}(n_j − (j−1)·f)); a queue of chunks with ready
times r_k and busy times d_k (cumulative D_k) finishes chunk k at D_k + max(free, max_{j≤k}(r_j −
D_{j−1})). Every quantity below is in seconds of the replica's clock, which all replicas share (they
are identical and synchronous by construction).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from .link import Link
from .methods import Method, Sync
from .workload import Workload


@dataclass(frozen=True)
class SimResult:
    """One simulation over a window of ``steps`` steps: ``wall_s`` from the window's first step's
    start to its last step's end, ``compute_s`` = steps × step time, ``exposed_s`` the waits for
    results, ``overhead_s`` the sync work on the compute timeline (pack/merge; 0 unless given),
    ``wire_bytes`` what one replica put on its link for the syncs sent in the window."""

    steps: int
    wall_s: float
    compute_s: float
    exposed_s: float
    overhead_s: float
    wire_bytes: float
    syncs: int

    @property
    def utilisation(self) -> float:
        """Compute utilisation: compute / (compute + exposed communication + sync overhead); at most
        1 (a wall a rounding error shorter than the compute is the compute)."""
        return min(1.0, self.compute_s / self.wall_s)


class _Timeline:
    def __init__(
        self, workload: Workload, link: Link, layerwise: bool, pack_s: float, merge_s: float
    ) -> None:
        self.w, self.link, self.layerwise = workload, link, layerwise
        self.pack_s, self.merge_s = pack_s, merge_s
        L, f = workload.layers, workload.node_s
        self.L, self.f = L, f
        self.fwd_offset = np.arange(L) * f  # (j − 1)·f for layer j = 1..L
        # backward, layer by layer from L: activations, then weights (layer 1: weights only), so
        # layer l's gradient is ready after node 2(L − l) + 2, layer 1's after the last, 2L − 1
        l = np.arange(1, L + 1)
        self.grad_ready = np.where(l >= 2, 2 * (L - l) + 2, 2 * L - 1) * f  # after the backward's start
        self.bwd_s = (2 * L - 1) * f
        self.link_free = 0.0
        self.need_layer: dict[int, np.ndarray] = {}
        self.need_whole: dict[int, float] = defaultdict(lambda: -np.inf)
        self.merges: dict[int, int] = defaultdict(int)
        self.exposed = 0.0
        self.overhead = 0.0
        self.wire = 0.0

    def step(self, t: int, t0: float, sends: list[Sync]) -> float:
        """Run step ``t`` from time t0 (its sends and the waits of the results it needs); returns its end."""
        L, f = self.L, self.f
        start = t0
        need = self.need_layer.pop(t, None)
        if need is not None:
            g = max(start, float(np.max(need - self.fwd_offset)))
            self.exposed += g - start
            start = g
        bwd0 = start + L * f
        end = self._merge_due(t + 1, bwd0 + self.bwd_s)  # results sent at earlier steps, due now
        for s in sends:
            end += self.pack_s
            self.overhead += self.pack_s
            busy = np.array([self.link.busy_s(b, s.collective) for b in s.payload])
            self.wire += sum(self.link.wire_bytes(b, s.collective) for b in s.payload)
            delay = self.link.delay_s(s.collective)
            if s.whole or not self.layerwise:
                self.merges[s.need_step] += 1
                done = max(end, self.link_free) + busy.sum()
                self.link_free = done
                self.need_whole[s.need_step] = max(self.need_whole[s.need_step], done + delay)
                continue
            order = np.argsort(-np.asarray(s.layers), kind="stable")  # readiness: the last layer first
            layers, busy = np.asarray(s.layers)[order], busy[order]
            D = np.cumsum(busy)
            r = bwd0 + self.grad_ready[layers] - (D - busy)
            done = D + np.maximum(self.link_free, np.maximum.accumulate(r))
            self.link_free = float(done[-1])
            arr = self.need_layer.setdefault(s.need_step, np.full(L, -np.inf))
            np.maximum.at(arr, layers, done + delay)
        return self._merge_due(t + 1, end)  # τ = 0: the results of this step's own sends

    def _merge_due(self, need_step: int, now: float) -> float:
        """At the end of a step, wait for the whole-sync results the next step needs and merge them
        (the runtime's hook: results due at a step are applied before its sends, τ = 0 after)."""
        if need_step not in self.need_whole:
            return now
        done = max(now, self.need_whole.pop(need_step))
        self.exposed += done - now
        merge = self.merges.pop(need_step, 0) * self.merge_s
        self.overhead += merge
        return done + merge


#: warm-up periods of an eager method: its backlog grows by (link time − compute) per period until it
#: exceeds its slack of about a period, so it reaches its steady state within this many periods
#: unless a period's bytes take less than about 1.1 periods of compute on the link (there its
#: utilisation comes out slightly high)
EAGER_WARMUP_PERIODS = 10


def simulate(
    workload: Workload,
    method: Method,
    link: Link,
    *,
    layerwise: bool = True,
    steps: int | None = None,
    warmup: int | None = None,
    pack_s: float = 0.0,
    merge_s: float = 0.0,
) -> SimResult:
    """Simulate ``warmup`` steps, then measure over ``steps`` more (defaults: one period of warm-up
    and two measured, a period being the steps after which the schedule repeats: H, K / gcd(N, K)
    times H for CoCoDC, 4 steps for data-parallel). ``warmup=0`` with a given
    ``steps`` simulates a run from its start, e.g. to predict one of this package's runs;
    ``pack_s`` / ``merge_s``: seconds of sync work on the compute timeline per send / per merge."""
    P = method.schedule_period(workload, link)
    if warmup is None:
        # eager: a result is needed a whole period after its send, so a link slower than a period's
        # bytes per period builds a backlog for several periods before the compute waits on it
        warmup = 2 if P == 1 else P * (EAGER_WARMUP_PERIODS if method.eager else 1)
    if steps is None:
        steps = 4 if P == 1 else 2 * P
    total = warmup + steps
    syncs = method.syncs(workload, link, total)
    by_step: dict[int, list[Sync]] = defaultdict(list)
    for s in syncs:
        by_step[s.step].append(s)
    # a step is simulated node by node when it sends, or ends with a merge (whole syncs: step
    # need − 1), or waits in its forward (layerwise: step need)
    due = {t for s in syncs for t in (s.need_step - 1, s.need_step)}
    events = sorted(t for t in set(by_step) | due if 1 <= t <= total)
    tl = _Timeline(workload, link, layerwise, pack_s, merge_s)
    T = workload.step_s
    clock, at = 0.0, 1  # time at the start of step `at`
    marks: dict[str, float] = {}
    counted = {"exposed": 0.0, "overhead": 0.0, "wire": 0.0}

    def advance_to(target: int) -> None:  # plain steps up to the start of step `target`
        nonlocal clock, at
        if at <= warmup + 1 <= target and "start" not in marks:
            marks["start"] = clock + (warmup + 1 - at) * T
            counted.update(exposed=tl.exposed, overhead=tl.overhead, wire=tl.wire)
        clock += (target - at) * T
        at = target

    for e in events:
        advance_to(e)
        clock = tl.step(e, clock, by_step.get(e, []))
        at = e + 1
    advance_to(total + 1)
    wall = clock - marks["start"]
    sent = sum(1 for s in syncs if s.step > warmup)
    return SimResult(
        steps=steps,
        wall_s=wall,
        compute_s=steps * T,
        exposed_s=tl.exposed - counted["exposed"],
        overhead_s=tl.overhead - counted["overhead"],
        wire_bytes=tl.wire - counted["wire"],
        syncs=sent,
    )
