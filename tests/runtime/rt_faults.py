"""Workers for the failure tests: faults injected into real gloo ranks (see test_failures.py).

Every scenario returns plain data: the error each rank ended with (or None), what was skipped,
whether the parameters are finite, and hashes of g so the test can compare ranks.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import lowcomm_kernels.runtime as rt
from lowcomm_kernels.runtime.base import tensor_hash
from lowcomm_kernels.runtime.checkpoint import read_checkpoint, write_checkpoint
from tests.runtime.rt_common import batch, loss_fn, make_model

CLASSES = {"diloco": rt.DiLoCo, "streaming": rt.StreamingDiLoCo, "cocodc": rt.CoCoDC, "loscar": rt.LOSCAR}


class RootMeanSquare(torch.optim.Optimizer):
    """A user's own optimizer with lazily created per-parameter state (torch's convention)."""

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "sq" not in st:
                    st["sq"] = torch.zeros_like(p)
                st["sq"].add_(p.grad * p.grad)
                p.addcdiv_(p.grad, st["sq"].sqrt().add_(group["eps"]), value=-group["lr"])


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd_momentum":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if name == "custom":
        return RootMeanSquare(model.parameters(), lr=1e-2)
    raise ValueError(name)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _finite(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def train(rank: int, sc: dict) -> dict:
    """Train one scenario; faults: ``nan`` {(rank, step)} multiplies that loss by NaN (so gradients,
    optimizer state and parameters all become NaN), ``nan_from`` (rank, step) does it at every step
    from then on, ``break_views`` (rank, step, how) reassigns the parameters after wrapping."""
    dtype = sc.get("dtype_by_rank", {}).get(rank, sc.get("dtype", torch.float64))
    model = MODELS[sc.get("model", "tiny")](dtype, rank, **sc.get("model_kw", {}).get(rank, {}))
    other = make_model(dtype) if sc.get("opt_of_other") else None
    opt = make_optimizer(sc.get("opt", "sgd_momentum"), other if other is not None else model)
    kw = {**sc["kw"], **sc.get("kw_by_rank", {}).get(rank, {})}
    cls = sc.get("cls_by_rank", {}).get(rank, sc["cls"])
    records, g_hashes = [], []
    holder: list = []

    def on_sync(rec):
        records.append((rec.fragment, rec.send_step, rec.apply_step, rec.skipped, rec.round))
        st = holder[0]
        g_hashes.append(tensor_hash(st.g) if hasattr(st, "g") else tensor_hash(st.frags.flat))

    try:
        st = CLASSES[cls](model, opt, metrics_callback=on_sync, **kw)
    except Exception as e:
        return {"error": _err(e), "stage": "construct"}
    holder.append(st)
    nan_at = {tuple(x) for x in sc.get("nan", ())}
    err = None
    try:
        for t in range(1, sc["T"] + 1):
            x, y = batch(rank, t, dtype)
            if (rank, t) == tuple(sc.get("nan_input", (-1, -1))):
                x[0, 0] = float("nan")  # reaches the BatchNorm running statistics
            loss = loss_fn(model, x, y)
            if (rank, t) == tuple(sc.get("spike", (-1, -1))):
                loss = loss * 1e22  # finite gradients whose squares overflow Adam's second moment
            nf = sc.get("nan_from")
            if (rank, t) in nan_at or (nf is not None and rank == nf[0] and t >= nf[1]):
                loss = loss * float("nan")
            loss.backward()
            opt.step()
            opt.zero_grad()
            br = sc.get("break_views")
            if br is not None and (rank, t) == tuple(br[:2]):
                _break(model, br[2])
            st.step()
        st.finish()
    except Exception as e:
        err = _err(e)
    return {"error": err, "stage": "train", "records": records, "g_hashes": g_hashes,
            "finite": _finite(model),
            "state_finite": all(bool(torch.isfinite(v).all()) for s in opt.state.values()
                                for v in s.values() if isinstance(v, torch.Tensor) and v.is_floating_point()),
            "buffers_finite": all(bool(torch.isfinite(b).all()) for b in model.buffers()
                                  if b.is_floating_point()),
            "num_skipped": st.metrics.num_skipped, "num_syncs": st.metrics.num_syncs,
            "recovery_bytes": st.metrics.recovery_bytes,
            "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


class AB(nn.Module):
    """Two same-shaped layers registered in an order that depends on ``swap``."""

    def __init__(self, swap: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        a, b = nn.Linear(4, 4), nn.Linear(4, 1)
        if swap:
            self.b, self.a = b, a
        else:
            self.a, self.b = a, b

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class BNNet(nn.Module):
    """A model with floating buffers (BatchNorm running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.bn, self.out = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.bn(self.inp(x))))


