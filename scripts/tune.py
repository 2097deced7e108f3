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
    from fusebox.bench import suite
    from fusebox.bench.runner import Runner
    from fusebox.bench.timing import Timer

    runner = Runner(Timer(warmup=10, iters=60), use_compile=False, use_liger=False)
    if runner.fb is None:
        raise SystemExit(f"fusebox not loaded: {runner.fb_error}")
    out = {"calibration": runner.timer.calibrate(), "cases": {}}
    for case in suite.matching(patterns, dtype):
        m = runner.run_case(case, impls=("fusebox",))["impls"]["fusebox"]
        if "us" not in m:
            raise SystemExit(f"{case.key}: {m.get('absent')}")
        out["cases"][case.key] = {"us": m["us"], "graph_us": m.get("graph_us"), "bytes": case.nbytes}
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
    results = {}  # by position: a setting may repeat (alternating runs)
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
        results[(len(results), st)] = json.loads(r.stdout.strip().splitlines()[-1])
    if not results:
        return 1
    first = next(iter(results.values()))
    c = first["calibration"]
    print(f"copy {c['copy_tbps']:.2f} TB/s, launch {c['launch_us']:.2f} us")
    keys = list(first["cases"])
    for i, (_, s) in enumerate(results):
        print(f"[{i}] {s}")
    print(f"{'case':58s} {'MB':>8} {'floor':>7} " + " ".join(f"{f'[{i}]':>22}" for i in range(len(results))))
    for k in keys:
        nb = first["cases"][k]["bytes"]
        floor = c["launch_us"] + nb / (c["copy_tbps"] * 1e6)
        cells = []
        for s, r in results.items():
            v = r["cases"].get(k)
            cells.append(f"{v['us']:>14.2f} ({v['us'] / floor:4.2f}x)" if v else f"{'—':>22}")
        print(f"{k[:58]:58s} {nb / 1e6:8.2f} {floor:7.2f} " + " ".join(cells))
    graphed = [k for k in keys if first["cases"][k].get("graph_us")]
    if graphed:  # decode-sized cases: CUDA-graph replay per call, against the empty launch's
        print(f"CUDA-graph replay us (empty launch {c.get('launch_graph_us') or float('nan'):.2f} us)")
        for k in graphed:
            cells = [f"{(r['cases'].get(k) or {}).get('graph_us') or float('nan'):>22.2f}" for r in results.values()]
            print(f"{k[:58]:58s} {'':8} {'':7} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
