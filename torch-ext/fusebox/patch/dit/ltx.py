"""LTX-Video (diffusers ``LTXVideoTransformer3DModel``) on fusebox.

Per ``LTXVideoTransformerBlock``, in the order the block runs:

- ``norm1(x) * (1 + scale_msa) + shift_msa`` (RMSNorm without weight) -> :func:`adaln`;
- self-attention: ``norm_q``/``norm_k`` (RMSNorm over all heads) and the interleaved RoPE on the
  flat ``[B, S, heads * head_dim]`` q/k with LTX's per-channel cos/sin tables ->
  :func:`qk_norm_rope` (one launch for q and k), then diffusers' attention dispatch;
- ``x + attn1 * gate_msa`` -> :func:`gated_residual`;
- ``x + attn2`` then ``norm2(x) * (1 + scale_mlp) + shift_mlp`` -> :func:`gated_residual_norm`;
- feed-forward ``gelu_tanh(x @ W + b)`` -> bias-free matmul + :func:`gelu_tanh` with the bias;
- ``x + ff * gate_mlp`` -> :func:`gated_residual`.

The modulation is per sample (``temb`` [B, 1, 6D], text-to-video) or per token ([B, S, 6D],
image-to-video with a per-token timestep); both are strided views of one table, read in place.
The model's forward is replaced too (a mirror of diffusers 0.42's, installed only where the
signature still matches): it builds one cos/sin table for the whole batch instead of one per
sample, and its final ``norm_out`` + modulation (LayerNorm without affine) -> :func:`adaln`.
"""

from __future__ import annotations

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.utils import apply_lora_scale

from ... import functional as fb
from .._common import original_forward, replace_forward
from ._blocks import (
    FusedAttnProcessor, absorb, attention_unfusable, feed_forward, forward_parameters, fusable,
    gelu_tanh_projection, grad_needed, install_processor, original_processor, rms_eps,
    rms_norm_module,
)

MODEL = "LTXVideoTransformer3DModel"
BLOCK = "LTXVideoTransformerBlock"
ATTENTION = "LTXAttention"


def applies(module: torch.nn.Module) -> bool:
    return any(type(m).__name__ in (MODEL, BLOCK) for m in module.modules())


# --------------------------------------------------------------------------- attention


class LTXFusedAttnProcessor(FusedAttnProcessor):
    """``LTXVideoAttnProcessor`` with q/k RMSNorm and RoPE fused. Same call signature (LTXAttention
    filters keyword arguments by it)."""

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        cos, sin = image_rotary_emb if image_rotary_emb is not None else (None, None)
        if (grad_needed(attn, hidden_states, encoder_hidden_states)
                or not fusable(hidden_states, attn.norm_q.weight, attn.norm_k.weight, cos, sin)):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 image_rotary_emb)
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        batch_size, sequence_length, _ = context.shape
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length,
                                                         batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1,
                                                 attention_mask.shape[-1])

        query = attn.to_q(hidden_states)
        key = attn.to_k(context)
        value = attn.to_v(context)
        if cos is not None:
            # one "head" of width heads * head_dim: the norm spans all heads and the tables
            # hold a frequency per channel
            query, key = fb.qk_norm_rope(query, key, attn.norm_q.weight, attn.norm_k.weight, cos,
                                         sin, eps=rms_eps(attn.norm_q), across_heads=True,
                                         interleaved=True)
        else:
            query = rms_norm_module(attn.norm_q, query)
            key = rms_norm_module(attn.norm_k, key)

        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=self._attention_backend, parallel_config=self._parallel_config)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


# --------------------------------------------------------------------------- block


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
    batch_size = hidden_states.size(0)
    # [B, T, 6, D] with T = 1 (per sample) or T = S (per token); the six terms stay views
    ada = (table[None, None].to(temb.device)
           + temb.reshape(batch_size, temb.size(1), table.shape[0], -1))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = ada.unbind(dim=2)

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

    ff_output = feed_forward(block.ff, norm_hidden_states)
    return fb.gated_residual(hidden_states, ff_output, gate_mlp)


def _block_fusable(block: torch.nn.Module) -> str:
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


# --------------------------------------------------------------------------- model


def _model_forward(
    model: torch.nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    timestep: torch.LongTensor,
    encoder_attention_mask: torch.Tensor,
    num_frames: int | None = None,
    height: int | None = None,
    width: int | None = None,
    rope_interpolation_scale=None,
    video_coords: torch.Tensor | None = None,
    attention_kwargs: dict | None = None,
    return_dict: bool = True,
):
    args = (hidden_states, encoder_hidden_states, timestep, encoder_attention_mask, num_frames,
            height, width, rope_interpolation_scale, video_coords)
    kwargs = dict(attention_kwargs=attention_kwargs, return_dict=return_dict)
    if (grad_needed(model, hidden_states, encoder_hidden_states)
            or not fusable(hidden_states, model.scale_shift_table)):
        return original_forward(model)(*args, **kwargs)
    return _fused_model_forward(model, *args, **kwargs)


