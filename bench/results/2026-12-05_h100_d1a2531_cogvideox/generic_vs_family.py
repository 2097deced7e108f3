"""CogVideoX-5B (random weights, bf16), one forward: eager, the generic pass alone (what the model
got before the family patcher), the family patcher; CUDA events, median of 5 after 2 warm-ups;
then the patched forward's kernels by total time."""
import sys
import torch
import fusebox
from fusebox.bench.e2e import dit
from fusebox.patch.dit import cogvideox

spec = dit.SPECS["cogvideox-5b"]
model = dit.build(spec, "cuda", torch.bfloat16).eval()
kw = spec.inputs("cuda", torch.bfloat16)


def timed(n=5):
    with torch.inference_mode():
        for _ in range(2):
            model(**kw)
        torch.cuda.synchronize()
        times = []
        for _ in range(n):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = model(**kw)[0]
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
    return sorted(times)[n // 2], out


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.norm().double()).item()


eager, ref = timed()
applies = cogvideox.applies
cogvideox.applies = lambda m: False
fusebox.patch(model)
generic, out_g = timed()
fusebox.unpatch(model)
cogvideox.applies = applies
print(fusebox.patch(model))
family, out_f = timed()
print(f"forward ms (median of 5): eager {eager:.1f}, generic pass {generic:.1f} "
      f"({eager / generic:.3f}x), family patcher {family:.1f} ({eager / family:.3f}x; "
      f"{generic / family:.3f}x over generic)")
print(f"rel diff vs eager: generic {rel(out_g, ref):.2e}, family {rel(out_f, ref):.2e}")
for name, fused in (("eager", False), ("patched", True)):
    if not fused:
        fusebox.unpatch(model)
    else:
        fusebox.patch(model)
    with torch.inference_mode(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model(**kw)
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events) / 1e3
    print(f"== {name}: {total:.1f} ms of kernels")
    print(events.table(sort_by="device_time_total", row_limit=18, max_name_column_width=70))
