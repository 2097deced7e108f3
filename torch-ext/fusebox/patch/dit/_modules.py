"""Generic diffusers modules on fusebox, and the fused pieces the family patchers share.

:func:`patch_generic` replaces the forwards of the building blocks every diffusers model is
made of (when a family patcher did not already cover them):

- ``normalization.RMSNorm`` -> ``rms_norm`` (weight may be None; the output dtype is the
  weight's, fp32 for an fp32 weight, as diffusers returns it);
- ``nn.LayerNorm`` / ``FP32LayerNorm`` -> ``layer_norm``;
- ``AdaLayerNormZero``, ``AdaLayerNormZeroSingle``, ``SD35AdaLayerNormZeroX``,
  ``AdaLayerNormContinuous``: the conditioning projection stays, ``norm(x) * (1 + scale) +
  shift`` becomes one ``adaln`` pass;
- ``activations.GELU``: the projection without its bias, then the bias + GELU in one pass;
  ``GEGLU`` / ``SwiGLU`` -> ``gated_activation_packed`` (gate = second half).

The helpers below (``modulated_norm``, ``gated_add``, ``gated_add_norm``, ``linear_gelu``,
``norm_rope``) compute the same formulas the diffusers code writes; each takes the fused path
when its operands allow (no autograd, supported dtypes, the model's output dtype reachable)
and otherwise runs the eager formula, so a patched block never changes what a model computes.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Tuple

import torch
from diffusers.models.activations import GEGLU, GELU, SwiGLU
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import (
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    AdaLayerNormZeroSingle,
    FP32LayerNorm,
    RMSNorm,
    SD35AdaLayerNormZeroX,
)

from ... import functional as F
from .._common import has_hooks, is_patched, needs_autograd, original_forward, replace_forward

Tensor = torch.Tensor
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FUSED_DEVICES = ("cpu", "cuda")
UNDO_ATTR = "_fusebox_undo"            # called by fusebox.unpatch
FUSED_INTO_ATTR = "_fusebox_fused_into"  # a module whose work a patched parent now does


# --------------------------------------------------------------------------- eligibility


def fusable(x: Tensor, *small: Optional[Tensor], like_x: Tuple[Optional[Tensor], ...] = ()) -> bool:
    """Can the fused path take ``x``? ``small`` operands (weights, scale/shift, tables) may be
    fp32 or x's dtype; ``like_x`` operands (branches, gates that the model adds in x's dtype)
    must have x's dtype; small operands need contiguous rows (large ones go through
    :func:`rows`). False when autograd must record the computation."""
    if needs_autograd(x, *small, *like_x):
        return False
    if x.dtype not in FUSED_DTYPES or x.device.type not in FUSED_DEVICES:
        return False
    if not all(t is None or t.dtype in (torch.float32, x.dtype) for t in small):
        return False
    if not all(t is None or t.dtype == x.dtype for t in like_x):
        return False
    return all(t is None or _unit_last_stride(t) for t in small)


def _unit_last_stride(t: Tensor) -> bool:
    return t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] == 1


def rows(t: Tensor) -> Tensor:
    """``t`` with contiguous rows, as the operators read them (a patch embedding's transposed
    output is copied once, as an eager norm would copy it)."""
    return t if _unit_last_stride(t) else t.contiguous()


def _out_dtype(x: Tensor, dtype: torch.dtype) -> Optional[torch.dtype]:
    """The ``out_dtype`` argument giving ``dtype`` (None for x's own dtype)."""
    return None if dtype == x.dtype else dtype


# --------------------------------------------------------------------------- undo bookkeeping


def _run_all(*fns: Callable) -> None:
    for fn in fns:
        fn()


def add_undo(module: torch.nn.Module, fn: Callable[[], None]) -> None:
    """Registers ``fn`` to run when :func:`fusebox.unpatch` reaches ``module``."""
    previous = module.__dict__.get(UNDO_ATTR)
    if previous is not None:
        fn = functools.partial(_run_all, previous, fn)
    module.__dict__[UNDO_ATTR] = fn


def mark_fused(module: torch.nn.Module, into: str) -> None:
    """Records that a patched parent does ``module``'s work (so the generic pass leaves it)."""
    if module.__dict__.get(FUSED_INTO_ATTR) == into:
        return
    module.__dict__[FUSED_INTO_ATTR] = into
    add_undo(module, functools.partial(module.__dict__.pop, FUSED_INTO_ATTR, None))


def install_processor(attn: torch.nn.Module, processor) -> None:
    """Gives ``attn`` a new processor that keeps the old one's attention backend and parallel
    config; unpatch puts the old processor object back."""
    old = attn.processor
    for name in ("_attention_backend", "_parallel_config"):
        setattr(processor, name, getattr(old, name, None))
    attn.set_processor(processor)
    add_undo(attn, functools.partial(attn.set_processor, old))


# --------------------------------------------------------------------------- norms


class NormParams(NamedTuple):
    kind: str                  # "layer" or "rms"
    weight: Optional[Tensor]
    bias: Optional[Tensor]
    eps: float
    dtype: torch.dtype         # what the module returns for this input


_LAYER_NORMS = (torch.nn.LayerNorm, FP32LayerNorm)


def norm_kind(norm: torch.nn.Module) -> Optional[str]:
    """The fused norm kind ("layer" or "rms") of a norm module, None if it has none."""
    if type(norm) in _LAYER_NORMS and len(norm.normalized_shape) == 1:
        return "layer"
    if type(norm) is RMSNorm and norm.bias is None and len(norm.dim) == 1:
        return "rms"
    return None


def norm_params(norm: torch.nn.Module, x: Tensor) -> Optional[NormParams]:
    """How a norm module normalizes ``x``, or None when it is not one fusebox reproduces or
    when a hook owns its weights (offloaded weights arrive only when its own forward runs)."""
    if has_hooks(norm):
        return None
    kind = norm_kind(norm)
    if kind == "layer":
        return NormParams(kind, norm.weight, norm.bias, norm.eps, x.dtype)
    if kind == "rms":   # diffusers returns the weight's dtype (fp32 for an fp32 weight)
        dtype = x.dtype if norm.weight is None else norm.weight.dtype
        return NormParams(kind, norm.weight, None, norm.eps, dtype)
    return None


def _modulation_dtype(p: NormParams, x: Tensor, scale: Tensor, shift: Tensor):
    """dtype of ``norm(x) * (1 + scale) + shift`` in eager PyTorch, or None when the fused op
    cannot write it."""
    dtype = torch.promote_types(torch.promote_types(p.dtype, scale.dtype), shift.dtype)
    return dtype if dtype in (x.dtype, torch.float32) else None


def modulated_norm(norm: torch.nn.Module, x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """``norm(x) * (1 + scale) + shift`` (AdaLN); scale/shift broadcast as ``[B, 1, D]``."""
    p = norm_params(norm, x)
    if p is not None and fusable(x, scale, shift, p.weight, p.bias):
        dtype = _modulation_dtype(p, x, scale, shift)
        if dtype is not None:
            return F.adaln(rows(x), scale, shift, p.weight, p.bias, p.kind, p.eps,
                           out_dtype=_out_dtype(x, dtype))
    return norm(x) * (1 + scale) + shift


def gated_add(x: Tensor, branch: Tensor, gate: Optional[Tensor] = None) -> Tensor:
    """``x + gate * branch`` (the AdaLN-Zero residual; ``x + branch`` without a gate)."""
    if fusable(x, like_x=(branch, gate)):
        return F.gated_residual(rows(x), rows(branch), gate)
    return x + branch if gate is None else x + gate * branch


def gated_add_norm(x: Tensor, branch: Tensor, gate: Optional[Tensor], norm: torch.nn.Module,
                   scale: Tensor, shift: Tensor) -> Tuple[Tensor, Tensor]:
    """A DiT block boundary: ``h = x + gate * branch``, then ``norm(h) * (1 + scale) + shift``.
    Returns ``(normed, h)``."""
    p = norm_params(norm, x)
    if p is not None and fusable(x, scale, shift, p.weight, p.bias, like_x=(branch, gate)):
        dtype = _modulation_dtype(p, x, scale, shift)
        if dtype is not None:
            return F.gated_residual_norm(rows(x), rows(branch), gate, scale, shift, p.weight,
                                         p.bias, p.kind, p.eps, out_dtype=_out_dtype(x, dtype))
    h = gated_add(x, branch, gate)
    return modulated_norm(norm, h, scale, shift), h


# --------------------------------------------------------------------------- activations

_GELU_KINDS = {"tanh": "gelu_tanh", "none": "gelu"}


def _bias_foldable(proj: torch.nn.Module) -> bool:
    """Can the projection's bias move into the activation? Only for a plain Linear that no hook
    (offload, casting) wraps: its weight is then the one its own forward would use."""
    return type(proj) is torch.nn.Linear and proj.bias is not None and not has_hooks(proj)


def linear_gelu(proj: torch.nn.Module, x: Tensor, approximate: str = "tanh") -> Tensor:
    """``gelu(proj(x))``: the matmul without bias, then bias + GELU in one pass."""
    if _bias_foldable(proj) and fusable(x, proj.bias, like_x=(proj.weight,)):
        h = torch.nn.functional.linear(x, proj.weight)
        return F.activation(h, proj.bias, _GELU_KINDS[approximate])
    return torch.nn.functional.gelu(proj(x), approximate=approximate)


def linear_act(proj: torch.nn.Module, act: torch.nn.Module, x: Tensor) -> Tensor:
    """``act(proj(x))``, fused when ``act`` is a torch GELU."""
    if type(act) is torch.nn.GELU and act.approximate in _GELU_KINDS:
        return linear_gelu(proj, x, act.approximate)
    return act(proj(x))


# --------------------------------------------------------------------------- q/k norm + RoPE


def _rms_params(norm: torch.nn.Module, x: Tensor) -> Optional[Tuple[Optional[Tensor], float]]:
    """(weight, eps) of a per-head RMSNorm module that returns x's dtype, else None."""
    if has_hooks(norm):
        return None
    if type(norm) is torch.nn.RMSNorm and len(norm.normalized_shape) == 1 and norm.eps is not None:
        return norm.weight, norm.eps
    p = norm_params(norm, x)
    if p is not None and p.kind == "rms" and p.dtype == x.dtype:
        return p.weight, p.eps
    return None


def _eager_norm_rope(q, k, norm_q, norm_k, rotary):
    if norm_q is not None:
        q = norm_q(q)
    if norm_k is not None:
        k = norm_k(k)
    if rotary is not None:
        q = apply_rotary_emb(q, rotary, sequence_dim=1)
        k = apply_rotary_emb(k, rotary, sequence_dim=1)
    return q, k


def norm_rope(q: Tensor, k: Tensor, norm_q: Optional[torch.nn.Module],
              norm_k: Optional[torch.nn.Module], rotary: Optional[Tuple[Tensor, Tensor]]):
    """Per-head RMSNorm of q and k (``[B, S, H, D]``; modules ``norm_q``/``norm_k``, or None
    for none), then diffusers' interleaved RoPE with its ``(cos, sin)`` ``[S, D]`` tables
    (``apply_rotary_emb(..., sequence_dim=1)``), q and k in one launch."""
    cos, sin = rotary if rotary is not None else (None, None)
    if cos is not None and (cos.dim() != 2 or sin.dim() != 2):
        return _eager_norm_rope(q, k, norm_q, norm_k, rotary)
    if norm_q is None and norm_k is None:
        if cos is not None and fusable(q, cos, sin, like_x=(k,)):
            return F.rope(rows(q), rows(k), cos, sin, interleaved=True)
        return _eager_norm_rope(q, k, norm_q, norm_k, rotary)
    pq = _rms_params(norm_q, q) if norm_q is not None else None
    pk = _rms_params(norm_k, k) if norm_k is not None else None
    if pq is None or pk is None or pq[1] != pk[1] or not fusable(q, pq[0], pk[0], cos, sin,
                                                                  like_x=(k,)):
        return _eager_norm_rope(q, k, norm_q, norm_k, rotary)
    q, k = rows(q), rows(k)
    if cos is None:
        return F.rms_norm(q, pq[0], pq[1]), F.rms_norm(k, pk[0], pk[1])
    return F.qk_norm_rope(q, k, pq[0], pk[0], cos, sin, pq[1], interleaved=True)


def split_rotary(rotary: Optional[Tuple[Tensor, Tensor]], n: int):
    """The tables of the first ``n`` tokens and of the rest (views; None stays None)."""
    if rotary is None:
        return None, None
    cos, sin = rotary
    return (cos[:n], sin[:n]), (cos[n:], sin[n:])


# --------------------------------------------------------------------------- module forwards


def _rms_norm_forward(self, hidden_states):
    weight = self.weight
    dtype = hidden_states.dtype if weight is None else weight.dtype
    if not fusable(hidden_states, weight) or dtype not in (hidden_states.dtype, torch.float32):
        return original_forward(self)(hidden_states)
    return F.rms_norm(rows(hidden_states), weight, self.eps,
                      out_dtype=_out_dtype(hidden_states, dtype))


def _layer_norm(self, x):
    if not fusable(x, self.weight, self.bias):
        return original_forward(self)(x)
    return F.layer_norm(rows(x), self.weight, self.bias, self.eps)


def _layer_norm_forward(self, input):       # nn.LayerNorm.forward's signature
    return _layer_norm(self, input)


def _fp32_layer_norm_forward(self, inputs):  # FP32LayerNorm.forward's signature
    return _layer_norm(self, inputs)


def _ada_layer_norm_zero_forward(self, x, timestep=None, class_labels=None, hidden_dtype=None,
                                 emb=None):
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    emb = self.linear(self.silu(emb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    x = modulated_norm(self.norm, x, scale_msa[:, None], shift_msa[:, None])
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def _ada_layer_norm_zero_single_forward(self, x, emb=None):
    emb = self.linear(self.silu(emb))
    shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
    return modulated_norm(self.norm, x, scale_msa[:, None], shift_msa[:, None]), gate_msa


def _sd35_ada_layer_norm_zero_x_forward(self, hidden_states, emb=None):
    emb = self.linear(self.silu(emb))
    (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
     shift_msa2, scale_msa2, gate_msa2) = emb.chunk(9, dim=1)
    # two modulations of one norm: each pass normalizes again, cheaper than writing norm(x)
    out = modulated_norm(self.norm, hidden_states, scale_msa[:, None], shift_msa[:, None])
    out2 = modulated_norm(self.norm, hidden_states, scale_msa2[:, None], shift_msa2[:, None])
    return out, gate_msa, shift_mlp, scale_mlp, gate_mlp, out2, gate_msa2


def _ada_layer_norm_continuous_forward(self, x, conditioning_embedding):
    emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return modulated_norm(self.norm, x, scale[:, None, :], shift[:, None, :])


def _gelu_forward(self, hidden_states):
    return linear_gelu(self.proj, hidden_states, self.approximate)


def _geglu_forward(self, hidden_states, *args, **kwargs):
    if args or kwargs.get("scale") is not None or not fusable(hidden_states, self.proj.weight):
        return original_forward(self)(hidden_states, *args, **kwargs)   # it warns about `scale`
    # diffusers' GEGLU is exact-erf GELU with the gate in the second half
    return F.gated_activation_packed(self.proj(hidden_states), "gelu", gate_first=False)


def _swiglu_forward(self, hidden_states):
    if not fusable(hidden_states, self.proj.weight):
        return original_forward(self)(hidden_states)
    return F.gated_activation_packed(self.proj(hidden_states), "silu", gate_first=False)


# --------------------------------------------------------------------------- generic pass

_ADA_NORMS = {
    AdaLayerNormZero: (_ada_layer_norm_zero_forward, "adaln"),
    AdaLayerNormZeroSingle: (_ada_layer_norm_zero_single_forward, "adaln"),
    SD35AdaLayerNormZeroX: (_sd35_ada_layer_norm_zero_x_forward, "adaln x2"),
    AdaLayerNormContinuous: (_ada_layer_norm_continuous_forward, "adaln"),
}


def _generic_rule(module: torch.nn.Module):
    """(forward, what) for a module the generic pass fuses, (None, why not) for a candidate it
    leaves alone, None for anything else."""
    cls = type(module)
    if cls in _ADA_NORMS:
        forward, what = _ADA_NORMS[cls]
        kind = norm_kind(module.norm)
        if kind is None:
            return None, f"its norm ({type(module.norm).__name__}) has no fused form"
        return forward, f"{what} ({kind})"
    if cls is RMSNorm:
        if module.bias is not None or len(module.dim) != 1:
            return None, "RMSNorm with a bias or over several dims"
        return _rms_norm_forward, "rms_norm"
    if cls in _LAYER_NORMS:
        if len(module.normalized_shape) != 1:
            return None, "LayerNorm over several dims"
        forward = _fp32_layer_norm_forward if cls is FP32LayerNorm else _layer_norm_forward
        return forward, "layer_norm"
    if cls is GELU:
        if module.approximate not in _GELU_KINDS:
            return None, f"GELU approximate={module.approximate!r}"
        return _gelu_forward, f"linear + {_GELU_KINDS[module.approximate]}(+bias)"
    if cls is GEGLU:
        return _geglu_forward, "gated_activation_packed (gelu)"
    if cls is SwiGLU:
        return _swiglu_forward, "gated_activation_packed (silu)"
    return None


def patch_generic(model: torch.nn.Module, report, **options) -> None:
    """Fuses the generic diffusers modules of ``model`` that no family patcher covered."""
    for path, module in model.named_modules():
        if is_patched(module):
            continue
        into = module.__dict__.get(FUSED_INTO_ATTR)
        if into is not None:
            report.skip(path, module, f"done by {into}")
            continue
        rule = _generic_rule(module)
        if rule is None:
            continue
        forward, what = rule
        if forward is None:
            report.skip(path, module, what)
            continue
        replace_forward(module, forward, what)
        report.add(path, module, what)
        if type(module) in _ADA_NORMS:
            mark_fused(module.norm, "the parent AdaLayerNorm's adaln")
