"""The metric sinks: what a real strategy records reaches TensorBoard event files and log lines
unchanged, the fan-out and rank-0-only pattern work inside a 2-rank run, and bad input is named.

The event files are read back with TensorBoard's own ``EventAccumulator``; values are compared
with the float32 rounding that TensorBoard's scalar format applies, exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # the dev extra

from lowcomm_kernels.runtime import LoggingSink, MultiSink, SyncRecord, TensorBoardSink
from lowcomm_kernels.runtime.launch import spawn_local
from lowcomm_kernels.runtime.log import rank_logger
from lowcomm_kernels.runtime.sinks import format_record, record_scalars

HERE = os.path.abspath(__file__)
NUMERIC = [
    f.name
    for f in dataclasses.fields(SyncRecord)
    if f.name not in ("apply_step", "reason")  # the step axis; text
]
SCENARIOS = {
    # 2 fragments, staggered, tau = 1: records from both fragments in one series
    "streaming": {"kw": {"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 1}, "T": 13},
    # LOSCAR's sparse rounds: fragment -1, round >= 0
    "loscar": {"kw": {"density": 0.5, "local_steps": 2, "overlap_steps": 1}, "T": 10},
}


# ---- the worker (runs on 2 spawned gloo ranks) ------------------------------------------------


def sink_worker(rank: int, world: int, tb_root: str) -> dict:
    """Each scenario's strategy logs through MultiSink(TensorBoard on rank 0 only, LoggingSink, a
    list); rank 0 also writes its loss per step. Returns the records and log lines of this rank."""
    import torch

    import lowcomm_kernels.runtime as rt

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())
            assert isinstance(record.sync_record, rt.SyncRecord)  # the extra= attribute

    logger = logging.getLogger("lowcomm_kernels.metrics")
    logger.setLevel(logging.INFO)
    logger.addHandler(Collect())
    out: dict = {}
    for name, sc in SCENARIOS.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        records: list = []
        tb = TensorBoardSink(os.path.join(tb_root, name)) if rank == 0 else None
        sink = MultiSink(tb, LoggingSink(), records.append)
        cls = rt.StreamingDiLoCo if name == "streaming" else rt.LOSCAR
        losses = []
        lines.clear()
        with cls(model, opt, metrics_callback=sink, wan=rt.WAN(0.002, 1e9), **sc["kw"]):
            g = torch.Generator().manual_seed(rank)
            for step in range(1, sc["T"] + 1):
                x = torch.randn(8, 4, generator=g)
                loss = (model(x) - x.flip(1)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                sink.add_scalar("train/loss", loss.item(), step)  # only the TensorBoard sink has it
        sink.close()
        out[name] = {
            "records": [dataclasses.asdict(r) for r in records],
            "lines": list(lines),
            "losses": losses,
        }
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("tb")
    return root, spawn_local(f"{HERE}:sink_worker", 2, (str(root),), timeout_s=180)


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def f32(v: float) -> float:
    return float(np.float32(v))


# ---- TensorBoard -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_tensorboard_holds_what_the_strategy_recorded(run, name: str):
    root, per_rank = run
    records = per_rank[0][name]["records"]
    assert len(records) >= 2, records
    scalars = read_scalars(root / name)
    assert set(scalars) == {"lowcomm/" + f for f in NUMERIC} | {"train/loss"}
    for field in NUMERIC:
        expected = [(r["apply_step"], f32(float(r[field]))) for r in records]
        assert scalars["lowcomm/" + field] == expected, field
    losses = per_rank[0][name]["losses"]
    assert scalars["train/loss"] == [(s, f32(v)) for s, v in enumerate(losses, start=1)]
    if name == "streaming":  # both fragments synced, in one series
        assert {v for _, v in scalars["lowcomm/fragment"]} == {0.0, 1.0}
    else:
        assert {v for _, v in scalars["lowcomm/fragment"]} == {-1.0}
        assert [v for _, v in scalars["lowcomm/round"]] == [float(i) for i in range(len(records))]


def test_rank_zero_only_writes_one_run_per_scenario(run):
    root, per_rank = run
    assert sorted(p.name for p in root.iterdir()) == sorted(SCENARIOS)
    for name in SCENARIOS:
        files = list((root / name).iterdir())
        assert len(files) == 1 and files[0].name.startswith("events.out.tfevents."), files
        # rank 1 recorded its own syncs (same schedule, its own timings) but wrote no event file
        r0, r1 = per_rank[0][name]["records"], per_rank[1][name]["records"]
        assert [r["apply_step"] for r in r1] == [r["apply_step"] for r in r0]


def test_a_users_writer_stays_open_and_the_prefix_applies(tmp_path: Path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    rec = SyncRecord(
        fragment=3,
        send_step=5,
        apply_step=7,
        bytes=2**25 + 1,
        in_flight_s=0.1,
        exposed_s=0.0,
        staleness=2,
        skipped=True,
        reason="stale",
    )
    with TensorBoardSink(writer, prefix="sync/") as sink:
        sink(rec)
    writer.add_scalar("after", 1.0, 0)  # the sink's close() left the caller's writer open
    writer.close()
    scalars = read_scalars(tmp_path)
    assert set(scalars) == {"sync/" + f for f in NUMERIC} | {"after"}
    assert scalars["sync/skipped"] == [(7, 1.0)]
    assert scalars["sync/bytes"] == [(7, f32(2**25 + 1))]  # float32: 2^25 + 1 rounds to 2^25
    assert record_scalars(rec)["bytes"] == 2**25 + 1  # exact before TensorBoard's rounding


# ---- logging -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_logging_sink_inside_the_strategy_writes_one_line_per_sync(run, name: str):
    _, per_rank = run
    for rank in range(2):
        recs = [SyncRecord(**r) for r in per_rank[rank][name]["records"]]
        assert per_rank[rank][name]["lines"] == ["sync " + format_record(r) for r in recs]


def test_logging_sink_levels_and_loggers(run, caplog):
    _, per_rank = run
    recs = [SyncRecord(**r) for r in per_rank[0]["streaming"]["records"]]
    caplog.set_level(logging.DEBUG)
    LoggingSink()(recs[0])
    LoggingSink("my.app", level="debug")(recs[1])
    LoggingSink(rank_logger(1), level=logging.WARNING)(recs[0])  # an adapter: its prefix and extra kept
    got = [(r.name, r.levelno, r.getMessage(), r.sync_record) for r in caplog.records]
    assert caplog.records[2].rank == 1
    assert got == [
        ("lowcomm_kernels.metrics", logging.INFO, "sync " + format_record(recs[0]), recs[0]),
        ("my.app", logging.DEBUG, "sync " + format_record(recs[1]), recs[1]),
        ("lowcomm_kernels", logging.WARNING, "[rank 1] sync " + format_record(recs[0]), recs[0]),
    ]
    line = got[0][2]
    for field in ("fragment", "send_step", "apply_step", "bytes", "exposed_s", "skipped", "reason"):
        assert f" {field}=" in line
    caplog.clear()
    caplog.set_level(logging.WARNING)
    LoggingSink()(recs[0])  # below the logger's level: nothing
    assert caplog.records == []


# ---- fan-out -----------------------------------------------------------------------------------


def test_multisink_calls_each_in_order_and_skips_none():
    seen: list[tuple[str, int]] = []
    rec = SyncRecord(0, 1, 2, 8, 0.0, 0.0, 1)
    sink = MultiSink(
        lambda r: seen.append(("a", r.apply_step)), None, lambda r: seen.append(("b", r.apply_step))
    )
    sink(rec)
    assert seen == [("a", 2), ("b", 2)] and len(sink) == 2
    sink.add_scalar("x", 1.0, 1)  # no sink has add_scalar: nothing to do
    sink.flush()
    sink.close()
    assert len(MultiSink()) == 0 and len(MultiSink(None, None)) == 0


# ---- bad input ---------------------------------------------------------------------------------


def test_bad_input_names_the_argument(tmp_path: Path):
    a_file = tmp_path / "events.txt"
    a_file.write_text("not a folder")
    with pytest.raises(ValueError, match=r"log_dir_or_writer: .*events.txt.* is an existing file"):
        TensorBoardSink(a_file)
    with pytest.raises(ValueError, match=r"log_dir_or_writer: cannot create the folder"):
        TensorBoardSink(str(a_file / "run"))
    with pytest.raises(ValueError, match=r"log_dir_or_writer: needs a folder"):
        TensorBoardSink("  ")
    with pytest.raises(TypeError, match=r"log_dir_or_writer must be a folder .* got int"):
        TensorBoardSink(3)
    with pytest.raises(TypeError, match=r"prefix must be a str"):
        TensorBoardSink(tmp_path / "tb", prefix=None)
    with pytest.raises(ValueError, match=r"tag must be a non-empty str"):
        TensorBoardSink(tmp_path / "tb").add_scalar("", 1.0, 0)
    with pytest.raises(TypeError, match=r"sinks\[1\] must be callable"):
        MultiSink(print, "tensorboard")
    with pytest.raises(TypeError, match=r"logger must be a logging.Logger"):
        LoggingSink(logger=42)
    with pytest.raises(ValueError, match=r"level must be a logging level or its name, got 'LOUD'"):
        LoggingSink(level="LOUD")
    with pytest.raises(ValueError, match=r"level must be a logging level"):
        LoggingSink(level=-1)
    with pytest.raises(TypeError, match=r"record must be a SyncRecord, got dict"):
        LoggingSink()({"fragment": 0})
    with pytest.raises(TypeError, match=r"record must be a SyncRecord, got dict"):
        TensorBoardSink(tmp_path / "tb2")({"fragment": 0})
    assert not (tmp_path / "events.txt" / "run").exists() and a_file.read_text() == "not a folder"


def test_missing_tensorboard_says_which_extra_to_install(tmp_path: Path):
    """In a fresh interpreter where importing tensorboard fails as it does when it is not installed:
    the sink's ImportError gives the pip command and no folder is created."""
    code = textwrap.dedent(
        f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "tensorboard" or name.startswith("tensorboard."):
                    raise ModuleNotFoundError(f"No module named {{name!r}}")
        sys.meta_path.insert(0, Block())
        from lowcomm_kernels.runtime import LoggingSink, MultiSink, TensorBoardSink
        MultiSink(LoggingSink())  # the other sinks need nothing
        try:
            TensorBoardSink({str(tmp_path / "tb")!r})
        except ImportError as exc:
            print(exc)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'lowcomm-kernels[tensorboard]'" in proc.stdout, proc.stdout
    assert not (tmp_path / "tb").exists()


# ---- the documented example runs as written -------------------------------------------------------


@pytest.mark.slow
def test_integrations_doc_example_runs_under_torchrun(tmp_path: Path):
    doc = Path(HERE).parents[2] / "docs" / "integrations.md"
    blocks = [
        b for b in re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S) if "TensorBoardSink(" in b
    ]
    assert len(blocks) == 1, blocks
    (tmp_path / "train.py").write_text(blocks[0])
    logs = tmp_path / "logs"  # one file per rank and stream
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            f"--log-dir={logs}",
            "--redirects=3",
            "train.py",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # a rank that aborts prints every thread's stack
    )
    ranks = "\n".join(
        f"--- {p.relative_to(logs)}\n{p.read_text()[-2500:]}" for p in sorted(logs.rglob("*.log"))
    )
    assert proc.returncode == 0, proc.stderr[-2000:] + "\n" + ranks
    files = list((tmp_path / "tb" / "streaming").iterdir())
    assert len(files) == 1 and [p.name for p in (tmp_path / "tb").iterdir()] == ["streaming"]  # rank 0 only
    scalars = read_scalars(tmp_path / "tb" / "streaming")
    assert set(scalars) == {"lowcomm/" + f for f in NUMERIC} | {"train/loss"}
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 101))
    per_rank = [
        [ln for ln in p.read_text().splitlines() if "sync fragment=" in ln]
        for p in sorted(logs.rglob("stderr.log"))
    ]
    assert len(per_rank) == 2
    applied = [s for s, _ in scalars["lowcomm/fragment"]]
    for lines in per_rank:  # every rank logged each sync that rank 0 wrote to TensorBoard
        assert [int(re.search(r" apply_step=(\d+) ", ln)[1]) for ln in lines] == applied
