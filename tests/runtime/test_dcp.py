"""A strategy inside torch.distributed.checkpoint (runtime.dcp.DCPState): save with results pending,
resume into a fresh strategy, and the trajectory goes on exactly as without the interruption."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from lowcomm_kernels.runtime import StreamingDiLoCo
from lowcomm_kernels.runtime.dcp import DCPState


@pytest.fixture(scope="module")
def group():
    owner = not dist.is_initialized()
    if owner:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist.group.WORLD
    if owner:  # later tests in this process (the Hugging Face callback's) expect no default group
        dist.destroy_process_group()


def _make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strat = StreamingDiLoCo(
        model, opt, sync_every=4, num_fragments=2, fragment_sync_delay=1, outer_lr=0.7, outer_momentum=0.9
    )
    return model, opt, strat


def _train(model, opt, strat, steps, gen):
    with strat:
        for _ in range(steps):
            loss = model(torch.randn(8, 4, generator=gen)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_dcp_round_trip_with_pending_results(group, tmp_path):
    gen = torch.Generator().manual_seed(1)
    model, opt, strat = _make()
    _train(model, opt, strat, 6, gen)
    assert len(strat.pending) == 1  # a fragment in flight at the save
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "strategy": DCPState(strat)}
    dcp.save(state, checkpoint_id=str(tmp_path))
    gen_state = gen.get_state()
    _train(model, opt, strat, 10, gen)  # the uninterrupted run

    model2, opt2, strat2 = _make()
    loaded = {"model": model2.state_dict(), "opt": opt2.state_dict(), "strategy": DCPState(strat2)}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["opt"])
    assert strat2.step_count == 6 and len(strat2.pending) == 1
    gen.set_state(gen_state)
    _train(model2, opt2, strat2, 10, gen)
    assert torch.equal(strat2.g, strat.g) and torch.equal(strat2.u, strat.u)
    assert torch.equal(strat2.frags.flat, strat.frags.flat)
    strat.close()
    strat2.close()


def test_dcp_refuses_another_model(group, tmp_path):
    model, opt, strat = _make()
    dcp.save({"strategy": DCPState(strat)}, checkpoint_id=str(tmp_path))
    strat.close()
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    o2 = torch.optim.SGD(other.parameters(), lr=0.1)
    s2 = StreamingDiLoCo(
        other, o2, sync_every=4, num_fragments=2, fragment_sync_delay=1, outer_lr=0.7, outer_momentum=0.9
    )
    with pytest.raises(CheckpointException):  # DCP itself refuses a g of another size
        dcp.load({"strategy": DCPState(s2)}, checkpoint_id=str(tmp_path))
    s2.close()
