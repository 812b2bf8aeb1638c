"""manager= without torchft installed: an ImportError that names the extra to install."""

import sys

import pytest
import torch
from torch import nn

from lowcomm_kernels.runtime.ft import INSTALL_HINT, require_torchft


def test_missing_torchft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'lowcomm-kernels\[ft\]'"):
        require_torchft()
    from lowcomm_kernels.runtime import DiLoCo

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ImportError, match=r"lowcomm-kernels\[ft\]"):
        DiLoCo(model, opt, sync_every=2, outer_lr=0.7, outer_momentum=0.9, manager=object(), num_replicas=2)
    assert "lowcomm-kernels[ft]" in INSTALL_HINT


def test_manager_arguments_are_checked_by_name():
    pytest.importorskip("torchft")
    from lowcomm_kernels.runtime import DiLoCo

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(sync_every=2, outer_lr=0.7, outer_momentum=0.9)
    with pytest.raises(TypeError, match="manager must be a torchft.Manager"):
        DiLoCo(model, opt, manager=object(), num_replicas=2, **kw)
    with pytest.raises(TypeError, match="manager must be a torchft.Manager"):
        DiLoCo(model, opt, num_replicas=2, **kw)  # num_replicas without a manager


def test_a_strategy_that_cannot_replay_a_heal_is_refused_at_construction():
    """A strategy without ``replay`` (how a replica healed inside the peers' step finishes it) is
    refused when it is built with a manager, not at its first heal mid-run."""
    from lowcomm_kernels.runtime import DiLoCo
    from lowcomm_kernels.runtime.base import Strategy

    class NoReplay(DiLoCo):
        replay = Strategy.replay  # the base's: "does not support replicas that heal"

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(sync_every=2, outer_lr=0.7, outer_momentum=0.9)
    with pytest.raises(
        TypeError, match=r"NoReplay cannot run under a torchft manager: it does not define replay"
    ):
        NoReplay(model, opt, manager=object(), num_replicas=2, **kw)


def test_every_strategy_builds_on_a_replica_of_several_ranks():
    """A replica that is a data-parallel group (Manager(world_size=2)) takes every strategy: DiLoCo,
    Streaming DiLoCo, and CoCoDC and LOSCAR, whose per-process decisions the replica's ranks take
    from its group rank 0 (a group of their own, made at first use, so building one rank alone does
    not block). Running them is tested with 2 and 3 replicas of 2 ranks in test_ft.py."""
    pytest.importorskip("torchft")
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer

    from lowcomm_kernels.runtime import LOSCAR, CoCoDC, DiLoCo, StreamingDiLoCo

    lh = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    builds = {
        "LOSCAR": lambda m, o, ft: LOSCAR(m, o, density=0.5, local_steps=2, overlap_steps=1, **ft),
        "CoCoDC": lambda m, o, ft: CoCoDC(m, o, sync_every=6, num_fragments=1, fragment_sync_delay=1, **ft),
        "StreamingDiLoCo": lambda m, o, ft: StreamingDiLoCo(
            m, o, sync_every=6, num_fragments=1, fragment_sync_delay=1, **ft
        ),
        "DiLoCo": lambda m, o, ft: DiLoCo(m, o, sync_every=2, **ft),
    }
    try:
        for name, build in builds.items():
            manager = Manager(
                pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=2, load_state_dict=None,
                state_dict=None, replica_id="replica_0", store_addr="localhost", store_port=store.port,
                rank=0, world_size=2, lighthouse_addr=lh.address(), use_async_quorum=False,
                timeout=timedelta(seconds=5),
            )  # fmt: skip
            try:
                model = nn.Linear(4, 1)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                strategy = build(model, opt, dict(manager=manager, num_replicas=2))
                assert type(strategy).__name__ == name and strategy.transport.manager is manager
                strategy.close()
            finally:
                manager.shutdown(wait=False)
    finally:
        lh.shutdown()


