"""Chaos soak workers: random faults injected into real gloo ranks (driven by test_chaos.py).

An episode is generated from (seed, world, index) alone, so every rank builds the same one and any
episode can be replayed by its id. Process start-up is the expensive part (seconds per rank), so
the test runs a short chain of long-lived groups, each a ``segment``:

1. (after a kill) restore every rank from the newest checkpoint generation they all hold, falling
   back to the previous one if a rank refuses its file, finish the run, then run the same job
   uninterrupted and compare bit for bit;
2. in-process episodes back to back until a deadline: one NaN loss, a rank stuck non-finite, a
   mismatched configuration, reassigned parameters, a corrupted or truncated checkpoint at
   restore, a checkpoint resumed under another wire format, one resumed by a group of another
   size (a subgroup of all ranks but the last, made once per segment), and fault-free control
   runs. After each, a short probe run proves the group's collectives still pair up; each rank
   writes its result to a file at once, so the verdicts survive a group that crashes;
3. (optionally) a SIGKILL episode: every rank checkpoints every few steps and one rank kills itself
   (between two steps or in the middle of writing a checkpoint); the survivors report the error
   they got. The group is dead afterwards, so this comes last; the next segment restarts it.

Workers return plain data (errors as "Type: message", hashes, booleans); test_chaos.py judges it.
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import time

import torch
import torch.distributed as dist

from lowcomm_kernels.runtime.base import tensor_hash
from tests.runtime.rt_common import WIDTH, batch, loss_fn, make_model
from tests.runtime.rt_faults import CLASSES, make_optimizer

METHODS = ("diloco", "streaming", "cocodc", "loscar")
OPTS = ("sgd_momentum", "adamw", "custom")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
# in-process episode kinds and their weights (each appears once first, in a seeded order)
SOAK_KINDS = {"nan": 4, "stuck": 2, "config": 2, "views": 2, "corrupt": 2, "wire": 2, "resize": 1, "clean": 1}
FAULT_KINDS = ("nan", "stuck", "kill", "corrupt", "config", "views", "wire", "resize")
# wire formats a float32 model may send in (runtime.schedule.WIRE_FORMATS): dense, then quantized
DENSE_WIRES = ("fp32", "bf16")
QUANT_WIRES = ("int8", "int4", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "fp4_e3m0")
QUANT_BLOCK = 16
PARAM_NAMES = (
    ["inp.weight", "inp.bias"]
    + [f"blocks.{i}.{w}" for i in range(4) for w in ("weight", "bias")]
    + ["out.weight", "out.bias"]
)


# ----- episode generation (pure functions of the seed: the parent and every rank agree) ----------


def soak_world(seed: int) -> int:
    return random.Random(f"chaos:{seed}:soak-world").choice([2, 3])


def _strategy(rng: random.Random, method: str, world: int, *, hetero: bool) -> tuple[dict, int]:
    """Random valid keyword arguments for `method` and its period (steps between two syncs of the
    same data: H for the dense methods, the longest round for LOSCAR)."""
    kw: dict = {"timeout_s": rng.choice([5.0, 8.0, 10.0]), "guard_every": rng.choice([0, 0, 1, 2])}
    if rng.random() < 0.25:
        kw["wire_dtype"] = "bfloat16"
    if method == "diloco":
        H = rng.randint(2, 6)
        kw["sync_every"] = H
        return kw, H
    if method == "streaming":
        K = rng.randint(1, 3)
        H = K * rng.randint(2, 4)
        kw.update(sync_every=H, num_fragments=K, fragment_sync_delay=rng.randrange(0, H // K))
        if rng.random() < 0.3:
            kw["fragment_update_alpha"] = 0.5
        return kw, H
    if method == "cocodc":
        K = rng.randint(1, 3)
        tau = rng.randint(0, 2)
        H = rng.randint(max(2, K, tau * K), 8)
        n_max = H if tau == 0 else H // tau
        # a fixed syncs_per_period: "auto" follows the wall clock, so it is not reproducible bit for bit
        kw.update(
            sync_every=H,
            num_fragments=K,
            fragment_sync_delay=tau,
            syncs_per_period=rng.randint(K, n_max),
            score=rng.choice(["l2_global", "l1_local", "round_robin"]),
        )
        return kw, H
    N, Q = rng.randint(1, 4), rng.randint(0, 2)
    kw.update(
        density=rng.choice([0.1, 0.3, 0.5, 1.0]),
        local_steps=N,
        overlap_steps=Q,
        merge=rng.choice(["delay_corrected", "overwrite"]),
        seed=rng.randint(0, 999),
    )
    if hetero and rng.random() < 0.3:  # per-rank step counts (no checkpoints then: only at round ends)
        kw["local_steps"] = [rng.randint(1, 4) for _ in range(world)]
        kw["overlap_steps"] = [rng.randint(0, 2) for _ in range(world)]
        return kw, max(n + q for n, q in zip(kw["local_steps"], kw["overlap_steps"], strict=True))
    return kw, N + Q


def _job(rng: random.Random, world: int, *, hetero: bool, method: str | None = None) -> dict:
    method = method or rng.choice(METHODS)
    kw, period = _strategy(rng, method, world, hetero=hetero)
    return {
        "method": method,
        "dtype": rng.choice(list(DTYPES)),
        "opt": rng.choice(OPTS),
        "kw": kw,
        "period": period,
        "world": world,
    }


def _corruption(rng: random.Random) -> dict:
    if rng.random() < 0.3:
        return {"mode": "truncate", "frac": rng.random()}
    # byte positions as fractions of the file size; a third of them inside the magic + JSON header
    flips = [
        (rng.random() * (0.01 if rng.random() < 0.33 else 1.0), rng.randint(1, 255))
        for _ in range(rng.randint(1, 8))
    ]
    return {"mode": "flip", "flips": flips}


def soak_episode(seed: int, world: int, index: int) -> dict:
    rng = random.Random(f"chaos:{seed}:soak:{world}:{index}")
    kinds = list(SOAK_KINDS)
    random.Random(f"chaos:{seed}:soak-order").shuffle(kinds)
    kind = kinds[index] if index < len(kinds) else rng.choices(kinds, [SOAK_KINDS[k] for k in kinds])[0]
    ep = {
        "id": f"s{index}",
        "seed": seed,
        "kind": kind,
        **_job(rng, world, hetero=kind in ("nan", "stuck", "views", "config")),
    }
    P, tau = ep["period"], ep["kw"].get("fragment_sync_delay", 0)
    if kind == "clean":
        ep["T"] = rng.randint(2 * P, 4 * P) + tau
    elif kind == "nan":
        ep["T"] = rng.randint(3 * P, 5 * P) + tau
        ep["rank"], ep["step"] = rng.randrange(world), rng.randint(1, ep["T"] - 2 * P)
        if rng.random() < 0.15:
            ep["kw"]["on_nonfinite"] = "raise"  # the same NaN must then stop every rank instead
        else:
            ep["kw"]["max_nonfinite_syncs"] = rng.choice([3, 4])
    elif kind == "stuck":
        m = rng.randint(1, 3)
        ep["kw"]["max_nonfinite_syncs"] = m
        ep["rank"], ep["step"] = rng.randrange(world), rng.randint(1, 2 * P)
        ep["T"] = ep["step"] + (m + 2) * P + tau
    elif kind == "views":
        ep["T"] = rng.randint(2 * P, 4 * P) + tau
        ep["rank"], ep["step"] = rng.randrange(world), rng.randint(1, ep["T"])
        ep["how"] = rng.choice(["data", "double_float", "assign"])
        ep["param"] = rng.choice(PARAM_NAMES)
    elif kind == "config":
        ep["rank"] = rng.randrange(world)
        ep["T"] = 2 * P + tau
        ep.update(_mismatch(rng, ep))
    elif kind == "corrupt":
        c = rng.randint(2, 4)
        ep["ckpt_every"] = c
        ep["T"] = rng.randint(3 * c, 5 * c) + rng.randint(1, P + tau)
        gens = list(range(c, ep["T"], c))
        ep["restore"] = rng.choice(gens[1:])  # its predecessor exists: the fallback
        ep["fallback"] = ep["restore"] - c
        n_bad = 1 if rng.random() < 0.8 else rng.randint(1, world)
        ep["victims"] = sorted(rng.sample(range(world), n_bad))
        ep["corruption"] = _corruption(rng)
    elif kind == "wire":
        ep.update(_wire_job(rng, world, methods=METHODS))
    elif kind == "resize":
        ep.update(_wire_job(rng, world, methods=("diloco", "streaming", "cocodc")))
        # with error feedback, a DCP load on another number of ranks has no residual of its own
        ep["kw"]["error_feedback"] = ep["kw"]["wire_dtype"] in QUANT_WIRES and rng.random() < 0.25
        ep["load_kw"] = dict(ep["kw"])
        ep["writers"] = rng.choice(["all", "sub"])  # the other group loads: sub = ranks 0 .. world-2
    ls = ep["kw"].get("local_steps")
    if isinstance(ls, list):
        # per-rank LOSCAR rounds: each rank must run the same number of ROUNDS (so its own number of
        # steps), else the faster rank's next round meets the slower one's finish() in a collective
        lens = [n + q for n, q in zip(ls, ep["kw"]["overlap_steps"], strict=True)]
        own = lens[ep.get("rank", 0)]
        rounds = 2
        if kind == "nan":
            rounds = rng.randint(3, 5)
            ep["step"] = rng.randint(1, (rounds - 2) * own)
        elif kind == "stuck":
            ep["step"] = rng.randint(1, 2 * own)
            rounds = -(-ep["step"] // own) + ep["kw"]["max_nonfinite_syncs"] + 2
        elif kind == "views":
            rounds = rng.randint(2, 4)
            ep["step"] = rng.randint(1, rounds * own)
        ep["T"] = [rounds * n for n in lens]
    return ep


def _wire_job(rng: random.Random, world: int, methods: tuple[str, ...]) -> dict:
    """A float32 job with a sync in flight most of the time (a fragment sync delay, or LOSCAR's
    overlap), saved at the first step from ep["save_from"] with a sync in flight, under one wire
    format (error feedback on or off) and loaded under another (or the same)."""
    method = rng.choice(methods)
    kw: dict = {"timeout_s": rng.choice([5.0, 8.0, 10.0]), "quant_block": QUANT_BLOCK}
    if method == "diloco":  # blocking: nothing in flight between steps, the plain resume
        H = rng.randint(2, 5)
        kw["sync_every"] = H
    elif method == "streaming":
        K = rng.randint(1, 2)
        H = K * rng.randint(2, 4)
        kw.update(sync_every=H, num_fragments=K, fragment_sync_delay=rng.randint(1, H // K - 1))
    elif method == "cocodc":
        K, tau = rng.randint(1, 2), rng.randint(1, 2)
        H = rng.randint(max(2, K, tau * K), 8)
        kw.update(
            sync_every=H,
            num_fragments=K,
            fragment_sync_delay=tau,
            syncs_per_period=rng.randint(K, H // tau),
            score=rng.choice(["l2_global", "round_robin"]),
        )
    else:
        N, Q = rng.randint(1, 3), rng.randint(1, 2)
        H = N + Q
        kw.update(
            density=rng.choice([0.3, 0.5, 1.0]),
            local_steps=N,
            overlap_steps=Q,
            merge=rng.choice(["delay_corrected", "overwrite"]),
            seed=rng.randint(0, 999),
        )
    wires = DENSE_WIRES + QUANT_WIRES
    save = rng.choice(wires)
    ef_ok = method != "loscar"  # LOSCAR has no error feedback
    ef = ef_ok and save in QUANT_WIRES and rng.random() < 0.6
    if rng.random() < 0.35:  # the same wire (and error feedback): the whole run must be bit-identical
        load, load_ef = save, ef
    else:
        load = rng.choice(wires)
        load_ef = ef_ok and load in QUANT_WIRES and rng.random() < 0.6
    tau = kw.get("fragment_sync_delay", 0)
    return {
        "method": method,
        "dtype": "float32",
        "opt": rng.choice(OPTS),
        "period": H,
        "world": world,
        "kw": {**kw, "wire_dtype": save, "error_feedback": ef},
        "load_kw": {**kw, "wire_dtype": load, "error_feedback": load_ef},
        "save_from": rng.randint(1, 2 * H),
        "T": 4 * H + tau + 2,
    }


def steps(ep: dict, rank: int) -> int:
    T = ep["T"]
    return T[rank] if isinstance(T, list) else T


def _mismatch(rng: random.Random, ep: dict) -> dict:
    """One knob that differs on rank ep["rank"]: the other rank's overrides and the field the error
    must name first."""
    method, kw = ep["method"], ep["kw"]
    options = ["method", "wire_dtype", "width"]
    if method == "loscar":
        options += ["local_steps", "seed", "density"]
    else:
        options += ["sync_every"]
    if method in ("streaming", "cocodc") and _other_fragments(kw, method):
        options.append("num_fragments")
    knob = rng.choice(options)
    over: dict = {}
    field = knob
    if knob == "method":
        other = rng.choice([m for m in METHODS if m != method])
        okw, _ = _strategy(rng, other, ep["world"], hetero=False)
        okw["wire_dtype"] = kw.get("wire_dtype")  # only the method differs among the leading fields
        okw["guard_every"] = kw["guard_every"]
        over = {"method": other, "kw": {k: v for k, v in okw.items() if v is not None}}
    elif knob == "wire_dtype":
        over = {"kw": {**kw, "wire_dtype": None if kw.get("wire_dtype") else "bfloat16"}}
    elif knob == "width":
        over = {"width": rng.choice([6, 12, 16])}
        field = "k" if method == "loscar" else "parameter 'inp.weight'"  # LOSCAR's k = ceil(density * d)
    elif knob == "sync_every":
        H = kw["sync_every"]
        step = kw.get("num_fragments", 1) if method == "streaming" else 1  # stays a valid schedule
        over = {"kw": {**kw, "sync_every": H + step}}
    elif knob == "num_fragments":
        over = {"kw": {**kw, "num_fragments": rng.choice(_other_fragments(kw, method))}}
        field = "number of fragments"
    elif knob == "local_steps":
        ls = kw["local_steps"]
        ls = [v + 1 for v in ls] if isinstance(ls, list) else ls + 1
        over = {"kw": {**kw, "local_steps": ls}}
        field = "local_steps (per rank)"
    elif knob == "seed":
        over = {"kw": {**kw, "seed": kw["seed"] + 1}}
    else:
        over = {"kw": {**kw, "density": rng.choice([d for d in (0.1, 0.3, 0.5, 1.0) if d != kw["density"]])}}
    return {"knob": knob, "field": field, "override": over}


def _other_fragments(kw: dict, method: str) -> list[int]:
    """Fragment counts != K for which the rest of the configuration stays valid."""
    H, K, tau = kw["sync_every"], kw["num_fragments"], kw["fragment_sync_delay"]
    if method == "streaming":
        return [k for k in (1, 2, 3, 4) if k != K and k <= H and tau < H // k]
    return [k for k in (1, 2, 3) if k != K and tau * k <= H and k <= kw["syncs_per_period"]]


def kill_episode(seed: int, world: int, index: int) -> dict:
    rng = random.Random(f"chaos:{seed}:kill:{world}:{index}")
    ep = {"id": f"k{index}", "seed": seed, "kind": "kill", **_job(rng, world, hetero=False)}
    P = ep["period"]
    ep["kw"]["timeout_s"] = rng.choice([5.0, 8.0])
    c = rng.randint(2, 4)
    ep["ckpt_every"] = c
    # survivors run on until their next wait (at most one period): keep enough generations that the
    # last one every rank holds, and the one before it, are still there
    ep["keep"] = P // c + 4
    ep["T"] = rng.randint(4 * c, 6 * c) + P + ep["kw"].get("fragment_sync_delay", 0)
    ep["victim"] = rng.randrange(world)
    if rng.random() < 0.3:
        ep["mode"] = "mid_save"  # dies inside write_checkpoint, between write and rename
        ep["kill_at"] = c * rng.randint(1, ep["T"] // c)
    else:
        ep["mode"] = "step"
        ep["kill_at"] = rng.randint(c + 1, ep["T"])
    if rng.random() < 0.5:  # and at restart one rank's newest common file is damaged
        ep["restart_corrupt"] = {"rank": rng.randrange(world), "corruption": _corruption(rng)}
    return ep


def describe(ep: dict) -> str:
    kw = {k: v for k, v in ep["kw"].items() if k != "timeout_s"}
    job = (
        f"{ep['method']} W={ep['world']} {ep['dtype']} {ep['opt']} T={ep['T']} "
        f"timeout_s={ep['kw']['timeout_s']} {kw}"
    )
    k = ep["kind"]
    if k == "clean":
        what = "no fault (control)"
    elif k == "nan":
        mode = "on_nonfinite=raise" if ep["kw"].get("on_nonfinite") == "raise" else "skip"
        what = f"NaN loss on rank {ep['rank']} at step {ep['step']} ({mode})"
    elif k == "stuck":
        what = f"NaN loss on rank {ep['rank']} at every step from {ep['step']}"
    elif k == "views":
        what = f"rank {ep['rank']} reassigns its parameters after step {ep['step']} ({ep['how']}" + (
            f" {ep['param']})" if ep["how"] == "data" else ")"
        )
    elif k == "config":
        what = f"rank {ep['rank']} differs in {ep['knob']}: {ep['override']}"
    elif k == "wire":
        lk = ep["load_kw"]
        what = (
            f"saved from step {ep['save_from']} with a sync in flight, wire {_wire_text(ep['kw'])}, "
            f"loaded under {_wire_text(lk)}"
        )
    elif k == "resize":
        n_sub = ep["world"] - 1
        a, b = (ep["world"], n_sub) if ep["writers"] == "all" else (n_sub, ep["world"])
        what = (
            f"saved (plain and DCP) from step {ep['save_from']} by {a} rank(s), wire "
            f"{_wire_text(ep['kw'])}, loaded by {b}"
        )
    elif k == "corrupt":
        what = (
            f"checkpoints every {ep['ckpt_every']}; rank(s) {ep['victims']} damaged at step "
            f"{ep['restore']} ({_corruption_text(ep['corruption'])}); fallback {ep['fallback']}"
        )
    else:
        what = (
            f"rank {ep['victim']} SIGKILLed at step {ep['kill_at']} ({ep['mode']}); checkpoints every "
            f"{ep['ckpt_every']}, keep {ep['keep']}"
        )
        rc = ep.get("restart_corrupt")
        if rc:
            what += f"; at restart rank {rc['rank']}'s file damaged ({_corruption_text(rc['corruption'])})"
    return f"[{ep['id']}] {k}: {job}; {what}"


def _wire_text(kw: dict) -> str:
    return kw["wire_dtype"] + ("+ef" if kw.get("error_feedback") else "")


def _corruption_text(c: dict) -> str:
    if c["mode"] == "truncate":
        return f"truncated to {c['frac']:.3f} of its size"
    return f"{len(c['flips'])} byte(s) flipped"


# ----- building and training -------------------------------------------------------------------


def _kwargs(kw: dict) -> dict:
    out = dict(kw)
    if out.get("wire_dtype") in DENSE_WIRES + QUANT_WIRES:  # a name of runtime.schedule.WIRE_FORMATS
        pass
    elif out.get("wire_dtype") is not None:
        out["wire_dtype"] = getattr(torch, out["wire_dtype"])
    else:
        out.pop("wire_dtype", None)
    return out


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _guarded(fn) -> str | None:
    try:
        fn()
    except Exception as e:
        return _err(e)
    return None


def _build(ep: dict, override: dict | None = None):
    """Model, inner optimizer and strategy of the episode's job (collective: the strategy joins the
    group). The log collects per-sync records and a hash of the shared state after each sync."""
    over = override or {}
    model = make_model(DTYPES[ep["dtype"]], width=over.get("width", WIDTH))
    opt = make_optimizer(ep["opt"], model)
    method = over.get("method", ep["method"])
    log: dict = {"records": [], "g": []}
    holder: list = []

    def on_sync(rec):
        st = holder[0]
        log["records"].append((rec.fragment, rec.send_step, rec.apply_step, bool(rec.skipped), rec.round))
        if hasattr(st, "g"):
            log["g"].append(tensor_hash(st.g))
        else:  # LOSCAR keeps no global copy; its mask is what every rank must agree on
            log["g"].append(tensor_hash(st.last_idx))

    extra = {"process_group": over["group"]} if over.get("group") is not None else {}
    st = CLASSES[method](model, opt, metrics_callback=on_sync, **extra, **_kwargs(over.get("kw", ep["kw"])))
    holder.append(st)
    return model, opt, st, log


def _break_views(model, how: str, param: str) -> None:
    if how == "data":
        p = model.get_parameter(param)
        p.data = p.data.clone()
    elif how == "double_float":  # a round trip through the other float dtype: same dtype, new storage
        if next(model.parameters()).dtype == torch.float32:
            model.double().float()
        else:
            model.float().double()
    else:
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)


def _train(
    rank: int,
    ep: dict,
    model,
    opt,
    st,
    start: int,
    stop: int,
    *,
    nan=None,
    nan_from=None,
    brk=None,
    on_step=None,
) -> None:
    dtype = DTYPES[ep["dtype"]]
    for t in range(start + 1, stop + 1):
        x, y = batch(rank, t, dtype)
        loss = loss_fn(model, x, y)
        if (nan is not None and (rank, t) == nan) or (
            nan_from is not None and rank == nan_from[0] and t >= nan_from[1]
        ):
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        opt.zero_grad()
        if brk is not None and (rank, t) == brk[:2]:
            _break_views(model, brk[2], brk[3])
        if on_step is not None:
            on_step(t, "before")
        st.step()
        if on_step is not None:
            on_step(t, "after")
    st.finish()


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _finite(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _diff(a: dict, b: dict) -> list[str]:
    """Names of the parameters that are not bit-identical (torch.equal)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _all_ok(ok: bool) -> list[bool]:
    """Every rank's flag (a test-side collective, not the runtime's)."""
    mine = torch.tensor([1 if ok else 0], dtype=torch.int64)
    outs = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(outs, mine)
    return [bool(o.item()) for o in outs]


