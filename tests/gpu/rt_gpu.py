"""The runtime on the GPU, shared by tests/gpu/test_runtime.py and its two ranks (spawn_local loads
this file in each): the configurations, the delayed pack, training and the float64 simulation.

The model, data and inner step are those of tests/runtime/rt_common.py and the simulation is the
independent float64 one of tests/runtime/rt_sim.py, so that a match means the same thing it means in
tests/runtime.
"""

from __future__ import annotations

import traceback
import warnings
from contextlib import contextmanager

import torch

import lowcomm_kernels.runtime as rt
from lowcomm_kernels import ops as lk
from tests.runtime.rt_common import batch, loss_fn, make_model, make_opt
from tests.runtime.rt_sim import simulate_dense, simulate_loscar

CLASSES = {"diloco": rt.DiLoCo, "streaming": rt.StreamingDiLoCo, "cocodc": rt.CoCoDC, "loscar": rt.LOSCAR}
STREAM = dict(sync_every=8, num_fragments=2, fragment_sync_delay=2)
SIZE1 = [  # (a), M = 1: tests/runtime/test_config.py's configurations, ~30 steps
    dict(name="diloco", cls="diloco", T=32, kw=dict(sync_every=4)),
    dict(name="streaming", cls="streaming", T=32, kw=STREAM),
    dict(name="cocodc", cls="cocodc", T=32, kw=dict(STREAM, syncs_per_period=4)),
    dict(name="loscar", cls="loscar", T=30, kw=dict(density=0.5, local_steps=2, overlap_steps=1)),
]
PAIR = [  # (b), M = 2: tests/runtime/test_strategies.py's configurations
    dict(name="diloco", cls="diloco", T=30, kw=dict(sync_every=6)),
    dict(name="streaming", cls="streaming", T=40, kw=STREAM),
    dict(
        name="cocodc", cls="cocodc", T=48, kw=dict(STREAM, syncs_per_period=4, lam=0.5, lam_mode="normalized")
    ),
    dict(
        name="loscar",
        cls="loscar",
        T=30,
        kw=dict(density=0.5, local_steps=4, overlap_steps=2, merge="overwrite", seed=3),
    ),
]
SYNC_CASES = [  # (c): name, class, keywords; one warm-up period, then one period checked
    ("Streaming DiLoCo", "streaming", STREAM),
    ("CoCoDC, absolute lambda", "cocodc", dict(STREAM, syncs_per_period=4, lam_mode="absolute")),
    ("CoCoDC, normalized lambda (default)", "cocodc", dict(STREAM, syncs_per_period=4)),
]
TOL = 1e-7  # float64 on the GPU against float64 on the CPU: ~1e-13 expected; a race is O(1)
PACK_SLEEP_CYCLES = 50_000_000  # ~25 ms


# ------------------------------------------------------------------------------------ helpers
@contextmanager
def delayed_pack(dev: torch.device, cycles: int = PACK_SLEEP_CYCLES):
    """Enqueue ``torch.cuda._sleep(cycles)`` on the current stream before every pack (the runtime
    calls ``ops.pack`` / ``ops.sparse_gather`` through the module, so patching it reaches them)."""
    saved = lk.pack, lk.sparse_gather
    if dev.type == "cuda":

        def delayed(fn):
            def call(*args, **kwargs):
                torch.cuda._sleep(cycles)
                return fn(*args, **kwargs)

            return call

        lk.pack, lk.sparse_gather = delayed(saved[0]), delayed(saved[1])
    try:
        yield
    finally:
        lk.pack, lk.sparse_gather = saved


def inner_step(model, opt, rank: int, t: int, dev: torch.device) -> None:
    """rt_common.inner_step with the batch on the model's device (and no host read of the loss)."""
    x, y = batch(rank, t, next(model.parameters()).dtype)
    loss_fn(model, x.to(dev), y.to(dev)).backward()
    opt.step()
    opt.zero_grad()


