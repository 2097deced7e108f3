"""Mochi (``MochiTransformer3DModel``) on fusebox.

- text padding, at the model's input (a forward pre-hook, eager calls only): the text columns
  after every sample's last valid token are dropped (masked in the caption pooling, never a key
  of a valid token in the blocks, and the output is read from the video tokens only); when every
  text token left is valid, the fused attention processors are told so and attend unmasked. A
  forward hook clears that after each call;
- attention (``MochiAttnProcessor2_0``): the video stream's per-head q/k RMSNorm
  (``MochiRMSNorm``) and its rotary in one ``qk_norm_rope`` launch. Mochi's tables are per head,
  ``[S, H, D/2]``, and rotate interleaved pairs (2j, 2j + 1); they become interleaved rows
  ``[S * H, D]`` (each pair's cos and sin written twice), formed once per forward, with q/k read
  as ``[B, S * H, 1, D]`` rows. The text stream's q/k norms (no rotary) run as ``rms_norm``.
  Attention calls ``scaled_dot_product_attention`` as diffusers' Mochi processor does (it has no
  attention dispatch): one batched call when the text is all valid or a prefix of the same
  length in every sample, diffusers' per-sample loop over each sample's valid text otherwise:
  eager, with each sample's valid prefix counted once a forward and sliced (no host read in the
  blocks; a sample without valid text, CFG's empty negative prompt, attends over its video
  tokens in place); with the blocks compiled and the model's input eager (regional compile),
  sliced by the counts of the model's input hook, which the graphs take as unknown sizes (no
  host read, no recompile for new counts); with the whole model compiled, with diffusers'
  ``nonzero`` (a data-dependent size, as in diffusers' own compiled processor); and, in captured
  CUDA graphs (no host read of the mask, no data-dependent size), one masked call whose text
  outputs are placed as the loop places them (valid ones first, then zeros). The masked call
  attends over every padded key and its mask
  rules out SDPA's flash kernel: compiled, it made the patched forward 1.19x slower than
  diffusers' compiled loop (H100: 423.6 against 355.7 ms; 354.5 with the loop);
- blocks: ``MochiRMSNormZero`` / ``MochiLayerNormContinuous`` (RMSNorm then ``(1 + scale)``) as
  one ``adaln`` (RMS, no shift); per stream, the tanh-gated sandwich residual
  ``x + norm2(attn) * tanh(g)`` and the next modulated norm as ``rms_norm`` +
  ``gated_residual_norm``, the feed-forward's ``x + norm4(ff) * tanh(g)`` as ``rms_norm`` +
  ``gated_residual``. Mochi multiplies the normalized branch by the gate in fp32 before rounding
  it; the fused ops round the branch's norm once first (exact in fp32, one more rounding in half
  precision).

Left eager: the modulation linears (GEMMs), the feed-forward SwiGLU (the generic pass fuses its
activation), the output ``AdaLayerNormContinuous`` (generic pass), the patch embedding, the
caption pooling and the rotary tables' own computation (once per forward). The last block's
``norm4_context``, which diffusers builds but never calls, is left to the generic pass.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import MochiAttention, MochiAttnProcessor2_0
from diffusers.models.normalization import MochiRMSNorm, RMSNorm
from diffusers.models.transformers.transformer_mochi import (
    MochiLayerNormContinuous,
    MochiModulatedRMSNorm,
    MochiRMSNormZero,
    MochiTransformer3DModel,
    MochiTransformerBlock,
)

from ... import functional as fb
from .._common import add_undo, derived_once, has_hooks, original_forward, replace_forward
from ._shared import (
    FusedAttnProcessor,
    built_on,
    fusable,
    grad_needed,
    host_readable,
    mark_fused,
    original_processor,
    rows,
    text_suffix_trim,
    trim_text_padding,
    valid_key_counts,
)

FAMILY = "mochi"
Tensor = torch.Tensor


def applies(model: torch.nn.Module) -> bool:
    return built_on(model, MochiTransformer3DModel, MochiTransformerBlock)


# --------------------------------------------------------------------------- attention


def _qk_rms(norm) -> Optional[Tuple[Optional[Tensor], float]]:
    """(weight, eps) of a ``MochiRMSNorm`` (it returns its input's dtype), None for another
    module or one a hook owns (offloaded weights arrive only when its own forward runs)."""
    if type(norm) is not MochiRMSNorm or has_hooks(norm) or len(norm.dim) != 1:
        return None
    return norm.weight, float(norm.eps)


def _rotary_rows(cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    """Mochi's per-head tables ``[S, H, D/2]`` as interleaved rows ``[S * H, D]`` for q/k read
    as ``[B, S * H, 1, D]``. Formed once per forward."""
    def rows_of(t):
        return t.float().repeat_interleave(2, dim=-1).flatten(0, 1)
    return derived_once(cos, ("mochi rows", sin.shape), lambda: (rows_of(cos), rows_of(sin)))


def _rotary_fits(rotary, query: Tensor) -> bool:
    """Are these Mochi's ``(cos, sin)`` tables ``[S, H, D/2]`` for ``query`` ``[B, S, H, D]``?"""
    if rotary is None:
        return True
    cos, sin = rotary
    return (cos.dim() == 3 and cos.shape == sin.shape
            and tuple(cos.shape) == (query.shape[1], query.shape[2], query.shape[3] // 2)
            and query.shape[3] % 2 == 0)


def _compact_text(text_out: Tensor, valid: Tensor) -> Tensor:
    """The text outputs ``[B, L, H, D]`` of a masked joint attention placed as diffusers' loop
    places them: each sample's valid tokens first, in order, then zeros."""
    text_out = torch.where(valid[:, :, None, None], text_out, text_out.new_zeros(()))
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    return torch.gather(text_out, 1, order[:, :, None, None].expand_as(text_out))


class MochiFusedAttnProcessor(FusedAttnProcessor):
    """``MochiAttnProcessor2_0`` with the video q/k norms and rotary in one launch and the text
    q/k norms fused. Calls it cannot fuse run the original processor."""

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask,
                 image_rotary_emb=None):
        def original():
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 image_rotary_emb)
        norms = [_qk_rms(getattr(attn, name, None))
                 for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")]
        if (any(n is None for n in norms) or norms[0][1] != norms[1][1] or attention_mask is None
                or grad_needed(attn, hidden_states, encoder_hidden_states)
                or not fusable(hidden_states, *(n[0] for n in norms),
                               *(image_rotary_emb or ()), like_x=(encoder_hidden_states,))):
            return original()
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))
        if not _rotary_fits(image_rotary_emb, query):
            return original()
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        (weight_q, eps), (weight_k, _) = norms[0], norms[1]
        if image_rotary_emb is None:
            query, key = fb.rms_norm(rows(query), weight_q, eps), fb.rms_norm(rows(key), weight_k,
                                                                              eps)
        else:
            cos, sin = _rotary_rows(*image_rotary_emb)
            shape = query.shape
            query, key = fb.qk_norm_rope(query.flatten(1, 2).unsqueeze(2),
                                         key.flatten(1, 2).unsqueeze(2), weight_q, weight_k,
                                         cos, sin, eps, interleaved=True)
            query, key = query.view(shape), key.view(shape)

        encoder_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        encoder_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        encoder_query = fb.rms_norm(rows(encoder_query), *norms[2])
        encoder_key = fb.rms_norm(rows(encoder_key), *norms[3])

        hidden_states = self.attend(query, key, value, encoder_query, encoder_key,
                                    encoder_value, attention_mask).flatten(2, 3)
        hidden_states, encoder_hidden_states = hidden_states.split_with_sizes(
            (query.shape[1], encoder_query.shape[1]), dim=1)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if hasattr(attn, "to_add_out"):
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states

    def attend(self, query, key, value, encoder_query, encoder_key, encoder_value, mask):
        """Joint attention of the video tokens and each sample's valid text tokens, ``[B, S,
        H, D]`` in and out (video, then the text outputs as diffusers' loop lays them out)."""
        length = encoder_query.shape[1]

        def joint(video, text):
            return torch.cat([video, text], dim=1).transpose(1, 2)

        if self.text_all_valid():
            valid = length
        elif torch.compiler.is_compiling():
            # the counts of the model's input hook (regional compile), else diffusers' compiled
            # path: sizes from the mask
            return self.attend_per_sample(query, key, value, encoder_query, encoder_key,
                                          encoder_value, mask, self.text_counts())
        elif not host_readable(mask, None):
            valid_text = mask.bool()
            keep = torch.cat([valid_text.new_ones(query.shape[:2]), valid_text], dim=1)
            out = F.scaled_dot_product_attention(
                joint(query, encoder_query), joint(key, encoder_key),
                joint(value, encoder_value), attn_mask=keep[:, None, None, :], dropout_p=0.0,
                is_causal=False).transpose(1, 2)
            video_out, text_out = out.split_with_sizes((query.shape[1], length), dim=1)
            return torch.cat([video_out, _compact_text(text_out, valid_text)], dim=1)
        else:
            counts = valid_key_counts(self, mask)
            if counts is None or min(counts) != max(counts) or counts[0] == 0:
                return self.attend_per_sample(query, key, value, encoder_query, encoder_key,
                                              encoder_value, mask, counts)
            valid = counts[0]
        # the same first `valid` text tokens in every sample: one call, zeros for the rest
        out = F.scaled_dot_product_attention(
            joint(query, encoder_query[:, :valid]), joint(key, encoder_key[:, :valid]),
            joint(value, encoder_value[:, :valid]), dropout_p=0.0, is_causal=False)
        return F.pad(out.transpose(1, 2), (0, 0, 0, 0, 0, length - valid))

    @staticmethod
    def attend_per_sample(query, key, value, encoder_query, encoder_key, encoder_value, mask,
                          counts=None):
        """diffusers' loop: per sample, attention over the video and its valid text tokens.
        With ``counts`` (each sample's valid text is its first ``counts[i]`` tokens, read once a
        forward) the text is sliced and each output written into one buffer, with no host read
        in the loop and no copy of the video q/k/v for a sample without text (CFG's empty
        negative prompt). Else, as diffusers, the valid tokens are found by ``nonzero`` (a host
        read per sample; a data-dependent size when compiled)."""
        video, length = query.shape[1], encoder_query.shape[1]
        if counts is not None:
            out = query.new_empty(query.shape[0], video + length, *query.shape[2:])
            # compiled, the counts are sizes the graph does not know (unbacked symbols): no
            # branch on them, their bounds told to the compiler
            symbolic = torch.compiler.is_compiling()
            for idx, valid in enumerate(counts):
                empty = not symbolic and valid == 0
                if symbolic:
                    torch._check_is_size(valid)
                    torch._check(valid <= length)

                def joint(v, text):
                    v = v[idx:idx + 1]
                    if empty:
                        return v.transpose(1, 2)
                    return torch.cat([v, text[idx:idx + 1, :valid]], dim=1).transpose(1, 2)
                row = out[idx]
                row.narrow(0, 0, video + valid).copy_(F.scaled_dot_product_attention(
                    joint(query, encoder_query), joint(key, encoder_key),
                    joint(value, encoder_value), dropout_p=0.0, is_causal=False)[0].transpose(0, 1))
                row.narrow(0, video + valid, length - valid).zero_()
            return out
        outputs = []
        for idx in range(query.shape[0]):
            keep = torch.nonzero(mask[idx].flatten(), as_tuple=False).flatten()
            out = F.scaled_dot_product_attention(
                torch.cat([query[idx:idx + 1], encoder_query[idx:idx + 1, keep]],
                          dim=1).transpose(1, 2),
                torch.cat([key[idx:idx + 1], encoder_key[idx:idx + 1, keep]],
                          dim=1).transpose(1, 2),
                torch.cat([value[idx:idx + 1], encoder_value[idx:idx + 1, keep]],
                          dim=1).transpose(1, 2),
                dropout_p=0.0, is_causal=False)
            outputs.append(F.pad(out, (0, 0, 0, video + length - out.shape[2])))
        return torch.cat(outputs, dim=0).transpose(1, 2)


