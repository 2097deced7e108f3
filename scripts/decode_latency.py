"""Where a decode-sized call's time goes, per implementation: the bench's flushed, event-timed
call (L2 flushed before each start event), the same call warm (the previous kernel was the same
call, its code and data in the caches), and the per-call time of a CUDA-graph replay (where
kernels launched with programmatic dependent launch, as fusebox's are, overlap their start with
the previous kernel's end). A tuning aid, not the benchmark.

    python scripts/decode_latency.py --cases "rms_norm|1x2048|bf16,rope|1 tok" --impls fusebox,liger,compile
"""

from __future__ import annotations

import argparse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", required=True, help="comma-separated substrings of suite keys")
    ap.add_argument("--impls", default="fusebox,liger,compile")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("decode_latency: no CUDA device; this script times GPU kernels")
    from fusebox.bench import suite
    from fusebox.bench.runner import Runner
    from fusebox.bench.timing import Timer, median

    impls = [i for i in args.impls.split(",") if i]
    runner = Runner(Timer(warmup=10, iters=args.iters), use_compile="compile" in impls,
                    use_liger="liger" in impls)
    timer = runner.timer
    cal = timer.calibrate()
    graph_launch = cal.get("launch_graph_us")
    print(f"copy {cal['copy_tbps']:.2f} TB/s, empty launch {cal['launch_us']:.2f} us (events), "
          + (f"{graph_launch:.2f} us (graph)" if graph_launch is not None else "no graph figure"))
    print(f"{'case':44s} {'impl':8s} {'flushed':>8s} {'warm':>8s} {'graph':>8s}")
    for case in suite.matching([p for p in args.cases.split(",") if p], args.dtype):
        sets = [suite.build_inputs(case, "cuda", seed=0)]
        for name in impls:
            fn, absent = runner.impl(name, case)
            if fn is None:
                print(f"{case.key[:44]:44s} {name:8s} {absent.get('absent', '')}")
                continue
            with torch.no_grad():
                for _ in range(10):
                    fn(sets[0])
                torch.cuda.synchronize()
                enq = timer.host_enqueue_us(fn, sets)
                cold = median(timer.device_times(fn, sets, args.iters, True, enq))
                warm = median(timer.device_times(fn, sets, args.iters, False, enq))
                graph = timer.graph_us(fn, sets)
            print(f"{case.key[:44]:44s} {name:8s} {cold:8.2f} {warm:8.2f} {graph:8.2f}")
        del sets
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
