"""Where the GPU time of one forward of an end-to-end model goes: the CUDA kernels of a few
forwards under torch.profiler, eager and fusebox-patched side by side, biggest first. A
diagnostic aid; `fusebox bench e2e` is the benchmark.

    python scripts/profile_e2e.py --model ltx-video [--top 30]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ltx-video")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048, help="LLMs: prompt length")
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
    with torch.inference_mode():
        eager = kernel_times(call, args.iters)
        print(fusebox.patch(model))
        patched = kernel_times(call, args.iters)
    for name, table in (("eager", eager), ("patched", patched)):
        total = sum(t for t, _ in table.values())
        print(f"\n== {name}: {total / 1e3:.2f} ms of kernels per forward, "
              f"{sum(n for _, n in table.values()):.0f} launches")
        for k, (t, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"{t / 1e3:8.3f} ms {t / total * 100:5.1f}% {n:6.0f}x  {k[:110]}")


if __name__ == "__main__":
    main()