def ckpt_path(d: str, step: int, rank: int) -> str:
    return os.path.join(d, f"ckpt_{step}_rank{rank}.pt")


def corrupt_file(path: str, c: dict) -> None:
    """Damage a file in place, as a bad disk or an interrupted copy would."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if c["mode"] == "truncate":
        data = data[: int(c["frac"] * len(data))]
    else:
        for frac, xor in c["flips"]:
            data[min(int(frac * len(data)), len(data) - 1)] ^= xor
    with open(path, "wb") as f:
        f.write(bytes(data))


# ----- in-process episodes ---------------------------------------------------------------------


def _run_fault(rank: int, ep: dict, **fault) -> dict:
    model, opt, st, log = _build(ep)
    err = _guarded(lambda: _train(rank, ep, model, opt, st, 0, steps(ep, rank), **fault))
    m = st.metrics
    out = {
        "error": err,
        "records": log["records"],
        "g": log["g"],
        "finite": _finite(model),
        "skipped": m.num_skipped,
        "syncs": m.num_syncs,
        "recovery": m.recovery_bytes,
        "params": _params(model),
    }
    st.close()
    return out


def _twice(rank: int, ep: dict, **fault) -> dict:
    """The same run twice from fresh objects: the second must be bit-identical to the first."""
    a = _run_fault(rank, ep, **fault)
    b = _run_fault(rank, ep, **fault)
    same = (
        a["records"] == b["records"]
        and a["g"] == b["g"]
        and a["error"] == b["error"]
        and not _diff(a["params"], b["params"])
    )
    pa, pb = a.pop("params"), b.pop("params")
    return {**a, "deterministic": same, "error2": b["error"], "diff": _diff(pa, pb)}


def _ep_corrupt(rank: int, ep: dict, out_dir: str) -> dict:
    d = os.path.join(out_dir, ep["id"])
    os.makedirs(d, exist_ok=True)
    c = ep["ckpt_every"]
    # A: the uninterrupted run, checkpointing every c steps (saving never changes the trajectory)
    model, opt, st, log = _build(ep)

    def save(t, when):
        if when == "after" and t % c == 0:
            st.save_checkpoint(ckpt_path(d, t, rank))

    err_a = _guarded(lambda: _train(rank, ep, model, opt, st, 0, ep["T"], on_step=save))
    ref = _params(model)
    st.close()
    if rank in ep["victims"]:
        corrupt_file(ckpt_path(d, ep["restore"], rank), ep["corruption"])
    # B: fresh objects restore the damaged generation; if any rank refuses it, every rank falls back
    model, opt, st, log = _build(ep)
    attempts, loaded = [], None
    for step in (ep["restore"], ep["fallback"]):
        err = _guarded(lambda: st.load_checkpoint(ckpt_path(d, step, rank)))  # noqa: B023
        oks = _all_ok(err is None)
        attempts.append({"step": step, "error": err, "all_ok": all(oks), "at_step": st.step_count})
        if all(oks):
            loaded = step
            break
    err_b = None
    if loaded is not None:
        err_b = _guarded(lambda: _train(rank, ep, model, opt, st, st.step_count, ep["T"]))
    out = {
        "error": err_a,
        "error_b": err_b,
        "attempts": attempts,
        "loaded": loaded,
        "diff": _diff(ref, _params(model)) if loaded is not None else None,
    }
    st.close()
    return out


def _in_flight(st) -> list[tuple[int, int]]:
    """(fragment, apply step) of each sync in flight; LOSCAR's round in flight as (-1, -1)."""
    if hasattr(st, "pending"):
        return [(pd.fragment, pd.apply_step) for pd in st.pending]
    return [(-1, -1)] if getattr(st, "inflight", None) is not None else []


