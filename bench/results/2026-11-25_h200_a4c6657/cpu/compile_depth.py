"""Whole-model torch.compile (inductor, CPU) of the patched tiny LTX-Video config at several
depths, with fusebox's inductor fallbacks registered (default) or not (--no-fallbacks), and
whether inductor's implicit fallback (its operator_str message) ran for a fusebox operator.

    PYTHONPATH=torch-ext python compile_depth.py LAYERS [--no-fallbacks]
"""
import dataclasses
import sys
import time

import torch
import torch._inductor.exc as exc

import fusebox
from fusebox import _inductor
from fusebox.bench.e2e import dit

layers = int(sys.argv[1])
if "--no-fallbacks" in sys.argv:
    _inductor.register_fallbacks = lambda: None
implicit = []
real = exc.OperatorIssue.operator_str


def spy(target, args, kwargs):
    implicit.append(str(target))
    print(f"  implicit fallback: {target}", flush=True)
    return real(target, args, kwargs)


exc.OperatorIssue.operator_str = staticmethod(spy)
spec = dit.SPECS["tiny-dit"]
spec = dataclasses.replace(spec, config=dict(spec.config, num_layers=layers))
model = dit.build(spec, torch.device("cpu"), torch.float32)
inputs = spec.inputs(torch.device("cpu"), torch.float32)
fusebox.patch(model)
with torch._inductor.config.patch(fx_graph_cache=False), torch.inference_mode():
    t0 = time.time()
    torch.compile(model, fullgraph=True)(**inputs)
print(f"layers {layers}, fallbacks {'off' if '--no-fallbacks' in sys.argv else 'on'}: "
      f"compile {time.time() - t0:.1f} s, implicit fallbacks for fusebox ops: "
      f"{sum(t.startswith('fusebox.') for t in implicit)}", flush=True)
