"""The dense strategies' wire buffers are reused across syncs: a set an applied sync leaves is cut
to the next fragment sent (fresh large buffers page-fault on the CPU), as many sets are kept as syncs
were in flight at once, and training is bit for bit what it is with fresh buffers every send."""

from __future__ import annotations

import pytest
import torch

from lowcomm_kernels import runtime as rt
from lowcomm_kernels.runtime.dense import DenseStrategy

from .rt_common import inner_step, make_model, make_opt, one_rank_world

STREAM = dict(num_fragments=3, sync_every=9, fragment_sync_delay=2)
SCENARIOS = {
    "streaming": (rt.StreamingDiLoCo, STREAM),
    "streaming_bf16_wire": (rt.StreamingDiLoCo, dict(STREAM, wire_dtype=torch.bfloat16)),
    "streaming_int4_ef": (rt.StreamingDiLoCo, dict(STREAM, wire_dtype="int4", error_feedback=True)),
    "cocodc": (rt.CoCoDC, dict(STREAM, syncs_per_period=4)),
    "cocodc_int8": (rt.CoCoDC, dict(STREAM, syncs_per_period=4, wire_dtype="int8")),
    "diloco": (rt.DiLoCo, dict(sync_every=4)),
}
STEPS = 30


@pytest.fixture(scope="module")
def group():
    with one_rank_world() as g:
        yield g


def _train(name: str, group, fresh: bool) -> tuple[torch.Tensor, set[int], int, DenseStrategy]:
    """Final parameters, the storages the syncs' payloads were written to, the most syncs in flight
    at once, and the strategy; ``fresh``: every send allocates its own buffers (the old behaviour)."""
    cls, kw = SCENARIOS[name]
    model = make_model(torch.float32)
    opt = make_opt(model)
    st = cls(model, opt, process_group=group, outer_lr=0.7, outer_momentum=0.9, **kw)
    if fresh:
        st._take_buffers = lambda n: ({}, {})  # type: ignore[method-assign]
    storages: set[int] = set()
    most = 0
    send = st._send

    def spy(p: int, t: int, reason: str) -> None:
        nonlocal most
        send(p, t, reason)
        storages.add(st.pending[-1].delta.untyped_storage().data_ptr())
        most = max(most, len(st.pending))

    st._send = spy  # type: ignore[method-assign]
    for t in range(1, STEPS + 1):
        inner_step(model, opt, 0, t)
        st.step()
    st.finish()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return params, storages, most, st


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_reused_buffers_train_bit_for_bit_as_fresh_ones(group, name):
    fresh, fresh_storages, _, _ = _train(name, group, fresh=True)
    reused, storages, most, st = _train(name, group, fresh=False)
    assert torch.equal(reused, fresh)
    syncs = st.metrics.num_syncs
    assert syncs >= 6
    # every payload was written into one of as many sets as syncs were in flight at once
    assert 1 <= len(storages) <= most < syncs
    assert len(st._spare) == len(storages)  # all applied by finish(): every set is spare again
    mem = st.memory_per_param()
    assert mem["spare"] > 0 and mem["extra"] == pytest.approx(
        mem["outer_state"] + mem["in_flight"] + mem["spare"], rel=1e-12
    )


def test_no_buffers_are_kept_off_the_cpu(group):
    """A GPU keeps none (its caching allocator reuses freed memory), nor a strategy whose outer state
    is on another device than the model (the payload is copied across on send). Checked on the CPU
    by making the strategy believe its devices are others."""
    cls, kw = SCENARIOS["streaming"]
    model = make_model(torch.float32)
    st = cls(model, make_opt(model), process_group=group, outer_lr=0.7, outer_momentum=0.9, **kw)
    assert st._take_buffers(10)[0]  # the CPU: a set
    st.outer_dev = st.device = torch.device("meta")  # an accelerator
    assert st._take_buffers(10) == ({}, {})
    st.outer_dev, st.device = torch.device("cpu"), torch.device("meta")  # outer state on the host
    assert st._take_buffers(10) == ({}, {})
