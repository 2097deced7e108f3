"""FLUX.1 (``FluxTransformer2DModel``) on fusebox, the models built on its block classes (FLUX's
ControlNet), and the models that copy its blocks and attention word for word under their own
class names (LongCat-Image, Ovis-Image's double-stream blocks, Bria FIBO's double-stream
blocks): found by their source (:func:`reads_as_flux`).

- ``FluxAttention``: a processor that runs the per-head q/k RMSNorm and the interleaved RoPE
  of each stream as one ``qk_norm_rope`` launch (text with the first rows of the joint
  ``(cos, sin)`` tables, image with the rest), then concatenates text-then-image and calls
  ``dispatch_attention_fn`` with the processor's attention backend and parallel config, as
  ``FluxAttnProcessor`` does;
- double-stream blocks: per stream, the gated attention residual and ``norm2`` + modulation
  become one ``gated_residual_norm``, the feed-forward residual one ``gated_residual``;
- single-stream blocks: ``proj_mlp`` bias + GELU-tanh in one pass, the gated residual in one
  ``gated_residual``.

The AdaLayerNormZero(-Single)/Continuous norms and the feed-forward GELU are left to the
generic pass (:mod:`._modules`).
"""

from __future__ import annotations

import functools
import sys
from typing import Optional

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxAttnProcessor,
    FluxSingleTransformerBlock,
    FluxTransformer2DModel,
    FluxTransformerBlock,
    _get_qkv_projections,
)

from .._common import source_text
from ._shared import (
    FusedAttnProcessor,
    context_stream_tail,
    install_processor,
    linear_act,
    linear_rows,
    norm_rope,
    original_processor,
    patch_two_stream_model,
    single_stream_out,
    split_rotary,
    stream_tail,
)

FAMILY = "flux"


# --------------------------------------------------------------------------- FLUX's copies


def _flux_normal_form(text: str, prefix: str) -> str:
    """Source text (``source_text``) of a class copied from FLUX's module with its class names
    renamed (``prefix``Attention for FluxAttention...), in FLUX's words: the prefix back to
    "Flux", heads split by count or by width (the same split: heads * head_dim is the width),
    and the ``.contiguous()`` FLUX puts before its output projections (no change of values)."""
    text = text.replace(prefix, "Flux") if prefix else text
    text = text.replace("unflatten(-1,(attn.heads,-1))", "unflatten(-1,(-1,attn.head_dim))")
    return text.replace(".contiguous())", ")")


@functools.lru_cache(maxsize=None)
def reads_as_flux(cls: type, flux_cls: type, method: str = "forward") -> bool:
    """Is ``cls`` a copy of FLUX's ``flux_cls`` (named ``<prefix><its name without Flux>``)
    whose ``method`` reads as FLUX's, word for word? LongCat-Image, Ovis-Image and Bria FIBO
    copy FLUX's blocks and attention this way."""
    suffix = flux_cls.__name__[len("Flux"):]
    if cls is flux_cls or not cls.__name__.endswith(suffix):
        return cls is flux_cls
    prefix = cls.__name__[: -len(suffix)]
    ours = source_text(getattr(cls, method, None))
    return bool(ours) and (_flux_normal_form(ours, prefix)
                           == _flux_normal_form(source_text(getattr(flux_cls, method)), ""))


def _flux_attention(module: torch.nn.Module) -> bool:
    """FLUX's attention module or a copy of it whose processor and projections read as FLUX's."""
    cls = type(module)
    if cls is FluxAttention:
        return type(original_processor(module)) is FluxAttnProcessor
    processor = type(original_processor(module))
    helper = sys.modules[cls.__module__].__dict__.get("_get_qkv_projections")
    prefix = cls.__name__[: -len("Attention")]
    return (reads_as_flux(cls, FluxAttention, "__init__")
            and reads_as_flux(processor, FluxAttnProcessor, "__call__")
            and helper is not None
            and _flux_normal_form(source_text(helper), prefix)
            == source_text(_get_qkv_projections))


def _block_class(model: torch.nn.Module, flux_cls: type) -> Optional[type]:
    """The class of ``model``'s modules that is FLUX's ``flux_cls`` or reads as it."""
    return next((type(m) for m in model.modules() if reads_as_flux(type(m), flux_cls)), None)


def applies(model: torch.nn.Module) -> bool:
    return (isinstance(model, FluxTransformer2DModel)
            or _block_class(model, FluxTransformerBlock) is not None)


