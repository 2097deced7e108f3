"""Stable Diffusion 3 / 3.5 (``SD3Transformer2DModel``) on fusebox.

``JointTransformerBlock``: per stream, the gated attention residual and ``norm2`` + modulation
become one ``gated_residual_norm`` and the feed-forward residual one ``gated_residual`` (SD3.5
dual-attention layers add the second attention with a ``gated_residual`` first). SD3 has no
RoPE: its per-head q/k RMSNorm (SD3.5, ``qk_norm="rms_norm"``) is a diffusers ``RMSNorm`` that
the generic pass turns into ``rms_norm``, like the AdaLayerNormZero(-X)/Continuous norms and
the feed-forward GELU.

The joint attention keeps q/k/v as the projections write them, ``[B, S, heads, head_dim]``:
diffusers' ``JointAttnProcessor2_0`` transposes them to ``[B, heads, S, head_dim]`` first, so
the q/k norms read strided rows, the concatenation of the two streams copies into a heads-first
layout, and flattening the attention output copies it back. Here the norms read contiguous rows,
the streams are concatenated along the sequence in the projections' layout, and the attention
takes transposed views of it, so its output flattens without a copy; each stream's output
projection then reads its slice of that output in place (``linear_rows``: with CFG's batch of
2, ``F.linear`` would copy the slice and add the bias in a separate pass). Same math, same
order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention import JointTransformerBlock, _chunked_feed_forward
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

from .._common import replace_forward
from ._shared import (
    FusedAttnProcessor, built_on, custom_processor, gated_add, gated_add_norm, grad_needed,
    install_processor, linear_rows, mark_fused,
)

FAMILY = "sd3"


def applies(model: torch.nn.Module) -> bool:
    """SD3 / SD3.5, and the models built on their joint blocks (their ControlNet)."""
    return built_on(model, SD3Transformer2DModel, JointTransformerBlock)


class SD3JointAttnProcessor(FusedAttnProcessor):
    """``JointAttnProcessor2_0`` with q/k/v kept in the projections' ``[B, S, H, D]`` layout
    (see the module docstring). Differentiable calls run the original processor."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 *args, **kwargs):
        if grad_needed(attn, hidden_states, encoder_hidden_states):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 *args, **kwargs)
        heads = attn.heads

        def project(to_q, to_k, to_v, norm_q, norm_k, x):
            q, k, v = (proj(x).unflatten(-1, (heads, -1)) for proj in (to_q, to_k, to_v))
            return (q if norm_q is None else norm_q(q)), (k if norm_k is None else norm_k(k)), v

        query, key, value = project(attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k,
                                    hidden_states)
        if encoder_hidden_states is not None:
            context = project(attn.add_q_proj, attn.add_k_proj, attn.add_v_proj,
                              attn.norm_added_q, attn.norm_added_k, encoder_hidden_states)
            query, key, value = (torch.cat([x, c], dim=1)
                                 for x, c in zip((query, key, value), context))

        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2),
                                             value.transpose(1, 2), dropout_p=0.0,
                                             is_causal=False)
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        tokens = hidden_states.shape[1]
        out, context_out = out[:, :tokens], out[:, tokens:]
        if not attn.context_pre_only:
            context_out = linear_rows(attn.to_add_out, context_out)
        return attn.to_out[1](linear_rows(attn.to_out[0], out)), context_out


def _attention_unfusable(attn) -> str:
    """Why an attention module keeps its processor ("" when the joint one can replace it)."""
    why = custom_processor(attn, "JointAttnProcessor2_0")
    if why:
        return why
    head_dim = attn.inner_dim // attn.heads
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        norm = getattr(attn, name, None)
        dims = getattr(norm, "dim", None) or getattr(norm, "normalized_shape", None)
        if norm is not None and tuple(dims or ()) != (head_dim,):
            return f"{name} does not normalize one head"
    return ""


def _feed_forward(block, ff, hidden_states):
    if block._chunk_size is None:
        return ff(hidden_states)
    return _chunked_feed_forward(ff, hidden_states, block._chunk_dim, block._chunk_size)


def _joint_block_forward(self, hidden_states, encoder_hidden_states, temb,
                         joint_attention_kwargs=None):
    joint_attention_kwargs = joint_attention_kwargs or {}
    if self.use_dual_attention:
        (norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp, norm_hidden_states2,
         gate_msa2) = self.norm1(hidden_states, emb=temb)
    else:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(
            hidden_states, emb=temb)

    if self.context_pre_only:
        norm_encoder_hidden_states = self.norm1_context(encoder_hidden_states, temb)
    else:
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = (
            self.norm1_context(encoder_hidden_states, emb=temb))

    attn_output, context_attn_output = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        **joint_attention_kwargs,
    )

    # the residual the norm2 boundary fuses with: the last attention before the feed-forward
    last_output, last_gate = attn_output, gate_msa
    if self.use_dual_attention:
        hidden_states = gated_add(hidden_states, attn_output, gate_msa.unsqueeze(1))
        last_output = self.attn2(hidden_states=norm_hidden_states2, **joint_attention_kwargs)
        last_gate = gate_msa2
    norm_hidden_states, hidden_states = gated_add_norm(
        hidden_states, last_output, last_gate.unsqueeze(1), self.norm2, scale_mlp[:, None],
        shift_mlp[:, None])
    ff_output = _feed_forward(self, self.ff, norm_hidden_states)
    hidden_states = gated_add(hidden_states, ff_output, gate_mlp.unsqueeze(1))

    if self.context_pre_only:
        return None, hidden_states
    norm_encoder_hidden_states, encoder_hidden_states = gated_add_norm(
        encoder_hidden_states, context_attn_output, c_gate_msa.unsqueeze(1), self.norm2_context,
        c_scale_mlp[:, None], c_shift_mlp[:, None])
    context_ff_output = _feed_forward(self, self.ff_context, norm_encoder_hidden_states)
    encoder_hidden_states = gated_add(encoder_hidden_states, context_ff_output,
                                      c_gate_mlp.unsqueeze(1))
    return encoder_hidden_states, hidden_states


def patch(model: torch.nn.Module, report, **options) -> None:
    report.family = FAMILY
    for path, module in model.named_modules():
        if type(module) is not JointTransformerBlock:
            continue
        replace_forward(module, _joint_block_forward, "sd3 joint block")
        streams = "image stream" if module.context_pre_only else "both streams"
        report.add(path, module, f"gated_residual_norm + gated_residual, {streams}")
        mark_fused(module.norm2, "the block's gated_residual_norm")
        if module.norm2_context is not None:
            mark_fused(module.norm2_context, "the block's gated_residual_norm")
    for path, module in model.named_modules():
        if type(module).__name__ != "Attention" or not hasattr(module, "processor"):
            continue
        why = _attention_unfusable(module)
        if why:
            report.skip(path, module, why)
            continue
        install_processor(module, SD3JointAttnProcessor)
        report.add(path, module, "processor: joint attention on [B, S, H, D] q/k/v "
                                 "(no layout copies)")
    report.note("sd3: per-head q/k RMSNorm runs as rms_norm through the generic RMSNorm patch "
                "(no RoPE to fuse it with)")
