"""LTX-Video (diffusers ``LTXVideoTransformer3DModel``) on fusebox.

Per ``LTXVideoTransformerBlock``, in the order the block runs:

- ``norm1(x) * (1 + scale_msa) + shift_msa`` (RMSNorm without weight) -> :func:`adaln`;
- self-attention: ``norm_q``/``norm_k`` (RMSNorm over all heads) and the interleaved RoPE on the
  flat ``[B, S, heads * head_dim]`` q/k with LTX's per-channel cos/sin tables ->
  :func:`qk_norm_rope` (one launch for q and k), then diffusers' attention dispatch;
- ``x + attn1 * gate_msa`` -> :func:`gated_residual`;
- ``x + attn2`` then ``norm2(x) * (1 + scale_mlp) + shift_mlp`` -> :func:`gated_residual_norm`;
- ``x + ff * gate_mlp`` -> :func:`gated_residual`.

The modulation is per sample (``temb`` [B, 1, 6D], text-to-video) or per token ([B, S, 6D],
image-to-video with a per-token timestep); both are strided views of one table, read in place.
The rotary embedding (``model.rope``) builds one ``[1, S, D]`` cos/sin table for the batch when
every sample has the same grid (no per-sample ``video_coords``). The feed-forward GELU-tanh and
the model's final ``norm_out`` (a LayerNorm -> :func:`layer_norm`) are fused by the generic
module pass; the output modulation after ``norm_out`` runs eagerly.
"""

from __future__ import annotations

import torch

from ... import functional as fb
from .._common import original_forward, replace_forward
from ._shared import (
    TokenQKNormAttnProcessor,
    contains_class,
    fusable,
    grad_needed,
    modulation_sum,
    patch_block,
    patch_qk_norm_attention,
    rows,
)

MODEL = "LTXVideoTransformer3DModel"
BLOCK = "LTXVideoTransformerBlock"
ATTENTION = "LTXAttention"
ROPE = "LTXVideoRotaryPosEmbed"


def applies(module: torch.nn.Module) -> bool:
    return contains_class(module, MODEL, BLOCK)


# --------------------------------------------------------------------------- attention


class LTXFusedAttnProcessor(TokenQKNormAttnProcessor):
    """``LTXVideoAttnProcessor`` with q/k RMSNorm and RoPE fused. Same call signature (LTXAttention
    filters keyword arguments by it)."""

    # the norm spans all heads and the tables hold a frequency per channel of the flat q/k
    rope_layout = "flat"

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return self.run(attn, hidden_states, encoder_hidden_states, attention_mask,
                        image_rotary_emb)

    def project(self, attn, hidden_states, encoder_hidden_states, attention_mask):
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        batch_size, sequence_length, _ = context.shape
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length,
                                                         batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1,
                                                 attention_mask.shape[-1])
        return attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context), attention_mask


# --------------------------------------------------------------------------- block


def modulation_terms(table: torch.Tensor, temb: torch.Tensor, batch_size: int):
    """The terms of ``table [n, D] + temb [B, T, n * D]`` as LTX blocks form them (LTX-2's
    ``get_mod_params``): ``[B, T, D]`` views of one ``[B, T, n, D]`` sum, with T = 1 (per
    sample) or T = S (per token), read in place by the fused ops."""
    return modulation_sum(table[None, None].to(temb.device),
                          temb.reshape(batch_size, temb.size(1), table.shape[0], -1)).unbind(dim=2)


def _block_forward(
    block: torch.nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    table = block.scale_shift_table
    if (grad_needed(block, hidden_states, encoder_hidden_states, temb)
            or not fusable(hidden_states, temb, table, block.norm1.weight, block.norm2.weight)):
        return original_forward(block)(hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                       encoder_attention_mask)
    hidden_states = rows(hidden_states)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation_terms(
        table, temb, hidden_states.size(0))

    norm_hidden_states = fb.adaln(hidden_states, scale_msa, shift_msa, block.norm1.weight,
                                  norm_type="rms", eps=block.norm1.eps)
    attn_hidden_states = block.attn1(hidden_states=norm_hidden_states, encoder_hidden_states=None,
                                     image_rotary_emb=image_rotary_emb)
    hidden_states = fb.gated_residual(hidden_states, attn_hidden_states, gate_msa)

    attn_hidden_states = block.attn2(hidden_states, encoder_hidden_states=encoder_hidden_states,
                                     image_rotary_emb=None, attention_mask=encoder_attention_mask)
    norm_hidden_states, hidden_states = fb.gated_residual_norm(
        hidden_states, attn_hidden_states, None, scale_mlp, shift_mlp, block.norm2.weight,
        norm_type="rms", eps=block.norm2.eps)

    ff_output = block.ff(norm_hidden_states)
    return fb.gated_residual(hidden_states, ff_output, gate_mlp)


def _block_unfusable(block: torch.nn.Module) -> str:
    """Why the block cannot be fused ("" when it can)."""
    for name in ("norm1", "norm2"):
        norm = getattr(block, name, None)
        if type(norm).__name__ != "RMSNorm" or not hasattr(norm, "eps"):
            return f"{name} is {type(norm).__name__}, not diffusers RMSNorm"
        if getattr(norm, "bias", None) is not None:
            return f"{name} has a bias"
    if getattr(block, "scale_shift_table", None) is None:
        return "no scale_shift_table"
    return ""


# --------------------------------------------------------------------------- rope


def _per_sample(rope_interpolation_scale) -> bool:
    """Does the interpolation scale hold a per-sample tensor (one value per batch entry)?"""
    scales = rope_interpolation_scale
    if not isinstance(scales, (tuple, list)):
        scales = (scales,)
    return any(isinstance(s, torch.Tensor) and s.numel() > 1 for s in scales)


def _rope_forward(rope: torch.nn.Module, hidden_states: torch.Tensor, num_frames=None,
                  height=None, width=None, rope_interpolation_scale=None, video_coords=None):
    """Without per-sample coordinates every sample has the same grid: the tables of the first
    sample ([1, S, D]) broadcast over the batch in the fused kernel and in diffusers'
    ``apply_rotary_emb`` alike, and every block reads 1/B of the table bytes."""
    if video_coords is None and not _per_sample(rope_interpolation_scale):
        hidden_states = hidden_states[:1]
    return original_forward(rope)(hidden_states, num_frames, height, width,
                                  rope_interpolation_scale, video_coords)


# --------------------------------------------------------------------------- patch


def patch(model: torch.nn.Module, report, **options) -> None:
    report.family = "ltx-video"
    for path, module in model.named_modules():
        kind = type(module).__name__
        if kind == ROPE:
            replace_forward(module, _rope_forward, "ltx rope")
            report.add(path, module, "one [1, S, D] cos/sin table for the batch (same grid)")
        elif kind == BLOCK:
            patch_block(path, module, report, _block_unfusable(module), _block_forward,
                        "ltx block", ("norm1", "norm2"),
                        "adaln(rms) + gated_residual + gated_residual_norm(rms) + gated_residual")
        elif kind == ATTENTION:
            patch_qk_norm_attention(path, module, report, "LTXVideoAttnProcessor",
                                    LTXFusedAttnProcessor,
                                    "processor: qk_norm_rope(across heads, interleaved)")
