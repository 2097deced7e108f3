"""HunyuanVideo 1.5 (``HunyuanVideo15Transformer3DModel``) on fusebox.

- text padding, at the model's input (a forward pre-hook, eager calls only): the pipeline pads
  the Qwen2.5-VL text to 1000 tokens and the ByT5 glyph text to 256, and text-to-video hands
  729 all-zero SigLIP image tokens, all masked; padded tokens never reach a valid one (masked as
  keys everywhere, the refiner's pooling a masked mean) and the output reads only the video
  tokens. The hook drops the text columns that are padding in every sample and, for all-zero
  image embeddings (diffusers' text-to-video test), every image token; when every text token
  left is valid, it tells the fused attention processors so, and they attend unmasked, compiled
  blocks too. A forward hook clears that after each call;
- attention (``HunyuanVideo15AttnProcessor2_0``): the video tokens' per-head q/k RMSNorm and
  interleaved RoPE as one ``qk_norm_rope`` launch, the text tokens' q/k norms (no RoPE) as
  ``rms_norm``; concatenation video-then-text; attention over all keys unmasked when every text
  token is valid, else over the valid keys only (unmasked over a valid prefix, else with a key
  mask) instead of diffusers' square mask, the padded text queries zeroed as that mask leaves
  them; each stream's output projection run on its slice of the attention output;
- dual-stream blocks, per stream: the gated attention residual + ``norm2`` + modulation as one
  ``gated_residual_norm``, the feed-forward residual as one ``gated_residual``. ``norm1``
  (AdaLayerNormZero) and the feed-forward GELU go to the generic pass.

The token refiner keeps its forward; its generic modules are fused by the generic pass.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_hunyuan_video15 import (
    HunyuanVideo15AttnProcessor2_0,
    HunyuanVideo15Transformer3DModel,
    HunyuanVideo15TransformerBlock,
)

from .._common import replace_forward
from ._shared import (
    FusedAttnProcessor,
    PaddedStream,
    attend,
    drop_padded_columns,
    grad_needed,
    linear_rows,
    mark_fused,
    norm_rope,
    stream_qkv,
    swap_processor,
    trim_text_padding,
    valid_key_prefix,
)
from .hunyuan_video import double_block_forward

FAMILY = "hunyuan-video-1.5"


def applies(model: torch.nn.Module) -> bool:
    return isinstance(model, HunyuanVideo15Transformer3DModel)


class HunyuanVideo15FusedAttnProcessor(FusedAttnProcessor):
    """``HunyuanVideo15AttnProcessor2_0`` with the video q/k norms and RoPE in one launch.
    Calls it cannot fuse (gradients, no text stream or mask) run the original processor."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        if (encoder_hidden_states is None or attention_mask is None
                or grad_needed(attn, hidden_states, encoder_hidden_states)):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 image_rotary_emb)

        query, key, value = stream_qkv(attn, hidden_states)
        query, key = norm_rope(query, key, attn.norm_q, attn.norm_k, image_rotary_emb)
        encoder_query, encoder_key, encoder_value = stream_qkv(attn, encoder_hidden_states,
                                                               context=True)
        encoder_query, encoder_key = norm_rope(encoder_query, encoder_key, attn.norm_added_q,
                                               attn.norm_added_k, None)
        query = torch.cat([query, encoder_query], dim=1)
        key = torch.cat([key, encoder_key], dim=1)
        value = torch.cat([value, encoder_value], dim=1)

        text = encoder_hidden_states.shape[1]
        valid_text = text if self.text_all_valid() else valid_key_prefix(self, attention_mask)
        hidden_states = self._joint_attention(query, key, value, attention_mask, valid_text)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        video_out, text_out = hidden_states[:, :-text], hidden_states[:, -text:]
        if valid_text != text:
            # diffusers masks padded text queries from every key: their rows come out of
            # attention as zeros, here too (they never reach a valid token: padded keys are masked)
            text_out = text_out * attention_mask.bool().to(text_out.dtype).unsqueeze(-1)
        if getattr(attn, "to_out", None) is not None:
            video_out = attn.to_out[1](linear_rows(attn.to_out[0], video_out))
        if getattr(attn, "to_add_out", None) is not None:
            text_out = linear_rows(attn.to_add_out, text_out)
        return video_out, text_out

    def _joint_attention(self, query, key, value, text_mask, valid_text):
        """Attention of every token over the valid ones. diffusers masks both sides (a
        ``[B, 1, S, S]`` mask, rebuilt in every block over S^2 bytes, which keeps SDPA on its
        masked kernel); the valid tokens' outputs need only the keys' side. The model puts
        valid text first, so when every sample pads the same text suffix (``valid_text``
        tokens each) the keys are cut to the valid prefix and attention runs unmasked;
        otherwise the key mask is ``[B, 1, 1, S]``."""
        batch, seq = query.shape[:2]
        video = seq - text_mask.shape[1]
        if valid_text is not None:
            return attend(self, query, key, value, video + valid_text, None)
        mask = F.pad(text_mask.bool(), (video, 0), value=True).view(batch, 1, 1, seq)
        return attend(self, query, key, value, None, mask)


TEXT_INPUTS = ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2",
               "encoder_attention_mask_2", "image_embeds")


def _trim_text(inputs) -> Optional[bool]:
    """The model's text inputs without their padding (see the module's docstring); whether every
    text token left is valid. The Qwen2.5-VL stream keeps a token: the refiner cannot run on
    none. None when an input diffusers' forward needs is missing (it fails on its own)."""
    if any(inputs[name] is None for name in TEXT_INPUTS):
        return None
    image_embeds = inputs["image_embeds"]
    trimmed = drop_padded_columns(
        [PaddedStream(inputs["encoder_attention_mask"], inputs["encoder_hidden_states"],
                      never_empty=True),
         PaddedStream(inputs["encoder_attention_mask_2"], inputs["encoder_hidden_states_2"])],
        torch.all(image_embeds == 0))
    ((inputs["encoder_attention_mask"], inputs["encoder_hidden_states"]),
     (inputs["encoder_attention_mask_2"], inputs["encoder_hidden_states_2"])) = trimmed.streams
    if trimmed.flags[0]:
        # text-to-video: diffusers masks every image token (and, with none, still takes this
        # path); otherwise the image tokens are all valid
        inputs["image_embeds"] = image_embeds[:, :0]
    return trimmed.all_valid


def patch(model: torch.nn.Module, report, **options) -> None:
    report.family = FAMILY
    for path, module in model.named_modules():
        if type(module) is HunyuanVideo15TransformerBlock:
            replace_forward(module, double_block_forward, f"{FAMILY} block")
            report.add(path, module, "gated_residual_norm + gated_residual, both streams")
            for norm in ("norm2", "norm2_context"):
                mark_fused(getattr(module, norm), "the block's gated_residual_norm")
        else:
            swap_processor(path, module, report, {HunyuanVideo15AttnProcessor2_0: (
                HunyuanVideo15FusedAttnProcessor,
                "qk_norm_rope per head (interleaved) for video, rms_norm for text")})
    # the trim is exact for the forward read above, not for one a subclass rewrites
    if type(model).forward is HunyuanVideo15Transformer3DModel.forward:
        trim_text_padding(model, TEXT_INPUTS, _trim_text)
        report.note(f"{FAMILY}: the text padding is trimmed at the model's input (eager calls)")
