"""Checkpoints: resume is bit-identical (CPU), a SIGKILLed peer makes survivors raise within the
timeout, and restarting every rank from the last checkpoint ends bit-identical to an uninterrupted
run."""

from __future__ import annotations

import os

import pytest
import torch

from lowcomm_kernels.runtime.checkpoint import read_checkpoint
from lowcomm_kernels.runtime.launch import spawn_local

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rt_workers.py")


def _equal_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume (max |diff| {(a[k] - b[k]).abs().max()})"


@pytest.mark.parametrize("cls,kw,T,at", [
    # checkpoint while fragment 1 is in flight (sent at 4, applied at 6)
    ("streaming", {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2}, 26, 5),
    ("cocodc", {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 2, "syncs_per_period": 4},
     26, 11),
    ("loscar", {"density": 0.4, "local_steps": 3, "overlap_steps": 2}, 26, 9),
])
def test_resume_is_bit_identical(tmp_path, cls, kw, T, at):
    sc = {"name": cls, "cls": cls, "T": T, "kw": kw, "ckpt_at": at, "ckpt_dir": str(tmp_path),
          "dtype": torch.float32}
    res = spawn_local(f"{WORKERS}:resume_pair", 2, (sc,), timeout_s=180)
    for r in res:
        assert r["start"] == at
        assert r["full"]["error"] is None and r["resumed"]["error"] is None
        _equal_bits(r["full"]["params"], r["resumed"]["params"])
    # the checkpoint was taken with a sync in flight, and that sync's result was applied after resume
    if cls != "loscar":
        assert any(send <= at < apply for _, send, apply, *_ in res[0]["full"]["records"])
    assert res[0]["full"]["params"] != {}  # compared something


@pytest.mark.slow
def test_sigkill_peer_survivor_raises_then_restart_is_bit_identical(tmp_path):
    kw = {"sync_every": 6, "num_fragments": 2, "fragment_sync_delay": 1, "timeout_s": 20.0}
    base = {"cls": "streaming", "T": 24, "kw": kw, "dtype": torch.float32}
    killed_dir, full_dir = tmp_path / "killed", tmp_path / "full"
    killed_dir.mkdir()
    full_dir.mkdir()
    sc = {**base, "ckpt_dir": str(killed_dir), "ckpt_every": 5, "victim": 1, "kill_at": 13}
    res = spawn_local(f"{WORKERS}:killed_run", 2, (sc,), timeout_s=120, allow_dead=(1,))
    assert res[1] is None  # the victim died
    err = res[0]["error"]
    assert err is not None and err.startswith("SyncError"), err
    assert "fragment" in err and "sent at step" in err, err
    assert res[0]["after_kill_s"] < kw["timeout_s"] + 5
    # restart every rank from the last checkpoint (step 10), finish the run
    restarted = spawn_local(f"{WORKERS}:resume_only", 2, ({**base, "ckpt_dir": str(killed_dir)},),
                            timeout_s=120)
    full = spawn_local(f"{WORKERS}:run_scenarios", 2,
                       ([{**base, "name": "full", "ckpt_at": 10, "ckpt_dir": str(full_dir)}],), timeout_s=120)
    for r in range(2):
        # the survivor's last checkpoint is the uninterrupted run's state at step 10, bit for bit
        killed = read_checkpoint(killed_dir / f"rank{r}.pt")
        clean = read_checkpoint(full_dir / f"rank{r}.pt")
        assert killed["strategy"]["step"] == clean["strategy"]["step"] == 10
        _equal_bits(killed["model"], clean["model"])
        for key in ("g", "u"):
            assert torch.equal(killed["strategy"][key], clean["strategy"][key]), key
        assert restarted[r]["error"] is None
        _equal_bits(restarted[r]["params"], full[r]["full"]["params"])


@pytest.mark.slow
def test_hung_peer_survivor_raises_after_the_timeout(tmp_path):
    """A stopped (not dead) peer keeps its sockets open: only the per-collective timeout can help."""
    kw = {"sync_every": 6, "num_fragments": 2, "fragment_sync_delay": 1, "timeout_s": 3.0}
    sc = {"cls": "streaming", "T": 24, "kw": kw, "dtype": torch.float32, "ckpt_dir": str(tmp_path),
          "ckpt_every": 100, "victim": 1, "kill_at": 8, "hang": True}
    res = spawn_local(f"{WORKERS}:killed_run", 2, (sc,), timeout_s=120, allow_dead=(1,))
    err = res[0]["error"]
    assert err is not None and err.startswith("SyncError") and "fragment" in err, err
    assert kw["timeout_s"] - 0.5 <= res[0]["after_kill_s"] < kw["timeout_s"] + 10, res[0]
