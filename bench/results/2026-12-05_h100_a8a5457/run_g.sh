#!/usr/bin/env bash
# Mochi's eager per-sample attention without per-block host reads: CUDA tests, e2e over two rounds;
# Phi-2's compiled one-token rotary by GPU busy time a decode step (profiler), Inductor vs kernel
set -u
source .ab/prep.sh
R=/tmp/res; mkdir -p $R; t0=$(date +%s)
(cd tests/python && timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf test_patch_dit_video.py -k "mochi and cuda" > $R/pytest_mochi_cuda.log 2>&1; echo "mochi cuda tests rc=$?"; tail -1 $R/pytest_mochi_cuda.log)
t1=$(date +%s)
timeout ${MOCHI_T:-170} python3 -m fusebox bench e2e --model mochi-1-preview --variants eager,patched,compile-regional,patched+compile-regional --rounds 2 --quick --out $R/e2e_mochi > $R/e2e_mochi.log 2>&1
echo "== mochi rc=$? $(( $(date +%s) - t1 )) s"; grep -E "^\s+(eager|patched|compile)\S*\s+[0-9]" $R/e2e_mochi.log | tail -4 | cut -c1-110
for arm in torch kernel; do
  t1=$(date +%s)
  FUSEBOX_COMPILED_ONE_TOKEN_ROTARY=$arm timeout 100 python3 scripts/profile_e2e.py --model phi-2 --graphs 1 --rounds 1 > $R/phi2_graphs_$arm.log 2>&1
  echo "== phi2 rotary=$arm rc=$? $(( $(date +%s) - t1 )) s"; grep -E "^== |GPU busy|GPU work a step" $R/phi2_graphs_$arm.log | cut -c1-200
done
tar czf $OUT/res.tgz -C $R .
echo "total wall $(( $(date +%s) - t0 )) s"
