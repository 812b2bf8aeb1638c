"""bench/ft_recovery.py, the side-by-side kill of our DiLoCo and torchft's: a smoke run of the whole
script (``--quick``: one seed, 25 steps, a kill and a restart, a Lighthouse loss, both
implementations) and its checks of bad arguments.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "ft_recovery.py"


@pytest.mark.slow
@pytest.mark.study  # the whole benchmark script: CI runs it in its own step (pytest -m study)
def test_quick_run_writes_results_and_figure(tmp_path):
    out, fig = tmp_path / "ft.json", tmp_path / "ft.png"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--figure", str(fig)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert fig.stat().st_size > 10_000
    res = json.loads(out.read_text())
    assert "--quick" in res["command"] and "overhead" not in res
    runs = res["runs"]
    assert sorted((r["impl"], r["fault"]) for r in runs) == [
        ("lowcomm", False), ("lowcomm", True), ("torchft", False), ("torchft", True)
    ]  # fmt: skip
    for r in runs:
        assert r["steps"][-1] == 25 and math.isfinite(r["eval_loss"])
        assert r["loss"][-1] < r["loss"][0]  # every run trained
        if not r["fault"]:
            assert set(r["participants"][-5:]) == {3}
            continue
        # the survivors' next committed sync after the kill ran without the dead replica, then it
        # came back (restarted at step 17) and was in a quorum of three again
        assert r["kill_to_commit_s"] > 0 and r["first_commit_participants"] == 2
        assert r["failed_syncs"] >= 0
        assert r["return_to_3_s"] is not None and r["return_to_3_s"] > 0
    for impl in ("lowcomm", "torchft"):
        s = res["summary"][impl]
        assert s["kill_to_commit_s"]["n"] == 1 and math.isfinite(s["eval_loss_gap"]["mean"])
        # the life cycle: a fresh start (processes up, then the first step, which holds the joining
        # quorum), and the restart's start-up
        for key in ("start_up_s", "first_step_s", "median_step_s", "restart_up_s"):
            assert s[key]["n"] == 1 and s[key]["mean"] > 0, (impl, key, s[key])
    assert "| lowcomm DiLoCo (manager=) |" in proc.stdout and "| torchft.local_sgd.DiLoCo |" in proc.stdout
    # the Lighthouse lost mid-run: every replica of both implementations stops with an error within
    # its quorum timeout (10 s in --quick) and a margin, none hangs and none trains on
    assert sorted(r["impl"] for r in res["lighthouse"]) == ["lowcomm", "torchft"]
    for r in res["lighthouse"]:
        assert r["quorum_timeout_s"] == 10.0 and len(r["exits"]) == 3
        for e in r["exits"]:
            assert e["code"] not in (None, 0) and 0 < e["exit_s"] < 60, (r["impl"], e)
            assert e["last_step"] < 25, (r["impl"], e)  # it stopped: no step after the loss's next sync
        if r["impl"] == "lowcomm":  # ours names the cause
            assert all("Lighthouse" in e["error"] and "SyncError" in e["error"] for e in r["exits"]), r
    assert res["lighthouse_summary"]["lowcomm"]["exited_nonzero"] == 3
    assert "| Lighthouse loss (quorum_timeout 10 s): replicas |" in proc.stdout


def _module():
    spec = importlib.util.spec_from_file_location("ft_recovery", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_docs_quote_the_committed_result():
    """docs/fault_tolerance.md and docs/results.md show the tables of bench/figures/ft_recovery.json as
    the script renders them (``--render``), line for line: no hand-copied figure can drift from it."""
    mod = _module()
    res = json.loads((ROOT / "bench" / "figures" / "ft_recovery.json").read_text())
    assert res["complete"] and res["lighthouse"] and "overhead" in res
    git = res["provenance"]["git"]  # a clean tree (but for this results file, rewritten after each run)
    assert git["dirty"] is False or git["modified"] == ["bench/figures/ft_recovery.json"], git
    docs = (ROOT / "docs" / "fault_tolerance.md").read_text()
    for table in (mod.kill_table(res), mod.lifecycle_table(res), mod.source_line(res)):
        missing = [line for line in table.splitlines() if line not in docs]
        assert not missing, f"docs/fault_tolerance.md lacks {missing}: re-render with --render"
    results = (ROOT / "docs" / "results.md").read_text()
    missing = [line for line in mod.overhead_table(res).splitlines() if line not in results]
    assert not missing, f"docs/results.md lacks {missing}"


@pytest.mark.parametrize(
    "args, name",
    [
        (["--kill-at", "30", "--steps", "20"], "--kill-at"),
        (["--restart-at", "5", "--kill-at", "10"], "--restart-at"),
        (["--impls", "lowcomm,horovod"], "--impls"),
        (["--seeds", "0"], "--seeds"),
        (["--step-sleep", "-1"], "--step-sleep"),
        (["--lighthouse-quorum-timeout", "0"], "--lighthouse-quorum-timeout"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, capsys, args, name):
    mod = _module()
    out = tmp_path / "ft.json"
    with pytest.raises(SystemExit) as e:
        mod.main([*args, "--out", str(out), "--figure", str(tmp_path / "f.png")])
    assert e.value.code == 2 and name in capsys.readouterr().err
    assert not out.exists()
