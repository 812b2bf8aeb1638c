"""`lowcomm` end to end on a tiny configuration, and its handling of bad input.

The smoke runs spawn real gloo workers (2 ranks, a 2-block model, a few steps), so they check the
whole path: corpus -> launcher -> runtime strategies -> table, JSON and PNG plots.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lowcomm_kernels.cli import main

TINY = [
    "--workers",
    "2",
    "--steps",
    "8",
    "--eval-every",
    "4",
    "--eval-batches",
    "2",
    "--batch-size",
    "2",
    "--dim",
    "16",
    "--layers",
    "2",
    "--heads",
    "2",
    "--mlp-hidden",
    "32",
    "--seq-len",
    "16",
    "--sync-every",
    "4",
    "--delay",
    "1",
    "--fragments",
    "2",
    "--latency-ms",
    "5",
    "--bandwidth-mbps",
    "1000",
    "--warmup",
    "2",
    "--no-progress",
]
PNG = b"\x89PNG\r\n\x1a\n"
ROW_FIELDS = {
    "method",
    "steps_to_target",
    "wall_to_target_s",
    "bytes_to_target",
    "final_val_loss",
    "final_val_ppl",
    "wall_clock_s",
    "bytes_sent_per_worker",
    "exposed_comm_s",
    "exposed_comm_frac",
    "syncs",
}


@pytest.mark.slow
def test_compare_smoke_all_methods(tmp_path: Path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", *TINY, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for label in ("data-parallel", "DiLoCo", "Streaming DiLoCo", "CoCoDC", "LOSCAR"):
        assert label in printed
    doc = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in doc["rows"]] == [
        "data-parallel (every step)",
        "DiLoCo",
        "Streaming DiLoCo",
        "CoCoDC",
        "LOSCAR",
    ]
    for row in doc["rows"]:
        assert ROW_FIELDS <= set(row)
        assert row["final_val_loss"] < 5.55  # below the uniform-byte loss ln(256)
        assert row["bytes_sent_per_worker"] > 0 and row["syncs"] > 0
        assert row["steps_to_target"] is not None  # auto target: reached by every run
    runs = {r["method"]: r for r in doc["runs"]}
    # every step all-reduces the gradient: 8 syncs, the most bytes of all
    assert runs["dp"]["syncs"] == 8
    assert runs["dp"]["bytes_sent"] == max(r["bytes_sent"] for r in doc["runs"])
    assert [p["step"] for p in runs["diloco"]["points"]] == [0, 4, 8]
    table = (out / "table.md").read_text()
    for header in (
        "steps to target",
        "final val loss",
        "final ppl",
        "wall-clock",
        "bytes sent/worker",
        "exposed comm",
    ):
        assert header in table
    for name in ("val_loss_vs_steps.png", "val_loss_vs_wallclock.png", "val_loss_vs_bytes.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG and len(data) > 5000


@pytest.mark.slow
def test_train_one_method_on_user_data(tmp_path: Path):
    data = tmp_path / "corpus"
    data.mkdir()
    for i in range(30):
        (data / f"f{i}.txt").write_text(f"def f(x):\n    return x * {i}\n" * 60)
    out = tmp_path / "train"
    rc = main(
        [
            "train",
            "--method",
            "loscar",
            "--data",
            str(data),
            "--density",
            "0.5",
            "--local-steps",
            "2",
            "--overlap-steps",
            "1",
            *TINY,
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["rows"]) == 1 and doc["rows"][0]["method"] == "LOSCAR"
    assert str(data) in doc["corpus"]
    run = doc["runs"][0]
    assert run["config"]["density"] == 0.5 and run["config"]["data"] == str(data)
    assert run["syncs"] == 8 // (2 + 1)  # rounds of N + Q = 3 steps within 8 steps


@pytest.mark.slow
def test_profile_writes_trace_and_timeline(tmp_path: Path):
    out = tmp_path / "prof"
    args = [a for a in TINY if a != "--no-progress"] + ["--no-progress"]
    assert main(["profile", "--method", "streaming", *args, "--out", str(out)]) == 0
    for r in range(2):
        trace = json.loads((out / f"trace_rank{r}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"lowcomm/compute", "lowcomm/pack", "lowcomm/comm", "lowcomm/merge"} <= names
        assert (out / f"timeline_rank{r}.png").read_bytes()[:8] == PNG
    assert (out / "timeline.png").read_bytes()[:8] == PNG


def _bad(tmp_path: Path, case: str) -> list[str]:
    empty = tmp_path / "empty"
    empty.mkdir(exist_ok=True)
    (tmp_path / "empty.txt").write_text("")
    return {
        "missing data path": ["train", "--method", "diloco", "--data", str(tmp_path / "nope")],
        "empty corpus folder": ["compare", "--data", str(empty)],
        "empty corpus file": ["train", "--method", "dp", "--data", str(tmp_path / "empty.txt")],
        "workers < 1": ["compare", "--workers", "0"],
        "unknown method (train)": ["train", "--method", "sgd"],
        "unknown method (compare)": ["compare", "--methods", "diloco,nope"],
        "bad model shape": ["train", "--method", "diloco", "--dim", "30"],
        "not a number": ["train", "--method", "diloco", "--lr", "fast"],
        "unknown study": ["compare", "--study", "nope"],
        "delay >= sync period": ["train", "--method", "streaming", "--sync-every", "5", "--delay", "5"],
    }[case]


@pytest.mark.parametrize(
    "case",
    [
        "missing data path",
        "empty corpus folder",
        "empty corpus file",
        "workers < 1",
        "unknown method (train)",
        "unknown method (compare)",
        "bad model shape",
        "not a number",
        "unknown study",
        "delay >= sync period",
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path: Path, capsys, case: str):
    assert main(_bad(tmp_path, case)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_console_script_bad_input_has_no_traceback(tmp_path: Path):
    """The installed entry point (a fresh interpreter) gives the same single line and exit code."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lowcomm_kernels.cli",
            "train",
            "--method",
            "diloco",
            "--data",
            str(tmp_path / "missing"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: --data path does not exist: {tmp_path / 'missing'}"]


def test_bench_without_bench_folder_is_a_clear_error(tmp_path: Path, capsys):
    assert main(["bench", "--bench-dir", str(tmp_path / "nobench")]) == 2
    assert "is not a folder" in capsys.readouterr().err
