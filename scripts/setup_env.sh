#!/usr/bin/env bash
# Creates (or reuses) the Python environment fusebox builds and tests in.
# The environment lives outside the checkout so a fresh clone reuses it; its
# name carries a hash of the requirements, so changing them makes a new one.
# Usage: source scripts/setup_env.sh   (exports FUSEBOX_PY)
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_req="$_root/requirements-dev.txt"
_hash="$(sha256sum "$_req" | cut -c1-12)"
_venv="${FUSEBOX_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/fusebox/venv-$_hash}"
if [ ! -x "$_venv/bin/python" ] || [ ! -f "$_venv/.complete" ]; then
  echo "[setup] creating $_venv (first run downloads torch, a few GB)"
  rm -rf "$_venv"
  python3 -m venv "$_venv"
  "$_venv/bin/python" -m pip install -q --upgrade pip
  "$_venv/bin/python" -m pip install -q -r "$_req"
  touch "$_venv/.complete"
fi
export FUSEBOX_PY="$_venv/bin/python"
echo "[setup] python: $FUSEBOX_PY ($("$FUSEBOX_PY" -c 'import torch; print("torch", torch.__version__)'))"
