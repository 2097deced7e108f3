"""Runs one call of representative fusebox kernels, for Nsight Compute:

    ncu --clock-control none -k regex:fusebox --section SpeedOfLight ... python scripts/ncu_probe.py
"""

import torch

import fusebox

torch.manual_seed(0)
dev, bf16 = "cuda", torch.bfloat16


def r(*shape, dtype=bf16):
    return torch.randn(*shape, device=dev, dtype=dtype)


x = r(2048, 4096)
w = r(4096)
cases = {
    "rms_norm 2048x4096": lambda: fusebox.rms_norm(x, w),
    "rms_norm 1x4096": lambda: fusebox.rms_norm(x[:1], w),
    "gelu_tanh 5376x8192": (lambda a, b: lambda: fusebox.gelu_tanh(a, b))(r(5376, 8192), r(8192)),
    "swiglu 2048x12288": (lambda g, u: lambda: fusebox.swiglu(g, u))(r(2048, 12288), r(2048, 12288)),
    "rope qwen 8192 tok": (lambda q, k, c, s: lambda: fusebox.rope(q, k, c, s, heads_first=True))(
        r(1, 32, 8192, 128), r(1, 8, 8192, 128), r(1, 8192, 128), r(1, 8192, 128)),
}
for name, fn in cases.items():
    fn()  # warm-up (module load)
torch.cuda.synchronize()
for name, fn in cases.items():
    torch.cuda.nvtx.range_push(name)
    fn()
    torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
print("done")
