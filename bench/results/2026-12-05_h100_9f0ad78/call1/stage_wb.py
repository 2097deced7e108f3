"""weight + modulation rows (no compile-time twin), 16-bit, 4-vector plans: staged or read at use."""
import json, statistics, torch
import fusebox.functional as fb
torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
def t(fn, iters=30):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    s = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    for i in range(iters):
        s[i].record(); fn()
    s[iters].record(); torch.cuda.synchronize()
    return statistics.median(s[i].elapsed_time(s[i + 1]) * 1e3 for i in range(iters))
res = {}
for name, (B, N, D) in {"cog": (2, 17550, 3072), "d4096": (2, 8192, 4096), "d6144": (1, 8192, 6144), "ltx": (2, 2688, 2048)}.items():
    x = torch.randn(B, N, D, device=dev, dtype=dt); br = torch.randn_like(x)
    proj = torch.randn(B, 1, 6 * D, device=dev, dtype=dt) * 0.1
    shift, scale, gate = proj[..., :D], proj[..., D:2 * D], proj[..., 2 * D:3 * D]
    w = torch.rand(D, device=dev, dtype=dt) + 0.5; b = torch.randn(D, device=dev, dtype=dt) * 0.1
    nb = x.numel() * 2
    y = torch.empty_like(x)
    res[f"{name} copy"] = (t(lambda: y.copy_(x)), 2 * nb)
    for norm in ("layer", "rms"):
        bb = b if norm == "layer" else None
        res[f"{name} adaln {norm} w"] = (t(lambda: fb.adaln(x, scale, shift, w, bb, norm, 1e-5)), 2 * nb)
        res[f"{name} grn {norm} w"] = (t(lambda: fb.gated_residual_norm(x, br, gate, scale, shift, w, bb, norm, 1e-5)), 4 * nb)
    res[f"{name} adaln layer (no w)"] = (t(lambda: fb.adaln(x, scale, shift, None, None, "layer", 1e-5)), 2 * nb)
print(json.dumps({k: [round(v[0], 2), round(v[1] / v[0] / 1e6, 3)] for k, v in res.items()}))
