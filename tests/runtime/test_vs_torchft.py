"""bench/vs_torchft.py, the per-step cost of our DiLoCo / Streaming DiLoCo beside torchft's: a tiny
run of the whole script (``--quick``) and its refusals of bad arguments. Only the output's form is
checked, never a timing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "vs_torchft.py"
CONFIGS = ["plain", "ours-diloco", "torchft-diloco", "ours-streaming", "torchft-streaming"]


def _module():
    spec = importlib.util.spec_from_file_location("vs_torchft", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.study  # two replica processes and a Lighthouse, ~30 s on a loaded machine
def test_quick_run_writes_a_well_formed_summary(tmp_path):
    pytest.importorskip("torchft")
    out, md = tmp_path / "vs.json", tmp_path / "vs.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--markdown", str(md)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert "--quick" in res["command"] and res["args"]["rounds"] == 2
    assert len(res["load_before"]) == 3 and len(res["load_after"]) == 3
    runs = res["runs"]
    assert sorted((r["round"], r["config"]) for r in runs) == sorted(
        (i, c) for i in range(2) for c in CONFIGS
    )
    assert all(r["step_s"] > 0 for r in runs)
    assert all(r["hook_s"] > 0 if r["config"] != "plain" else r["hook_s"] == 0 for r in runs)
    assert all(r["cpu_s"] > 0 and r["hook_cpu_s"] >= 0 for r in runs)
    for r in runs:
        if r["config"].startswith("ours"):  # 40 timed steps after a warm-up period of 10: 5 syncs
            assert r["syncs"] == 5 if r["config"] == "ours-diloco" else r["syncs"] == 10
    s = res["summary"]
    assert set(s["step_ms"]) == set(CONFIGS) and all(v["n"] == 2 for v in s["step_ms"].values())
    for key in ("hook", "cpu", "hook_cpu"):
        assert set(s[f"{key}_ms"]) == set(CONFIGS) and set(s[f"{key}_ratio"]) == {"diloco", "streaming"}
    assert set(s["ratio"]) == {"diloco", "streaming"} and set(s["floor"]) == {"diloco", "streaming"}
    assert set(s["added_ratio"]) == {"diloco", "streaming"}
    tables = [s[k] for k in ("ratio", "hook_ratio", "cpu_ratio", "hook_cpu_ratio", "floor")]
    for q in [q for t in tables for q in t.values()]:
        assert len(q["by_round"]) == 2 and q["min"] <= q["median"] <= q["max"]
    table = md.read_text()
    assert "| ours-streaming |" in table and "| torchft-diloco |" in table
    assert "| DiLoCo | " in table and "| Streaming DiLoCo | " in table  # the floor's table
    assert table in proc.stdout


def test_summary_takes_same_round_ratios():
    runs = [
        {"round": r, "config": c, "step_s": v}
        for r, vals in enumerate([(1.0, 2.0, 4.0), (1.0, 6.0, 3.0), (1.0, 1.0, 4.0)])
        for c, v in zip(["plain", "ours-diloco", "torchft-diloco"], vals, strict=True)
    ]
    s = _module().summarize(runs, ["plain", "ours-diloco", "torchft-diloco"])
    assert s["ratio"]["diloco"]["by_round"] == [0.5, 2.0, 0.25]
    assert s["ratio"]["diloco"]["median"] == 0.5  # not median(ours) / median(torchft) = 2 / 4
    assert s["step_ms"]["ours-diloco"]["median"] == 2000.0 and "streaming" not in s["ratio"]
    assert s["hook_ms"] == {} and s["hook_ratio"] == {}  # runs without hook times


def test_the_floor_and_the_added_step_time_come_from_the_same_round():
    runs = [
        {"round": r, "config": c, "step_s": v}
        for r, vals in enumerate([(1.0, 1.5, 2.0), (2.0, 2.0, 4.0), (1.0, 3.0, 1.0)])
        for c, v in zip(["plain", "ours-diloco", "torchft-diloco"], vals, strict=True)
    ]
    runs.append({"round": 3, "config": "ours-diloco", "step_s": 9.0})  # no plain run: not a pair
    s = _module().summarize(runs, ["plain", "ours-diloco", "torchft-diloco"])
    assert s["floor"]["diloco"]["by_round"] == [0.5, 0.5, 1.0] and s["floor"]["diloco"]["median"] == 0.5
    # added per round: ours 0.5, 0, 2 s; torchft 1, 2, 0 s; medians 0.5 and 1 s
    assert s["added_ratio"]["diloco"] == {"ours_ms": 500.0, "torchft_ms": 1000.0, "ratio": 0.5}
    assert "streaming" not in s["floor"] and "streaming" not in s["added_ratio"]
    table = _module().markdown({"summary": s, "args": _ARGS, "load_before": [], "load_after": []})
    assert "| DiLoCo | 0.500 (0.500-1.000) | 500.000 | 1000.000 | 0.500 |" in table
    assert "| Streaming DiLoCo |" not in table


def test_torchft_adding_nothing_gives_no_ratio():
    runs = [
        {"round": 0, "config": c, "step_s": v}
        for c, v in (("plain", 1.0), ("ours-diloco", 1.2), ("torchft-diloco", 1.0))
    ]
    s = _module().summarize(runs, ["plain", "ours-diloco", "torchft-diloco"])
    assert s["added_ratio"]["diloco"]["ratio"] is None
    table = _module().markdown({"summary": s, "args": _ARGS, "load_before": [], "load_after": []})
    assert "| DiLoCo | 1.000 (1.000-1.000) | 200.000 | 0.000 |  |" in table


_ARGS = {
    "layers": 2,
    "dim": 4,
    "batch": 1,
    "sync_every": 2,
    "fragments": 2,
    "tau": 0,
    "steps": 2,
    "rounds": 3,
}


@pytest.mark.parametrize(
    "args, name",
    [
        (["--steps", "30"], "--steps"),
        (["--configs", "ours-diloco,horovod"], "--configs"),
        (["--tau", "10"], "--tau"),
        (["--rounds", "0"], "--rounds"),
        (["--layers", "1"], "--layers"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, capsys, args, name):
    out = tmp_path / "vs.json"
    with pytest.raises(SystemExit) as e:
        _module().main([*args, "--out", str(out), "--markdown", str(tmp_path / "vs.md")])
    assert e.value.code == 2 and name in capsys.readouterr().err
    assert not out.exists()
