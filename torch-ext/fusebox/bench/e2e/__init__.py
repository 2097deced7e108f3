"""``fusebox bench e2e``: whole models built from their real configs with random weights (no
downloads), timed as eager, patched (``fusebox.patch``), torch.compile and patched +
torch.compile, with the patched-vs-unpatched output difference beside the bf16 spread.

Each family module (``llm``: transformers decoder LLMs; ``dit``: diffusers transformers)
provides ``MODELS`` (name -> one-line description) and ``run(name, args) -> dict`` (the result
record); this module owns the command line and the result files.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Dict, Optional, Sequence

FAMILY_MODULES = ("fusebox.bench.e2e.llm", "fusebox.bench.e2e.dit")


def families() -> Dict[str, object]:
    """model name -> family module."""
    out = {}
    for name in FAMILY_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for model in getattr(mod, "MODELS", {}):
            out[model] = mod
    return out


def build_parser(models: Dict[str, object]) -> argparse.ArgumentParser:
    lines = [f"  {m:<16} {getattr(f, 'MODELS')[m]}" for m, f in models.items()]
    p = argparse.ArgumentParser(
        prog="fusebox bench e2e",
        description="End-to-end timing of a model built from its real config with random "
                    "weights: eager, fusebox-patched, torch.compile, patched + torch.compile.",
        epilog="models:\n" + "\n".join(lines),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="model name (see below); comma-separated for several; tiny = every tiny-* config")
    p.add_argument("--variants", default=None,
                   help="comma-separated subset of eager, patched, compile, patched+compile; "
                        "diffusers models add compile-regional, graphs and their patched+ forms, "
                        "LLMs graphs and patched+graphs (default: each family's own set)")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--quick", action="store_true", help="fewer iterations and smaller workloads")
    p.add_argument("--out", default=None, help="results folder (default: bench/results/<date>_<gpu>_<commit>_e2e/)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--attention-backend", default=None, metavar="NAME",
                   help="diffusers models: the attention backend every variant runs "
                        "(model.set_attention_backend, e.g. _native_cudnn; default: diffusers' own)")
    p.add_argument("--same-process", action="store_true",
                   help="LLMs: time the variants that compile (compile, CUDA graphs) in this "
                        "process too (by default each runs in a process of its own)")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="run the variants N times, every other round in the reverse order, "
                        "and report each variant's median over the rounds (a variant's place in "
                        "the run can move its time by a few percent); LLMs: the variants timed "
                        "in processes of their own (compile, CUDA graphs), a process each a round")
    p.add_argument("--pipeline", action="store_true",
                   help="diffusers models: also run the full pipeline and write its output file")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    models = families()
    parser = build_parser(models)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.rounds < 1:
        parser.error(f"--rounds must be 1 or more; got {args.rounds}")
    names = []
    for m in (m.strip() for m in args.model.split(",")):
        # "tiny": the small functional configs of every family (tiny-llm, tiny-dit)
        names += sorted(n for n in models if n.startswith("tiny-")) if m == "tiny" else [m] if m else []
    unknown = [m for m in names if m not in models]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(models)}")
    import torch

    from . import common

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fusebox bench e2e: no CUDA GPU found; nothing was timed. Use --device cpu --model tiny "
              "for a functional run on the CPU.")
        return 0
    records = []
    for name in names:
        print(f"== {name} ({models[name].MODELS[name]})", flush=True)
        rec = models[name].run(name, args)
        records.append(rec)
        print("\n".join(common.format_record(rec)), flush=True)
    out_dir = args.out or common.default_out_dir()
    paths = common.write_results(out_dir, records)
    print(f"wrote {', '.join(os.path.basename(p) for p in paths)} to {out_dir}")
    return 0
