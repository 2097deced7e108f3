"""Times fusebox alone on selected suite cases under several launch-plan settings (environment
variables read by the core, e.g. FUSEBOX_NORM_ITEMS), each setting in its own process, and
prints one table: median us per case and setting, with the floor. A tuning aid, not the
benchmark (`fusebox bench` is).

    python scripts/tune.py --cases "rms_norm|2048x4096|bf16,adaln|ltx" \\
        --settings "default;FUSEBOX_NORM_ITEMS=1;FUSEBOX_NORM_STAGE=0"

A case is matched by substring against the suite key ``op|shape|dtype``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def measure(patterns, dtype):
    import torch

    from fusebox.bench import suite
    from fusebox.bench.runner import load_fusebox
    from fusebox.bench.timing import SMALL_BYTES, Timer, plan_sets

    fb, err = load_fusebox()
    if fb is None:
        raise SystemExit(f"fusebox not loaded: {err}")
    timer = Timer(warmup=10, iters=60)
    calib = timer.calibrate()
    cases = [c for c in suite.select(list(suite.OP_NAMES), list(suite.GROUPS), [dtype], False)
             if any(p in c.key for p in patterns)]
    out = {"calibration": calib, "cases": {}}
    for case in cases:
        n_sets, flush = plan_sets(case.nbytes, timer.l2)
        sets = [suite.build_inputs(case, "cuda", seed=i) for i in range(n_sets)]
        spec = case.spec

        def fn(t, spec=spec, p=case.params):
            return spec.fusebox(fb, t, p)

        m = timer.measure(fn, sets, flush, case.nbytes <= 2 * SMALL_BYTES)
        out["cases"][case.key] = {"us": m["us"], "graph_us": m.get("graph_us"), "bytes": case.nbytes}
        del sets
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", required=True, help="comma-separated substrings of suite keys")
    ap.add_argument("--settings", default="default", help="';'-separated settings: default or VAR=V[,VAR=V]")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    patterns = [p for p in args.cases.split(",") if p]
    if args.child:
        print(json.dumps(measure(patterns, args.dtype)))
        return 0
    settings = [s.strip() for s in args.settings.split(";") if s.strip()]
    results = {}
    for st in settings:
        env = dict(os.environ)
        if st != "default":
            for kv in st.split(","):
                k, v = kv.split("=", 1)
                env[k.strip()] = v.strip()
        r = subprocess.run([sys.executable, __file__, "--child", "--cases", args.cases, "--dtype", args.dtype],
                           env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"[{st}] failed:\n{r.stderr[-2000:]}")
            continue
        results[st] = json.loads(r.stdout.strip().splitlines()[-1])
    if not results:
        return 1
    first = next(iter(results.values()))
    c = first["calibration"]
    print(f"copy {c['copy_tbps']:.2f} TB/s, launch {c['launch_us']:.2f} us")
    keys = list(first["cases"])
    head = f"{'case':58s} {'MB':>8} {'floor':>7} " + " ".join(f"{s[:22]:>22}" for s in results)
    print(head)
    for k in keys:
        nb = first["cases"][k]["bytes"]
        floor = c["launch_us"] + nb / (c["copy_tbps"] * 1e6)
        cells = []
        for s, r in results.items():
            v = r["cases"].get(k)
            cells.append(f"{v['us']:>14.2f} ({v['us'] / floor:4.2f}x)" if v else f"{'—':>22}")
        print(f"{k[:58]:58s} {nb / 1e6:8.2f} {floor:7.2f} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
