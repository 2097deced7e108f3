"""Wan 2.1 / 2.2 (diffusers ``WanTransformer3DModel``) and SkyReels-V2
(``SkyReelsV2Transformer3DModel``, Wan 2.1's blocks) on fusebox.

Wan keeps its norms and modulation in fp32 (``FP32LayerNorm``, fp32 ``scale_shift_table + temb``)
and rounds to the activation dtype where noted below; the fused ops do the same math in fp32 and
round once at the same places. Per ``WanTransformerBlock``:

- ``(norm1(x.float()) * (1 + scale_msa) + shift_msa).type_as(x)`` -> :func:`adaln` with fp32
  modulation;
- self-attention: ``norm_q``/``norm_k`` (RMSNorm over all heads) then the interleaved RoPE on
  ``[B, S, H, D]`` with the cos/sin table shared by the heads -> :func:`qk_norm_rope`;
- ``(x.float() + attn1 * gate_msa).type_as(x)`` then ``norm2(x.float()).type_as(x)`` (affine
  LayerNorm, ``cross_attn_norm=True``) -> :func:`gated_residual_norm`;
- ``x + attn2`` then ``(norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)`` ->
  :func:`gated_residual_norm`;
- ``(x.float() + ff.float() * c_gate).type_as(x)`` -> :func:`gated_residual`.

Per-sample (``temb`` [B, 6, D]) and per-token (Wan 2.2 TI2V, [B, S, 6, D]; SkyReels-V2's
diffusion forcing, [B, 6, S, D]) modulation both; SkyReels-V2's self-attention mask passes
through. Per token, the fused ops take each term as its fp32 table row plus its slice of the
16-bit projection (split modulation) and add them where they use it: the model's fp32
``table + temb`` ([B, S, 6, D], 1.9 GB a block for SkyReels-V2 at 51000 tokens) is never
written.
Image-conditioned cross-attention (Wan 2.1 I2V: ``add_k_proj``) keeps diffusers' processor.
The feed-forward GELU-tanh and the model's final ``norm_out`` (an ``FP32LayerNorm`` ->
:func:`layer_norm`) are fused by the generic module pass; the output modulation runs eagerly.
Wan's rotary embedding already builds one ``[1, S, 1, D]`` table for the whole batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from diffusers.models.transformers.transformer_wan import _get_qkv_projections

from ... import functional as fb
from .._common import original_forward
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

class Names(NamedTuple):
    """The classes of one model built on Wan's blocks."""
    model: str
    block: str
    attention: str
    processor: str


WAN = Names("WanTransformer3DModel", "WanTransformerBlock", "WanAttention", "WanAttnProcessor")
# SkyReels-V2: Wan 2.1's blocks, with an attention mask (diffusion forcing's causal frame
# blocks) and per-token modulation laid out [B, 6, S, D]
SKYREELS_V2 = Names("SkyReelsV2Transformer3DModel", "SkyReelsV2TransformerBlock",
                    "SkyReelsV2Attention", "SkyReelsV2AttnProcessor")
FAMILIES = {"wan": WAN, "skyreels-v2": SKYREELS_V2}
IMAGE_CROSS_ATTENTION = "image cross-attention (I2V) keeps diffusers' processor"


def applies(module: torch.nn.Module) -> bool:
    return any(contains_class(module, n.model, n.block) for n in FAMILIES.values())


# --------------------------------------------------------------------------- attention


class WanFusedAttnProcessor(TokenQKNormAttnProcessor):
    """``WanAttnProcessor`` with the q/k RMSNorm and RoPE fused (self-attention; the norm spans
    all heads of a token, the [1, S, 1, D] table is shared by the heads) or the q/k RMSNorm on
    fusebox (text cross-attention). Same call signature (the base class's)."""

    def project(self, attn, hidden_states, encoder_hidden_states, attention_mask):
        return (*_get_qkv_projections(attn, hidden_states, encoder_hidden_states), attention_mask)

    def parallel_config(self, encoder_hidden_states):
        return self._parallel_config if encoder_hidden_states is None else None


class SkyReelsV2FusedAttnProcessor(WanFusedAttnProcessor):
    """``SkyReelsV2AttnProcessor``, fused as Wan's; it hands its parallel config to the text
    cross-attention too."""

    def parallel_config(self, encoder_hidden_states):
        return self._parallel_config


# --------------------------------------------------------------------------- block


