source .ab/prep.sh > /dev/null
# default (LayerNorm w,b + modulation read at use since 83778b1) against FUSEBOX_NORM_STAGE=1 (every 16-bit operand staged, the old default)
for st in default FUSEBOX_NORM_STAGE=1 default FUSEBOX_NORM_STAGE=1; do
  echo "== $st"; if [ $st = default ]; then python3 .ab/stage_wb.py; else env $st python3 .ab/stage_wb.py; fi
done > $OUT/stage_wb.txt 2>&1
python3 - <<'PY'
import json, os
blocks = open(os.environ["OUT"] + "/stage_wb.txt").read().split("== ")[1:]
rows, sts = {}, []
for i, blk in enumerate(blocks):
    st, rest = blk.split("\n", 1); sts.append(f"{i}:{st.replace('FUSEBOX_NORM_', '')}")
    try: d = json.loads(rest.strip().splitlines()[-1])
    except Exception: print(st, "failed", rest[-400:]); continue
    for k, (us, tb) in d.items(): rows.setdefault(k, {})[sts[-1]] = f"{us:.1f}/{tb:.2f}"
print("us/TBps", " | ".join(sts))
for k, v in rows.items(): print(f"{k:28s}", " ".join(f"{v.get(s, '-'):>12s}" for s in sts))
PY
