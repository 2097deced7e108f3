"""Qwen-Image (``QwenImageTransformer2DModel``) on fusebox.

- attention (``QwenDoubleStreamAttnProcessor2_0``): per stream, the per-head q/k RMSNorm and
  the RoPE as one ``qk_norm_rope`` launch. The model's complex frequencies multiply
  consecutive channel pairs, which is the interleaved rotation with each pair's cos and sin
  written twice; those tables are formed once per forward, not once per block. Concatenation
  is text-then-image, the joint mask is built (dropped when the text mask lets every token
  through, so SDPA runs unmasked) and ``dispatch_attention_fn`` called with the processor's
  backend and parallel config, as in diffusers;
- model input (eager calls): the text columns after every sample's last valid token are
  dropped, and when every text token left is valid the processors know it without reading the
  mask, so compiled blocks attend unmasked as well (:func:`._shared.trim_text_padding`);
- blocks: per stream, ``norm1`` + modulation in one ``adaln``, the gated attention residual +
  ``norm2`` + modulation in one ``gated_residual_norm``, the feed-forward residual in one
  ``gated_residual``. The edit models' per-token modulation (``zero_cond_t``) keeps the
  block's forward.

The feed-forward GELU and the output AdaLayerNormContinuous are left to the generic pass
(:mod:`._modules`).
"""

from __future__ import annotations

from typing import List, Optional

import torch
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    QwenImageTransformer2DModel,
    QwenImageTransformerBlock,
)

from .._common import original_forward, replace_forward
from ._shared import (
    FusedAttnProcessor,
    attend,
    built_on,
    complex_rotary_tables,
    grad_needed,
    linear_rows,
    mark_fused,
    modulated_norm,
    norm_rope,
    stream_qkv,
    stream_tail,
    swap_processor,
    text_suffix_trim,
    trim_text_padding,
    valid_key_prefix,
)

FAMILY = "qwen-image"


def applies(model: torch.nn.Module) -> bool:
    """Qwen-Image, and the models built on its blocks (its ControlNet)."""
    return built_on(model, QwenImageTransformer2DModel, QwenImageTransformerBlock)


def _complex_pair(rotary) -> bool:
    """Qwen-Image's (image, text) complex frequencies ``[S, D/2]``."""
    return (isinstance(rotary, (tuple, list)) and len(rotary) == 2
            and all(isinstance(f, torch.Tensor) and f.is_complex() and f.dim() == 2 for f in rotary))


# --------------------------------------------------------------------------- attention


