"""Where the GPU time of one forward of an end-to-end model goes: the CUDA kernels of a few
forwards under torch.profiler, eager and fusebox-patched side by side, biggest first. A
diagnostic aid; `fusebox bench e2e` is the benchmark.

    python scripts/profile_e2e.py --model ltx-video [--top 30] [--compiled]
    python scripts/profile_e2e.py --model qwen3-8b --decode 1   # one decode step, also compiled
    python scripts/profile_e2e.py --model qwen3-8b --generate 16   # greedy generate, dynamic cache
    python scripts/profile_e2e.py --model gemma3-4b --graphs 1   # generate under CUDA graphs
    python scripts/profile_e2e.py --model ltx-video --timeline  # where the GPU waits, patched
    python scripts/profile_e2e.py --model gemma3-4b --timeline --compiled  # and under compile
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch


def kernel_times(fn, iters: int):
    """{kernel name: (total us per forward, calls per forward)} over ``iters`` forwards."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name][0] += e.device_time / iters
            out[e.name][1] += 1
    return {k: (v[0], v[1] / iters) for k, v in out.items()}


# Calls that block the host until the GPU catches up (cudaMemcpyAsync is not one of them: the
# forward's device-to-device copies use it).
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuCtxSynchronize", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2"}


def timeline(fn, top: int, label: str) -> None:
    """Idle time of the GPU during one forward, from a CPU + CUDA trace: each gap between two
    kernels is "host" when the next kernel was launched after the GPU had gone idle (the GPU
    waited for Python and the launch path), else "device" (launch latency behind queued work).
    The profiler's own per-op cost inflates the host share, so the wall time of an unprofiled
    forward is printed beside the profiled span."""
    import bisect
    import json
    import tempfile
    import time

    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    op_starts = [e["ts"] for e in ops]
    syncs = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
             and e.get("name") in SYNC_CALLS]

    def launching_op(ts: float) -> str:
        """The innermost CPU op running at host time ts: of the nested ops that cover ts, the one
        that started last."""
        for i in range(bisect.bisect_right(op_starts, ts) - 1, -1, -1):
            if ops[i]["ts"] + ops[i].get("dur", 0) >= ts:
                return ops[i]["name"]
        return "?"

    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    busy = host_idle = device_idle = 0.0
    end = kernels[0]["ts"]
    gaps = []
    for k in kernels:
        if k["ts"] > end:
            launch = runtime.get(k.get("args", {}).get("correlation"))
            gap = k["ts"] - end
            if launch is not None and launch["ts"] + launch.get("dur", 0) > end:
                host_idle += gap
                gaps.append((gap, launching_op(launch["ts"]), k["name"]))
            else:
                device_idle += gap
        busy += max(0.0, k["ts"] + k["dur"] - max(k["ts"], end))
        end = max(end, k["ts"] + k["dur"])
    print(f"\n== timeline of {label}: {len(kernels)} kernels; unprofiled forward {wall_ms:.2f} ms wall; profiled span "
          f"{span / 1e3:.2f} ms: GPU busy {busy / 1e3:.2f} ms, idle waiting for a launch {host_idle / 1e3:.2f} ms "
          f"({len(gaps)} gaps), idle behind queued launches {device_idle / 1e3:.2f} ms")
    print(f"synchronizing calls in the forward (the last one ends the profiled forward): {len(syncs)} "
          f"({', '.join(sorted({e['name'] for e in syncs})) or 'none'})")
    by_op = defaultdict(lambda: [0.0, 0])
    for gap, op, _ in gaps:
        by_op[op][0] += gap
        by_op[op][1] += 1
    print("GPU idle before a late launch, by the CPU op that launched:")
    for op, (t, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{t / 1e3:8.3f} ms {n:6d}x  {op[:100]}")
    print("largest gaps:")
    for gap, op, name in sorted(gaps, reverse=True)[:10]:
        print(f"{gap:8.1f} us  {op[:50]:50s} -> {name[:60]}")


def decode_tables(fusebox, model, args, device):
    """Kernel tables of one decode step (``args.decode`` sequences, one new token each, after a
    prompt of ``args.tokens``) for eager, compile, patched and patched+compile."""
    from transformers import StaticCache

    from fusebox.bench.e2e import common

    batch = args.decode
    # Every step appends one token: room for all the steps of the four variants.
    cache = StaticCache(config=model.config, max_cache_len=args.tokens + 512)
    prompt = torch.randint(0, model.config.vocab_size, (batch, args.tokens), device=device)
    token = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    tables = []
    with torch.inference_mode():
        model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for name in ("eager", "compile", "patched", "patched+compile"):
            if name == "patched":
                print(fusebox.patch(model))
            torch._dynamo.reset()
            forward = torch.compile(model.forward, fullgraph=True) if "compile" in name else model.forward

            for layer in getattr(cache, "layers", []):   # back to the end of the prompt
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                    layer.cumulative_length.fill_(args.tokens)

            def step(forward=forward):
                return forward(token, past_key_values=cache, use_cache=True, logits_to_keep=1)

            for _ in range(3):
                step()
            wall = common.time_ms(step, device, warmup=0, iters=20)["median_ms"]
            print(f"{name}: one decode step (batch {batch}) {wall:.3f} ms wall")
            tables.append((name, kernel_times(step, args.iters)))
    return tables


def generate_profile(fusebox, model, batch: int, device, steps: int = 16, prompt_tokens: int = 32) -> None:
    """Greedy ``generate`` on a dynamic cache (the path of the benchmark's eager decode), unpatched
    then patched: the time of one decode step (a run of ``steps`` + 1 tokens less a run of one,
    median of 3), the top kernels and operators of one run under the profiler, and the host
    synchronizations it made."""
    import statistics
    import time

    from torch.profiler import ProfilerActivity, profile

    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_tokens), device=device)

    def gen(n):
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0, disable_compile=True)

    def run(label):
        gen(4)
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            a = time.perf_counter()
            gen(steps + 1)
            torch.cuda.synchronize()
            b = time.perf_counter()
            gen(1)
            torch.cuda.synchronize()
            c = time.perf_counter()
            times.append(((b - a) - (c - b)) / steps * 1e3)
        print(f"== {label}: {statistics.median(times):.2f} ms per decode step (batch {batch})")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gen(steps + 1)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
        for e in prof.key_averages():
            if "Synchronize" in e.key or "Memcpy" in e.key or "item" in e.key:
                print("host:", e.key, e.count)

    with torch.inference_mode():
        run("eager")
        fusebox.patch(model)
        run("patched")


