"""Times the first projection of a DiT feed-forward with its GELU-tanh (``GELU(proj(x))`` in
diffusers' FeedForward, FLUX's single-block ``act_mlp(proj_mlp(x))``) at the models' shapes, each
way fusebox or a baseline can run it, side by side in one process:

- ``eager``: the module as diffusers writes it (``F.linear`` with its bias, then ``F.gelu``);
- ``compile``: ``torch.compile`` of that;
- ``gemm + pass``: the product without bias, then fusebox's bias + GELU pass;
- ``epilogue``: one GEMM whose epilogue adds the bias and applies the GELU (what a patched
  model runs on CUDA);
- ``gemm alone``: ``F.linear`` with the bias and no GELU, the GEMM's own time for reference.

Kernel time by CUDA events, median of the timed calls, warm L2 (the GEMMs dominate).

    python scripts/ffn_gelu.py --out bench/results/<dir>/ffn_gelu
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

# name: (tokens, in width, out width)
SHAPES = {
    "ltx 2x2688": (2 * 2688, 2048, 8192),
    "flux 4608": (4608, 3072, 12288),
    "sd3.5 2x4096": (2 * 4096, 2432, 9728),
    "pixart 2x4096": (2 * 4096, 1152, 4608),
    "wan1.3b 32760": (32760, 1536, 8960),
    "wan14b 32760": (32760, 5120, 13824),
}


def time_us(fn, warmup: int = 5, iters: int = 30) -> float:
    """Median kernel time of ``fn()`` by the benchmark's event timer, L2 left warm."""
    from fusebox.bench.timing import Timer

    return Timer(warmup=warmup, iters=iters).measure(lambda _: fn(), [None], flush=False,
                                                     small=False)["us"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for ffn_gelu.json and ffn_gelu.md")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("ffn_gelu: no CUDA GPU; nothing to time")
        return 0
    import fusebox.functional as fb
    from fusebox.patch.dit import _shared

    dtype = torch.bfloat16
    rows = []
    for name, (m, k, n) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
        proj = torch.nn.Linear(k, n, device="cuda", dtype=dtype)
        act = torch.nn.GELU(approximate="tanh")

        def eager():
            return act(proj(x))

        compiled = torch.compile(eager)

        def gemm_pass():
            return fb.activation(F.linear(x, proj.weight), proj.bias, "gelu_tanh")

        def epilogue():
            return _shared.linear_gelu(proj, x, "tanh")

        def gemm_alone():
            return proj(x)

        impls = {"eager": eager, "compile": compiled, "gemm + pass": gemm_pass,
                 "epilogue": epilogue, "gemm alone": gemm_alone}
        with torch.no_grad():
            ref = eager().float()
            row = {"case": name, "m": m, "k": k, "n": n, "us": {}, "max_abs_diff_vs_eager": {}}
            for label, fn in impls.items():
                row["us"][label] = time_us(fn, 5, args.iters)
                row["max_abs_diff_vs_eager"][label] = (fn().float() - ref).abs().max().item()
        row["tflops_epilogue"] = 2 * m * k * n / row["us"]["epilogue"] / 1e6
        rows.append(row)
        print(name, {k_: round(v, 1) for k_, v in row["us"].items()}, flush=True)

    labels = list(rows[0]["us"])
    lines = ["| case | M x K -> N | " + " | ".join(f"{l} us" for l in labels)
             + " | epilogue vs eager | vs compile | vs gemm + pass | epilogue TFLOP/s |",
             "|---|---|" + "---:|" * (len(labels) + 4)]
    for r in rows:
        u = r["us"]
        lines.append(f"| {r['case']} | {r['m']}x{r['k']} -> {r['n']} | "
                     + " | ".join(f"{u[l]:.1f}" for l in labels)
                     + f" | {u['eager'] / u['epilogue']:.2f}x | {u['compile'] / u['epilogue']:.2f}x"
                     f" | {u['gemm + pass'] / u['epilogue']:.2f}x | {r['tflops_epilogue']:.0f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bf16"}
        with open(os.path.join(args.out, "ffn_gelu.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "ffn_gelu.md"), "w") as f:
            f.write(f"# DiT feed-forward projection + GELU-tanh ({meta['gpu']}, torch {meta['torch']}, bf16)\n\n")
            f.write(__doc__.split("\n\n    python")[0] + "\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
