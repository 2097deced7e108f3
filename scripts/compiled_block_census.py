"""What Inductor makes of each DiT family's blocks, patched and unpatched, on the CPU: the tiny
models of ``compat_sweep_dit.py`` compiled by blocks (``compile_repeated_blocks``, as ``fusebox
bench e2e``'s regional compile), one forward, and per model the generated kernels, fusebox
operators and extern calls. The kernels of the patched model that only move data (``cat``,
``clone``, ``repeat``...: a conversion the eager layers may share once a forward but each
compiled block repeats) are listed by name. No GPU needed: the CPU code shows the same graph
Inductor builds for a GPU, not its kernels' speed.

    PYTHONPATH=torch-ext python scripts/compiled_block_census.py [NAME ...] [--code DIR]

NAME is a case-insensitive part of a class name (default: every class with tiny inputs and
repeated blocks); ``--code DIR`` writes each model's generated code there.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from collections import Counter

import torch
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compat_sweep_dit as sweep  # noqa: E402

MOVES_DATA = re.compile(r"_(cat|repeat|clone|copy|stack|index|expand)_")


def census(cls, config, make_inputs, patched: bool):
    """(graphs, kernel names, fusebox operator counts, extern call counts, code) of one
    compiled forward."""
    import fusebox

    model = sweep.build(cls, config)
    if patched:
        fusebox.patch(model)
    model.compile_repeated_blocks(fullgraph=True)
    torch._dynamo.reset()
    _, codes = run_and_get_code(lambda: sweep.forward(model, make_inputs))
    code = "\n".join(codes)
    return (len(codes), re.findall(r"\n\s+(cpp_fused_\w+)\(", code),
            Counter(re.findall(r"torch\.ops\.fusebox\.(\w+)\.default\(", code)),
            Counter(re.findall(r"extern_kernels\.(\w+)\(", code)), code)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*")
    ap.add_argument("--code", metavar="DIR", help="write each model's generated code here")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    for name, cls in sweep.model_classes().items():
        if args.names and not any(n.lower() in name.lower() for n in args.names):
            continue
        if name not in sweep.TINY or not getattr(cls, "_repeated_blocks", None):
            continue
        config, make_inputs = sweep.TINY[name]
        try:
            runs = {p: census(cls, config, make_inputs, p) for p in (False, True)}
        except Exception as e:  # noqa: BLE001
            print(f"{name}: not compiled ({type(e).__name__}: {str(e)[:160]})")
            continue
        for patched, (graphs, kernels, ops, extern, code) in runs.items():
            label = "patched" if patched else "unpatched"
            print(f"{name} {label}: {graphs} graphs, {len(kernels)} generated kernels, "
                  f"fusebox {dict(ops)}, extern {dict(extern)}")
            if args.code:
                os.makedirs(args.code, exist_ok=True)
                with open(os.path.join(args.code, f"{name}_{label}.py"), "w") as f:
                    f.write(code)
        movers = Counter(re.sub(r"_\d+$", "", k) for k in runs[True][1]
                         if MOVES_DATA.search(k) and "scaled_dot" not in k)
        print(f"  patched, data movement: {dict(movers.most_common()) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
