#!/usr/bin/env bash
# Builds the core library, the C++ tests and the PyTorch operator library, and places the
# operator library next to the Python package (torch-ext/fusebox) for in-tree use.
# Usage: scripts/build.sh [python]   (python: the interpreter whose torch to build against)
# Env: FUSEBOX_CUDA_ARCHS (default "75;80;89;90"), FUSEBOX_BUILD_DIR (default build),
#      FUSEBOX_GTEST_SOURCE_DIR (build GoogleTest from this source tree).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${1:-${FUSEBOX_PY:-python3}}"
build="${FUSEBOX_BUILD_DIR:-$root/build}"
archs="${FUSEBOX_CUDA_ARCHS:-75;80;89;90}"
extra=()
[ -n "${FUSEBOX_GTEST_SOURCE_DIR:-}" ] && extra+=("-DFUSEBOX_GTEST_SOURCE_DIR=$FUSEBOX_GTEST_SOURCE_DIR")
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
mkdir -p "$build"
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="$archs" -DFUSEBOX_BUILD_TESTS=ON -DFUSEBOX_BUILD_TORCH=ON \
  -DPython_EXECUTABLE="$(command -v "$py")" "${extra[@]}" >"$build/configure.log" 2>&1 \
  || { cat "$build/configure.log"; exit 1; }
cmake --build "$build" -j"$(nproc)"
cp "$build"/_fusebox_C*.so "$root/torch-ext/fusebox/"
echo "[build] $(ls "$root"/torch-ext/fusebox/_fusebox_C*.so)"
