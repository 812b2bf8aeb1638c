"""Fault tolerance on torchft (runtime.ft): real replica processes, an in-process Lighthouse, gloo.

Each replica is bench/ft_worker.py in its own process; the test kills, stops and restarts
them and reads the per-step JSON lines they write.
"""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torchft = pytest.importorskip("torchft")
from torchft._torchft import LighthouseServer  # noqa: E402

WORKER = Path(__file__).resolve().parents[2] / "bench" / "ft_worker.py"  # also bench/ft_recovery.py's
pytestmark = pytest.mark.slow


def _start(lh, i, out: Path, steps: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, str(WORKER), "--lighthouse", lh.address(), "--replica", str(i)]
    cmd += ["--steps", str(steps), "--out", str(out / f"r{i}.jsonl"), *extra]
    return _popen(cmd, out / f"log{i}")


def _popen(cmd: list[str], log: Path) -> subprocess.Popen:
    """The worker with stdout and stderr appended to `log` (kept on the process as ``log_path``)."""
    with open(log, "a") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    p.log_path = log
    return p


def _start_together(procs: dict, out: Path, timeout: float = 240.0) -> None:
    """Release replicas started with ``--start-gate out/go`` once every one of them (its Manager up
    and heartbeating) waits at the gate: the Lighthouse then waits for all of them in the first
    quorum. (Without the gate a replica still importing torch on a loaded machine is not yet known
    to the Lighthouse, which forms the first quorum without it: a late starter.)"""
    t_end = time.time() + timeout
    while not all((out / f"go.{i}_{r}").exists() for i, r in procs):
        dead = [key for key, p in procs.items() if p.poll() is not None]
        assert not dead, f"replica(s) {dead} exited before the start (see their logs)"
        assert time.time() < t_end, f"not every replica reached the start gate within {timeout} s"
        time.sleep(0.05)
    (out / "go").touch()


def _start_all(lh, out: Path, n: int, steps: int, *extra: str, args=None) -> list[subprocess.Popen]:
    """n replicas started together (``_start_together``); args(i): replica i's own extra arguments."""
    procs = {
        (i, 0): _start(lh, i, out, steps, *extra, *(args(i) if args else ()), "--start-gate", str(out / "go"))
        for i in range(n)
    }
    _start_together(procs, out)
    return [procs[i, 0] for i in range(n)]


def _fresh_start(out: Path, names: list, participants: int, until: int | None = None) -> None:
    """Replicas started together: each one's first run recorded every step from step 1 (it trained its
    own first steps: nobody healed into the run late) and its first sync averaged all replicas.
    ``until``: the step a replica was killed at; a survivor whose round in flight then failed (it did
    not commit where another did) heals from then on, as it should, so later heals are not checked."""
    for i in names:
        recs = _records(out, i)
        first = [r for r in recs if r["pid"] == recs[0]["pid"]] if recs else []
        steps = [r["step"] for r in first]
        assert steps and steps == list(range(1, len(steps) + 1)), f"replica {i} started at {steps[:3]}"
        # (the joining round heals the non-primary replicas at step 0; none heals at a later step)
        early = [r for r in first if until is None or r["step"] < until]
        assert all(r["healed_at"] in (None, 0) for r in early), f"replica {i} healed into the run late"
        synced = [r["participants"] for r in first if r["participants"]]
        assert synced and synced[0] == participants, f"replica {i}: the first syncs averaged {synced[:3]}"


def _records(out: Path, i: int | str) -> list[dict]:
    p = out / f"r{i}.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _wait_step(out: Path, i: int | str, step: int, procs, timeout: float = 240.0) -> None:
    """Wait until replica i recorded `step`. Otherwise fail with every replica's stacks and log
    (``_stacks_and_logs``; `procs`: all the test's replica processes), then end those still running."""
    t_end = time.time() + timeout
    while time.time() < t_end:
        recs = _records(out, i)
        if recs and recs[-1]["step"] >= step:
            return
        time.sleep(0.1)
    procs = list(procs)
    report = _stacks_and_logs(procs)
    for p in procs:
        if p.poll() is None:
            p.kill()
    raise AssertionError(f"replica {i} did not reach step {step} within {timeout} s:\n" + report)


