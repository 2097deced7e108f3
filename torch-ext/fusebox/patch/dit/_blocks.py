"""Pieces the block-level family patchers share: when a fused forward may run, handing the
children a block absorbed to the block, the GELU-tanh feed-forward, and attention processors
that fall back to (and are undone into) the processor they replaced."""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from ... import functional as fb
from .._common import has_hooks, needs_autograd, original_forward, replace_forward

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fusable(x: torch.Tensor, *operands: Optional[torch.Tensor]) -> bool:
    """Can the fusebox ops take ``x`` and its small operands (weights, modulation, tables)?
    Each operand must sit on x's device in fp32 or x's dtype; anything else (fp64, a weight an
    offload hook has not loaded yet) runs the original code."""
    if x.dtype not in FUSED_DTYPES or x.device.type not in ("cpu", "cuda"):
        return False
    return all(t is None or (t.device == x.device and t.dtype in (torch.float32, x.dtype))
               for t in operands)


def grad_needed(module: torch.nn.Module, *tensors: Optional[torch.Tensor]) -> bool:
    """Must this call be differentiable (through its inputs or the module's parameters)?"""
    if not torch.is_grad_enabled():
        return False
    return needs_autograd(*tensors) or any(p.requires_grad for p in module.parameters())


def rms_eps(norm: torch.nn.Module) -> float:
    """``torch.nn.RMSNorm`` takes ``eps=None`` as the fp32 machine epsilon."""
    eps = getattr(norm, "eps", None)
    return torch.finfo(torch.float32).eps if eps is None else float(eps)


def _runs_original(module, *args, **kwargs):
    return original_forward(module)(*args, **kwargs)


def absorb(child: torch.nn.Module, owner: str) -> None:
    """Marks a module whose work the fused forward of ``owner`` does, so the generic module
    pass leaves it alone; called on its own (or by a falling-back owner) it runs its original
    forward. Undone by :func:`fusebox.unpatch` like any replaced forward."""
    replace_forward(child, _runs_original, f"fused into {owner}")


def forward_parameters(fn) -> list:
    """Parameter names of a forward (after self): a model-level fused forward mirrors one
    diffusers version and is only installed where the signature still matches."""
    fn = inspect.unwrap(fn)
    return list(inspect.signature(fn).parameters)[1:]


# --------------------------------------------------------------------------- feed-forward


def gelu_tanh_projection(ff: torch.nn.Module) -> Optional[torch.nn.Linear]:
    """The input projection of a diffusers ``FeedForward(activation_fn="gelu-approximate")``,
    or None for any other feed-forward."""
    net = getattr(ff, "net", None)
    act = net[0] if net is not None and len(net) > 0 else None
    if type(act).__name__ != "GELU" or getattr(act, "approximate", None) != "tanh":
        return None
    proj = getattr(act, "proj", None)
    return proj if isinstance(proj, torch.nn.Linear) else None


def feed_forward(ff: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``ff(x)`` with the GELU-tanh fused: the projection's bias is added inside the activation
    (one pass over the [S, 4D] tensor instead of three). Modules carrying hooks are called as
    modules so their hooks (offload, LoRA scaling) still run."""
    proj = gelu_tanh_projection(ff)
    if proj is None or has_hooks(ff) or has_hooks(ff.net[0]):
        return ff(x)
    if type(proj) is torch.nn.Linear and not has_hooks(proj) and fusable(x, proj.weight, proj.bias):
        h = fb.gelu_tanh(F.linear(x, proj.weight), proj.bias)
    else:
        h = proj(x)
        h = fb.gelu_tanh(h) if fusable(h) else F.gelu(h, approximate="tanh")
    for layer in ff.net[1:]:
        h = layer(h)
    return h


# --------------------------------------------------------------------------- attention


class FusedAttnProcessor:
    """Base of the fused attention processors. Keeps the processor it replaced (``original``)
    for the calls it cannot fuse, and shares its attention backend and parallel config, so
    ``model.set_attention_backend(...)`` reaches both."""

    def __init__(self, original):
        self.original = original

    @property
    def _attention_backend(self):
        return getattr(self.original, "_attention_backend", None)

    @_attention_backend.setter
    def _attention_backend(self, value):
        self.original._attention_backend = value

    @property
    def _parallel_config(self):
        return getattr(self.original, "_parallel_config", None)

    @_parallel_config.setter
    def _parallel_config(self, value):
        self.original._parallel_config = value


def original_processor(attn: torch.nn.Module):
    """The processor fusebox did not put there (a patched model is patched again cleanly)."""
    processor = attn.processor
    return processor.original if isinstance(processor, FusedAttnProcessor) else processor


def install_processor(attn: torch.nn.Module, processor: FusedAttnProcessor) -> None:
    """Sets ``processor`` on ``attn``; :func:`fusebox.unpatch` puts the original back."""
    attn.set_processor(processor)
    attn.__dict__["_fusebox_undo"] = lambda: attn.set_processor(processor.original)


def attention_unfusable(attn: torch.nn.Module, processor_class: str) -> str:
    """Why an attention module keeps its processor ("" when the fused one can replace it)."""
    processor = original_processor(attn)
    if type(processor).__name__ != processor_class:
        return f"custom processor {type(processor).__name__}"
    norms = (getattr(attn, "norm_q", None), getattr(attn, "norm_k", None))
    if not all(isinstance(n, torch.nn.RMSNorm) for n in norms):
        return "q/k norms are not torch.nn.RMSNorm"
    if rms_eps(norms[0]) != rms_eps(norms[1]):
        return "q and k norms have different eps"     # one eps per fused q/k launch
    return ""


def rms_norm_module(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` for a ``torch.nn.RMSNorm`` on fusebox (fp32 math, x's dtype out)."""
    return fb.rms_norm(x, norm.weight, rms_eps(norm))
