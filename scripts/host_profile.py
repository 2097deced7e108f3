"""The host side of one end-to-end forward, eager and fusebox-patched: wall time and the host
time to enqueue a forward (the GPU held busy ahead by a sleep kernel, so no launch waits on it),
alternating in one process; synchronizing calls in one forward; a cProfile of each (Python
functions and the operators' host time); for PixArt-Sigma also the host time of single fused
calls against the eager code they replace. A diagnostic aid, not the benchmark.

    python scripts/host_profile.py --model pixart-sigma [--rounds 2] [--top 30]
    python scripts/host_profile.py --model pixart-sigma --layers 2 --size 64   # a small CPU run
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
import warnings

import torch

import fusebox
from fusebox.bench.e2e import dit


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def hold_gpu(cuda: bool) -> None:
    """About 100 ms of GPU work ahead of the host: the launches that follow queue behind it."""
    if cuda:
        torch.cuda._sleep(int(2e8))


def wall_and_host(forward, cuda: bool, label: str) -> None:
    with torch.inference_mode():
        for _ in range(3):
            forward()
        sync(cuda)
        walls, hosts = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            forward()
            sync(cuda)
            walls.append((time.perf_counter() - t0) * 1e3)
        for _ in range(5):
            hold_gpu(cuda)
            t0 = time.perf_counter()
            forward()
            hosts.append((time.perf_counter() - t0) * 1e3)
            sync(cuda)
    print(f"{label}: wall {statistics.median(walls):.2f} ms (min {min(walls):.2f}), "
          f"host enqueue {statistics.median(hosts):.2f} ms (min {min(hosts):.2f})", flush=True)


def sync_calls(forward, label: str) -> None:
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            forward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    print(f"{label}: synchronizing calls in one forward: {len(caught)}",
          *[str(w.message)[:150] for w in caught[:3]], sep="\n  ")


def python_profile(forward, cuda: bool, label: str, top: int) -> None:
    with torch.inference_mode():
        forward()
        sync(cuda)
        hold_gpu(cuda)
        prof = cProfile.Profile()
        prof.enable()
        forward()
        prof.disable()
        sync(cuda)
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(top)
        print(f"==== cProfile {label} ({order})")
        print("\n".join(text.getvalue().splitlines()[:top + 12]))


def pixart_single_calls(device, tokens: int) -> None:
    """Host time of one call of each fused operator a PixArt-Sigma block runs, against the eager
    code it replaces, at the block's shapes (bf16, [2, tokens, 1152], modulation views)."""
    import torch.nn.functional as F

    import fusebox.functional as fb

    d = 1152
    x = torch.randn(2, tokens, d, device=device, dtype=torch.bfloat16)
    branch = torch.randn_like(x)
    shift, scale, gate, shift2, scale2, _ = torch.randn(2, 6, d, device=device, dtype=torch.bfloat16).chunk(6, 1)
    w = torch.randn(4 * d, d, device=device, dtype=torch.bfloat16)
    bias = torch.randn(4 * d, device=device, dtype=torch.bfloat16)
    cases = {
        "fb.adaln": lambda: fb.adaln(x, scale, shift, None, None, "layer", 1e-6, out_dtype=torch.bfloat16),
        "eager ln*(1+s)+t": lambda: F.layer_norm(x, (d,), eps=1e-6) * (1 + scale) + shift,
        "fb.gated_residual": lambda: fb.gated_residual(x, branch, gate),
        "eager x+g*b": lambda: x + gate * branch,
        "fb.gated_residual_norm": lambda: fb.gated_residual_norm(x, branch, None, scale2, shift2, None, None,
                                                                 "layer", 1e-6, out_dtype=torch.bfloat16),
        "F.layer_norm": lambda: F.layer_norm(x, (d,), eps=1e-6),
        "torch.add": lambda: torch.add(x, branch),
        "F.linear": lambda: F.linear(x, w, bias),
        "_addmm_activation": lambda: torch._addmm_activation(bias, x.view(-1, d), w.t(), use_gelu=True),
    }
    with torch.inference_mode():
        for name, fn in cases.items():
            for _ in range(5):
                fn()
            sync(True)
            per_call = []
            for _ in range(5):
                hold_gpu(True)
                t0 = time.perf_counter()
                for _ in range(50):
                    fn()
                per_call.append((time.perf_counter() - t0) / 50 * 1e6)
                sync(True)
            print(f"host per call {name:26s} {statistics.median(per_call):7.1f} us (min {min(per_call):.1f})",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="pixart-sigma", help="a `fusebox bench e2e` DiT model")
    ap.add_argument("--layers", type=int, default=0, help="fewer blocks than the config's")
    ap.add_argument("--size", type=int, default=0, help="PixArt-Sigma only: the image size (default 1024)")
    ap.add_argument("--rounds", type=int, default=3, help="eager / patched alternations")
    ap.add_argument("--top", type=int, default=30, help="rows of each cProfile table")
    args = ap.parse_args()
    if args.size and args.model != "pixart-sigma":
        ap.error("--size builds PixArt-Sigma's inputs: use it with --model pixart-sigma")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    spec = dit.SPECS[args.model]
    if args.layers:
        spec.config["num_layers"] = args.layers
    make_inputs = dit._pixart_inputs(args.size) if args.size else spec.inputs
    inputs = make_inputs(device, torch.bfloat16)
    model = dit.build(spec, device, torch.bfloat16)

    def forward():
        return model(**inputs)

    for r in range(args.rounds):
        wall_and_host(forward, cuda, f"round {r} eager")
        fusebox.patch(model)
        wall_and_host(forward, cuda, f"round {r} patched")
        fusebox.unpatch(model)
    for label in ("eager", "patched"):
        if label == "patched":
            fusebox.patch(model)
        if cuda:
            sync_calls(forward, label)
        python_profile(forward, cuda, label, args.top)
    if cuda and args.model == "pixart-sigma":
        pixart_single_calls(device, (args.size or 1024) // 16 * ((args.size or 1024) // 16))


if __name__ == "__main__":
    main()
