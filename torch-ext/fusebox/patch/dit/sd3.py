"""Stable Diffusion 3 / 3.5 (``SD3Transformer2DModel``) on fusebox.

``JointTransformerBlock``: per stream, the gated attention residual and ``norm2`` + modulation
become one ``gated_residual_norm`` and the feed-forward residual one ``gated_residual`` (SD3.5
dual-attention layers add the second attention with a ``gated_residual`` first). SD3 has no
RoPE: its per-head q/k RMSNorm (SD3.5, ``qk_norm="rms_norm"``) is a diffusers ``RMSNorm`` that
the generic pass turns into ``rms_norm``, like the AdaLayerNormZero(-X)/Continuous norms and
the feed-forward GELU.
"""

from __future__ import annotations

import torch
from diffusers.models.attention import JointTransformerBlock, _chunked_feed_forward
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

from .._common import replace_forward
from ._shared import gated_add, gated_add_norm, mark_fused

FAMILY = "sd3"


def applies(model: torch.nn.Module) -> bool:
    return isinstance(model, SD3Transformer2DModel)


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
    report.note("sd3: per-head q/k RMSNorm runs as rms_norm through the generic RMSNorm patch "
                "(no RoPE to fuse it with)")