def _modulation(table: torch.Tensor, temb: torch.Tensor, terms_first: bool, x_dtype: torch.dtype):
    """The six modulation terms (shift, scale, gate, then the feed-forward's) and their tables:
    per token (temb [B, S, 6, D]; SkyReels-V2's ``terms_first``: [B, 6, S, D]) with an fp32
    table and temb in x's dtype, [B, S, D] views of temb and the table's [D] rows, which the
    fused ops add in fp32 as the model does (split modulation); otherwise the fp32 terms as the
    model forms them, [B, 1, D] views of ``table + temb`` per sample or [B, S, D] per token, and
    no tables."""
    at = 1 if temb.ndim == 3 or terms_first else 2
    if (temb.ndim == 4 and temb.dtype == x_dtype and table.dtype == torch.float32
            and temb.stride(-1) == 1):
        return temb.unbind(at), table.reshape(6, -1).unbind(0)
    if temb.ndim == 4:
        table = table.unsqueeze(3 - at)
    if temb.dtype == torch.float32 and table.dtype == torch.float32:
        terms = modulation_sum(table, temb)
    else:
        # A 16-bit temb is widened inside the add, in one pass: the model's ``temb.float()``
        # first writes an fp32 copy, which per token (SkyReels-V2 at 51000 tokens: 1.9 GB a
        # block) costs a pass of its own. The sum is the same.
        terms = table.float() + temb
    terms = terms.chunk(6, dim=at)
    return (tuple(t.squeeze(at) for t in terms) if temb.ndim == 4 else terms), (None,) * 6


def _block_forward(
    block: torch.nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor = None,
) -> torch.Tensor:
    """Wan's block; SkyReels-V2's also takes the self-attention's mask."""
    skyreels = type(block).__name__ == SKYREELS_V2.block
    if (grad_needed(block, hidden_states, encoder_hidden_states, temb)
            or not fusable(hidden_states, block.scale_shift_table)):
        mask = (attention_mask,) if skyreels else ()
        return original_forward(block)(hidden_states, encoder_hidden_states, temb, rotary_emb,
                                       *mask)
    # (WanVACE hands the first block the patch embedding's transposed output)
    hidden_states = rows(hidden_states)
    terms, tables = _modulation(block.scale_shift_table, temb, skyreels, hidden_states.dtype)
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = terms
    t_shift_msa, t_scale_msa, t_gate_msa, t_c_shift_msa, t_c_scale_msa, t_c_gate_msa = tables

    norm_hidden_states = fb.adaln(hidden_states, scale_msa, shift_msa, norm_type="layer",
                                  eps=block.norm1.eps, scale_table=t_scale_msa,
                                  shift_table=t_shift_msa)
    attn_output = block.attn1(norm_hidden_states, None, attention_mask, rotary_emb)
    norm2 = block.norm2
    if isinstance(norm2, torch.nn.LayerNorm) and fusable(hidden_states, norm2.weight, norm2.bias):
        norm_hidden_states, hidden_states = fb.gated_residual_norm(
            hidden_states, attn_output, gate_msa, weight=norm2.weight, bias=norm2.bias,
            norm_type="layer", eps=norm2.eps, gate_table=t_gate_msa)
    else:
        # Identity (cross_attn_norm=False), or an affine norm whose weight an offload hook
        # loads only when the module runs
        hidden_states = fb.gated_residual(hidden_states, attn_output, gate_msa, t_gate_msa)
        norm_hidden_states = norm2(hidden_states.float()).type_as(hidden_states)

    attn_output = block.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    norm_hidden_states, hidden_states = fb.gated_residual_norm(
        hidden_states, attn_output, None, c_scale_msa, c_shift_msa, norm_type="layer",
        eps=block.norm3.eps, scale_table=t_c_scale_msa, shift_table=t_c_shift_msa)

    ff_output = block.ffn(norm_hidden_states)
    return fb.gated_residual(hidden_states, ff_output, c_gate_msa, t_c_gate_msa)


def _block_unfusable(block: torch.nn.Module) -> str:
    """Why the block cannot be fused ("" when it can)."""
    for name in ("norm1", "norm3"):
        norm = getattr(block, name, None)
        if not isinstance(norm, torch.nn.LayerNorm) or norm.weight is not None:
            return f"{name} is not a LayerNorm without affine"
    if not isinstance(block.norm2, (torch.nn.LayerNorm, torch.nn.Identity)):
        return f"norm2 is {type(block.norm2).__name__}"
    return ""


# --------------------------------------------------------------------------- patch


def patch(model: torch.nn.Module, report, **options) -> None:
    family, names = next((f, n) for f, n in FAMILIES.items()
                         if contains_class(model, n.model, n.block))
    report.family = family
    processor = SkyReelsV2FusedAttnProcessor if names is SKYREELS_V2 else WanFusedAttnProcessor
    image_cross_attention = 0
    for path, module in model.named_modules():
        kind = type(module).__name__
        if kind == names.block:
            norms = [c for c in ("norm1", "norm2", "norm3")
                     if isinstance(getattr(module, c, None), torch.nn.LayerNorm)]
            patch_block(path, module, report, _block_unfusable(module), _block_forward,
                        "wan block", norms, "adaln(layer, fp32 modulation) + "
                                            "gated_residual_norm(layer) x2 + gated_residual")
        elif kind == names.attention:
            image = getattr(module, "add_k_proj", None) is not None
            why = patch_qk_norm_attention(
                path, module, report, names.processor, processor,
                "processor: qk_norm_rope(across heads, interleaved) (self) / rms_norm q, k "
                "(cross)", why=IMAGE_CROSS_ATTENTION if image else "")
            image_cross_attention += why == IMAGE_CROSS_ATTENTION
    if image_cross_attention:
        report.note(f"{family}: image-conditioned cross-attention (I2V image tokens) runs diffusers' "
                    "processor")
