"""Host time of cudaGraphLaunch for graphs of N small kernels: torch elementwise, fusebox
rms_norm, and the two interleaved (as in a patched decode step)."""
import os, statistics, sys, time
import torch
import fusebox.functional as F

N = 600
dev = torch.device("cuda")
x = torch.randn(1, 2560, device=dev, dtype=torch.bfloat16)
w = torch.randn(2560, device=dev, dtype=torch.bfloat16)
y = torch.empty_like(x)

def torch_op():
    torch.add(x, 1.0, out=y)

def fb_op():
    F.rms_norm(x, w, 1e-6)

def mixed():
    torch.add(x, 1.0, out=y)
    F.rms_norm(x, w, 1e-6)

z = torch.empty_like(x)

def mixed_copy():
    torch.add(x, 1.0, out=y)
    F.rms_norm(x, w, 1e-6)
    z.copy_(x)          # a memcpy node, as the KV-cache and input copies in a decode graph

def torch_copy():
    torch.add(x, 1.0, out=y)
    torch.mul(x, 2.0, out=y)
    z.copy_(x)

a_mat = torch.randn(1, 2560, device=dev, dtype=torch.bfloat16)
b_mat = torch.randn(2560, 2560, device=dev, dtype=torch.bfloat16)
c_mat = torch.empty(1, 2560, device=dev, dtype=torch.bfloat16)

def with_gemm():
    torch.mm(a_mat, b_mat, out=c_mat)
    F.rms_norm(x, w, 1e-6)
    torch.add(x, 1.0, out=y)

def torch_gemm():
    torch.mm(a_mat, b_mat, out=c_mat)
    torch.mul(x, 2.0, out=y)
    torch.add(x, 1.0, out=y)

def graph_of(body, n):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            body()
    return g

out = []
for name, body, n in (("torch add", torch_op, N), ("fusebox rms_norm", fb_op, N), ("add + rms_norm", mixed, N // 2),
                      ("add + mul + copy", torch_copy, N // 3), ("add + rms_norm + copy", mixed_copy, N // 3),
                      ("gemm + mul + add", torch_gemm, N // 3), ("gemm + rms_norm + add", with_gemm, N // 3)):
    g = graph_of(body, n)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(30):
        torch.cuda.synchronize()
        a = time.perf_counter(); g.replay(); b = time.perf_counter(); torch.cuda.synchronize(); c = time.perf_counter()
        host.append((b - a) * 1e6); wall.append((c - a) * 1e6)
    out.append(f"{name:18s} {N} kernels: graph launch host {statistics.median(host):7.1f} us ({statistics.median(host)/N:.2f} a kernel), replay wall {statistics.median(wall):7.1f} us")
print(f"FUSEBOX_PDL={os.environ.get('FUSEBOX_PDL', 'default')}")
print("\n".join(out))