def _finish(procs, timeout: float = 240.0) -> None:
    """Wait for every replica to exit 0. One that is still running after `timeout` is asked for its
    threads' stacks (SIGUSR1: faulthandler in the worker), which the failure shows with its log."""
    t_end = time.time() + timeout
    try:
        for p in procs:
            try:
                rc = p.wait(timeout=max(t_end - time.time(), 1.0))
            except subprocess.TimeoutExpired:
                hung = [q for q in procs if q.poll() is None]
                raise AssertionError(
                    f"{len(hung)} replica(s) still running after {timeout} s:\n" + _stacks_and_logs(hung)
                ) from None
            if rc != 0:  # its log's end, the others' last lines: what each was doing when it failed
                others = [q for q in procs if q is not p]
                raise AssertionError(f"a replica failed (exit {rc}):\n" + _logs([p], 150) + _logs(others, 20))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _stacks_and_logs(procs) -> str:
    """Every replica process described for a failure: those still running are first asked for their
    threads' stacks (SIGUSR1: faulthandler in the worker writes them to its log), then ``_logs``
    with a tail long enough to hold such a dump."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGUSR1)
    if live:
        time.sleep(2.0)  # for the dumps to land in the logs
    return _logs(procs, 80)


def _logs(procs, lines: int = 80) -> str:
    """The last `lines` lines of each process's log (its stdout and stderr), with its exit code and
    the wall time of the last step its replica recorded (to line the logs up)."""
    parts = []
    for p in procs:
        log = getattr(p, "log_path", None)
        text = log.read_text(errors="replace") if log and log.exists() else "(no log)"
        text = "\n".join(text.splitlines()[-lines:])
        recs = _records(log.parent, log.name[3:]) if log else []
        last = "no step"
        if recs:
            at = time.strftime("%H:%M:%S", time.localtime(recs[-1]["t"]))
            last = f"last step {recs[-1]['step']} at {at}"
        parts.append(f"--- {log} (exit {p.poll()}, {last}, now {time.strftime('%H:%M:%S')})\n{text}")
    return "\n".join(parts)


@pytest.fixture
def lighthouse():
    # heartbeats every 100 ms; a replica whose heartbeat thread starves for a second on a loaded
    # machine was taken for dead and left out of the first sync (it healed at the next one): 5 s
    lh = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=30000, heartbeat_timeout_ms=5000)
    yield lh
    lh.shutdown()


def _last(recs: list[dict]) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for r in recs:
        by_step[r["step"]] = r  # a restarted replica's later lines win
    return by_step


@pytest.mark.parametrize("method", ["diloco", "loscar"])
def test_a_fresh_start_trains_every_replica_from_its_first_step(tmp_path, method):
    """3 replicas started together (a Lighthouse that waits for all three): the non-primary replicas
    heal in the joining round and every replica trains from step 1; none joins again, and the first
    sync averages all three. (The joining round used to send nothing, so the primary locked its
    checkpoint server before the others had fetched from it: they joined again a Manager timeout
    later, and the first sync averaged fewer replicas.)"""
    lh = LighthouseServer(bind="[::]:0", min_replicas=3, join_timeout_ms=30000, heartbeat_timeout_ms=1000)
    try:
        steps = 15
        procs = [_start(lh, i, tmp_path, steps, "--method", method) for i in range(3)]
        _finish(procs)
    finally:
        lh.shutdown()
    for i in range(3):
        recs = _records(tmp_path, i)
        log = (tmp_path / f"log{i}").read_text()
        assert "joining again" not in log, f"replica {i} joined again:\n{log[-2000:]}"
        assert [r["step"] for r in recs] == list(range(1, steps + 1)), f"replica {i}: {recs[:3]}"
        synced = [r["participants"] for r in recs if r["participants"]]
        assert synced and all(n == 3 for n in synced), f"replica {i}: {synced}"


@pytest.mark.parametrize("method", ["diloco", "streaming", "cocodc"])
def test_kill_then_heal(lighthouse, tmp_path, method):
    """3 replicas; SIGKILL one mid-run: the others go on (loss decreasing, no hang); restarted, it
    heals and then holds exactly the others' g at every step."""
    steps, hold = 100, 50
    killed_at, (r0, r1, r2) = _hold_run(lighthouse, tmp_path, method, steps, hold, 12)
    # the survivors trained through the failure: every step recorded, same g, loss went down
    common = _survivors_common_steps(r0, r1, killed_at, steps)
    assert all(r0[s]["g"] == r1[s]["g"] for s in common)
    losses = [r0[s]["loss"] for s in common]
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    # the round in flight at the kill failed everywhere, then rounds ran with the two survivors
    _synced_without_the_killed(r0, killed_at, hold)
    # the restarted replica healed (its steps continue the others') and then matches g exactly
    healed = [s for s in r2 if s > hold]
    assert healed, "the restarted replica recorded nothing after the heal"
    assert all(r2[s]["g"] == r0[s]["g"] for s in healed)
    assert any(r0[s]["participants"] == 3 for s in healed)  # it contributes again after healing


