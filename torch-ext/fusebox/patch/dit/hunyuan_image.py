"""HunyuanImage 2.1 (``HunyuanImageTransformer2DModel``: the base and distilled text-to-image
models and the refiner) on fusebox.

HunyuanImage's double- and single-stream blocks and its attention processor are HunyuanVideo's
under their own names: their forwards read as HunyuanVideo's word for word (checked on the
source at patch time, :func:`reads_as_hunyuan_video`; a class that has drifted keeps its
forward), so they take :mod:`.hunyuan_video`'s fused forwards and processor:

- attention (``HunyuanImageAttnProcessor``): the image tokens' per-head q/k RMSNorm and
  interleaved RoPE as one ``qk_norm_rope`` launch (the text tokens of the single-stream blocks
  in the same launch with identity rows), the double-stream text q/k norms as ``rms_norm``;
  ``dispatch_attention_fn`` with the processor's backend and parallel config, unmasked over
  the valid keys when every text token is valid or when the valid keys are the same prefix in
  every sample;
- double-stream blocks, per stream: gated attention residual + ``norm2`` + modulation as one
  ``gated_residual_norm``, the feed-forward residual as one ``gated_residual``;
- single-stream blocks: ``proj_mlp`` bias + GELU-tanh in one pass, one ``gated_residual``;
- text padding, at the model's input (a forward pre-hook, eager calls only): the pipeline pads
  the Qwen2.5-VL text to 1000 tokens and the ByT5 glyph text to 128 (all padding for a prompt
  without quoted text). Padded tokens never reach a valid one (masked as keys in the refiner
  and the blocks, the refiner's pooling a masked mean, the output read from the image tokens
  only), so the columns after every sample's last valid token go, and a glyph stream without a
  valid token goes whole; when every text token left is valid the fused processors attend
  unmasked. A forward hook clears that after each call.

``norm1`` / ``norm1_context`` (AdaLayerNormZero), the single-stream ``norm``
(AdaLayerNormZeroSingle), the feed-forward GELU and ``norm_out`` go to the generic pass
(``adaln``, ``activation``). The token refiner and the ByT5 projection (a few text tokens,
negligible cost) keep their forwards; their LayerNorms go to the generic pass.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Dict, Optional

import torch
from diffusers.models.transformers.transformer_hunyuan_video import (
    HunyuanVideoAttnProcessor2_0,
    HunyuanVideoSingleTransformerBlock,
    HunyuanVideoTransformerBlock,
)
from diffusers.models.transformers.transformer_hunyuanimage import (
    HunyuanImageAttnProcessor,
    HunyuanImageSingleTransformerBlock,
    HunyuanImageTransformer2DModel,
    HunyuanImageTransformerBlock,
)

from .._common import source_text
from ._shared import (
    PaddedStream,
    built_on,
    drop_padded_columns,
    patch_two_stream_model,
    trim_text_padding,
)
from .hunyuan_video import double_block_forward, patch_attention, single_block_forward

FAMILY = "hunyuan-image"


def applies(model: torch.nn.Module) -> bool:
    return built_on(model, HunyuanImageTransformer2DModel, HunyuanImageTransformerBlock)


def _normal_form(fn) -> str:
    """``fn``'s source (``source_text``) in HunyuanVideo's words: the class prefix, trailing
    commas (formatting), return annotations, and the double-stream block's rotary parameter,
    which HunyuanVideo names ``freqs_cis`` (the fused forward below takes HunyuanImage's name)."""
    text = source_text(fn).replace("HunyuanImage", "HunyuanVideo")
    text = re.sub(r",([)\]])", r"\1", text)
    text = re.sub(r"\)->[^:]*:", "):", text, count=1)
    return text.replace("freqs_cis", "image_rotary_emb")


@functools.lru_cache(maxsize=None)
def reads_as_hunyuan_video(fn, video_fn) -> bool:
    """Does ``fn`` (a HunyuanImage forward or ``__call__``) read as HunyuanVideo's
    ``video_fn``, word for word?"""
    ours = _normal_form(fn)
    return bool(ours) and ours == _normal_form(video_fn)


def _double_block_forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None,
                          image_rotary_emb=None, *args, **kwargs):
    return double_block_forward(self, hidden_states, encoder_hidden_states, temb,
                                attention_mask, image_rotary_emb)


def _unless_drifted(cls, video_cls, method: str = "forward") -> Optional[type]:
    """``cls`` when its ``method`` reads as ``video_cls``'s, else None (not patched)."""
    return cls if reads_as_hunyuan_video(getattr(cls, method),
                                         getattr(video_cls, method)) else None


TEXT_INPUTS = ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2",
               "encoder_attention_mask_2")


def _trim_text(model: torch.nn.Module, inputs: Dict[str, Any]) -> Optional[bool]:
    """The model's text inputs without their padding (see the module's docstring); whether every
    text token left is valid. Only columns after every sample's last valid token go: the refiner
    always lets its first token through as a key, so the Qwen stream's positions matter (and it
    keeps a token); the glyph stream goes whole when it has no valid token (the model then skips
    the reordering it would have put only padding into). None when a needed input is missing."""
    if inputs["encoder_hidden_states"] is None or inputs["encoder_attention_mask"] is None:
        return None
    streams = [PaddedStream(inputs["encoder_attention_mask"], inputs["encoder_hidden_states"],
                            never_empty=True)]
    glyph = (model.context_embedder_2 is not None and inputs["encoder_hidden_states_2"] is not None
             and inputs["encoder_attention_mask_2"] is not None)
    if glyph:
        streams.append(PaddedStream(inputs["encoder_attention_mask_2"],
                                    inputs["encoder_hidden_states_2"]))
    trimmed = drop_padded_columns(streams, suffix_only=True)
    inputs["encoder_attention_mask"], inputs["encoder_hidden_states"] = trimmed.streams[0]
    if glyph:
        mask_2, states_2 = trimmed.streams[1]
        if mask_2.shape[1] == 0:
            mask_2 = states_2 = None
        inputs["encoder_attention_mask_2"], inputs["encoder_hidden_states_2"] = mask_2, states_2
    return trimmed.all_valid


def patch(model: torch.nn.Module, report, **options) -> None:
    double = _unless_drifted(HunyuanImageTransformerBlock, HunyuanVideoTransformerBlock)
    single = _unless_drifted(HunyuanImageSingleTransformerBlock,
                             HunyuanVideoSingleTransformerBlock)
    processor = _unless_drifted(HunyuanImageAttnProcessor, HunyuanVideoAttnProcessor2_0,
                                "__call__")
    for name, cls in (("double-stream blocks", double), ("single-stream blocks", single),
                      ("attention processor", processor)):
        if cls is None:
            report.note(f"{FAMILY}: the {name} no longer read as HunyuanVideo's; kept as they are")
    patch_two_stream_model(model, report, FAMILY, (double, _double_block_forward),
                           (single, single_block_forward),
                           functools.partial(patch_attention, processor_class=processor))
    # the trim is exact for the forward read above, not for one a subclass rewrites
    if processor is not None and type(model).forward is HunyuanImageTransformer2DModel.forward:
        trim_text_padding(model, TEXT_INPUTS, functools.partial(_trim_text, model))
        report.note(f"{FAMILY}: the text padding is trimmed at the model's input (eager calls)")
