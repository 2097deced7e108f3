#!/usr/bin/env bash
# call 1: the bf16 suite at the current kernels, the staged-operand A/B (stage_wb), then FLUX.3 and Krea 2 over three rounds (run order alternating)
set -u
source .ab/prep.sh
R=/tmp/res; mkdir -p $R; t0=$(date +%s)
python3 -c "import liger_kernel, diffusers; print('liger', liger_kernel.__file__, 'diffusers', diffusers.__version__)" 2>&1 | tail -1
timeout ${SUITE_T:-300} python3 -m fusebox bench --dtype ${DT:-bf16} --out $R/bench_${DT:-bf16} > $R/bench_${DT:-bf16}.log 2>&1
echo "suite rc=$? $(( $(date +%s) - t0 )) s"; tail -8 $R/bench_${DT:-bf16}.log | cut -c1-400
timeout 120 bash .ab/stage_wb.sh | tee $R/stage_wb_table.txt; echo "stage_wb $(( $(date +%s) - t0 )) s"
run() {  # model variants rounds timeout
  t1=$(date +%s)
  timeout $4 python3 -m fusebox bench e2e --model $1 --variants $2 --rounds $3 --quick --out $R/e2e_$1 > $R/e2e_$1.log 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - t1 )) s"; grep -E "^\s+(eager|patched|compile)\S*\s+[0-9]" $R/e2e_$1.log | tail -4 | cut -c1-110
}
V=eager,patched,compile-regional,patched+compile-regional
for m in ${MODELS:-flux3 krea-2}; do run $m $V ${ROUNDS:-3} ${PER_MODEL:-130}; done
tar czf $OUT/res.tgz -C $R .
echo "total wall $(( $(date +%s) - t0 )) s"
