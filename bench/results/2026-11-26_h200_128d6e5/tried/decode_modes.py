"""Qwen3-8B greedy decode: per-step time by the bench's StepClock and by whole-run wall time,
under no_grad and inference_mode, unpatched and patched, batch 1 and 16 (same process)."""
import contextlib, statistics, time
import torch
import fusebox
from fusebox.bench.e2e import llm

dev = torch.device("cuda")
model = llm.build_model("qwen3-8b", dev, torch.bfloat16).to(torch.bfloat16)
work = dict(prompt_tokens=32, decode_steps=64, warmup=1, iters=3)

def wall_ms(batch, steps=64):
    prompt = torch.randint(0, model.config.vocab_size, (batch, 32), device=dev)
    def gen(n):
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0, disable_compile=True)
    gen(4); torch.cuda.synchronize(); t = []
    for _ in range(3):
        torch.cuda.synchronize(); a = time.perf_counter(); gen(steps + 1); torch.cuda.synchronize()
        b = time.perf_counter(); gen(1); torch.cuda.synchronize(); c = time.perf_counter()
        t.append(((b - a) - (c - b)) / steps * 1e3)
    return statistics.median(t)

for variant in ("eager", "patched"):
    if variant == "patched":
        fusebox.patch(model)
    for mode in ("no_grad", "inference_mode"):
        ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
        for batch in (1, 16):
            with ctx():
                clock = llm.decode_tokens_per_s(model, variant, batch, work, dev)
                wall = wall_ms(batch)
            print(f"{variant:8s} {mode:15s} b{batch:<3d} stepclock {batch*1e3/clock:7.2f} ms/step ({clock:7.1f} tok/s)"
                  f"   wall {wall:7.2f} ms/step ({batch*1e3/wall:7.1f} tok/s)", flush=True)