def _snapshot(model, opt, st) -> dict:
    """Everything a refused load must leave untouched: parameters, inner optimizer state, the
    strategy's step, outer state and residual."""
    snap = {f"param {k}": v for k, v in _params(model).items()}
    for i, state in enumerate(opt.state_dict()["state"].values()):
        for key, v in state.items():
            if isinstance(v, torch.Tensor):
                snap[f"optimizer state {i}.{key}"] = v.detach().clone()
    for key in ("g", "u", "residual"):
        v = getattr(st, key, None)
        if isinstance(v, torch.Tensor):
            snap[key] = v.detach().clone()
    snap["step"] = torch.tensor(st.step_count)
    return snap


def _outer_hash(st) -> list[int]:
    """The replicated state (x, and g / u where the strategy has them) as hashes."""
    return [tensor_hash(st.frags.flat)] + [tensor_hash(getattr(st, k)) for k in ("g", "u") if hasattr(st, k)]


def _ep_wire(rank: int, ep: dict, out_dir: str) -> dict:
    """A: the run under the save wire, checkpointing at the first step from save_from with a sync in
    flight (x, g, u hashed after every step). B: fresh objects under the load wire load it; a refusal
    must leave them untouched, a load must follow A bit for bit at least until the result in flight
    lands (to the end when nothing about the wire changed)."""
    d = os.path.join(out_dir, ep["id"])
    os.makedirs(d, exist_ok=True)
    path = ckpt_path(d, 0, rank)
    model, opt, st, log = _build(ep)
    hashes: dict[int, list[int]] = {}
    saved: dict = {}

    def save(t, when):
        if when != "after":
            return
        hashes[t] = _outer_hash(st)
        if not saved and t >= ep["save_from"] and (_in_flight(st) or ep["method"] == "diloco"):
            saved.update(step=t, in_flight=_in_flight(st))
            res = getattr(st, "residual", None)
            saved["residual"] = None if res is None else res.detach().clone()
            st.save_checkpoint(path)
            saved["after_save"] = _outer_hash(st)  # saving drains, never changes the state

    err_a = _guarded(lambda: _train(rank, ep, model, opt, st, 0, ep["T"], on_step=save))
    st.close()
    oks = _all_ok(err_a is None and bool(saved))
    if not all(oks):
        return {"error": err_a, "saved": saved.get("step"), "skip": "no rank saved"}
    model, opt, st, log = _build(ep, {"kw": ep["load_kw"]})
    before = _snapshot(model, opt, st)
    from tests.runtime.rt_common import runtime_warnings

    with runtime_warnings() as logged:
        refused = _guarded(lambda: st.load_checkpoint(path))
    out = {
        "error": None,
        "saved": saved["step"],
        "in_flight": saved["in_flight"],
        "refused": refused,
        "logged": logged,
        "residual_saved": None if saved["residual"] is None else tensor_hash(saved["residual"]),
    }
    if refused is not None:
        after = _snapshot(model, opt, st)
        out["changed"] = _diff(before, after)
        st.close()
        return out
    res = getattr(st, "residual", None)
    out["residual_loaded"] = None if res is None else tensor_hash(res)
    out["residual_equal"] = (
        res is not None and saved["residual"] is not None and torch.equal(res, saved["residual"])
    )
    same_wire = ep["load_kw"] == ep["kw"]
    lands = max([a for _, a in saved["in_flight"] if a >= 0], default=saved["step"])
    got: dict[int, list[int]] = {}
    loscar_landed: list[int] = []

    def follow(t, when):
        if when == "after":
            got[t] = _outer_hash(st)
            if not _in_flight(st) and not loscar_landed:
                loscar_landed.append(t)

    out["error_b"] = _guarded(
        lambda: _train(rank, ep, model, opt, st, st.step_count, ep["T"], on_step=follow)
    )
    st.close()
    if ep["method"] == "loscar":  # the round in flight merges when LOSCAR's in-flight slot empties
        lands = loscar_landed[0] if loscar_landed else ep["T"]
    until = ep["T"] if same_wire else lands
    out["until"] = until
    out["differ"] = [t for t in range(saved["step"] + 1, until + 1) if got.get(t) != hashes.get(t)]
    out["end_equal"] = got.get(ep["T"]) == hashes.get(ep["T"])
    return out


