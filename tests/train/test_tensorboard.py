"""`lowcomm train|compare --tensorboard DIR` end to end, and the CLI's optional packages.

The runs spawn real gloo workers at the tiny size of test_cli.py; the event files are read back with
TensorBoard's own EventAccumulator and checked against what the same run wrote to results.json.
Values are compared after the float32 rounding of TensorBoard's scalar format.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lowcomm_kernels.cli import main
from lowcomm_kernels.runtime import SyncRecord
from tests.train.test_cli import TINY

SYNC_TAGS = {"lowcomm/" + f.name for f in dataclasses.fields(SyncRecord)} - {
    "lowcomm/apply_step",
    "lowcomm/reason",
}
HARNESS_TAGS = {
    "train/loss",
    "train/lr",
    "val/loss",
    "val/loss_avg_model",
    "val/loss_worker_min",
    "val/loss_worker_max",
}


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def f32(v: float) -> float:
    return float(np.float32(v))


def check_run(folder: Path, run: dict) -> dict[str, list[tuple[int, float]]]:
    """The harness's scalars of one run against its results.json entry; returns every scalar."""
    files = list(folder.iterdir())
    assert len(files) == 1 and files[0].name.startswith("events.out.tfevents."), files
    s = read_scalars(folder)
    steps = run["config"]["steps"]
    assert [st for st, _ in s["train/loss"]] == list(range(1, steps + 1))
    assert all(0 < v < 6 for _, v in s["train/loss"])  # byte-level LM: about ln(256) = 5.5 at the start
    assert s["val/loss"] == [(p["step"], f32(p["val_loss"])) for p in run["points"]]
    assert s["val/loss_avg_model"] == [(p["step"], f32(p["val_loss_avg_model"])) for p in run["points"]]
    assert s["val/loss_worker_min"] == [(p["step"], f32(min(p["val_loss_workers"]))) for p in run["points"]]
    assert s["val/loss_worker_max"] == [(p["step"], f32(max(p["val_loss_workers"]))) for p in run["points"]]
    lr, warmup = run["config"]["lr"], run["config"]["warmup_steps"]
    assert s["train/lr"][:warmup] == [(k, f32(lr * k / warmup)) for k in range(1, warmup + 1)]
    return s


@pytest.mark.slow
def test_train_tensorboard_holds_rank0_loss_and_sync_records(tmp_path: Path):
    tb, out = tmp_path / "tb", tmp_path / "out"
    assert main(["train", "--method", "streaming", *TINY, "--out", str(out), "--tensorboard", str(tb)]) == 0
    assert [p.name for p in tb.iterdir()] == ["streaming"]
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["config"]["tensorboard_dir"] == str(tb / "streaming")
    s = check_run(tb / "streaming", run)
    assert set(s) == HARNESS_TAGS | SYNC_TAGS
    # the sync records: one point per applied sync, at its apply step
    assert len(s["lowcomm/bytes"]) == run["syncs"] >= 2
    assert sum(v for _, v in s["lowcomm/bytes"]) == run["bytes_sent"]  # exact: small integers
    for point in run["points"]:  # bytes sent up to each evaluation
        assert sum(v for st, v in s["lowcomm/bytes"] if st <= point["step"]) == point["bytes_sent"]
    assert sum(v for _, v in s["lowcomm/exposed_s"]) == pytest.approx(run["exposed_s"], rel=1e-6, abs=1e-9)
    assert {v for _, v in s["lowcomm/fragment"]} == {0.0, 1.0}  # --fragments 2
    assert {v for _, v in s["lowcomm/staleness"]} == {1.0}  # --delay 1
    assert [st - v for (st, v) in s["lowcomm/staleness"]] == [v for _, v in s["lowcomm/send_step"]]


