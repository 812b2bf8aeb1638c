"""The simulator against the runtime: real runs over the emulated WAN, and its prediction of them.

Two configurations of ``lowcomm_kernels.train.simcheck`` (blocking DiLoCo and Streaming DiLoCo with
τ = 1, 2 workers, the tiny LM, 100 Mbit/s and 300 ms): the simulator, fed with each run's measured
step and sync work, must predict the exposed communication within 15 % (the wall-clock is not an
independent check: the step fed in is the measured wall less the exposed time, so its error is the
exposed error, diluted; the test pins that identity instead). The full
set of eight configurations is ``python -m lowcomm_kernels.train.simcheck --out DIR``, whose
committed result is rendered in docs/results.md.
"""

from __future__ import annotations

import pytest

from lowcomm_kernels.train import simcheck

pytestmark = pytest.mark.slow


@pytest.mark.serial  # measured exposed time within 15 %: in a parallel run, alone (conftest.py)
def test_the_simulator_predicts_real_runs_within_15_percent():
    checks = [c for c in simcheck.CHECKS if c.label in simcheck.QUICK]
    assert len(checks) == 2
    outcomes = simcheck.run(checks)
    table = simcheck.table([o.as_dict() for o in outcomes])  # what lowcomm report renders
    assert all(c.label in table for c in checks)
    # a real-timing measurement on a shared 2-core machine: a configuration that misses is measured
    # once more (CI once read 45 % for DiLoCo under load, which then passed alone); the second
    # measurement must hold, and both are shown
    missed = [c for c, o in zip(checks, outcomes, strict=True) if abs(o.exposed_error) > simcheck.TOLERANCE]
    if missed:
        again = dict(zip([c.label for c in missed], simcheck.run(missed), strict=True))
        print("re-measured:", [(o.as_dict(), again[o.label].as_dict()) for o in outcomes if o.label in again])
        outcomes = [again.get(o.label, o) for o in outcomes]
    for o in outcomes:
        assert o.measured_exposed_s > 0.3  # the comm to predict is well above a step's jitter
        assert abs(o.exposed_error) <= simcheck.TOLERANCE, o.as_dict()
        # the wall-clock differs by the exposed error alone (sync work and steps are fed in)
        diff = o.predicted_wall_s - o.measured_wall_s
        assert diff == pytest.approx(o.predicted_exposed_s - o.measured_exposed_s, abs=1e-6), o.as_dict()
        assert o.syncs >= 3


def test_the_twin_of_each_check_is_the_runs_method():
    kinds = {c.spec.method: simcheck.sim_method(c.spec).kind for c in simcheck.CHECKS}
    assert kinds == {
        "dp": "data-parallel",
        "diloco": "diloco",
        "streaming": "streaming",
        "cocodc": "cocodc",
        "loscar": "loscar",
    }
    loscar = next(c.spec for c in simcheck.CHECKS if c.spec.method == "loscar")
    m = simcheck.sim_method(loscar)
    assert (m.sync_every, m.overlap) == (loscar.resolved_local_steps() + 2, 2)
