"""pytest configuration of the CPU microbenchmark suite (bench_ops.py).

Run (from the repository root; the JSON is committed, bench/RESULTS.md is rendered from it):
    OMP_WAIT_POLICY=ACTIVE .venv/bin/python -m pytest -q bench/bench_ops.py \
        --benchmark-json bench/figures/ops.json
CI smoke (one tiny size, proves the suite and the renderer work end to end):
    LOWCOMM_BENCH_SIZES=64K .venv/bin/python -m pytest bench/bench_ops.py --benchmark-json /tmp/ops.json
    (or ``--quick``; ``--bench-sizes=1M,16M`` overrides both).

The JSON keeps each row's statistics, not its per-round times (``--benchmark-save-data`` keeps
them): the interleaved rows' per-round ratios, which the verdicts need, are in their extra_info.

Sizes come from ``--bench-sizes``, else ``LOWCOMM_BENCH_SIZES`` (a benchmark knob, read only in
bench/), else 1M,16M,64M fp32 elements. Threads: ``--bench-threads`` (default 2: the target
machine has 2 cores; the native library's OpenMP regions follow torch.set_num_threads because
both share the one libgomp that torch loads).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads  # noqa: E402  (bench/ is not a package)

QUICK_SIZES = "64K"
IMPLS = ("memcpy_nt", "torch_copy", "ref", "compile", "fused")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lowcomm bench")
    group.addoption("--bench-sizes", default=None,
                    help=f"comma-separated fp32 element counts, e.g. 1M,16M,64M "
                         f"(default {workloads.DEFAULT_SIZES}, or ${workloads.SIZES_ENV})")
    group.addoption("--quick", action="store_true", help=f"CI smoke run: only {QUICK_SIZES} elements")
    group.addoption("--bench-threads", type=int, default=2, help="torch / OpenMP threads (default 2)")


def bench_sizes(config: pytest.Config) -> list[int]:
    text = config.getoption("--bench-sizes")
    if text:
        return [workloads.parse_size(p) for p in text.split(",") if p.strip()]
    if config.getoption("--quick"):
        return [workloads.parse_size(QUICK_SIZES)]
    return workloads.sizes_from_env()


def pytest_configure(config: pytest.Config) -> None:
    threads = config.getoption("--bench-threads")
    if threads < 1:
        raise pytest.UsageError(f"--bench-threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    out = config.getoption("benchmark_json", None)  # pytest-benchmark writes it at the very end and
    if out is not None:  # fails there, after the whole run, when its folder does not exist
        Path(out).resolve().parent.mkdir(parents=True, exist_ok=True)
    config._lowcomm_notes = []  # type: ignore[attr-defined]  # skipped rows, with the reason
    config._lowcomm_load_start = os.getloadavg()  # type: ignore[attr-defined]


def _row_cases(metafunc: pytest.Metafunc) -> None:
    cases, ids = [], []
    # Workload-major, then size, then implementation: the five rows of one (op, size) run back to
    # back on the same buffers, so their ratios compare like with like on a noisy shared machine.
    for w in workloads.WORKLOADS:
        for n in bench_sizes(metafunc.config):
            for impl in IMPLS:
                cases.append((w, n, impl))
                ids.append(f"{w.name}-{workloads.size_label(n)}-{impl}")
    metafunc.parametrize("case", cases, ids=ids)


def _interleaved_cases(metafunc: pytest.Metafunc) -> None:
    sizes = bench_sizes(metafunc.config)
    # The targets are defined at >= 16M; a smoke run (only small sizes) still exercises the code.
    big = [n for n in sizes if n >= 16 << 20] or sizes[:1]
    cases = [(w, n) for w in workloads.WORKLOADS if w.target for n in big]
    metafunc.parametrize("icase", cases, ids=[f"{w.name}-{workloads.size_label(n)}" for w, n in cases])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "icase" in metafunc.fixturenames:
        _interleaved_cases(metafunc)
    if "case" in metafunc.fixturenames:
        _row_cases(metafunc)


@pytest.fixture(scope="session", autouse=True)
def _warm_machine() -> None:
    """~1 s of the kinds of work the suite times (a parallel torch op, the nt copy), before the
    first row: the first rows of a fresh process otherwise pay the OpenMP pool's start-up and the
    CPU's wake-up, and the first group's memcpy row is the denominator of its percentages."""
    a = torch.ones(4 << 20)
    b = torch.empty_like(a)
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:
        torch.add(a, a, out=b)
        if workloads.nt_copy_available():
            workloads.cpu_copy_nt(b, a)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return ""
    return " ".join(f for f in ("avx2", "fma", "avx512f", "avx512bw") if f in flags)


def _versions() -> dict[str, str]:
    import lowcomm_kernels
    from lowcomm_kernels import _native

    out = {"torch": torch.__version__, "python": platform.python_version(),
           "lowcomm_kernels": getattr(lowcomm_kernels, "__version__", "?")}
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception:  # triton is optional on CPU
        out["triton"] = "not importable"
    lib = _native.cpu_lib()
    if lib is not None and hasattr(lib, "lc_version"):
        import ctypes
        lib.lc_version.restype = ctypes.c_char_p
        out["native"] = lib.lc_version().decode()
    else:
        out["native"] = "not loaded"
    try:
        import subprocess
        here = Path(__file__).resolve().parent
        out["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=here, timeout=10).stdout.strip()
        # tracked files changed since that revision: the figures then come from code no commit holds
        status = ["git", "status", "--porcelain", "--untracked-files=no"]
        changed = subprocess.run(status, capture_output=True, text=True, cwd=here, timeout=10).stdout
        out["git_dirty_files"] = len(changed.splitlines())
    except Exception:
        out["git"] = "?"
    return out


# Environment that changes what is measured; echoed in front of the command in RESULTS.md.
RECORDED_ENV = (workloads.SIZES_ENV, "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS",
                "LOWCOMM_BACKEND",
                "LOWCOMM_NATIVE_LIB")


def _command(config: pytest.Config) -> str:
    prefix = "".join(f"{k}={os.environ[k]} " for k in RECORDED_ENV if os.environ.get(k))
    return prefix + ".venv/bin/python -m pytest " + " ".join(config.invocation_params.args)


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    machine_info["lowcomm"] = {
        "cpu_model": _cpu_model(), "cpu_flags": _cpu_flags(), "logical_cpus": os.cpu_count(),
        "threads": torch.get_num_threads(), "loadavg_start": list(config._lowcomm_load_start),  # type: ignore
        "versions": _versions(),
        "memcpy": "lc_copy_nt (non-temporal stores)" if workloads.nt_copy_available()
                  else "MISSING lc_copy_nt: torch copy_ fallback",
    }


def pytest_benchmark_update_json(config: pytest.Config, benchmarks: list, output_json: dict) -> None:
    if not config.getoption("benchmark_save_data", False):
        for b in output_json.get("benchmarks", []):  # --benchmark-json writes every round's time;
            (b.get("stats") or {}).pop("data", None)  # the committed JSON keeps the statistics only
    output_json["lowcomm"] = {
        "command": _command(config),
        "sizes": [workloads.size_label(n) for n in bench_sizes(config)],
        "loadavg_end": list(os.getloadavg()),
        "notes": list(config._lowcomm_notes),  # type: ignore[attr-defined]
        "workloads": {
            w.name: {"op": w.op, "note": w.note, "target": w.target, "target_pct": w.target_pct,
                     "no_target": w.no_target}
            for w in workloads.WORKLOADS
        },
    }
