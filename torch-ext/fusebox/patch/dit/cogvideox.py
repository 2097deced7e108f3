"""CogVideoX (diffusers ``CogVideoXTransformer3DModel``, 1.0 and 1.5) and ConsisID
(``ConsisIDTransformer3DModel``, CogVideoX's blocks and attention) on fusebox.

A block holds the text and the video tokens as two streams, each with its own modulation from one
``CogVideoXLayerNormZero`` (a LayerNorm shared by the streams; shift, scale and gate per stream);
attention and the feed-forward run over the two concatenated, text first. Per ``CogVideoXBlock``
/ ``ConsisIDBlock``, per stream:

- ``norm1(x) * (1 + scale) + shift`` -> :func:`adaln` (layer);
- ``x + gate_msa * attn`` then ``norm2(x) * (1 + scale) + shift`` -> :func:`gated_residual_norm`;
- ``x + gate_ff * ff`` (the stream's rows of the joint feed-forward output, read in place) ->
  :func:`gated_residual`.

Attention (``CogVideoXAttnProcessor2_0``, and ``FusedCogVideoXAttnProcessor2_0`` after
``fuse_qkv_projections``): the q/k norms are LayerNorms per head, which the fused q/k norm +
RoPE kernel (an RMSNorm) cannot apply. Each runs as one :func:`layer_norm` on the
``[B, N, H, D]`` projection, read in place (diffusers normalizes a transposed copy); the
interleaved RoPE of the video tokens then runs as one :func:`rope` launch for q and k over all
tokens, the text tokens (first, not rotated by diffusers) riding along with identity rows
(cos = 1, sin = 0) put ahead of the tables, formed once per forward: diffusers rotates a slice
through fp32 temporaries and writes it back into q and k. Attention goes through diffusers'
dispatch with the processor's backend (cuDNN's attention took the same time with q/k
``[B, N, H, D]``- or ``[B, H, N, D]``-contiguous: 18.2 ms at CogVideoX-5B's shape on an H100). A
mask, cross-attention or tables that are not ``[S, D]`` keep diffusers' processor.

The feed-forward GELU-tanh and ``norm_final`` (a LayerNorm) are fused by the generic module pass;
``norm_out`` (``AdaLayerNorm``, shift and scale chunked per sample) -> :func:`adaln`.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import (
    CogVideoXAttnProcessor2_0,
    FusedCogVideoXAttnProcessor2_0,
)
from diffusers.models.normalization import AdaLayerNorm, CogVideoXLayerNormZero
from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXBlock

from ... import functional as fb
from .._common import derived_once, original_forward, replace_forward
from ._shared import (
    FusedAttnProcessor,
    attend,
    custom_processor,
    fusable,
    gated_add,
    gated_add_norm,
    grad_needed,
    install_processor,
    mark_fused,
    modulated_norm,
    norm_kind,
    norm_params,
    norm_rope,
    original_processor,
    patch_block,
)

try:
    from diffusers.models.transformers.consisid_transformer_3d import ConsisIDBlock
except ImportError:     # a diffusers without ConsisID
    ConsisIDBlock = None

BLOCKS = {CogVideoXBlock: "cogvideox", ConsisIDBlock: "consisid"}
BLOCKS.pop(None, None)
FAMILIES = {"ConsisIDTransformer3DModel": "consisid"}
PROCESSORS = (CogVideoXAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0)


def applies(model: torch.nn.Module) -> bool:
    """CogVideoX and ConsisID, and any model built on their blocks."""
    return any(type(m) in BLOCKS for m in model.modules())


# --------------------------------------------------------------------------- attention


def _text_identity_rows(rotary, text: int):
    """The video tokens' ``(cos, sin)`` ``[S, D]`` tables with ``text`` rows ahead that leave
    their tokens as they are, formed once per forward."""
    cos, sin = rotary

    def make():
        return (torch.cat([cos.new_ones(text, cos.shape[1]), cos]),
                torch.cat([sin.new_zeros(text, sin.shape[1]), sin]))
    return derived_once(cos, ("cogvideox text rows", text, sin.shape), make)


def _tables_fit(rotary, video: int, head_dim: int) -> bool:
    """Are these the ``[S, D]`` tables of the video tokens diffusers' ``apply_rotary_emb``
    takes (None: no RoPE)?"""
    if rotary is None:
        return True
    cos, sin = rotary
    return (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)
            and cos.dim() == 2 and cos.shape == sin.shape == (video, head_dim))


def _layer_norms(attn, query, key):
    """q and k ``[B, N, H, D]`` through ``norm_q`` / ``norm_k`` as per-head LayerNorms on
    fusebox, or None where the norms are not both LayerNorms fusebox can apply here."""
    if attn.norm_q is None or attn.norm_k is None:
        return None
    pq, pk = norm_params(attn.norm_q, query), norm_params(attn.norm_k, key)
    if (pq is None or pk is None or pq.kind != "layer" or pk.kind != "layer"
            or not fusable(query, pq.weight, pq.bias, pk.weight, pk.bias, like_x=(key,))):
        return None
    return (fb.layer_norm(query, pq.weight, pq.bias, pq.eps),
            fb.layer_norm(key, pk.weight, pk.bias, pk.eps))


class CogVideoXFusedAttnProcessor(FusedAttnProcessor):
    """``CogVideoXAttnProcessor2_0`` (or its fused-QKV form) with the q/k LayerNorms on fusebox
    and the video tokens' RoPE as one launch for q and k. Same call signature (``Attention``
    filters keyword arguments by it)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None,
                 image_rotary_emb=None):
        text = encoder_hidden_states.size(1)
        heads = attn.heads
        if (attention_mask is not None or attn.is_cross_attention
                or grad_needed(attn, hidden_states, encoder_hidden_states)
                or not fusable(hidden_states, like_x=(encoder_hidden_states,))
                or not _tables_fit(image_rotary_emb, hidden_states.size(1),
                                   attn.inner_dim // heads)):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 image_rotary_emb)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        if type(self.original) is FusedCogVideoXAttnProcessor2_0:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = (attn.to_q(hidden_states), attn.to_k(hidden_states),
                                 attn.to_v(hidden_states))
        query, key, value = (t.unflatten(2, (heads, -1)) for t in (query, key, value))

        rotary = None
        if image_rotary_emb is not None:
            rotary = _text_identity_rows(image_rotary_emb, text)
        normed = _layer_norms(attn, query, key)
        if normed is None:      # other norms, none, or hooked ones (offloaded weights): the modules
            normed = (query if attn.norm_q is None else attn.norm_q(query),
                      key if attn.norm_k is None else attn.norm_k(key))
        query, key = norm_rope(*normed, None, None, rotary)

        out = attend(self, query, key, value, None, None)
        out = attn.to_out[0](out.flatten(2, 3).to(query.dtype))
        out = attn.to_out[1](out)
        encoder_hidden_states, hidden_states = out.split([text, out.size(1) - text], dim=1)
        return hidden_states, encoder_hidden_states


def _patch_attention(path: str, attn: torch.nn.Module, report) -> None:
    processor = original_processor(attn)
    if type(processor) not in PROCESSORS:
        report.skip(path, attn, custom_processor(attn, "CogVideoXAttnProcessor2_0"))
        return
    install_processor(attn, CogVideoXFusedAttnProcessor)
    for name in ("norm_q", "norm_k"):
        norm = getattr(attn, name, None)
        if norm is not None and norm_kind(norm) == "layer":
            mark_fused(norm, "the attention processor")
    report.add(path, attn, "processor: layer_norm(q), layer_norm(k), rope(q, k) (interleaved; "
                           "video tokens, text as identity rows)")


# --------------------------------------------------------------------------- block


def _terms(norm: torch.nn.Module, temb: torch.Tensor):
    """``CogVideoXLayerNormZero``'s six terms (shift, scale, gate, then the text stream's) as
    ``[B, 1, D]`` views of its projection."""
    return norm.linear(norm.silu(temb)).unsqueeze(1).chunk(6, dim=2)


def _block_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                   *args, **kwargs):
    """``CogVideoXBlock.forward`` (``attention_kwargs`` after the tables) and
    ``ConsisIDBlock.forward`` (none)."""
    if (grad_needed(self, hidden_states, encoder_hidden_states, temb)
            or not fusable(hidden_states, like_x=(encoder_hidden_states,))):
        return original_forward(self)(hidden_states, encoder_hidden_states, temb,
                                      image_rotary_emb, *args, **kwargs)
    attention_kwargs = (args[0] if args else kwargs.get("attention_kwargs")) or {}
    text = encoder_hidden_states.size(1)

    shift, scale, gate, enc_shift, enc_scale, enc_gate = _terms(self.norm1, temb)
    norm_hidden_states = modulated_norm(self.norm1.norm, hidden_states, scale, shift)
    norm_encoder_hidden_states = modulated_norm(self.norm1.norm, encoder_hidden_states,
                                                enc_scale, enc_shift)
    attn_hidden_states, attn_encoder_hidden_states = self.attn1(
        hidden_states=norm_hidden_states, encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb, **attention_kwargs)

    shift, scale, gate_ff, enc_shift, enc_scale, enc_gate_ff = _terms(self.norm2, temb)
    norm_hidden_states, hidden_states = gated_add_norm(
        hidden_states, attn_hidden_states, gate, self.norm2.norm, scale, shift)
    norm_encoder_hidden_states, encoder_hidden_states = gated_add_norm(
        encoder_hidden_states, attn_encoder_hidden_states, enc_gate, self.norm2.norm, enc_scale,
        enc_shift)

    ff_output = self.ff(torch.cat([norm_encoder_hidden_states, norm_hidden_states], dim=1))
    hidden_states = gated_add(hidden_states, ff_output[:, text:], gate_ff)
    encoder_hidden_states = gated_add(encoder_hidden_states, ff_output[:, :text], enc_gate_ff)
    return hidden_states, encoder_hidden_states


