"""FLUX.3 patched forward: attention + feed-forward summed inside the output GEMM (addmm) or
added after it, alternating in one process."""
import statistics, torch, fusebox
from fusebox.bench.e2e import dit
from fusebox.patch.dit import flux3
spec = dit.SPECS["flux3"]; dev = torch.device("cuda")
model = dit.build(spec, dev, torch.bfloat16)
inputs = spec.inputs(dev, torch.bfloat16)
fusebox.patch(model)
fused = flux3.linear_add
separate = lambda proj, x, other: proj(x) + other
def fwd():
    with torch.inference_mode():
        return dit._output(model(**inputs))
def time_ms(n=5):
    fwd(); torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    for i in range(n):
        ev[i].record(); fwd()
    ev[n].record(); torch.cuda.synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(n))
res = {"addmm": [], "separate add": []}
outs = {}
for r in range(3):
    for name, fn in (("addmm", fused), ("separate add", separate)):
        flux3.linear_add = fn
        res[name].append(time_ms())
        outs[name] = fwd().float()
d = (outs["addmm"] - outs["separate add"]).norm() / outs["separate add"].norm()
for k, v in res.items(): print(f"flux3 patched forward, {k}: " + " ".join(f"{x:.2f}" for x in v) + " ms")
print(f"rel diff addmm vs separate: {d.item():.2e}")
