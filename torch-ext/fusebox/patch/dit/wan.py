"""Wan 2.1 / 2.2 (diffusers ``WanTransformer3DModel``) on fusebox.

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
- feed-forward GELU-tanh with its bias -> :func:`gelu_tanh`;
- ``(x.float() + ff.float() * c_gate).type_as(x)`` -> :func:`gated_residual`.

Per-sample (``temb`` [B, 6, D]) and per-token (Wan 2.2 TI2V, [B, S, 6, D]) modulation both.
Image-conditioned cross-attention (Wan 2.1 I2V: ``add_k_proj``) keeps diffusers' processor.
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

MODEL = "WanTransformer3DModel"
BLOCK = "WanTransformerBlock"
ATTENTION = "WanAttention"


def applies(module: torch.nn.Module) -> bool:
    return any(type(m).__name__ in (MODEL, BLOCK) for m in module.modules())


# --------------------------------------------------------------------------- attention


class WanFusedAttnProcessor(FusedAttnProcessor):
    """``WanAttnProcessor`` with the q/k RMSNorm and RoPE fused (self-attention) or the q/k
    RMSNorm on fusebox (text cross-attention). Same call signature."""

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        cos, sin = rotary_emb if rotary_emb is not None else (None, None)
        if (grad_needed(attn, hidden_states, encoder_hidden_states)
                or not fusable(hidden_states, attn.norm_q.weight, attn.norm_k.weight, cos, sin)):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 rotary_emb)
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        if cos is None:
            query = rms_norm_module(attn.norm_q, query)
            key = rms_norm_module(attn.norm_k, key)
        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if cos is not None:
            # the norm spans all heads of a token; the [1, S, 1, D] table is shared by the heads
            query, key = fb.qk_norm_rope(query, key, attn.norm_q.weight, attn.norm_k.weight, cos,
                                         sin, eps=rms_eps(attn.norm_q), across_heads=True,
                                         interleaved=True)

        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config if encoder_hidden_states is None else None)
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


# --------------------------------------------------------------------------- block


def _modulation(table: torch.Tensor, temb: torch.Tensor):
    """The six fp32 modulation terms exactly as Wan forms them: [B, 1, D] views of
    ``table + temb`` per sample, [B, S, D] per token (temb [B, S, 6, D])."""
    if temb.ndim == 4:
        return tuple(t.squeeze(2) for t in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2))
    return (table + temb.float()).chunk(6, dim=1)


def _block_forward(
    block: torch.nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
) -> torch.Tensor:
    if (grad_needed(block, hidden_states, encoder_hidden_states, temb)
            or not fusable(hidden_states, block.scale_shift_table)):
        return original_forward(block)(hidden_states, encoder_hidden_states, temb, rotary_emb)
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = _modulation(
        block.scale_shift_table, temb)

    norm_hidden_states = fb.adaln(hidden_states, scale_msa, shift_msa, norm_type="layer",
                                  eps=block.norm1.eps)
    attn_output = block.attn1(norm_hidden_states, None, None, rotary_emb)
    norm2 = block.norm2
    if isinstance(norm2, torch.nn.LayerNorm) and fusable(hidden_states, norm2.weight, norm2.bias):
        norm_hidden_states, hidden_states = fb.gated_residual_norm(
            hidden_states, attn_output, gate_msa, weight=norm2.weight, bias=norm2.bias,
            norm_type="layer", eps=norm2.eps)
    else:
        # Identity (cross_attn_norm=False), or an affine norm whose weight an offload hook
        # loads only when the module runs
        hidden_states = fb.gated_residual(hidden_states, attn_output, gate_msa)
        norm_hidden_states = norm2(hidden_states.float()).type_as(hidden_states)

    attn_output = block.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    norm_hidden_states, hidden_states = fb.gated_residual_norm(
        hidden_states, attn_output, None, c_scale_msa, c_shift_msa, norm_type="layer",
        eps=block.norm3.eps)

    ff_output = feed_forward(block.ffn, norm_hidden_states)
    return fb.gated_residual(hidden_states, ff_output, c_gate_msa)


def _block_fusable(block: torch.nn.Module) -> str:
    """Why the block cannot be fused ("" when it can)."""
    for name in ("norm1", "norm3"):
        norm = getattr(block, name, None)
        if not isinstance(norm, torch.nn.LayerNorm) or norm.weight is not None:
            return f"{name} is not a LayerNorm without affine"
    if not isinstance(block.norm2, (torch.nn.LayerNorm, torch.nn.Identity)):
        return f"norm2 is {type(block.norm2).__name__}"
    return ""


# --------------------------------------------------------------------------- model


def _model_forward(
    model: torch.nn.Module,
    hidden_states: torch.Tensor,
    timestep: torch.LongTensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_image: torch.Tensor | None = None,
    return_dict: bool = True,
    attention_kwargs: dict | None = None,
):
    args = (hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image)
    kwargs = dict(return_dict=return_dict, attention_kwargs=attention_kwargs)
    if (grad_needed(model, hidden_states, encoder_hidden_states)
            or not fusable(hidden_states, model.scale_shift_table)):
        return original_forward(model)(*args, **kwargs)
    return _fused_model_forward(model, *args, **kwargs)


@apply_lora_scale("attention_kwargs")
def _fused_model_forward(model, hidden_states, timestep, encoder_hidden_states,
                         encoder_hidden_states_image, return_dict=True, attention_kwargs=None):
    """``WanTransformer3DModel.forward`` (diffusers 0.42) with the output norm and its fp32
    modulation in one :func:`adaln` (the blocks are patched on their own)."""
    batch_size, num_channels, num_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = model.config.patch_size
    post_patch_num_frames = num_frames // p_t
    post_patch_height = height // p_h
    post_patch_width = width // p_w

    rotary_emb = model.rope(hidden_states)
    hidden_states = model.patch_embedding(hidden_states)
    hidden_states = hidden_states.flatten(2).transpose(1, 2).contiguous()

    if timestep.ndim == 2:   # per-token timestep (Wan 2.2 TI2V)
        ts_seq_len = timestep.shape[1]
        timestep = timestep.flatten()
    else:
        ts_seq_len = None
    embedded = model.condition_embedder(timestep, encoder_hidden_states,
                                        encoder_hidden_states_image, timestep_seq_len=ts_seq_len)
    temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image = embedded
    if ts_seq_len is not None:
        timestep_proj = timestep_proj.unflatten(2, (6, -1))
    else:
        timestep_proj = timestep_proj.unflatten(1, (6, -1))
    if encoder_hidden_states_image is not None:
        encoder_hidden_states = torch.concat([encoder_hidden_states_image, encoder_hidden_states],
                                             dim=1)

    for block in model.blocks:
        hidden_states = block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)

    table = model.scale_shift_table
    if temb.ndim == 3:
        shift, scale = (table.unsqueeze(0).to(temb.device) + temb.unsqueeze(2)).chunk(2, dim=2)
        shift, scale = shift.squeeze(2), scale.squeeze(2)
    else:
        shift, scale = (table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    shift, scale = shift.to(hidden_states.device), scale.to(hidden_states.device)
    # fp32 norm and modulation, rounded once to the activation dtype, as Wan does
    hidden_states = fb.adaln(hidden_states, scale, shift, norm_type="layer", eps=model.norm_out.eps)
    hidden_states = model.proj_out(hidden_states)

    hidden_states = hidden_states.reshape(batch_size, post_patch_num_frames, post_patch_height,
                                          post_patch_width, p_t, p_h, p_w, -1)
    hidden_states = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6)
    output = hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)
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
    report.family = "wan"
    if type(model).__name__ == MODEL:
        why = _model_fusable(model)
        if why:
            report.skip("norm_out", model.norm_out, why)
        else:
            replace_forward(model, _model_forward, "wan model")
            absorb(model.norm_out, type(model).__name__)
            report.add("norm_out", model.norm_out, "adaln(layer, fp32 modulation) with the output "
                                                   "modulation")
    image_cross_attention = 0
    for path, module in model.named_modules():
        kind = type(module).__name__
        if kind == BLOCK:
            why = _block_fusable(module)
            if why:
                report.skip(path, module, why)
                continue
            replace_forward(module, _block_forward, "wan block")
            for child in ("norm1", "norm2", "norm3"):
                if isinstance(getattr(module, child), torch.nn.LayerNorm):
                    absorb(getattr(module, child), path)
            if gelu_tanh_projection(module.ffn) is not None:
                absorb(module.ffn.net[0], path)
            report.add(path, module, "adaln(layer, fp32 modulation) + gated_residual_norm(layer) "
                                     "x2 + gelu_tanh(bias) + gated_residual")
        elif kind == ATTENTION:
            why = attention_unfusable(module, "WanAttnProcessor")
            if not why and module.add_k_proj is not None:
                image_cross_attention += 1
                why = "image cross-attention (I2V) keeps diffusers' processor"
            if why:
                report.skip(path, module, why)
                continue
            install_processor(module, WanFusedAttnProcessor(original_processor(module)))
            for child in ("norm_q", "norm_k"):
                absorb(getattr(module, child), path)
            rope = "qk_norm_rope(across heads, interleaved)"
            report.add(path, module, f"processor: {rope} (self) / rms_norm q, k (cross)")
    if image_cross_attention:
        report.note("wan: image-conditioned cross-attention (I2V image tokens) runs diffusers' "
                    "processor; its norms are left to the generic module pass")
