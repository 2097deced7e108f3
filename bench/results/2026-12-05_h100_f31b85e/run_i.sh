#!/usr/bin/env bash
# H200: the bf16 suite at the current kernels first. Any card: the fused grouped experts (ac75ded) and Mochi's
# compiled counts (be7674e) CUDA tests; DeepSeek-V2-Lite and OLMoE end to end, compiled variants each in its own process
set -u
source .ab/prep.sh
R=/tmp/res; mkdir -p $R; t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
if grep -q H200 $OUT/gpu.txt && [ -z "${NO_SUITE:-}" ]; then
  timeout 330 python3 -m fusebox bench --dtype bf16 --out $R/bench_bf16 > $R/bench_bf16.log 2>&1
  echo "suite rc=$? $(el) s"; tail -8 $R/bench_bf16.log | cut -c1-400
fi
(cd tests/python && timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf test_patch_llm.py test_patch_dit_video.py -k "grouped_experts or activation_module or e2e_configs or (mochi and cuda)" > $R/pytest_experts_mochi.log 2>&1; echo "tests rc=$? $(el) s"; tail -1 $R/pytest_experts_mochi.log)
run() {  # model variants rounds timeout
  t1=$(date +%s)
  timeout $4 python3 -m fusebox bench e2e --model $1 --variants $2 --rounds $3 --quick --out $R/e2e_$1 > $R/e2e_$1.log 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - t1 )) s"; grep -E "^\s+(eager|patched|compile)\S*\s+[0-9.e+-]+\s" $R/e2e_$1.log | tail -4 | cut -c1-110
}
for m in ${MODELS:-deepseek-v2-lite olmoe-1b-7b}; do
  [ $(el) -lt ${STOP_AT:-420} ] && run $m ${VARIANTS:-eager,patched,compile,patched+compile} ${ROUNDS:-1} ${PER_MODEL:-220}
done
tar czf $OUT/res.tgz -C $R .
echo "total wall $(el) s"