def _install_processor(attn: torch.nn.Module) -> None:
    """MochiAttention has no ``set_processor``: the attribute is set, and put back by unpatch."""
    original = original_processor(attn)
    attn.processor = MochiFusedAttnProcessor(original)
    add_undo(attn, functools.partial(setattr, attn, "processor", original))


# --------------------------------------------------------------------------- blocks


def _plain_rms_eps(norm) -> Optional[float]:
    """eps of the weightless diffusers RMSNorm inside Mochi's modulated norms."""
    if type(norm) is not RMSNorm or norm.weight is not None or has_hooks(norm):
        return None
    return float(norm.eps)


def _inner_norm(module) -> Optional[RMSNorm]:
    """The RMSNorm a Mochi modulated norm applies (``MochiLayerNormContinuous`` holds it one
    level deeper), None for a module of another class."""
    if type(module) in (MochiRMSNormZero, MochiModulatedRMSNorm):
        return module.norm
    if type(module) is MochiLayerNormContinuous and type(module.norm) is MochiModulatedRMSNorm:
        return module.norm.norm
    return None


def _stream_norms(block, context: bool):
    names = ("norm1", "norm2", "norm3", "norm4")
    if context:
        names = ("norm1_context",) if block.context_pre_only else tuple(
            n + "_context" for n in names)
    return names


