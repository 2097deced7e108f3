#!/usr/bin/env bash
# The main job (README): builds fusebox for the local GPU and runs `fusebox bench` with its
# default suite; arguments go to `fusebox bench`. Without a GPU it says so and exits.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PATH="$PATH:/usr/local/cuda/bin"
source scripts/setup_env.sh
export PATH="$(dirname "$FUSEBOX_PY"):$PATH"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')"
  FUSEBOX_CUDA_ARCHS="${FUSEBOX_CUDA_ARCHS:-$cap}" scripts/build.sh "$FUSEBOX_PY"
elif command -v nvcc >/dev/null 2>&1; then
  scripts/build.sh "$FUSEBOX_PY" >/dev/null || echo "[bench] build failed; the bench will explain"
fi
PYTHONPATH="$root/torch-ext" exec "$FUSEBOX_PY" -m fusebox bench "$@"
