"""PixArt-Sigma one forward, eager and fusebox-patched: wall time, host time to enqueue (GPU
held busy), and the profiler's CPU / CUDA totals and top host ops."""
import time
import torch
import fusebox
from fusebox.bench.e2e import dit

dev = torch.device("cuda")
spec = dit.SPECS["pixart-sigma"]
model = dit.build(spec, dev, torch.bfloat16)
inputs = spec.inputs(dev, torch.bfloat16)


def fwd():
    return dit._output(model(**inputs))


def measure(tag):
    with torch.inference_mode():
        for _ in range(3):
            fwd()
        torch.cuda.synchronize()
        walls = []
        for _ in range(6):
            t0 = time.perf_counter(); fwd(); torch.cuda.synchronize(); walls.append((time.perf_counter() - t0) * 1e3)
        hosts = []
        for _ in range(4):
            torch.cuda._sleep(int(2e9 * 0.25))   # ~250 ms of GPU held busy: the host runs ahead
            t0 = time.perf_counter(); fwd(); hosts.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            fwd(); torch.cuda.synchronize()
        ev = prof.key_averages()
        cuda_total = sum(e.self_device_time_total for e in ev) / 1e3
        launches = sum(e.count for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
        walls.sort(); hosts.sort()
        print(f"{tag}: wall {walls[len(walls)//2]:.2f} ms (min {walls[0]:.2f}), host enqueue {hosts[len(hosts)//2]:.2f} ms, "
              f"CUDA kernel total {cuda_total:.2f} ms, kernels {launches}", flush=True)
        print(ev.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))


measure("eager")
report = fusebox.patch(model)
measure("patched")
