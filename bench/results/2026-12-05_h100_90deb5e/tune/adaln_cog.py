"""adaln / gated_residual_norm at CogVideoX's video-stream shape, as the patch calls them."""
import os, sys, json, statistics, torch
import fusebox.functional as fb
torch.manual_seed(0)
dev = "cuda"; dt = torch.bfloat16

def t(fn, iters=40):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    s = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    for i in range(iters):
        s[i].record(); fn()
    s[iters].record(); torch.cuda.synchronize()
    return statistics.median(s[i].elapsed_time(s[i + 1]) * 1e3 for i in range(iters))

res = {}
for name, (B, N, D) in {"cog": (2, 17550, 3072), "flux": (1, 4608, 3072), "cog-text": (2, 226, 3072)}.items():
    x = torch.randn(B, N, D, device=dev, dtype=dt)
    br = torch.randn_like(x)
    proj = torch.randn(B, 1, 6 * D, device=dev, dtype=dt) * 0.1
    shift, scale, gate = proj[..., :D], proj[..., D:2 * D], proj[..., 2 * D:3 * D]
    cs, cc = shift.contiguous(), scale.contiguous()
    w = torch.rand(D, device=dev, dtype=dt) + 0.5; b = torch.randn(D, device=dev, dtype=dt) * 0.1
    nb = x.numel() * 2
    y = torch.empty_like(x)
    res[f"{name} copy"] = (t(lambda: y.copy_(x)), 2 * nb)
    res[f"{name} adaln layer"] = (t(lambda: fb.adaln(x, cc, cs, None, None, "layer", 1e-5)), 2 * nb)
    res[f"{name} adaln layer views"] = (t(lambda: fb.adaln(x, scale, shift, None, None, "layer", 1e-5)), 2 * nb)
    res[f"{name} adaln layer w,b views"] = (t(lambda: fb.adaln(x, scale, shift, w, b, "layer", 1e-5)), 2 * nb)
    res[f"{name} adaln layer w,b"] = (t(lambda: fb.adaln(x, cc, cs, w, b, "layer", 1e-5)), 2 * nb)
    res[f"{name} grn layer w,b views"] = (t(lambda: fb.gated_residual_norm(x, br, gate, scale, shift, w, b, "layer", 1e-5)), 4 * nb)
    xs = torch.randn(B, N + 226, D, device=dev, dtype=dt)[:, 226:]
    res[f"{name} adaln layer w,b views, x sliced"] = (t(lambda: fb.adaln(xs, scale, shift, w, b, "layer", 1e-5)), 2 * nb)
print(json.dumps({k: [round(v[0], 2), round(v[1] / v[0] / 1e6, 3)] for k, v in res.items()}))