class FluxFusedAttnProcessor(FusedAttnProcessor):
    """``FluxAttnProcessor`` with the q/k norms and RoPE of each stream in one launch (each
    falls back to the eager formula on its own, so no call needs the original processor).
    FLUX.2's joint attention is the same computation with its own projection helper."""

    project = staticmethod(_get_qkv_projections)   # (attn, x, context) -> q, k, v, cq, ck, cv

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        query, key, value, encoder_query, encoder_key, encoder_value = self.project(
            attn, hidden_states, encoder_hidden_states)
        query = query.unflatten(-1, (-1, attn.head_dim))
        key = key.unflatten(-1, (-1, attn.head_dim))
        value = value.unflatten(-1, (-1, attn.head_dim))

        if attn.added_kv_proj_dim is not None:
            encoder_query = encoder_query.unflatten(-1, (-1, attn.head_dim))
            encoder_key = encoder_key.unflatten(-1, (-1, attn.head_dim))
            encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
            # the joint tables are text rows then image rows: each stream gets its own rows
            text_rotary, image_rotary = split_rotary(image_rotary_emb, encoder_query.shape[1])
            encoder_query, encoder_key = norm_rope(encoder_query, encoder_key, attn.norm_added_q,
                                                   attn.norm_added_k, text_rotary)
            query, key = norm_rope(query, key, attn.norm_q, attn.norm_k, image_rotary)
            query = torch.cat([encoder_query, query], dim=1)
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)
        else:
            query, key = norm_rope(query, key, attn.norm_q, attn.norm_k, image_rotary_emb)

        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
            parallel_config=self._parallel_config)
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        if encoder_hidden_states is not None:
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [encoder_hidden_states.shape[1],
                 hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1)
            hidden_states = attn.to_out[1](linear_rows(attn.to_out[0], hidden_states))
            encoder_hidden_states = linear_rows(attn.to_add_out, encoder_hidden_states)
            return hidden_states, encoder_hidden_states
        return hidden_states


def double_block(self, hidden_states, encoder_hidden_states, temb, context_temb,
                 image_rotary_emb, attention_kwargs):
    """FLUX's double-stream block (Chroma's too, with a modulation of its own per stream):
    AdaLN-Zero per stream, the joint attention, then each stream's tail."""
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(
        hidden_states, emb=temb)
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = (
        self.norm1_context(encoder_hidden_states, emb=context_temb))

    attention_outputs = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **attention_kwargs,
    )
    attn_output, context_attn_output = attention_outputs[0], attention_outputs[1]

    hidden_states = stream_tail(hidden_states, attn_output, gate_msa, self.norm2, scale_mlp,
                                shift_mlp, self.ff, gate_mlp)
    if len(attention_outputs) == 3:   # IP-adapter processors add a third output
        hidden_states = hidden_states + attention_outputs[2]
    encoder_hidden_states = context_stream_tail(self, encoder_hidden_states, context_attn_output,
                                                c_gate_msa, c_scale_mlp, c_shift_mlp, c_gate_mlp)
    return encoder_hidden_states, hidden_states


def single_block(self, hidden_states, temb, image_rotary_emb, attention_kwargs):
    """FLUX's single-stream block over the joint tokens (Chroma's too)."""
    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    mlp_hidden_states = linear_act(self.proj_mlp, self.act_mlp, norm_hidden_states)
    attn_output = self.attn(
        hidden_states=norm_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **attention_kwargs,
    )

    hidden_states = single_stream_out(self, residual, attn_output, mlp_hidden_states, gate)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states


def _double_block_forward(self, hidden_states, encoder_hidden_states, temb,
                          image_rotary_emb=None, joint_attention_kwargs=None):
    return double_block(self, hidden_states, encoder_hidden_states, temb, temb,
                        image_rotary_emb, joint_attention_kwargs or {})


def _single_block_forward(self, hidden_states, encoder_hidden_states, temb,
                          image_rotary_emb=None, joint_attention_kwargs=None):
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    hidden_states = single_block(self, hidden_states, temb, image_rotary_emb,
                                 joint_attention_kwargs or {})
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


def patch_attention(path, module, report) -> None:
    if not hasattr(module, "processor") or not (
            type(module) is FluxAttention or reads_as_flux(type(module), FluxAttention, "__init__")):
        return
    if not _flux_attention(module):
        report.skip(path, module, f"processor {type(original_processor(module)).__name__} kept")
        return
    install_processor(module, FluxFusedAttnProcessor)
    report.add(path, module, "qk_norm_rope per head (interleaved), per stream")


def patch(model: torch.nn.Module, report, **options) -> None:
    double = _block_class(model, FluxTransformerBlock)
    single = _block_class(model, FluxSingleTransformerBlock)
    if not isinstance(model, FluxTransformer2DModel):
        report.note(f"{type(model).__name__}: its blocks{'' if single else ' (double-stream)'} "
                    "and attention are FLUX's or read as FLUX's, and get FLUX's fusions")
    patch_two_stream_model(model, report, FAMILY, (double, _double_block_forward),
                           (single, _single_block_forward), patch_attention)
