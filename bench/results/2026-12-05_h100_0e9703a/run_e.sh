#!/usr/bin/env bash
# LTX-2 under regional compile (and MODELS over ROUNDS rounds), then Phi-2's decode under CUDA graphs: the unpatched graphs, patched (the compiled
# one-token rotary as torch code, the default) and patched with the rope kernel, in alternating order, a process each
set -u
source .ab/prep.sh
R=/tmp/res; mkdir -p $R; t0=$(date +%s)
run() {  # model rounds timeout
  t1=$(date +%s)
  timeout $3 python3 -m fusebox bench e2e --model $1 --variants eager,patched,compile-regional,patched+compile-regional --rounds $2 --quick --out $R/e2e_$1 > $R/e2e_$1.log 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - t1 )) s"; grep -E "^\s+(eager|patched|compile)\S*\s+[0-9]" $R/e2e_$1.log | tail -4 | cut -c1-110
}
[ -z "${NO_LTX:-}" ] && run ltx-2 1 ${LTX_T:-170}
for m in ${MODELS:-}; do run $m ${ROUNDS:-2} ${PER_MODEL:-120}; done
n=0
for arm in ${ARMS:-graphs patched+graphs kernel kernel patched+graphs graphs}; do
  n=$((n+1)); v=$arm; envs=""
  [ $arm = kernel ] && v=patched+graphs && envs="FUSEBOX_COMPILED_ONE_TOKEN_ROTARY=kernel"
  t1=$(date +%s)
  env $envs timeout ${ARM_T:-75} python3 -m fusebox bench e2e --model ${LLM:-phi-2} --variants $v --quick --out $R/llm_${n}_$arm > $R/llm_${n}_$arm.log 2>&1
  echo "$n $arm rc=$? $(( $(date +%s) - t1 )) s $(grep -E "^\s+\S+: decode_tok_s_b1" $R/llm_${n}_$arm.log | tail -1)"
  [ $(( $(date +%s) - t0 )) -gt ${BUDGET:-540} ] && echo "stopping: budget" && break
done
tar czf $OUT/res.tgz -C $R .
echo "total wall $(( $(date +%s) - t0 )) s"
