"""HunyuanVideo (``HunyuanVideoTransformer3DModel``) on fusebox, and the models built on its
blocks and attention (FramePack's ``HunyuanVideoFramepackTransformer3DModel``).

- text padding, at ``HunyuanVideoTransformer3DModel``'s input (a forward pre-hook, eager calls
  only): the text columns after every sample's last valid token are dropped (the model takes a
  sample's first ``mask.sum()`` text tokens as its valid ones, and padded tokens never reach a
  valid one: masked as keys in the refiner and the blocks, the refiner's pooling a masked mean,
  the output read from the video tokens only); when every text token left is valid, the fused
  attention processors are told so and attend unmasked, compiled blocks too. A forward hook
  clears that after each call. FramePack's forward, which adds image tokens, keeps its inputs;
- attention (``HunyuanVideoAttnProcessor2_0``): the per-head q/k RMSNorm and the interleaved
  RoPE of the video tokens run as one ``qk_norm_rope`` launch; the text tokens of the
  single-stream blocks, which diffusers normalizes but does not rotate, ride along in the same
  launch with identity rows (cos = 1, sin = 0) appended to the tables; the text q/k of the
  double-stream blocks (their own norms, no RoPE) get ``rms_norm``. Concatenation is
  video-then-text and ``dispatch_attention_fn`` gets the processor's backend and parallel
  config, as in diffusers; attention runs unmasked over all keys when every text token is valid,
  or over the prefix the model's key mask lets through when that is the same in every sample
  (video, then the valid text);
- double-stream blocks: per stream, gated attention residual + ``norm2`` + modulation in one
  ``gated_residual_norm``, the feed-forward residual in one ``gated_residual``;
- single-stream blocks: ``proj_mlp`` bias + GELU-tanh in one pass, one ``gated_residual``.

The token refiner (negligible cost) and the image-to-video token-replace blocks keep their
forwards; their generic modules (norms, AdaLayerNorms, GELU) are still fused by the generic
pass.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_hunyuan_video import (
    HunyuanVideoAttnProcessor2_0,
    HunyuanVideoSingleTransformerBlock,
    HunyuanVideoTransformer3DModel,
    HunyuanVideoTransformerBlock,
)

from ._shared import (
    FusedAttnProcessor,
    attend,
    built_on,
    fusable,
    grad_needed,
    install_processor,
    linear_act,
    linear_rows,
    mark_fused,
    norm_rope,
    original_processor,
    patch_two_stream_model,
    single_stream_out,
    stream_tail,
    text_suffix_trim,
    trim_text_padding,
    valid_key_prefix,
)

FAMILY = "hunyuan-video"


def applies(model: torch.nn.Module) -> bool:
    """HunyuanVideo, and the models built on its blocks (FramePack)."""
    return built_on(model, HunyuanVideoTransformer3DModel, HunyuanVideoTransformerBlock)


def _with_identity_rows(rotary, n: int):
    """RoPE tables extended by ``n`` rows that leave their tokens as they are."""
    cos, sin = rotary
    cos = torch.cat([cos, cos.new_ones(n, cos.shape[1])])
    sin = torch.cat([sin, sin.new_zeros(n, sin.shape[1])])
    return cos, sin


class HunyuanVideoFusedAttnProcessor(FusedAttnProcessor):
    """``HunyuanVideoAttnProcessor2_0`` with the q/k norms and RoPE in one launch."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        if (grad_needed(attn, hidden_states, encoder_hidden_states) or not fusable(hidden_states)
                or (image_rotary_emb is not None and image_rotary_emb[0].dim() != 2)):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 image_rotary_emb)
        if attn.add_q_proj is None and encoder_hidden_states is not None:
            # single-stream: video and text tokens share the projections; only video rotates
            if image_rotary_emb is not None:
                image_rotary_emb = _with_identity_rows(image_rotary_emb,
                                                       encoder_hidden_states.shape[1])
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        query, key = norm_rope(query, key, attn.norm_q, attn.norm_k, image_rotary_emb)

        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            encoder_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            encoder_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            encoder_query, encoder_key = norm_rope(encoder_query, encoder_key,
                                                   attn.norm_added_q, attn.norm_added_k, None)
            query = torch.cat([query, encoder_query], dim=1)
            key = torch.cat([key, encoder_key], dim=1)
            value = torch.cat([value, encoder_value], dim=1)

        # the model's mask lets through the video tokens and each sample's valid text, a prefix
        valid_keys = None
        if self.text_all_valid():
            valid_keys = key.shape[1]
        elif attention_mask is not None and attention_mask.shape[-1] == key.shape[1]:
            valid_keys = valid_key_prefix(self, attention_mask)
        hidden_states = attend(self, query, key, value, valid_keys, attention_mask)
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (
                hidden_states[:, : -encoder_hidden_states.shape[1]],
                hidden_states[:, -encoder_hidden_states.shape[1]:],
            )
            if getattr(attn, "to_out", None) is not None:
                hidden_states = attn.to_out[1](linear_rows(attn.to_out[0], hidden_states))
            if getattr(attn, "to_add_out", None) is not None:
                encoder_hidden_states = linear_rows(attn.to_add_out, encoder_hidden_states)
        return hidden_states, encoder_hidden_states


