"""The torchft membership speaks to a strategy through its public heal hooks only.

``Averaging`` (tests/runtime/ft_protocol_worker.py) is a toy strategy written against the base
class's subclass interface and the public hooks (``heal_state``, ``load_heal_state``, ``replay``,
``restart_from_shared``, ``clear_inner_state``); nothing of runtime.ft knows it. Two real replica
processes under a torchft Lighthouse: one is SIGKILLed mid-run and restarted, heals from the other,
and from then on both hold the same average.
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

WORKER = Path(__file__).with_name("ft_protocol_worker.py")
pytestmark = pytest.mark.slow


def _start(lh, i: int, out: Path, steps: int, *extra: str) -> subprocess.Popen:
    log = open(out / f"log{i}", "a")  # noqa: SIM115 (closed with the process)
    cmd = [sys.executable, str(WORKER), "--lighthouse", lh.address(), "--replica", str(i)]
    cmd += ["--steps", str(steps), "--out", str(out / f"r{i}.jsonl"), *extra]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _records(out: Path, i: int) -> list[dict]:
    p = out / f"r{i}.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _wait_step(out: Path, i: int, step: int, timeout: float = 240.0) -> None:
    t_end = time.time() + timeout
    while time.time() < t_end:
        recs = _records(out, i)
        if recs and recs[-1]["step"] >= step:
            return
        time.sleep(0.1)
    raise AssertionError(f"replica {i} did not reach step {step} within {timeout} s")


def test_a_toy_strategy_heals_through_the_public_hooks(tmp_path):
    lh = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=30000, heartbeat_timeout_ms=1000)
    steps, sync_every, killed_at = 40, 5, 12
    # replica 1 stops after step 12 until it is killed; replica 0 cannot run ahead: each sync needs
    # both replicas, so it waits in its next quorum for the restarted one
    procs = [_start(lh, 0, tmp_path, steps), _start(lh, 1, tmp_path, steps, "--freeze-at", str(killed_at))]
    try:
        _wait_step(tmp_path, 1, killed_at)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        assert _records(tmp_path, 1)[-1]["step"] == killed_at
        procs[1] = _start(lh, 1, tmp_path, steps)
        for p in procs:
            assert p.wait(timeout=240) == 0, "a replica failed (see its log)"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lh.shutdown()
    r0 = {r["step"]: r for r in _records(tmp_path, 0)}
    first_pid = _records(tmp_path, 1)[0]["pid"]
    back = [r for r in _records(tmp_path, 1) if r["pid"] != first_pid]
    log = (tmp_path / "log1").read_text()
    assert sorted(r0) == list(range(1, steps + 1)), "the survivor skipped steps"
    assert back, f"the restarted replica recorded nothing:\n{log[-2000:]}"
    # it healed at the survivor's sync (the survivor served its heal state from inside that quorum)
    # and went on from the step after it
    t = back[0]["healed_at"]
    assert t is not None and t > killed_at and t % sync_every == 0, back[0]
    assert back[0]["step"] == t + 1 and back[0]["loaded"] == 1
    assert r0[steps]["served"] >= 1
    assert "healed from a peer at step" in log and "the peers' last average" in log
    # from then on both hold the same average at every step, and the same parameters right after
    # every sync, to which both contribute again
    assert all(r["avg"] == r0[r["step"]]["avg"] for r in back)
    syncs = [r for r in back if r["step"] % sync_every == 0]
    assert syncs and all(r["x"] == r0[r["step"]]["x"] for r in syncs)
    assert syncs[-1]["participants"] == 2 and r0[steps]["participants"] == 2
    assert syncs[-1]["merged"] > back[0]["merged"]
