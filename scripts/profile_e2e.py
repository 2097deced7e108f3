"""Where the GPU time of one forward of an end-to-end model goes: the CUDA kernels of a few
forwards under torch.profiler, eager and fusebox-patched side by side, biggest first. A
diagnostic aid; `fusebox bench e2e` is the benchmark.

    python scripts/profile_e2e.py --model ltx-video [--top 30] [--compiled]
    python scripts/profile_e2e.py --model qwen3-8b --decode 1   # one decode step, also compiled
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ltx-video")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048, help="LLMs: prompt length")
    ap.add_argument("--decode", type=int, default=0, metavar="BATCH",
                    help="LLMs: profile one decode step at this batch on a static cache, eager and "
                         "torch.compile'd, unpatched and patched")
    ap.add_argument("--compiled", action="store_true",
                    help="diffusers transformers: also the unpatched model under regional compile")
    args = ap.parse_args()

    import fusebox
    from fusebox.bench.e2e import families

    family = families()[args.model]
    device = torch.device("cuda")
    if hasattr(family, "profile_target"):        # diffusers transformers: one denoising step
        model, call = family.profile_target(args.model, device, torch.bfloat16)
    else:                                        # LLMs: prefill of args.tokens tokens
        model = family.build_model(args.model, device, torch.bfloat16).to(torch.bfloat16)
        ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), device=device)
        call = lambda: model(ids, use_cache=False, logits_to_keep=1)  # noqa: E731
    if args.decode:
        tables = decode_tables(fusebox, model, args, device)
    else:
        with torch.inference_mode():
            tables = [("eager", kernel_times(call, args.iters))]
            if args.compiled:
                from fusebox.bench.e2e import dit

                with dit.compiled(model, "compile-regional", fullgraph=True):
                    tables.append(("compile-regional", kernel_times(call, args.iters)))
            print(fusebox.patch(model))
            tables.append(("patched", kernel_times(call, args.iters)))
    for name, table in tables:
        total = sum(t for t, _ in table.values())
        print(f"\n== {name}: {total / 1e3:.2f} ms of kernels per forward, "
              f"{sum(n for _, n in table.values()):.0f} launches")
        for k, (t, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"{t / 1e3:8.3f} ms {t / total * 100:5.1f}% {n:6.0f}x  {k[:110]}")


if __name__ == "__main__":
    main()
