"""bench/gpu_check.sh --dry-run: the GPU check's scripts run on the CPU, so they cannot rot unseen.

The GPU check runs only where a GPU is lent; this runs the same script, stage for stage, on the CPU
(Triton through its interpreter, the cpu backend, gloo on CPU tensors, a tiny bench) and checks the
report it writes: every stage present, each passed or was skipped for the documented reason, every
check in the correctness, runtime and bench reports passed. About 40 s on an idle 2-core machine
(70 s beside a parallel test run), hence marked ``study``: CI runs it in its own step
(``pytest -m study``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.study]
STAGES = ("build", "correctness", "pytest", "runtime", "bench")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    return proc, out


@pytest.mark.slow
def test_dry_run_exits_zero_and_prints_a_summary(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "DRY RUN" in proc.stdout and f"wrote {out}/gpu_check.md" in proc.stdout
    assert not (out / "gpu.md").exists(), "a dry run must not write the GPU section of RESULTS.md"


@pytest.mark.slow
def test_every_stage_passed_or_was_skipped_for_the_documented_reason(dry_run):
    _, out = dry_run
    rep = json.loads((out / "gpu_check.json").read_text())
    assert rep["dry_run"] is True and rep["exit"] == 0
    status = {name: rep["stages"][name]["status"] for name in STAGES}
    assert status["build"] == "skip"
    # without a GPU, `pytest -m gpu` selects nothing (exit 5: skip) or only tests that skip (exit 0: pass)
    assert status["pytest"] == "pass" or status["pytest"].startswith("skip (no test carries the gpu marker")
    assert status["correctness"] == status["runtime"] == status["bench"] == "pass", status


@pytest.mark.slow
def test_correctness_report_covers_backends_dtypes_offsets_and_passed(dry_run):
    _, out = dry_run
    corr = json.loads((out / "gpu_check.json").read_text())["correctness"]
    rows = corr["results"]
    assert not [r for r in rows if r["status"] == "FAIL"]
    passed = {(r["backend"], r["op"]) for r in rows if r["status"] == "pass"}
    for backend in ("triton", "cpu"):
        for op in ("pack", "outer_merge_", "sparse", "fragment_norms", "mask_indices"):
            assert (backend, op) in passed, (backend, op)
    assert ("cpu", "opcheck") in passed
    cases = {r["case"] for r in rows if r["status"] == "pass" and r["backend"] == "cpu"}
    for label in ("fp32", "fp32/bf16", "fp64", "fp64/bf16"):
        for off in (0, 1, 3, 5):
            assert f"n=4097 {label} offset={off}" in cases
    # the interpreter runs Triton in fp32 only; everything else is skipped for that reason, none for time
    edge = {(r["backend"], r["op"]): r for r in rows if r["case"] == "edge"}
    skips = {r["detail"] for r in rows if r["status"] == "skip" and r["case"] != "edge"}
    assert skips <= {"Triton interpreter: fp32 only"}, skips
    # the GPU-only edge checks are reported as skipped with their reason, never absent
    for backend in ("triton", "cpu"):
        assert edge[(backend, "pack bf16 overflow")]["status"] == "pass"
        for op in ("pack n=2^31+7", "outer_merge_ n=2^31+7", "second device"):
            assert edge[(backend, op)]["status"] == "skip" and edge[(backend, op)]["detail"], (backend, op)


@pytest.mark.slow
def test_runtime_report_matches_the_simulator_and_measures_overlap(dry_run):
    _, out = dry_run
    rt = json.loads((out / "gpu_check.json").read_text())["runtime"]
    rows = {(r["part"], r["name"]): r for r in rt["rows"]}
    for strategy in ("diloco", "streaming", "cocodc", "loscar"):
        a = rows[("a", f"{strategy} (gloo, 1 rank)")]
        assert a["status"] == "pass" and a["max_abs_diff"] <= 1e-7 and a["syncs"] > 0, a
        for rank in (0, 1):
            b = rows[("b", f"{strategy} (gloo, rank {rank} of 2)")]
            assert b["status"] == "pass" and b["max_abs_diff"] <= 1e-7, b
    assert rows[("c", "sync debug mode")]["status"] == "skip"
    sd = rt["overlap"]["Streaming DiLoCo"]
    assert sd["syncs"] > 0 and 0.0 <= sd["exposed_fraction"] <= 1.0


@pytest.mark.slow
def test_bench_checked_every_result_then_timed(dry_run):
    _, out = dry_run
    bench = json.loads((out / "gpu_check.json").read_text())["bench"]
    assert bench["failed_checks"] == 0 and bench["errors"] == 0
    assert len(bench["checks"]) >= 10 and all(c["check"] == "pass" for c in bench["checks"])
    assert {r["impl"] for r in bench["rows"]} >= {"copy_", "ref", "cpu"}


@pytest.mark.slow
def test_markdown_has_every_section(dry_run):
    _, out = dry_run
    md = (out / "gpu_check.md").read_text()
    for title in ("### Correctness", "### pytest -m gpu", "### Runtime", "### Bandwidth"):
        assert title in md
    for stage in STAGES:
        assert f"| {stage} |" in md
    for name in ("gpu_correctness.md", "gpu_runtime.md", "gpu_bench.md"):
        assert (out / name).read_text().strip()
