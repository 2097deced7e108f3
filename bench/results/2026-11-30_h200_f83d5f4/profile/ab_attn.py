"""profile_e2e.py --graphs with one more label: patched-noattn (patched, then the attention unpatched)."""
import runpy, sys
import torch
import fusebox
from fusebox.bench.e2e import llm

orig = llm._set_variant

def set_variant(model, variant):
    if variant != "patched-noattn":
        return orig(model, variant)
    orig(model, "patched")
    n = sum(fusebox.unpatch(m) for name, m in model.named_modules() if name.endswith("self_attn"))
    print("attention modules restored:", n)
    model.__dict__.pop("_compiled_call", None)
    torch._dynamo.reset()

llm._set_variant = set_variant
sys.argv = ["profile_e2e.py"] + sys.argv[1:]
runpy.run_path("scripts/profile_e2e.py", run_name="__main__")
