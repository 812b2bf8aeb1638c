"""The runtime on a GPU: training against the float64 simulator, and host syncs inside ``step()``.

The runtime's tests run on the CPU with gloo; these check what only a GPU can show, with the model,
data and inner step of tests/runtime/rt_common.py and the independent float64 simulation of
tests/runtime/rt_sim.py (tests/gpu/rt_gpu.py), so that a match means the same thing it means in
tests/runtime:

(a) one rank, an NCCL group of size 1 (``init_process_group("nccl", world_size=1)``, TCP on
    127.0.0.1): DiLoCo, Streaming DiLoCo, CoCoDC and LOSCAR each train the tiny float64 model on
    the GPU for ~30 steps (the size-1 configurations of tests/runtime/test_config.py) and must end
    where ``rt_sim`` ends with M = 1. ``torch.cuda._sleep`` is enqueued right before every pack
    (``ops.pack``; LOSCAR's ``ops.sparse_gather``), so a consumer that does not wait for the compute
    stream (the side-stream collective, the host mirror of the control vector, a score read) sees
    data that is not written yet: a wrong result rather than a lucky one. DiLoCo and Streaming
    DiLoCo once more with the model sharded by FSDP2 ``fully_shard`` over the one-rank mesh: the
    parameters are DTensors and FSDP all-gathers (on its own CUDA streams) from the strategy's
    flat buffer (runtime/sharding.py); the gathered model must end where ``rt_sim`` ends;
(b) two processes on the same GPU (NCCL refuses two ranks on one device), gloo with CUDA tensors,
    started by ``runtime.launch.spawn_local``: the four strategies against ``rt_sim`` with M = 2
    (configurations of tests/runtime/test_strategies.py), with the same delay before each pack; here
    the all-reduce really moves data, so a missing stream wait averages unwritten values;
(c) one period (sends and applies) of Streaming DiLoCo and CoCoDC (absolute and, the default,
    normalized lambda) under ``torch.cuda.set_sync_debug_mode("error")`` around ``strategy.step()``
    only (the user's inner step is not the runtime's business): a synchronising call fails the test
    with its traceback; then the same period under "warn" lists every such call, plus the explicit
    host waits that the sync debug mode does not see (``Event.synchronize``, ``Stream.synchronize``,
    ``torch.cuda.synchronize``; recorded as the test's properties, not failed: the runtime waits on
    events by design).

On the CPU (``LOWCOMM_GPU_TESTS_DEVICE=cpu``) (a) and (b) run with gloo on CPU tensors and (c) skips.
The overlap over an emulated WAN, a measurement, is bench/gpu_overlap.py.
"""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from lowcomm_kernels.runtime.launch import free_port, spawn_local
from tests.gpu.rt_gpu import (
    CLASSES,
    PAIR,
    SIZE1,
    SYNC_CASES,
    TOL,
    _warn_period,
    delayed_pack,
    inner_step,
    make_model,
    make_opt,
    simulate,
    train,
    train_fsdp2,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
RT_GPU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rt_gpu.py")


def matches_the_simulation(run: dict, sim: dict) -> None:
    """run's parameters within TOL of the simulation's, having synced and skipped nothing."""
    assert "error" not in run, run.get("error")
    diff = max(float((run["params"][k].double() - v).abs().max()) for k, v in sim.items())
    assert diff <= TOL, f"max |param - sim| = {diff:.3g} (tol {TOL})"
    assert run["syncs"] > 0 and run["skipped"] == 0, f"syncs {run['syncs']}, skipped {run['skipped']}"


@pytest.fixture(scope="module")
def one_rank_group(gpu_device):
    """(a), (c): this process as a process group of size 1 (NCCL on a GPU, else gloo)."""
    backend = "nccl" if gpu_device.type == "cuda" else "gloo"
    if gpu_device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    yield backend
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(gpu_device):
    """(b): every PAIR configuration on two gloo ranks, once for the module."""
    return spawn_local(f"{RT_GPU}:pair_worker", 2, ({"device": str(gpu_device)},), timeout_s=120.0)


@pytest.mark.parametrize("sc", SIZE1, ids=[sc["name"] for sc in SIZE1])
def test_one_rank_matches_the_simulator(sc, one_rank_group, gpu_device):
    with delayed_pack(gpu_device):
        run = train(sc, 0, gpu_device)
    matches_the_simulation(run, simulate(sc, 1)[0])


@pytest.mark.parametrize("sc", SIZE1[:2], ids=[sc["name"] for sc in SIZE1[:2]])
def test_one_rank_fsdp2_matches_the_simulator(sc, one_rank_group, gpu_device):
    with delayed_pack(gpu_device):
        run = train_fsdp2(sc, gpu_device)
    matches_the_simulation(run, simulate(sc, 1)[0])


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("sc", PAIR, ids=[sc["name"] for sc in PAIR])
def test_two_ranks_match_the_simulator(sc, rank, two_ranks):
    matches_the_simulation(two_ranks[rank][sc["name"]], simulate(sc, 2)[rank])


@pytest.mark.parametrize("case", SYNC_CASES, ids=[c[0] for c in SYNC_CASES])
def test_step_does_not_synchronise_with_the_host(case, one_rank_group, gpu_device, record_property):
    if gpu_device.type != "cuda":
        pytest.skip("needs a GPU (torch.cuda.set_sync_debug_mode)")
    _name, cls, kw = case
    H = kw["sync_every"]
    model = make_model(torch.float64).to(gpu_device)
    opt = make_opt(model)
    st = CLASSES[cls](model, opt, **kw)
    error = ""
    for t in range(1, 2 * H + 1):
        inner_step(model, opt, 0, t, gpu_device)
        if t <= H:
            st.step()
            continue
        torch.cuda.set_sync_debug_mode("error")
        try:
            st.step()
        except RuntimeError as e:
            error = f"step {t}: {e}\n{traceback.format_exc()[-2500:]}"
            break
        finally:
            torch.cuda.set_sync_debug_mode(0)
    found: list[tuple[str, str]] = []
    _warn_period(dict(cls=cls, kw=kw), gpu_device, found)
    flagged = sorted({s for k, s in found if k.startswith("sync debug")})
    waits = sorted({s for k, s in found if k.startswith("explicit")})
    for i, stack in enumerate(waits[:6]):  # by design: reported, not failed
        record_property(f"explicit wait {i}", stack)
    assert not error, error
    assert not flagged, "synchronising calls under 'warn':\n" + "\n".join(flagged[:6])