def double_block_forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None,
                         freqs_cis=None, *args, **kwargs):
    """The dual-stream block (HunyuanVideo 1.5's too): norm1 (AdaLayerNormZero, the generic
    pass's), the joint attention, then each stream's tail."""
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(
        hidden_states, emb=temb)
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = (
        self.norm1_context(encoder_hidden_states, emb=temb))

    attn_output, context_attn_output = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        attention_mask=attention_mask,
        image_rotary_emb=freqs_cis,
    )

    hidden_states = stream_tail(hidden_states, attn_output, gate_msa, self.norm2, scale_mlp,
                                shift_mlp, self.ff, gate_mlp)
    encoder_hidden_states = stream_tail(encoder_hidden_states, context_attn_output, c_gate_msa,
                                        self.norm2_context, c_scale_mlp, c_shift_mlp,
                                        self.ff_context, c_gate_mlp)
    return hidden_states, encoder_hidden_states


def single_block_forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None,
                         image_rotary_emb=None, *args, **kwargs):
    text_seq_length = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
    residual = hidden_states

    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    mlp_hidden_states = linear_act(self.proj_mlp, self.act_mlp, norm_hidden_states)

    attn_output, context_attn_output = self.attn(
        hidden_states=norm_hidden_states[:, :-text_seq_length, :],
        encoder_hidden_states=norm_hidden_states[:, -text_seq_length:, :],
        attention_mask=attention_mask,
        image_rotary_emb=image_rotary_emb,
    )
    attn_output = torch.cat([attn_output, context_attn_output], dim=1)

    hidden_states = single_stream_out(self, residual, attn_output, mlp_hidden_states, gate)
    return hidden_states[:, :-text_seq_length, :], hidden_states[:, -text_seq_length:, :]


def patch_attention(path, module, report,
                    processor_class: type = HunyuanVideoAttnProcessor2_0) -> None:
    """Installs the fused processor on attention whose processor is a ``processor_class`` (one
    whose ``__call__`` reads as ``HunyuanVideoAttnProcessor2_0``'s)."""
    if type(original_processor(module)) is not processor_class:
        return
    install_processor(module, HunyuanVideoFusedAttnProcessor)
    report.add(path, module, "qk_norm_rope per head (interleaved) on video tokens")
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        norm = getattr(module, name, None)
        if norm is not None:
            mark_fused(norm, "the attention processor")


TEXT_INPUTS = ("encoder_hidden_states", "encoder_attention_mask")
# the padding after every sample's last valid token (the blocks count valid tokens); the refiner
# needs a token (it always lets its first one through)
_trim_text = text_suffix_trim(*TEXT_INPUTS)


def patch(model: torch.nn.Module, report, **options) -> None:
    family = {"HunyuanVideoFramepackTransformer3DModel": "hunyuan-video-framepack"}.get(
        type(model).__name__, FAMILY)
    patch_two_stream_model(model, report, family,
                           (HunyuanVideoTransformerBlock, double_block_forward),
                           (HunyuanVideoSingleTransformerBlock, single_block_forward),
                           patch_attention)
    # the trim is exact for the forward read above, not for FramePack's or a subclass's
    if type(model).forward is HunyuanVideoTransformer3DModel.forward:
        trim_text_padding(model, TEXT_INPUTS, _trim_text)
        report.note(f"{family}: the text padding is trimmed at the model's input (eager calls)")