MODELS = {
    "tiny": lambda dtype, rank, **kw: make_model(dtype, **kw),
    "ab_swapped_on_1": lambda dtype, rank: AB(swap=rank == 1).to(dtype),
    "bn": lambda dtype, rank: BNNet().to(dtype),
}


def _break(model, how: str) -> None:
    if how == "double_float":
        model.double().float()
    elif how == "assign":
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    elif how == "data":
        model.out.weight.data = model.out.weight.data.clone()
    elif how == "transpose":  # same pointer, same (square) shape, other strides
        model.blocks[0].weight.data = model.blocks[0].weight.data.t()
    else:
        raise ValueError(how)


def fault_scenarios(rank: int, world: int, scenarios: list[dict]) -> dict:
    return {sc["name"]: train(rank, sc) for sc in scenarios}


def frozen_and_buffers(rank: int, world: int) -> dict:
    """Frozen parameters and buffers start from rank 0's values, like the trainable ones."""
    model = make_model(torch.float64)
    model.blocks[0].bias.requires_grad_(False)
    with torch.no_grad():
        model.blocks[0].bias.fill_(float(rank))
        model.inp.weight.add_(float(rank))
    model.register_buffer("scale", torch.full((3,), float(rank) + 0.5))
    model.register_buffer("mask", torch.tensor([bool(rank), True, not rank]))
    model.register_buffer("count", torch.tensor(7 + rank))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    rt.DiLoCo(model, opt, sync_every=4)
    return {"frozen": model.blocks[0].bias.detach().clone(), "inp": model.inp.weight.detach().clone(),
            "scale": model.scale.clone(), "mask": model.mask.clone(), "count": model.count.clone()}


