"""Krea 2 (diffusers ``Krea2Transformer2DModel``) on fusebox.

Krea 2's norms are ``Krea2RMSNorm``: RMSNorm in fp32 with a zero-centred scale (``1 + weight``;
the weight is kept in fp32), the result cast back to the input's dtype; fusebox's norms take the
offset as ``weight_offset=1``. Per ``Krea2TransformerBlock`` (single stream, the text tokens
ahead of the image tokens):

- ``(1 + prescale) * norm1(x) + preshift`` -> :func:`adaln` (rms);
- attention (``Krea2AttnProcessor``): the per-head q/k norms and the interleaved RoPE
  (``apply_rotary_emb``'s pairs, one ``[S, D]`` table for the batch) -> :func:`qk_norm_rope`;
  the key/value head repeat, diffusers' attention dispatch and the sigmoid output gate as
  diffusers runs them;
- ``x + pregate * attn`` then ``(1 + postscale) * norm2(x) + postshift`` ->
  :func:`gated_residual_norm`;
- the SwiGLU feed-forward (separate gate and up projections): ``silu(gate) * up`` ->
  :func:`gated_activation`;
- ``x + postgate * ff`` -> :func:`gated_residual`.

The modulation terms are the model's own ``temb + scale_shift_table`` ([B, 1, 6, D], per
sample), read as strided views. Every other ``Krea2RMSNorm`` (the text-fusion blocks, the text
projection, the final layer) runs as :func:`rms_norm`, and the text-fusion blocks' attention
takes the fused processor too (its q/k norms without rotary).
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from ... import functional as fb
from .._common import has_hooks, original_forward, replace_forward
from ._shared import (
    FUSED_INTO_ATTR,
    FusedAttnProcessor,
    contains_class,
    custom_processor,
    fusable,
    grad_needed,
    install_processor,
    mark_fused,
    rows,
)

FAMILY = "krea2"
MODEL = "Krea2TransformerBlock"
NORM = "Krea2RMSNorm"
ATTENTION = "Krea2Attention"
PROCESSOR = "Krea2AttnProcessor"
SWIGLU = "Krea2SwiGLU"


def applies(module: torch.nn.Module) -> bool:
    return contains_class(module, MODEL, NORM)


def _norm_weight(norm: torch.nn.Module, x: torch.Tensor):
    """The weight of a ``Krea2RMSNorm`` fusebox can apply to ``x`` in place of the module (with
    ``weight_offset=1``), or None: not while a hook owns the weights (offloaded weights arrive
    only when the module's own forward runs)."""
    if type(norm).__name__ != NORM or has_hooks(norm) or not fusable(x, norm.weight):
        return None
    return norm.weight


# --------------------------------------------------------------------------- modules


def _rms_norm_forward(self, hidden_states):
    weight = _norm_weight(self, hidden_states)
    if weight is None or hidden_states.shape[-1] != self.dim:
        return original_forward(self)(hidden_states)
    return fb.rms_norm(rows(hidden_states), weight, self.eps, weight_offset=1.0)


def _swiglu_forward(self, hidden_states):
    if grad_needed(self, hidden_states) or not fusable(hidden_states):
        return original_forward(self)(hidden_states)
    return self.down(fb.gated_activation(self.gate(hidden_states), self.up(hidden_states), "silu"))


class Krea2FusedAttnProcessor(FusedAttnProcessor):
    """``Krea2AttnProcessor`` with the q/k norms and RoPE in one launch (the q/k norms alone
    where there is no rotary: the text-fusion blocks). Same call signature (Krea2Attention
    filters keyword arguments by it)."""

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        cos, sin = image_rotary_emb if image_rotary_emb is not None else (None, None)
        weight_q = _norm_weight(attn.norm_q, hidden_states)
        weight_k = _norm_weight(attn.norm_k, hidden_states)
        if (weight_q is None or weight_k is None or attn.norm_q.eps != attn.norm_k.eps
                or grad_needed(attn, hidden_states) or not fusable(hidden_states, cos, sin)
                or (cos is not None and cos.dtype != sin.dtype)):
            return self.original(attn, hidden_states, attention_mask, image_rotary_emb)
        query = attn.to_q(hidden_states).unflatten(-1, (attn.num_heads, attn.head_dim))
        key = attn.to_k(hidden_states).unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        value = attn.to_v(hidden_states).unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        gate = attn.to_gate(hidden_states)
        eps = attn.norm_q.eps
        if cos is None:
            query = fb.rms_norm(query, weight_q, eps, weight_offset=1.0)
            key = fb.rms_norm(key, weight_k, eps, weight_offset=1.0)
        else:
            query, key = fb.qk_norm_rope(query, key, weight_q, weight_k, cos, sin, eps=eps,
                                         interleaved=True, weight_offset=1.0)
        # as diffusers: repeated key/value heads (every SDPA kernel takes them with a mask)
        groups = attn.num_heads // attn.num_kv_heads
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
            parallel_config=self._parallel_config)
        hidden_states = hidden_states.flatten(2, 3) * torch.sigmoid(gate)
        return attn.to_out[0](hidden_states)


