"""FLUX.2 (``Flux2Transformer2DModel``) on fusebox.

- joint attention (``Flux2AttnProcessor``): FLUX.1's fused processor (per stream, the per-head
  q/k RMSNorm and the interleaved RoPE as one ``qk_norm_rope`` launch) with FLUX.2's
  projections;
- parallel single-stream attention (``Flux2ParallelSelfAttnProcessor``): q/k read in place
  from the fused QKV + MLP projection, their norms and RoPE in one ``qk_norm_rope``;
- double-stream blocks, per stream: ``norm1`` + modulation as ``adaln``, the gated attention
  residual + ``norm2`` + modulation as ``gated_residual_norm``, the feed-forward residual as
  ``gated_residual``; single-stream blocks: ``adaln`` and ``gated_residual``. The blocks take
  the model's shared modulation terms as they come (per sample, or per token where the
  reference-image cache blends them);
- the SwiGLU of the feed-forwards and of the parallel MLP (gate first, packed in one
  projection): ``gated_activation_packed``.

The reference-image KV-cache processors keep their code.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_flux2 import (
    Flux2AttnProcessor,
    Flux2Modulation,
    Flux2ParallelSelfAttnProcessor,
    Flux2SingleTransformerBlock,
    Flux2SwiGLU,
    Flux2Transformer2DModel,
    Flux2TransformerBlock,
    _get_qkv_projections,
)

from ... import functional as fb
from .._common import original_forward, replace_forward
from ._shared import (
    FusedAttnProcessor,
    context_stream_tail,
    fusable,
    gated_add,
    grad_needed,
    mark_fused,
    modulated_norm,
    norm_rope,
    stream_tail,
    swap_processor,
)
from .flux import FluxFusedAttnProcessor

FAMILY = "flux2"


def applies(model: torch.nn.Module) -> bool:
    return isinstance(model, Flux2Transformer2DModel)


# --------------------------------------------------------------------------- attention


class Flux2FusedAttnProcessor(FluxFusedAttnProcessor):
    """``Flux2AttnProcessor`` with each stream's q/k norms and RoPE in one launch."""

    project = staticmethod(_get_qkv_projections)


class Flux2FusedParallelAttnProcessor(FusedAttnProcessor):
    """``Flux2ParallelSelfAttnProcessor`` with the q/k norms and RoPE in one launch, q and k
    read where the fused projection wrote them."""

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        if grad_needed(attn, hidden_states):
            return self.original(attn, hidden_states, attention_mask, image_rotary_emb)
        hidden_states = attn.to_qkv_mlp_proj(hidden_states)
        # the QKV and MLP parts by their global ratio, as diffusers splits them (a column-sharded
        # projection keeps it on every rank)
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = hidden_states.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp_hidden_states = torch.split(
            hidden_states, [local_qkv, hidden_states.shape[-1] - local_qkv], dim=-1)
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
        query, key = norm_rope(query, key, attn.norm_q, attn.norm_k, image_rotary_emb)
        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
            parallel_config=self._parallel_config)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
        return attn.to_out(torch.cat([hidden_states, mlp_hidden_states], dim=-1))


# --------------------------------------------------------------------------- blocks


def swiglu_forward(self, x):
    """FLUX.2's (and FLUX.3's) SwiGLU: gate first, packed in one projection."""
    if not fusable(x):
        return original_forward(self)(x)
    return fb.gated_activation_packed(x, "silu", gate_first=True)


def _double_block_forward(self, hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt,
                          image_rotary_emb=None, joint_attention_kwargs=None):
    # [B, 1, D] (or [B, S, D]) each: shift, scale, gate before the attention, then the MLP
    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = Flux2Modulation.split(
        temb_mod_img, 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = (
        Flux2Modulation.split(temb_mod_txt, 2))
    attn_output, context_attn_output = self.attn(
        hidden_states=modulated_norm(self.norm1, hidden_states, scale_msa, shift_msa),
        encoder_hidden_states=modulated_norm(self.norm1_context, encoder_hidden_states,
                                             c_scale_msa, c_shift_msa),
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    hidden_states = stream_tail(hidden_states, attn_output, gate_msa, self.norm2, scale_mlp,
                                shift_mlp, self.ff, gate_mlp)
    encoder_hidden_states = context_stream_tail(self, encoder_hidden_states, context_attn_output,
                                                c_gate_msa, c_scale_mlp, c_shift_mlp, c_gate_mlp)
    return encoder_hidden_states, hidden_states


def _single_block_forward(self, hidden_states, encoder_hidden_states, temb_mod,
                          image_rotary_emb=None, joint_attention_kwargs=None,
                          split_hidden_states=False, text_seq_len=None):
    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    mod_shift, mod_scale, mod_gate = Flux2Modulation.split(temb_mod, 1)[0]
    attn_output = self.attn(
        hidden_states=modulated_norm(self.norm, hidden_states, mod_scale, mod_shift),
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    hidden_states = gated_add(hidden_states, attn_output, mod_gate)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    if split_hidden_states:
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return hidden_states


_FUSED_PROCESSORS = {
    Flux2AttnProcessor: (Flux2FusedAttnProcessor,
                         "qk_norm_rope per head (interleaved), per stream"),
    Flux2ParallelSelfAttnProcessor: (Flux2FusedParallelAttnProcessor,
                                     "qk_norm_rope per head (interleaved), q/k in place"),
}


def patch(model: torch.nn.Module, report, **options) -> None:
    report.family = FAMILY
    for path, module in model.named_modules():
        cls = type(module)
        if cls is Flux2TransformerBlock:
            replace_forward(module, _double_block_forward, f"{FAMILY} double block")
            report.add(path, module, "adaln + gated_residual_norm + gated_residual, both streams")
            for norm in ("norm1", "norm1_context"):
                mark_fused(getattr(module, norm), "the block's adaln")
            for norm in ("norm2", "norm2_context"):
                mark_fused(getattr(module, norm), "the block's gated_residual_norm")
        elif cls is Flux2SingleTransformerBlock:
            replace_forward(module, _single_block_forward, f"{FAMILY} single block")
            report.add(path, module, "adaln + gated_residual")
            mark_fused(module.norm, "the block's adaln")
        elif cls is Flux2SwiGLU:
            replace_forward(module, swiglu_forward, f"{FAMILY} SwiGLU")
            report.add(path, module, "gated_activation_packed (silu)")
        else:
            swap_processor(path, module, report, _FUSED_PROCESSORS)