def test_stopped_replica_is_dropped(lighthouse, tmp_path):
    """A SIGSTOPped replica stops heartbeating: after the timeouts the others form quorums without it."""
    steps = 60
    procs = _start_all(lighthouse, tmp_path, 3, steps, "--step-sleep", "0.05")
    try:
        _wait_step(tmp_path, 2, 12, procs)
        procs[2].send_signal(signal.SIGSTOP)
        stopped_at = _records(tmp_path, 2)[-1]["step"]
        _wait_step(tmp_path, 0, steps, procs, timeout=90)
        _finish(procs[:2])
    finally:
        procs[2].kill()
        procs[2].wait()
    r0 = _last(_records(tmp_path, 0))
    later = [r0[s]["participants"] for s in r0 if s > stopped_at + 10]
    assert later and later[-1] == 2
    assert r0[steps]["loss"] < r0[1]["loss"]
    _fresh_start(tmp_path, [0, 1, 2], 3)


def test_commit_failure_applies_nowhere(lighthouse, tmp_path):
    """Replica 1 reports an error in its 3rd round: that round is skipped on every replica."""
    steps = 30
    procs = _start_all(
        lighthouse, tmp_path, 3, steps, args=lambda i: ["--fail-commit-at", "3"] if i == 1 else []
    )
    _finish(procs)
    _fresh_start(tmp_path, [0, 1, 2], 3)
    recs = [_last(_records(tmp_path, i)) for i in range(3)]
    r1 = recs[1]
    fail_step = min(s for s in r1 if r1[s]["failed"] == 1)
    # every replica skipped it, and every replica holds the same g at every step
    for r in recs:
        assert sorted(r) == list(range(1, steps + 1))
        assert r[steps]["skipped"] == 1 and r[steps]["failed"] == 1
    assert all(recs[0][s]["g"] == recs[i][s]["g"] for i in (1, 2) for s in recs[0])
    # the failed round changed g nowhere: g after it equals g before it
    assert fail_step - 1 in r1 and r1[fail_step]["g"] == r1[fail_step - 1]["g"]


def _hold_run(lighthouse, tmp_path, method: str, steps: int, hold: int, kill_after: int):
    """3 replicas; SIGKILL replica 2 after step `kill_after`; the survivors pause after step `hold`
    until it is restarted (a slow restart must not find them finished); the restarted one stops at
    step 80. Returns the step it was killed at and the three replicas' records by step."""
    ready = tmp_path / "ready"
    hold_args = ["--method", method, "--hold-at", str(hold), "--hold-for", str(ready)]
    die = ["--die-at", str(kill_after)]
    procs = _start_all(lighthouse, tmp_path, 3, steps, *hold_args, args=lambda i: die if i == 2 else [])
    _killed(procs[2], tmp_path, 2, kill_after, procs)
    killed_at = kill_after
    _wait_step(tmp_path, 0, hold, procs)
    procs[2] = _start(lighthouse, 2, tmp_path, 80, "--method", method, "--ready-file", str(ready))
    _finish(procs)
    _fresh_start(tmp_path, [0, 1, 2], 3, until=killed_at)
    return killed_at, [_last(_records(tmp_path, i)) for i in range(3)]


