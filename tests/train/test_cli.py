"""`lowcomm` end to end on a tiny configuration, and its handling of bad input.

The smoke runs spawn real gloo workers (2 ranks, a 2-block model, a few steps), so they check the
whole path: corpus -> worker processes -> runtime strategies -> table, JSON and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import os
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
    "--eval-bytes",
    "512",
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
    "val_loss_basis",
    "final_val_loss_workers",
    "final_val_loss_workers_min",
    "final_val_loss_workers_max",
    "final_val_loss_avg_model",
    "eval_bytes_scored",
    "final_val_ppl",
    "wall_clock_s",
    "bytes_sent_per_worker",
    "exposed_comm_s",
    "exposed_comm_frac",
    "syncs",
}


def test_train_with_bf16_parameters(tmp_path: Path):
    """--param-dtype bf16: a bf16 TinyLlama under Streaming DiLoCo (float32 outer master) trains,
    syncs and reports a finite validation loss; the choice is recorded in the run's config."""
    out = tmp_path / "bf16"
    argv = ["train", "--method", "streaming", "--fragments", "2", "--sync-every", "4", "--delay", "1"]
    rc = main([*argv, "--param-dtype", "bf16", *TINY, "--out", str(out)])
    assert rc == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["config"]["param_dtype"] == "bf16" and run["syncs"] > 0
    losses = [p["val_loss"] for p in run["points"]]
    assert losses and all(0 < v < 10 for v in losses), losses


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
    for run in doc["runs"]:
        assert run["val_loss_basis"] == "worker models, mean" and run["eval_bytes_scored"] == 512
        for p in run["points"]:  # the headline is the mean of the 2 workers' own models
            assert len(p["val_loss_workers"]) == 2 and p["val_loss"] == sum(p["val_loss_workers"]) / 2
            assert 0 < p["val_loss_avg_model"] < 10
        assert run["points"][0]["workers_agree"]  # one initialisation: step 0 is one model
    # data-parallel workers apply the same averaged gradient: always one model; LOSCAR's never agree
    assert all(p["workers_agree"] for p in runs["dp"]["points"])
    assert not any(p["workers_agree"] for p in runs["loscar"]["points"][1:])
    loscar_last = runs["loscar"]["points"][-1]
    assert loscar_last["val_loss_workers"][0] != loscar_last["val_loss_workers"][1]
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


