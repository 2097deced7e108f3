"""Chroma (``ChromaTransformer2DModel``) on fusebox: FLUX's blocks with the modulation terms
handed in ready-made (its pruned AdaLN layers, fused by the generic pass) and a text padding
mask that each block squares before its attention, as diffusers does.

- double-stream blocks: FLUX's fused block (:func:`.flux.double_block`), the image stream
  modulated by the first six terms and the text stream by the next six;
- single-stream blocks: FLUX's fused single block (:func:`.flux.single_block`);
- attention: FLUX's fused processor (:class:`.flux.FluxFusedAttnProcessor`).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_chroma import (
    ChromaSingleTransformerBlock,
    ChromaTransformer2DModel,
    ChromaTransformerBlock,
)

from ._shared import patch_two_stream_model
from .flux import double_block, patch_attention, single_block

FAMILY = "chroma"


def applies(model: torch.nn.Module) -> bool:
    return isinstance(model, ChromaTransformer2DModel)


def _attention_kwargs(attention_mask, joint_attention_kwargs):
    """The attention's keyword arguments, with the text mask squared as the block squares it."""
    kwargs = dict(joint_attention_kwargs or {})
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask[:, None, None, :] * attention_mask[:, None, :, None]
    return kwargs


def _double_block_forward(self, hidden_states, encoder_hidden_states, temb,
                          image_rotary_emb=None, attention_mask=None, joint_attention_kwargs=None):
    return double_block(self, hidden_states, encoder_hidden_states, temb[:, :6], temb[:, 6:],
                        image_rotary_emb, _attention_kwargs(attention_mask, joint_attention_kwargs))


def _single_block_forward(self, hidden_states, temb, image_rotary_emb=None, attention_mask=None,
                          joint_attention_kwargs=None):
    return single_block(self, hidden_states, temb, image_rotary_emb,
                        _attention_kwargs(attention_mask, joint_attention_kwargs))


def patch(model: torch.nn.Module, report, **options) -> None:
    patch_two_stream_model(model, report, FAMILY,
                           (ChromaTransformerBlock, _double_block_forward),
                           (ChromaSingleTransformerBlock, _single_block_forward), patch_attention)
