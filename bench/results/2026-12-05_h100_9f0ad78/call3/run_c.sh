#!/usr/bin/env bash
# call 3: Mochi's compiled attention loop (tests + e2e), FLUX.3 in the reverse variant order with SM clocks sampled, LTX-2 under regional compile
set -u
source .ab/prep.sh
R=/tmp/res; mkdir -p $R; t0=$(date +%s)
(cd tests/python && timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf test_patch_dit_video.py -k "mochi and cuda" > $R/pytest_mochi.log 2>&1; echo "mochi tests rc=$?"; tail -1 $R/pytest_mochi.log)
stamp() { while IFS= read -r l; do echo "$(date +%s.%N) $l"; done; }
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 250 > $R/clocks.csv &
SMI=$!
run() {  # model variants timeout
  t1=$(date +%s)
  timeout $3 python3 -m fusebox bench e2e --model $1 --variants $2 --quick --out $R/e2e_$1 2>&1 | stamp > $R/e2e_$1.log
  echo "== $1 rc=$? $(( $(date +%s) - t1 )) s"; grep -E "^\S+ \s+(eager|patched|compile)" $R/e2e_$1.log | tail -4 | cut -c1-150
}
run mochi-1-preview eager,patched,compile-regional,patched+compile-regional 120
timeout 80 python3 scripts/host_profile.py --model flux3 --rounds 2 --top 25 > $R/host_flux3.txt 2>&1; echo "host_profile rc=$?"; grep -E "wall|synchronizing" $R/host_flux3.txt | head -8
run flux3 eager,patched+compile-regional,compile-regional,patched 90
kill $SMI
[ -n "${LTX:-}" ] && run ltx-2 eager,patched,compile-regional,patched+compile-regional ${LTX_T:-150}
tar czf $OUT/res.tgz -C $R .
echo "total wall $(( $(date +%s) - t0 )) s"
