"""Where LayerNorm's time goes at LTX's and FLUX's sizes: the same rows with and without their
small operands, beside RMS and a copy (flushed L2, medians of alternating rounds)."""
import sys
import torch
import fusebox
from fusebox.bench.timing import Timer

torch.manual_seed(0)
dt = torch.bfloat16
timer = Timer(warmup=10, iters=100)
cal = timer.calibrate()
print(f"copy {cal.get('copy_tbps', 0):.2f} TB/s", flush=True)
cases = {}
for name, shape in (("ltx", (2, 2688, 2048)), ("flux", (1, 4608, 3072))):
    d = shape[-1]
    x = torch.randn(shape, device="cuda", dtype=dt)
    w = torch.rand(d, device="cuda", dtype=dt) + 0.5
    b = torch.randn(d, device="cuda", dtype=dt) * 0.1
    sc = torch.randn(shape[0], 1, d, device="cuda", dtype=dt) * 0.1
    sh = torch.randn(shape[0], 1, d, device="cuda", dtype=dt) * 0.1
    y = torch.empty_like(x)
    cases[f"{name} copy"] = lambda _, x=x, y=y: y.copy_(x)
    cases[f"{name} rms"] = lambda _, x=x: fusebox.rms_norm(x, None, eps=1e-6)
    cases[f"{name} rms w"] = lambda _, x=x, w=w: fusebox.rms_norm(x, w, eps=1e-6)
    cases[f"{name} ln"] = lambda _, x=x: fusebox.layer_norm(x, None, None, 1e-6)
    cases[f"{name} ln w"] = lambda _, x=x, w=w: fusebox.layer_norm(x, w, None, 1e-6)
    cases[f"{name} ln wb"] = lambda _, x=x, w=w, b=b: fusebox.layer_norm(x, w, b, 1e-6)
    cases[f"{name} adaln rms"] = lambda _, x=x, sc=sc, sh=sh: fusebox.adaln(x, sc, sh, norm_type="rms")
    cases[f"{name} adaln ln"] = lambda _, x=x, sc=sc, sh=sh: fusebox.adaln(x, sc, sh, norm_type="layer")
res = {k: [] for k in cases}
for rnd in range(3):
    for k, fn in (cases.items() if rnd % 2 == 0 else reversed(list(cases.items()))):
        res[k].append(timer.measure(fn, [None], flush=True, small=False)["us"])
for k, v in res.items():
    print(f"{k:16s} " + " ".join(f"{t:7.2f}" for t in v) + f"   median {sorted(v)[1]:7.2f}")
