"""LTX-2 (diffusers ``LTX2VideoTransformer3DModel``: a video and an audio stream) on fusebox.

Attention (``LTX2AudioVideoAttnProcessor``; ``LTX2PerturbedAttnProcessor`` outside the
spatio-temporal guidance blocks, where it computes the same): ``norm_q``/``norm_k`` (RMSNorm
over all heads) and the RoPE of q and k ->

- interleaved RoPE (a frequency per channel of the flat q/k): :func:`qk_norm_rope`, one launch
  for q and k where they share tables (self-attention), one each where k has its own
  (audio-to-video and video-to-audio attention: k from the other stream, its own length);
- split RoPE (LTX-2.0's checkpoints: each head's pairs ``(j, j + D/2)``, per-head tables):
  :func:`rms_norm` of q and of k, then one :func:`rope` launch over the heads as rows (the
  kernel reads one table per row, and the norm spans all heads of a token, so the two cannot
  share a launch); the tables, ``[B, H, S, D/2]``, are written once per forward as
  ``[B, S * H, D]`` rows (under ``torch.compile`` the rotation is torch operations that read
  the tables in place instead: a compiled block would write the rows again);
- text cross-attention (no RoPE): :func:`rms_norm` of q and of k;

then diffusers' attention dispatch; LTX-2.3's per-head output gates run eagerly.

Per ``LTX2VideoTransformerBlock``, for the video and the audio stream alike, each residual
update is added in the pass of the norm that follows it:

- ``norm1(x) * (1 + scale_msa) + shift_msa`` -> :func:`adaln`;
- ``x + attn1 * gate_msa`` then ``norm2(x)`` (times LTX-2.3's text-query modulation where the
  model has it) -> :func:`gated_residual_norm`;
- ``x + attn2`` (gated in LTX-2.3) then the cross-modal norm with the audio-to-video
  modulation -> :func:`gated_residual_norm`, and the same norm with the video-to-audio
  modulation -> :func:`adaln` (diffusers writes the norm once and modulates it twice);
- ``x + gate * a2v`` / ``x + gate * v2a`` then ``norm3(x) * (1 + scale_mlp) + shift_mlp`` ->
  :func:`gated_residual_norm`;
- ``x + ff * gate_mlp`` -> :func:`gated_residual`.

The modulation terms (``scale_shift_table + temb`` and the cross-modal tables, per sample or
per token) are strided views of one sum each, read in place. LTX-2.3's modulation of the text
(``encoder_hidden_states * (1 + scale) + shift``: no norm to fuse it into) runs eagerly. The
feed-forward GELU-tanh and the final ``norm_out`` / ``audio_norm_out`` (LayerNorms ->
:func:`layer_norm`) are fused by the generic module pass; the output modulation runs eagerly.
"""

from __future__ import annotations

import torch

from .._common import original_forward
from ._shared import (
    contains_class,
    fusable,
    gated_add,
    gated_add_norm,
    grad_needed,
    modulated_norm,
    norm_kind,
    original_processor,
    patch_block,
    patch_qk_norm_attention,
    rows,
)
from .ltx import LTXFusedAttnProcessor, modulation_terms

MODEL = "LTX2VideoTransformer3DModel"
BLOCK = "LTX2VideoTransformerBlock"
ATTENTION = "LTX2Attention"
PROCESSOR = "LTX2AudioVideoAttnProcessor"
PERTURBED_PROCESSOR = "LTX2PerturbedAttnProcessor"
ROPE_TYPES = {"interleaved": "flat", "split": "split"}
# the block's norms, all RMSNorm: each stream's self-attention, text cross-attention,
# cross-modal attention and feed-forward norm
NORMS = ("norm1", "audio_norm1", "norm2", "audio_norm2", "audio_to_video_norm",
         "video_to_audio_norm", "norm3", "audio_norm3")


def applies(module: torch.nn.Module) -> bool:
    return contains_class(module, MODEL, BLOCK)


# --------------------------------------------------------------------------- attention


