"""Fault tolerance figures (runtime.ft), on CPU / gloo: replica processes and an in-process Lighthouse.

    .venv/bin/python bench/ft_recovery.py                      # all of it (~15 min on 2 busy cores)
    .venv/bin/python bench/ft_recovery.py --quick --out /tmp/ft.json --figure /tmp/ft.png   # smoke

(1) Overhead: the wall time of one sync round under a torchft Manager (quorum + SUM all-reduces of
payload, control and presence + should_commit, median over the rounds before the kill) next to a SUM
all-reduce of the same tensors over a fixed 3-process gloo group, and the time from a SIGKILL of one
replica to the first round the survivors commit without it (bench/ft_worker.py).

(2) Side by side: the same kill under our DiLoCo (``manager=``) and under torchft's own
``torchft.local_sgd.DiLoCo``, on the same model, data, H and outer optimizer (Nesterov SGD), each
next to a fault-free run of the same seed (bench/ft_replica.py): the time from the SIGKILL of
replica 2 to replica 0's next committed sync, the syncs in between that did not commit, and the gap
of replica 0's final held-out loss to the fault-free run's, over several seeds (mean +- std).
``--restart-at`` restarts the killed replica (it heals) when replica 0 reaches that step.

(3) The life cycle, from the same runs: what a fresh start costs (from the common start to the end
of replica 0's first step, next to the median step), what a restart costs (the new process's
start-up, then the time until it is in a quorum of three), and a Lighthouse loss: the Lighthouse is
shut down once replica 0 has recorded step ``--kill-at``, and each replica's exit (code, seconds
after the loss, its last error line) is recorded, under both implementations, with the replicas'
``--lighthouse-quorum-timeout``.

Writes ``--out`` (JSON: configuration, command, every run's per-step records, the summary) and
``--figure`` (training loss of replica 0 against the step, faulty and fault-free, both
implementations, kill and return marked), and prints the table.
"""

import gc
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lowcomm_kernels.train import provenance

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "ft_worker.py"
REPLICA = ROOT / "bench" / "ft_replica.py"
IMPLS = ("lowcomm", "torchft")
LABEL = {"lowcomm": "lowcomm DiLoCo (manager=)", "torchft": "torchft.local_sgd.DiLoCo"}


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def ft_figures() -> tuple[list[float], float]:
    from torchft._torchft import LighthouseServer

    lh = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=30000, heartbeat_timeout_ms=1000)
    out = Path(tempfile.mkdtemp())
    procs = []
    for i in range(3):
        cmd = [sys.executable, str(WORKER), "--lighthouse", lh.address(), "--replica", str(i)]
        cmd += ["--steps", "120", "--out", str(out / f"r{i}.jsonl"), "--step-sleep", "0.02"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        while not _records(out / "r2.jsonl") or _records(out / "r2.jsonl")[-1]["step"] < 60:
            time.sleep(0.05)
        t_kill = time.time()
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait()
        for p in procs[:2]:
            p.wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lh.shutdown()
    recs = _records(out / "r0.jsonl")
    before = [r for r in recs if r["t"] < t_kill]
    # one round per sync step (steps where the round counter moved), all three replicas present
    rounds = [
        b["round_s"]
        for a, b in zip(before, before[1:], strict=False)
        if b["rounds"] > a["rounds"] and b["participants"] == 3
    ]
    after = [r for r in recs if r["t"] > t_kill and r["participants"] == 2]
    recovered = after[0]["t"] - t_kill if after else float("nan")
    return rounds[1:], recovered  # the first round after the join is left out


def _fixed(rank: int, port: int, n: int, q) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=3)
    numel = sum(
        p.numel() for p in torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)).parameters()
    )
    payload, control = torch.zeros(numel), torch.zeros(9, dtype=torch.float64)
    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        for t in (payload, control):
            dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        q.put(times)
    dist.destroy_process_group()


def fixed_figures(n: int = 30) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_fixed, args=(r, port, n, q)) for r in range(3)]
    for p in ps:
        p.start()
    times = q.get(timeout=300)
    for p in ps:
        p.join()
    return times[5:]