@pytest.fixture
def lone_managers():
    """Makes torchft Managers of replicas alone (a Lighthouse with min_replicas=1): their quorums need
    no peer. Each call a new Manager (a Manager carries one strategy's state)."""
    pytest.importorskip("torchft")
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer

    lh = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000)
    made, stores = [], []

    def make(**kw):
        store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        stores.append(store)  # the Manager's store must outlive it
        made.append(
            Manager(
                pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
                min_replica_size=1,
                load_state_dict=None,
                state_dict=None,
                replica_id="replica_0",
                store_addr="localhost",
                store_port=store.port,
                rank=0,
                world_size=1,
                lighthouse_addr=lh.address(),
                use_async_quorum=False,
                timeout=timedelta(seconds=10),
                **kw,
            )  # fmt: skip
        )
        return made[-1]

    yield make
    for m in made:
        m.shutdown(wait=False)
    lh.shutdown()


@pytest.fixture
def lone_manager(lone_managers):
    return lone_managers()


def test_a_manager_without_init_sync_is_refused_by_name(lone_managers):
    """Without init_sync nothing is healed at a fresh start, and the heal is where replicas agree on
    the configuration and take one starting state: refused at construction, naming it."""
    from lowcomm_kernels.runtime import LOSCAR, DiLoCo

    for build in (
        lambda m, o, ft: DiLoCo(m, o, sync_every=2, **ft),
        lambda m, o, ft: LOSCAR(m, o, density=0.5, local_steps=2, overlap_steps=1, **ft),
    ):
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ValueError, match=r"init_sync=True"):
            build(model, opt, dict(manager=lone_managers(init_sync=False), num_replicas=2))
    model = nn.Linear(4, 1)  # the default still builds
    DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2,
           manager=lone_managers(), num_replicas=2).close()  # fmt: skip


def test_loscar_poisoned_replica_stops(lone_manager):
    """LOSCAR under torchft: a replica whose parameters turn non-finite cannot be restarted from a peer
    over a fixed group; at the round's merge it raises (restarted, it would heal from a peer)."""
    from lowcomm_kernels.runtime import LOSCAR

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strat = LOSCAR(
        model, opt, density=0.5, local_steps=2, overlap_steps=1, manager=lone_manager, num_replicas=1
    )
    with pytest.raises(FloatingPointError, match="this replica holds non-finite"), strat:
        for step in range(1, 7):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 4:  # round 1 is sent after step 5 and merged after step 6
                with torch.no_grad():
                    model.weight[0, 0] = float("nan")
    # round 0 was merged; round 1 stopped at its merge (nothing merged, this replica raised)
    assert strat.round == 1 and strat.metrics.num_syncs == 1 and strat.metrics.num_skipped == 0
    strat.close()


def test_quorum_is_a_profiler_range(lone_manager):
    """Each torchft quorum shows as lowcomm/quorum in a torch profiler trace (one replica alone)."""
    from lowcomm_kernels.runtime import DiLoCo

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strat = DiLoCo(model, opt, sync_every=2, manager=lone_manager, num_replicas=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, strat:
        for _ in range(4):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    names = [e.name for e in prof.events()]
    assert names.count("lowcomm/quorum") == 3  # the join and the syncs after steps 2 and 4
    assert strat.transport.participants == [1, 1]
    strat.close()


def test_one_strategy_per_manager(lone_manager):
    """torchft registers a strategy's state once per Manager: a second strategy on it is refused by name."""
    from lowcomm_kernels.runtime import DiLoCo

    model = nn.Linear(4, 1)
    first = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, manager=lone_manager,
                   num_replicas=1)  # fmt: skip
    first.close()
    model = nn.Linear(4, 1)
    with pytest.raises(ValueError, match="manager: this Manager already carries"):
        DiLoCo(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            sync_every=2,
            manager=lone_manager,
            num_replicas=1,
        )