_GROUPS: dict = {}  # "sub": the group of ranks 0 .. world-2, made by segment() on every rank


def _even_out(rank: int, members: list[int], ep: dict) -> None:
    """A compressed wire makes a process group of its own over its strategy's ranks
    (use_local_synchronization), named after the ranks AND the number of groups this rank holds: a
    strategy on a subgroup leaves the ranks outside it one group short. The runtime evens the counts
    itself before it makes its group (compression._even_group_counts); the soak also keeps them even,
    so its episodes' group layout does not depend on that."""
    if rank not in members and len(members) > 1 and ep["kw"]["wire_dtype"] in QUANT_WIRES:
        dist.new_group([rank], use_local_synchronization=True)


def _ep_resize(rank: int, ep: dict, out_dir: str) -> dict:
    """One group (all ranks, or ranks 0 .. world-2) trains, saves a plain per-rank checkpoint and a DCP
    one at the first step from save_from with a sync in flight, and goes on (g and u hashed after
    every step); then the group of the other size loads: the plain file must be refused naming the
    world size, the DCP save must resume with the saved g, u, step and syncs in flight and follow the
    writers bit for bit until those syncs have landed (or, with error feedback, be refused naming the
    residuals: another number of ranks has none of its own)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from lowcomm_kernels.runtime.dcp import DCPState

    world = ep["world"]
    d = os.path.join(out_dir, ep["id"])
    os.makedirs(d, exist_ok=True)
    dcp_dir = os.path.join(d, "dcp")
    groups = {
        "all": (list(range(world)), dist.group.WORLD),
        "sub": (list(range(world - 1)), _GROUPS.get("sub")),
    }
    writers, wgroup = groups[ep["writers"]]
    loaders, lgroup = groups["sub" if ep["writers"] == "all" else "all"]
    out: dict = {"error": None, "writer": rank in writers, "loader": rank in loaders}

    def g_hash(st) -> list[int]:
        return [tensor_hash(st.g), tensor_hash(st.u)]

    if rank in writers:
        model, opt, st, log = _build(ep, {"group": wgroup})
        ref: dict = {"hashes": {}}

        def save(t, when):
            if when != "after":
                return
            ref["hashes"][t] = g_hash(st)
            if "step" not in ref and t >= ep["save_from"] and (_in_flight(st) or ep["method"] == "diloco"):
                ref.update(step=t, in_flight=_in_flight(st))
                st.save_checkpoint(ckpt_path(d, 0, writers.index(rank)))
                dcp.save(
                    {"model": model.state_dict(), "strategy": DCPState(st)},
                    checkpoint_id=dcp_dir,
                    process_group=wgroup,
                )

        out["error"] = _guarded(lambda: _train(rank, ep, model, opt, st, 0, ep["T"], on_step=save))
        st.close()
        if rank == 0:
            _write(d, "ref.pkl", ref)
    _even_out(rank, writers, ep)
    dist.barrier()
    _even_out(rank, loaders, ep)
    if rank not in loaders:
        return out
    with open(os.path.join(d, "ref.pkl"), "rb") as f:
        ref = pickle.load(f)
    if "step" not in ref:
        return {**out, "skip": "the writers never saved"}
    model, opt, st, log = _build(ep, {"kw": ep["load_kw"], "group": lgroup})
    before = _snapshot(model, opt, st)
    own = ckpt_path(d, 0, loaders.index(rank) % len(writers))
    out["plain_refused"] = _guarded(lambda: st.load_checkpoint(own))
    out["plain_changed"] = _diff(before, _snapshot(model, opt, st))
    state = {"model": model.state_dict(), "strategy": DCPState(st)}
    try:
        dcp.load(state, checkpoint_id=dcp_dir, process_group=lgroup)
    except CheckpointException as e:  # a BaseException: DCP's refusal on every rank
        out["dcp_refused"] = _err(e)
        out["dcp_changed"] = _diff(before, _snapshot(model, opt, st))
        st.close()
        return out
    out["dcp_refused"] = None
    model.load_state_dict(state["model"])
    out["loaded"] = {"step": st.step_count, "in_flight": _in_flight(st), "g": g_hash(st)}
    out["saved"] = {"step": ref["step"], "in_flight": ref["in_flight"], "g": ref["hashes"][ref["step"]]}
    lands = max([a for _, a in ref["in_flight"]], default=ref["step"])
    got: dict[int, list[int]] = {}

    def follow(t, when):
        if when == "after":
            got[t] = g_hash(st)

    out["error_b"] = _guarded(
        lambda: _train(rank, ep, model, opt, st, st.step_count, ep["T"], on_step=follow)
    )
    out["differ"] = [t for t in range(ref["step"] + 1, lands + 1) if got.get(t) != ref["hashes"].get(t)]
    out["final_g"] = got.get(ep["T"])
    out["finite"] = _finite(model)
    st.close()
    return out


def run_episode(rank: int, ep: dict, out_dir: str) -> dict:
    k = ep["kind"]
    if k == "clean":
        return _twice(rank, ep)
    if k == "nan":
        return _twice(rank, ep, nan=(ep["rank"], ep["step"]))
    if k == "stuck":
        r = _run_fault(rank, ep, nan_from=(ep["rank"], ep["step"]))
        r.pop("params")
        return r
    if k == "views":
        r = _run_fault(rank, ep, brk=(ep["rank"], ep["step"], ep["how"], ep["param"]))
        r.pop("params")
        return r
    if k == "config":
        try:
            model, opt, st, log = _build(ep, ep["override"] if rank == ep["rank"] else None)
        except Exception as e:
            return {"error": _err(e), "stage": "construct"}
        err = _guarded(lambda: _train(rank, ep, model, opt, st, 0, steps(ep, rank)))
        return {"error": err, "stage": "train"}
    if k == "corrupt":
        return _ep_corrupt(rank, ep, out_dir)
    if k == "wire":
        return _ep_wire(rank, ep, out_dir)
    if k == "resize":
        return _ep_resize(rank, ep, out_dir)
    raise ValueError(k)


def _probe(rank: int) -> dict:
    """A short fault-free DiLoCo run: the group still pairs its collectives and agrees on g."""
    ep = {
        "method": "diloco",
        "dtype": "float64",
        "opt": "sgd_momentum",
        "kw": {"sync_every": 2, "timeout_s": 10.0},
    }
    try:
        model, opt, st, log = _build(ep)
        _train(rank, ep, model, opt, st, 0, 4)
        st.close()
    except Exception as e:
        return {"error": _err(e), "g": []}
    return {"error": None, "g": log["g"]}


def _write(out_dir: str, name: str, rec: dict) -> None:
    path = os.path.join(out_dir, name)
    with open(path + ".tmp", "wb") as f:
        pickle.dump(rec, f)
    os.replace(path + ".tmp", path)


def _harness_gather(values: list[int]) -> list[list[int]]:
    """Every rank's values (the test's own collective: keeps the ranks in step between episodes)."""
    mine = torch.tensor(values, dtype=torch.int64)
    table = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(table, mine)
    return [[int(v) for v in t] for t in table]


def segment(rank: int, world: int, seed: int, plan: dict, out_dir: str) -> dict:
    """One long-lived group: plan["restart"] (a kill episode and its candidate generations) if any,
    then soak episodes from plan["first"] until rank 0's wall clock passes plan["deadline"] (at
    least plan["min"] of them) or exactly the indices plan["only"], then the kill episode
    plan["kill"] if any. Results go to files in out_dir as they come."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # the first optimizer imports dynamo
    # the resize episodes' other group, and (so that every rank holds as many groups: see _even_out)
    # one for the rank outside it; both collective
    _GROUPS["sub"] = dist.new_group(list(range(world - 1)))
    dist.new_group([world - 1])
    ready = time.time()
    desync = None
    if plan.get("restart"):
        r = plan["restart"]
        t0 = time.monotonic()
        try:
            res, harness = restart(rank, r["ep"], r["dir"], r["candidates"]), None
        except Exception as e:
            res, harness = {}, _err(e)
        _write(
            out_dir,
            f"restart_{r['ep']['id']}_rank{rank}.pkl",
            {"result": res, "harness_error": harness, "seconds": time.monotonic() - t0},
        )
    only, i = plan.get("only"), 0
    while True:
        go = i < len(only) if only is not None else (i < plan["min"] or time.time() < plan["deadline"])
        try:  # rank 0 decides; every rank must be at the same episode (else the group lost its pairing)
            table = _harness_gather([i, 1 if go else 0])
        except Exception as e:
            desync = f"harness all_gather before soak episode {i} of this group failed: {_err(e)}"
            break
        if any(t[0] != i for t in table):
            desync = f"ranks are at different episodes: {[t[0] for t in table]}"
            break
        if not table[0][1]:
            break
        ep = soak_episode(seed, world, only[i] if only is not None else plan["first"] + i)
        t0 = time.monotonic()
        try:
            res, harness = run_episode(rank, ep, out_dir), None
        except Exception as e:  # a failure of the test's own steps (e.g. a refused fallback)
            res, harness = {}, _err(e)
        _write(
            out_dir,
            f"ep_{ep['id']}_rank{rank}.pkl",
            {
                "spec": ep,
                "result": res,
                "harness_error": harness,
                "probe": _probe(rank),
                "seconds": time.monotonic() - t0,
            },
        )
        i += 1
    if plan.get("kill") and desync is None:
        ep = plan["kill"]
        d = os.path.join(out_dir, ep["id"])
        os.makedirs(d, exist_ok=True)
        _harness_gather([-1])
        t0 = time.monotonic()
        res = kill_run(rank, ep, d)  # the victim never returns
        _write(out_dir, f"kill_{ep['id']}_rank{rank}.pkl", {**res, "seconds": time.monotonic() - t0})
    return {"episodes": i, "desync": desync, "ready": ready}