# ----- (2) our DiLoCo and torchft's, side by side ---------------------------------------------------
def _lighthouse():
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=30000, heartbeat_timeout_ms=1000)


def _replica(lh, impl: str, i: int, out: Path, a, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, str(REPLICA), "--impl", impl, "--lighthouse", lh.address(), "--replica", str(i)]
    cmd += list(extra)
    cmd += ["--steps", str(a.steps), "--sync-every", str(a.sync_every), "--seed", str(a.seed_now)]
    cmd += ["--out", str(out), "--step-sleep", str(a.step_sleep)]
    with open(log, "a") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)


def _wait_for(cond, procs, what: str, timeout: float) -> None:
    t_end = time.time() + timeout
    while not cond():
        if time.time() > t_end:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed:
            log = Path(failed[0].args[failed[0].args.index("--out") + 1]).with_suffix(".log")
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else ""
            raise RuntimeError(f"a replica failed while waiting for {what}; its log ends:\n{tail}")
        time.sleep(0.02)


def _run_files(impl: str, seed: int, kind: str, a, work: Path):
    """One run's files in ``work``, named by implementation, seed and kind: the per-replica records
    and logs, the ready files and the common-start gate. Sets the seed the replicas are given."""
    a.seed_now = seed
    tag = f"{impl}-s{seed}-{kind}"
    outs = [work / f"{tag}-r{i}.jsonl" for i in range(3)]
    ready = [work / f"{tag}-ready{i}" for i in range(3)]
    return tag, outs, [out.with_suffix(".log") for out in outs], ready, work / f"{tag}-go"


def one_run(impl: str, seed: int, fault: bool, a, work: Path) -> dict:
    """3 replicas of bench/ft_replica.py; with ``fault``: SIGKILL replica 2 once it recorded step
    ``a.kill_at`` (and restart it when replica 0 reaches ``a.restart_at``, if given)."""
    tag, outs, logs, ready, go = _run_files(impl, seed, "kill" if fault else "clean", a, work)
    lh = _lighthouse()
    # a common start: on a loaded machine the processes take very different times to import torch,
    # and a replica that reaches its first quorum long before the others would time out there
    back = work / f"{tag}-ready2-again"  # the restarted replica is up: the survivors hold for it
    hold = ["--hold-at", str(a.restart_at), "--hold-for", str(back)] if fault and a.restart_at else []
    t_start = time.time()
    procs = [_replica(lh, impl, i, outs[i], a, logs[i], "--ready-file", str(ready[i]), "--go-file", str(go),
                      *(hold if i < 2 else [])) for i in range(3)]  # fmt: skip
    extra: list[subprocess.Popen] = []
    t_kill = t_return = restart_up_s = None
    kill_step = return_step = None
    try:
        _wait_for(lambda: all(r.exists() for r in ready), procs, f"{tag}: the replicas to start", 900)
        go.touch()
        t0 = time.time()
        start_up_s = t0 - t_start  # 3 fresh processes: start, import torch, build, Manager up
        if fault:
            _wait_for(lambda: _records(outs[2]) and _records(outs[2])[-1]["step"] >= a.kill_at, procs,
                      f"{tag}: replica 2 at step {a.kill_at}", 600)  # fmt: skip
            procs[2].send_signal(signal.SIGKILL)
            t_kill = time.time()
            procs[2].wait()
            kill_step = _records(outs[2])[-1]["step"]
            if a.restart_at is not None:
                # replica 0 holds after step restart_at until the restarted replica is up (a slow
                # start on a loaded machine must not find the survivors finished)
                _wait_for(lambda: _records(outs[0])[-1]["step"] >= a.restart_at, procs[:2],
                          f"{tag}: replica 0 at step {a.restart_at}", 600)  # fmt: skip
                return_step = _records(outs[0])[-1]["step"]
                t_launch = time.time()
                extra.append(_replica(lh, impl, 2, outs[2], a, logs[2], "--ready-file", str(back)))
                _wait_for(back.exists, extra, f"{tag}: the restarted replica to start", 900)
                t_return = time.time()
                restart_up_s = t_return - t_launch  # a fresh process: start, import torch, build
        live = procs[:2] if fault else procs
        for i, p in enumerate(live):
            if p.wait(timeout=900) != 0:
                tail = "\n".join(logs[i].read_text(errors="replace").splitlines()[-30:])
                raise RuntimeError(f"{tag}: replica {i} exited with {p.returncode}; its log ends:\n{tail}")
    finally:
        for p in procs + extra:  # a restarted torchft replica counts its steps from 0: it outlives the others
            if p.poll() is None:
                p.kill()
                p.wait()
        lh.shutdown()
    wall = time.time() - t0
    recs = _records(outs[0])
    run = {"impl": impl, "seed": seed, "fault": fault, "wall_s": wall, "eval_loss": recs[-1].get("eval_loss"),
           "steps": [r["step"] for r in recs], "loss": [r["loss"] for r in recs],
           "participants": [r["participants"] for r in recs],
           "commits": [r["commits"] for r in recs]}  # fmt: skip
    # the fresh start: from the common start to the end of replica 0's first step (its first quorum,
    # the joining round, in it), next to the median of its other steps that ran no sync
    dts = [b["t"] - a_["t"] for a_, b in zip(recs, recs[1:], strict=False) if b["syncs"] == a_["syncs"]]
    first_sync = next((r["participants"] for r in recs if r["syncs"] > 0), None)
    run.update(start_up_s=start_up_s, first_step_s=recs[0]["t"] - t0,
               median_step_s=statistics.median(dts) if dts else None,
               first_sync_participants=first_sync)  # fmt: skip
    if fault:
        before = [r for r in recs if r["t"] <= t_kill]
        after = [r for r in recs if r["t"] > t_kill]
        c0, s0 = before[-1]["commits"], before[-1]["syncs"]
        nxt = next((r for r in after if r["commits"] > c0), None)
        run.update(
            kill_step=kill_step, kill_step_r0=before[-1]["step"], return_step=return_step,
            kill_to_commit_s=(nxt["t"] - t_kill) if nxt else None,
            failed_syncs=(nxt["syncs"] - s0 - 1) if nxt else None,
            first_commit_participants=nxt["participants"] if nxt else None,
        )  # fmt: skip
        if t_return is not None:
            back = [r for r in recs if r["t"] > t_return and r["participants"] == 3]
            run["return_to_3_s"] = (back[0]["t"] - t_return) if back else None
            run["restart_up_s"] = restart_up_s
    return run