def _adaln(x: Tensor, scale: Tensor, eps: float) -> Tensor:
    """``norm(x.float()) * (1 + scale)`` rounded to x's dtype (MochiRMSNormZero's and
    MochiLayerNormContinuous' fp32 modulation)."""
    return fb.adaln(rows(x), scale, None, None, None, "rms", eps, out_dtype=x.dtype)


def _stream_tail(block, x: Tensor, attn_output: Tensor, gate_msa: Tensor, scale_mlp: Tensor,
                 gate_mlp: Tensor, context: bool) -> Tensor:
    """One stream after its attention: ``h = x + norm2(attn) * tanh(g1)``, then
    ``h + norm4(ff(norm3(h) * (1 + s))) * tanh(g2)``. Gates and scale ``[B, 1, D]``."""
    suffix = "_context" if context else ""
    norm2, norm3, norm4 = (getattr(block, f"norm{i}{suffix}") for i in (2, 3, 4))
    ff = block.ff_context if context else block.ff
    gate_msa, gate_mlp = gate_msa.tanh(), gate_mlp.tanh()
    if fusable(x, gate_msa, scale_mlp, like_x=(attn_output,)):
        ff_in, x = fb.gated_residual_norm(
            rows(x), fb.rms_norm(rows(attn_output), None, norm2.norm.eps), gate_msa, scale_mlp,
            None, None, None, "rms", norm3.norm.eps, out_dtype=x.dtype)
    else:
        x = x + norm2(attn_output, gate_msa)
        ff_in = norm3(x, 1 + scale_mlp.to(torch.float32))
    ff_output = ff(ff_in)
    if fusable(x, gate_mlp, like_x=(ff_output,)):
        return fb.gated_residual(rows(x), fb.rms_norm(rows(ff_output), None, norm4.norm.eps),
                                 gate_mlp)
    return x + norm4(ff_output, gate_mlp)


