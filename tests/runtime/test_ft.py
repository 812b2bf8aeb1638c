"""Fault tolerance on torchft (runtime.ft): real replica processes, an in-process Lighthouse, gloo.

Each replica is tests/runtime/ft_worker.py in its own process; the test kills, stops and restarts
them and reads the per-step JSON lines they write.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torchft = pytest.importorskip("torchft")
from torchft._torchft import LighthouseServer  # noqa: E402

WORKER = Path(__file__).with_name("ft_worker.py")
pytestmark = pytest.mark.slow


def _start(lh, i, out: Path, steps: int, *extra: str) -> subprocess.Popen:
    log = open(out / f"log{i}", "a")  # noqa: SIM115 (closed with the process)
    cmd = [sys.executable, str(WORKER), "--lighthouse", lh.address(), "--replica", str(i)]
    cmd += ["--steps", str(steps), "--out", str(out / f"r{i}.jsonl"), *extra]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _records(out: Path, i: int) -> list[dict]:
    p = out / f"r{i}.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _wait_step(out: Path, i: int, step: int, timeout: float = 60.0) -> None:
    t_end = time.time() + timeout
    while time.time() < t_end:
        recs = _records(out, i)
        if recs and recs[-1]["step"] >= step:
            return
        time.sleep(0.1)
    raise AssertionError(f"replica {i} did not reach step {step} within {timeout} s")


def _finish(procs, timeout: float = 90.0) -> None:
    for p in procs:
        try:
            assert p.wait(timeout=timeout) == 0, "a replica failed (see its log)"
        finally:
            if p.poll() is None:
                p.kill()


@pytest.fixture
def lighthouse():
    lh = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=30000, heartbeat_timeout_ms=1000)
    yield lh
    lh.shutdown()


def _last(recs: list[dict]) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for r in recs:
        by_step[r["step"]] = r  # a restarted replica's later lines win
    return by_step


@pytest.mark.parametrize("method", ["diloco", "streaming", "cocodc"])
def test_kill_then_heal(lighthouse, tmp_path, method):
    """3 replicas; SIGKILL one mid-run: the others go on (loss decreasing, no hang); restarted, it
    heals and then holds exactly the others' g at every step."""
    steps, hold = 100, 50
    ready = tmp_path / "ready"
    # the survivors pause after step `hold` until the restarted replica is up (a slow restart must
    # not find them finished); they train through the outage before that
    procs = [
        _start(
            lighthouse,
            i,
            tmp_path,
            steps,
            "--method",
            method,
            "--hold-at",
            str(hold),
            "--hold-for",
            str(ready),
        )
        for i in range(3)
    ]
    _wait_step(tmp_path, 2, 12)
    procs[2].send_signal(signal.SIGKILL)
    procs[2].wait()
    killed_at = _records(tmp_path, 2)[-1]["step"]
    _wait_step(tmp_path, 0, hold)
    # it stops at step 80, before the others (a replica alone would wait for a quorum of two)
    procs[2] = _start(lighthouse, 2, tmp_path, 80, "--method", method, "--ready-file", str(ready))
    _finish(procs)
    r0, r1, r2 = (_last(_records(tmp_path, i)) for i in range(3))
    # the survivors trained through the failure: every step recorded, same g, loss went down
    # (a replica that started late healed at the first sync: no records before it)
    common = sorted(set(r0) & set(r1))
    assert common[-1] == steps and len(common) >= steps - 10
    assert all(r0[s]["g"] == r1[s]["g"] for s in common)
    losses = [r0[s]["loss"] for s in common]
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    # the round in flight at the kill failed everywhere, then rounds ran with the two survivors
    assert any(r0[s]["participants"] == 2 for s in r0 if killed_at < s <= hold)
    # the restarted replica healed (its steps continue the others') and then matches g exactly
    healed = [s for s in r2 if s > hold]
    assert healed, "the restarted replica recorded nothing after the heal"
    assert all(r2[s]["g"] == r0[s]["g"] for s in healed)
    assert any(r0[s]["participants"] == 3 for s in healed)  # it contributes again after healing


def test_stopped_replica_is_dropped(lighthouse, tmp_path):
    """A SIGSTOPped replica stops heartbeating: after the timeouts the others form quorums without it."""
    steps = 60
    procs = [_start(lighthouse, i, tmp_path, steps, "--step-sleep", "0.05") for i in range(3)]
    try:
        _wait_step(tmp_path, 2, 12)
        procs[2].send_signal(signal.SIGSTOP)
        stopped_at = _records(tmp_path, 2)[-1]["step"]
        _wait_step(tmp_path, 0, steps, timeout=90)
        _finish(procs[:2])
    finally:
        procs[2].kill()
        procs[2].wait()
    r0 = _last(_records(tmp_path, 0))
    later = [r0[s]["participants"] for s in r0 if s > stopped_at + 10]
    assert later and later[-1] == 2
    assert r0[steps]["loss"] < r0[min(r0)]["loss"]  # (a late starter has no records before its heal)


def test_commit_failure_applies_nowhere(lighthouse, tmp_path):
    """Replica 1 reports an error in its 3rd round: that round is skipped on every replica."""
    steps = 30
    procs = [
        _start(lighthouse, i, tmp_path, steps, *(["--fail-commit-at", "3"] if i == 1 else []))
        for i in range(3)
    ]
    _finish(procs)
    recs = [_last(_records(tmp_path, i)) for i in range(3)]
    for r in recs:
        assert r[steps]["skipped"] == 1 and r[steps]["failed"] == 1
    common = set(recs[0]) & set(recs[1]) & set(recs[2])  # (a late starter healed at the first sync)
    assert all(recs[0][s]["g"] == recs[i][s]["g"] for i in (1, 2) for s in common)
    # the failed round changed g nowhere: g after it equals g before it
    fail_step = min(s for s in common if recs[0][s]["failed"] == 1)
    assert recs[0][fail_step]["g"] == recs[0][fail_step - 1]["g"]
