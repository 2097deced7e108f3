#!/usr/bin/env bash
# one call: GPU tests + memcheck in parallel, then two e2e models, then adaln at CogVideoX's shape
set -u
source .ab/prep.sh
t0=$(date +%s)
P="python3 -m pytest -q -p no:cacheprovider -p no:logging -rf"
(cd tests/python && timeout 250 $P test_compile.py -k cuda > $OUT/pytest_compile.log 2>&1; echo "compile rc=$?" >> $OUT/rc.txt) &
(cd tests/python && timeout 250 $P test_patch_llm.py -k cuda > $OUT/pytest_llm.log 2>&1; echo "llm rc=$?" >> $OUT/rc.txt) &
(cd tests/python && timeout 250 $P test_patch_dit_image.py test_patch_dit_video.py -k cuda > $OUT/pytest_dit.log 2>&1; echo "dit rc=$?" >> $OUT/rc.txt) &
(SANITIZE_TESTS="tests/python/test_patch_dit_image.py tests/python/test_patch_dit_video.py" SANITIZE_SELECT="cuda and not compile" \
  SANITIZE_STRIDE=3 SANITIZE_OFFSET=0 SANITIZE_CHUNK=32 SANITIZE_TIMEOUT=245 PY=python3 \
  scripts/memcheck_ops.sh $OUT/memcheck_dit.log > $OUT/memcheck_summary.txt 2>&1; echo "memcheck rc=$?" >> $OUT/rc.txt) &
wait
echo "tests wall $(( $(date +%s) - t0 )) s"; cat $OUT/rc.txt
for f in $OUT/pytest_*.log; do echo "== $f"; grep -E "^FAILED|passed|failed" $f | tail -5; done
echo "== memcheck"; cat $OUT/memcheck_summary.txt; grep -E "Invalid|ERROR SUMMARY: [1-9]" $OUT/memcheck_dit.log | head -5
MODELS="${MODELS:-ltx-2 flux3}" PER_MODEL=100 ADDMM= bash .ab/run2.sh 2>&1 | grep -v "^NVIDIA"
FAST=1 timeout 70 bash .ab/adaln_cog.sh
echo "total wall $(( $(date +%s) - t0 )) s"