def _block_unfusable(block: torch.nn.Module) -> str:
    """Why the block cannot be fused ("" when it can)."""
    for name in ("norm1", "norm2"):
        norm = getattr(block, name, None)
        if type(norm) is not CogVideoXLayerNormZero:
            return f"{name} is {type(norm).__name__}, not CogVideoXLayerNormZero"
        if norm_kind(norm.norm) != "layer":
            return f"{name}.norm ({type(norm.norm).__name__}) has no fused form"
    return ""


# --------------------------------------------------------------------------- output norm


def _ada_layer_norm_forward(self, x, timestep=None, temb=None):
    """``AdaLayerNorm`` with per-sample shift and scale (``chunk_dim=1``, CogVideoX's
    ``norm_out``): the projection stays, ``norm(x) * (1 + scale) + shift`` is one pass."""
    if self.emb is not None:
        temb = self.emb(timestep)
    shift, scale = self.linear(self.silu(temb)).unsqueeze(1).chunk(2, dim=2)
    return modulated_norm(self.norm, x, scale, shift)


# --------------------------------------------------------------------------- patch


def patch(model: torch.nn.Module, report, **options) -> None:
    report.family = FAMILIES.get(type(model).__name__, "cogvideox")
    for path, module in model.named_modules():
        cls = type(module)
        if cls in BLOCKS:
            why = _block_unfusable(module)
            patch_block(path, module, report, why, _block_forward, f"{BLOCKS[cls]} block", (),
                        "adaln(layer) + gated_residual_norm(layer) + gated_residual, "
                        "both streams")
            if not why:
                for name in ("norm1", "norm2"):
                    mark_fused(getattr(module, name).norm, "the block's adaln / "
                                                          "gated_residual_norm")
            _patch_attention(f"{path}.attn1", module.attn1, report)
        elif (cls is AdaLayerNorm and module.chunk_dim == 1
              and norm_kind(module.norm) == "layer"):
            replace_forward(module, _ada_layer_norm_forward, "adaln")
            report.add(path, module, "adaln (layer)")
            mark_fused(module.norm, "the parent AdaLayerNorm's adaln")
