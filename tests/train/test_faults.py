"""``--faults``: the schedule's parsing (every bad input a UsageError naming the flag, before anything
is spawned) and the main job through a lost and a returning worker (torchft replicas, a Lighthouse in
the parent, worker 2 SIGKILLed and restarted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lowcomm_kernels.cli import main
from lowcomm_kernels.train.errors import UsageError
from lowcomm_kernels.train.faults import Fault, event_marks, parse_faults
from lowcomm_kernels.train.report import RunResult, format_fault_table


def _parse(text: str, workers: int = 4, steps: int = 100, sync_every: int = 10):
    return parse_faults(text, workers=workers, steps=steps, sync_every=sync_every)


def test_parse_schedule():
    s = _parse(" return:2@40 , kill:2@20,kill:3@30 ")
    assert s.events == (Fault("kill", 2, 20), Fault("kill", 3, 30), Fault("return", 2, 40))
    assert str(s) == "kill:2@20,kill:3@30,return:2@40"
    # killed again after its return, then back again
    s = _parse("kill:1@10,return:1@20,kill:1@30,return:1@40")
    assert [e.kind for e in s.events] == ["kill", "return", "kill", "return"]
    assert _parse("kill:3@99").kills() == [Fault("kill", 3, 99)]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "at least one event"),
        ("  ", "at least one event"),
        ("kill:2", "cannot read 'kill:2'"),
        ("stop:2@10", "cannot read 'stop:2@10'"),
        ("kill:2@10,", "cannot read ''"),
        ("kill:-1@10", "cannot read"),
        ("kill:2@1.5", "cannot read"),
        ("kill:0@10", "worker 0 stays alive"),
        ("kill:4@10", "no worker 4 with --workers 4"),
        ("kill:2@0", "1 .. 99"),
        ("kill:2@100", "1 .. 99"),
        ("kill:2@500", "1 .. 99"),
        ("return:2@40", "worker 2 was never killed"),
        ("kill:2@20,return:2@20", "two events of worker 2 at one step"),
        ("return:2@10,kill:2@20", "was never killed"),
        ("kill:2@20,kill:2@30", "worker 2 is already dead (killed at step 20)"),
        ("kill:2@20,return:2@30,return:2@40", "is alive again since step 30"),
        ("kill:2@20,return:2@91", "--sync-every 10 must not pass --steps 100"),
        ("kill:1@10,kill:2@20,kill:3@30", "leaves 1 live worker(s) of 4"),
    ],
)
def test_bad_schedules(text, says):
    with pytest.raises(UsageError) as info:
        _parse(text)
    assert "--faults" in str(info.value) and says in str(info.value)


def test_two_dead_at_once_needs_enough_workers():
    _parse("kill:1@10,kill:2@20,return:1@30")  # 2 of 4 alive between 20 and 30
    with pytest.raises(UsageError, match="leaves 1 live worker"):
        _parse("kill:1@10,kill:2@20", workers=3)
    # a return at the step of another worker's kill counts first: never fewer than two alive
    _parse("kill:1@10,return:1@30,kill:2@30", workers=3)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["train", "--method", "dp", "--faults", "kill:2@5"], "data-parallel baseline (dp)"),
        (["train", "--method", "diloco", "--faults", "kill:0@5"], "worker 0 stays alive"),
        (["train", "--method", "diloco", "--fault-free"], "--fault-free goes with --faults"),
        (["compare", "--methods", "diloco,dp", "--faults", "kill:2@5"], "data-parallel baseline (dp)"),
        (["compare", "--task", "logreg", "--faults", "kill:2@5"], "not --study or --task logreg"),
        (["train", "--method", "diloco", "--wire-dtype", "int8", "--faults", "kill:2@5"], "wire-dtype int8"),
        (["train", "--method", "loscar", "--density", "0", "--faults", "kill:2@5"], "--density 0"),
        (
            ["train", "--method", "loscar", "--local-steps", "3", "--overlap-steps", "2", "--worker-speeds",
             "1,1,2", "--speed-model", "steps", "--faults", "kill:2@8"],
            "--speed-model steps (a slow LOSCAR worker idling on some ticks) is not supported",
        ),
        (
            ["train", "--method", "diloco", "--final-eval-bytes", "4096", "--faults", "kill:2@5"],
            "--final-eval-bytes is not supported with faults",
        ),
        (
            ["train", "--method", "loscar", "--local-steps", "8", "--overlap-steps", "2", "--faults",
             "kill:2@5,return:2@95"],
            "--local-steps + --overlap-steps 10 must not pass --steps 100",
        ),
    ],
)  # fmt: skip
def test_cli_refuses_before_any_spawn(tmp_path, capsys, argv, says):
    out = tmp_path / "out"
    argv = [*argv, "--workers", "3", "--steps", "100", "--out", str(out), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert not out.exists()  # refused before the output folder (or a worker) was made


def test_profile_refuses_a_bad_schedule(tmp_path, capsys):
    """``lowcomm profile --faults``: its preset runs 2 workers, too few to lose one."""
    out = tmp_path / "out"
    assert main(["profile", "--method", "diloco", "--faults", "kill:1@5", "--out", str(out)]) == 2
    assert "leaves 1 live worker(s) of 2" in capsys.readouterr().err and not out.exists()


def test_help_documents_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--faults SCHEDULE" in text and "kill:W@S" in text and "return:W@S" in text
    assert "--fault-free" in text


def _corpus(path: Path) -> Path:
    import random

    rng = random.Random(0)
    words = "the of and model train loss worker sync alpha beta gamma delta".split()
    path.write_text(" ".join(rng.choice(words) for _ in range(40000)))
    return path


@pytest.mark.slow
def test_kill_and_return_end_to_end(tmp_path):
    """3 workers, DiLoCo, worker 2 SIGKILLed at step 8 and back at step 15: the run finishes, worker 0's
    loss goes down, the returned worker heals and then holds the others' global state (hash of g equal
    at every evaluation after the heal and at the end), and results.json, the table and the plot name the
    events. The subprocess's timeout is the no-hang check."""
    pytest.importorskip("torchft")
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "lowcomm_kernels.cli", "train", "--method", "diloco",
        "--workers", "3", "--steps", "30", "--sync-every", "5", "--eval-every", "5", "--eval-bytes", "2048",
        "--batch-size", "4", "--dim", "16", "--layers", "1", "--heads", "2", "--mlp-hidden", "32",
        "--seq-len", "16", "--lr", "0.01", "--warmup", "2", "--faults", "kill:2@8,return:2@15",
        "--data", str(_corpus(tmp_path / "text.txt")), "--out", str(out), "--no-progress",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    run = doc["runs"][0]
    f = run["extra"]["faults"]
    assert doc["faults"] == "kill:2@8,return:2@15" and f["reported_by"] == 0
    kill, back = f["events"]
    assert (kill["kind"], kill["worker"], kill["step"]) == ("kill", 2, 8)
    assert (back["kind"], back["worker"], back["step"]) == ("return", 2, 15)
    healed = back["healed_at"]
    assert isinstance(healed, int) and 15 <= healed < 30 and healed % 5 == 0  # at a sync after its return
    # worker 0 trained through the outage: every evaluation, loss down
    steps = [p["step"] for p in run["points"]]
    assert steps == list(range(0, 31, 5))
    losses = [p["val_loss"] for p in run["points"]]
    assert losses[-1] < losses[0] - 0.3
    # rounds: the quorum shrank to 2 after the kill and held 3 again after the heal, the returned
    # worker contributing
    syncs = f["syncs"]
    assert f["syncs_committed"] == sum(s["committed"] for s in syncs) >= 5
    assert any(s["quorum"] == 2 for s in syncs if 8 < s["step"] <= 15)
    assert any(s["replicas"] == 3 for s in syncs if s["step"] > healed)
    assert f["kill_to_next_commit_s"][0] is not None and f["kill_to_next_commit_s"][0] > 0
    # the healed worker equals the others: the hash of g at each evaluation after the heal, and at the end
    curves = {int(w): {c[0]: c[2] for c in v} for w, v in f["replica_curves"].items()}
    after = [s for s in curves[2] if s >= healed]
    assert after and all(curves[2][s] == curves[0][s] == curves[1][s] for s in after)
    assert max(s for s in curves[2] if s < 15) <= 8  # no evaluation while it was dead
    assert len(set(f["final_g_hash"].values())) == 1 and set(f["final_g_hash"]) == {"0", "1", "2"}
    # the plot, its marks and the printed table
    assert (out / "val_loss_faults.png").stat().st_size > 10_000
    labels = [m[1] for m in event_marks(f)]
    assert labels == ["worker 2 killed", f"worker 2 back, healed at step {healed}"]
    assert "kill -> next committed sync" in proc.stdout and f"w2: step {healed}" in proc.stdout
    assert "kill -> next committed sync" in (out / "table.md").read_text()
    # lowcomm report renders the same fault table again from results.json (the docs quote it so)
    from lowcomm_kernels.train import render

    text, _ = render.render([str(out)])
    ftable = format_fault_table([RunResult.from_dict(r) for r in doc["runs"]])
    assert ftable in text and f"w2: step {healed}" in text


