"""diffusers transformers (video and image DiTs) on fusebox.

Each model family has a module here providing ``applies(model) -> bool`` (the class is one it
knows) and ``patch(model, report, **options)`` (fuses that family's block chain: norm +
modulation, gated residual + next norm, q/k norm + RoPE). After the family patcher,
:mod:`._modules` replaces the forwards of generic diffusers modules (RMSNorm, LayerNorm,
AdaLayerNorm variants, the feed-forward GELU/GEGLU/SwiGLU) that the family patcher did not
already cover, so a model of an unknown family still gets its norms and activations fused. A family patcher marks the modules
whose work its fused forwards do (``_shared.mark_fused``), so the generic pass leaves them alone.
The helpers the patchers share live in :mod:`._shared`.
"""

from __future__ import annotations

import importlib
from typing import List

import torch

FAMILY_MODULES = ("ltx", "ltx2", "wan", "flux", "chroma", "flux2", "sd3", "pixart",
                  "hunyuan_video", "hunyuan_video15", "hunyuan_image", "qwen_image", "z_image",
                  "krea2", "flux3", "mochi", "cogvideox")


def _families() -> List[object]:
    out = []
    for name in FAMILY_MODULES:
        try:
            out.append(importlib.import_module(f"{__name__}.{name}"))
        except ImportError:
            continue
    return out


def _is_diffusers_model(module: torch.nn.Module) -> bool:
    return any(c.__module__.startswith("diffusers.") for c in type(module).__mro__)


def applies(module: torch.nn.Module) -> bool:
    return _is_diffusers_model(module)


def patch(module: torch.nn.Module, report, **options) -> None:
    family = next((f for f in _families() if f.applies(module)), None)
    if family is not None:
        family.patch(module, report, **options)
    else:
        report.note(f"{type(module).__name__}: no block-level fusion for this class; "
                    "generic diffusers modules only")
    try:
        from . import _modules
    except ImportError:
        return
    _modules.patch_generic(module, report, **options)
