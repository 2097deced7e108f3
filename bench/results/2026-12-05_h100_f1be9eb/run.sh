#!/usr/bin/env bash
set -u
gunzip -c .ab/lib.so.gz > torch-ext/fusebox/_fusebox_C.so
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/torch-ext:/tmp/site:$PWD/tests/python
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader | tee $OUT/gpu.txt
git rev-parse --short HEAD 2>/dev/null | tee $OUT/commit.txt
cd tests/python
timeout 125 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf test_compile.py test_patch_llm.py test_patch_dit_image.py test_patch_dit_video.py \
  -k "cuda and (one_token or leaves_its_rotary or grouped or latent or shared_kv or gptj or ltx2 or flux3 or krea2 or mochi or hunyuan_image or cogvideox or own_builder or generic_module)" \
  > $OUT/pytest_cuda.log 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|^FAILED" $OUT/pytest_cuda.log | tail -8
cd ../..
for arm in torch kernel; do
  FUSEBOX_COMPILED_ONE_TOKEN_ROTARY=$arm timeout 100 python3 -m fusebox bench e2e --model phi-2 --variants patched+graphs --quick --out $OUT/phi2_$arm > $OUT/phi2_$arm.log 2>&1
  echo "== phi-2 graphs, one-token rotary: $arm (rc=$?)"; grep -iE "tok/s|graphs" $OUT/phi2_$arm.log | tail -6
done