def _killed(p: subprocess.Popen, out: Path, name, step: int, procs, timeout: float = 240.0) -> None:
    """Wait for a replica started with ``--die-at step`` to SIGKILL itself right after recording that
    step. (A kill sent by the test once it sees the step lands wherever the replica has got to by then:
    on a loaded machine dozens of steps later, past the steps a test needs the survivors to sync alone.)"""
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        report = _stacks_and_logs(procs)
        raise AssertionError(f"replica {name} did not die at step {step}:\n{report}") from None
    recs = _records(out, name)
    last = recs[-1]["step"] if recs else None
    assert rc == -signal.SIGKILL and last == step, (
        f"replica {name}: exit {rc}, last step {last}\n{_logs([p])}"
    )


def _synced_without_the_killed(recs: dict[int, dict], killed_at: int, hold: int) -> None:
    """A round committed with the 2 survivors alone between the kill and the hold (the one in flight at
    the kill may have failed)."""
    seen = [(s, recs[s]["participants"], recs[s]["failed"]) for s in sorted(recs) if killed_at < s <= hold]
    assert any(n == 2 for _, n, _ in seen), f"(step, participants, failed rounds) after the kill: {seen}"


def _survivors_common_steps(r0: dict, r1: dict, killed_at: int, steps: int) -> list[int]:
    """The steps both survivors recorded: every step, from the first (they started together with the
    killed one) to the last."""
    common = sorted(set(r0) & set(r1))
    assert common == list(range(1, steps + 1)), "a survivor skipped recording steps"
    assert killed_at > 1
    return common


def _until_healed(recs: dict[int, dict], killed_at: int) -> set[int]:
    """The steps from the kill until this survivor healed, if a round of its failed at the kill (it
    then heals at a later step); empty if it never needed to."""
    failed_at = min((s for s, r in recs.items() if s >= killed_at and r["failed"] > 0), default=None)
    if failed_at is None:
        return set()
    healed = [s for s, r in recs.items() if s >= failed_at and r["healed_at"] not in (None, 0)]
    return set(range(failed_at, min(healed) if healed else failed_at))


def test_loscar_kill_then_heal(lighthouse, tmp_path):
    """LOSCAR (overwrite merge, so the merged x[S] is the average, equal on every replica): SIGKILL one
    replica mid-run, the others go on with decreasing loss; restarted, it heals from a peer's
    parameters and round, then merges the same averages as the others."""
    steps, hold = 100, 50
    killed_at, (r0, r1, r2) = _hold_run(lighthouse, tmp_path, "loscar", steps, hold, 12)
    common = _survivors_common_steps(r0, r1, killed_at, steps)
    # the survivors share the round counter and every merged average (g: hash of x[S] after a merge),
    # except while one of them, whose round in flight at the kill failed where the other's
    # committed, has not yet healed from the other (torchft decides the commit per replica)
    lagging = _until_healed(r0, killed_at) | _until_healed(r1, killed_at)
    assert len(lagging) <= 20
    same = [s for s in common if s not in lagging]
    assert all(r0[s]["round"] == r1[s]["round"] and r0[s]["g"] == r1[s]["g"] for s in same)
    merged = [s for s in common if r0[s]["g"] is not None]
    assert len(merged) >= 10
    losses = [r0[s]["loss"] for s in common]
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    _synced_without_the_killed(r0, killed_at, hold)
    # a round in flight at the kill (if any) failed on both survivors alike
    assert r0[steps]["failed"] == r1[steps]["failed"] and r0[steps]["skipped"] == r1[steps]["skipped"]
    # the restarted replica healed at a round's send point: its parameters right after the heal are
    # a healthy peer's parameters at that step, then it merges exactly the others' averages
    after = sorted(s for s in r2 if s > hold)
    assert after, "the restarted replica recorded nothing after the heal"
    first = r2[after[0]]
    t = first["healed_at"]
    assert t is not None and t > hold and after[0] == t + 1
    assert first["x"] in (r0[t]["x"], r1[t]["x"])
    assert all(r2[s]["round"] == r0[s]["round"] and r2[s]["g"] == r0[s]["g"] for s in after)
    assert any(r2[s]["g"] is not None for s in after)
    assert any(r0[s]["participants"] == 3 for s in after)  # it contributes again after healing


