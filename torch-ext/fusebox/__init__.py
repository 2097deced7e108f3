"""fusebox: fused CUDA kernels for the memory-bound layers of transformers and diffusers
models, as PyTorch operators (eager and torch.compile)."""

from ._ops import LIBRARY_PATH, LOAD_ERROR, LOADED_HERE, ops

if LOADED_HERE:  # (an HF kernels build that loaded the library has registered them)
    from . import _fake  # noqa: F401  (registers the fake implementations)
from .functional import (
    activation,
    adaln,
    adaln_layernorm,
    adaln_rmsnorm,
    adaln_zero,
    fused_add_rms_norm,
    gated_activation,
    gated_activation_packed,
    gated_residual,
    gated_residual_norm,
    geglu,
    gelu_tanh,
    layer_norm,
    moe_combine,
    moe_sort,
    moe_topk,
    qk_norm_rope,
    rms_norm,
    rms_norm_add,
    rmsnorm,
    rmsnorm_residual,
    rope,
    rope_1d,
    rope_3d,
    silu_and_mul,
    swiglu,
)
from .patch import PatchReport, is_patched, patch, unpatch

__version__ = "0.1.0"

__all__ = [
    "LIBRARY_PATH",
    "LOAD_ERROR",
    "PatchReport",
    "activation",
    "adaln",
    "adaln_layernorm",
    "adaln_rmsnorm",
    "adaln_zero",
    "fused_add_rms_norm",
    "gated_activation",
    "gated_activation_packed",
    "gated_residual",
    "gated_residual_norm",
    "geglu",
    "gelu_tanh",
    "is_patched",
    "layer_norm",
    "moe_combine",
    "moe_sort",
    "moe_topk",
    "ops",
    "patch",
    "qk_norm_rope",
    "rms_norm",
    "rms_norm_add",
    "rmsnorm",
    "rmsnorm_residual",
    "rope",
    "rope_1d",
    "rope_3d",
    "silu_and_mul",
    "swiglu",
    "unpatch",
]
