"""Decode batch 1 under generate's CUDA graphs, Gemma3-4B: unpatched, then patched (64 steps,
3 timed generates each); run once per FUSEBOX_PDL setting, alternating processes."""
import os, torch
from fusebox.bench.e2e import llm as e2e
dev = torch.device("cuda")
model = e2e.build_model("gemma3-4b", dev, torch.bfloat16).to(torch.bfloat16)
work = {"decode_steps": 64, "prompt_tokens": 32, "warmup": 1, "iters": 3}
for variant in ("graphs", "patched+graphs"):
    e2e._set_variant(model, variant)
    tps = e2e.decode_tokens_per_s(model, variant, 1, work, dev)
    print(f"FUSEBOX_PDL={os.environ.get('FUSEBOX_PDL', '1')} {variant}: {tps:.1f} tok/s", flush=True)
