"""Runs selected suite cases once per implementation inside NVTX ranges, for Nsight Compute to
profile only those calls. A diagnostic aid for a kernel that misses its floor:

    ncu --clock-control none --nvtx --nvtx-include "ncu/" --csv \\
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \\
        python scripts/ncu_cases.py --cases "rms_norm|1x2048|bf16" --impls fusebox,liger,compile

Each implementation is warmed up (compiled) outside the ranges; the profiled calls run in the
order printed (case by case, implementations in the order given).
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", required=True, help="comma-separated substrings of suite keys")
    ap.add_argument("--impls", default="fusebox,liger,compile")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--calls", type=int, default=3, help="profiled calls per implementation")
    args = ap.parse_args()

    from fusebox.bench import suite
    from fusebox.bench.runner import Runner
    from fusebox.bench.timing import Timer

    runner = Runner(Timer())
    patterns = [p for p in args.cases.split(",") if p]
    cases = suite.matching(patterns, args.dtype)
    if not cases:
        raise SystemExit(f"no suite case matches {patterns}")
    for case in cases:
        inputs = suite.build_inputs(case, "cuda", seed=0)
        for impl in args.impls.split(","):
            fn, absent = runner.impl(impl, case)
            if fn is None:
                print(f"{impl} {case.key}: {absent['absent']}")
                continue
            for _ in range(3):
                fn(inputs)
            torch.cuda.synchronize()
            for _ in range(args.calls):
                torch.cuda.nvtx.range_push("ncu")
                fn(inputs)
                torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            print(f"profiled {impl} {case.key}")


if __name__ == "__main__":
    main()
