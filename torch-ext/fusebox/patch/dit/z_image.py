"""Z-Image (``ZImageTransformer2DModel``) on fusebox.

- attention (``ZSingleStreamAttnProcessor``): the per-head q/k RMSNorm and the RoPE in one
  ``qk_norm_rope`` launch. The model rotates heads as complex numbers with per-sample
  frequencies ``[B, S, D/2]``; they become interleaved tables ``[B, S, D]``, formed once per
  forward. The mask and ``dispatch_attention_fn`` are called as in diffusers;
- modulated blocks (the main layers and the noise refiner), whose sandwich norms and
  tanh-gated residuals read ``x + g1 * n2(attn(n1(x) * (1 + s1)))`` then
  ``x + g2 * n4(ff(n3(x) * (1 + s2)))``: ``n1`` + scale in one ``adaln`` (RMS, no shift), the
  attention's gated residual + ``n3`` + scale in one ``gated_residual_norm``, the feed-forward's
  gated residual in one ``gated_residual``; ``n2`` and ``n4`` run as fused ``rms_norm``s;
- the feed-forward ``w2(silu(w1(x)) * w3(x))``: ``gated_activation``.

Blocks without modulation (the caption and SigLIP refiners) keep their forward, their norms
fused by the generic pass; so do blocks given per-token modulation (omni mode's noise mask).
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_z_image import (
    FeedForward,
    ZImageTransformer2DModel,
    ZImageTransformerBlock,
    ZSingleStreamAttnProcessor,
)

from ... import functional as fb
from .._common import original_forward, replace_forward
from ._shared import (
    FusedAttnProcessor,
    complex_rotary_tables,
    fusable,
    gated_add,
    gated_add_norm,
    grad_needed,
    mark_fused,
    modulated_norm,
    qk_norm_weights,
    stream_qkv,
    swap_processor,
)

FAMILY = "z-image"


def applies(model: torch.nn.Module) -> bool:
    return isinstance(model, ZImageTransformer2DModel)


# --------------------------------------------------------------------------- attention


class ZImageFusedAttnProcessor(FusedAttnProcessor):
    """``ZSingleStreamAttnProcessor`` with the q/k norms and RoPE in one launch. Calls it cannot
    fuse (gradients, no q/k norm, other frequency formats) run the original processor."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 freqs_cis=None):
        def original():
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 freqs_cis)
        if (encoder_hidden_states is not None or freqs_cis is None or not freqs_cis.is_complex()
                or freqs_cis.dim() != 3 or attn.norm_q is None or attn.norm_k is None
                or grad_needed(attn, hidden_states)):
            return original()
        query, key, value = stream_qkv(attn, hidden_states)
        weights = qk_norm_weights(attn, query)
        cos, sin = complex_rotary_tables(freqs_cis)   # [B, S, head_dim]
        if weights is None or not fusable(query, weights[0], weights[1], cos, sin,
                                          like_x=(key,)):
            return original()
        query, key = fb.qk_norm_rope(query, key, weights[0], weights[1], cos, sin, weights[2],
                                     interleaved=True)
        if attention_mask is not None and attention_mask.ndim == 2:
            attention_mask = attention_mask[:, None, None, :]
        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=self._attention_backend, parallel_config=self._parallel_config)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        output = attn.to_out[0](hidden_states)
        if len(attn.to_out) > 1:
            output = attn.to_out[1](output)  # dropout
        return output


# --------------------------------------------------------------------------- blocks


def _feed_forward(self, x):
    if not fusable(x, like_x=(self.w1.weight,)):
        return original_forward(self)(x)
    return self.w2(fb.gated_activation(self.w1(x), self.w3(x), "silu"))


def _block_forward(self, x, attn_mask, freqs_cis, adaln_input=None, noise_mask=None,
                   adaln_noisy=None, adaln_clean=None):
    if not self.modulation or noise_mask is not None or grad_needed(self, x):
        return original_forward(self)(x, attn_mask, freqs_cis, adaln_input, noise_mask,
                                      adaln_noisy, adaln_clean)
    # [B, 1, D] each; the model adds 1 to the scales, the fused ops take them as they are
    scale_msa, gate_msa, scale_mlp, gate_mlp = (
        self.adaLN_modulation(adaln_input).unsqueeze(1).chunk(4, dim=2))
    gate_msa, gate_mlp = gate_msa.tanh(), gate_mlp.tanh()
    attn_out = self.attention(modulated_norm(self.attention_norm1, x, scale_msa),
                              attention_mask=attn_mask, freqs_cis=freqs_cis)
    ffn_in, x = gated_add_norm(x, self.attention_norm2(attn_out), gate_msa, self.ffn_norm1,
                               scale_mlp)
    return gated_add(x, self.ffn_norm2(self.feed_forward(ffn_in)), gate_mlp)


def patch(model: torch.nn.Module, report, **options) -> None:
    report.family = FAMILY
    for path, module in model.named_modules():
        if type(module) is ZImageTransformerBlock:
            if not module.modulation:
                continue   # the generic pass fuses its norms
            replace_forward(module, _block_forward, f"{FAMILY} block")
            report.add(path, module, "adaln + gated_residual_norm + gated_residual")
            mark_fused(module.attention_norm1, "the block's adaln")
            mark_fused(module.ffn_norm1, "the block's gated_residual_norm")
        elif type(module) is FeedForward:
            replace_forward(module, _feed_forward, f"{FAMILY} feed-forward")
            report.add(path, module, "gated_activation (silu)")
        else:
            swap_processor(path, module, report, {ZSingleStreamAttnProcessor: (
                ZImageFusedAttnProcessor, "qk_norm_rope per head (interleaved)")})
