"""bench/gpu_check.sh --dry-run: the GPU check's scripts run on the CPU, so they cannot rot unseen.

The GPU check runs only where a GPU is lent; this runs the same script, stage for stage, on the CPU
(the GPU tests of tests/gpu on the cpu backend and gloo on CPU tensors, the overlap on gloo, a tiny
bench) and checks the report it writes: every stage present, each passed or was skipped for the
documented reason, pytest's junit report covers every op, dtype, offset and strategy with no
failure, the overlap and bench reports passed. About two minutes on a 2-core machine, hence marked
``study``: CI runs it in its own step (``pytest -m study``).
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
STAGES = ("build", "pytest", "overlap", "bench")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    for name in (
        "TRITON_INTERPRET",
        "LOWCOMM_GPU_TESTS_DEVICE",
        "LOWCOMM_GPU_TESTS_BACKENDS",
        "LOWCOMM_GPU_TESTS_BUDGET_S",
        "PYTEST_XDIST_WORKER",
        "PYTEST_ADDOPTS",
    ):
        env.pop(name, None)
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
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
    assert status["pytest"] == status["overlap"] == status["bench"] == "pass", status
    assert (out / "pytest_gpu.xml").exists()


def _cases(out: Path) -> dict[str, dict]:
    return {c["test"]: c for c in json.loads((out / "gpu_check.json").read_text())["pytest"]["cases"]}


@pytest.mark.slow
def test_gpu_tests_ran_on_the_cpu_and_cover_ops_dtypes_offsets(dry_run):
    _, out = dry_run
    cases = _cases(out)
    assert not [t for t, c in cases.items() if c["status"] in ("FAIL", "ERROR")]
    passed = {t for t, c in cases.items() if c["status"] == "pass"}
    sweep = "tests.gpu.test_ops::test_op_matches_the_float64_ref"
    for op in ("pack", "outer_merge_", "sparse", "fragment_norms", "quantized", "mask_indices"):
        assert f"{sweep}[{op}-n4097-fp32-offset0-cpu]" in passed, op
    for label in ("fp32", "fp32-bf16", "fp64", "fp64-bf16"):
        for off in (0, 1, 3, 5):
            assert f"{sweep}[pack-n4097-{label}-offset{off}-cpu]" in passed
    for op in (
        "pack",
        "outer_merge_",
        "mask_indices",
        "sparse_gather",
        "sparse_scatter_merge_",
        "fragment_norms",
    ):
        assert f"tests.gpu.test_registered_ops::test_opcheck_on_the_device[{op}-fp32-cpu]" in passed
    assert "tests.gpu.test_ops::test_pack_to_bf16_where_the_difference_overflows[cpu]" in passed
    assert "tests.gpu.test_ops::test_bf16_and_fp16_parameters_beside_a_float32_master[cpu]" in passed
    assert "tests.gpu.test_topk::test_non_finite_chunks[cpu]" in passed
    # the GPU-only checks are reported as skipped with their reason, never absent
    for test in (
        "test_ops::test_past_2_31_elements[pack-cpu]",
        "test_ops::test_every_op_on_a_second_device[cpu]",
        "test_registered_ops::test_compiled_fullgraph_matches_eager",
    ):
        c = cases[f"tests.gpu.{test}"]
        assert c["status"] == "skip" and c["detail"], test
    # none for time: the dry run fits its budget
    assert not [t for t, c in cases.items() if c["detail"].startswith("time budget")]
    # the ops' own GPU tests are collected and skip without a GPU
    ops_gpu = [c for t, c in cases.items() if t.startswith("tests.ops.")]
    assert ops_gpu and all(c["status"] == "skip" and c["detail"] for c in ops_gpu)


@pytest.mark.slow
def test_runtime_tests_match_the_simulator_on_the_cpu(dry_run):
    _, out = dry_run
    cases = _cases(out)
    rt = "tests.gpu.test_runtime"
    for strategy in ("diloco", "streaming", "cocodc", "loscar"):
        assert cases[f"{rt}::test_one_rank_matches_the_simulator[{strategy}]"]["status"] == "pass"
        for rank in (0, 1):
            assert cases[f"{rt}::test_two_ranks_match_the_simulator[{strategy}-{rank}]"]["status"] == "pass"
    for strategy in ("diloco", "streaming"):
        assert cases[f"{rt}::test_one_rank_fsdp2_matches_the_simulator[{strategy}]"]["status"] == "pass"
    sync = [c for t, c in cases.items() if t.startswith(f"{rt}::test_step_does_not_synchronise")]
    assert len(sync) == 3 and all(c["status"] == "skip" for c in sync)


@pytest.mark.slow
def test_overlap_measured(dry_run):
    _, out = dry_run
    ov = json.loads((out / "gpu_check.json").read_text())["overlap"]["overlap"]
    sd = ov["Streaming DiLoCo"]
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
    for title in ("### pytest -m gpu", "### Overlap", "### Bandwidth"):
        assert title in md
    for stage in STAGES:
        assert f"| {stage} |" in md
    assert "| tests.gpu.test_ops::test_op_matches_the_float64_ref |" in md
    for name in ("gpu_overlap.md", "gpu_bench.md"):
        assert (out / name).read_text().strip()