def lighthouse_loss(impl: str, seed: int, a, work: Path) -> dict:
    """3 replicas; the Lighthouse is shut down once replica 0 has recorded step ``a.kill_at``. Each
    replica's exit: its code, the seconds from the loss to it (None: still running ``a.cap_s``
    after the loss, then killed), and the last line of its log that names an error."""
    tag, outs, logs, ready, go = _run_files(impl, seed, "lighthouse", a, work)
    lh = _lighthouse()
    qt = ["--quorum-timeout", str(a.lighthouse_quorum_timeout)]
    gate = ["--go-file", str(go), *qt]
    procs = [
        _replica(lh, impl, i, outs[i], a, logs[i], "--ready-file", str(ready[i]), *gate) for i in range(3)
    ]
    exits: list[dict] = []
    try:
        _wait_for(lambda: all(r.exists() for r in ready), procs, f"{tag}: the replicas to start", 900)
        go.touch()
        _wait_for(lambda: _records(outs[0]) and _records(outs[0])[-1]["step"] >= a.kill_at, procs,
                  f"{tag}: replica 0 at step {a.kill_at}", 600)  # fmt: skip
        lh.shutdown()
        del lh  # (the server stops serving only once the object is gone)
        gc.collect()
        t_loss = time.time()
        lost_at = _records(outs[0])[-1]
        pending = set(range(3))
        while pending and time.time() - t_loss < a.cap_s:
            for i in sorted(pending):
                if procs[i].poll() is not None:
                    pending.discard(i)
                    exits.append({"replica": i, "code": procs[i].returncode, "exit_s": time.time() - t_loss})
            time.sleep(0.05)
        exits += [{"replica": i, "code": None, "exit_s": None} for i in sorted(pending)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for e in exits:
        recs = _records(outs[e["replica"]])
        e["last_step"] = recs[-1]["step"] if recs else None
        e["last_commit"] = recs[-1]["commits"] if recs else None
        lines = logs[e["replica"]].read_text(errors="replace").splitlines()
        # the exception that ended it (a traceback's last line), else any line naming an error
        raised = [ln.strip() for ln in lines if re.match(r"[\w.]*(Error|Exception)\b", ln)]
        errors = raised or [ln.strip() for ln in lines if "error" in ln.lower()]
        e["error"] = errors[-1][:400] if errors else ""
    exits.sort(key=lambda e: e["replica"])
    return {"impl": impl, "seed": seed, "lighthouse_loss": True, "lost_at_step": lost_at["step"],
            "lost_at_commit": lost_at["commits"], "quorum_timeout_s": a.lighthouse_quorum_timeout,
            "exits": exits}  # fmt: skip


def _stat(v: list[float]) -> dict:
    v = [x for x in v if x is not None]
    if not v:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0, "n": len(v)}


