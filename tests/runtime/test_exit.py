"""A process ends as a user's script ends, on a process group the user made (a plain
``init_process_group("gloo")``, torch's 30-minute timeout): a survivor of a peer that stopped
answering exits soon after its ``SyncError``, and a loop that ends with a sync in flight and no
``finish()`` exits cleanly on every rank (no SIGABRT). Each rank is a script of its own
(``rt_exit.py``), so its exit is the interpreter's own, not a launcher's ``os._exit``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lowcomm_kernels.runtime.launch import free_port

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rt_exit.py")
# far below the group's 30 minutes, far above what a loaded machine needs (a few seconds)
EXIT_BOUND_S = 240.0

pytestmark = pytest.mark.slow


def _start(case: str, wire: str) -> list[subprocess.Popen]:
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, SCRIPT, str(r), "2", str(port), case, wire],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for r in range(2)
    ]


def _end(p: subprocess.Popen, timeout: float) -> tuple[int | None, str]:
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        return None, out


@pytest.mark.parametrize("wire", ["fp32", "int8"])
def test_survivor_of_a_stuck_peer_exits_after_its_sync_error(wire):
    survivor, stuck = _start("stuck_peer", wire)
    t0 = time.monotonic()
    try:
        rc, out = _end(survivor, EXIT_BOUND_S)
    finally:
        stuck.kill()
        stuck.communicate()
    assert rc is not None, f"the survivor did not exit within {EXIT_BOUND_S:g} s:\n{out[-3000:]}"
    assert rc == 1 and "SyncError" in out, out[-3000:]
    print(f"{wire}: survivor exited {time.monotonic() - t0:.1f} s after start (timeout_s=3)")


@pytest.mark.parametrize("wire", ["fp32", "int8", "topk"])
def test_a_loop_that_ends_with_a_sync_in_flight_exits_cleanly(wire):
    procs = _start("no_finish", wire)
    ends = [_end(p, EXIT_BOUND_S) for p in procs]
    for rank, (rc, out) in enumerate(ends):
        assert rc == 0, f"rank {rank} ended with {rc}:\n{out[-3000:]}"
        assert "done 6" in out and "terminate called" not in out, out[-3000:]


def test_a_collective_that_completes_as_the_interpreter_ends_does_not_abort():
    """rt_exit.py ``late_peer`` (see there), 4 times: every rank exits 0."""
    for _ in range(4):
        ends = [_end(p, EXIT_BOUND_S) for p in _start("late_peer", "fp32")]
        for rank, (rc, out) in enumerate(ends):
            assert rc == 0 and "done" in out and "terminate called" not in out, f"rank {rank}: {rc}\n{out}"


def test_a_collectives_tensors_stay_held_until_gloo_lets_go(monkeypatch):
    """The tensors of a collective started through ``start_collective`` are referenced by the runtime,
    also after the caller dropped them and after the collective completed, until gloo's own
    references are gone (their use count is back to what it was before); then they are dropped."""
    import datetime
    import functools

    import torch
    import torch.distributed as dist

    from lowcomm_kernels.runtime import transport

    monkeypatch.setattr(transport, "_in_flight", [])
    store = dist.HashStore()
    group = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=30))
    t = torch.ones(1000)
    opts = dist.AllreduceOptions()
    launch = functools.partial(group.allreduce, [t], opts)
    work = transport.start_collective(launch, [t], 30.0)
    (held,) = transport._in_flight
    assert held.tensors[0] is t and held.before == (1,) and held.work is work
    del t, launch  # the runtime's reference is the last Python one
    assert work.wait()
    with transport._in_flight_lock:
        transport._prune_in_flight()  # the work completed: its Work is dropped, its tensor is not
    assert held.work is None and (not transport._in_flight or transport._in_flight == [held])
    del work
    deadline = time.monotonic() + 10
    while not held.released() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert held.released()
    with transport._in_flight_lock:
        transport._prune_in_flight()
    assert transport._in_flight == []
