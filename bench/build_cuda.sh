#!/usr/bin/env bash
# Build liblowcomm_cuda (csrc/cuda/*.cu) with nvcc, for sm_80 and sm_90 by default.
#
# Usage: bench/build_cuda.sh [BUILD_DIR] [--install]
#   BUILD_DIR   CMake build folder (default: build/cuda). The library is BUILD_DIR/liblowcomm_cuda.so
#               and its path is the last line printed.
#   --install   also copy the library into lowcomm_kernels/, where lowcomm_kernels._native.cuda_lib()
#               finds it (source checkouts and editable installs).
# Environment:
#   NVCC        the nvcc to use (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc, /usr/local/bin/nvcc)
#   CUDA_ARCHS  CMAKE_CUDA_ARCHITECTURES (default "80;90")
# Needs cmake >= 3.18; uses ninja when present. No GPU is needed to build (CI compiles with this).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir=""
install=0
for arg in "$@"; do
  case "$arg" in
    --install) install=1 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    -*) echo "build_cuda.sh: unknown option $arg" >&2; exit 2 ;;
    *) build_dir="$arg" ;;
  esac
done
build_dir="${build_dir:-$repo/build/cuda}"

nvcc="${NVCC:-}"
if [[ -z "$nvcc" ]]; then
  for cand in "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc /usr/local/bin/nvcc; do
    if [[ -n "$cand" && -x "$cand" ]]; then nvcc="$cand"; break; fi
  done
fi
if [[ -z "$nvcc" ]]; then
  echo "build_cuda.sh: nvcc not found (set NVCC=/path/to/nvcc)" >&2
  exit 1
fi

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi

cmake -S "$repo/csrc" -B "$build_dir" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DLOWCOMM_WITH_CUDA=ON \
  -DCMAKE_CUDA_COMPILER="$nvcc" \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-80;90}" >/dev/null
cmake --build "$build_dir" --target lowcomm_cuda -j "$(nproc 2>/dev/null || echo 2)"

lib="$build_dir/liblowcomm_cuda.so"
test -f "$lib"
if [[ "$install" == 1 ]]; then
  cp -f "$lib" "$repo/lowcomm_kernels/liblowcomm_cuda.so"
  lib="$repo/lowcomm_kernels/liblowcomm_cuda.so"
fi
echo "$lib"
