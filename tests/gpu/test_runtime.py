"""The runtime on a GPU: training against the float64 simulator, host syncs, and overlap.

    python bench/gpu_runtime.py [--device cuda|cpu] [--json PATH] [--md PATH]

Run by bench/gpu_check.sh. The runtime's tests run on the CPU with gloo; this checks what only a GPU
can show, with the model, data and inner step of tests/runtime/rt_common.py and the independent
float64 simulation of tests/runtime/rt_sim.py (imported from the checkout as
tests.runtime.*), so that a match means the
same thing it means in tests/runtime:

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
    only (the user's inner step is not the runtime's business): a synchronising call fails the check
    with its traceback; then the same period under "warn" lists every such call, plus the explicit
    host waits that the sync debug mode does not see (``Event.synchronize``, ``Stream.synchronize``,
    ``torch.cuda.synchronize``; reported, not failed: the runtime waits on events by design);
(d) overlap: a Streaming DiLoCo run on the two ranks (model and buffers on the GPU) with an
    emulated WAN (``runtime.WAN``) and emulated compute (a host sleep per step, as
    bench/bench_overlap.py does: two processes on one GPU time-slice it, so device work would not
    emulate one GPU each): exposed communication fraction (target <= 10% when tau x T_c >= T_s) and
    step time against no sync. A measurement: reported, not gating.

``--device cpu`` (gpu_check.sh --dry-run) runs (a), (b) and (d) with gloo on CPU tensors and skips
(c). Exit status 1 when a check of (a), (b) or (c) failed, or (d) raised.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the checkout: tests.runtime.* and bench modules
from bench_overlap import _model  # noqa: E402

import lowcomm_kernels.runtime as rt  # noqa: E402
from lowcomm_kernels import ops as lk  # noqa: E402
from lowcomm_kernels.runtime.launch import free_port, spawn_local  # noqa: E402
from tests.runtime.rt_common import batch, loss_fn, make_model, make_opt  # noqa: E402
from tests.runtime.rt_sim import simulate_dense, simulate_loscar  # noqa: E402

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
    dict(name="cocodc", cls="cocodc", T=48,
         kw=dict(STREAM, syncs_per_period=4, lam=0.5, lam_mode="normalized")),
    dict(name="loscar", cls="loscar", T=30,
         kw=dict(density=0.5, local_steps=4, overlap_steps=2, merge="overwrite", seed=3)),
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
    return {"params": {k: v.detach().cpu().clone() for k, v in model.named_parameters()},
            "syncs": st.metrics.num_syncs, "skipped": st.metrics.num_skipped}


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
        return simulate_loscar(M, sc["T"] // (N + Q), density=kw["density"], local_steps=[N] * M,
                               overlap_steps=[Q] * M, merge=kw.get("merge", "delay_corrected"),
                               seed=kw.get("seed", 0))["params"]
    extra = {} if cls == "diloco" else dict(K=kw["num_fragments"], tau=kw["fragment_sync_delay"])
    if cls == "cocodc":
        extra.update(N=kw["syncs_per_period"], lam=kw.get("lam", 0.5),
                     lam_mode=kw.get("lam_mode", "normalized"))
    return simulate_dense(cls, M, sc["T"], H=kw["sync_every"], **extra)["params"]


def verdict(part: str, name: str, run: dict, sim: dict) -> dict:
    """Row of (a)/(b): run's parameters against the simulation's, within TOL."""
    if "error" in run:
        return dict(part=part, name=name, status="FAIL", detail=run["error"])
    diff = max(float((run["params"][k].double() - v).abs().max()) for k, v in sim.items())
    ok = diff <= TOL and run["syncs"] > 0 and run["skipped"] == 0
    return dict(part=part, name=name, status="pass" if ok else "FAIL", max_abs_diff=diff, syncs=run["syncs"],
                detail="" if ok else f"max |param - sim| = {diff:.3g} (tol {TOL}), syncs {run['syncs']}, "
                                     f"skipped {run['skipped']}")


def guarded(fn) -> dict:
    try:
        return fn()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}


# ---------------------------------------------------------------------------- (b) + (d) worker
def pair_worker(rank: int, world: int, cfg: dict) -> dict:
    """One of the two ranks (gloo; CUDA tensors on GPU 0 when cfg['device'] is cuda)."""
    dev = torch.device(cfg["device"])
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    out: dict = {"train": {}}
    with delayed_pack(dev):
        for sc in PAIR:
            out["train"][sc["name"]] = guarded(lambda sc=sc: train(sc, rank, dev, timeout_s=60.0))
    out["overlap"] = guarded(lambda: overlap(dev, cfg["overlap"]))
    return out


def overlap(dev: torch.device, o: dict) -> dict:
    wan = rt.WAN(o["latency"], o["bandwidth"])
    res = {}
    for name in ("no sync", "Streaming DiLoCo"):
        model = _model(o["width"], o["blocks"]).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        st = None if name == "no sync" else rt.StreamingDiLoCo(
            model, opt, sync_every=o["H"], num_fragments=o["K"], fragment_sync_delay=o["tau"], wan=wan,
            timeout_s=60.0)
        t0 = time.perf_counter()
        for _ in range(o["steps"]):
            time.sleep(o["compute_s"])  # emulated forward/backward (no gradients: opt.step() skips)
            opt.step()
            opt.zero_grad()
            if st is not None:
                st.step()
        if st is not None:
            st.drain()
        rec = {"step_ms": 1e3 * (time.perf_counter() - t0) / o["steps"]}
        if st is not None:
            m = st.metrics
            ts = [r.in_flight_s for r in m.syncs]
            rec.update(exposed_fraction=m.exposed_fraction(), syncs=m.num_syncs,
                       t_s_ms=1e3 * sum(ts) / max(1, len(ts)),
                       mb_per_sync=m.bytes_sent / max(1, m.num_syncs) / 1e6)
        res[name] = rec
    return res


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

    patches = [(torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
               (torch.cuda, "synchronize")]
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


def sync_debug(dev: torch.device) -> list[dict]:
    rows = []
    for name, cls, kw in SYNC_CASES:
        sc, H = dict(cls=cls, kw=kw), kw["sync_every"]
        model = make_model(torch.float64).to(dev)
        opt = make_opt(model)
        st = CLASSES[cls](model, opt, **kw)
        error = ""
        for t in range(1, 2 * H + 1):
            inner_step(model, opt, 0, t, dev)
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
        syncs = guarded(lambda sc=sc, found=found: _warn_period(sc, dev, found))
        flagged = sorted({s for k, s in found if k.startswith("sync debug")})
        waits = sorted({s for k, s in found if k.startswith("explicit")})
        failed = error or flagged or "error" in syncs
        rows.append(dict(part="c", name=name, status="FAIL" if failed else "pass",
                         detail=error or syncs.get("error", ""), synchronising_calls=flagged,
                         explicit_waits=waits))
    return rows


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


# ------------------------------------------------------------------------------------- driver
def one_rank(dev: torch.device, rows: list[dict], save) -> None:
    """(a) and (c) in this process, on a process group of size 1."""
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        with delayed_pack(dev):
            for sc in SIZE1:
                run = guarded(lambda sc=sc: train(sc, 0, dev))
                rows.append(verdict("a", f"{sc['name']} ({backend}, 1 rank)", run, simulate(sc, 1)[0]))
                save()
            for sc in SIZE1[:2]:  # DiLoCo, Streaming DiLoCo on FSDP2 DTensor parameters
                run = guarded(lambda sc=sc: train_fsdp2(sc, dev))
                rows.append(verdict("a", f"{sc['name']} ({backend}, 1 rank, FSDP2)", run, simulate(sc, 1)[0]))
                save()
        if dev.type == "cuda":
            rows.extend(sync_debug(dev))
        else:
            rows.append(dict(part="c", name="sync debug mode", status="skip",
                             detail="needs a GPU (torch.cuda.set_sync_debug_mode)"))
        save()
    finally:
        dist.destroy_process_group()


def render(report: dict) -> str:
    lines = [f"Runtime on {report['device']} (`bench/gpu_runtime.py`): (a) one-rank group, (b) two ranks "
             "(gloo) against the float64 simulator `tests/runtime/rt_sim.py` (on a GPU, a device sleep "
             "before every pack); (c) host synchronisation inside `strategy.step()`; (d) overlap.", "",
             "| part | check | result | max abs diff vs sim | syncs | detail |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        diff = f"{r['max_abs_diff']:.2e}" if "max_abs_diff" in r else ""
        detail = r.get("detail", "").splitlines()[0][:160] if r.get("detail") else ""
        lines.append(f"| {r['part']} | {r['name']} | {r['status']} | {diff} | {r.get('syncs', '')} "
                     f"| {detail} |")
    for r in report["rows"]:
        for what in ("synchronising_calls", "explicit_waits"):
            if r.get(what):
                lines += ["", f"(c) {r['name']}: {what.replace('_', ' ')} ({len(r[what])}):", ""]
                lines += ["```", *[s.rstrip() + "\n" for s in r[what][:6]], "```"]
    ov = report.get("overlap")
    if ov:
        o = report["overlap_config"]
        lines += ["", f"(d) Overlap, Streaming DiLoCo on 2 ranks: WAN {o['latency'] * 1e3:.0f} ms, "
                  f"{o['bandwidth'] * 8 / 1e9:.2f} Gbit/s; compute emulated "
                  f"({o['compute_s'] * 1e3:.0f} ms per step); MLP {o['blocks']} x {o['width']}^2; "
                  f"H {o['H']}, K {o['K']}, tau {o['tau']}; {o['steps']} steps.", ""]
        if "error" in ov:
            lines.append(f"error: {ov['error'].splitlines()[0]}")
        else:
            s, base = ov["Streaming DiLoCo"], ov["no sync"]["step_ms"]
            lines.append(f"step {s['step_ms']:.1f} ms vs {base:.1f} ms without sync "
                         f"({s['step_ms'] / base:.2f}x); "
                         f"exposed communication {100 * s['exposed_fraction']:.1f}% "
                         f"({'PASS' if s['exposed_fraction'] <= 0.10 else 'MISS'}, target <= 10%); "
                         f"T_s {s['t_s_ms']:.0f} ms; {s['syncs']} syncs of {s['mb_per_sync']:.2f} MB.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (gloo on CPU tensors; skips (c))")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "gpu_runtime.json")
    ap.add_argument("--md", type=Path, default=HERE / "results" / "gpu_runtime.md")
    ap.add_argument("--budget-s", type=float, default=85.0, help="the two-rank part gets this less 25 s")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_runtime: no GPU (torch {torch.__version__} sees no CUDA device): nothing checked")
        return 0
    t0 = time.perf_counter()
    cuda = dev.type == "cuda"
    o = dict(latency=0.05, bandwidth=125e6, width=1024 if cuda else 256, blocks=8, H=20 if cuda else 16, K=4,
             tau=4 if cuda else 3, steps=40 if cuda else 32, compute_s=0.06 if cuda else 0.03)
    report = {"device": torch.cuda.get_device_name(dev) if cuda else "CPU (gloo)", "rows": [],
              "overlap_config": o, "torch": torch.__version__}

    def save() -> None:
        report["seconds"] = round(time.perf_counter() - t0, 1)
        for path, text in ((args.json, json.dumps(report, indent=1)), (args.md, render(report))):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    pair = guarded(lambda: spawn_local(f"{Path(__file__).resolve()}:pair_worker", 2,
                                       ({"device": args.device, "overlap": o},),
                                       timeout_s=max(20.0, args.budget_s - 25.0)))
    if "error" in pair:
        report["rows"].append(dict(part="b", name="two ranks (gloo)", status="FAIL", detail=pair["error"]))
        report["overlap"] = {"error": pair["error"]}
    else:
        for sc in PAIR:
            sims = simulate(sc, 2)
            for m in range(2):
                run = pair[m]["train"][sc["name"]]
                report["rows"].append(verdict("b", f"{sc['name']} (gloo, rank {m} of 2)", run, sims[m]))
        report["overlap"] = pair[0]["overlap"]
    save()
    one_rank(dev, report["rows"], save)
    failed = [r for r in report["rows"] if r["status"] == "FAIL"] + (
        [1] if "error" in report.get("overlap", {}) else [])
    save()
    print(render(report))
    print(f"gpu_runtime: {len(report['rows'])} checks, {len(failed)} failed, {report['seconds']} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
