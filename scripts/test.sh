#!/usr/bin/env bash
# The test command (README): installs what is missing, builds everything from scratch, then
# runs the C++ tests (CTest) and the Python tests (pytest). CUDA tests run when a GPU is
# present and are skipped otherwise.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] || {
  echo "fusebox: the CUDA toolkit (nvcc) is required to build; install it first" >&2; exit 1; }
export PATH="$PATH:/usr/local/cuda/bin"
if [ ! -f /usr/include/gtest/gtest.h ] && [ -z "${FUSEBOX_GTEST_SOURCE_DIR:-}" ]; then
  echo "[test] installing GoogleTest (libgtest-dev)"
  apt-get update -qq && apt-get install -y -qq libgtest-dev cmake >/dev/null
fi

source scripts/setup_env.sh
export PATH="$(dirname "$FUSEBOX_PY"):$PATH"  # the environment's cmake and ninja
export FUSEBOX_BUILD_DIR="${FUSEBOX_BUILD_DIR:-$root/build/test}"
rm -rf "$FUSEBOX_BUILD_DIR"
start=$(date +%s)
scripts/build.sh "$FUSEBOX_PY"
echo "[test] build took $(( $(date +%s) - start )) s"

(cd "$FUSEBOX_BUILD_DIR" && ctest --output-on-failure)
PYTHONPATH="$root/torch-ext" "$FUSEBOX_PY" -m pytest tests/python -q -p no:cacheprovider "$@"