@apply_lora_scale("attention_kwargs")
def _fused_model_forward(model, hidden_states, encoder_hidden_states, timestep,
                         encoder_attention_mask, num_frames, height, width,
                         rope_interpolation_scale, video_coords, attention_kwargs=None,
                         return_dict=True):
    """``LTXVideoTransformer3DModel.forward`` (diffusers 0.42) with the output norm and its
    modulation in one :func:`adaln` (the blocks are patched on their own)."""
    # Without per-sample video_coords every sample has the same grid: a [1, S, D] cos/sin table
    # (broadcast over the batch by the kernel) halves the table bytes every block reads.
    rope_input = hidden_states if video_coords is not None else hidden_states[:1]
    image_rotary_emb = model.rope(rope_input, num_frames, height, width, rope_interpolation_scale,
                                  video_coords)
    if encoder_attention_mask is not None and encoder_attention_mask.ndim == 2:
        encoder_attention_mask = (1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0
        encoder_attention_mask = encoder_attention_mask.unsqueeze(1)

    batch_size = hidden_states.size(0)
    hidden_states = model.proj_in(hidden_states)
    temb, embedded_timestep = model.time_embed(timestep.flatten(), batch_size=batch_size,
                                               hidden_dtype=hidden_states.dtype)
    temb = temb.view(batch_size, -1, temb.size(-1))
    embedded_timestep = embedded_timestep.view(batch_size, -1, embedded_timestep.size(-1))
    encoder_hidden_states = model.caption_projection(encoder_hidden_states)
    encoder_hidden_states = encoder_hidden_states.view(batch_size, -1, hidden_states.size(-1))

    for block in model.transformer_blocks:
        hidden_states = block(hidden_states=hidden_states,
                              encoder_hidden_states=encoder_hidden_states, temb=temb,
                              image_rotary_emb=image_rotary_emb,
                              encoder_attention_mask=encoder_attention_mask)

    scale_shift_values = model.scale_shift_table[None, None] + embedded_timestep[:, :, None]
    shift, scale = scale_shift_values[:, :, 0], scale_shift_values[:, :, 1]
    hidden_states = fb.adaln(hidden_states, scale, shift, norm_type="layer", eps=model.norm_out.eps)
    output = model.proj_out(hidden_states)
    if not return_dict:
        return (output,)
    return Transformer2DModelOutput(sample=output)


def _model_fusable(model: torch.nn.Module) -> str:
    norm = getattr(model, "norm_out", None)
    if not isinstance(norm, torch.nn.LayerNorm) or norm.weight is not None:
        return "norm_out is not a LayerNorm without affine"
    if forward_parameters(type(model).forward) != forward_parameters(_model_forward):
        return "forward signature differs from the diffusers version fusebox mirrors"
    return ""


# --------------------------------------------------------------------------- patch


def patch(model: torch.nn.Module, report, **options) -> None:
    report.family = "ltx-video"
    if type(model).__name__ == MODEL:
        why = _model_fusable(model)
        if why:
            report.skip("norm_out", model.norm_out, why)
        else:
            replace_forward(model, _model_forward, "ltx model")
            absorb(model.norm_out, type(model).__name__)
            report.add("norm_out", model.norm_out, "adaln(layer) with the output modulation")
    for path, module in model.named_modules():
        kind = type(module).__name__
        if kind == BLOCK:
            why = _block_fusable(module)
            if why:
                report.skip(path, module, why)
                continue
            replace_forward(module, _block_forward, "ltx block")
            for child in ("norm1", "norm2"):
                absorb(getattr(module, child), path)
            if gelu_tanh_projection(module.ff) is not None:
                absorb(module.ff.net[0], path)
            report.add(path, module, "adaln(rms) + gated_residual + gated_residual_norm(rms) + "
                                     "gelu_tanh(bias) + gated_residual")
        elif kind == ATTENTION:
            why = attention_unfusable(module, "LTXVideoAttnProcessor")
            if why:
                report.skip(path, module, why)
                continue
            install_processor(module, LTXFusedAttnProcessor(original_processor(module)))
            for child in ("norm_q", "norm_k"):
                absorb(getattr(module, child), path)
            report.add(path, module, "processor: qk_norm_rope(across heads, interleaved)")
