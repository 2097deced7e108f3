"""A PixArt-Sigma of 28 tiny blocks (width 16, 16 tokens, batch 2) on one CPU thread, eager and
fusebox-patched: median and min of 20 forwards."""
import time
import torch
import fusebox
from fusebox.bench.e2e import dit
torch.set_num_threads(1)
spec = dit.SPECS["pixart-sigma"]
cfg = dict(spec.config, attention_head_dim=8, num_attention_heads=2, cross_attention_dim=16, caption_channels=32, sample_size=8)
spec2 = dit.Spec(spec.description, spec.cls, cfg, dit._latent_inputs((2, 4, 8, 8), 8, 500, text_dim=32,
                 added_cond_kwargs={"resolution": None, "aspect_ratio": None}, encoder_attention_mask=dit._mask(2, 8)), "tiny")
dev = torch.device("cpu")
model = dit.build(spec2, dev, torch.bfloat16)
inputs = spec2.inputs(dev, torch.bfloat16)
def fwd(): return dit._output(model(**inputs))
def t(tag):
    with torch.inference_mode():
        for _ in range(5): fwd()
        ts=[]
        for _ in range(20):
            t0=time.perf_counter(); fwd(); ts.append((time.perf_counter()-t0)*1e3)
        ts.sort(); print(f"{tag}: {ts[10]:.2f} ms (min {ts[0]:.2f})")
t("eager")
fusebox.patch(model)
t("patched")