def _record_guard_times(times: list) -> None:
    """Make dynamo time each new compiled frame's guards warm (200 checks of the frame's own
    locals, microseconds a check) into ``times``; dynamo itself times one cold check."""
    import time

    import torch._dynamo.guards as guards

    def warm_check_us(root, scope, _iters):
        for _ in range(20):
            root.check(scope)
        start = time.perf_counter()
        for _ in range(200):
            root.check(scope)
        times.append((time.perf_counter() - start) / 200 * 1e6)
        return times[-1]

    guards.profile_guard_manager = warm_check_us


def graphs_profile(model, batch: int, device, steps: int = 32, prompt_tokens: int = 32,
                   rounds: int = 1, gc_freeze: bool = False, order=None) -> None:
    """Greedy ``generate`` under CUDA graphs (a static cache, the step compiled with
    ``mode="reduce-overhead"``, as the benchmark's graph variants), unpatched and patched in
    rounds of alternating order (or in ``order``). Per decode step: the wall time (synchronized),
    the host time of the compiled call (call to return, the GPU still running) and of the layers
    under it (inductor's call, the cudagraph tree manager, the node's run, the graph's replay),
    the warm guard check of each compiled frame, the garbage collector's pauses; for the first two
    runs, from one profiled generate, the GPU's busy time a step and the runtime calls a step
    makes (the profiler's tracing lengthens cudaGraphLaunch several-fold:
    `scripts/graph_census.py` times the launch alone)."""
    import gc
    import json
    import statistics
    import tempfile
    import time

    from fusebox.bench.e2e import llm
    from torch.profiler import ProfilerActivity, profile
    from transformers import LogitsProcessor, LogitsProcessorList, StaticCache
    from transformers.generation import CompileConfig

    guard_us: list = []
    _record_guard_times(guard_us)
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_tokens), device=device)
    config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    stamps, calls = [], []

    class StepClock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            return scores

    def gen():
        return model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps + 1,
            min_new_tokens=steps + 1, do_sample=False, pad_token_id=0, compile_config=config,
            logits_processor=LogitsProcessorList([StepClock()]),
            past_key_values=StaticCache(config=model.config, max_cache_len=prompt_tokens + steps + 2))

    # Host time of the layers under the compiled call, unprofiled: dynamo's frame calls inductor's
    # compiled graph, whose cudagraph tree manager runs the recorded node, which replays its graph.
    from torch._inductor import cudagraph_trees, output_code

    layers = [("inductor call", output_code.CompiledFxGraph, "__call__"),
              ("tree manager", cudagraph_trees.CUDAGraphTreeManager, "run"),
              ("node run", cudagraph_trees.CUDAGraphNode, "run"),
              ("input check", cudagraph_trees.CUDAGraphNode, "check_static_inputs_are_stable"),
              ("replay", cudagraph_trees.CUDAGraphNode, "run_graph"),
              ("outputs", cudagraph_trees.CUDAGraphNode, "reconstruct_outputs")]
    layer_ms: dict = defaultdict(list)
    timing = [False]
    originals = []

    def clock(label, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if timing[0]:
                layer_ms[label].append((time.perf_counter() - start) * 1e3)
            return out
        return timed

    for label, owner, name in layers:
        originals.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, clock(label, owner.__dict__[name]))

    collections: dict = {}   # generation -> [collections, ms] while the steps are timed
    gc_start = [0.0]

    def gc_clock(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            entry = collections.setdefault(info["generation"], [0, 0.0])
            entry[0] += 1
            entry[1] += (time.perf_counter() - gc_start[0]) * 1e3

    def timed_call(compiled):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = compiled(*args, **kwargs)
            calls.append((start, time.perf_counter()))
            return out
        return call

    def run(label, trace):
        llm._set_variant(model, label)
        guard_us.clear()
        for _ in range(2):      # compiles, records the graphs, replays
            gen()
        model._compiled_call = timed_call(model._compiled_call)
        if gc_freeze:
            gc.collect()
            gc.freeze()
        objects = len(gc.get_objects())
        collections.clear()
        gc.callbacks.append(gc_clock)
        layer_ms.clear()
        timing[0] = True
        wall, host, tail = [], [], []
        for _ in range(3):
            stamps.clear()
            calls.clear()
            gen()
            wall += [(b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:])]
            host += [(b - a) * 1e3 for a, b in calls[1:]]
            tail += [(s - b) * 1e3 for (_, b), s in zip(calls[1:], stamps[2:])]
        timing[0] = False
        gc.callbacks.remove(gc_clock)
        gc.unfreeze()
        steps_timed = 3 * (steps + 1)
        print(f"== {label}: decode step (batch {batch}) {statistics.median(wall):.3f} ms wall "
              f"(min {min(wall):.3f}); compiled call on the host {statistics.median(host):.3f} ms, "
              f"return to synchronized {statistics.median(tail):.3f} ms; warm guard check of each "
              f"compiled frame {', '.join(f'{t:.0f}' for t in guard_us)} us")
        print("   host time under the compiled call, median a step: " + ", ".join(
            f"{label} {statistics.median(layer_ms[label]):.3f} ms" for label, _, _ in layers
            if layer_ms[label]))
        print(f"   Python's garbage collector: {objects} objects tracked"
              f"{' (frozen)' if gc_freeze else ''}; "
              + ", ".join(f"generation {g}: {n} collections, {ms / steps_timed:.3f} ms a step"
                          for g, (n, ms) in sorted(collections.items())))
        if not trace:
            return
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gen()
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            with open(f.name) as trace_file:
                events = json.load(trace_file)["traceEvents"]
        kernels = sorted((e for e in events
                          if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                         key=lambda e: e["ts"])
        runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
        # Profiler times are microseconds on its own clock: place the steps by the compiled
        # calls' CPU events ("Torch-Compiled Region") instead of perf_counter.
        regions = sorted((e for e in events if e.get("cat") == "cpu_op"
                          and e.get("name", "").startswith("Torch-Compiled Region")),
                         key=lambda e: e["ts"])
        print(f"   profiled run: {len(regions)} compiled-region events")
        if len(regions) >= 3:
            steps_ts = [(r["ts"], n["ts"]) for r, n in zip(regions[1:], regions[2:])]
            busy, counts = [], defaultdict(int)
            for a, b in steps_ts:
                end, total = a, 0.0
                for k in kernels:
                    if a <= k["ts"] < b:
                        total += max(0.0, k["ts"] + k["dur"] - max(k["ts"], end))
                        end = max(end, k["ts"] + k["dur"])
                busy.append(total / 1e3)
                for e in runtime:
                    if a <= e["ts"] < b:
                        counts[e["name"]] += 1
            span = statistics.median((b - a) / 1e3 for a, b in steps_ts)
            top = sorted(counts.items(), key=lambda kv: -kv[1])[:8]
            print(f"   profiled step {span:.3f} ms, GPU busy {statistics.median(busy):.3f} ms; "
                  "runtime calls a step: "
                  + ", ".join(f"{n} {c / len(steps_ts):.1f}" for n, c in top))
            # the GPU's work a step by kernel: what the variant runs that the other does not
            per_kernel: dict = defaultdict(lambda: [0, 0.0])
            a, b = steps_ts[0][0], steps_ts[-1][1]
            for k in kernels:
                if a <= k["ts"] < b:
                    per_kernel[k["name"]][0] += 1
                    per_kernel[k["name"]][1] += k["dur"]
            n = len(steps_ts)
            print(f"   GPU work a step: {sum(c for c, _ in per_kernel.values()) / n:.1f} kernels; "
                  "the 14 longest in all (launches a step, us a step):")
            for name, (count, us) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:14]:
                print(f"     {count / n:6.1f} {us / n:8.1f}  {name[:110]}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                        max_name_column_width=60))

    with torch.no_grad():
        # a process's later compiles may find its host slower: each round swaps the order
        if order is None:
            order = [label for i in range(rounds)
                     for label in (("unpatched", "patched") if i % 2 == 0 else ("patched", "unpatched"))]
        for i, label in enumerate(order):
            run(label, trace=i < 2)
    for owner, name, fn in originals:
        setattr(owner, name, fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ltx-video")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048, help="LLMs: prompt length")
    ap.add_argument("--decode", type=int, default=0, metavar="BATCH",
                    help="LLMs: profile one decode step at this batch on a static cache, eager and "
                         "torch.compile'd, unpatched and patched")
    ap.add_argument("--generate", type=int, default=0, metavar="BATCH",
                    help="LLMs: time and profile greedy generate at this batch on a dynamic cache, "
                         "unpatched and patched")
    ap.add_argument("--graphs", type=int, default=0, metavar="BATCH",
                    help="LLMs: greedy generate at this batch under CUDA graphs (static cache, "
                         "reduce-overhead), unpatched and patched: where a step's time goes")
    ap.add_argument("--rounds", type=int, default=1,
                    help="--graphs: rounds of unpatched and patched, the order swapped each round")
    ap.add_argument("--order", default=None, metavar="LABELS",
                    help="--graphs: the runs in this order instead of --rounds (e.g. "
                         "patched,unpatched,unpatched)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="--graphs: move the objects alive after warm-up out of the garbage "
                         "collector's reach (gc.freeze) while the steps are timed")
    ap.add_argument("--timeline", action="store_true",
                    help="the GPU's idle time in one patched forward (with --compiled, also the "
                         "compiled ones), split into waiting for the host "
                         "and launch latency, by the launching op")
    ap.add_argument("--compiled", action="store_true",
                    help="also the unpatched and the patched model under regional compile (each "
                         "diffusers block or decoder layer compiled)")
    args = ap.parse_args()

    import fusebox
    from fusebox.bench.e2e import families

    family = families()[args.model]
    device = torch.device("cuda")
    if hasattr(family, "profile_target"):        # diffusers transformers: one denoising step
        model, call = family.profile_target(args.model, device, torch.bfloat16)
        from fusebox.bench.e2e import dit

        regional = lambda: dit.compiled(model, "compile-regional", fullgraph=True)  # noqa: E731
    else:                                        # LLMs: prefill of args.tokens tokens
        model = family.build_model(args.model, device, torch.bfloat16).to(torch.bfloat16)
        ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), device=device)
        call = lambda: model(ids, use_cache=False, logits_to_keep=1)  # noqa: E731
        regional = lambda: family._compiled_layers(model)  # noqa: E731
    if args.graphs:
        graphs_profile(model, args.graphs, device, rounds=args.rounds, gc_freeze=args.gc_freeze,
                       order=args.order.split(",") if args.order else None)
        return
    if args.generate:
        generate_profile(fusebox, model, args.generate, device)
        return
    if args.decode:
        tables = decode_tables(fusebox, model, args, device)
    else:
        with torch.inference_mode():
            tables = [("eager", kernel_times(call, args.iters))]
            if args.compiled:
                with regional():
                    tables.append(("compile-regional", kernel_times(call, args.iters)))
                    if args.timeline:
                        timeline(call, args.top, "compile-regional")
            print(fusebox.patch(model))
            tables.append(("patched", kernel_times(call, args.iters)))
            if args.timeline:
                timeline(call, args.top, "patched")
            if args.compiled:
                torch._dynamo.reset()
                with regional():
                    tables.append(("patched+compile-regional", kernel_times(call, args.iters)))
                    if args.timeline:
                        timeline(call, args.top, "patched+compile-regional")
    for name, table in tables:
        total = sum(t for t, _ in table.values())
        print(f"\n== {name}: {total / 1e3:.2f} ms of kernels per forward, "
              f"{sum(n for _, n in table.values()):.0f} launches")
        for k, (t, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"{t / 1e3:8.3f} ms {t / total * 100:5.1f}% {n:6.0f}x  {k[:110]}")


if __name__ == "__main__":
    main()
