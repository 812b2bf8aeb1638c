"""Worker functions run on spawned gloo ranks by ``lowcomm_kernels.runtime.launch.spawn_local``.

Each returns plain Python / CPU tensors that the test (in the parent process) compares with the
float64 simulation (rt_sim) and across ranks. Loaded by file path, so imports are absolute.
"""

from __future__ import annotations

import os
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import lowcomm_kernels.runtime as rt
from lowcomm_kernels.runtime.base import tensor_hash
from tests.runtime.rt_common import batch, inner_step, loss_fn, make_model, make_opt

CLASSES = {"diloco": rt.DiLoCo, "streaming": rt.StreamingDiLoCo, "cocodc": rt.CoCoDC, "loscar": rt.LOSCAR}


class AllocLog(TorchDispatchMode):
    """Records the size of every tensor an op creates (outputs not sharing storage with an input)."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)}
        for o in tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in ins:
                self.max_numel = max(self.max_numel, o.numel())
                self.sizes.append((str(func), o.numel()))
        return out


def _named(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.named_parameters()}


def _steps_for(sc: dict, rank: int) -> int:
    T = sc["T"]
    return T[rank] if isinstance(T, (list, tuple)) else T


def run_one(rank: int, sc: dict, group=None, start: int = 0, model=None, opt=None, strategy=None,
            stop: int | None = None) -> dict:
    """Train one scenario; returns params, per-sync records, g hashes after every sync, masks."""
    dtype = sc.get("dtype", torch.float64)
    if model is None:
        model = make_model(dtype, **sc.get("model_kw", {}))
        opt = make_opt(model)
    records, g_hashes, masks = [], [], []
    kw = dict(sc["kw"])
    if strategy is None:
        def on_sync(rec):
            records.append((rec.fragment, rec.send_step, rec.apply_step, rec.skipped, rec.reason, rec.round))
            st = holder[0]
            if hasattr(st, "g"):
                g_hashes.append(tensor_hash(st.g))
            else:
                masks.append(tensor_hash(st.last_idx) if st.last_idx is not None else 0)
        holder = []
        strategy = CLASSES[sc["cls"]](model, opt, process_group=group, metrics_callback=on_sync, **kw)
        holder.append(strategy)
        if sc.get("freeze_lr_fragment") is not None:  # inner lr 0 on one fragment: its score stays 0
            f = sc["freeze_lr_fragment"]
            frozen = {id(p) for p in strategy.frags.params[f]}
            params = list(model.parameters())
            opt2 = torch.optim.SGD([{"params": [p for p in params if id(p) not in frozen]},
                                    {"params": [p for p in params if id(p) in frozen], "lr": 0.0}],
                                   lr=opt.defaults["lr"], momentum=opt.defaults["momentum"])
            opt = opt2
            strategy.inner_optimizer = opt2
    T = _steps_for(sc, rank) if stop is None else stop
    alloc = AllocLog() if sc.get("alloc_check") else None
    err = None
    try:
        for t in range(start + 1, T + 1):
            if "inject_nan" in sc:
                _nan_step(model, opt, rank, t, sc, strategy)
            else:
                inner_step(model, opt, rank, t)
            if sc.get("corrupt_g") and sc["corrupt_g"][:2] == (rank, t):
                with torch.no_grad():
                    strategy.frags.slice(strategy.g, sc["corrupt_g"][2]).add_(1.0)
            if alloc is not None:
                with alloc:
                    strategy.step()
            else:
                strategy.step()
            if sc.get("ckpt_at") == t:
                strategy.save_checkpoint(os.path.join(sc["ckpt_dir"], f"rank{rank}.pt"))
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    m = strategy.metrics
    return {"params": _named(model), "records": records, "g_hashes": g_hashes, "masks": masks, "error": err,
            "max_alloc": alloc.max_numel if alloc else None, "k": getattr(strategy, "k", None),
            "d": strategy.frags.numel, "num_syncs": m.num_syncs, "num_skipped": m.num_skipped,
            "bytes_sent": m.bytes_sent, "n_history": list(getattr(strategy, "n_history", [])),
            "g": strategy.g.detach().cpu().clone() if hasattr(strategy, "g") else None,
            "memory": strategy.memory_per_param(), "_strategy": (model, opt, strategy)}


def _nan_step(model, opt, rank, t, sc, strategy) -> None:
    x, y = batch(rank, t, next(model.parameters()).dtype)
    loss_fn(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    if sc["inject_nan"] == (rank, t):
        with torch.no_grad():
            strategy.frags.params[0][0].view(-1)[0] = float("nan")


def run_scenarios(rank: int, world: int, scenarios: list[dict]) -> dict:
    out = {}
    for sc in scenarios:
        res = run_one(rank, sc)
        res.pop("_strategy")
        out[sc["name"]] = res
    return out


def resume_pair(rank: int, world: int, sc: dict) -> dict:
    """Uninterrupted run with a checkpoint at ckpt_at, then fresh objects resumed from it."""
    full = run_one(rank, sc)
    full.pop("_strategy")
    model = make_model(sc.get("dtype", torch.float64), **sc.get("model_kw", {}))
    opt = make_opt(model)
    st = CLASSES[sc["cls"]](model, opt, **sc["kw"])
    st.load_checkpoint(os.path.join(sc["ckpt_dir"], f"rank{rank}.pt"))
    start = st.step_count
    resumed = run_one(rank, {**sc, "ckpt_at": None}, start=start, model=model, opt=opt, strategy=st)
    resumed.pop("_strategy")
    return {"full": full, "resumed": resumed, "start": start}


def resume_only(rank: int, world: int, sc: dict) -> dict:
    """Fresh processes: restore every rank from its last checkpoint and finish the run."""
    model = make_model(sc.get("dtype", torch.float64))
    opt = make_opt(model)
    st = CLASSES[sc["cls"]](model, opt, **sc["kw"])
    st.load_checkpoint(os.path.join(sc["ckpt_dir"], f"rank{rank}.pt"))
    res = run_one(rank, {**sc, "ckpt_at": None, "ckpt_every": None}, start=st.step_count, model=model,
                  opt=opt, strategy=st)
    res.pop("_strategy")
    return res


def killed_run(rank: int, world: int, sc: dict) -> dict:
    """Checkpoint every `ckpt_every` steps; rank `victim` SIGKILLs itself at step `kill_at`.
    Survivors report the error they got and how long after the kill it came."""
    import signal
    model = make_model(sc.get("dtype", torch.float64))
    opt = make_opt(model)
    st = CLASSES[sc["cls"]](model, opt, **sc["kw"])
    t_kill = None
    try:
        for t in range(1, sc["T"] + 1):
            inner_step(model, opt, rank, t)
            if rank == sc["victim"] and t == sc["kill_at"]:
                with open(os.path.join(sc["ckpt_dir"], "victim.pid"), "w") as f:
                    f.write(str(os.getpid()))
                # SIGKILL: a dead peer (connection reset); SIGSTOP: a hung peer (only the timeout helps)
                os.kill(os.getpid(), signal.SIGSTOP if sc.get("hang") else signal.SIGKILL)
            if t == sc["kill_at"]:
                t_kill = time.monotonic()
            st.step()
            if t % sc["ckpt_every"] == 0:
                st.save_checkpoint(os.path.join(sc["ckpt_dir"], f"rank{rank}.pt"))
    except Exception as e:
        if sc.get("hang"):  # clean up the stopped victim (our own sibling process)
            with open(os.path.join(sc["ckpt_dir"], "victim.pid")) as f:
                os.kill(int(f.read()), signal.SIGKILL)
        return {"error": f"{type(e).__name__}: {e}",
                "after_kill_s": time.monotonic() - (t_kill or time.monotonic()),
                "step": st.step_count}
    return {"error": None, "step": st.step_count}


def overlap_run(rank: int, world: int, scenarios: list[dict]) -> dict:
    """Emulated compute (sleep T_c per step, so timing does not depend on CPU load) + emulated WAN."""
    out = {}
    for sc in scenarios:
        model = make_model(torch.float32)
        opt = make_opt(model)
        st = CLASSES[sc["cls"]](model, opt, wan=rt.WAN(sc["latency"], 1e9), **sc["kw"])
        t0 = time.perf_counter()
        for t in range(1, sc["T"] + 1):
            inner_step(model, opt, rank, t)
            time.sleep(sc["t_c"])
            st.step()
        wall = time.perf_counter() - t0
        m = st.metrics
        out[sc["name"]] = {"wall": wall, "exposed": m.exposed_comm_s, "num_syncs": m.num_syncs,
                           "in_flight": [r.in_flight_s for r in m.syncs], "compute": m.compute_s}
    return out


def topology_run(rank: int, world: int, sc: dict) -> dict:
    """4 ranks = 2 regions x 2 DP: DDP over the inner group, the strategy over the outer group."""
    inner, outer = rt.region_groups(2)
    model = make_model(torch.float64)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=inner)
    opt = make_opt(model)
    hashes = []
    st = CLASSES[sc["cls"]](model, opt, process_group=outer,
                            metrics_callback=lambda r: hashes.append(tensor_hash(st.g)), **sc["kw"])
    with st:
        for t in range(1, sc["T"] + 1):
            x, y = batch(rank, t, torch.float64)
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
    return {"params": _named(model), "g_hashes": hashes, "g": st.g.clone()}


def _err(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "OK"


def config_errors(rank: int, world: int, scenarios: list[dict]) -> dict:
    """Bad configurations on a group of size 1 (each must fail at construction), then the same group
    training every strategy (size 1 is valid), then the uninitialised-group error."""
    import torch.distributed as dist

    def mk(cls, dtype=torch.float32, **kw):
        model = make_model(dtype)
        return lambda: CLASSES[cls](model, make_opt(model), **kw)

    def mixed():
        model = make_model(torch.float32)
        model.out.to("meta")
        return CLASSES["diloco"](model, make_opt(model), sync_every=4)

    def frozen():
        model = make_model(torch.float32)
        for p in model.parameters():
            p.requires_grad_(False)
        other = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        return CLASSES["diloco"](model, other, sync_every=4)

    def mixed_dtypes():
        model = make_model(torch.float32)
        model.out.to(torch.bfloat16)
        return CLASSES["diloco"](model, make_opt(model), sync_every=4)

    cases = {
        "too_many_fragments": mk("streaming", sync_every=20, num_fragments=5, fragment_sync_delay=1),
        "delay_ge_period": mk("streaming", sync_every=8, num_fragments=2, fragment_sync_delay=4),
        "cocodc_delay_too_long": mk("cocodc", sync_every=8, num_fragments=2, fragment_sync_delay=5),
        "cocodc_n_out_of_range": mk("cocodc", sync_every=8, num_fragments=2, fragment_sync_delay=2,
                                    syncs_per_period=5),
        "density_zero": mk("loscar", density=0.0, local_steps=2, overlap_steps=1),
        "density_above_one": mk("loscar", density=1.5, local_steps=2, overlap_steps=1),
        "density_nan": mk("loscar", density=float("nan"), local_steps=2, overlap_steps=1),
        "local_steps_wrong_len": mk("loscar", density=0.5, local_steps=[2, 3], overlap_steps=1),
        "mixed_devices": mixed,
        "no_trainable": frozen,
        "mixed_dtype_params": mixed_dtypes,
        "bf16_params_f16_wire": mk("diloco", dtype=torch.bfloat16, sync_every=4, wire_dtype=torch.float16),
        "bad_wire_dtype": mk("diloco", sync_every=4, wire_dtype=torch.float16),
        "bad_on_nonfinite": mk("diloco", sync_every=4, on_nonfinite="ignore"),
        "sync_every_zero": mk("diloco", sync_every=0),
        "bad_timeout": mk("diloco", sync_every=4, timeout_s=0),
    }
    out = {name: _err(fn) for name, fn in cases.items()}
    runs = {}
    for sc in scenarios:
        res = run_one(rank, sc)
        res.pop("_strategy")
        runs[sc["name"]] = res
    model = make_model(torch.float64)
    opt = make_opt(model)
    st = CLASSES["streaming"](model, opt, sync_every=8, num_fragments=2, fragment_sync_delay=2)
    for t in range(1, 9):  # fragment 1 sent at 4 (applied at 6), fragment 0 sent at 8 (still pending)
        inner_step(model, opt, rank, t)
        st.step()
    before = st.metrics.num_syncs
    st.finish()
    finish = {"before": before, "after": st.metrics.num_syncs, "pending": len(st.pending),
              "x_equals_g": bool(torch.equal(st.frags.x(0), st.frags.slice(st.g, 0)))}
    dist.destroy_process_group()
    out["uninitialised"] = _err(mk("diloco", sync_every=4))
    return {"errors": out, "runs": runs, "finish": finish}
