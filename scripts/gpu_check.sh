#!/usr/bin/env bash
# GPU proof in one call: builds against the torch installed on the GPU machine, runs the C++
# and Python suites on CUDA, runs them again under compute-sanitizer memcheck, optionally runs
# the benchmark, and prints a pass/fail table last.
# Usage: scripts/gpu_check.sh [stages...]   stages: test sanitize tune bench quick e2e (default: test sanitize)
# Env: OUT (where logs and results go; default ./gpu_out), PY (default python3),
#      PYTEST_PATHS (the test stage's selection; default tests/python), GPU_TEST_SHARDS (pytest processes
#      side by side on the GPU, each every n-th test; default 1),
#      TUNE_CASES / TUNE_SETTINGS / TUNE_DTYPES (the tune stage: scripts/tune.py --cases / --settings,
#      once per dtype, default bf16),
#      SANITIZE_TIMEOUT / SANITIZE_CHUNK / SANITIZE_STRIDE / SANITIZE_OFFSET (the memcheck pytest
#      run: scripts/memcheck_ops.sh),
#      GPU_CHECK_SECONDS (a time budget for the whole script: each stage then runs under `timeout`
#      with what is left, a stage that gets under 15 s is skipped, one the budget stops shows
#      TIME, and the summary and archive are still written), FUSEBOX_CUDA_ARCHS (default: the GPU's),
#      PREBUILT (an operator library to use instead of building; see below),
#      .whl/ wheels are installed to /tmp/site if present,
#      .gtest/ (a GoogleTest source tree) is used when the machine has no GoogleTest package.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(test sanitize)
out="${OUT:-$root/gpu_out}"
mkdir -p "$out"
py="${PY:-python3}"
export PATH="$PATH:/usr/local/cuda/bin"
export PYTHONUNBUFFERED=1
declare -a summary
script_start=$(date +%s)

# Seconds left of GPU_CHECK_SECONDS (a large number without one).
seconds_left() {
  if [ -n "${GPU_CHECK_SECONDS:-}" ]; then echo $(( GPU_CHECK_SECONDS - ($(date +%s) - script_start) )); else echo 999999; fi
}
# Runs a command under the time left (exit 124 when it ran out). At least 1 s: `timeout 0`
# would mean no limit at all.
bounded() {
  local left; left=$(seconds_left)
  [ "$left" -lt 1 ] && left=1
  timeout "$left" "$@"
}

# PASS, FAIL, or TIME when `bounded` stopped the stage (exit 124: the budget ran out).
verdict() { case "$1" in 0) echo PASS ;; 124) echo TIME ;; *) echo FAIL ;; esac; }

record() {  # name, status, detail
  summary+=("$(printf '| %-34s | %-4s | %s |' "$1" "$2" "$3")")
}

if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
[ -d .gtest ] && [ ! -f /usr/include/gtest/gtest.h ] && export FUSEBOX_GTEST_SOURCE_DIR="$root/.gtest"
# Build with the system compiler: a toolchain that links its own static libstdc++ into the
# module gives it a second, uninitialized locale (iostream formatting then crashes).
if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')"
export FUSEBOX_CUDA_ARCHS="${FUSEBOX_CUDA_ARCHS:-$cap}"
export FUSEBOX_BUILD_DIR="$root/build/gpu"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"

t0=$(date +%s)
# PREBUILT: an operator library built elsewhere for this GPU against the same torch and CUDA; where
# it loads and runs, the build is skipped (the C++ test binary's stages then show SKIP); where
# not, prebuilt.log says why and the build runs as usual.
# (importing fusebox tolerates a library that fails to load; the explicit load raises instead)
prebuilt_check='import torch, fusebox
torch.ops.load_library("torch-ext/fusebox/_fusebox_C.so")
x = torch.randn(3, 200, device="cuda", dtype=torch.bfloat16)
assert torch.allclose(fusebox.rms_norm(x, None).float(), torch.nn.functional.rms_norm(x.float(), (200,)), atol=0.02)'
if [ -n "${PREBUILT:-}" ] && cp "$PREBUILT" torch-ext/fusebox/_fusebox_C.so \
  && PYTHONPATH="$root/torch-ext${PYTHONPATH:+:$PYTHONPATH}" "$py" -c "$prebuilt_check" >"$out/prebuilt.log" 2>&1; then
  record build PASS "prebuilt $(basename "$PREBUILT") loads"; prebuilt_used=1