class LTX2FusedAttnProcessor(LTXFusedAttnProcessor):
    """``LTX2AudioVideoAttnProcessor`` with the q/k RMSNorm and the RoPE fused; k may have its
    own tables. Same call signature (LTX2Attention filters keyword arguments by it); LTX-Video's
    projections."""

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return self.run(attn, hidden_states, encoder_hidden_states, attention_mask,
                        query_rotary_emb, key_rotary_emb)

    def rope_layout_of(self, attn) -> str:
        return ROPE_TYPES[attn.rope_type]

    def call_original(self, attn, hidden_states, encoder_hidden_states, attention_mask, rotary,
                      key_rotary):
        return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary,
                             key_rotary)

    def heads_output(self, attn, hidden_states, attn_output):
        if attn.to_gate_logits is None:
            return attn_output
        # LTX-2.3: a gate per head from the attention's input, 2 * sigmoid(logits)
        gates = 2.0 * torch.sigmoid(attn.to_gate_logits(hidden_states))
        return (attn_output.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)


class LTX2FusedPerturbedAttnProcessor(LTX2FusedAttnProcessor):
    """``LTX2PerturbedAttnProcessor``: fused as :class:`LTX2FusedAttnProcessor` when nothing is
    perturbed (every block outside spatio-temporal guidance); a perturbed call (values instead
    of attention for some samples) runs the original."""

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        perturbation_mask: torch.Tensor | None = None,
        all_perturbed: bool | None = None,
    ) -> torch.Tensor:
        if perturbation_mask is not None or (all_perturbed is not None
                                             and all_perturbed is not False):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 query_rotary_emb, key_rotary_emb, perturbation_mask,
                                 all_perturbed)
        return self.run(attn, hidden_states, encoder_hidden_states, attention_mask,
                        query_rotary_emb, key_rotary_emb)


FUSED_PROCESSORS = {PROCESSOR: LTX2FusedAttnProcessor,
                    PERTURBED_PROCESSOR: LTX2FusedPerturbedAttnProcessor}


# --------------------------------------------------------------------------- block


class _Stream:
    """One stream's residual, with its last gated branch not yet added: the next norm adds it
    in its own pass (:func:`gated_add_norm`), the end of the block in a :func:`gated_add`."""

    __slots__ = ("x", "branch", "gate")

    def __init__(self, x: torch.Tensor):
        self.x, self.branch, self.gate = rows(x), None, None

    def add(self, branch: torch.Tensor, gate: torch.Tensor | None = None) -> None:
        self.value()
        self.branch, self.gate = branch, gate

    def norm(self, norm: torch.nn.Module, scale=None, shift=None) -> torch.Tensor:
        """``norm(x) * (1 + scale) + shift`` (``norm(x)`` without scale) of the updated x."""
        if self.branch is None:
            return modulated_norm(norm, self.x, scale, shift)
        normed, self.x = gated_add_norm(self.x, self.branch, self.gate, norm, scale, shift)
        self.branch = self.gate = None
        return normed

    def value(self) -> torch.Tensor:
        if self.branch is not None:
            self.x = gated_add(self.x, self.branch, self.gate)
            self.branch = self.gate = None
        return self.x


def _prompt_modulation(block, table, temb_prompt, like, batch_size):
    """LTX-2.3's (shift, scale) of the text keys/values, as the block forms them."""
    if temb_prompt is not None:
        return block.get_mod_params(table, temb_prompt, batch_size)
    return table[None, None].to(device=like.device, dtype=like.dtype).unbind(dim=2)


