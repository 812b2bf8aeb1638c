#!/usr/bin/env bash
# The whole GPU check in one command, at most 8 minutes, on a machine with one NVIDIA GPU and no
# network (nothing is installed: the package is used from this source tree):
#   1. build    liblowcomm_cuda (bench/build_cuda.sh --install; sm_80, sm_90 and the GPU's own)  <= 90 s
#   2. pytest   `pytest -m gpu tests/gpu tests/ops`: the GPU tests (tests/gpu: every op x backend
#               (triton, cuda) x dtype (fp32, fp64, bf16 wire with fp32 and fp64 data) x buffer
#               offset (0, 1, 3, 5 elements), odd sizes, on a non-default stream, against the float64
#               *_ref; opcheck + compile on the GPU; the four strategies against the float64
#               simulator (one-rank NCCL group, two gloo ranks with CUDA tensors, FSDP2), host syncs
#               under set_sync_debug_mode; the top-k kernels' bits) and the ops' tests parametrized
#               on cuda                                                                          <= 230 s
#   3. overlap  Streaming DiLoCo's exposed communication over an emulated WAN on two ranks
#               (bench/gpu_overlap.py)                                                          <= 60 s
#   4. bench    every op's result checked against the ref, then its bandwidth against a device
#               copy of the same bytes at 64M elements (bench/gpu_bench.py)                     <= 90 s
# Every stage runs under `timeout`, and no stage starts past a 470 s deadline, so the whole script
# stays under 8 minutes. Results: pytest's junit report (pytest_gpu.xml), JSON and markdown of the
# other stages, plus gpu_check.json / gpu_check.md (all stages) and gpu.md (the GPU section of
# bench/RESULTS.md), in $OUT when set, else bench/results/; a short summary is printed.
#
# Usage: bash bench/gpu_check.sh [--dry-run] [gpu_bench.py options, e.g. --sizes 16M,64M]
#   --dry-run  on the CPU, so the script cannot rot unseen (tests/test_gpu_check.py runs it): no build
#              and no nvidia-smi; the GPU tests on the CPU (LOWCOMM_GPU_TESTS_DEVICE=cpu: the cpu
#              backend, gloo on CPU tensors; GPU-only tests skip with their reason); the overlap with
#              gloo on CPU tensors; the bench at a tiny size. Writes no gpu.md. About two minutes.
# Environment: PYTHON (default: .venv/bin/python if present, else python3); CUDA_ARCHS (build); OUT.
# Exit status: 0 every check passed (or no GPU here: says so); 1 a pytest or overlap run or a bench
# result check failed or timed out; 2 a GPU is present but torch cannot use it; 3 only the
# CUDA build failed (Triton is still checked); 4 only the bench's timing failed.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
results="${OUT:-$repo/bench/results}"  # resolved before the cd below: a relative $OUT is the caller's
mkdir -p "$results" && results="$(cd "$results" && pwd)" || exit 2
cd "$repo" || exit 2
dry=0
bench_args=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) bench_args+=("$arg") ;;
  esac
done
started=$(date +%s)
deadline=470  # seconds after start: no stage may run past it (timeout -k adds at most 5 s)
stages="$results/gpu_check_stages.tsv"
printf 'stage\trc\tseconds\tlimit\n' > "$stages"

say() { printf 'gpu_check: %s\n' "$*"; }
now() { echo $(( $(date +%s) - started )); }

python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$repo/.venv/bin/python" ]]; then python="$repo/.venv/bin/python"; else python="python3"; fi
fi
# A source checkout works without an install; an editable install resolves to the same files.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# run NAME CAP CMD...: CMD under `timeout`, at most CAP seconds and never past the deadline; its
# output goes to the terminal and to $results/NAME.log; one line per stage in $stages.
# The seconds granted are in $limit (set by `slot`) so a stage can be told its own budget.
slot() { limit=$(( $1 < deadline - $(now) ? $1 : deadline - $(now) )); }
run() {
  local name="$1" t0 rc
  shift
  if (( limit < 10 )); then
    say "$name: not started, the 8-minute deadline is near"
    printf '%s\t%s\t0\t%s\n' "$name" "deadline" "$limit" >> "$stages"
    return 124
  fi
  say "$name (limit ${limit} s, at $(now) s)"
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$results/$name.log"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" >> "$stages"
  if (( rc == 124 || rc == 137 )); then say "$name: TIMED OUT after ${limit} s"; fi
  return "$rc"
}
skip() { printf '%s\tskip\t0\t0\n' "$1" >> "$stages"; say "$1: skipped ($2)"; }

# ---- the machine ------------------------------------------------------------------------------
if (( dry )); then
  device=cpu
  say "DRY RUN on the CPU with $python (results in $results)"
