"""Per-step cost of our DiLoCo / Streaming DiLoCo beside torchft's (torchft.local_sgd.DiLoCo), on CPU.

Two replica processes (one per rank, gloo) train the same model on the same data under five
configurations, interleaved in every round (the order rotates from round to round):

    plain            the bare loop: forward, backward, inner AdamW step (no wrapper)
    ours-diloco      lowcomm_kernels.runtime.DiLoCo(sync_every=H) over a torch.distributed gloo group
    torchft-diloco   torchft.local_sgd.DiLoCo(manager, [model], ..., sync_every=H)
    ours-streaming   lowcomm_kernels.runtime.StreamingDiLoCo(H, K fragments, tau)
    torchft-streaming torchft.local_sgd.DiLoCo(manager, K fragment modules, ..., fragment_sync_delay=tau)

Each run builds a fresh model (same seed), inner AdamW and wrapper, takes ``--warmup`` steps (a
whole period: the first sync and its allocations happen there), then times ``--steps`` steps (a
multiple of H, so every configuration times the same number of syncs). A run's step time is the
timed wall clock over the timed steps (syncs included) on rank 0. Reported per configuration: the
median over rounds, and for ours the ratio ours / torchft taken within each round, then its median.
Beside them, from the same rounds: the floor plain / torchft (a wrapped step is never faster than the
bare loop, so no wrapper's ratio can fall below it) and the step time each wrapper adds to the bare
loop (ours - plain and torchft - plain within each round, their medians, and the ratio of those).
torchft's manager talks to an in-process Lighthouse; ours needs none (a fixed gloo group).

    .venv/bin/python bench/vs_torchft.py                 # 8 x Linear(768), 300 steps, 5 rounds
    .venv/bin/python bench/vs_torchft.py --quick         # a tiny model, seconds (the test's)

Writes ``--out`` (JSON: the command, the machine's load before and after, every run, the summary)
and ``--markdown`` (the summary table), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "bench" / "figures"
CONFIGS = ("plain", "ours-diloco", "torchft-diloco", "ours-streaming", "torchft-streaming")
PAIRS = {"diloco": ("ours-diloco", "torchft-diloco"), "streaming": ("ours-streaming", "torchft-streaming")}
OUTER_LR, OUTER_MOMENTUM, INNER_LR = 0.7, 0.9, 1e-3


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps and rounds (a smoke run)")
    ap.add_argument("--layers", type=int, default=8, help="Linear(dim, dim) layers")
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300, help="timed inner steps per run (a multiple of H)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: H)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sync-every", type=int, default=20, help="H")
    ap.add_argument("--fragments", type=int, default=2, help="K (Streaming DiLoCo)")
    ap.add_argument("--tau", type=int, default=3, help="fragment_sync_delay (Streaming DiLoCo)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica process")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    ap.add_argument("--out", default=str(FIGURES / "vs_torchft.json"))
    ap.add_argument("--markdown", default=str(FIGURES / "vs_torchft.md"))
    ap.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--master-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        a.layers, a.dim, a.batch, a.steps, a.rounds, a.sync_every = 2, 64, 8, 40, 2, 10
    if a.warmup is None:
        a.warmup = a.sync_every
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        ap.error(f"--configs: unknown {bad}; choose from {', '.join(CONFIGS)}")
    a.configs = configs
    for name in ("layers", "dim", "batch", "steps", "rounds", "sync_every", "fragments", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.steps % a.sync_every:
        ap.error(f"--steps must be a multiple of --sync-every ({a.sync_every}), got {a.steps}")
    if a.sync_every % a.fragments or a.tau < 0 or a.tau >= a.sync_every // a.fragments:
        ap.error("--sync-every must be a multiple of --fragments and 0 <= --tau < sync_every / fragments")
    if a.layers < a.fragments:
        ap.error("--layers must be >= --fragments (one Linear at least per fragment)")
    return a


# ----- one replica ---------------------------------------------------------------------------------
def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed import TCPStore

    torch.set_num_threads(a.threads)
    rank = a.worker
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{a.master_port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    manager = None
    if any(c.startswith("torchft") for c in a.configs):
        from torchft import Manager, ProcessGroupGloo

        store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=120)), min_replica_size=2,
            load_state_dict=None, state_dict=None, replica_id=f"bench_{rank}", store_addr="localhost",
            store_port=store.port, hostname="localhost", rank=0, world_size=1,
            lighthouse_addr=a.lighthouse, use_async_quorum=False, init_sync=False,
            timeout=timedelta(seconds=120), quorum_timeout=timedelta(seconds=120),
            connect_timeout=timedelta(seconds=30),
        )  # fmt: skip
    gen = torch.Generator().manual_seed(1 + rank)
    data = [
        (torch.randn(a.batch, a.dim, generator=gen), torch.randn(a.batch, a.dim, generator=gen))
        for _ in range(8)
    ]

    def build():
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for i in range(a.layers):
            layers += [nn.Linear(a.dim, a.dim)] + ([nn.ReLU()] if i < a.layers - 1 else [])
        model = nn.Sequential(*layers)
        return model, torch.optim.AdamW(model.parameters(), lr=INNER_LR)

    def wrap(cfg: str, model: nn.Module, opt: torch.optim.Optimizer):
        if cfg == "plain":
            return None
        if cfg.startswith("ours"):
            from lowcomm_kernels.runtime import DiLoCo, StreamingDiLoCo

            kw = dict(outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
            if cfg == "ours-diloco":
                return DiLoCo(model, opt, sync_every=a.sync_every, **kw)
            return StreamingDiLoCo(
                model, opt, sync_every=a.sync_every, num_fragments=a.fragments,
                fragment_sync_delay=a.tau, **kw,
            )  # fmt: skip
        from torchft.local_sgd import DiLoCo as TorchftDiLoCo

        assert manager is not None
        for key in [k for k in manager._user_state_dicts if k.startswith("StreamingDiLoCoFragment")]:
            manager._user_state_dicts.pop(key)  # the previous run's fragments (one key each)
            manager._load_state_dict_fns.pop(key)
        outer = lambda ps: torch.optim.SGD(ps, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)  # noqa: E731
        if cfg == "torchft-diloco":
            return TorchftDiLoCo(manager, [model], opt, outer(model.parameters()), sync_every=a.sync_every)
        # K contiguous fragments of the Linear layers (torchft takes one module per fragment)
        linears = [m for m in model if isinstance(m, nn.Linear)]
        per = [linears[i * len(linears) // a.fragments : (i + 1) * len(linears) // a.fragments]
               for i in range(a.fragments)]  # fmt: skip
        frags = [nn.ModuleList(ms) for ms in per]
        return TorchftDiLoCo(
            manager, frags, opt, [outer(f.parameters()) for f in frags], sync_every=a.sync_every,
            fragment_sync_delay=a.tau,
        )  # fmt: skip

    def timed(fn, acc: list[float]):
        def call(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[0] += time.perf_counter() - t0
                acc[1] += time.thread_time() - c0

        return call

    def run(cfg: str) -> dict:
        model, opt = build()
        strat = wrap(cfg, model, opt)
        # the wrapper's own time, in its optimizer hooks (bound before ``with`` registers them)
        hook = [0.0, 0.0]  # wall, this thread's CPU
        if cfg.startswith("ours"):
            strat._on_step = timed(strat._on_step, hook)
        elif strat is not None:
            strat._step_pre_hook = timed(strat._step_pre_hook, hook)
            strat._step_post_hook = timed(strat._step_post_hook, hook)

        def step(i: int) -> None:
            x, y = data[i % len(data)]
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

        ctx = strat if strat is not None else _null()
        with ctx:
            for i in range(a.warmup):
                step(i)
            dist.barrier()
            hook[:] = [0.0, 0.0]
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(a.warmup, a.warmup + a.steps):
                step(i)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        out = {
            "config": cfg,
            "step_s": wall / a.steps,
            "wall_s": wall,
            "hook_s": hook[0] / a.steps,
            "cpu_s": cpu / a.steps,
            "hook_cpu_s": hook[1] / a.steps,
        }
        if cfg.startswith("ours"):
            strat.finish()
            m = strat.metrics
            out["syncs"] = m.num_syncs
            out["overhead_s"] = m.overhead_s
            out["exposed_comm_s"] = m.exposed_comm_s
            strat.close()
        dist.barrier()
        return out

    results = []
    for r in range(a.rounds):
        order = a.configs[r % len(a.configs) :] + a.configs[: r % len(a.configs)]
        for cfg in order:
            res = run(cfg)
            res["round"] = r
            results.append(res)
            if rank == 0:
                print(f"round {r} {cfg:18s} {res['step_s'] * 1e3:8.3f} ms/step", flush=True)
    if rank == 0:
        import lowcomm_kernels

        Path(a.result).write_text(json.dumps({"runs": results, "package": lowcomm_kernels.__file__}))
    dist.barrier()
    if manager is not None:
        manager.shutdown(wait=False)
    dist.destroy_process_group()
    os._exit(0)  # torchft's threads and servers: no teardown to wait for


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


# ----- the parent: lighthouse, two replicas, summary ----------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load() -> list[float]:
    try:
        return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def _by_round(results: list[dict], field: str) -> dict[int, dict[str, float]]:
    """{round: {config: its ``field``}} over the runs that recorded it."""
    by_round: dict[int, dict[str, float]] = {}
    for r in results:
        if field in r:
            by_round.setdefault(r["round"], {})[r["config"]] = r[field]
    return by_round


def _spread(ratios: list[float]) -> dict:
    """Same-round ratios: their median, min, max and every round's value."""
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "by_round": ratios}