def summarize(runs: list[dict]) -> dict:
    out = {}
    for impl in IMPLS:
        clean = {r["seed"]: r for r in runs if r["impl"] == impl and not r["fault"]}
        faulty = [r for r in runs if r["impl"] == impl and r["fault"]]
        if not faulty:
            continue
        gaps = [r["eval_loss"] - clean[r["seed"]]["eval_loss"] for r in faulty if r["seed"] in clean]
        out[impl] = {
            "kill_to_commit_s": _stat([r["kill_to_commit_s"] for r in faulty]),
            "failed_syncs": _stat([r["failed_syncs"] for r in faulty]),
            "eval_loss_fault_free": _stat([clean[s]["eval_loss"] for s in clean]),
            "eval_loss_faulty": _stat([r["eval_loss"] for r in faulty]),
            "eval_loss_gap": _stat(gaps),
            "return_to_3_s": _stat([r.get("return_to_3_s") for r in faulty]),
            "restart_up_s": _stat([r.get("restart_up_s") for r in faulty]),
            "start_up_s": _stat([r.get("start_up_s") for r in clean.values()]),
            "first_step_s": _stat([r.get("first_step_s") for r in clean.values()]),
            "median_step_s": _stat([r.get("median_step_s") for r in clean.values()]),
        }
    return out


def summarize_lighthouse(losses: list[dict]) -> dict:
    """Per implementation: how the replicas ended after the Lighthouse went away."""
    out = {}
    for impl in IMPLS:
        rs = [r for r in losses if r["impl"] == impl]
        if not rs:
            continue
        exits = [e for r in rs for e in r["exits"]]
        out[impl] = {
            "runs": len(rs),
            "replicas": len(exits),
            "exited_nonzero": sum(1 for e in exits if e["code"] not in (None, 0)),
            "exited_zero": sum(1 for e in exits if e["code"] == 0),
            "still_running": sum(1 for e in exits if e["code"] is None),
            "exit_s": _stat([e["exit_s"] for e in exits]),
            "error": next((e["error"] for e in exits if e["error"]), ""),
        }
    return out


def _smooth(v: list[float], k: int) -> list[float]:
    return [statistics.fmean(v[max(0, i - k + 1) : i + 1]) for i in range(len(v))]