else
  device=cuda
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    say "no GPU on this machine (nvidia-smi finds no NVIDIA device): nothing to check, exit 0"
    say "(bash bench/gpu_check.sh --dry-run runs the same scripts on the CPU)"
    exit 0
  fi
  nvidia-smi -L
  if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    say "a GPU is present but $python's torch cannot use it (a CPU-only torch build?):"
    "$python" -c 'import torch; print("  torch", torch.__version__, "cuda", torch.version.cuda)' || true
    say "set PYTHON to an interpreter with a CUDA build of torch; exit 2"
    exit 2
  fi
fi

# ---- 1. build ---------------------------------------------------------------------------------
backends="triton,cuda"  # named explicitly: a built library that fails to load is then an error
if (( dry )); then
  skip build "dry run; bench/build_cuda.sh parses: $(bash -n bench/build_cuda.sh && echo yes || echo NO)"
else
  cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')"
  archs="${CUDA_ARCHS:-80;90}"
  if [[ -n "$cc" && ";$archs;" != *";$cc;"* ]]; then archs="$archs;$cc"; fi
  slot 90
  if ! run build env CUDA_ARCHS="$archs" bash "$repo/bench/build_cuda.sh" "$repo/build/cuda" --install; then
    backends="triton"
    say "the CUDA build FAILED: the cuda backend is not checked; Triton still is"
  fi
fi

# ---- 2. pytest -m gpu ---------------------------------------------------------------------------
# SIGINT at the limit (pytest then still writes its report); tests not started 30 s before it skip.
slot $(( dry ? 300 : 230 ))  # a dry run has no build: its time goes to the slower CPU
if (( dry )); then
  gpu_env=(LOWCOMM_GPU_TESTS_DEVICE=cpu)
else
  gpu_env=(LOWCOMM_GPU_TESTS_BACKENDS="$backends")
fi
run pytest env "${gpu_env[@]}" LOWCOMM_GPU_TESTS_BUDGET_S=$(( limit - 30 )) timeout -s INT $(( limit - 5 )) \
  "$python" -m pytest -m gpu -q -rfEs -p no:cacheprovider -p no:xdist tests/gpu tests/ops \
  -o junit_family=xunit1 --junitxml="$results/pytest_gpu.xml"

# ---- 3. overlap -------------------------------------------------------------------------------
slot $(( dry ? 120 : 60 ))
run overlap "$python" bench/gpu_overlap.py --device "$device" --budget-s $(( limit - 15 )) \
  --json "$results/gpu_overlap.json" --md "$results/gpu_overlap.md"

# ---- 4. bench ---------------------------------------------------------------------------------
slot 90
bench_out=(--out-md "$results/gpu_bench.md" --out-json "$results/gpu_bench.json")
if (( dry )); then
  run bench "$python" bench/gpu_bench.py --device cpu --sizes 16K --max-reps 3 "${bench_out[@]}"
else
  run bench "$python" bench/gpu_bench.py --backends "$backends" --budget-s $(( limit - 20 )) \
    "${bench_out[@]}" ${bench_args[@]+"${bench_args[@]}"}
fi

# ---- report -----------------------------------------------------------------------------------
"$python" - "$results" "$dry" "$(now)" <<'PY'
"""Merge the stages' results into gpu_check.json / gpu_check.md (and gpu.md), print a summary,
and exit with the status the header of gpu_check.sh documents."""
import datetime as dt
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, dry, total = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
read = lambda name: (out / name).read_text() if (out / name).exists() else ""  # noqa: E731
load = lambda name: json.loads(read(name)) if read(name) else None  # noqa: E731
lines = read("gpu_check_stages.tsv").splitlines()[1:]
stages = {n: dict(rc=rc, seconds=int(s), limit=int(lim)) for n, rc, s, lim in (ln.split("\t") for ln in lines)}
rep = dict(dry_run=dry, seconds=total, when=f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
           overlap=load("gpu_overlap.json"), bench=load("gpu_bench.json"))
# pytest's junit report: the counts, and every test case (status, reason or failure, properties)
pytest = {}
if read("pytest_gpu.xml"):
    root = ET.fromstring(read("pytest_gpu.xml"))
    suite = root if root.tag == "testsuite" else root[0]
    pytest = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    cases = []
    for tc in suite.iter("testcase"):
        status, detail = "pass", ""
        for tag, name in (("failure", "FAIL"), ("error", "ERROR"), ("skipped", "skip")):
            el = tc.find(tag)
            if el is not None:
                status, detail = name, (el.get("message") or el.text or "")[:600]
                break
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        cases.append(dict(test=f"{tc.get('classname')}::{tc.get('name')}", status=status, detail=detail,
                          seconds=float(tc.get("time", 0)), properties=props))
    pytest["cases"] = cases
