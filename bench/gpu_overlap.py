"""Overlap on a GPU: Streaming DiLoCo's exposed communication over an emulated WAN, on two ranks.

    python bench/gpu_overlap.py [--device cuda|cpu] [--json PATH] [--md PATH] [--budget-s 60]

Run by bench/gpu_check.sh. Two processes on the same GPU (gloo with CUDA tensors, started by
``runtime.launch.spawn_local``) run Streaming DiLoCo with the model and buffers on the GPU, an
emulated WAN (``runtime.WAN``) and emulated compute (a host sleep per step, as bench/bench_overlap.py
does: two processes on one GPU time-slice it, so device work would not emulate one GPU each), and
once without any sync: the exposed communication fraction (target <= 10% when tau x T_c >= T_s)
and the step time against no sync. A measurement, reported with a verdict, not gating; exit status
1 only when the run raised. The runtime's correctness on the GPU is tests/gpu/test_runtime.py.
``--device cpu`` (gpu_check.sh --dry-run) runs it with gloo on CPU tensors.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the checkout and bench/bench_overlap.py
from bench_overlap import _model  # noqa: E402

import lowcomm_kernels.runtime as rt  # noqa: E402
from lowcomm_kernels.runtime.launch import spawn_local  # noqa: E402


def pair_worker(rank: int, world: int, cfg: dict) -> dict:
    """One of the two ranks (gloo; CUDA tensors on GPU 0 when cfg['device'] is cuda)."""
    dev = torch.device(cfg["device"])
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    return overlap(dev, cfg["overlap"])


def overlap(dev: torch.device, o: dict) -> dict:
    wan = rt.WAN(o["latency"], o["bandwidth"])
    res = {}
    for name in ("no sync", "Streaming DiLoCo"):
        model = _model(o["width"], o["blocks"]).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        st = (
            None
            if name == "no sync"
            else rt.StreamingDiLoCo(
                model,
                opt,
                sync_every=o["H"],
                num_fragments=o["K"],
                fragment_sync_delay=o["tau"],
                wan=wan,
                timeout_s=60.0,
            )
        )
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
            rec.update(
                exposed_fraction=m.exposed_fraction(),
                syncs=m.num_syncs,
                t_s_ms=1e3 * sum(ts) / max(1, len(ts)),
                mb_per_sync=m.bytes_sent / max(1, m.num_syncs) / 1e6,
            )
        res[name] = rec
    return res


def render(report: dict) -> str:
    o, ov = report["overlap_config"], report["overlap"]
    lines = [
        f"Overlap on {report['device']} (`bench/gpu_overlap.py`), Streaming DiLoCo on 2 ranks: WAN "
        f"{o['latency'] * 1e3:.0f} ms, {o['bandwidth'] * 8 / 1e9:.2f} Gbit/s; compute emulated "
        f"({o['compute_s'] * 1e3:.0f} ms per step); MLP {o['blocks']} x {o['width']}^2; "
        f"H {o['H']}, K {o['K']}, tau {o['tau']}; {o['steps']} steps.",
        "",
    ]
    if "error" in ov:
        lines.append(f"error: {ov['error'].splitlines()[0]}")
    else:
        s, base = ov["Streaming DiLoCo"], ov["no sync"]["step_ms"]
        lines.append(
            f"step {s['step_ms']:.1f} ms vs {base:.1f} ms without sync "
            f"({s['step_ms'] / base:.2f}x); "
            f"exposed communication {100 * s['exposed_fraction']:.1f}% "
            f"({'PASS' if s['exposed_fraction'] <= 0.10 else 'MISS'}, target <= 10%); "
            f"T_s {s['t_s_ms']:.0f} ms; {s['syncs']} syncs of {s['mb_per_sync']:.2f} MB."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (gloo on CPU tensors)")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "gpu_overlap.json")
    ap.add_argument("--md", type=Path, default=HERE / "results" / "gpu_overlap.md")
    ap.add_argument("--budget-s", type=float, default=60.0, help="the two ranks' time limit")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_overlap: no GPU (torch {torch.__version__} sees no CUDA device): nothing measured")
        return 0
    t0 = time.perf_counter()
    cuda = dev.type == "cuda"
    o = dict(
        latency=0.05,
        bandwidth=125e6,
        width=1024 if cuda else 256,
        blocks=8,
        H=20 if cuda else 16,
        K=4,
        tau=4 if cuda else 3,
        steps=40 if cuda else 32,
        compute_s=0.06 if cuda else 0.03,
    )
    report = {
        "device": torch.cuda.get_device_name(dev) if cuda else "CPU (gloo)",
        "overlap_config": o,
        "torch": torch.__version__,
    }
    try:
        pair = spawn_local(
            f"{Path(__file__).resolve()}:pair_worker",
            2,
            ({"device": args.device, "overlap": o},),
            timeout_s=max(20.0, args.budget_s),
        )
        report["overlap"] = pair[0]
    except Exception as e:
        report["overlap"] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
    report["seconds"] = round(time.perf_counter() - t0, 1)
    for path, text in ((args.json, json.dumps(report, indent=1)), (args.md, render(report))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(render(report))
    print(f"gpu_overlap: {report['seconds']} s")
    return 1 if "error" in report["overlap"] else 0


if __name__ == "__main__":
    sys.exit(main())
