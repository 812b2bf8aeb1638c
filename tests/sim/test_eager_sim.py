"""The simulator's eager updates: a sync's result is needed a whole period after its send (at the
fragment's next send), so the link has a period to carry it; beyond that rate the backlog throttles
the compute to the link's pace."""

from __future__ import annotations

import pytest

from lowcomm_kernels import cli
from lowcomm_kernels.sim import Link, Method, Workload, simulate
from lowcomm_kernels.sim.methods import wire_bytes

W = Workload.uniform("toy", 1e9, 24, 0.1)


def test_result_needed_at_the_next_send():
    link = Link(1.0)
    for kind in ("diloco", "streaming"):
        m = Method(kind, sync_every=20, num_fragments=4 if kind == "streaming" else None, eager=True)
        syncs = m.syncs(W, link, 100)
        assert syncs and all(s.need_step == s.step + 20 + 1 for s in syncs)


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_link_that_carries_a_period_in_a_period_exposes_nothing(layerwise):
    """bf16 1B on 2 replicas: 16 Gbit per sync; at 2 Gbit/s that is 8 s, inside a period of 10 s
    (H = 100 steps of 0.1 s): eager hides it entirely where blocking DiLoCo exposes it."""
    link = Link(2.0, replicas=2)
    eager = simulate(W, Method("diloco", sync_every=100, wire="bf16", eager=True), link, layerwise=layerwise)
    blocking = simulate(W, Method("diloco", sync_every=100, wire="bf16"), link, layerwise=layerwise)
    assert eager.exposed_s == pytest.approx(0.0, abs=1e-9)
    assert eager.utilisation == pytest.approx(1.0)
    assert blocking.exposed_s > 1.0


@pytest.mark.parametrize("kind", ["diloco", "streaming"])
def test_a_slower_link_sets_the_pace(kind):
    """At 1 Gbit/s a period's 16 Gbit take 16 s against 10 s of compute: in the steady state the
    compute runs at the link's pace, utilisation 10/16 (the warm-up lets the backlog build)."""
    link = Link(1.0, replicas=2)
    m = Method(kind, sync_every=100, wire="bf16", eager=True)
    r = simulate(W, m, link, layerwise=False)
    period_bytes = sum(wire_bytes("bf16", n) for n in W.layer_params)  # 2(M−1)/M = 1 for M = 2
    bound = 100 * 0.1 / (period_bytes * 8 / 1e9)
    assert r.utilisation == pytest.approx(bound, rel=0.02)


def test_bad_input_refused():
    with pytest.raises(ValueError, match="eager overlaps a whole period: diloco or streaming with overlap 0"):
        Method("cocodc", sync_every=10, overlap=1, eager=True)
    with pytest.raises(ValueError, match="got streaming with overlap=1"):
        Method("streaming", sync_every=10, overlap=1, eager=True)
    with pytest.raises(ValueError, match="eager must be a bool"):
        Method("diloco", eager="yes")


def test_cli_rows_on_request(capsys):
    argv = ["simulate", "--model", "1B", "--methods", "diloco,diloco-eager,streaming-eager", "--wire", "bf16"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "| diloco-eager bf16 |" in out and "| streaming-eager bf16 |" in out