elif bounded scripts/build.sh "$py" >"$out/build.log" 2>&1; then
  record build PASS "$(( $(date +%s) - t0 )) s, sm_$FUSEBOX_CUDA_ARCHS"
else
  tail -30 "$out/build.log"; record build FAIL "see build.log"; printf '%s\n' "${summary[@]}"; exit 1
fi
export PYTHONPATH="$root/torch-ext${PYTHONPATH:+:$PYTHONPATH}"
cpp_tests="$FUSEBOX_BUILD_DIR/fusebox_cpp_tests"

# "passed failed skipped" of a pytest -q log: from its summary line, or, where the time budget cut
# it off before one (status 124), from its progress marks.
pytest_counts() {
  local line marks
  line="$(grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|deselected)|no tests ran" "$1" | tail -1)"
  if [ "$2" -ne 124 ] && [ -n "$line" ]; then
    count() { grep -oE "[0-9]+ $1" <<<"$line" | cut -d' ' -f1 | awk '{s += $1} END {print s + 0}'; }
    echo "$(count passed) $(( $(count failed) + $(count error) )) $(count skipped)"
  else
    marks="$(grep -E '^[.sFEx]+( |$)' "$1" | cut -d' ' -f1 | tr -d '\n')"
    echo "$(tr -cd . <<<"$marks" | wc -c) $(tr -cd FE <<<"$marks" | wc -c) $(tr -cd s <<<"$marks" | wc -c)"
  fi
}

