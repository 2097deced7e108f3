"""Host cost of a compiled decode step's guards and call wrapper, unpatched against
fusebox-patched, without a GPU.

The decode step is compiled with ``fullgraph=True`` and a backend that returns the graph's
outputs from its one run, so a call costs only dynamo's guard check and the frame's entry and
exit. A small-width Llama with the real layer count keeps the guard structure of the full model
(guards grow with layers and modules, not with widths). Each variant runs in its own process;
the script alternates them.

    python scripts/guard_cost.py [--layers 32] [--rounds 3] [--against OTHER/torch-ext]

``--against`` adds a column patched by another checkout's fusebox (e.g. a worktree of an
earlier commit, its library copied in), timed in the same rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Tuple


def one_variant(patched: bool, layers: int, calls: int) -> Tuple[float, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    import fusebox

    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                      max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    if patched:
        fusebox.patch(model)

    def cached_outputs(gm, example_inputs):
        outputs = gm(*example_inputs)
        return lambda *args: outputs

    cache = StaticCache(config=cfg, max_cache_len=64)
    token, position = torch.randint(0, 256, (1, 1)), torch.tensor([8])
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 8)), past_key_values=cache, use_cache=True,
              cache_position=torch.arange(8))
        step = torch.compile(model.forward, fullgraph=True, backend=cached_outputs)
        times = []
        for i in range(calls + 3):
            start = time.perf_counter()
            step(token, past_key_values=cache, use_cache=True, cache_position=position)
            if i >= 3:
                times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6, min(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--against", metavar="TORCH_EXT",
                        help="also patch with the fusebox package under this folder")
    parser.add_argument("--variant", choices=["unpatched", "patched"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print("%.1f %.1f" % one_variant(args.variant == "patched", args.layers, args.calls))
        return

    def env_for(torch_ext: str) -> dict:
        path = os.pathsep.join(filter(None, [torch_ext, os.environ.get("PYTHONPATH")]))
        return dict(os.environ, PYTHONPATH=path)

    here = str(Path(__file__).resolve().parents[1] / "torch-ext")
    columns = {"unpatched": ("unpatched", here), "patched": ("patched", here)}
    if args.against:
        columns["patched by " + args.against] = ("patched", args.against)
    results = {label: [] for label in columns}
    for _ in range(args.rounds):
        for label, (variant, torch_ext) in columns.items():
            child = subprocess.run([sys.executable, __file__, "--variant", variant, "--layers",
                                    str(args.layers), "--calls", str(args.calls)],
                                   capture_output=True, text=True, check=True,
                                   env=env_for(torch_ext))
            results[label].append(tuple(map(float, child.stdout.strip().splitlines()[-1].split())))
    print(f"Llama, {args.layers} layers, compiled decode step with cached outputs: us a call "
          f"(guard check + call wrapper), median / fastest of {args.calls} calls, one process per "
          f"value (the fastest is the steadier figure on a busy host)")
    for label, values in results.items():
        print(f"  {label}\n    " + "  ".join(f"{m:7.1f} /{f:6.1f}" for m, f in values))


if __name__ == "__main__":
    main()