def _block_forward(self, hidden_states, encoder_hidden_states, temb, encoder_attention_mask,
                   image_rotary_emb=None):
    if (grad_needed(self, hidden_states, encoder_hidden_states, temb)
            or not fusable(hidden_states, like_x=(encoder_hidden_states,))):
        return original_forward(self)(hidden_states, encoder_hidden_states, temb,
                                      encoder_attention_mask, image_rotary_emb)
    # [B, 1, D] views each; the model adds 1 to the scales, the fused ops take them as they are
    scale_msa, gate_msa, scale_mlp, gate_mlp = self.norm1.linear(
        self.norm1.silu(temb))[:, None].chunk(4, dim=2)
    if self.context_pre_only:
        norm = self.norm1_context
        context_scale = norm.linear_1(norm.silu(temb).to(encoder_hidden_states.dtype))[:, None]
        context_eps = norm.norm.norm.eps
    else:
        c_scale_msa, c_gate_msa, c_scale_mlp, c_gate_mlp = self.norm1_context.linear(
            self.norm1_context.silu(temb))[:, None].chunk(4, dim=2)
        context_scale, context_eps = c_scale_msa, self.norm1_context.norm.eps
    if not (fusable(hidden_states, scale_msa) and fusable(encoder_hidden_states, context_scale)):
        return original_forward(self)(hidden_states, encoder_hidden_states, temb,
                                      encoder_attention_mask, image_rotary_emb)
    norm_hidden_states = _adaln(hidden_states, scale_msa, self.norm1.norm.eps)
    norm_encoder_hidden_states = _adaln(encoder_hidden_states, context_scale, context_eps)

    attn_hidden_states, context_attn_hidden_states = self.attn1(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        attention_mask=encoder_attention_mask,
    )
    hidden_states = _stream_tail(self, hidden_states, attn_hidden_states, gate_msa, scale_mlp,
                                 gate_mlp, context=False)
    if not self.context_pre_only:
        encoder_hidden_states = _stream_tail(self, encoder_hidden_states,
                                             context_attn_hidden_states, c_gate_msa, c_scale_mlp,
                                             c_gate_mlp, context=True)
    return hidden_states, encoder_hidden_states