def _block_forward(
    block: torch.nn.Module,
    hidden_states: torch.Tensor,
    audio_hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    audio_encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    temb_audio: torch.Tensor,
    temb_ca_scale_shift: torch.Tensor,
    temb_ca_audio_scale_shift: torch.Tensor,
    temb_ca_gate: torch.Tensor,
    temb_ca_audio_gate: torch.Tensor,
    temb_prompt: torch.Tensor | None = None,
    temb_prompt_audio: torch.Tensor | None = None,
    video_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    audio_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ca_video_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ca_audio_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    audio_encoder_attention_mask: torch.Tensor | None = None,
    self_attention_mask: torch.Tensor | None = None,
    audio_self_attention_mask: torch.Tensor | None = None,
    a2v_cross_attention_mask: torch.Tensor | None = None,
    v2a_cross_attention_mask: torch.Tensor | None = None,
    use_a2v_cross_attention: bool = True,
    use_v2a_cross_attention: bool = True,
    perturbation_mask: torch.Tensor | None = None,
    all_perturbed: bool | None = None,
):
    if (grad_needed(block, hidden_states, audio_hidden_states, encoder_hidden_states,
                    audio_encoder_hidden_states, temb, temb_audio, temb_ca_scale_shift,
                    temb_ca_audio_scale_shift, temb_ca_gate, temb_ca_audio_gate, temb_prompt,
                    temb_prompt_audio)
            or not fusable(hidden_states) or not fusable(audio_hidden_states)):
        return original_forward(block)(
            hidden_states, audio_hidden_states, encoder_hidden_states,
            audio_encoder_hidden_states, temb, temb_audio, temb_ca_scale_shift,
            temb_ca_audio_scale_shift, temb_ca_gate, temb_ca_audio_gate, temb_prompt,
            temb_prompt_audio, video_rotary_emb, audio_rotary_emb, ca_video_rotary_emb,
            ca_audio_rotary_emb, encoder_attention_mask, audio_encoder_attention_mask,
            self_attention_mask, audio_self_attention_mask, a2v_cross_attention_mask,
            v2a_cross_attention_mask, use_a2v_cross_attention, use_v2a_cross_attention,
            perturbation_mask, all_perturbed)
    batch_size = hidden_states.size(0)
    video, audio = _Stream(hidden_states), _Stream(audio_hidden_states)
    perturbed = (dict(perturbation_mask=perturbation_mask, all_perturbed=all_perturbed)
                 if block.perturbed_attn else {})

    # 1. self-attention
    v_terms = modulation_terms(block.scale_shift_table, temb, batch_size)
    a_terms = modulation_terms(block.audio_scale_shift_table, temb_audio, batch_size)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = v_terms[:6]
    a_shift_msa, a_scale_msa, a_gate_msa, a_shift_mlp, a_scale_mlp, a_gate_mlp = a_terms[:6]
    # LTX-2.3's text-query modulation (shift, scale, gate), else no modulation and no gate
    text_q = v_terms[6:9] if block.video_cross_attn_adaln else (None, None, None)
    a_text_q = a_terms[6:9] if block.audio_cross_attn_adaln else (None, None, None)

    normed = video.norm(block.norm1, scale_msa, shift_msa)
    video.add(block.attn1(hidden_states=normed, encoder_hidden_states=None,
                          query_rotary_emb=video_rotary_emb, attention_mask=self_attention_mask,
                          **perturbed), gate_msa)
    normed = audio.norm(block.audio_norm1, a_scale_msa, a_shift_msa)
    audio.add(block.audio_attn1(hidden_states=normed, encoder_hidden_states=None,
                                query_rotary_emb=audio_rotary_emb,
                                attention_mask=audio_self_attention_mask, **perturbed),
              a_gate_msa)

    # 2. text cross-attention
    if block.cross_attn_adaln:
        shift_kv, scale_kv = _prompt_modulation(block, block.prompt_scale_shift_table,
                                                temb_prompt, video.x, batch_size)
        a_shift_kv, a_scale_kv = _prompt_modulation(block, block.audio_prompt_scale_shift_table,
                                                    temb_prompt_audio, audio.x, batch_size)
        encoder_hidden_states = encoder_hidden_states * (1 + scale_kv) + shift_kv
        audio_encoder_hidden_states = audio_encoder_hidden_states * (1 + a_scale_kv) + a_shift_kv
    normed = video.norm(block.norm2, text_q[1], text_q[0])
    video.add(block.attn2(normed, encoder_hidden_states=encoder_hidden_states,
                          query_rotary_emb=None, attention_mask=encoder_attention_mask),
              text_q[2])
    normed = audio.norm(block.audio_norm2, a_text_q[1], a_text_q[0])
    audio.add(block.audio_attn2(normed, encoder_hidden_states=audio_encoder_hidden_states,
                                query_rotary_emb=None,
                                attention_mask=audio_encoder_attention_mask), a_text_q[2])

    # 3. audio-to-video (q: video; k, v: audio) and video-to-audio cross-attention; both take
    # the streams as they are before either adds its output
    if use_a2v_cross_attention or use_v2a_cross_attention:
        v_a2v_scale, v_a2v_shift, v_v2a_scale, v_v2a_shift = modulation_terms(
            block.video_a2v_cross_attn_scale_shift_table[:4, :], temb_ca_scale_shift, batch_size)
        a2v_gate, = modulation_terms(block.video_a2v_cross_attn_scale_shift_table[4:, :],
                                     temb_ca_gate, batch_size)
        a_a2v_scale, a_a2v_shift, a_v2a_scale, a_v2a_shift = modulation_terms(
            block.audio_a2v_cross_attn_scale_shift_table[:4, :], temb_ca_audio_scale_shift,
            batch_size)
        v2a_gate, = modulation_terms(block.audio_a2v_cross_attn_scale_shift_table[4:, :],
                                     temb_ca_audio_gate, batch_size)
        if use_a2v_cross_attention:
            video_q = video.norm(block.audio_to_video_norm, v_a2v_scale, v_a2v_shift)
            audio_kv = audio.norm(block.video_to_audio_norm, a_a2v_scale, a_a2v_shift)
        if use_v2a_cross_attention:
            video_kv = video.norm(block.audio_to_video_norm, v_v2a_scale, v_v2a_shift)
            audio_q = audio.norm(block.video_to_audio_norm, a_v2a_scale, a_v2a_shift)
        if use_a2v_cross_attention:
            video.add(block.audio_to_video_attn(
                video_q, encoder_hidden_states=audio_kv, query_rotary_emb=ca_video_rotary_emb,
                key_rotary_emb=ca_audio_rotary_emb, attention_mask=a2v_cross_attention_mask),
                a2v_gate)
        if use_v2a_cross_attention:
            audio.add(block.video_to_audio_attn(
                audio_q, encoder_hidden_states=video_kv, query_rotary_emb=ca_audio_rotary_emb,
                key_rotary_emb=ca_video_rotary_emb, attention_mask=v2a_cross_attention_mask),
                v2a_gate)

    # 4. feed-forward
    normed = video.norm(block.norm3, scale_mlp, shift_mlp)
    video.add(block.ff(normed), gate_mlp)
    normed = audio.norm(block.audio_norm3, a_scale_mlp, a_shift_mlp)
    audio.add(block.audio_ff(normed), a_gate_mlp)
    return video.value(), audio.value()