for stage in "${stages[@]}"; do
  if [ "$(seconds_left)" -lt 15 ]; then record "$stage" SKIP "no time left of GPU_CHECK_SECONDS"; continue; fi
  case "$stage" in
    test)
      t0=$(date +%s)
      if [ -n "${prebuilt_used:-}" ]; then
        record "C++ tests (CPU + CUDA vs CPU)" SKIP "no test binary (prebuilt library, nothing built here)"
      else
        bounded "$cpp_tests" --gtest_brief=1 >"$out/cpp_tests.log" 2>&1
        rc=$?; record "C++ tests (CPU + CUDA vs CPU)" "$(verdict $rc)" "$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/cpp_tests.log" | tr '\n' ' ') $(( $(date +%s) - t0 )) s"
      fi
      t0=$(date +%s)
      # GPU_TEST_SHARDS processes share the GPU side by side, each every n-th test
      # (tests/python/conftest.py), their counts summed. Each gets its share of the CPU cores for
      # torch's threads and compiles in-process: n processes that each take every core (and
      # inductor's pool of as many compile workers) mostly wait on one another. Test phases of a
      # second or more go to slow.<i>.txt.
      shards="${GPU_TEST_SHARDS:-1}"; pids=()
      shard_threads=$(( $(nproc) / shards )); [ "$shard_threads" -lt 1 ] && shard_threads=1
      for ((i = 0; i < shards; i++)); do
        if [ "$shards" -gt 1 ]; then shard_env=(OMP_NUM_THREADS=$shard_threads TORCHINDUCTOR_COMPILE_THREADS=1)
        else shard_env=(); fi
        # shellcheck disable=SC2086
        bounded env "${shard_env[@]}" FUSEBOX_TEST_SHARD="$i/$shards" FUSEBOX_SLOW_TEST_LOG="$out/slow.$i.txt" \
          "$py" -m pytest ${PYTEST_PATHS:-tests/python} -q -p no:cacheprovider \
          --maxfail=40 -rf --junitxml="$out/pytest.$i.xml" >"$out/pytest.$i.log" 2>&1 &
        pids+=($!)
      done
      rc=0; passed=0; failed=0; skipped=0
      for ((i = 0; i < shards; i++)); do
        wait "${pids[$i]}"; status=$?
        if [ $status -eq 124 ]; then [ $rc -eq 0 ] && rc=124; elif [ $status -ne 0 ]; then rc=1; fi
        read -r p f s <<<"$(pytest_counts "$out/pytest.$i.log" $status)"
        passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
        [ $status -ne 0 ] && [ $status -ne 124 ] && grep -E "^FAILED|Error" "$out/pytest.$i.log" | head -30
      done
      prefix=""; [ $rc -eq 124 ] && prefix="cut off: "
      record "pytest (CPU + CUDA)" "$(verdict $rc)" \
        "$prefix$passed passed, $failed failed, $skipped skipped in $shards process(es), $(( $(date +%s) - t0 )) s"
      ;;
    sanitize)
      t0=$(date +%s)
      if [ -n "${prebuilt_used:-}" ]; then
        record "memcheck: C++ CUDA tests" SKIP "no test binary (prebuilt library, nothing built here)"
      else
        bounded compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 "$cpp_tests" \
          --gtest_filter='CudaVsCpu.*' >"$out/sanitizer_cpp.log" 2>&1
        rc=$?; record "memcheck: C++ CUDA tests" "$(verdict $rc)" "$(grep -E 'ERROR SUMMARY' "$out/sanitizer_cpp.log" | tail -1), $(( $(date +%s) - t0 )) s"
      fi
      t0=$(date +%s)
      budget=$(( $(seconds_left) - 5 )); [ "$budget" -gt "${SANITIZE_TIMEOUT:-420}" ] && budget="${SANITIZE_TIMEOUT:-420}"
      line="$(PY="$py" SANITIZE_TIMEOUT="$budget" scripts/memcheck_ops.sh "$out/sanitizer_py.log")"
      rc=$?; record "memcheck: pytest CUDA op tests" "$(verdict $rc)" "$line"
      ;;
    tune)
      t0=$(date +%s); rc=0; : >"$out/tune.txt"
      for dtype in ${TUNE_DTYPES:-bf16}; do
        echo "== $dtype" | tee -a "$out/tune.txt"
        bounded "$py" scripts/tune.py --cases "${TUNE_CASES:?TUNE_CASES}" --settings "${TUNE_SETTINGS:-default}" \
          --dtype "$dtype" 2>&1 | tee -a "$out/tune.txt"
        status=${PIPESTATUS[0]}; [ "$status" -eq 0 ] || rc=$status  # 124: the budget ran out
      done
      record "tune.py" "$(verdict $rc)" "$(( $(date +%s) - t0 )) s"
      ;;
    bench|quick)
      t0=$(date +%s)
      args=(); [ "$stage" = quick ] && args=(--quick)
      # shellcheck disable=SC2206
      args+=(${BENCH_ARGS:-})
      bounded "$py" -m fusebox bench "${args[@]}" --out "$out/bench" 2>&1 | tee "$out/bench.log" | tail -60
      rc=${PIPESTATUS[0]}; record "fusebox bench ${args[*]}" "$(verdict $rc)" "$(( $(date +%s) - t0 )) s"
      ;;
    e2e)
      # End-to-end models (E2E_MODELS, comma-separated; E2E_ARGS e.g. --quick).
      t0=$(date +%s)
      # shellcheck disable=SC2206
      eargs=(${E2E_ARGS:-})
      bounded "$py" -m fusebox bench e2e --model "${E2E_MODELS:-tiny}" "${eargs[@]}" --out "$out/e2e" 2>&1 | tee "$out/e2e.log" | tail -80
      rc=${PIPESTATUS[0]}; record "fusebox bench e2e ${E2E_MODELS:-tiny}" "$(verdict $rc)" "$(( $(date +%s) - t0 )) s"
      ;;
  esac
done

echo
echo "| check                              | ok   | detail |"
echo "|------------------------------------|------|--------|"
printf '%s\n' "${summary[@]}" | tee "$out/summary.md"
# Everything in one archive (the summary stays beside it).
tar czf "$root/gpu_run.tgz" -C "$out" . && mv "$root/gpu_run.tgz" "$out/gpu_run.tgz"
find "$out" -mindepth 1 ! -name gpu_run.tgz ! -name summary.md -exec rm -rf {} + 2>/dev/null || true
