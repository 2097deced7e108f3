"""PixArt-alpha / PixArt-Sigma (``PixArtTransformer2DModel``) on fusebox.

``BasicTransformerBlock`` with ``norm_type="ada_norm_single"``: the ``scale_shift_table`` +
timestep modulation stays (a ``[B, 6, D]`` add), then ``norm1`` + modulation is one ``adaln``
(LayerNorm without affine), the self-attention gated residual one ``gated_residual``, the
cross-attention residual and ``norm2`` + modulation one ``gated_residual_norm``, and the
feed-forward gated residual one ``gated_residual``. The feed-forward GELU-tanh and the other
norms are left to the generic pass.
"""

from __future__ import annotations

import torch
from diffusers.models.attention import BasicTransformerBlock, _chunked_feed_forward
from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel

from .._common import original_forward, replace_forward
from ._shared import gated_add, gated_add_norm, mark_fused, modulated_norm, modulation_sum

FAMILY = "pixart"


def applies(model: torch.nn.Module) -> bool:
    return isinstance(model, PixArtTransformer2DModel)


def _ada_norm_single_block_forward(self, hidden_states, attention_mask=None,
                                   encoder_hidden_states=None, encoder_attention_mask=None,
                                   timestep=None, cross_attention_kwargs=None, class_labels=None,
                                   added_cond_kwargs=None):
    cross_attention_kwargs = dict(cross_attention_kwargs or {})
    if (hidden_states.ndim != 3 or self.pos_embed is not None or "gligen" in cross_attention_kwargs
            or cross_attention_kwargs.get("scale") is not None):
        # rare inputs (GLIGEN, positional embedding, the deprecated `scale`): diffusers' code
        return original_forward(self)(
            hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
            timestep, cross_attention_kwargs, class_labels, added_cond_kwargs)

    batch_size = hidden_states.shape[0]
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation_sum(
        self.scale_shift_table[None], timestep.reshape(batch_size, 6, -1)).chunk(6, dim=1)
    norm_hidden_states = modulated_norm(self.norm1, hidden_states, scale_msa, shift_msa)

    attn_output = self.attn1(
        norm_hidden_states,
        encoder_hidden_states=encoder_hidden_states if self.only_cross_attention else None,
        attention_mask=attention_mask,
        **cross_attention_kwargs,
    )
    if self.attn2 is None:
        norm_hidden_states, hidden_states = gated_add_norm(
            hidden_states, attn_output, gate_msa, self.norm2, scale_mlp, shift_mlp)
    else:
        hidden_states = gated_add(hidden_states, attn_output, gate_msa)
        # PixArt's cross-attention reads the residual stream without a norm
        attn_output = self.attn2(
            hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            attention_mask=encoder_attention_mask,
            **cross_attention_kwargs,
        )
        norm_hidden_states, hidden_states = gated_add_norm(
            hidden_states, attn_output, None, self.norm2, scale_mlp, shift_mlp)

    if self._chunk_size is not None:
        ff_output = _chunked_feed_forward(self.ff, norm_hidden_states, self._chunk_dim,
                                          self._chunk_size)
    else:
        ff_output = self.ff(norm_hidden_states)
    return gated_add(hidden_states, ff_output, gate_mlp)


def patch(model: torch.nn.Module, report, **options) -> None:
    report.family = FAMILY
    for path, module in model.named_modules():
        if type(module) is not BasicTransformerBlock:
            continue
        if module.norm_type != "ada_norm_single":
            report.skip(path, module, f"norm_type {module.norm_type!r} (generic modules only)")
            continue
        replace_forward(module, _ada_norm_single_block_forward, "pixart block")
        report.add(path, module, "adaln + gated_residual + gated_residual_norm + gated_residual")
        mark_fused(module.norm1, "the block's adaln")
        mark_fused(module.norm2, "the block's gated_residual_norm")
