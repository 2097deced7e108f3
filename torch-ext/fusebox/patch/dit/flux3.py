"""FLUX.3 (``Flux3Transformer2DModel``) on fusebox.

FLUX.3's blocks are parallel: attention and feed-forward read the same modulated norm and their
sum is added back through one gate. The modulation is per token (``[B, S, 3D]`` projections of
the timestep embedding, read as strided views).

- attention (``Flux3AttnProcessor``): the per-head q/k RMSNorm and the interleaved RoPE
  (``apply_rotary_emb``'s pairs, the pos-embed's ``repeat_interleave_real`` tables), which the
  model computes on ``q.float()`` / ``k.float()`` and casts back once, as one ``qk_norm_rope``
  launch; then diffusers' attention dispatch with the processor's backend and parallel config;
- per-mode blocks (``Flux3ModeTransformerBlock``): ``(1 + scale) * norm(x) + shift`` as
  ``adaln``, the feed-forward's output projection accumulating onto the attention output in its
  GEMM (``addmm``: no separate add of the two branches), the gated residual as
  ``gated_residual``;
- joint single blocks (``Flux3SingleTransformerBlock``): the same, with the text and content
  streams each modulated by their own terms (one ``adaln`` and one ``gated_residual`` each);
- the output norm (``Flux3AdaLayerNorm``): ``adaln``;
- the SwiGLU of the feed-forwards (gate first, packed in one projection):
  ``gated_activation_packed``, FLUX.2's fused forward.

Left eager: the gated residual at the end of a block and the norm at the start of the next one
are in different module calls (the model's block loop), so they stay ``gated_residual`` +
``adaln`` rather than one ``gated_residual_norm``; the timestep embedders, the per-token
modulation projections and the text/content concatenation of the single blocks run as diffusers
writes them.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_flux3 import (
    Flux3AdaLayerNorm,
    Flux3AttnProcessor,
    Flux3FeedForward,
    Flux3ModeTransformerBlock,
    Flux3SingleTransformerBlock,
    Flux3SwiGLU,
    Flux3Transformer2DModel,
    _get_qkv_projections,
)

from .._common import has_hooks, original_forward, replace_forward
from ._shared import (
    FusedAttnProcessor,
    gated_add,
    grad_needed,
    linear_add,
    mark_fused,
    modulated_norm,
    norm_rope,
    swap_processor,
)
from .flux2 import swiglu_forward

FAMILY = "flux3"


def applies(model: torch.nn.Module) -> bool:
    return isinstance(model, Flux3Transformer2DModel)


# --------------------------------------------------------------------------- attention


class Flux3FusedAttnProcessor(FusedAttnProcessor):
    """``Flux3AttnProcessor`` with the q/k norms and RoPE in one launch (fp32 math, rounded
    once, as the model computes them); calls that need gradients run the original processor."""

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        if grad_needed(attn, hidden_states):
            return self.original(attn, hidden_states, attention_mask, image_rotary_emb)
        query, key, value = (t.unflatten(-1, (attn.heads, -1))
                             for t in _get_qkv_projections(attn, hidden_states))
        query, key = norm_rope(query, key, attn.norm_q, attn.norm_k, image_rotary_emb,
                               upcast=True)
        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
            parallel_config=self._parallel_config)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        return attn.to_out[1](attn.to_out[0](hidden_states))


# --------------------------------------------------------------------------- blocks


def _attn_plus_ff(block, normed, image_rotary_emb):
    """``attn(normed) + ff(normed)``, the sum formed in the feed-forward's output GEMM."""
    attn_output = block.attn(hidden_states=normed, image_rotary_emb=image_rotary_emb)
    ff = block.ff
    if type(ff) is not Flux3FeedForward or has_hooks(ff):
        return attn_output + ff(normed)
    return linear_add(ff.linear_out, ff.act_fn(ff.linear_in(normed)), attn_output)


def _mode_block_forward(self, hidden_states, temb_mod, image_rotary_emb):
    if grad_needed(self, hidden_states, temb_mod):
        return original_forward(self)(hidden_states, temb_mod, image_rotary_emb)
    # [B, S, D] strided views each, per token
    mod_shift, mod_scale, mod_gate = torch.chunk(temb_mod, 3, dim=-1)
    normed = modulated_norm(self.norm, hidden_states, mod_scale, mod_shift)
    return gated_add(hidden_states, _attn_plus_ff(self, normed, image_rotary_emb), mod_gate)


def _single_block_forward(self, hidden_states, encoder_hidden_states, temb_mod,
                          temb_mod_context, image_rotary_emb):
    if grad_needed(self, hidden_states, encoder_hidden_states, temb_mod, temb_mod_context):
        return original_forward(self)(hidden_states, encoder_hidden_states, temb_mod,
                                      temb_mod_context, image_rotary_emb)
    mod_shift, mod_scale, mod_gate = torch.chunk(temb_mod, 3, dim=-1)
    c_mod_shift, c_mod_scale, c_mod_gate = torch.chunk(temb_mod_context, 3, dim=-1)
    combined = torch.cat([
        modulated_norm(self.norm, encoder_hidden_states, c_mod_scale, c_mod_shift),
        modulated_norm(self.norm, hidden_states, mod_scale, mod_shift),
    ], dim=1)
    output = _attn_plus_ff(self, combined, image_rotary_emb)
    context_output, content_output = torch.split(
        output, [encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1)
    encoder_hidden_states = gated_add(encoder_hidden_states, context_output, c_mod_gate)
    hidden_states = gated_add(hidden_states, content_output, mod_gate)
    return encoder_hidden_states, hidden_states


def _norm_out_forward(self, hidden_states, temb):
    if grad_needed(self, hidden_states, temb):
        return original_forward(self)(hidden_states, temb)
    scale, shift = torch.chunk(self.linear(self.act_fn(temb)), 2, dim=-1)
    return modulated_norm(self.norm, hidden_states, scale, shift)


_FUSED_PROCESSORS = {
    Flux3AttnProcessor: (Flux3FusedAttnProcessor, "qk_norm_rope per head (interleaved, fp32)"),
}


def patch(model: torch.nn.Module, report, **options) -> None:
    report.family = FAMILY
    for path, module in model.named_modules():
        cls = type(module)
        if cls is Flux3ModeTransformerBlock:
            replace_forward(module, _mode_block_forward, f"{FAMILY} mode block")
            report.add(path, module, "adaln + linear_out onto attn (addmm) + gated_residual")
            mark_fused(module.norm, "the block's adaln")
        elif cls is Flux3SingleTransformerBlock:
            replace_forward(module, _single_block_forward, f"{FAMILY} single block")
            report.add(path, module, "adaln + linear_out onto attn (addmm) + gated_residual, "
                                     "per stream")
            mark_fused(module.norm, "the block's adaln")
        elif cls is Flux3AdaLayerNorm:
            replace_forward(module, _norm_out_forward, f"{FAMILY} output norm")
            report.add(path, module, "adaln")
            mark_fused(module.norm, "the parent's adaln")
        elif cls is Flux3SwiGLU:
            replace_forward(module, swiglu_forward, f"{FAMILY} SwiGLU")
            report.add(path, module, "gated_activation_packed (silu)")
        else:
            swap_processor(path, module, report, _FUSED_PROCESSORS)