def figure(runs: list[dict], path: Path, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = min(r["seed"] for r in runs)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, impl in zip(axes, IMPLS, strict=True):
        for r in (r for r in runs if r["impl"] == impl and r["seed"] == seed):
            style = {"color": "tab:red", "label": "replica 2 killed"} if r["fault"] else {
                "color": "tab:blue", "label": "fault-free"}  # fmt: skip
            ax.plot(r["steps"], _smooth(r["loss"], k), lw=1.2, **style)
            if r["fault"]:
                ax.axvline(r["kill_step_r0"], color="k", ls="--", lw=0.8, label="kill (SIGKILL)")
                if r.get("return_step") is not None:
                    back = r.get("return_to_3_s") is not None
                    label = "restart" if back else "restart launched (not back before the end)"
                    ax.axvline(r["return_step"], color="tab:green", ls=":", lw=1.0, label=label)
        ax.set_title(LABEL[impl])
        ax.set_xlabel("inner step (replica 0)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.lines:  # (an implementation left out with --impls has an empty panel)
            ax.legend(fontsize=8)
    axes[0].set_ylabel(f"training loss of replica 0 (mean of {k} steps)")
    fig.suptitle(f"3 replicas, H = {runs[0]['H']}, seed {seed}: a SIGKILL of one replica", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(s: dict | None, unit: str = "", digits: int = 2) -> str:
    if s is None or s["mean"] is None:  # (None: a file written before the figure was measured)
        return "n/a"
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}{unit}"


def parse(argv: list[str] | None = None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (default 3)")
    ap.add_argument("--steps", type=int, default=60, help="inner steps per run (default 60)")
    ap.add_argument("--sync-every", type=int, default=5, help="H (default 5)")
    ap.add_argument("--kill-at", type=int, default=22, help="SIGKILL replica 2 at this step (default 22)")
    ap.add_argument(
        "--restart-at",
        type=int,
        default=None,
        help="restart it when replica 0 reaches this step (default: no restart)",
    )
    ap.add_argument("--step-sleep", type=float, default=0.05, help="seconds per inner step (default 0.05)")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated, of " + ", ".join(IMPLS))
    ap.add_argument("--no-overhead", action="store_true", help="skip (1), the per-round overhead")
    ap.add_argument("--no-lighthouse", action="store_true", help="skip the Lighthouse loss runs of (3)")
    ap.add_argument(
        "--lighthouse-quorum-timeout",
        type=float,
        default=20.0,
        help="the replicas' quorum_timeout in the Lighthouse loss runs, s (default 20)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke: 1 seed, 25 steps, kill at 12, restart at 17, no overhead part, a Lighthouse "
        "quorum timeout of 10 s",
    )
    ap.add_argument(
        "--render",
        type=Path,
        default=None,
        help="run nothing: redraw --figure and print the table from this results file",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "figures" / "ft_recovery.json")
    ap.add_argument("--figure", type=Path, default=ROOT / "bench" / "figures" / "ft_recovery.png")
    a = ap.parse_args(argv)
    if a.quick:
        a.seeds, a.steps, a.kill_at, a.restart_at, a.no_overhead = 1, 25, 12, 17, True
        a.lighthouse_quorum_timeout = 10.0
    a.impls = [x.strip() for x in a.impls.split(",") if x.strip()]
    bad = [x for x in a.impls if x not in IMPLS]
    if bad or not a.impls:
        ap.error(f"--impls: unknown {bad or a.impls}; choose from {', '.join(IMPLS)}")
    for name in ("seeds", "steps", "sync_every", "kill_at"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.kill_at >= a.steps:
        ap.error(f"--kill-at ({a.kill_at}) must be below --steps ({a.steps})")
    if a.restart_at is not None and not a.kill_at < a.restart_at < a.steps:
        ap.error(f"--restart-at ({a.restart_at}) must lie between --kill-at and --steps")
    if a.step_sleep < 0:
        ap.error(f"--step-sleep must be >= 0, got {a.step_sleep}")
    if not 0 < a.lighthouse_quorum_timeout <= 600:
        ap.error(f"--lighthouse-quorum-timeout must lie in (0, 600] s, got {a.lighthouse_quorum_timeout}")
    # a replica still running this long after the Lighthouse went away counts as hung, and is killed
    a.cap_s = 3 * a.lighthouse_quorum_timeout + 60
    return a


def _save(result: dict, runs: list[dict], a, complete: bool, losses: list[dict] | None = None) -> None:
    result.update(complete=complete, runs=runs, summary=summarize(runs), loadavg_end=list(os.getloadavg()))
    result["provenance"] = provenance.collect(a.started, repo=ROOT)  # revision, load, CPU time, command
    # the checkout as the run found it: the results file rewritten after each run is not the code's change
    result["provenance"]["git"] = a.git_at_start
    if losses:
        result.update(lighthouse=losses, lighthouse_summary=summarize_lighthouse(losses))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")


def overhead_table(result: dict) -> str:
    """The round's overhead (markdown), or "" when the run left part (1) out."""
    if "overhead" not in result:
        return ""
    o = result["overhead"]
    return "\n".join([
        "| | median |",
        "| --- | --- |",
        f"| one sync round under a torchft `Manager` (quorum + SUM all-reduces of payload, control, presence "
        f"+ `should_commit`), {o['ft_rounds']} rounds | {o['ft_round_ms_median']:.1f} ms |",
        f"| the same SUM all-reduces of payload and control over a fixed 3-process gloo group, "
        f"{o['fixed_rounds']} syncs | {o['fixed_ms_median']:.1f} ms |",
        f"| SIGKILL of one of the 3 replicas → first round the 2 survivors commit without it | "
        f"{o['kill_to_round_without_it_s']:.2f} s |",
    ])  # fmt: skip


def kill_table(result: dict) -> str:
    """The kill side by side (markdown): both implementations, mean ± std over the seeds."""
    restart = result["config"].get("restart_at") is not None
    rows = ["| implementation | seeds | kill → next committed sync (s) | syncs that failed | held-out loss, "
            "fault-free | held-out loss, killed | gap (killed − fault-free) |"
            + (" restart → in a quorum of 3 (s) |" if restart else ""),
            "| --- " * (8 if restart else 7) + "|"]  # fmt: skip
    for impl, st in result["summary"].items():
        rows.append(f"| {LABEL[impl]} | {st['kill_to_commit_s']['n']} | {_fmt(st['kill_to_commit_s'])} | "
                    f"{_fmt(st['failed_syncs'], digits=1)} | {_fmt(st['eval_loss_fault_free'], digits=4)} | "
                    f"{_fmt(st['eval_loss_faulty'], digits=4)} | {_fmt(st['eval_loss_gap'], digits=4)} |"
                    + (f" {_fmt(st['return_to_3_s'])} |" if restart else ""))  # fmt: skip
    return "\n".join(rows)


def source_line(result: dict, label: str = "bench/figures/ft_recovery.json") -> str:
    """Where the figures come from: the file, the revision that made it (clean or not), the date,
    the load and the command, as ``lowcomm report`` writes it under every table."""
    from lowcomm_kernels.train import render

    git = (result.get("provenance") or {}).get("git") or {}
    if git.get("dirty") and git.get("modified") == [label]:
        # (files written before the checkout was taken at the start: the only change the record
        # names is this results file, rewritten after every run, so the code was clean)
        git = dict(git, dirty=False, modified=[], modified_count=0)
        result = dict(result, provenance=dict(result["provenance"], git=git))
    return render.provenance_line(render.Source(label, Path(label), "ft_recovery", result))


def report(result: dict) -> None:
    """Prints the three tables (markdown) of a result: the round's overhead, the kill side by side,
    and the life cycle, then the source line. The docs quote them as printed
    (tests/runtime/test_ft_bench.py checks it)."""
    for table in (overhead_table(result), kill_table(result)):
        if table:
            print(table + "\n")
    print(
        "(mean ± std over the seeds"
        + ("" if result.get("complete", True) else "; an interrupted run")
        + ")\n"
    )
    print(lifecycle_table(result))
    print("\n" + source_line(result))


def lifecycle_table(result: dict) -> str:
    """What a fresh start, a kill, a restart and a Lighthouse loss cost (markdown), per implementation."""
    impls = list(result["summary"])
    rows = ["| event | " + " | ".join(LABEL[i] for i in impls) + " |", "| --- " * (len(impls) + 1) + "|"]

    def row(name: str, cell) -> None:
        rows.append(f"| {name} | " + " | ".join(cell(i) for i in impls) + " |")

    S = result["summary"]
    row("fresh start: 3 processes launched → all built and ready (s)", lambda i: _fmt(S[i].get("start_up_s")))
    row(
        "fresh start: common start → end of replica 0's first step (s)",
        lambda i: _fmt(S[i].get("first_step_s")),
    )
    row("for comparison: an ordinary step, median (s)", lambda i: _fmt(S[i].get("median_step_s"), digits=3))
    row("kill: SIGKILL → survivors' next committed sync (s)", lambda i: _fmt(S[i].get("kill_to_commit_s")))
    row("kill: syncs that failed in between", lambda i: _fmt(S[i].get("failed_syncs"), digits=1))
    if result["config"].get("restart_at") is not None:
        row("restart: new process launched → built and ready (s)", lambda i: _fmt(S[i].get("restart_up_s")))
        row("restart: ready → in a quorum of three (s)", lambda i: _fmt(S[i].get("return_to_3_s")))
    L = result.get("lighthouse_summary", {})
    if L:
        qt = result["lighthouse"][0]["quorum_timeout_s"]

        def ended(i: str) -> str:
            x = L.get(i)
            if x is None:
                return "n/a"
            parts = [f"{x['exited_nonzero']} exited with an error", f"{x['exited_zero']} exited 0"]
            if x["still_running"]:
                parts.append(
                    f"{x['still_running']} still running after {result['config']['lighthouse_cap_s']:.0f} s"
                )
            return f"{', '.join(parts)} (of {x['replicas']})"

        row(f"Lighthouse loss (quorum_timeout {qt:.0f} s): replicas", ended)
        row("Lighthouse loss: loss → replica exit (s)", lambda i: _fmt(L[i]["exit_s"]) if i in L else "n/a")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    a.started = provenance.begin(argv, prog="python bench/ft_recovery.py")
    a.git_at_start = provenance.git_info(ROOT)
    if a.render is not None:
        result = json.loads(a.render.read_text())
        figure(result["runs"], a.figure, result["config"]["H"])
        report(result)
        print(f"wrote {a.figure}")
        return result
    command = "   ".join(
        ["python bench/ft_recovery.py", *(argv if argv is not None else sys.argv[1:])]
    ).strip()
    result: dict = {"command": command.replace("   ", " "), "loadavg_start": list(os.getloadavg()),
                    "config": {"replicas": 3, "steps": a.steps, "H": a.sync_every, "kill_at": a.kill_at,
                               "restart_at": a.restart_at, "step_sleep_s": a.step_sleep, "seeds": a.seeds,
                               "inner": "SGD lr 0.05", "outer": "Nesterov SGD lr 0.7 momentum 0.9",
                               "model": "MLP 8-32-1 (tanh), batch 32, teacher tanh(x . w)",
                               "lighthouse": "min_replicas 2, join_timeout 30 s, heartbeat_timeout 1 s",
                               "manager_timeout_s": 5.0, "lighthouse_cap_s": a.cap_s}}  # fmt: skip
    if not a.no_overhead:
        rounds, recovered = ft_figures()
        fixed = fixed_figures()
        result["overhead"] = {"ft_round_ms_median": 1e3 * statistics.median(rounds), "ft_rounds": len(rounds),
                              "fixed_ms_median": 1e3 * statistics.median(fixed), "fixed_rounds": len(fixed),
                              "kill_to_round_without_it_s": recovered}  # fmt: skip
    runs = []
    with tempfile.TemporaryDirectory(prefix="ft_recovery-") as tmp:
        for seed in range(a.seeds):
            for impl in a.impls:
                for fault in (False, True):
                    r = one_run(impl, seed, fault, a, Path(tmp))
                    r["H"] = a.sync_every
                    runs.append(r)
                    _save(result, runs, a, complete=False)  # what is done so far survives an interruption
                    print(f"{impl:8s} seed {seed} {'kill ' if fault else 'clean'}: held-out loss "
                          f"{r['eval_loss']:.4f}"
                          + (f", kill -> next commit {r['kill_to_commit_s']:.2f} s" if fault else ""),
                          flush=True)  # fmt: skip
        losses: list[dict] = []
        for seed in range(0 if a.no_lighthouse else a.seeds):
            for impl in a.impls:
                losses.append(lighthouse_loss(impl, seed, a, Path(tmp)))
                _save(result, runs, a, complete=False, losses=losses)
                ends = [
                    (e["code"], None if e["exit_s"] is None else round(e["exit_s"], 1))
                    for e in losses[-1]["exits"]
                ]
                print(f"{impl:8s} seed {seed} Lighthouse lost: (exit code, s) per replica {ends}", flush=True)
    _save(result, runs, a, complete=True, losses=losses)
    figure(runs, a.figure, a.sync_every)
    report(result)
    print(f"wrote {a.out} and {a.figure}")
    return result


if __name__ == "__main__":
    main()