def test_loscar_commit_failure_applies_nowhere(lighthouse, tmp_path):
    """LOSCAR: replica 1 reports an error in its 3rd round: that round is skipped on every replica,
    each keeping its own x[S] (the coordinates are not averaged), and later rounds merge as before."""
    steps = 40
    fail = ["--fail-commit-at", "3"]
    procs = _start_all(
        lighthouse, tmp_path, 3, steps, "--method", "loscar", args=lambda i: fail if i == 1 else []
    )
    _finish(procs)
    _fresh_start(tmp_path, [0, 1, 2], 3)
    recs = [_last(_records(tmp_path, i)) for i in range(3)]
    r = recs[1]  # the replica that reported the error
    merges = [s for s in r if s - 1 in r and r[s]["applied"] > r[s - 1]["applied"]]
    skipped_at = [s for s in r if s - 1 in r and r[s]["skipped"] == 1 and r[s - 1]["skipped"] == 0]
    assert len(skipped_at) == 1 and skipped_at[0] in merges
    s_fail = skipped_at[0]
    # every replica skipped it: nobody merged, and each kept its own parameters
    for rec in recs:
        assert sorted(rec) == list(range(1, steps + 1))
        assert rec[steps]["skipped"] == 1 and rec[steps]["failed"] == 1
    assert all(rec[s_fail]["g"] is None for rec in recs)
    assert len({rec[s_fail]["x"] for rec in recs}) == len(recs)
    # every other merge is the same average on every replica that ran it
    good = [s for s in merges if s != s_fail]
    assert len(good) >= 3
    assert all(r[s]["g"] is not None for s in good)
    assert all(rec[s]["g"] == r[s]["g"] for rec in recs for s in good if s in rec)


def _dp_run_killed_at_12(lh, out: Path, replicas: int, steps: int, extra: tuple, killed: int) -> dict:
    """`replicas` replicas of 2 ranks started together (``_start_together``), each with `extra`;
    replica `killed` (both ranks) SIGKILLs itself right after step 12. Returns the processes by
    (replica, group rank)."""
    gate = ("--start-gate", str(out / "go"))
    procs = {}
    for i in range(replicas):
        port, die = _free_port(), ("--die-at", "12") if i == killed else ()
        for r in range(2):
            procs[i, r] = _start_dp(lh, i, r, port, out, steps, *extra, *gate, *die, replicas=replicas)
    _start_together(procs, out)
    for r in range(2):
        _killed(procs[killed, r], out, f"{killed}_{r}", 12, procs.values())
    return procs


