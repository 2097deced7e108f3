"""``fusebox bench``: kernel benchmarks against eager HF/diffusers code, the fused PyTorch op,
torch.compile and Liger-Kernel.

Modules: ``suite`` (the op registry and shapes), ``baselines`` (the eager reference code and
Liger adapters), ``timing`` (CUDA-event / graph / host timing, L2 handling, copy bandwidth and
launch calibration), ``runner`` (one case end to end), ``report`` (derived numbers, JSON,
markdown, plots), ``cli`` (the command). Importing this package does not load the fusebox
operators.
"""


def main(argv=None) -> int:
    from .cli import main as _main

    return _main(argv)


__all__ = ["main"]
