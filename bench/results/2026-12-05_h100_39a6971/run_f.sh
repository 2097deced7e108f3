#!/usr/bin/env bash
# next: LTX-2's compiled split rotary (42fe5e8) on a GPU: its CUDA tests, then e2e with the knob A/B; Phi-2 decode rounds
set -u
source .ab/prep.sh
R=/tmp/res; mkdir -p $R; t0=$(date +%s)
(cd tests/python && timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf test_patch_dit_video.py -k "ltx2 and cuda" > $R/pytest_ltx2_cuda.log 2>&1; echo "ltx2 cuda tests rc=$?"; tail -1 $R/pytest_ltx2_cuda.log)
run() {  # tag env model variants rounds timeout
  t1=$(date +%s)
  env $2 timeout $6 python3 -m fusebox bench e2e --model $3 --variants $4 --rounds $5 --quick --out $R/e2e_$1 > $R/e2e_$1.log 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - t1 )) s"; grep -E "^\s+(eager|patched|compile|graphs)\S*\s+[0-9]" $R/e2e_$1.log | tail -4 | cut -c1-110
}
run ltx2 "X=1" ltx-2 eager,patched,compile-regional,patched+compile-regional 2 ${LTX_T:-200}
run ltx2_kernel "FUSEBOX_COMPILED_SPLIT_ROTARY=kernel" ltx-2 patched,patched+compile-regional 1 ${LTX_T:-120}
[ $(( $(date +%s) - t0 )) -lt 380 ] && run phi2 "X=1" phi-2 graphs,patched+graphs ${PHI_ROUNDS:-3} 150
tar czf $OUT/res.tgz -C $R .
echo "total wall $(( $(date +%s) - t0 )) s"