def _start_dp(lh, i, r, port, out: Path, steps: int, *extra: str, replicas: int = 2) -> subprocess.Popen:
    """Group rank r of replica i, a replica of 2 ranks with DDP inside (its store on `port`)."""
    cmd = [sys.executable, str(WORKER), "--lighthouse", lh.address(), "--replica", str(i)]
    cmd += ["--replicas", str(replicas)]
    cmd += ["--steps", str(steps), "--out", str(out / f"r{i}_{r}.jsonl"), "--group-size", "2"]
    # the port is a token naming this incarnation's port file: group rank 0 binds a port the OS picks
    # and publishes it there (a port chosen in advance could be taken before it binds)
    cmd += ["--group-rank", str(r), "--group-port-file", str(out / f"group{i}.{port}.port"), *extra]
    return _popen(cmd, out / f"log{i}_{r}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_replica_is_a_data_parallel_group(lighthouse, tmp_path):
    """2 replicas of 2 ranks each (DDP inside a replica, each rank all-reduces with the same rank of
    the other replica). Kill replica 1 (both ranks) mid-run and restart it: it heals rank by rank, then
    all four ranks hold the same g, and the two ranks of a replica the same parameters, at every step."""
    steps = 40
    procs = _dp_run_killed_at_12(lighthouse, tmp_path, 2, steps, (), killed=1)
    port = _free_port()  # the restarted replica's
    for r in range(2):
        procs[1, r] = _start_dp(lighthouse, 1, r, port, tmp_path, steps)
    _finish(list(procs.values()))
    recs = {key: _last(_records(tmp_path, f"{key[0]}_{key[1]}")) for key in procs}
    _fresh_start(tmp_path, [f"{i}_{r}" for i, r in procs], 2)
    a = recs[0, 0]
    assert sorted(a) == list(range(1, steps + 1))
    assert all(a[s]["g"] == recs[0, 1][s]["g"] and a[s]["x"] == recs[0, 1][s]["x"] for s in a)
    healed = [recs[1, r][steps]["healed_at"] for r in range(2)]
    assert healed[0] is not None and healed[0] == healed[1] > 12  # both ranks healed at the same step
    after = [s for s in a if s > healed[0]]
    assert after and all(recs[1, r][s]["g"] == a[s]["g"] for r in range(2) for s in after)
    assert all(recs[1, 0][s]["x"] == recs[1, 1][s]["x"] for s in after)
    assert a[steps]["participants"] == 2
    losses = [a[s]["loss"] for s in sorted(a)]
    assert sum(losses[-5:]) < sum(losses[:5])


@pytest.mark.parametrize("method", ["cocodc", "loscar"])
def test_replica_data_parallel_group_agrees(lighthouse, tmp_path, method):
    """CoCoDC and LOSCAR with 2 replicas of 2 ranks (DDP inside a replica). Group rank 1 of each
    replica is skewed (--skew): left to itself it would pick another N and fragment than rank 0 and
    receive another heal state (as from another healthy replica). Replica 1 (both ranks) is SIGKILLed
    after step 12 and restarted: both of its ranks heal at the same step, and the two ranks of each
    replica hold bit-identical parameters at every step (replica 1: from its heal on), with the same
    decisions (CoCoDC: N and fragment schedule, on all four ranks) and the same averages as the
    other replica (CoCoDC: g; LOSCAR: the merged x[S], and the round)."""
    steps = 40
    extra = ("--method", method, "--skew")
    procs = _dp_run_killed_at_12(lighthouse, tmp_path, 2, steps, extra, killed=1)
    killed_at = 12
    port = _free_port()  # the restarted replica's
    for r in range(2):
        procs[1, r] = _start_dp(lighthouse, 1, r, port, tmp_path, steps, *extra)
    _finish(list(procs.values()))
    recs = {key: _last(_records(tmp_path, f"{key[0]}_{key[1]}")) for key in procs}
    _fresh_start(tmp_path, [f"{i}_{r}" for i, r in procs], 2)
    a, b = recs[0, 0], recs[0, 1]
    assert sorted(a) == list(range(1, steps + 1))
    # replica 0: its two ranks identical at every step (parameters, averages, decisions)
    keys = ("x", "g", "round", "N", "n_history", "last_send", "healed_at")
    assert all(a[s][k] == b[s][k] for s in a for k in keys)
    # replica 1: both ranks healed at the same step, after the kill; from then on identical to each
    # other, and holding replica 0's averages and decisions
    healed = [recs[1, r][steps]["healed_at"] for r in range(2)]
    assert healed[0] is not None and healed[0] == healed[1] > killed_at
    after = [s for s in a if s > healed[0]]
    assert after and all(s in recs[1, r] for r in range(2) for s in after)
    assert all(recs[1, 0][s][k] == recs[1, 1][s][k] for s in after for k in keys)
    shared = ("g", "round", "N", "last_send")
    assert all(recs[1, r][s][k] == a[s][k] for r in range(2) for s in after for k in shared)
    if method == "cocodc":  # (N of the periods since the heal: the history is not part of the state)
        assert len(a[steps]["n_history"]) == steps // 6 + (steps % 6 > 0)
        since = recs[1, 0][steps]["n_history"]
        assert since and a[steps]["n_history"][-len(since) :] == since
        assert len({p for s in a for p in a[s]["last_send"]}) > 2  # both fragments sent, repeatedly
    else:
        # right after the heal each rank of replica 1 holds replica 0's parameters of the heal step
        t = healed[0]
        assert all(recs[1, r][t + 1]["x"] == recs[0, r][t]["x"] for r in range(2))
        # merges after the heal, equal everywhere: LOSCAR merges every local_steps + overlap_steps = 6
        # steps; each such round after the heal either merged here or was skipped as a failed round
        # (a loaded machine can time one out), never silently dropped
        due = [s for s in after if s % 6 == 0]
        merged = [s for s in after if a[s]["g"] is not None]
        skipped = a[steps]["skipped"] - a[healed[0]]["skipped"]
        assert set(merged) <= set(due) and merged and len(merged) + skipped == len(due)
    assert a[steps]["participants"] == 2 and a[steps]["failed"] == b[steps]["failed"]
    losses = [a[s]["loss"] for s in sorted(a)]
    assert sum(losses[-5:]) < sum(losses[:5])


# 6 replica processes and 2 restarts (about 35 s each on 2 cores): in CI's long-run step, which keeps
# the README's test command under 10 minutes (pytest -m study -k heals_from_two_sources)
@pytest.mark.study
@pytest.mark.parametrize("method", ["loscar", "cocodc"])
def test_replica_data_parallel_heals_from_two_sources(lighthouse, tmp_path, method):
    """3 replicas of 2 ranks; replica 2 (both ranks) is SIGKILLed after step 12 and restarted while
    the two others wait. torchft heals its group rank 0 from replica 0 and its group rank 1 from
    replica 1 (it spreads the group ranks over the healthy replicas); under LOSCAR their states differ
    (each replica's own parameters). Both of its ranks continue from group rank 0's, i.e. replica 0's,
    state: at the same step, with identical parameters from then on, and the same averages (and, for
    CoCoDC, decisions) as the others."""
    steps, hold = 40, 24
    ready = tmp_path / "ready"
    run = ("--method", method)
    held = (*run, "--hold-at", str(hold), "--hold-for", str(ready))
    procs = _dp_run_killed_at_12(lighthouse, tmp_path, 3, steps, held, killed=2)
    _wait_step(tmp_path, "0_0", hold, procs.values())
    port = _free_port()  # the restarted replica's
    for r in range(2):
        extra = (*run, "--ready-file", str(ready)) if r == 1 else run  # the last one up releases them
        procs[2, r] = _start_dp(lighthouse, 2, r, port, tmp_path, steps, *extra, replicas=3)
    _finish(list(procs.values()))
    recs = {key: _last(_records(tmp_path, f"{key[0]}_{key[1]}")) for key in procs}
    _fresh_start(tmp_path, [f"{i}_{r}" for i, r in procs], 3)
    for i in (0, 1):  # the survivors: both ranks of each identical at every step, from the first
        assert sorted(recs[i, 0]) == sorted(recs[i, 1]) == list(range(1, steps + 1))
        assert all(recs[i, 0][s]["x"] == recs[i, 1][s]["x"] for s in recs[i, 0])
    healed = [recs[2, r][steps]["healed_at"] for r in range(2)]
    t = healed[0]
    assert t is not None and t == healed[1] >= hold
    after = [s for s in recs[0, 0] if s > t]
    assert after and all(s in recs[2, r] for r in range(2) for s in after)
    assert all(recs[2, 0][s]["x"] == recs[2, 1][s]["x"] for s in after)
    shared = ("g", "round", "N", "last_send")
    assert all(recs[2, r][s][k] == recs[0, 0][s][k] for r in range(2) for s in after for k in shared)
    if method == "loscar":
        # the two sources differ; both ranks hold replica 0's parameters (group rank 0's source)
        assert recs[0, 0][t]["x"] != recs[1, 0][t]["x"]
        assert all(recs[2, r][t + 1]["x"] == recs[0, 0][t]["x"] for r in range(2))
    assert recs[0, 0][steps]["participants"] == 3