class QwenImageFusedAttnProcessor(FusedAttnProcessor):
    """``QwenDoubleStreamAttnProcessor2_0`` with each stream's q/k norms and RoPE in one launch.
    Calls it cannot fuse (gradients, an external mask, other frequency formats) run the
    original processor."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None,
                 encoder_hidden_states_mask=None, attention_mask=None, image_rotary_emb=None):
        if (encoder_hidden_states is None or attention_mask is not None
                or not _complex_pair(image_rotary_emb)
                or grad_needed(attn, hidden_states, encoder_hidden_states)):
            return self.original(attn, hidden_states, encoder_hidden_states,
                                 encoder_hidden_states_mask, attention_mask, image_rotary_emb)
        seq_txt = encoder_hidden_states.shape[1]
        # a text mask that lets every token through is dropped: SDPA then runs unmasked
        if (encoder_hidden_states_mask is not None and not self.text_all_valid()
                and valid_key_prefix(self, encoder_hidden_states_mask) != seq_txt):
            image_mask = torch.ones(hidden_states.shape[:2], dtype=torch.bool,
                                    device=hidden_states.device)
            attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)
            attention_mask = attention_mask[:, None, None, :]
        img_query, img_key, img_value = stream_qkv(attn, hidden_states)
        txt_query, txt_key, txt_value = stream_qkv(attn, encoder_hidden_states, context=True)
        img_freqs, txt_freqs = image_rotary_emb
        img_query, img_key = norm_rope(img_query, img_key, attn.norm_q, attn.norm_k,
                                       complex_rotary_tables(img_freqs))
        txt_query, txt_key = norm_rope(txt_query, txt_key, attn.norm_added_q, attn.norm_added_k,
                                       complex_rotary_tables(txt_freqs))

        joint_query = torch.cat([txt_query, img_query], dim=1)
        joint_key = torch.cat([txt_key, img_key], dim=1)
        joint_value = torch.cat([txt_value, img_value], dim=1)
        joint = attend(self, joint_query, joint_key, joint_value, None, attention_mask)
        joint = joint.flatten(2, 3).to(joint_query.dtype)

        img_out = linear_rows(attn.to_out[0], joint[:, seq_txt:])
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)  # dropout
        txt_out = linear_rows(attn.to_add_out, joint[:, :seq_txt])
        return img_out, txt_out


# --------------------------------------------------------------------------- blocks


def _block_forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                   image_rotary_emb=None, joint_attention_kwargs=None,
                   modulate_index: Optional[List[int]] = None):
    if (self.zero_cond_t or modulate_index is not None
            or grad_needed(self, hidden_states, encoder_hidden_states)):
        return original_forward(self)(hidden_states, encoder_hidden_states,
                                      encoder_hidden_states_mask, temb, image_rotary_emb,
                                      joint_attention_kwargs, modulate_index)
    # [B, 6 * dim] each: shift, scale, gate of norm1, then of norm2
    img_mod = self.img_mod(temb).chunk(6, dim=-1)
    txt_mod = self.txt_mod(temb).chunk(6, dim=-1)

    img_modulated = modulated_norm(self.img_norm1, hidden_states, img_mod[1][:, None],
                                   img_mod[0][:, None])
    txt_modulated = modulated_norm(self.txt_norm1, encoder_hidden_states, txt_mod[1][:, None],
                                   txt_mod[0][:, None])
    img_attn_output, txt_attn_output = self.attn(
        hidden_states=img_modulated,
        encoder_hidden_states=txt_modulated,
        encoder_hidden_states_mask=encoder_hidden_states_mask,
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    hidden_states = stream_tail(hidden_states, img_attn_output, img_mod[2], self.img_norm2,
                                img_mod[4], img_mod[3], self.img_mlp, img_mod[5])
    encoder_hidden_states = stream_tail(encoder_hidden_states, txt_attn_output, txt_mod[2],
                                        self.txt_norm2, txt_mod[4], txt_mod[3], self.txt_mlp,
                                        txt_mod[5])
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


TEXT_INPUTS = ("encoder_hidden_states", "encoder_hidden_states_mask")
# the text RoPE numbers columns, so only the padding after every sample's last valid token goes
_trim_text = text_suffix_trim(*TEXT_INPUTS)


def patch(model: torch.nn.Module, report, **options) -> None:
    report.family = FAMILY
    for path, module in model.named_modules():
        if type(module) is QwenImageTransformerBlock:
            replace_forward(module, _block_forward, f"{FAMILY} block")
            report.add(path, module, "adaln + gated_residual_norm + gated_residual, both streams")
            for norm in ("img_norm1", "txt_norm1"):
                mark_fused(getattr(module, norm), "the block's adaln")
            for norm in ("img_norm2", "txt_norm2"):
                mark_fused(getattr(module, norm), "the block's gated_residual_norm")
        else:
            swap_processor(path, module, report, {QwenDoubleStreamAttnProcessor2_0: (
                QwenImageFusedAttnProcessor, "qk_norm_rope per head (interleaved), per stream")})
    # the trim is exact for the forward read above, not for the ControlNet's or a subclass's
    if type(model).forward is QwenImageTransformer2DModel.forward:
        trim_text_padding(model, TEXT_INPUTS, _trim_text)
        report.note(f"{FAMILY}: the text padding is trimmed at the model's input (eager calls)")