def test_dcp_resume_with_another_num_replicas(lone_managers, tmp_path):
    """Under manager= a DCP checkpoint saved with num_replicas=2 resumes with num_replicas=3: g and u
    as saved, and the result pending at the save applied with the same average."""
    import torch.distributed.checkpoint as dcp

    from lowcomm_kernels.runtime import StreamingDiLoCo
    from lowcomm_kernels.runtime.dcp import DCPState

    def make(n):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        kw = dict(
            sync_every=4, num_fragments=2, fragment_sync_delay=1, manager=lone_managers(), num_replicas=n
        )
        return model, opt, StreamingDiLoCo(model, opt, **kw)

    def train(model, opt, strat, steps):
        for _ in range(steps):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            strat.step()

    model, opt, strat = make(2)
    train(model, opt, strat, 6)  # fragment 1 sent after step 6, applied after step 7
    assert [pd.fragment for pd in strat.pending] == [1]
    dcp.save({"strategy": DCPState(strat)}, checkpoint_id=str(tmp_path))
    g6, u6 = strat.g.clone(), strat.u.clone()
    train(model, opt, strat, 1)
    g7 = strat.g.clone()
    strat.close()
    strat.manager.shutdown(wait=False)  # replica gone: the resumed one forms quorums alone

    model, opt, strat = make(3)
    dcp.load({"strategy": DCPState(strat)}, checkpoint_id=str(tmp_path))
    assert torch.equal(strat.g, g6) and torch.equal(strat.u, u6) and strat.step_count == 6
    assert [pd.fragment for pd in strat.pending] == [1]
    train(model, opt, strat, 1)  # its first quorum (the join), then the pending result's apply
    torch.testing.assert_close(strat.g, g7, rtol=1e-6, atol=1e-7)
    assert not torch.equal(strat.g, g6)
    strat.close()


def test_a_num_replicas_mismatch_at_a_heal_is_named(lone_managers):
    """A replica built with another num_replicas than the healthy peer it heals from: the error names
    num_replicas (it used to be a CheckpointError about a checkpoint's world size: there is no
    checkpoint, the heal state carries the control vector's width)."""
    from lowcomm_kernels.runtime import DiLoCo
    from lowcomm_kernels.runtime.checkpoint import CheckpointError
    from lowcomm_kernels.runtime.ft import STATE_KEY

    def build(n):
        model = nn.Linear(4, 1)
        manager = lone_managers()
        strat = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, manager=manager,
                       num_replicas=n)  # fmt: skip
        return manager, strat

    (peer, a), (mine, b) = build(2), build(3)
    sd = peer._user_state_dicts[STATE_KEY]()
    g = b.g.clone()
    with pytest.raises(ValueError, match="num_replicas") as err:
        mine._load_state_dict_fns[STATE_KEY](sd)
    assert not isinstance(err.value, CheckpointError) and "world_size" not in str(err.value), err.value
    assert "num_replicas=3" in str(err.value) and "num_replicas=2" in str(err.value), err.value
    assert torch.equal(b.g, g)  # refused before anything changed
    a.close()
    b.close()


def test_a_dead_lighthouse_is_named():
    """The Lighthouse dies mid-run: the next quorum fails with a SyncError that names the Lighthouse
    and the quorum timeout, not torchft's raw gRPC 'Timeout expired'."""
    pytest.importorskip("torchft")
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer

    from lowcomm_kernels.runtime import DiLoCo, SyncError

    lh = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1, load_state_dict=None,
        state_dict=None, replica_id="replica_0", store_addr="localhost", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=lh.address(), use_async_quorum=False, timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=3),
    )  # fmt: skip
    try:
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        strat = DiLoCo(model, opt, sync_every=2, manager=manager, num_replicas=1)

        def step():
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            strat.step()

        step()
        step()  # joined and synced once with the Lighthouse up
        lh.shutdown()
        del lh
        time.sleep(2)  # (the server goes away in the background)
        with pytest.raises(SyncError, match="Lighthouse") as err:
            for _ in range(8):
                step()
        assert "quorum_timeout" in str(err.value), err.value
        strat.close()
    finally:
        manager.shutdown(wait=False)
