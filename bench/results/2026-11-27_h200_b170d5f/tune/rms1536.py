"""Per-sample RMS adaln and gated_residual_norm on 1536-wide 16-bit rows with fp32 modulation
(no suite case has them): median us of flushed, event-timed calls, rotating 4 input sets."""
import sys
import torch
import fusebox
from fusebox.bench.timing import Timer, median

t = Timer(warmup=10, iters=60)
out = []
for dtype in (torch.bfloat16, torch.float16):
    for samples, rows in ((1, 32760), (2, 16380)):
        g = torch.Generator(device="cuda").manual_seed(0)
        sets = []
        for _ in range(4):
            x = torch.randn(samples, rows, 1536, device="cuda", dtype=dtype, generator=g)
            br = torch.randn_like(x)
            sc, sh, ga = (0.1 * torch.randn(samples, 1, 1536, device="cuda", generator=g) for _ in range(3))
            sets.append((x, br, ga, sc, sh))
        with torch.no_grad():
            for name, fn in (("adaln rms", lambda s: fusebox.adaln(s[0], s[3], s[4], norm_type="rms")),
                             ("grn rms", lambda s: fusebox.gated_residual_norm(s[0], s[1], s[2], s[3], s[4], norm_type="rms"))):
                for i in range(10):
                    fn(sets[i % 4])
                torch.cuda.synchronize()
                enq = t.host_enqueue_us(fn, sets)
                us = median(t.device_times(fn, sets, 60, False, enq))
                out.append(f"{name} {samples}x{rows}x1536 {str(dtype)[6:]} {us:.2f}")
print("\n".join(out))
