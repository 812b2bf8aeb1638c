"""The simulator checked against this package's runtime: real runs, and the simulator's prediction of them.

Each configuration trains the CLI's tiny LM for real (worker processes, gloo, the emulated WAN of
``runtime.transport``); the simulator (``lowcomm_kernels.sim``) is then fed what the run measured
of its own compute: the mean time of a sync's pack and of its merge (the runtime's sync records),
and the mean inner step (rank 0's wall-clock less its exposed communication and that sync work, over
the steps: compute plus the runtime's per-step bookkeeping), and predicts the exposed communication and the
wall-clock. The simulation is set up as the run is: the link is the emulated one (latency once per
collective, ring bytes 2(M−1)/M × payload, one FIFO link per worker), a sync is one collective
issued after the optimizer step and merged before the step that needs it (``layerwise=False``), the
fragments are the runtime's own (``FlatFragments`` of the same model), and the run starts cold
(``warmup=0``) and ends at its last step (the syncs still in flight then are outside its wall-clock,
as ``lowcomm train`` measures it).

    python -m lowcomm_kernels.train.simcheck --out docs/data/sim-vs-runtime

What the prediction cannot see: the jitter of individual steps (it uses their mean) and the time
gloo itself takes on loopback beside the emulated link's sleeps. Only the exposed communication is
an independent prediction: the step fed in is the measured wall-clock less the measured exposed time
and sync work, so the predicted wall-clock differs from the measured one by exactly the exposed
error (reported for scale). The test (tests/sim/test_runtime_check.py) holds the exposed
communication to within 15 %.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..runtime.fragments import FlatFragments
from ..runtime.schedule import cocodc_auto_syncs, cocodc_max_syncs
from ..runtime.transport import WAN, ring_wire_bytes
from ..sim import Link, Method, Workload, simulate
from ..sim.methods import wire_bytes
from . import provenance
from .model import TinyLlama
from .report import RunResult
from .runner import run_specs
from .spec import TrainSpec
from .tasks.lm import load_checked_corpus

TOLERANCE = 0.15
#: the emulated link of every check: 100 Mbit/s, 300 ms one way, so that what is exposed is well above
#: the jitter of τ steps (a step is 25-60 ms here, more on a loaded machine)
LINK = dict(latency_s=0.3, bandwidth_bytes_per_s=12.5e6)


@dataclass(frozen=True)
class Check:
    """One configuration: ``spec`` is run, then simulated."""

    label: str
    spec: TrainSpec


def _spec(**kw: Any) -> TrainSpec:
    base: dict[str, Any] = dict(
        workers=2,
        steps=60,
        batch_size=8,
        eval_every=60,
        eval_bytes=4096,
        sync_every=20,
        num_fragments=4,
        **LINK,
    )
    base.update(kw)
    return TrainSpec(**base)


CHECKS = (
    Check("data-parallel", _spec(method="dp", steps=30, eval_every=30)),
    Check("DiLoCo H=20", _spec(method="diloco")),
    Check("DiLoCo H=20, int8 wire", _spec(method="diloco", wire_dtype="int8")),
    Check("Streaming K=4, tau=1", _spec(method="streaming", fragment_sync_delay=1)),
    Check("Streaming K=4, tau=2", _spec(method="streaming", fragment_sync_delay=2)),
    Check(
        "Streaming K=4, tau=1, int4 wire", _spec(method="streaming", fragment_sync_delay=1, wire_dtype="int4")
    ),
    Check(
        "CoCoDC K=4, tau=2, round-robin", _spec(method="cocodc", fragment_sync_delay=2, score="round_robin")
    ),
    Check("LOSCAR p=0.25, Q=2", _spec(method="loscar", density=0.25, fragment_sync_delay=2)),
)
QUICK = ("DiLoCo H=20", "Streaming K=4, tau=1")  # the test's: the least sensitive to a loaded machine


def sim_method(spec: TrainSpec) -> Method:
    """The simulator's twin of the run's strategy."""
    common: dict[str, Any] = dict(wire=spec.wire_dtype, quant_block=spec.quant_block)
    if spec.method == "dp":
        return Method("data-parallel", wire="fp32")
    if spec.method == "diloco":
        return Method("diloco", sync_every=spec.sync_every, **common)
    if spec.method == "streaming":
        return Method(
            "streaming", sync_every=spec.sync_every, overlap=spec.fragment_sync_delay,
            num_fragments=spec.num_fragments, **common,
        )  # fmt: skip
    if spec.method == "cocodc":
        return Method(
            "cocodc", sync_every=spec.sync_every, overlap=spec.fragment_sync_delay,
            num_fragments=spec.num_fragments, syncs_per_period=cocodc_syncs(spec), **common,
        )  # fmt: skip
    if spec.method == "loscar":
        N, Q = spec.resolved_local_steps(), spec.fragment_sync_delay
        return Method("loscar", sync_every=N + Q, overlap=Q, density=spec.density, **common)
    raise ValueError(f"no simulated twin for method {spec.method!r}")


def fragment_sizes(spec: TrainSpec) -> tuple[int, ...]:
    """The runtime's fragments of the run's model (one 'layer' per fragment for the simulator)."""
    if spec.method in ("streaming", "cocodc"):
        return tuple(FlatFragments(TinyLlama(spec.model), spec.num_fragments).sizes())
    return (sum(p.numel() for p in TinyLlama(spec.model).parameters()),)


def cocodc_syncs(spec: TrainSpec) -> int:
    """CoCoDC's N as the run computes it (timing 'emulated': T_c = the spec's step time, T_s = the
    emulated link's time of the mean fragment), by the runtime's own rule."""
    if spec.syncs_per_period != "auto":
        return int(spec.syncs_per_period)
    sizes = fragment_sizes(spec)
    wan = WAN(spec.latency_s, spec.bandwidth_bytes_per_s)
    mean = sum(
        ring_wire_bytes(int(wire_bytes(spec.wire_dtype, n, spec.quant_block)), spec.workers) for n in sizes
    )
    T_s = wan.latency_s + wan.transfer_s(mean / len(sizes))
    H, tau = spec.sync_every, spec.fragment_sync_delay
    return cocodc_auto_syncs(
        spec.gamma, H, spec.step_time_ms / 1e3, T_s, spec.num_fragments, cocodc_max_syncs(H, tau)
    )


@dataclass
class Outcome:
    label: str
    method: str
    steps: int
    step_s: float
    measured_wall_s: float
    measured_exposed_s: float
    predicted_wall_s: float
    predicted_exposed_s: float
    syncs: int
    config: dict = field(default_factory=dict)

    @property
    def wall_error(self) -> float:
        return self.predicted_wall_s / self.measured_wall_s - 1

    @property
    def exposed_error(self) -> float:
        return (
            self.predicted_exposed_s / self.measured_exposed_s - 1
            if self.measured_exposed_s > 0
            else math.inf
        )

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__, wall_error=self.wall_error, exposed_error=self.exposed_error)


def predict(spec: TrainSpec, result: RunResult) -> Outcome:
    """Feed the run's measured step into the simulator and predict its exposed comm and wall-clock."""
    steps, sizes, method = spec.steps, fragment_sizes(spec), sim_method(spec)
    link = Link(
        spec.bandwidth_bytes_per_s * 8 / 1e9, spec.latency_s, max(2, spec.workers), latency_model="once"
    )
    # the sync work (pack before a send, merge after a wait) where it happens, the rest spread over
    # the steps: the simulator's count of sends and merges tells how much of the wall-clock it is
    work = dict(pack_s=result.extra.get("pack_s_mean", 0.0), merge_s=result.extra.get("merge_s_mean", 0.0))
    probe = simulate(
        Workload(spec.method, sizes, 1.0), method, link, layerwise=False, steps=steps, warmup=0, **work
    )
    step_s = (result.train_wall_s - result.exposed_s - probe.overhead_s) / steps
    w = Workload(spec.method, sizes, step_s)
    sim = simulate(w, method, link, layerwise=False, steps=steps, warmup=0, **work)
    return Outcome(
        label=spec.name or spec.method,
        method=spec.method,
        steps=steps,
        step_s=step_s,
        measured_wall_s=result.train_wall_s,
        measured_exposed_s=result.exposed_s,
        predicted_wall_s=sim.wall_s,
        predicted_exposed_s=sim.exposed_s,
        syncs=sim.syncs,
        config={k: v for k, v in result.config.items() if k not in ("model",)},
    )


