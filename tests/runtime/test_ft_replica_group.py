"""runtime.ft.ReplicaGroup: the ranks of one multi-rank replica take group rank 0's decisions and
healed state. Two ranks in two threads over one TCPStore (the replica's store), no Lighthouse."""

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchft")
from torch.distributed import TCPStore  # noqa: E402
from torchft.manager import REPLICA_ID_KEY  # noqa: E402

from lowcomm_kernels.runtime.ft import ReplicaGroup  # noqa: E402
from lowcomm_kernels.runtime.transport import SyncError  # noqa: E402


def _managers(incarnation: str = "replica_0:abc", size: int = 2):
    """Stand-ins for the replica's Managers: the replica's store and the group rank / size."""
    host = TCPStore("localhost", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    host.set(REPLICA_ID_KEY, incarnation)  # what the replica's group rank 0 Manager writes at its start
    return host, [
        SimpleNamespace(
            _store=TCPStore("localhost", host.port, is_master=False, wait_for_workers=False),
            _group_rank=r,
            _group_world_size=size,
        )
        for r in range(size)
    ]


def _on_every_rank(groups, fn):
    """fn(rank, group) on each rank in its own thread; returns the results (or raised errors) by rank."""
    out: list = [None] * len(groups)

    def run(r):
        try:
            out[r] = fn(r, groups[r])
        except Exception as e:  # noqa: BLE001 (returned to the test)
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def test_every_rank_takes_group_rank_zeros_decision_and_state():
    _host, managers = _managers()
    groups = [ReplicaGroup(m, timeout_s=20) for m in managers]
    # CoCoDC: each rank computed its own N and choice (per-process timings and scores); rank 0's win
    local = [(2, (1, "score")), (5, (0, "stale"))]
    got = _on_every_rank(groups, lambda r, g: g.agree_decision(7, *local[r]))
    assert got == [(2, (1, "score")), (2, (1, "score"))]
    # no send at rank 0's slot: None on every rank, whatever the others chose
    local = [(3, None), (4, (1, "never_sent"))]
    got = _on_every_rank(groups, lambda r, g: g.agree_decision(8, *local[r]))
    assert got == [(3, None), (3, None)]
    # a heal: each rank received a state of its own (torchft may pick another healthy replica per
    # group rank); every rank continues with rank 0's, bit for bit
    states = [
        {"digest": "d", "strategy": {"x": torch.randn(1000, generator=torch.Generator().manual_seed(r)),
                                     "step": 40 + r, "round": 6, "at_send": True, "tag": f"rank{r}"}}
        for r in range(2)
    ]  # fmt: skip
    got = _on_every_rank(groups, lambda r, g: g.agree_state(states[r], "heal"))
    for r in range(2):
        assert torch.equal(got[r]["strategy"]["x"], states[0]["strategy"]["x"])
        assert {k: v for k, v in got[r]["strategy"].items() if k != "x"} == {
            k: v for k, v in states[0]["strategy"].items() if k != "x"
        }
    assert [g.exchanges for g in groups] == [3, 3]


def test_ranks_at_different_points_raise_instead_of_pairing():
    """Rank 0 exchanges a heal's state while rank 1 exchanges a decision (or another step's): both
    kinds of mismatch raise SyncError on the rank that notices; no value is taken."""
    _host, managers = _managers()
    groups = [ReplicaGroup(m, timeout_s=5) for m in managers]

    def mismatch(r, g):
        if r == 0:
            return g.agree_state({"x": torch.zeros(3)}, "heal")
        return g.agree_decision(5, 2, (0, "score"))

    got = _on_every_rank(groups, mismatch)
    assert isinstance(got[1], SyncError) and "instead" in str(got[1])

    _host, managers = _managers("replica_0:def")
    groups = [ReplicaGroup(m, timeout_s=5) for m in managers]
    got = _on_every_rank(groups, lambda r, g: g.agree_decision(5 + r, 2, (0, "score")))
    assert got[0] == (2, (0, "score"))
    assert isinstance(got[1], SyncError) and "step 5" in str(got[1])


def test_a_lone_rank_times_out_with_a_sync_error():
    _host, managers = _managers("replica_0:ghi")
    group = ReplicaGroup(managers[0], timeout_s=2)
    with pytest.raises(SyncError, match="did not meet"):
        group.agree_decision(1, 2, None)


def test_sharded_model_in_a_multi_rank_replica_is_refused_for_cocodc_and_loscar(tmp_path):
    """A replica of 2 ranks holding a sharded model (DTensor parameters): each rank heals its shard
    from the healthy replica torchft assigns to its group rank, and group rank 0's state cannot stand
    for another shard, so CoCoDC and LOSCAR are refused naming manager; nothing is modified (the
    model's values, the optimizer and the Manager, which then takes a DiLoCo)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer

    from lowcomm_kernels.runtime import LOSCAR, CoCoDC, DiLoCo
    from lowcomm_kernels.runtime.ft import STATE_KEY

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    lh = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=2, load_state_dict=None,
        state_dict=None, replica_id="replica_0", store_addr="localhost", store_port=store.port, rank=0,
        world_size=2, lighthouse_addr=lh.address(), use_async_quorum=False, timeout=timedelta(seconds=5),
    )  # fmt: skip
    try:
        mesh = init_device_mesh("cpu", (1,))

        def sharded_model():
            torch.manual_seed(0)
            model = nn.Linear(4, 2)
            for n, p in list(model.named_parameters()):
                setattr(model, n, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
            return model

        ft = dict(manager=manager, num_replicas=2)
        cases = [
            (LOSCAR, dict(density=0.5, local_steps=2, overlap_steps=1)),
            # the choices CoCoDC allows on a sharded model (no per-shard scores, timings or norms)
            (CoCoDC, dict(sync_every=6, num_fragments=1, fragment_sync_delay=1, score="round_robin",
                          syncs_per_period=1, lam_mode="absolute")),
        ]  # fmt: skip
        for cls, kw in cases:
            model = sharded_model()
            before = [p.full_tensor().clone() for p in model.parameters()]
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with pytest.raises(ValueError, match="manager: a replica of 2 ranks holding a sharded model"):
                cls(model, opt, **kw, **ft)
            assert all(
                torch.equal(p.full_tensor(), b) for p, b in zip(model.parameters(), before, strict=True)
            )
            assert not opt._optimizer_step_post_hooks
            assert STATE_KEY not in manager._load_state_dict_fns
        model = sharded_model()
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, **ft).close()
        assert STATE_KEY in manager._load_state_dict_fns
    finally:
        manager.shutdown(wait=False)
        lh.shutdown()
        dist.destroy_process_group()
