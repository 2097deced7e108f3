"""Times the modulation work of one Wan-family block with per-token modulation, two ways in one
process: the fp32 terms written first (``table.float() + temb``, then the fused ops read them)
and split modulation (the fused ops take the table's rows and the 16-bit projection and add
them where they use them). Checks that both give the same outputs bit for bit.

    python scripts/split_modulation_ab.py [--reps 15]

Per block the work is adaln (norm1), gated_residual_norm (attention gate, affine norm2),
gated_residual_norm (norm3 with the feed-forward's scale and shift) and gated_residual (the
feed-forward gate), as ``fusebox.patch`` runs a Wan / SkyReels-V2 block.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import fusebox as fb

# name: (tokens, width, terms first ([B, 6, S, D], SkyReels-V2) or not ([B, S, 6, D], Wan 2.2))
CASES = {
    "skyreels-v2 1.3b, 51000 tokens": (51000, 1536, True),
    "wan2.2 ti2v 5b, 27280 tokens": (27280, 3072, False),
    "wan 14b per token, 32760 tokens": (32760, 5120, False),
}


def block_ops(x, attn, ff, terms, tables, w, b):
    shift, scale, gate, c_shift, c_scale, c_gate = terms
    t = tables
    n = fb.adaln(x, scale, shift, norm_type="layer", scale_table=t[1], shift_table=t[0])
    n, h = fb.gated_residual_norm(x, attn, gate, weight=w, bias=b, norm_type="layer", gate_table=t[2])
    n2, h = fb.gated_residual_norm(h, attn, None, c_scale, c_shift, norm_type="layer",
                                   scale_table=t[4], shift_table=t[3])
    return n, n2, fb.gated_residual(h, ff, c_gate, t[5])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; median of {args.reps} block passes, ms")
    print("| case | fp32 terms written | split | ratio | outputs equal |")
    print("|---|---:|---:|---:|---|")
    for name, (s, d, terms_first) in CASES.items():
        r = lambda *shape, dt=torch.bfloat16: torch.randn(*shape, generator=g, device=dev).to(dt)  # noqa: E731
        x, attn, ff = r(1, s, d), r(1, s, d), r(1, s, d)
        table = r(1, 6, d, dt=torch.float32) * 0.1
        temb = r(1, 6, s, d) if terms_first else r(1, s, 6, d)
        w, b = 1 + 0.1 * r(d, dt=torch.float32), 0.1 * r(d, dt=torch.float32)
        at = 1 if terms_first else 2

        def summed():
            terms = (table.unsqueeze(3 - at).float() + temb).chunk(6, dim=at)
            return block_ops(x, attn, ff, [t.squeeze(at) for t in terms], (None,) * 6, w, b)

        def split():
            return block_ops(x, attn, ff, temb.unbind(at), table.reshape(6, -1).unbind(0), w, b)

        equal = all(torch.equal(p, q) for p, q in zip(summed(), split()))
        times = {"summed": [], "split": []}
        for _ in range(args.reps):
            for key, fn in (("summed", summed), ("split", split)):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times[key].append(start.elapsed_time(end))
        a, c = statistics.median(times["summed"]), statistics.median(times["split"])
        print(f"| {name} | {a:.3f} | {c:.3f} | {a / c:.2f}x | {equal} |")


if __name__ == "__main__":
    main()
