#!/usr/bin/env bash
# The whole GPU check in one call, on a machine with an NVIDIA GPU (about 5-8 minutes):
#   1. build liblowcomm_cuda from csrc/cuda (bench/build_cuda.sh --install; sm_80, sm_90 and the
#      GPU's own architecture);
#   2. correctness: the Triton and CUDA backends against the *_ref specification, fp32, bf16 and
#      fp64, odd sizes (bench/gpu_correctness.py);
#   3. timing: every op per backend against a device copy of the same bytes, CUDA events
#      (bench/gpu_bench.py);
# and writes bench/results/gpu.md (+ gpu.json, gpu_correctness.json), then re-renders
# bench/RESULTS.md when the CPU suite's bench/results/ops.json is present.
#
# Usage: bash bench/gpu_check.sh [gpu_bench.py options, e.g. --compile or --sizes 16M,64M]
# Environment: PYTHON (default: .venv/bin/python if present, else python3); CUDA_ARCHS (build).
# Exit status: 0 all checks passed, or no GPU on this machine (says so); 1 a correctness check
# failed; 2 a GPU is present but torch cannot use it; 3 the CUDA library did not build (Triton is
# still checked and timed); 4 the timing step failed.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo" || exit 2
results="$repo/bench/results"
started=$(date +%s)

say() { printf 'gpu_check: %s\n' "$*"; }
elapsed() { echo "$(( $(date +%s) - started )) s"; }

# ---- is there a GPU at all? ------------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  say "no GPU on this machine (nvidia-smi finds no NVIDIA device): nothing to check, exit 0"
  exit 0
fi
nvidia-smi -L

python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$repo/.venv/bin/python" ]]; then python="$repo/.venv/bin/python"; else python="python3"; fi
fi
# A source checkout works without an install; an editable install resolves to the same files.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  say "a GPU is present but $python's torch cannot use it (a CPU-only torch build?):"
  "$python" -c 'import torch; print("  torch", torch.__version__, "cuda", torch.version.cuda)' || true
  say "set PYTHON to an interpreter with a CUDA build of torch; exit 2"
  exit 2
fi

# ---- 1. build -------------------------------------------------------------------------------
cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')"
archs="${CUDA_ARCHS:-80;90}"
if [[ -n "$cc" && ";$archs;" != *";$cc;"* ]]; then archs="$archs;$cc"; fi
build_rc=0
backends="triton,cuda"  # named explicitly: a built library that fails to load is then an error
say "building liblowcomm_cuda for sm {$archs} ($(elapsed))"
if ! CUDA_ARCHS="$archs" timeout 240 bash "$repo/bench/build_cuda.sh" "$repo/build/cuda" --install; then
  build_rc=3
  backends="triton"
  say "the CUDA build FAILED: the cuda backend is not checked; Triton still is"
fi

# ---- 2. correctness -------------------------------------------------------------------------
mkdir -p "$results"
say "correctness ($(elapsed))"
timeout 240 "$python" "$repo/bench/gpu_correctness.py" --backends "$backends" --json "$results/gpu_correctness.json" \
  --md "$results/gpu_correctness.md"
correct_rc=$?
if [[ $correct_rc -ne 0 ]]; then say "correctness FAILED (exit $correct_rc): see above"; fi

# ---- 3. timing ------------------------------------------------------------------------------
say "timing ($(elapsed))"
timeout 300 "$python" "$repo/bench/gpu_bench.py" --correctness-md "$results/gpu_correctness.md" \
  --backends "$backends" --out-md "$results/gpu.md" --out-json "$results/gpu.json" "$@"
bench_rc=$?
if [[ $bench_rc -ne 0 ]]; then say "timing FAILED (exit $bench_rc)"; fi

if [[ -f "$results/ops.json" && -f "$results/gpu.md" ]]; then
  "$python" "$repo/bench/render_results.py" || say "render_results.py failed (gpu.md is still written)"
elif [[ -f "$results/gpu.md" ]]; then
  say "wrote bench/results/gpu.md; bench/RESULTS.md includes it at the next render_results.py run"
fi

say "done in $(elapsed): build rc=$build_rc, correctness rc=$correct_rc, timing rc=$bench_rc"
if [[ $correct_rc -ne 0 ]]; then exit 1; fi
if [[ $build_rc -ne 0 ]]; then exit 3; fi
if [[ $bench_rc -ne 0 ]]; then exit 4; fi
exit 0
