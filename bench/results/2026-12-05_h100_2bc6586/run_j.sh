#!/usr/bin/env bash
# moe_combine: C++ CUDA-vs-CPU tests, the Python GPU tests (and under compute-sanitizer), the
# per-kernel benchmark, then DeepSeek-V2-Lite and OLMoE eager vs patched end to end
set -u
source .ab/prep.sh
R=/tmp/res; rm -rf $R; mkdir -p $R; t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
[ -f .ab/cpp_tests.gz ] && gunzip -c .ab/cpp_tests.gz > /tmp/fusebox_cpp_tests && chmod +x /tmp/fusebox_cpp_tests
[ -x /tmp/fusebox_cpp_tests ] && /tmp/fusebox_cpp_tests --gtest_filter='CudaVsCpu.*:Moe*' > $R/cpp_tests.log 2>&1; echo "cpp rc=$? $(el) s"; tail -2 $R/cpp_tests.log
[ -x /tmp/fusebox_cpp_tests ] && compute-sanitizer --tool memcheck --error-exitcode 9 /tmp/fusebox_cpp_tests --gtest_filter='CudaVsCpu.Moe*' > $R/cpp_memcheck.log 2>&1; echo "cpp memcheck rc=$? $(el) s"; tail -2 $R/cpp_memcheck.log
(cd tests/python && timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf test_moe.py test_opcheck.py test_patch_llm.py -k "moe or grouped_experts" > $R/pytest_moe.log 2>&1; echo "pytest rc=$? $(el) s"; tail -1 $R/pytest_moe.log)
SANITIZE_TESTS=tests/python/test_moe.py SANITIZE_TIMEOUT=90 timeout 120 bash scripts/memcheck_ops.sh $R/memcheck_moe.log; echo "memcheck $(el) s"
timeout 120 python3 -m fusebox bench --ops moe_combine --dtype bf16 --out $R/bench_moe > $R/bench_moe.log 2>&1; echo "bench rc=$? $(el) s"; grep -E "moe_combine|copy" $R/bench_moe/*.md 2>/dev/null | head -24 | cut -c1-230
for m in ${MODELS:-deepseek-v2-lite olmoe-1b-7b}; do
  [ $(el) -gt ${STOP_AT:-450} ] && break; t1=$(date +%s)
  timeout 150 python3 -m fusebox bench e2e --model $m --variants eager,patched --rounds ${ROUNDS:-1} --quick --out $R/e2e_$m > $R/e2e_$m.log 2>&1
  echo "== $m rc=$? $(( $(date +%s) - t1 )) s"; grep -E "^\s+(eager|patched)\S*\s+[0-9.e+-]+\s" $R/e2e_$m.log | tail -2 | cut -c1-110
done
tar czf $OUT/res.tgz -C $R .
echo "total wall $(el) s"