def test_final_eval_bytes_is_one_more_evaluation_on_a_larger_sample(tmp_path: Path):
    """--final-eval-bytes: after the last step every worker's model is scored once more on that many
    bytes; the final loss (results and rows) is that evaluation's, the curve keeps --eval-bytes."""
    out = tmp_path / "final"
    rc = main(["train", "--method", "diloco", *TINY, "--final-eval-bytes", "4096", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    run, row = doc["runs"][0], doc["rows"][0]
    fin = run["final_eval"]
    assert fin["eval_bytes_scored"] == 4096 and run["eval_bytes_scored"] == 512
    assert [p["step"] for p in run["points"]] == [0, 4, 8]
    assert len(fin["val_loss_workers"]) == 2 and 0 < fin["val_loss"] < 10
    assert fin["val_loss"] == pytest.approx(sum(fin["val_loss_workers"]) / 2, rel=1e-12)
    assert run["final_loss"] == row["final_val_loss"] == fin["val_loss"]
    assert fin["val_loss"] != run["points"][-1]["val_loss"]  # other bytes, another number
    assert row["final_val_loss_workers"] == fin["val_loss_workers"]
    assert row["final_eval_bytes_scored"] == 4096
    assert "after the last step on 4,096 bytes" in (out / "table.md").read_text()


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


# ---- --out: a folder the run can write, checked before any worker starts ------------------------

OUT_COMMANDS = {
    "compare": ["compare"],
    "train": ["train", "--method", "diloco"],
    "profile": ["profile"],
    "study": ["compare", "--study", "matched"],
    "logreg": ["compare", "--task", "logreg"],
    "bench": ["bench"],
}


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if a command gets as far as starting a process (a worker, or the benchmarks)."""
    import multiprocessing.process

    import lowcomm_kernels.train.commands as commands

    def started(*a, **k):
        raise AssertionError("a process was started before the bad input was reported")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", started)
    monkeypatch.setattr(commands.subprocess, "call", started)


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


@pytest.mark.parametrize("command", list(OUT_COMMANDS))
def test_out_is_an_existing_file(tmp_path: Path, capsys, no_workers, command: str):
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    assert main([*OUT_COMMANDS[command], "--out", str(target)]) == 2
    assert _one_error_line(capsys) == f"error: --out {target} is an existing file, not a folder"
    assert target.read_text() == "keep me"


@pytest.mark.parametrize("command", list(OUT_COMMANDS))
def test_out_under_a_file(tmp_path: Path, capsys, no_workers, command: str):
    (tmp_path / "f").write_text("")
    out = tmp_path / "f" / "run"
    assert main([*OUT_COMMANDS[command], "--out", str(out)]) == 2
    assert _one_error_line(capsys).startswith(f"error: --out {out}: cannot create the folder (")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
@pytest.mark.parametrize("command", ["train", "logreg", "bench"])
@pytest.mark.parametrize("where", ["/proc/lowcomm-out", "/proc"])
def test_out_in_an_unwritable_place(capsys, no_workers, command: str, where: str):
    # /proc refuses new files even to root (for whom permission bits change nothing)
    assert main([*OUT_COMMANDS[command], "--out", where]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: --out {where}: cannot "), line


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_out_under_a_read_only_folder(tmp_path: Path, capsys, no_workers):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert main(["train", "--method", "dp", "--out", str(ro / "run")]) == 2
        assert _one_error_line(capsys).startswith(f"error: --out {ro / 'run'}: cannot create the folder (")
        assert main(["train", "--method", "dp", "--out", str(ro)]) == 2
        assert _one_error_line(capsys).startswith(f"error: --out {ro}: cannot write files in the folder (")
    finally:
        ro.chmod(0o700)


# ---- errors name the flag and the value as typed, not the converted internal field ---------------

FLAG_COMMANDS = {
    "compare": ["compare"],
    "train": ["train", "--method", "dp"],
    "profile": ["profile"],
    "study": ["compare", "--study", "matched"],
    "logreg": ["compare", "--task", "logreg"],
}
FLAG_ERRORS = [
    (["--latency-ms", "-1"], "--latency-ms must be >= 0, got -1"),
    (["--latency-ms", "-0.5"], "--latency-ms must be >= 0, got -0.5"),
    (["--latency-ms", "inf"], "--latency-ms expected a finite number, got 'inf'"),
    (["--bandwidth-mbps", "0"], "--bandwidth-mbps must be > 0, got 0"),
    (["--bandwidth-mbps", "-5"], "--bandwidth-mbps must be > 0, got -5"),
    (["--bandwidth-mbps", "inf"], "--bandwidth-mbps expected a finite number, got 'inf'"),
    (["--bandwidth-mbps", "nan"], "--bandwidth-mbps expected a finite number, got 'nan'"),
    (["--bandwidth-mbps", "1e-400"], "--bandwidth-mbps must be > 0, got 1e-400"),
    (["--alpha", "2"], "--alpha must be in [0, 1], got 2"),
    (["--delay", "-1"], "--delay must be >= 0, got -1"),
    (["--fragments", "0"], "--fragments must be >= 1, got 0"),
    (["--warmup", "-3"], "--warmup must be >= 0, got -3"),
    (["--density", "-0.1"], "--density must be in [0, 1], got -0.1"),  # 0: LOSCAR's no-communication baseline
    (["--lr", "0"], "--lr must be > 0, got 0"),
    (["--workers", "1.5"], "--workers expected an integer, got '1.5'"),
    (["--eval-bytes", "0"], "--eval-bytes must be >= 1, got 0"),
    (["--eval-bytes", "4096.5"], "--eval-bytes expected an integer, got '4096.5'"),
    (["--worker-speeds", "1,0,2"], "--worker-speeds needs positive numbers separated by commas, got '1,0,2'"),
]


@pytest.mark.parametrize("command", list(FLAG_COMMANDS))
@pytest.mark.parametrize(("flag", "expected"), FLAG_ERRORS, ids=[" ".join(f) for f, _ in FLAG_ERRORS])
def test_bad_flag_value_names_the_flag_as_typed(capsys, no_workers, command, flag, expected):
    assert main([*FLAG_COMMANDS[command], *flag]) == 2
    assert _one_error_line(capsys) == f"error: {expected}"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["train", "--method", "streaming", "--sync-every", "5"],
            "--delay=5 must be < --sync-every // --fragments = 1 (the per-fragment period)",
        ),
        (
            ["train", "--method", "cocodc", "--syncs-per-period", "100"],
            "--syncs-per-period=100 must lie in [--fragments=4, --sync-every // --delay = 10]",
        ),
        (
            ["train", "--method", "loscar", "--worker-speeds", "1,2"],
            "--worker-speeds needs --workers = 4 positive values, got 1,2",
        ),
        (["compare", "--dim", "30"], "--dim (30) must be divisible by --heads (4) with an even head size"),
        (
            ["train", "--method", "dp", "--eval-bytes", "63"],
            "--eval-bytes must be at least one window of --seq-len = 64 bytes, got 63",
        ),
        (
            ["train", "--method", "dp", "--final-eval-bytes", "63"],
            "--final-eval-bytes must be 0 (none) or at least one window of --seq-len = 64 bytes, got 63",
        ),
        (["compare", "--study", "matched", "--sync-every", "2"], "--delay=5 is too long: --delay x"),
        # a link on which one sync outlasts the runtime's timeout (it used to hang, or overflow a sleep)
        (
            ["train", "--method", "diloco", "--latency-ms", "1e12"],
            "--latency-ms 1e+12 ms and --bandwidth-mbps 100 Mbit/s: one sync of 923904 payload bytes",
        ),
        (
            ["train", "--method", "streaming", "--bandwidth-mbps", "1e-12"],
            "--latency-ms 50 ms and --bandwidth-mbps 1e-12 Mbit/s: one sync of 230976 payload bytes",
        ),
        (["compare", "--quick", "--bandwidth-mbps", "1e-9"], "--latency-ms 50 ms and --bandwidth-mbps 1e-09"),
    ],
)
def test_knobs_that_disagree_are_named_by_their_flags(capsys, no_workers, argv, expected):
    assert main(argv) == 2
    assert _one_error_line(capsys).startswith(f"error: {expected}")


@pytest.fixture
def small_machine(monkeypatch):
    """A 2-core machine with 4 GiB available (what check_workers reads)."""
    from lowcomm_kernels.train import provenance

    monkeypatch.setattr(provenance, "usable_cores", lambda: 2)
    monkeypatch.setattr(provenance, "available_memory_bytes", lambda: 4 * 2**30)


@pytest.mark.parametrize(
    ("argv", "most"),
    [
        (["train", "--method", "dp", "--workers", "5000"], 16),  # 8 per core
        (["compare", "--quick", "--workers", "17"], 16),
        (["compare", "--task", "logreg", "--workers", "17"], 16),
        # the memory: 12.9M parameters take ~400 MiB of state per worker on top of its ~200
        (["train", "--method", "diloco", "--dim", "512", "--mlp-hidden", "1376", "--workers", "7"], 6),
    ],
)
def test_more_workers_than_the_machine_holds_are_refused(capsys, no_workers, small_machine, argv, most):
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert line.startswith(
        f"error: --workers {argv[-1]}: this machine has 2 usable cores and 4.0 GiB of "
        f"available memory, enough for at most {most} worker processes"
    ), line
    assert line.endswith("use fewer, or --oversubscribe to start them anyway"), line


def test_oversubscribe_starts_them_anyway(small_machine):
    from lowcomm_kernels.cli import build_parser
    from lowcomm_kernels.train.args import spec_from_args

    args = build_parser().parse_args(["train", "--method", "dp", "--workers", "5000", "--oversubscribe"])
    assert spec_from_args(args, "dp").workers == 5000
    args = build_parser().parse_args(["train", "--method", "dp", "--workers", "16"])
    assert spec_from_args(args, "dp").workers == 16


def test_every_flag_named_in_errors_exists():
    """FLAGS (field -> flag, used to word SpecError) matches the parser's flags and dests."""
    from lowcomm_kernels.cli import build_parser
    from lowcomm_kernels.train.args import FLAGS

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = {s: a.dest for a in sub.choices["train"]._actions for s in a.option_strings}
    for field, flag in FLAGS.items():
        assert flag in options, (field, flag)
        if not field.startswith("ModelConfig.") and flag not in ("--latency-ms", "--bandwidth-mbps"):
            assert options[flag] == field, (field, flag)


def _small_corpus(tmp_path: Path) -> Path:
    path = tmp_path / "small.txt"
    path.write_text("x = 1\n" * 1000)  # 6000 bytes: 5400 train, 600 validation
    return path


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--seq-len", "3000"], "--seq-len 3000 needs more than 3001 bytes of training text per worker"),
        (["--seq-len", "700", "--workers", "1"], "--seq-len 700 needs more than 701 bytes of validation"),
        (["--seed", "4294967296"], "--seed must be in [0, 4294967295], got 4294967296"),
        (["--seed", "-1"], "--seed must be in [0, 4294967295], got -1"),
        (["--out", ""], "--out needs a folder, got ''"),
        (["--data", " "], "--data needs a file or folder, got ' '"),
    ],
)
@pytest.mark.parametrize("command", ["train", "profile", "study"])
def test_odd_values_fail_before_any_worker(tmp_path, capsys, no_workers, command, argv, expected):
    data = [] if "--data" in argv else ["--data", str(_small_corpus(tmp_path))]
    assert main([*FLAG_COMMANDS[command], *data, *argv]) == 2
    assert _one_error_line(capsys).startswith(f"error: {expected}")


def test_study_seeds_past_the_largest_seed(capsys, no_workers):
    assert main(["compare", "--study", "lambda", "--seed", "4294967295", "--seeds", "2"]) == 2
    assert _one_error_line(capsys) == (
        "error: --seed 4294967295 with --seeds 2 needs seed 4294967296; the largest is 4294967295"
    )


def test_a_failed_run_is_one_line_with_the_traceback_in_a_file(tmp_path: Path, capsys):
    from lowcomm_kernels.runtime.launch import RankFailure, WorkerError
    from lowcomm_kernels.train.runner import report_failure

    failures = [RankFailure(2, "ValueError: bad", "Traceback ...\nValueError: bad"), RankFailure(0, "died")]
    exc = WorkerError(failures)
    assert report_failure(exc, tmp_path) == 1
    err = capsys.readouterr().err
    assert err == f"error: run failed: worker 2: ValueError: bad (traceback in {tmp_path / 'error.txt'})\n"
    assert "rank 0: died" in (tmp_path / "error.txt").read_text()
    assert "Traceback ...\nValueError: bad" in (tmp_path / "error.txt").read_text()