def train(sc: dict, rank: int, dev: torch.device, steps: int | None = None, **extra) -> dict:
    model = make_model(torch.float64).to(dev)
    opt = make_opt(model)
    st = CLASSES[sc["cls"]](model, opt, **sc["kw"], **extra)
    for t in range(1, (steps or sc["T"]) + 1):
        inner_step(model, opt, rank, t, dev)
        st.step()
    return {
        "params": {k: v.detach().cpu().clone() for k, v in model.named_parameters()},
        "syncs": st.metrics.num_syncs,
        "skipped": st.metrics.num_skipped,
    }


def train_fsdp2(sc: dict, dev: torch.device) -> dict:
    """``train`` with the model sharded by FSDP2 over a one-rank mesh of the default group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dev.type, (1,))
    model = make_model(torch.float64).to(dev)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_opt(model)
    st = CLASSES[sc["cls"]](model, opt, **sc["kw"])
    for t in range(1, sc["T"] + 1):
        inner_step(model, opt, 0, t, dev)
        st.step()
    full = {k: v.full_tensor().detach().cpu().clone() for k, v in model.named_parameters()}
    return {"params": full, "syncs": st.metrics.num_syncs, "skipped": st.metrics.num_skipped}


def simulate(sc: dict, M: int) -> list[dict]:
    kw, cls = sc["kw"], sc["cls"]
    if cls == "loscar":
        N, Q = kw["local_steps"], kw["overlap_steps"]
        return simulate_loscar(
            M,
            sc["T"] // (N + Q),
            density=kw["density"],
            local_steps=[N] * M,
            overlap_steps=[Q] * M,
            merge=kw.get("merge", "delay_corrected"),
            seed=kw.get("seed", 0),
        )["params"]
    extra = {} if cls == "diloco" else dict(K=kw["num_fragments"], tau=kw["fragment_sync_delay"])
    if cls == "cocodc":
        extra.update(
            N=kw["syncs_per_period"], lam=kw.get("lam", 0.5), lam_mode=kw.get("lam_mode", "normalized")
        )
    return simulate_dense(cls, M, sc["T"], H=kw["sync_every"], **extra)["params"]


def pair_worker(rank: int, world: int, cfg: dict) -> dict:
    """One of the two ranks (gloo; CUDA tensors on GPU 0 when cfg['device'] is cuda): every PAIR
    configuration, with the delayed pack; an exception is returned as {"error": traceback}."""
    dev = torch.device(cfg["device"])
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    out: dict = {}
    with delayed_pack(dev):
        for sc in PAIR:
            try:
                out[sc["name"]] = train(sc, rank, dev, timeout_s=60.0)
            except Exception as e:
                out[sc["name"]] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
    return out


# ------------------------------------------------------------------------------- (c) sync debug
@contextmanager
def host_waits(found: list[tuple[str, str]]):
    """set_sync_debug_mode('warn') plus the explicit waits it does not flag; each hit -> found."""

    def record(kind: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if "warnings" not in f.filename]
        found.append((kind, "".join(traceback.format_list(frames[-8:]))))

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            record(f"sync debug mode: {message}")

    def wrap(kind, fn):
        def call(*args, **kwargs):
            record(kind)
            return fn(*args, **kwargs)

        return call

    patches = [
        (torch.cuda.Event, "synchronize"),
        (torch.cuda.Stream, "synchronize"),
        (torch.cuda, "synchronize"),
    ]
    saved = [getattr(obj, name) for obj, name in patches]
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        for (obj, name), fn in zip(patches, saved, strict=True):
            setattr(obj, name, wrap(f"explicit wait: {getattr(obj, '__name__', obj)}.{name}()", fn))
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
            for (obj, name), fn in zip(patches, saved, strict=True):
                setattr(obj, name, fn)


def _warn_period(sc: dict, dev: torch.device, found: list) -> dict:
    model = make_model(torch.float64).to(dev)
    opt = make_opt(model)
    st = CLASSES[sc["cls"]](model, opt, **sc["kw"])
    H = sc["kw"]["sync_every"]
    for t in range(1, 2 * H + 1):
        inner_step(model, opt, 0, t, dev)
        if t <= H:
            st.step()
        else:
            with host_waits(found):
                st.step()
    return {"syncs": st.metrics.num_syncs}
