"""Does torch.compile(mode="reduce-overhead") replay a CUDA graph around a fusebox op?"""
import torch, fusebox, logging
from collections import Counter
from torch._dynamo.utils import counters
torch._logging.set_logs(perf_hints=True, cudagraphs=True)
x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
fns = {
    "F.rms_norm": lambda x, w: torch.nn.functional.rms_norm(x, (2048,), w, 1e-6) * 2,
    "fusebox.rms_norm": lambda x, w: fusebox.rms_norm(x, w, 1e-6) * 2,
}
for name, fn in fns.items():
    torch._dynamo.reset(); counters.clear()
    c = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):
        c(x, w)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        c(x, w); torch.cuda.synchronize()
    calls = Counter(e.name for e in p.events() if e.name.startswith("cuda"))
    print(name, "skips:", dict(counters["inductor"]), "host calls:", dict(calls), flush=True)
