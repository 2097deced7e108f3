import torch, torch.nn.functional as F
def t(fn, n=200):
    for _ in range(10): fn()
    s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e)/n*1000
for K, N in [(2560, 10240), (3072, 12288)]:
    for M in [1, 16, 2048]:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        a = t(lambda: F.linear(x, w, b))
        g = t(lambda: F.gelu(F.linear(x, w, b), approximate="tanh"))
        ep = t(lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True))
        print(f"K{K} N{N} M{M}: linear {a:.1f} us, linear+gelu {g:.1f}, epilogue {ep:.1f}")