def summarize(results: list[dict], configs: list[str]) -> dict:
    summary: dict = {}
    for key, field in (("step", "step_s"), ("hook", "hook_s"), ("cpu", "cpu_s"), ("hook_cpu", "hook_cpu_s")):
        by_round = _by_round(results, field)
        ms: dict = {}
        for cfg in configs:
            vals = [v[cfg] for v in by_round.values() if cfg in v]
            if vals:
                ms[cfg] = {
                    "median": statistics.median(vals) * 1e3, "min": min(vals) * 1e3, "max": max(vals) * 1e3,
                    "n": len(vals),
                }  # fmt: skip
        ratio: dict = {}
        for name, (ours, theirs) in PAIRS.items():
            pairs = [(v[ours], v[theirs]) for v in by_round.values() if ours in v and theirs in v]
            ratios = [x / y for x, y in pairs if y > 0]
            if ratios:
                ratio[name] = _spread(ratios)
        summary[f"{key}_ms"], summary["ratio" if key == "step" else f"{key}_ratio"] = ms, ratio
    summary["floor"], summary["added_ratio"] = _against_the_bare_loop(_by_round(results, "step_s"))
    return summary


def _against_the_bare_loop(by_round: dict[int, dict[str, float]]) -> tuple[dict, dict]:
    """Per pair, from the rounds that have all three runs: the floor, plain / torchft within each
    round (no wrapper makes a step faster than the loop it wraps, so no ours / torchft can fall
    below it), and the step time each wrapper adds to the loop, ours - plain and torchft - plain
    within each round, then their medians and the ratio of those (a ratio per round would divide by
    torchft's added time, which is near zero in some rounds on a noisy machine)."""
    floor: dict = {}
    added: dict = {}
    for name, (ours, theirs) in PAIRS.items():
        rounds = [v for v in by_round.values() if {"plain", ours, theirs} <= v.keys() and v[theirs] > 0]
        if not rounds:
            continue
        floor[name] = _spread([v["plain"] / v[theirs] for v in rounds])
        ours_ms = statistics.median((v[ours] - v["plain"]) * 1e3 for v in rounds)
        theirs_ms = statistics.median((v[theirs] - v["plain"]) * 1e3 for v in rounds)
        ratio = ours_ms / theirs_ms if theirs_ms > 0 else None
        added[name] = {"ours_ms": ours_ms, "torchft_ms": theirs_ms, "ratio": ratio}
    return floor, added


