"""Fault tolerance figures (runtime.ft), on CPU / gloo with 3 replica processes and a Lighthouse.

    .venv/bin/python bench/ft_recovery.py

Prints (1) the wall time of one sync round under a torchft Manager (quorum + SUM all-reduces of
payload, control and presence + should_commit, median over the rounds before the kill) next to a
SUM all-reduce of the same tensors over a fixed 3-process gloo group, and (2) the time from a
SIGKILL of one replica to the first round the survivors commit without it.
"""

import json
import os
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

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "runtime" / "ft_worker.py"


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


if __name__ == "__main__":
    rounds, recovered = ft_figures()
    fixed = fixed_figures()
    ms = lambda v: f"{1e3 * statistics.median(v):.1f} ms"  # noqa: E731
    print(f"torchft round (quorum + all-reduces + commit), median of {len(rounds)}: {ms(rounds)}")
    print(f"fixed gloo group, same all-reduces, median of {len(fixed)}: {ms(fixed)}")
    print(f"SIGKILL of one of 3 replicas -> first round committed by the 2 survivors: {recovered:.2f} s")
