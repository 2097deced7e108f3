"""What the general row split costs the per-sample modulated norm rows of two samples
(LTX-Video's classifier-free-guidance batch). The same bytes timed three ways, as the bench
times (L2 flushed, CUDA events), twice each:

- [2, S, D] rows with [2, 1, D] modulation: the general row split;
- [1, 2S, D] rows with one [1, 1, D] modulation row: the flat twin (not the same result: it
  shows what the split costs, the ceiling of a flat path for sample batches);
- two launches of one sample each (flat twins).

A tuning aid, not the benchmark.   python scripts/sample_split_cost.py
"""

from __future__ import annotations


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("sample_split_cost: no CUDA device; this script times GPU kernels")
    import fusebox
    from fusebox.bench.timing import Timer

    timer = Timer(warmup=10, iters=100)
    cal = timer.calibrate()
    print(f"copy {cal['copy_tbps']:.2f} TB/s, launch {cal['launch_us']:.2f} us")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * scale

    width, norm = 2048, "rms"
    for name, seq in (("ltx", 2688), ("ltx-long", 8064)):
        x, branch = randn(2, seq, width), randn(2, seq, width)
        gate, scale, shift = (randn(2, 1, width, scale=0.1) for _ in range(3))
        x1, branch1 = x.view(1, 2 * seq, width), branch.view(1, 2 * seq, width)
        adaln, grn = fusebox.adaln, fusebox.gated_residual_norm
        cases = {
            "adaln general [2,S,D]": lambda: adaln(x, scale, shift, None, None, norm),
            "adaln flat [1,2S,D]": lambda: adaln(x1, scale[:1], shift[:1], None, None, norm),
            "adaln 2 launches": lambda: [adaln(x[i:i + 1], scale[i:i + 1], shift[i:i + 1], None, None, norm)
                                         for i in range(2)],
            "grn general [2,S,D]": lambda: grn(x, branch, gate, scale, shift, norm_type=norm),
            "grn flat [1,2S,D]": lambda: grn(x1, branch1, gate[:1], scale[:1], shift[:1], norm_type=norm),
            "grn 2 launches": lambda: [grn(x[i:i + 1], branch[i:i + 1], gate[i:i + 1], scale[i:i + 1],
                                           shift[i:i + 1], norm_type=norm) for i in range(2)],
        }
        for label, fn in cases.items():
            with torch.no_grad():
                us = [timer.measure(lambda _: fn(), [None], flush=True, small=False)["us"] for _ in range(2)]
            print(f"{name:9s} {label:24s} {us[0]:8.2f} {us[1]:8.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