def double_wrap(rank: int, world: int) -> dict:
    model = make_model(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = rt.DiLoCo(model, opt, sync_every=4)
    out = {}
    try:
        rt.StreamingDiLoCo(model, opt, sync_every=8, num_fragments=2, fragment_sync_delay=1)
        out["second"] = "OK"
    except Exception as e:
        out["second"] = _err(e)
    first.close()
    try:
        rt.DiLoCo(model, opt, sync_every=4)
        out["after_close"] = "OK"
    except Exception as e:
        out["after_close"] = _err(e)
    return out


def _trained(cls: str, kw: dict, T: int, opt_name: str = "sgd_momentum"):
    model = make_model(torch.float32)
    opt = make_optimizer(opt_name, model)
    st = CLASSES[cls](model, opt, **kw)
    for t in range(1, T + 1):
        x, y = batch(0, t, torch.float32)
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        st.step()
    return model, opt, st


def _state_hash(model, st) -> int:
    parts = [st.g if hasattr(st, "g") else st.frags.flat, st.frags.flat]
    return tensor_hash(torch.cat([p.detach().reshape(-1).double() for p in parts]))


def corrupted_checkpoints(rank: int, world: int, tmp: str) -> dict:
    """One rank: every kind of bad checkpoint is refused with CheckpointError and nothing changes."""
    kw = {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2, "syncs_per_period": 4}
    model, opt, st = _trained("cocodc", kw, 5)  # fragment 1 in flight at step 5
    good = os.path.join(tmp, "good.pt")
    st.save_checkpoint(good)
    raw = open(good, "rb").read()
    obj = read_checkpoint(good)

    def variant(name: str, mutate) -> str:
        o = read_checkpoint(good)
        mutate(o)
        path = os.path.join(tmp, f"{name}.pt")
        write_checkpoint(o, path)  # a consistent checksum: only the content is wrong
        return path

    def raw_variant(name: str, data: bytes) -> str:
        path = os.path.join(tmp, f"{name}.pt")
        with open(path, "wb") as f:
            f.write(data)
        return path

    # flip 64 bytes inside g's data (it is in the payload; find its bytes)
    g_bytes = obj["strategy"]["g"].numpy().tobytes()
    at = raw.find(g_bytes[:256])
    flipped = bytearray(raw)
    for i in range(at + 64, at + 128):
        flipped[i] ^= 0xFF
    old = raw_variant("old_format", b"")
    torch.save(obj, old)
    cases = {
        "flipped_tensor_bytes": raw_variant("flipped", bytes(flipped)),
        "truncated": raw_variant("truncated", raw[: len(raw) // 2]),
        "empty": raw_variant("empty", b""),
        "old_format": old,
        "g_one_element": variant("g1", lambda o: o["strategy"].__setitem__("g", torch.zeros(1))),
        "u_wrong_dtype": variant("u64", lambda o: o["strategy"].__setitem__(
            "u", o["strategy"]["u"].double())),
        "pending_delta_shape": variant("pd", lambda o: o["strategy"]["pending"][0].__setitem__(
            "delta", torch.zeros(3))),
        "model_entry_dtype": variant("md", lambda o: o["model"].__setitem__(
            "out.weight", o["model"]["out.weight"].double())),
        "schedule_garbage": variant("sch", lambda o: o["strategy"]["schedule"].__setitem__("N", 10**6)),
        "step_negative": variant("step", lambda o: o["strategy"].__setitem__("step", -3)),
    }
    found_at = at
    out: dict = {"found_g_bytes": found_at >= 0}
    before = _state_hash(model, st)
    for name, path in cases.items():
        m2, o2, st2 = _trained("cocodc", kw, 3)
        h = _state_hash(m2, st2)
        try:
            st2.load_checkpoint(path)
            out[name] = "OK"
        except Exception as e:
            out[name] = _err(e)
        out[name + "_unchanged"] = _state_hash(m2, st2) == h
        st2.close()
    # another inner optimizer than the one that wrote the checkpoint
    m3, o3, st3 = _trained("cocodc", kw, 3, opt_name="adamw")
    try:
        st3.load_checkpoint(good)
        out["optimizer_type"] = "OK"
    except Exception as e:
        out["optimizer_type"] = _err(e)
    st3.close()
    # the good file still loads (and is byte-identical after all of this)
    m4, o4, st4 = _trained("cocodc", kw, 3)
    st4.load_checkpoint(good)
    out["good_loads"] = _state_hash(m4, st4) == before
    # atomicity: a save that fails half-way (disk full at fsync) leaves the previous file intact
    import lowcomm_kernels.runtime.checkpoint as ck

    real = ck.os.fsync

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    ck.os.fsync = full_disk
    try:
        st4.save_checkpoint(good)
        out["full_disk"] = "OK"
    except Exception as e:
        out["full_disk"] = _err(e)
    finally:
        ck.os.fsync = real
    out["good_unchanged_after_failed_save"] = open(good, "rb").read() == raw
    out["leftover_tmp"] = sorted(f for f in os.listdir(tmp) if ".tmp." in f)
    return out


def resume_at_different_steps(rank: int, world: int, tmp: str) -> dict:
    """Checkpoints at steps 4 and 8; then rank 0 resumes from its step-4 file, rank 1 from its
    step-8 file, and both train on: their next syncs pair up but sit at different steps."""
    model = make_model()
    opt = make_optimizer("sgd_momentum", model)
    st = CLASSES["diloco"](model, opt, sync_every=4)
    for t in range(1, 9):
        x, y = batch(rank, t)
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        st.step()
        if t in (4, 8):
            st.save_checkpoint(os.path.join(tmp, f"s{t}_r{rank}.pt"))
    st.close()
    model = make_model()
    opt = make_optimizer("sgd_momentum", model)
    st = CLASSES["diloco"](model, opt, sync_every=4)
    st.load_checkpoint(os.path.join(tmp, f"s{4 if rank == 0 else 8}_r{rank}.pt"))
    try:
        for t in range(st.step_count + 1, st.step_count + 9):
            x, y = batch(rank, t)
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
            st.step()
    except Exception as e:
        return {"error": _err(e)}
    return {"error": None}


def build_orders(rank: int, world: int) -> dict:
    """Two strategies over models of the same structure, built in the same or in another order on
    each rank; each case reports every construction's outcome, then one more strategy trains."""
    from tests.runtime.rt_common import TinyNet, inner_step

    def models(seed: int, copies: bool = False) -> list[nn.Module]:
        torch.manual_seed(seed)
        a = TinyNet().double()
        b = TinyNet().double()
        if copies:
            b.load_state_dict(a.state_dict())
        return [a, b]

    def build(ms: list[nn.Module], order: list[int]) -> list[str]:
        out = []
        for i in order:
            try:
                rt.DiLoCo(ms[i], torch.optim.SGD(ms[i].parameters(), lr=0.1), sync_every=2)
                out.append("OK")
            except Exception as e:
                out.append(_err(e))
        return out

    swapped = [0, 1] if rank == 0 else [1, 0]
    res = {
        "crossed": build(models(0), swapped),
        "same_order": build(models(0), [0, 1]),
        "seeded_by_rank": build(models(rank), [0, 1]),  # nothing to compare: accepted
        "copies_crossed": build(models(0, copies=True), swapped),  # identical values: harmless here
    }
    model = models(0)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    st = rt.DiLoCo(model, opt, sync_every=2)
    for t in range(1, 5):
        inner_step(model, opt, rank, t)
        st.step()
    st.finish()
    res["after"] = (st.metrics.num_syncs, tensor_hash(st.g))
    return res