def markdown(res: dict) -> str:
    s, a = res["summary"], res["args"]
    lines = [
        f"ours vs torchft.local_sgd.DiLoCo: {a['layers']} x Linear({a['dim']}), batch {a['batch']}, AdamW, "
        f"H={a['sync_every']}, K={a['fragments']}, tau={a['tau']}, 2 replicas on gloo, {a['steps']} timed "
        f"steps, {a['rounds']} interleaved rounds; load {res['load_before']} -> {res['load_after']}",
        "",
        "Per step: wall clock (syncs included); the wrapper's own wall time in its optimizer hooks (pack,",
        "checks, collectives, waits, merge); the process's CPU time (every thread: compute, gloo's, the",
        "wrapper's); the hooks' CPU time. On a loaded machine the CPU times are the steadier measure of the",
        "work each configuration does. Ratios: ours / torchft within each round, then the median",
        "(min-max) over rounds.",
        "",
        "| configuration | wall ms/step | ours / torchft | hooks ms | ours / torchft | CPU ms/step "
        "| ours / torchft | hooks CPU ms | ours / torchft |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def ratio(table: dict, cfg: str) -> str:
        for name, (ours, _) in PAIRS.items():
            if cfg == ours and name in table:
                q = table[name]
                return f"{q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f})"
        return ""

    for cfg, v in s["step_ms"].items():
        cells = [f"{v['median']:.3f}", ratio(s["ratio"], cfg)]
        for key in ("hook", "cpu", "hook_cpu"):
            cells += [f"{s[f'{key}_ms'].get(cfg, {}).get('median', 0.0):.3f}", ratio(s[f"{key}_ratio"], cfg)]
        lines.append(f"| {cfg} | " + " | ".join(cells) + " |")
    if s.get("floor"):
        lines += [
            "",
            "Against the bare loop. The floor, plain / torchft within each round, median (min-max): the",
            "lowest ours / torchft any wrapper can reach, since a wrapped step cannot be faster than the",
            "loop it wraps. The step time each wrapper adds to the loop: ours - plain and torchft - plain",
            "within each round, their medians, and the ratio of those medians.",
            "",
            "| method | floor: plain / torchft | ours adds ms/step | torchft adds ms/step | ours / torchft |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name, label in (("diloco", "DiLoCo"), ("streaming", "Streaming DiLoCo")):
            q, d = s["floor"].get(name), s["added_ratio"].get(name)
            if q is None or d is None:
                continue
            ratio = "" if d["ratio"] is None else f"{d['ratio']:.3f}"
            lines.append(
                f"| {label} | {q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f}) | {d['ours_ms']:.3f} "
                f"| {d['torchft_ms']:.3f} | {ratio} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker >= 0:
        _worker(a)
        return 0
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers: no per-quorum lines
    lh = None
    if any(c.startswith("torchft") for c in a.configs):
        from torchft._torchft import LighthouseServer

        lh = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=30000, heartbeat_timeout_ms=5000)
    load_before = _load()
    t0 = time.time()
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "rank0.json"
        passed = [x for x in (argv if argv is not None else sys.argv[1:])]
        procs = []
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.setdefault("OMP_NUM_THREADS", str(a.threads))
        for rank in range(2):
            cmd = [sys.executable, str(Path(__file__).resolve()), *passed, "--worker", str(rank)]
            cmd += [
                "--master-port",
                str(port),
                "--lighthouse",
                lh.address() if lh else "",
                "--result",
                str(result),
            ]
            procs.append(subprocess.Popen(cmd, env=env))
        try:
            codes = [p.wait(timeout=3600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if lh is not None:
                lh.shutdown()
        if any(codes) or not result.exists():
            print(f"a replica failed (exit codes {codes})", file=sys.stderr)
            return 1
        got = json.loads(result.read_text())
    import torch

    results = got["runs"]

    res = {
        "command": " ".join(["bench/vs_torchft.py", *(argv if argv is not None else sys.argv[1:])]),
        "args": {
            k: v for k, v in vars(a).items() if k not in ("worker", "master_port", "lighthouse", "result")
        },
        "load_before": load_before,
        "load_after": _load(),
        "wall_s": time.time() - t0,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torchft": _version("torchft"),
        "package": got["package"],
        "commit": _git("rev-parse", "--short", "HEAD"),
        "modified_files": len(_git("status", "--porcelain", "--untracked-files=no").splitlines()),
        "runs": results,
    }
    res["summary"] = summarize(results, a.configs)
    md = markdown(res)
    for path, text in ((a.out, json.dumps(res, indent=1)), (a.markdown, md)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + ("\n" if not text.endswith("\n") else ""))
    print(md)
    return 0


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _version(dist_name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
