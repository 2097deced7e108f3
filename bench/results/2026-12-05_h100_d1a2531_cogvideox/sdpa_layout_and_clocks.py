"""(1) cuDNN SDPA alone at CogVideoX-5B's shape with q/k [B, H, N, D]-contiguous against
[B, N, H, D]-contiguous (permuted), v a permuted projection as diffusers passes it; (2) SM clock
and power during eager and patched forwards (nvidia-smi sampled every 50 ms)."""
import datetime
import subprocess
import time

import torch
import torch.nn.functional as F

B, H, N, D = 2, 48, 17776, 64
g = torch.Generator(device="cuda").manual_seed(0)
v = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
bhnd = [torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "qk"]
bnhd = [torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        for _ in "qk"]


def timed(fn, n=8):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return sorted(out)[n // 2]


for rnd in range(2):
    a = timed(lambda: F.scaled_dot_product_attention(*bhnd, v))
    b = timed(lambda: F.scaled_dot_product_attention(*bnhd, v))
    print(f"round {rnd}: sdpa q/k BHND-contiguous {a:.2f} ms, BNHD-contiguous {b:.2f} ms")
del v, bhnd, bnhd

import fusebox  # noqa: E402
from fusebox.bench.e2e import dit  # noqa: E402

spec = dit.SPECS["cogvideox-5b"]
model = dit.build(spec, "cuda", torch.bfloat16).eval()
kw = spec.inputs("cuda", torch.bfloat16)
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                        "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE,
                       text=True)
windows = {}
with torch.inference_mode():
    for name in ("eager", "patched", "eager2"):
        if name == "patched":
            fusebox.patch(model)
        elif name == "eager2":
            fusebox.unpatch(model)
        model(**kw)
        torch.cuda.synchronize()
        t0 = datetime.datetime.now()
        for _ in range(4):
            model(**kw)
        torch.cuda.synchronize()
        windows[name] = (t0, datetime.datetime.now())
time.sleep(0.2)
smi.terminate()
rows = []
for line in smi.stdout.read().splitlines():
    try:
        ts, clk, pw = [x.strip() for x in line.split(",")]
        rows.append((datetime.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f"), float(clk), float(pw)))
    except ValueError:
        pass
for name, (a, b) in windows.items():
    sel = [r for r in rows if a <= r[0] <= b]
    if sel:
        print(f"{name}: {(b - a).total_seconds() / 4 * 1e3:.0f} ms a forward, SM clock mean "
              f"{sum(r[1] for r in sel) / len(sel):.0f} MHz (min {min(r[1] for r in sel):.0f}), "
              f"power mean {sum(r[2] for r in sel) / len(sel):.0f} W, {len(sel)} samples")