# ----- SIGKILL episodes (the last act of a group; the next group restarts it) -------------------


def _prune(d: str, rank: int, keep: int) -> None:
    steps = sorted(
        int(f.split("_")[1]) for f in os.listdir(d) if f.startswith("ckpt_") and f.endswith(f"_rank{rank}.pt")
    )
    for s in steps[:-keep]:
        os.remove(ckpt_path(d, s, rank))


def _die(d: str) -> None:
    with open(os.path.join(d, "victim_time"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def kill_run(rank: int, ep: dict, d: str) -> dict:
    """Train with a checkpoint generation every ckpt_every steps (the newest `keep` kept); the
    victim SIGKILLs itself at kill_at. Survivors report their error and how long after the kill
    it came."""
    model, opt, st, log = _build(ep)
    c, victim = ep["ckpt_every"], rank == ep["victim"]
    if victim and ep["mode"] == "mid_save":
        import lowcomm_kernels.runtime.checkpoint as ck

        real_fsync = ck.os.fsync

        def fsync(fd):  # the temporary file is written, not yet renamed
            if st.step_count == ep["kill_at"]:
                _die(d)
            real_fsync(fd)

        ck.os.fsync = fsync

    def on_step(t, when):
        if when == "before" and victim and ep["mode"] == "step" and t == ep["kill_at"]:
            _die(d)
        if when == "after" and t % c == 0:
            st.save_checkpoint(ckpt_path(d, t, rank))
            _prune(d, rank, ep["keep"])

    try:
        _train(rank, ep, model, opt, st, 0, ep["T"], on_step=on_step)
    except Exception as e:
        t_err = time.time()
        try:
            with open(os.path.join(d, "victim_time")) as f:
                after = t_err - float(f.read())
        except (OSError, ValueError):
            after = None
        return {"error": _err(e), "after_kill_s": after, "step": st.step_count}
    return {"error": None, "step": st.step_count}


def restart(rank: int, ep: dict, d: str, candidates: list[int]) -> dict:
    """A fresh group: restore every rank from the first candidate generation that every rank
    loads (0 = from scratch), finish the run, then run the same job uninterrupted; compare."""
    model, opt, st, log = _build(ep)
    attempts, loaded = [], None
    for step in candidates:
        if step == 0:
            if attempts:  # some ranks may have loaded a refused generation: start over cleanly
                st.close()
                model, opt, st, log = _build(ep)
            loaded = 0
            break
        err = _guarded(lambda: st.load_checkpoint(ckpt_path(d, step, rank)))  # noqa: B023
        oks = _all_ok(err is None)
        attempts.append({"step": step, "error": err, "all_ok": all(oks), "at_step": st.step_count})
        if all(oks):
            loaded = step
            break
    err = None
    if loaded is not None:
        err = _guarded(lambda: _train(rank, ep, model, opt, st, st.step_count, ep["T"]))
    restarted = _params(model)
    st.close()
    model, opt, st, log = _build(ep)
    ref_err = _guarded(lambda: _train(rank, ep, model, opt, st, 0, ep["T"]))
    st.close()
    return {
        "attempts": attempts,
        "loaded": loaded,
        "error": err,
        "ref_error": ref_err,
        "diff": _diff(restarted, _params(model)) if loaded is not None else None,
    }
