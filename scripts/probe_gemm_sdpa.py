"""Two probes behind choices in the DiT and LLM patches (H200 results in
bench/results/*/tune/gemm_bias_and_sdpa.txt), kernel time by CUDA events, median, bf16:

- GEMMs of the models' projections with the bias in the GEMM (``F.linear``: cuBLASLt's bias
  epilogue), without bias (``mm``), and as ``addmm``: would moving every bias into the next
  memory-bound kernel pay?
- ``scaled_dot_product_attention`` at the models' attention shapes on ``[B, S, H, D]`` views
  (the layout the attention processors pass), with each backend forced: what does each cost?

    python scripts/probe_gemm_sdpa.py
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ffn_gelu import time_us  # scripts/ffn_gelu.py: the benchmark's event timer

GEMMS = {  # name: (M, K, N)
    "ltx qkvo": (5376, 2048, 2048), "ltx ff-down": (5376, 8192, 2048),
    "ltx ff-up": (5376, 2048, 8192), "flux qkv": (4608, 3072, 3072),
    "flux ff-down": (4608, 12288, 3072), "wan1.3b qkvo": (32760, 1536, 1536),
    "wan1.3b ff-down": (32760, 8960, 1536), "qwen3 q": (2048, 4096, 4096),
    "qwen3 down": (2048, 12288, 4096),
}
ATTENTION = {  # name: (B, H, S, D); qwen3 is causal
    "ltx": (2, 32, 2688, 64), "ltx-long": (2, 32, 8064, 64), "flux": (1, 24, 4608, 128),
    "wan1.3b": (1, 12, 32760, 128), "sd3.5": (2, 38, 4429, 64), "qwen3 prefill": (1, 32, 2048, 128),
}


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_gemm_sdpa: no CUDA GPU; nothing to time")
        return 0
    dt = torch.bfloat16
    print("GEMM: F.linear with bias (Lt bias epilogue) vs mm without bias")
    for name, (m, k, n) in GEMMS.items():
        x = torch.randn(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
        b = torch.randn(n, device="cuda", dtype=dt)
        biased, plain = time_us(lambda: F.linear(x, w, b), 5, 30), time_us(lambda: F.linear(x, w), 5, 30)
        addmm = time_us(lambda: torch.addmm(b, x, w.t()), 5, 30)
        print(f"{name:16s} {m}x{k}->{n}: linear+bias {biased:8.1f}  mm {plain:8.1f}  addmm {addmm:8.1f}"
              f"  bias/mm {biased / plain:.3f}  tflops(mm) {2 * m * k * n / plain / 1e6:.0f}")
    print("SDPA backends (B,H,S,D), bf16")
    for name, (b, h, s, d) in ATTENTION.items():
        causal = name.startswith("qwen")
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt).transpose(1, 2) for _ in range(3))
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        row = []
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel(backend):
                    us = time_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), 5, 10)
                row.append(f"{backend.name[:6]} {us:8.1f} ({flops / us / 1e6:.0f} TF/s)")
            except RuntimeError as ex:
                row.append(f"{backend.name[:6]} err {str(ex)[:60]}")
        print(f"{name:14s}", " | ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