def _block_unfusable(block: torch.nn.Module) -> str:
    """Why the block cannot be fused ("" when it can)."""
    for name in NORMS:
        norm = getattr(block, name, None)
        if norm is None or norm_kind(norm) != "rms":
            return f"{name} is {type(norm).__name__}, not an RMSNorm without bias"
    return ""


# --------------------------------------------------------------------------- patch


def patch(model: torch.nn.Module, report, **options) -> None:
    report.family = "ltx-2"
    for path, module in model.named_modules():
        kind = type(module).__name__
        if kind == BLOCK:
            patch_block(path, module, report, _block_unfusable(module), _block_forward,
                        "ltx2 block", NORMS,
                        "video + audio: adaln(rms) + gated_residual_norm(rms) x3 + adaln(rms) "
                        "+ gated_residual")
        elif kind == ATTENTION:
            processor = type(original_processor(module)).__name__
            rope_type = getattr(module, "rope_type", None)
            what = ("processor: qk_norm_rope(across heads, interleaved)"
                    if rope_type == "interleaved" else
                    "processor: rms_norm q, k + rope(split, heads as rows)")
            patch_qk_norm_attention(
                path, module, report, processor if processor in FUSED_PROCESSORS else PROCESSOR,
                FUSED_PROCESSORS.get(processor, LTX2FusedAttnProcessor), what,
                why="" if rope_type in ROPE_TYPES else f"RoPE type {rope_type!r}")
