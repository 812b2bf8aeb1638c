"""Goodput under failures: the fraction of wall-clock time spent on steps that count.

Replicas fail independently, each at rate 1/MTBF. First-order expectations (valid while the time a
failure costs is small against the MTBF), with U the compute utilisation without failures:

- **data-parallel** (one job): any replica's failure stops the job, which restarts from its last
  checkpoint. Job failure rate λ = M / MTBF; each failure costs the restart R and, on average, half a
  checkpoint interval C of lost work; writing a checkpoint takes w every C seconds. Without a given
  C, the Young/Daly interval C = √(2·w/λ).

      goodput = U · C/(C + w) · (1 − λ·(R + C/2))

- **DiLoCo family** (quorum and heal, as this package's torchft path does): the failed replica drops
  out and the others go on after the quorum notices, a stall of ``detect_s`` for everyone; the
  replica comes back after R and heals by fetching the state from a peer over the link (``heal_bytes
  _per_param`` × parameters / bandwidth); its local progress since its last sync is lost, on
  average half a sync period (H/2 steps at the failure-free step time T/U). Per replica the lost
  share of capacity is (R + heal + lost)/MTBF, and every failure stalls all M replicas:

      goodput = U · (1 − (R + heal + lost)/MTBF − M·detect/MTBF)

``DETECT_S`` is measured, not assumed: the mean time from a SIGKILL of one replica to the
survivors' next committed sync, 3 seeds, from ``bench/ft_recovery.py`` (its result file
bench/figures/ft_recovery.json, key summary.lowcomm.kill_to_commit_s). It is dominated by the
Lighthouse's heartbeat timeout (1 s in that run), a setting, so it does not grow with the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .link import Link
from .methods import Method
from .workload import Workload

#: seconds from a replica's SIGKILL to the survivors' next committed sync (bench/ft_recovery.py)
DETECT_S = 1.037
#: bytes per parameter a healing replica fetches: g and u (fp32 outer state), x (fp32), and the
#: inner AdamW's two fp32 moments
HEAL_BYTES_PER_PARAM = 20.0


def _nonneg(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class Failures:
    """Per-replica ``mtbf_h`` (hours); ``restart_s``: a replica (or the job) back up after a failure;
    ``detect_s``: the survivors' stall per failure; ``checkpoint_s`` / ``checkpoint_every_s``: a
    data-parallel checkpoint's write time and interval (None: Young/Daly)."""

    mtbf_h: float
    restart_s: float = 600.0
    detect_s: float = DETECT_S
    checkpoint_s: float = 60.0
    checkpoint_every_s: float | None = None
    heal_bytes_per_param: float = HEAL_BYTES_PER_PARAM

    def __post_init__(self) -> None:
        if not (isinstance(self.mtbf_h, (int, float)) and math.isfinite(self.mtbf_h) and self.mtbf_h > 0):
            raise ValueError(f"mtbf_h must be a finite number > 0, got {self.mtbf_h!r}")
        for name in ("restart_s", "detect_s", "checkpoint_s", "heal_bytes_per_param"):
            _nonneg(name, getattr(self, name))
        if (
            self.checkpoint_every_s is not None
            and _nonneg("checkpoint_every_s", self.checkpoint_every_s) == 0
        ):
            raise ValueError("checkpoint_every_s must be > 0")

    @property
    def mtbf_s(self) -> float:
        return self.mtbf_h * 3600.0


@dataclass(frozen=True)
class Goodput:
    """``fraction`` of wall-clock on useful steps; ``lost`` the shares that went elsewhere."""

    fraction: float
    utilisation: float
    lost: dict[str, float]


def goodput(utilisation: float, workload: Workload, method: Method, link: Link, f: Failures) -> Goodput:
    M = link.replicas
    if method.kind == "data-parallel":
        lam = M / f.mtbf_s
        C = f.checkpoint_every_s if f.checkpoint_every_s is not None else math.sqrt(2 * f.checkpoint_s / lam)
        write = f.checkpoint_s / (C + f.checkpoint_s)
        failures = lam * (f.restart_s + C / 2)
        frac = utilisation * (1 - write) * (1 - failures)
        lost = {"checkpoint writes": write, "restart + rework": failures}
    else:
        heal = f.heal_bytes_per_param * workload.params / link.bytes_per_s
        step_wall = workload.step_s / utilisation
        rework = method.sync_every / 2 * step_wall
        down = (f.restart_s + heal + rework) / f.mtbf_s
        stall = M * f.detect_s / f.mtbf_s
        frac = utilisation * (1 - down - stall)
        lost = {"replica restart + heal + rework": down, "survivors' stall": stall}
    return Goodput(max(0.0, frac), utilisation, lost)
