"""LTX-size norm rows with and without their small operands, each call in an NVTX range
"ncu/<name>" for Nsight Compute."""
import torch
import fusebox

torch.manual_seed(0)
dt = torch.bfloat16
shape = (2, 2688, 2048)
d = shape[-1]
x = torch.randn(shape, device="cuda", dtype=dt)
w = torch.rand(d, device="cuda", dtype=dt) + 0.5
b = torch.randn(d, device="cuda", dtype=dt) * 0.1
sc = torch.randn(shape[0], 1, d, device="cuda", dtype=dt) * 0.1
sh = torch.randn(shape[0], 1, d, device="cuda", dtype=dt) * 0.1
cases = {
    "rms": lambda: fusebox.rms_norm(x, None, eps=1e-6),
    "rms_w": lambda: fusebox.rms_norm(x, w, eps=1e-6),
    "ln": lambda: fusebox.layer_norm(x, None, None, 1e-6),
    "ln_w": lambda: fusebox.layer_norm(x, w, None, 1e-6),
    "ln_wb": lambda: fusebox.layer_norm(x, w, b, 1e-6),
    "adaln_rms": lambda: fusebox.adaln(x, sc, sh, norm_type="rms"),
}
for name, fn in cases.items():
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("ncu")
    fn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print("profiled", name)