# --------------------------------------------------------------------------- block


def _block_forward(self, hidden_states, temb, image_rotary_emb, attention_mask=None):
    weight1 = _norm_weight(self.norm1, hidden_states)
    weight2 = _norm_weight(self.norm2, hidden_states)
    modulation = temb.unflatten(-1, (6, -1)) + self.scale_shift_table
    if (weight1 is None or weight2 is None or grad_needed(self, hidden_states, temb)
            or modulation.dtype != hidden_states.dtype or not fusable(hidden_states)):
        return original_forward(self)(hidden_states, temb, image_rotary_emb, attention_mask)
    hidden_states = rows(hidden_states)
    # [B, 1, D] views of the model's [B, 1, 6, D] sum, read in place
    prescale, preshift, pregate, postscale, postshift, postgate = modulation.unbind(-2)
    attn_input = fb.adaln(hidden_states, prescale, preshift, weight1, norm_type="rms",
                          eps=self.norm1.eps, weight_offset=1.0)
    attn_output = self.attn(attn_input, attention_mask=attention_mask,
                            image_rotary_emb=image_rotary_emb)
    ff_input, hidden_states = fb.gated_residual_norm(
        hidden_states, rows(attn_output), pregate, postscale, postshift, weight2, norm_type="rms",
        eps=self.norm2.eps, weight_offset=1.0)
    return fb.gated_residual(hidden_states, rows(self.ff(ff_input)), postgate)


# --------------------------------------------------------------------------- patch


def patch(model: torch.nn.Module, report, **options) -> None:
    report.family = FAMILY
    for path, module in model.named_modules():
        kind = type(module).__name__
        if kind == MODEL:
            replace_forward(module, _block_forward, f"{FAMILY} block")
            report.add(path, module, "adaln(rms) + gated_residual_norm(rms) + gated_residual")
            for norm in ("norm1", "norm2"):
                mark_fused(getattr(module, norm), "the block's adaln / gated_residual_norm")
        elif kind == ATTENTION:
            why = custom_processor(module, PROCESSOR)
            if why:
                report.skip(path, module, why)
                continue
            install_processor(module, Krea2FusedAttnProcessor)
            report.add(path, module, "processor: qk_norm_rope per head (interleaved) / "
                                     "rms_norm q, k without rotary")
            for norm in ("norm_q", "norm_k"):
                mark_fused(getattr(module, norm), "the attention processor")
        elif kind == SWIGLU:
            replace_forward(module, _swiglu_forward, f"{FAMILY} SwiGLU")
            report.add(path, module, "gated_activation (silu)")
    for path, module in model.named_modules():
        if type(module).__name__ == NORM and module.__dict__.get(FUSED_INTO_ATTR) is None:
            replace_forward(module, _rms_norm_forward, f"{FAMILY} RMSNorm")
            report.add(path, module, "rms_norm (1 + weight)")
