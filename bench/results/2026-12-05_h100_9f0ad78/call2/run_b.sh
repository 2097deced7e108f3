#!/usr/bin/env bash
# call 2: forced launch plans (alone on CUDA), FLUX.3 kernel profile (compile-regional vs patched+compile-regional), then regional compile e2e of more DiTs
set -u
source .ab/prep.sh
R=/tmp/res; mkdir -p $R; t0=$(date +%s)
(cd tests/python && timeout ${PLANS_T:-420} python3 -m pytest -q -p no:cacheprovider -p no:logging -rf -x test_launch_plans.py -k cuda --durations=5 > $R/pytest_plans.log 2>&1; echo "plans rc=$?" >> $R/rc.txt) &
timeout 200 python3 scripts/profile_e2e.py --model ${PROF_MODEL:-flux3} --compiled --top 40 --iters 3 > $R/profile_${PROF_MODEL:-flux3}.txt 2>&1; echo "profile rc=$? $(( $(date +%s) - t0 )) s"
grep -E "^== |ms of kernels" $R/profile_*.txt
for m in ${MODELS:-hunyuan-image-2.1 mochi-1-preview}; do
  t1=$(date +%s)
  timeout ${PER_MODEL:-170} python3 -m fusebox bench e2e --model $m --quick --out $R/e2e_$m > $R/e2e_$m.log 2>&1
  echo "== $m rc=$? $(( $(date +%s) - t1 )) s"; grep -E "^\s+(eager|patched|compile)" $R/e2e_$m.log | tail -4 | cut -c1-170
done
wait; cat $R/rc.txt; grep -E "^FAILED|passed|failed|slowest|s call" $R/pytest_plans.log | tail -12
tar czf $OUT/res.tgz -C $R .
echo "total wall $(( $(date +%s) - t0 )) s"