rep["pytest"] = pytest
for name in ("build", "pytest", "overlap", "bench"):
    st = stages.setdefault(name, dict(rc="missing", seconds=0, limit=0))
    rc = st["rc"]
    if rc == "skip":
        st["status"] = "skip"
    elif rc in ("124", "137"):
        st["status"] = "FAIL (timed out)"
    elif rc in ("deadline", "missing"):
        st["status"] = f"FAIL (not run: {rc})"
    elif name == "pytest" and not pytest.get("tests"):
        st["status"] = f"FAIL (exit {rc}: no test ran)"
    elif rc == "0":
        st["status"] = "pass"
    else:
        st["status"] = f"FAIL (exit {rc})"
untried = sum(c["detail"].startswith("time budget") for c in pytest.get("cases", []))
untried_bench = (rep["bench"] or {}).get("untimed", 0)
for name, n in (("pytest", untried), ("bench", untried_bench)):
    if n and stages[name]["status"] == "pass":
        stages[name]["status"] = f"pass, incomplete ({n} not started within the time budget)"
rep["stages"] = stages
bad = {n for n, s in stages.items() if s["status"].startswith("FAIL")}
bench_checks_failed = (rep["bench"] or {}).get("failed_checks", 1)
if bad - {"build", "bench"} or ("bench" in bad and bench_checks_failed):
    rep["exit"] = 1
else:
    rep["exit"] = 3 if "build" in bad else 4 if "bench" in bad else 0


def pytest_md(pt: dict) -> str:
    """Per test function: passed / failed / skipped; the skip reasons; the failures; the notes."""
    if not pt:
        return ""
    md = [f"`pytest -m gpu tests/gpu tests/ops`: {pt['tests']} tests, {pt['failures']} failed, "
          f"{pt['errors']} errors, {pt['skipped']} skipped.", "",
          "| test | pass | fail | skip |", "| --- | --- | --- | --- |"]
    count: dict = {}
    for c in pt["cases"]:
        fn = c["test"].split("[")[0]
        k = count.setdefault(fn, {"pass": 0, "fail": 0, "skip": 0})
        k["pass" if c["status"] == "pass" else "skip" if c["status"] == "skip" else "fail"] += 1
    md += [f"| {fn} | {k['pass']} | {k['fail']} | {k['skip']} |" for fn, k in count.items()]
    reasons: dict = {}
    for c in pt["cases"]:
        if c["status"] == "skip":
            reasons[c["detail"]] = reasons.get(c["detail"], 0) + 1
    if reasons:
        md += ["", "Skipped:", ""] + [f"- {n} x {r}" for r, n in sorted(reasons.items())]
    fails = [c for c in pt["cases"] if c["status"] in ("FAIL", "ERROR")]
    if fails:
        md += ["", "Failures:", ""] + [f"- {c['test']}: {' '.join(c['detail'].split())[:300]}" for c in fails[:40]]
    notes = sorted({f"{k[6:]}: {v}" for c in pt["cases"] for k, v in c["properties"].items()
                    if k.startswith("note: ")})
    if notes:
        md += ["", "Notes (not failures):", ""] + [f"- {n}" for n in notes[:40]]
    return "\n".join(md)


device = (rep["overlap"] or {}).get("device", "?")
md = [("**DRY RUN on the CPU** (`bash bench/gpu_check.sh --dry-run`): a test of the scripts, not a GPU "
       "measurement.\n\n" if dry else "") +
      f"GPU check of {rep['when']} on {device} (`bash bench/gpu_check.sh`): {total} s in all, exit {rep['exit']}.",
      "", "| stage | result | seconds | limit |", "| --- | --- | --- | --- |"]
md += [f"| {n} | {s['status']} | {s['seconds']} | {s['limit']} |" for n, s in stages.items()]
for title, body in (("pytest -m gpu", pytest_md(pytest)), ("Overlap", read("gpu_overlap.md")),
                    ("Bandwidth", read("gpu_bench.md"))):
    md += ["", f"### {title}", "", body.strip() or "(no report: see the stage's log)"]
text = "\n".join(md) + "\n"
(out / "gpu_check.md").write_text(text)
(out / "gpu_check.json").write_text(json.dumps(rep, indent=1))
if not dry:
    (out / "gpu.md").write_text(text)  # the GPU section of bench/RESULTS.md (render_results.py)
print("\n".join(md[:len(stages) + 4]))
print(f"gpu_check: wrote {out}/gpu_check.md and gpu_check.json; exit {rep['exit']}")
sys.exit(rep["exit"])
PY
rc=$?
if (( !dry )) && [[ "$results" == "$repo/bench/results" && -f "$results/ops.json" ]]; then
  "$python" "$repo/bench/render_results.py" || say "render_results.py failed (gpu.md is still written)"
fi
exit "$rc"
