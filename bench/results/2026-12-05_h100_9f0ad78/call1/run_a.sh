#!/usr/bin/env bash
# call 1: the 83778b1 norm change on the GPU (tests, memcheck, timing), then FLUX.3 and Krea 2 under regional compile
set -u
source .ab/prep.sh
t0=$(date +%s)
P="python3 -m pytest -q -p no:cacheprovider -p no:logging -rf"
(cd tests/python && timeout 200 $P test_launch_plans.py -k cuda > $OUT/pytest_plans.log 2>&1; echo "plans rc=$?" >> $OUT/rc.txt) &
(cd tests/python && timeout 200 $P test_norm.py -k "cuda and (adaln or gated_residual_norm)" > $OUT/pytest_norm_mod.log 2>&1; echo "norm_mod rc=$?" >> $OUT/rc.txt) &
(SANITIZE_TESTS="tests/python/test_norm.py" SANITIZE_SELECT="cuda and (adaln or gated_residual_norm) and layer" \
  SANITIZE_STRIDE=2 SANITIZE_OFFSET=0 SANITIZE_CHUNK=150 SANITIZE_TIMEOUT=190 PY=python3 \
  scripts/memcheck_ops.sh $OUT/memcheck_norm_mod.log > $OUT/memcheck_summary.txt 2>&1; echo "memcheck rc=$?" >> $OUT/rc.txt) &
wait
echo "tests wall $(( $(date +%s) - t0 )) s"; cat $OUT/rc.txt
for f in $OUT/pytest_*.log; do echo "== $f"; grep -E "^FAILED|passed|failed" $f | tail -5; done
echo "== memcheck"; cat $OUT/memcheck_summary.txt; grep -E "Invalid|ERROR SUMMARY: [1-9]" $OUT/memcheck_norm_mod.log | head -5
timeout 120 bash .ab/stage_wb.sh
echo "stage wall $(( $(date +%s) - t0 )) s"
MODELS="${MODELS:-flux3 krea-2}" PER_MODEL=${PER_MODEL:-150} VARIANTS=eager,patched,compile-regional,patched+compile-regional ADDMM= bash .ab/run2.sh 2>&1 | grep -v "^NVIDIA"
echo "total wall $(( $(date +%s) - t0 )) s"