def _block_unfusable(block) -> str:
    """Why a Mochi block keeps its forward ("" when the fused one can replace it)."""
    for context in (False, True):
        for name in _stream_norms(block, context):
            inner = _inner_norm(getattr(block, name, None))
            if inner is None or _plain_rms_eps(inner) is None:
                return f"{name} is not one of Mochi's weightless modulated RMSNorms"
    return ""


# --------------------------------------------------------------------------- model


TEXT_INPUTS = ("encoder_hidden_states", "encoder_attention_mask")
_trim_text = text_suffix_trim(*TEXT_INPUTS)


def patch(model: torch.nn.Module, report, **options) -> None:
    report.family = FAMILY
    for path, module in model.named_modules():
        if type(module) is MochiTransformerBlock:
            why = _block_unfusable(module)
            if why:
                report.skip(path, module, why)
                continue
            replace_forward(module, _block_forward, f"{FAMILY} block")
            report.add(path, module, "adaln x2 + per stream rms_norm + gated_residual_norm, "
                                     "rms_norm + gated_residual")
            for context in (False, True):
                for name in _stream_norms(module, context):
                    mark_fused(_inner_norm(getattr(module, name)),
                               "the block's adaln / gated_residual_norm")
        elif type(module) is MochiAttention:
            processor = original_processor(module)
            if type(processor) is not MochiAttnProcessor2_0:
                report.skip(path, module, f"processor {type(processor).__name__} kept")
                continue
            _install_processor(module)
            report.add(path, module, "qk_norm_rope per head (interleaved) on video tokens, "
                                     "rms_norm on text q/k")
            for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
                mark_fused(getattr(module, name), "the attention processor")
    # the trim is exact for the forward read above, not for a subclass's
    if type(model).forward is MochiTransformer3DModel.forward:
        trim_text_padding(model, TEXT_INPUTS, _trim_text, count_mask="encoder_attention_mask")
        report.note(f"{FAMILY}: the text padding is trimmed at the model's input (eager calls)")