def test_fault_table_against_the_fault_free_twin():
    from lowcomm_kernels.train.report import EvalPoint

    def run(name, loss, faults=None):
        r = RunResult(
            name, "diloco", {}, points=[EvalPoint(0, 0.0, 0.0, 0.0, 5.5), EvalPoint(10, 1.0, 0, 0, loss)]
        )
        r.extra = {"faults": faults, "waited_for_returns_s": 3.25} if faults else {}
        return r

    faults = {
        "events": [
            {"kind": "kill", "worker": 2, "step": 3},
            {"kind": "return", "worker": 2, "step": 5, "healed_at": 6},
        ],
        "syncs_committed": 4, "syncs_failed": 1, "kill_to_next_commit_s": [1.25],
        "fault_free_final_loss": 2.0,
    }  # fmt: skip
    table = format_fault_table([run("DiLoCo", 2.5, faults), run("DiLoCo (fault-free)", 2.0)])
    row = [line for line in table.splitlines() if line.startswith("| DiLoCo")]
    assert row == ["| DiLoCo | 4 | 1 | 1.25 s | w2: step 6 | 3.2 s | 2.5000 | 2.0000 | +0.5000 |"]
    faults["fault_free_final_loss"] = None
    assert "not run (--fault-free)" in format_fault_table([run("DiLoCo", 2.5, faults)])
