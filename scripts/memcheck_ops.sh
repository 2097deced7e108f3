#!/usr/bin/env bash
# The CUDA op tests under compute-sanitizer memcheck, a few hundred tests a process: one
# sanitized process over the whole suite grows its device memory until allocations fail
# (after ~400-1500 tests on an H200 / H100), which then reads as test failures.
# Usage: scripts/memcheck_ops.sh LOG   (appends every process's output to LOG; prints one summary line)
# Exit: 0 when every test ran and passed clean; 124 when SANITIZE_TIMEOUT stopped it first with
# nothing failed; 1 otherwise.
# Env: PY (default python3), SANITIZE_CHUNK (tests a process; default 250),
#      SANITIZE_STRIDE / SANITIZE_OFFSET (run every Nth case of each test function from the
#      Kth, K < N; default 1 / 0: all),
#      SANITIZE_TIMEOUT (seconds for all of it; no new process starts after it; default 420),
#      SANITIZE_JOBS (sanitized processes side by side; default 1),
#      SANITIZE_TESTS (default: the norm, rope, activation and MoE test files),
#      SANITIZE_SELECT (the pytest -k expression; default: cuda).
set -uo pipefail
log="${1:?usage: memcheck_ops.sh LOG}"
py="${PY:-python3}"
chunk="${SANITIZE_CHUNK:-250}"
stride="${SANITIZE_STRIDE:-1}"
offset="${SANITIZE_OFFSET:-0}"
budget="${SANITIZE_TIMEOUT:-420}"
select="${SANITIZE_SELECT:-cuda}"
# shellcheck disable=SC2206
files=(${SANITIZE_TESTS:-tests/python/test_norm.py tests/python/test_rope.py tests/python/test_activation.py tests/python/test_moe.py})
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
: >"$log"

"$py" -m pytest "${files[@]}" -q -p no:cacheprovider -k "$select" -m "not large" --collect-only 2>/dev/null \
  | grep '::' | awk -v s="$stride" -v o="$offset" '{f = $0; sub(/\[.*/, "", f); if ((n[f]++) % s == o) print}' >"$work/ids"
selected=$(wc -l <"$work/ids")
mkdir "$work/chunks" "$work/runs"
split -l "$chunk" "$work/ids" "$work/chunks/"

# One sanitized pytest process over a chunk of test ids; its output and exit status in runs/.
run_chunk() {  # chunk file, seconds left
  local ids run="$work/runs/${1##*/}"; mapfile -t ids <"$1"
  timeout "$2" compute-sanitizer --tool memcheck --error-exitcode 9 --target-processes all \
    "$py" -m pytest "${ids[@]}" -q -p no:cacheprovider -rf >"$run.out" 2>&1
  echo $? >"$run.status"
}

# SANITIZE_JOBS chunks at a time, side by side on the GPU.
start=$(date +%s); jobs_max="${SANITIZE_JOBS:-1}"
for part in "$work"/chunks/*; do
  [ -f "$part" ] || break  # none: no test selected
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
  left=$(( budget - ($(date +%s) - start) ))
  [ "$left" -le 10 ] && break
  run_chunk "$part" "$left" &
done
wait

passed=0; failed=0; errors=0; processes=0; ran=0; rc=0
for part in "$work"/chunks/*; do
  run="$work/runs/${part##*/}"
  [ -f "$run.status" ] || continue  # never started: the budget ran out first
  status=$(cat "$run.status")
  cat "$run.out" >>"$log"
  processes=$((processes + 1))
  [ "$status" -ne 0 ] && [ "$status" -ne 124 ] && rc=1
  [ "$status" -ne 124 ] && ran=$((ran + $(wc -l <"$part")))  # a process the budget cut did not run all its tests
  p=$(grep -oE '[0-9]+ passed' "$run.out" | tail -1 | cut -d' ' -f1)
  f=$(grep -oE '[0-9]+ failed' "$run.out" | tail -1 | cut -d' ' -f1)
  e=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$run.out" | awk '{s += $3} END {print s + 0}')
  passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0})); errors=$((errors + e))
done
{ [ "$failed" -gt 0 ] || [ "$errors" -gt 0 ]; } && rc=1  # also those of a process the budget cut
[ "$selected" -eq 0 ] && rc=1  # no CUDA test collected
[ "$ran" -gt 0 ] && [ "$passed" -eq 0 ] && rc=1  # processes finished, none of it ran on a GPU
# Not all run within the time budget, nothing failed: 124, as `timeout` (TIME in gpu_check.sh).
[ "$rc" -eq 0 ] && [ "$ran" -lt "$selected" ] && rc=124
echo "$passed passed, $failed failed, $errors memcheck errors; $ran of $selected tests (case ${offset} mod ${stride} of each CUDA op test) in $processes processes, $(( $(date +%s) - start )) s"
exit "$rc"
