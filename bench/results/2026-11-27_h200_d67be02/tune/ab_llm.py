"""Patched prefill with and without the grouped masked SDPA path and rms_norm_add, alternating
in one process; regional compile of the unpatched model beside them."""
import statistics, sys, time
import torch, fusebox
from fusebox.bench.e2e import llm as e2e
from fusebox.patch import llm

rotary_form = llm._rotary_form
new = {"applies": llm._grouped_masked_sdpa_applies, "norm_add": llm._norm_add, "rotary": rotary_form}
old = {"applies": lambda *a, **k: False, "norm_add": lambda norm, style, x, residual: residual + norm(x),
       "rotary": lambda m: rotary_form(m)[:2] + (False,)}

def use(model, v):
    fusebox.unpatch(model)
    llm._grouped_masked_sdpa_applies, llm._norm_add, llm._rotary_form = v["applies"], v["norm_add"], v["rotary"]
    fusebox.patch(model)

def prefill_ms(call, n=10):
    for _ in range(3): call()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); call(); torch.cuda.synchronize(); ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts), min(ts)

for name in sys.argv[1].split(","):
    model = e2e.build_model(name, torch.device("cuda"), torch.bfloat16).to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 2048), device="cuda")
    call = lambda: model(ids, use_cache=False, logits_to_keep=1)
    with torch.inference_mode():
        ref = call().logits.float()
        print(name, "eager %.2f ms (min %.2f)" % prefill_ms(call), flush=True)
        with e2e._compiled_layers(model):
            print(name, "compile-regional %.2f ms (min %.2f)" % prefill_ms(call), flush=True)
        torch._dynamo.reset()
        print(fusebox.patch(model))
        outs = {}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call(); torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print(name, "patched after: %.2f ms of kernels in %d launches" % (sum(e.device_time for e in ev) / 1e3, len(ev)))
        for r in range(3):
            for label, v in (("before", old), ("after", new)):
                use(model, v)
                outs[label] = call().logits.float()
                print(name, f"round {r} patched {label}: %.2f ms (min %.2f)" % prefill_ms(call), flush=True)
        for label, o in outs.items():
            print(name, label, "rel diff vs eager bf16 %.4f" % ((o - ref).norm() / ref.norm()).item())
    del model
    torch.cuda.empty_cache()