def run(checks: tuple[Check, ...] | list[Check], progress: bool = False) -> list[Outcome]:
    """Run every check for real (one launch per worker count) and predict each."""
    specs = [c.spec.with_(name=c.label) for c in checks]
    corpus = load_checked_corpus(None, specs)
    outcomes: list[Outcome] = []
    for world in sorted({s.workers for s in specs}):
        group = [s for s in specs if s.workers == world]
        for spec, result in zip(group, run_specs(group, corpus, progress=progress), strict=True):
            outcomes.append(predict(spec, result))
    order = [c.label for c in checks]
    return sorted(outcomes, key=lambda o: order.index(o.label))


def table(outcomes: list[dict[str, Any]]) -> str:
    """The check's table from its JSON outcomes (``Outcome.as_dict``)."""
    rows = [
        "| configuration | steps | step (ms) | exposed comm, measured (s) | predicted (s) | error | "
        "wall-clock, measured (s) | predicted (s) | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        rows.append(
            f"| {o['label']} | {o['steps']} | {o['step_s'] * 1e3:.1f} | {o['measured_exposed_s']:.3f} | "
            f"{o['predicted_exposed_s']:.3f} | {o['exposed_error']:+.1%} | {o['measured_wall_s']:.3f} | "
            f"{o['predicted_wall_s']:.3f} | {o['wall_error']:+.1%} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lowcomm_kernels.train.simcheck", description=__doc__)
    p.add_argument("--out", required=True, help="folder for results.json and table.md")
    p.add_argument("--quick", action="store_true", help="only " + ", ".join(QUICK))
    args = p.parse_args(argv)
    since = provenance.begin(argv if argv is not None else sys.argv[1:], prog=f"python -m {__spec__.name}")
    checks = [c for c in CHECKS if not args.quick or c.label in QUICK]
    t0 = time.perf_counter()
    outcomes = run(checks, progress=True)
    md = table([o.as_dict() for o in outcomes])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "title": "the simulator's prediction of real runs (2 workers, the tiny LM, the emulated WAN)",
        "link": LINK,
        "tolerance": TOLERANCE,
        "outcomes": [
            dict(o.__dict__, wall_error=o.wall_error, exposed_error=o.exposed_error) for o in outcomes
        ],
        "elapsed_s": time.perf_counter() - t0,
        "provenance": provenance.collect(since),
    }
    (out / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / "table.md").write_text(md + "\n")
    print(md)
    bad = [o.label for o in outcomes if abs(o.exposed_error) > TOLERANCE]
    print(f"\nwrote {out / 'results.json'}; outside {TOLERANCE:.0%}: {', '.join(bad) or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