@pytest.mark.slow
def test_compare_tensorboard_writes_one_run_per_method(tmp_path: Path):
    tb, out = tmp_path / "tb", tmp_path / "out"
    argv = ["compare", "--methods", "dp,loscar", *TINY, "--out", str(out), "--tensorboard", str(tb)]
    assert main(argv) == 0
    assert sorted(p.name for p in tb.iterdir()) == ["dp", "loscar"]
    runs = {r["method"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    dp = check_run(tb / "dp", runs["dp"])
    assert set(dp) == HARNESS_TAGS  # the data-parallel baseline has no runtime strategy: no sync records
    loscar = check_run(tb / "loscar", runs["loscar"])
    assert set(loscar) == HARNESS_TAGS | SYNC_TAGS
    assert len(loscar["lowcomm/round"]) == runs["loscar"]["syncs"] >= 1
    assert {v for _, v in loscar["lowcomm/fragment"]} == {-1.0}  # LOSCAR's sparse rounds


# ---- bad input: one line, exit code 2, no worker started ----------------------------------------


@pytest.fixture
def no_workers(monkeypatch):
    import multiprocessing.process

    def started(*a, **k):
        raise AssertionError("a process was started before the bad input was reported")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", started)


def _error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in captured.err, captured
    return lines[0]


def test_tensorboard_bad_folders(tmp_path: Path, capsys, no_workers):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    train = ["train", "--method", "diloco", "--out", str(tmp_path / "out")]
    assert main([*train, "--tensorboard", str(a_file)]) == 2
    assert _error(capsys) == f"error: --tensorboard {a_file} is an existing file, not a folder"
    assert main([*train, "--tensorboard", str(a_file / "tb")]) == 2
    assert _error(capsys).startswith(f"error: --tensorboard {a_file / 'tb'}: cannot write into ")
    assert main([*train, "--tensorboard", " "]) == 2
    assert _error(capsys) == "error: --tensorboard needs a folder, got ' '"
    used = tmp_path / "tb" / "diloco"
    used.mkdir(parents=True)
    (used / "events.out.tfevents.1.host.1.0").write_bytes(b"")
    assert main([*train, "--tensorboard", str(tmp_path / "tb")]) == 2
    assert "already holds TensorBoard event files of an earlier run" in _error(capsys)
    for extra in (["--study", "matched"], ["--task", "logreg"]):
        assert main(["compare", *extra, "--tensorboard", str(tmp_path / "tb2")]) == 2
        assert _error(capsys).startswith("error: --tensorboard works with the language-model runs of compare")
    assert not (tmp_path / "tb2").exists()


def _cli_without(tmp_path: Path, missing: list[str], argv: list[str]) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter where importing each of ``missing`` fails as if not installed."""
    code = textwrap.dedent(
        f"""
        import sys
        for name in {missing!r}:
            sys.modules[name] = None  # "import name" raises ImportError
        from lowcomm_kernels.cli import main
        sys.exit(main({argv!r}))
        """
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )


@pytest.mark.parametrize(
    "missing, argv, message",
    [
        (["matplotlib"], ["compare", "--no-progress"], "lowcomm compare (its plots) needs matplotlib"),
        (["matplotlib"], ["profile"], "lowcomm profile (its plots) needs matplotlib"),
        (["tqdm"], ["train", "--method", "dp"], "lowcomm train (its progress bars; or pass --no-progress)"),
        (
            ["tensorboard"],
            ["train", "--method", "dp", "--no-progress", "--tensorboard", "tb"],
            "--tensorboard",
        ),
        (
            ["sklearn"],
            ["compare", "--task", "logreg", "--no-progress"],
            "--task logreg (its data set) needs scikit-learn",
        ),
        (
            ["sklearn"],
            ["compare", "--task", "mlp", "--no-progress"],
            "--task mlp (its data set) needs scikit-learn",
        ),
        (
            ["sklearn"],
            ["compare", "--study", "loscar-regimes", "--no-progress"],
            "--study loscar-regimes (its data set)",
        ),
    ],
)
def test_missing_optional_package_names_the_extra(tmp_path: Path, missing, argv, message):
    proc = _cli_without(tmp_path, missing, argv)
    extra = "tensorboard" if missing == ["tensorboard"] else "cli"
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("error: " + message) and line.endswith(f"pip install 'lowcomm-kernels[{extra}]'")
    assert "\n" not in line and not (tmp_path / "tb").exists() and not (tmp_path / "runs").exists()


def test_no_progress_runs_without_tqdm(tmp_path: Path):
    # without tqdm, --no-progress gets past the check (and stops at the next bad input: --data)
    proc = _cli_without(tmp_path, ["tqdm"], ["train", "--method", "dp", "--no-progress", "--data", "nope"])
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --data path does not exist: nope"
