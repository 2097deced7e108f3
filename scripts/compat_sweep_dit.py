"""Runs ``fusebox.patch`` over every transformer model class of the installed diffusers: each
model class that ``diffusers.models.transformers`` exports (the DiTs, and the audio, prior and
temporal transformers beside them) is built tiny with random weights, run, patched and run again
on the same inputs, in fp32 on the CPU. The tiny configs and inputs (TINY below) follow the model
tests of diffusers (``tests/models/transformers/test_models_transformer_<name>.py``), shrunk where
those are large. Prints one line per class: OK (every output within 1e-5 of the unpatched one,
max abs difference over the unpatched output's max abs) with what was patched, counted per module
class; untouched (nothing recognized); MISMATCH; FAIL (the patch or the patched model raised);
skip (no inputs for the class, or the unpatched model does not run with them). An OK line also
names the host reads of tensors (``item``, ``tolist``, ``nonzero``, ``bool``...) that the patched
model's repeated blocks make after its first block, beside the unpatched model's count: each
stalls the host until the GPU catches up, once a block; a value read once a forward belongs in
the first block or before it.
Exits 1 on any MISMATCH or FAIL.

    PYTHONPATH=torch-ext python scripts/compat_sweep_dit.py [--only NAME ...] [--tol 1e-5]

NAME is a class name (``WanTransformer3DModel``) or a case-insensitive part of one (``wan``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import inspect
import sys
import time
import traceback
import warnings
from collections import Counter

import torch

TOL = 1e-5  # fp32 outputs differ by summation order, about 1e-7 to 1e-6


class Rand:
    """The random inputs of one model, from a generator seeded the same for both runs."""

    def __init__(self, seed: int = 1):
        self.g = torch.Generator().manual_seed(seed)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.g)

    def rand(self, *shape):
        return torch.rand(*shape, generator=self.g)

    def randint(self, low, high, *shape):
        return torch.randint(low, high, shape, generator=self.g)

    def steps(self, n):
        """``n`` timesteps in [0, 1000), as float."""
        return self.randint(0, 1000, n).float()


# --------------------------------------------------------------------------- inputs

# FLUX.1 and the models that copy its blocks, as the diffusers tests build them: 16 image and 48
# text tokens at random (not integer) positions
FLUX_TINY = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 4, 8])


def _flux_inputs(r, **extra):
    return dict(hidden_states=r.randn(1, 16, 4), encoder_hidden_states=r.randn(1, 48, 32),
                img_ids=r.randn(16, 3), txt_ids=r.randn(48, 3), timestep=torch.tensor([1.0]), **extra)


WAN_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def _wan_inputs(r):
    return dict(hidden_states=r.randn(1, 4, 2, 16, 16), encoder_hidden_states=r.randn(1, 12, 16),
                timestep=r.steps(1))


def _ltx2_inputs(r):
    return dict(hidden_states=r.randn(2, 2 * 4 * 4, 4), audio_hidden_states=r.randn(2, 9, 4),
                encoder_hidden_states=r.randn(2, 8, 16), audio_encoder_hidden_states=r.randn(2, 8, 16),
                timestep=r.rand(2) * 1000, encoder_attention_mask=torch.ones(2, 8).bool(),
                num_frames=2, height=4, width=4, audio_num_frames=9, fps=25.0)


LTX2_TINY = dict(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
                 attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4,
                 audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
                 audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
                 caption_channels=16, rope_double_precision=False)


def _sana_wm_refiner_inputs(r):
    from diffusers.models.transformers.transformer_sana_wm_refiner import (
        SanaWMLTX2AudioVideoRotaryPosEmbed,
    )

    rope = SanaWMLTX2AudioVideoRotaryPosEmbed(
        dim=16, patch_size=1, patch_size_t=1, base_num_frames=20, base_height=2048,
        base_width=2048, scale_factors=(8, 32, 32), modality="video", double_precision=False,
        num_attention_heads=2)
    coords = rope.prepare_video_coords(2, 2, 4, 4, device="cpu", fps=24.0)
    return dict(hidden_states=r.randn(2, 32, 4), encoder_hidden_states=r.randn(2, 8, 16),
                timestep=r.rand(2, 32) * 1000, video_rotary_emb=rope(coords, device="cpu"),
                encoder_attention_mask=torch.ones(2, 8))


# FramePack: HunyuanVideo's blocks with SigLIP image tokens and the clean / 2x / 4x history
# latents packed before the noisy ones; text padded in the second sample
FRAMEPACK_TINY = dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16,
                      num_layers=2, num_single_layers=2, num_refiner_layers=1, patch_size=2,
                      patch_size_t=1, text_embed_dim=32, pooled_projection_dim=16,
                      rope_axes_dim=(4, 6, 6), guidance_embeds=True, has_image_proj=True,
                      image_proj_dim=20, has_clean_x_embedder=True)


def _framepack_inputs(r):
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    return dict(hidden_states=r.randn(2, 4, 3, 8, 8), timestep=torch.tensor([10, 500]),
                encoder_hidden_states=r.randn(2, 7, 32), encoder_attention_mask=mask,
                pooled_projections=r.randn(2, 16), guidance=torch.tensor([3.0, 3.0]),
                image_embeds=r.randn(2, 5, 20), indices_latents=torch.arange(3),
                latents_clean=r.randn(2, 4, 2, 8, 8), indices_latents_clean=torch.tensor([3, 4]),
                latents_history_2x=r.randn(2, 4, 2, 8, 8), indices_latents_history_2x=torch.tensor([5, 6]),
                latents_history_4x=r.randn(2, 4, 4, 8, 8),
                indices_latents_history_4x=torch.tensor([7, 8, 9, 10]))


def _hunyuan_dit_inputs(r):
    meta = torch.tensor([[1024.0, 1024, 16, 16, 0, 0]] * 2)
    return dict(hidden_states=r.randn(2, 4, 8, 8), encoder_hidden_states=r.randn(2, 4, 8),
                text_embedding_mask=torch.ones(2, 4), encoder_hidden_states_t5=r.randn(2, 4, 8),
                text_embedding_mask_t5=torch.ones(2, 4), timestep=r.steps(2),
                image_meta_size=meta, style=torch.zeros(2, dtype=torch.long),
                image_rotary_emb=[torch.ones(1, 8), torch.zeros(1, 8)])


def _qwen_image_inputs(r):
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[:, 5:] = 0    # padded text
    return dict(hidden_states=r.randn(1, 16, 16), encoder_hidden_states=r.randn(1, 8, 16),
                encoder_hidden_states_mask=mask, timestep=torch.tensor([1.0]), img_shapes=[(1, 4, 4)])


def _qwen_image21_inputs(r):
    img_mask = torch.zeros(1, 5, dtype=torch.bool)
    img_mask[:, 4:] = True
    return dict(hidden_states=r.randn(1, 4, 4), encoder_hidden_states=r.randn(1, 4, 8),
                encoder_hidden_states_mask=torch.ones(1, 4, dtype=torch.long),
                timestep=torch.tensor([1.0]), img_shapes=[[(1, 2, 2)]], img_mask=img_mask)


def _ideogram4_inputs(r):
    from diffusers.models.transformers.transformer_ideogram4 import (
        IMAGE_POSITION_OFFSET,
        LLM_TOKEN_INDICATOR,
        OUTPUT_IMAGE_INDICATOR,
    )

    text, image = 4, 4
    hidden = torch.zeros(1, text + image, 16)
    hidden[:, text:] = r.randn(1, image, 16)
    encoder = torch.zeros(1, text + image, 24)
    encoder[:, :text] = r.randn(1, text, 24)
    pos = torch.zeros(1, text + image, 3, dtype=torch.long)
    pos[:, :text] = torch.arange(text)[:, None]
    pos[:, text:, 0] = IMAGE_POSITION_OFFSET
    pos[:, text:, 1] = torch.tensor([0, 0, 1, 1]) + IMAGE_POSITION_OFFSET
    pos[:, text:, 2] = torch.tensor([0, 1, 0, 1]) + IMAGE_POSITION_OFFSET
    indicator = torch.full((1, text + image), OUTPUT_IMAGE_INDICATOR, dtype=torch.long)
    indicator[:, :text] = LLM_TOKEN_INDICATOR
    return dict(hidden_states=hidden, encoder_hidden_states=encoder, timestep=torch.tensor([0.5]),
                position_ids=pos, segment_ids=torch.ones(1, text + image, dtype=torch.long),
                indicator=indicator)


def _krea2_inputs(r):
    pos = torch.zeros(4 + 4, 3)
    pos[4:, 1] = torch.arange(2).repeat_interleave(2)
    pos[4:, 2] = torch.arange(2).repeat(2)
    mask = torch.ones(1, 4, dtype=torch.bool)
    mask[:, -1] = False
    return dict(hidden_states=r.randn(1, 4, 16), encoder_hidden_states=r.randn(1, 4, 3, 16),
                timestep=torch.tensor([0.5]), position_ids=pos, encoder_attention_mask=mask)


def _kandinsky5_inputs(r):
    frames, height, width = 2, 4, 4
    return dict(hidden_states=r.randn(1, frames, height, width, 4), encoder_hidden_states=r.randn(1, 6, 8),
                timestep=torch.tensor([500.0]), pooled_projections=r.randn(1, 8),
                visual_rope_pos=[torch.arange(frames), torch.arange(height // 2),
                                 torch.arange(width // 2)],
                text_rope_pos=torch.arange(6))


def _kandinsky6_inputs(r):
    return dict(hidden_states=r.randn(1, 2, 4, 4, 9), encoder_hidden_states=r.randn(1, 6, 8),
                pooled_projections=r.randn(1, 8), timestep=r.steps(1),
                audio_hidden_states=r.randn(1, 6, 4))


def _minimax_h3_inputs(r):
    text, audio, video = 4, 6, 8
    n = text + audio + video
    text_i, audio_i = torch.arange(text), torch.arange(text, text + audio)
    video_i = torch.arange(text + audio, n)
    tags = torch.empty(n, dtype=torch.long)
    tags[text_i], tags[audio_i], tags[video_i] = 1, 2, 0
    timestep_indices = torch.zeros(n, dtype=torch.long)
    timestep_indices[audio_i] = 1
    pos = torch.zeros(n, 3)
    pos[:, 0] = torch.arange(float(n))
    pos[video_i, 1] = torch.arange(float(video)) % 4
    pos[video_i, 2] = torch.arange(float(video)) % 2
    return dict(hidden_states=r.randn(2, video, 16), audio_hidden_states=r.randn(2, audio, 6),
                encoder_hidden_states=r.randn(2, text, 8), timestep=torch.tensor([0.7, 0.3]),
                timestep_indices=timestep_indices, token_tags=tags, position_ids=pos,
                video_indices=video_i, audio_indices=audio_i, text_indices=text_i)


def _sana_wm_inputs(r):
    frames = 4
    c2w = torch.eye(4).repeat(1, frames, 1, 1)
    c2w[..., 2, 3] = torch.arange(frames) * 0.1
    intrinsics = torch.tensor([8.0, 8.0, 4.0, 4.0]).expand(1, frames, 4)
    return dict(hidden_states=r.randn(1, 4, frames, 8, 8),
                timestep=r.randint(0, 1000, 1, 1, frames).float(),
                encoder_hidden_states=r.randn(1, 1, 16, 8),
                encoder_attention_mask=torch.ones(1, 16, dtype=torch.long),
                camera_conditions=torch.cat([c2w.flatten(-2), intrinsics], -1),
                chunk_plucker=r.randn(1, 8, frames, 8, 8))


def _wan_animate2_inputs(r):
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

    return dict(hidden_states=[r.randn(16, 2, 4, 4)], timestep=torch.tensor([1.0]),
                encoder_hidden_states=[r.randn(8, 32)], condition_latents=[r.randn(20, 2, 4, 4)],
                encoder_hidden_states_image=r.randn(1, 4, 1280), kv_cache=WanAnimate2KVCache(2),
                kv_cache_mode="extract", seq_len=8,
                offset_grid_sizes=torch.tensor([[2, 2, 2]], dtype=torch.long))


def _cosmos3_inputs(r):
    return dict(input_ids=torch.tensor([1, 2]), text_indexes=torch.tensor([0, 1]),
                position_ids=torch.zeros(3, 3, dtype=torch.long), und_len=2, sequence_length=3,
                vision_tokens=[r.randn(1, 2, 1, 1, 1)], vision_token_shapes=[(1, 1, 1)],
                vision_sequence_indexes=torch.arange(2, 3), vision_mse_loss_indexes=torch.arange(2, 3),
                vision_timesteps=torch.ones(1), vision_noisy_frame_indexes=[torch.tensor([0])])


def _stable_audio_inputs(r):
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    frames = 8
    return dict(hidden_states=r.randn(2, 4, frames), timestep=torch.tensor([10.0, 500.0]),
                encoder_hidden_states=r.randn(2, 5, 8), global_hidden_states=r.randn(2, 1, 16),
                rotary_embedding=get_1d_rotary_pos_embed(8, frames + 1, use_real=True,
                                                         repeat_interleave_real=False))


def _t5_film_inputs(r):
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    return dict(encodings_and_masks=[(r.randn(2, 6, 32), mask)],
                decoder_input_tokens=r.randn(2, 8, 8), decoder_noise_time=r.rand(2))


def _helios_inputs(r):
    frames = 2
    return dict(hidden_states=r.randn(1, 4, frames, 16, 16), timestep=r.steps(1),
                encoder_hidden_states=r.randn(1, 12, 16),
                indices_hidden_states=torch.ones(1, frames),
                indices_latents_history_short=torch.ones(1, frames - 1),
                indices_latents_history_mid=torch.ones(1, frames - 1),
                indices_latents_history_long=torch.ones(1, (frames - 1) * 4),
                latents_history_short=r.randn(1, 4, frames - 1, 16, 16),
                latents_history_mid=r.randn(1, 4, frames - 1, 16, 16),
                latents_history_long=r.randn(1, 4, (frames - 1) * 4, 16, 16))


def _omnigen_inputs(r):
    seq = 24
    attn = seq + 1 + 8 * 8 // 4
    return dict(hidden_states=r.randn(2, 4, 8, 8), timestep=r.rand(2),
                input_ids=r.randint(0, 10, 2, seq), input_img_latents=[r.randn(1, 4, 8, 8)],
                input_image_sizes={0: [[0, 16]]}, attention_mask=torch.ones(2, attn, attn),
                position_ids=torch.arange(attn).repeat(2, 1))


def _bria_inputs(r, channels=4, hw=4, text=48, dim=32, **extra):
    return dict(hidden_states=r.randn(1, hw * hw, channels), encoder_hidden_states=r.randn(1, text, dim),
                img_ids=r.randn(hw * hw, 3), txt_ids=r.randn(text, 3), timestep=torch.tensor([1.0]),
                **extra)


def _bria_fibo_inputs(r):
    text = r.randn(1, 16, 64)
    return _bria_inputs(r, channels=48, hw=8, text=16, dim=64,
                        text_encoder_layers=[text[:, :, :32], text[:, :, :32]])


# class name -> (init kwargs, inputs(Rand) -> forward kwargs)
TINY = {
    "AceStepTransformer1DModel": (
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, in_channels=24, audio_acoustic_hidden_dim=8,
             patch_size=2, rope_theta=10000.0, rms_norm_eps=1e-6, sliding_window=16),
        lambda r: dict(hidden_states=r.randn(2, 8, 8), timestep=r.rand(2), timestep_r=r.rand(2),
                       encoder_hidden_states=r.randn(2, 10, 32), context_latents=r.randn(2, 8, 16))),
    "AllegroTransformer3DModel": (
        dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
             num_layers=1, cross_attention_dim=16, sample_width=8, sample_height=8,
             sample_frames=8, caption_channels=8),
        lambda r: dict(hidden_states=r.randn(2, 4, 8, 8, 8), encoder_hidden_states=r.randn(2, 16, 8),
                       timestep=r.steps(2))),
    "AnyFlowTransformer3DModel": (
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
             out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
             cross_attn_norm=True, rope_max_seq_len=32, gate_value=0.25, deltatime_type="r"),
        lambda r: dict(hidden_states=r.randn(1, 2, 4, 8, 8), timestep=torch.full((1, 2), 500.0),
                       r_timestep=torch.full((1, 2), 250.0), encoder_hidden_states=r.randn(1, 12, 16))),
    "AnyFlowFARTransformer3DModel": (
        dict(patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4), full_chunk_limit=3,
             num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
             text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
             rope_max_seq_len=32, gate_value=0.25, deltatime_type="r"),
        lambda r: dict(hidden_states=r.randn(1, 4, 4, 16, 16), timestep=torch.full((1, 4), 500.0),
                       r_timestep=torch.full((1, 4), 250.0), encoder_hidden_states=r.randn(1, 12, 16),
                       chunk_partition=[2, 2])),
    "AuraFlowTransformer2DModel": (
        dict(sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=1,
             num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=4,
             caption_projection_dim=32, joint_attention_dim=32, out_channels=4,
             pos_embed_max_size=64),
        lambda r: dict(hidden_states=r.randn(2, 4, 16, 16), encoder_hidden_states=r.randn(2, 16, 32),
                       timestep=r.steps(2))),
    "BriaFibo2Transformer2DModel": (
        dict(in_channels=4, patch_size=2, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
             cap_feat_dim=24, injection_layer_ids=(1,), perceiver_num_layers=1,
             min_num_gist_tokens=4, max_num_gist_tokens=8, gist_step=4, gist_min_text_len=4,
             gist_max_text_len=16, axes_dims=(4, 6, 6), axes_lens=(16, 16, 16)),
        lambda r: dict(hidden_states=r.randn(1, 4, 8, 8), timestep=torch.tensor([0.5]),
                       encoder_hidden_states=r.randn(1, 2, 6, 24))),
    "BriaFiboTransformer2DModel": (
        dict(patch_size=1, in_channels=48, num_layers=1, num_single_layers=1, attention_head_dim=8,
             num_attention_heads=2, joint_attention_dim=64, text_encoder_dim=32,
             pooled_projection_dim=None, axes_dims_rope=[0, 4, 4]),
        _bria_fibo_inputs),
    "BriaTransformer2DModel": (
        dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
             num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=None,
             axes_dims_rope=[0, 4, 4]),
        _bria_inputs),
    "ChromaTransformer2DModel": (FLUX_TINY, _flux_inputs),
    "ChronoEditTransformer3DModel": (
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=16,
             out_channels=16, text_dim=32, freq_dim=16, ffn_dim=32, num_layers=2,
             cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None,
             added_kv_proj_dim=None, rope_max_seq_len=64, pos_embed_seq_len=None,
             rope_temporal_skip_len=8),
        lambda r: dict(hidden_states=r.randn(1, 16, 2, 8, 8), timestep=r.steps(1),
                       encoder_hidden_states=r.randn(1, 12, 32), encoder_hidden_states_image=None)),
    "CogVideoXTransformer3DModel": (
        dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
             time_embed_dim=2, text_embed_dim=8, num_layers=1, sample_width=8, sample_height=8,
             sample_frames=8, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=8),
        lambda r: dict(hidden_states=r.randn(2, 1, 4, 8, 8), encoder_hidden_states=r.randn(2, 8, 8),
                       timestep=r.steps(2))),
    "CogView3PlusTransformer2DModel": (
        dict(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=2,
             out_channels=4, text_embed_dim=8, time_embed_dim=8, condition_dim=2,
             pos_embed_max_size=8, sample_size=8),
        lambda r: dict(hidden_states=r.randn(2, 4, 8, 8), encoder_hidden_states=r.randn(2, 8, 8),
                       original_size=torch.tensor([[64, 64]] * 2), target_size=torch.tensor([[64, 64]] * 2),
                       crop_coords=torch.tensor([[0, 0]] * 2), timestep=r.steps(2))),
    "CogView4Transformer2DModel": (
        dict(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=4,
             out_channels=4, text_embed_dim=8, time_embed_dim=8, condition_dim=4),
        lambda r: dict(hidden_states=r.randn(2, 4, 8, 8), encoder_hidden_states=r.randn(2, 8, 8),
                       timestep=r.steps(2), original_size=torch.tensor([[64, 64]] * 2),
                       target_size=torch.tensor([[64, 64]] * 2), crop_coords=torch.tensor([[0, 0]] * 2))),
    "ConsisIDTransformer3DModel": (
        dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
             time_embed_dim=2, text_embed_dim=8, num_layers=1, sample_width=8, sample_height=8,
             sample_frames=8, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=8,
             cross_attn_interval=1, is_kps=False, is_train_face=True, cross_attn_dim_head=1,
             cross_attn_num_heads=1, LFE_id_dim=2, LFE_vit_dim=2, LFE_depth=5, LFE_dim_head=8,
             LFE_num_heads=2, LFE_num_id_token=1, LFE_num_querie=1, LFE_output_dim=10,
             LFE_ff_mult=1, LFE_num_scale=1),
        lambda r: dict(hidden_states=r.randn(2, 1, 4, 8, 8), encoder_hidden_states=r.randn(2, 8, 8),
                       timestep=r.steps(2), id_vit_hidden=[torch.ones(2, 2, 2)],
                       id_cond=torch.ones(2, 2))),
    "Cosmos3OmniTransformer": (
        dict(head_dim=6, hidden_act="relu2", hidden_size=12, intermediate_size=24,
             latent_channel=2, latent_patch_size=1, num_attention_heads=2, num_hidden_layers=2,
             num_key_value_heads=1, patch_latent_dim=2, qk_norm_for_text=False, rms_norm_eps=1e-5,
             rope_axes_dim=[1, 1, 1], rope_theta=1e8, vocab_size=32),
        _cosmos3_inputs),
    "CosmosTransformer3DModel": (
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12,
             num_layers=2, mlp_ratio=2, text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 32, 32),
             patch_size=(1, 2, 2), rope_scale=(2.0, 1.0, 1.0), extra_pos_embed_type="learnable",
             # the padding mask channel is resized with torchvision, not installed here
             concat_padding_mask=False),
        lambda r: dict(hidden_states=r.randn(1, 4, 1, 16, 16), timestep=r.steps(1),
                       encoder_hidden_states=r.randn(1, 12, 16), attention_mask=torch.ones(1, 12),
                       fps=30)),
    "DiTTransformer2DModel": (
        dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8,
             num_layers=2, sample_size=8, num_embeds_ada_norm=10),
        lambda r: dict(hidden_states=r.randn(2, 4, 8, 8), timestep=torch.tensor([10, 500]),
                       class_labels=torch.tensor([1, 3]))),
    "DreamLiteTransformer2DModel": (
        dict(num_attention_heads=2, attention_head_dim=8, in_channels=8, num_layers=1,
             norm_num_groups=4, cross_attention_dim=16),
        lambda r: dict(hidden_states=r.randn(2, 8, 4, 4), encoder_hidden_states=r.randn(2, 5, 16),
                       timestep=torch.tensor([10, 500]))),
    "DualTransformer2DModel": (
        dict(num_attention_heads=2, attention_head_dim=8, in_channels=8, num_layers=1,
             norm_num_groups=4, cross_attention_dim=16),
        # the default condition lengths: 77 text tokens, then 257 image tokens
        lambda r: dict(hidden_states=r.randn(2, 8, 4, 4), encoder_hidden_states=r.randn(2, 77 + 257, 16),
                       timestep=torch.tensor([10, 500]))),
    "EasyAnimateTransformer3DModel": (
        dict(attention_head_dim=16, num_attention_heads=2, in_channels=4, mmdit_layers=2,
             num_layers=2, out_channels=4, patch_size=2, sample_height=60, sample_width=90,
             text_embed_dim=16, time_embed_dim=8, time_position_encoding_type="3d_rope",
             timestep_activation_fn="silu"),
        lambda r: dict(hidden_states=r.randn(2, 4, 2, 8, 8), timestep=r.steps(2),
                       encoder_hidden_states=r.randn(2, 16, 16))),
    "ErnieImageTransformer2DModel": (
        dict(hidden_size=16, num_attention_heads=1, num_layers=1, ffn_hidden_size=16,
             in_channels=16, out_channels=16, patch_size=1, text_in_dim=16, rope_theta=256,
             rope_axes_dim=(8, 4, 4), eps=1e-6, qk_layernorm=True),
        lambda r: dict(hidden_states=r.randn(1, 16, 8, 8), timestep=torch.tensor([1.0]),
                       text_bth=r.randn(1, 16, 16), text_lens=torch.tensor([16]))),
    "Flux2Transformer2DModel": (
        dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=256,
             axes_dims_rope=[4, 4, 4, 4]),
        lambda r: dict(hidden_states=r.randn(1, 16, 4), encoder_hidden_states=r.randn(1, 48, 32),
                       img_ids=torch.cartesian_prod(*map(torch.arange, (1, 4, 4, 1)))[None],
                       txt_ids=torch.cartesian_prod(*map(torch.arange, (1, 1, 1, 48)))[None],
                       timestep=torch.tensor([1.0]), guidance=torch.tensor([1.0]))),
    "Flux3Transformer2DModel": (
        dict(in_channels=4, cond_in_channels=4, num_layers=1, num_single_layers=1,
             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
             timestep_channels=256, axes_dims_rope=(4, 4, 4, 4)),
        lambda r: dict(hidden_states=r.randn(1, 16, 4), encoder_hidden_states=r.randn(1, 48, 32),
                       img_ids=torch.cartesian_prod(*map(torch.arange, (1, 4, 4, 1))),
                       txt_ids=torch.cartesian_prod(*map(torch.arange, (1, 1, 1, 48))),
                       timestep=torch.tensor([1.0]))),
    "FluxTransformer2DModel": (dict(FLUX_TINY, pooled_projection_dim=32),
                               lambda r: _flux_inputs(r, pooled_projections=r.randn(1, 32))),
    "GlmImageTransformer2DModel": (
        dict(patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8,
             num_attention_heads=2, text_embed_dim=32, time_embed_dim=16, condition_dim=8,
             prior_vq_quantizer_codebook_size=64),
        lambda r: dict(hidden_states=r.randn(1, 4, 8, 8), encoder_hidden_states=r.randn(1, 12, 32),
                       prior_token_id=r.randint(0, 64, 1), prior_token_drop=torch.zeros(1, dtype=torch.bool),
                       timestep=r.steps(1), target_size=torch.tensor([[8.0, 8.0]]),
                       crop_coords=torch.tensor([[0.0, 0.0]]))),
    "HeliosTransformer3DModel": (
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
             out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
             cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_dim=(4, 4, 4),
             has_multi_term_memory_patch=True, guidance_cross_attn=True, zero_history_timestep=True,
             is_amplify_history=False),
        _helios_inputs),
    "HiDreamImageTransformer2DModel": (
        dict(patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1,
             attention_head_dim=8, num_attention_heads=4, caption_channels=[8, 4], text_emb_dim=8,
             num_routed_experts=2, num_activated_experts=2, axes_dims_rope=(4, 2, 2),
             max_resolution=(32, 32), llama_layers=(0, 1), force_inference_output=True),
        lambda r: dict(hidden_states=r.randn(2, 4, 16, 16), encoder_hidden_states_t5=r.randn(2, 8, 8),
                       encoder_hidden_states_llama3=r.randn(2, 2, 8, 4), pooled_embeds=r.randn(2, 8),
                       timesteps=r.steps(2))),
    "HunyuanDiT2DModel": (
        dict(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
             num_attention_heads=2, cross_attention_dim=8, cross_attention_dim_t5=8,
             pooled_projection_dim=4, hidden_size=16, text_len=4, text_len_t5=4,
             activation_fn="gelu-approximate"),
        _hunyuan_dit_inputs),
    "HunyuanImageTransformer2DModel": (
        dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16,
             num_layers=2, num_single_layers=2, num_refiner_layers=1, patch_size=(1, 1),
             text_embed_dim=32, rope_axes_dim=(8, 8)),
        lambda r: dict(hidden_states=r.randn(2, 4, 4, 6), timestep=torch.tensor([10.0, 500.0]),
                       encoder_hidden_states=r.randn(2, 7, 32),
                       encoder_attention_mask=torch.ones(2, 7).index_fill_(1, torch.tensor([5, 6]), 0))),
    "HunyuanVideo15Transformer3DModel": (
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
             num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
             text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(2, 2, 4),
             target_size=16, task_type="t2v"),
        lambda r: dict(hidden_states=r.randn(1, 4, 1, 8, 8), timestep=torch.tensor([1.0]),
                       encoder_hidden_states=r.randn(1, 6, 16), encoder_hidden_states_2=r.randn(1, 4, 8),
                       encoder_attention_mask=torch.ones(1, 6), encoder_attention_mask_2=torch.ones(1, 4),
                       image_embeds=torch.zeros(1, 3, 12))),
    "HunyuanVideoFramepackTransformer3DModel": (FRAMEPACK_TINY, _framepack_inputs),
    "HunyuanVideoTransformer3DModel": (
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10,
             num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1,
             guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8,
             rope_axes_dim=(2, 4, 4), image_condition_type=None),
        lambda r: dict(hidden_states=r.randn(1, 4, 1, 16, 16), timestep=r.steps(1),
                       encoder_hidden_states=r.randn(1, 12, 16), pooled_projections=r.randn(1, 8),
                       encoder_attention_mask=torch.ones(1, 12), guidance=r.steps(1))),
    "Ideogram4Transformer2DModel": (
        dict(in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
             intermediate_size=32, adaln_dim=16, llm_features_dim=24, rope_theta=10_000,
             mrope_section=(2, 1, 1), norm_eps=1e-5),
        _ideogram4_inputs),
    "JoyImageEditPlusTransformer3DModel": (
        dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=32, num_attention_heads=2,
             text_dim=16, num_layers=2, rope_dim_list=[4, 6, 6], theta=256),
        lambda r: dict(hidden_states=r.randn(1, 2, 16, 1, 2, 2), encoder_hidden_states=r.randn(1, 12, 16),
                       timestep=torch.tensor([1.0]), shape_list=[[(1, 1, 1), (1, 1, 1)]])),
    "JoyImageEditTransformer3DModel": (
        dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=32, num_attention_heads=2,
             text_dim=16, num_layers=2, rope_dim_list=[4, 6, 6], theta=256),
        lambda r: dict(hidden_states=r.randn(1, 16, 1, 4, 4), encoder_hidden_states=r.randn(1, 12, 16),
                       timestep=torch.tensor([1.0]))),
    "Kandinsky5Transformer3DModel": (
        dict(in_visual_dim=4, in_text_dim=8, in_text_dim2=8, time_dim=16, out_visual_dim=4,
             patch_size=(1, 2, 2), model_dim=48, ff_dim=64, num_text_blocks=1,
             num_visual_blocks=2, axes_dims=(4, 4, 4)),
        _kandinsky5_inputs),
    "Kandinsky6SRTransformer3DModel": (
        dict(in_visual_dim=4, out_visual_dim=8, time_dim=16, patch_size=(1, 2, 2), model_dim=24,
             ff_dim=32, num_visual_blocks=2, axes_dims=(4, 4, 4)),
        lambda r: dict(hidden_states=r.randn(1, 2, 16, 16, 9), timestep=r.steps(1))),
    "Kandinsky6Transformer3DModel": (
        dict(in_visual_dim=4, out_visual_dim=4, in_text_dim=8, in_text_dim2=8, time_dim=16,
             patch_size=(1, 2, 2), model_dim=48, ff_dim=64, num_text_blocks=1,
             num_visual_blocks=2, axes_dims=(4, 4, 4), visual_cond=True, in_audio_dim=4,
             out_audio_dim=4),
        _kandinsky6_inputs),
    "Krea2Transformer2DModel": (
        dict(in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=32, timestep_embed_dim=8,
             text_hidden_dim=16, num_text_layers=3, text_num_attention_heads=2,
             text_num_key_value_heads=1, text_intermediate_size=16, num_layerwise_text_blocks=1,
             num_refiner_text_blocks=1, axes_dims_rope=(4, 2, 2), rope_theta=1000.0,
             norm_eps=1e-5),
        _krea2_inputs),
    "LTX2VideoTransformer3DModel": (LTX2_TINY, _ltx2_inputs),
    "LTXVideoTransformer3DModel": (
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
             cross_attention_dim=16, num_layers=1, qk_norm="rms_norm_across_heads",
             caption_channels=16),
        lambda r: dict(hidden_states=r.randn(2, 2 * 16 * 16, 4), encoder_hidden_states=r.randn(2, 16, 16),
                       timestep=r.steps(2), encoder_attention_mask=torch.ones(2, 16).bool(),
                       num_frames=2, height=16, width=16)),
    "LatteTransformer3DModel": (
        dict(sample_size=8, num_layers=2, patch_size=2, attention_head_dim=4, num_attention_heads=2,
             caption_channels=8, in_channels=4, cross_attention_dim=8, out_channels=8,
             attention_bias=True, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
             norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
             video_length=2),
        lambda r: dict(hidden_states=r.randn(2, 4, 2, 8, 8), encoder_hidden_states=r.randn(2, 8, 8),
                       timestep=r.steps(2).long(), enable_temporal_attentions=True)),
    "LongCatAudioDiTTransformer": (
        dict(dit_dim=64, dit_depth=2, dit_heads=4, dit_text_dim=32, latent_dim=8, text_conv=False),
        lambda r: dict(hidden_states=r.randn(1, 16, 8), encoder_hidden_states=r.randn(1, 10, 32),
                       encoder_attention_mask=torch.ones(1, 10, dtype=torch.bool),
                       attention_mask=torch.ones(1, 16, dtype=torch.bool), timestep=torch.ones(1))),
    "LongCatImageTransformer2DModel": (dict(FLUX_TINY, pooled_projection_dim=32), _flux_inputs),
    "Lumina2Transformer2DModel": (
        dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2,
             num_refiner_layers=1, num_attention_heads=3, num_kv_heads=1, multiple_of=2,
             ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(4, 2, 2),
             axes_lens=(128, 128, 128), cap_feat_dim=32),
        lambda r: dict(hidden_states=r.randn(2, 4, 16, 16), encoder_hidden_states=r.randn(2, 16, 32),
                       timestep=r.rand(2), encoder_attention_mask=torch.ones(2, 16, dtype=torch.bool))),
    "LuminaNextDiT2DModel": (
        dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2,
             num_attention_heads=3, num_kv_heads=1, multiple_of=16, ffn_dim_multiplier=None,
             norm_eps=1e-5, learn_sigma=False, qk_norm=True, cross_attention_dim=32,
             scaling_factor=1.0),
        lambda r: dict(hidden_states=r.randn(2, 4, 16, 16), encoder_hidden_states=r.randn(2, 16, 32),
                       timestep=r.rand(2), encoder_mask=r.randn(2, 16),
                       image_rotary_emb=r.randn(384, 384, 4), cross_attention_kwargs={})),
    "MiniMaxH3Transformer3DModel": (
        dict(num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=2,
             num_refiner_layers=2, ffn_dim=32, in_channels=4, audio_in_channels=6,
             patch_size=(1, 2, 2), text_dim=8, freq_dim=8, time_embed_hidden_dim=24,
             time_embed_dim=16, rope_freq_dim=2),
        _minimax_h3_inputs),
    "MiniMaxMusic3RVQDepthDecoder": (
        dict(hidden_size=32, num_layers=2, num_attention_heads=2, intermediate_size=64,
             audio_vocab_size=16, num_codebooks=4, max_position_embeddings=8),
        lambda r: dict(inputs_embeds=r.randn(2, 5, 32))),
    "MiniMaxMusic3Transformer1DModel": (
        dict(in_channels=8, condition_dim=16, num_layers=2, num_attention_heads=2,
             attention_head_dim=8, ff_inner_dim=32, rotary_dim=4, fourier_embedding_dim=8),
        lambda r: dict(hidden_states=r.randn(1, 8, 24), encoder_hidden_states=r.randn(1, 24, 16),
                       timestep=torch.full((1,), 0.5))),
    "MochiTransformer3DModel": (
        dict(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2,
             pooled_projection_dim=16, in_channels=4, out_channels=None, qk_norm="rms_norm",
             text_embed_dim=16, time_embed_dim=4, activation_fn="swiglu", max_sequence_length=16),
        lambda r: dict(hidden_states=r.randn(2, 4, 2, 8, 8), encoder_hidden_states=r.randn(2, 16, 16),
                       timestep=r.steps(2),
                       encoder_attention_mask=torch.arange(16).expand(2, 16)
                       < torch.tensor([[14], [11]]))),   # valid text of two lengths, as in CFG
    "MotifVideoTransformer3DModel": (
        dict(in_channels=33, out_channels=16, num_attention_heads=2, attention_head_dim=12,
             num_layers=1, num_single_layers=1, num_decoder_layers=0, mlp_ratio=4.0, patch_size=1,
             patch_size_t=1, qk_norm="rms_norm", norm_type="layer_norm", text_embed_dim=32,
             image_embed_dim=4, rope_theta=256.0, rope_axes_dim=(4, 4, 4),
             enable_text_cross_attention_dual=False, enable_text_cross_attention_single=False),
        lambda r: dict(hidden_states=r.randn(1, 33, 3, 8, 8), encoder_hidden_states=r.randn(1, 12, 32),
                       timestep=r.steps(1))),
    "NucleusMoEImageTransformer2DModel": (
        dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
             num_attention_heads=4, joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
             moe_enabled=False, capacity_factors=[8.0, 8.0]),
        lambda r: dict(hidden_states=r.randn(1, 16, 16), encoder_hidden_states=r.randn(1, 8, 16),
                       encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long),
                       timestep=torch.tensor([1.0]), img_shapes=[(1, 4, 4)])),
    "OmniGenTransformer2DModel": (
        dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32,
             num_layers=2, pad_token_id=0, vocab_size=1000, in_channels=4, time_step_dim=4,
             rope_scaling={"long_factor": [1, 2], "short_factor": [1, 2]}),
        _omnigen_inputs),
    "OvisImageTransformer2DModel": (dict(FLUX_TINY, out_channels=4), _flux_inputs),
    "PRXTransformer2DModel": (
        dict(in_channels=16, patch_size=2, context_in_dim=32, hidden_size=64, mlp_ratio=3.5,
             num_heads=4, depth=2, axes_dim=[8, 8], theta=10_000),
        lambda r: dict(hidden_states=r.randn(1, 16, 8, 8), encoder_hidden_states=r.randn(1, 16, 32),
                       timestep=torch.tensor([1.0]))),
    "PixArtTransformer2DModel": (
        dict(sample_size=8, num_layers=1, patch_size=2, attention_head_dim=2, num_attention_heads=2,
             in_channels=4, cross_attention_dim=8, out_channels=8, attention_bias=True,
             activation_fn="gelu-approximate", num_embeds_ada_norm=8, norm_type="ada_norm_single",
             norm_elementwise_affine=False, norm_eps=1e-6, use_additional_conditions=False,
             caption_channels=None),
        lambda r: dict(hidden_states=r.randn(4, 4, 8, 8), timestep=r.steps(4).long(),
                       encoder_hidden_states=r.randn(4, 8, 8),
                       added_cond_kwargs={"aspect_ratio": None, "resolution": None})),
    "PriorTransformer": (
        dict(num_attention_heads=2, attention_head_dim=4, num_layers=2, embedding_dim=8,
             num_embeddings=7, additional_embeddings=4),
        lambda r: dict(hidden_states=r.randn(2, 8), timestep=2, proj_embedding=r.randn(2, 8),
                       encoder_hidden_states=r.randn(2, 7, 8),
                       attention_mask=torch.ones(2, 7, dtype=torch.bool))),
    "QwenImage21Transformer2DModel": (
        dict(patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
             num_attention_heads=2, context_in_dim=8, mlp_ratio=2, axes_dims_rope=(4, 6, 6)),
        _qwen_image21_inputs),
    "QwenImageTransformer2DModel": (
        dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
             num_attention_heads=4, joint_attention_dim=16, guidance_embeds=False,
             axes_dims_rope=(8, 4, 4)),
        _qwen_image_inputs),
    "SD3Transformer2DModel": (
        # the SD3.5 test: layer 0 is a dual-attention layer, q/k RMSNorm; the last block is
        # context_pre_only
        dict(sample_size=32, patch_size=1, in_channels=4, num_layers=4, attention_head_dim=8,
             num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
             pooled_projection_dim=64, out_channels=4, pos_embed_max_size=96,
             dual_attention_layers=(0,), qk_norm="rms_norm"),
        lambda r: dict(hidden_states=r.randn(2, 4, 16, 16), encoder_hidden_states=r.randn(2, 154, 32),
                       pooled_projections=r.randn(2, 64), timestep=r.steps(2))),
    "SanaTransformer2DModel": (
        dict(patch_size=1, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=4,
             num_attention_heads=2, num_cross_attention_heads=2, cross_attention_head_dim=4,
             cross_attention_dim=8, caption_channels=8, sample_size=16),
        lambda r: dict(hidden_states=r.randn(2, 4, 16, 16), encoder_hidden_states=r.randn(2, 8, 8),
                       timestep=r.steps(2))),
    "SanaVideoTransformer3DModel": (
        dict(in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=12,
             num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=12,
             cross_attention_dim=24, caption_channels=16, mlp_ratio=2.5, dropout=0.0,
             attention_bias=False, sample_size=8, patch_size=(1, 2, 2),
             norm_elementwise_affine=False, norm_eps=1e-6, qk_norm="rms_norm_across_heads",
             rope_max_seq_len=32),
        lambda r: dict(hidden_states=r.randn(1, 16, 2, 16, 16), encoder_hidden_states=r.randn(1, 12, 16),
                       timestep=r.steps(1))),
    "SanaWMLTX2RefinerTransformer3DModel": (LTX2_TINY, _sana_wm_refiner_inputs),
    "SanaWMTransformer3DModel": (
        dict(in_channels=4, num_layers=2, hidden_size=32, num_attention_heads=2, patch_size=(1, 1, 1),
             softmax_every_n=2, linear_head_dim=16, t_kernel_size=3, conv_kernel_size=4,
             caption_channels=8, mlp_ratio=2.0, chunk_plucker_channels=8,
             chunk_plucker_post_attn_blocks=2),
        _sana_wm_inputs),
    "SkyReelsV2Transformer3DModel": (WAN_TINY, _wan_inputs),
    "StableAudio3DiTModel": (
        dict(io_channels=8, patch_size=1, embed_dim=32, depth=2, num_heads=4, cond_token_dim=16,
             global_cond_dim=12, local_add_cond_dim=5, timestep_features_dim=16, ff_mult=2,
             num_memory_tokens=3, use_differential_attention=False),
        lambda r: dict(hidden_states=r.randn(2, 8, 16), timestep=r.rand(2),
                       encoder_hidden_states=r.randn(2, 4, 16), global_hidden_states=r.randn(2, 12))),
    "StableAudioDiTModel": (
        dict(sample_size=8, in_channels=4, num_layers=2, attention_head_dim=16,
             num_attention_heads=2, num_key_value_attention_heads=1, out_channels=4,
             cross_attention_dim=8, time_proj_dim=8, global_states_input_dim=16,
             cross_attention_input_dim=8),
        _stable_audio_inputs),
    "T5FilmDecoder": (
        dict(input_dims=8, targets_length=8, d_model=32, num_layers=2, num_heads=2, d_kv=16,
             d_ff=64, dropout_rate=0.0),
        _t5_film_inputs),
    "Transformer2DModel": (
        dict(num_attention_heads=2, attention_head_dim=8, in_channels=8, num_layers=1,
             norm_num_groups=4, cross_attention_dim=16),
        lambda r: dict(hidden_states=r.randn(2, 8, 4, 4), encoder_hidden_states=r.randn(2, 5, 16),
                       timestep=torch.tensor([10, 500]))),
    "TransformerTemporalModel": (
        dict(num_attention_heads=8, attention_head_dim=4, in_channels=4, num_layers=1,
             norm_num_groups=1),
        lambda r: dict(hidden_states=r.randn(2, 4, 16, 16), timestep=r.steps(2).long())),
    "WanAnimate2Transformer3DModel": (
        dict(patch_size=(1, 2, 2), text_len=16, in_dim=36, dim=128, ffn_dim=256, freq_dim=64,
             text_dim=32, out_dim=16, num_heads=4, num_layers=2, cross_attn_norm=True,
             use_img_emb=True),
        _wan_animate2_inputs),
    "WanAnimateTransformer3DModel": (
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=12,
             latent_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32,
             num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", image_dim=16,
             rope_max_seq_len=32, motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16},
             motion_encoder_size=16, motion_style_dim=8, motion_dim=4, motion_encoder_dim=16,
             face_encoder_hidden_dim=16, face_encoder_num_heads=2, inject_face_latents_blocks=2),
        lambda r: dict(hidden_states=r.randn(1, 12, 21, 8, 8), timestep=r.steps(1),
                       encoder_hidden_states=r.randn(1, 12, 16),
                       encoder_hidden_states_image=r.randn(1, 12, 16),
                       pose_hidden_states=r.randn(1, 4, 20, 8, 8),
                       face_pixel_values=r.randn(1, 3, 77, 16, 16))),
    "WanTransformer3DModel": (WAN_TINY, _wan_inputs),
    "WanVACETransformer3DModel": (
        dict(WAN_TINY, in_channels=16, out_channels=16, text_dim=32, num_layers=4,
             vace_layers=[0, 2], vace_in_channels=48),
        lambda r: dict(hidden_states=r.randn(1, 16, 2, 8, 8), encoder_hidden_states=r.randn(1, 12, 32),
                       control_hidden_states=r.randn(1, 48, 2, 8, 8), timestep=r.steps(1))),
    "ZImageTransformer2DModel": (
        dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=16, n_layers=1,
             n_refiner_layers=1, n_heads=1, n_kv_heads=2, qk_norm=True, cap_feat_dim=16,
             rope_theta=256.0, t_scale=1000.0, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32]),
        lambda r: dict(x=[r.randn(16, 1, 16, 16)], cap_feats=[r.randn(16, 16)], t=torch.tensor([0.0]))),
}


# --------------------------------------------------------------------------- running


def model_classes():
    """Every model class ``diffusers.models.transformers`` exports, by name."""
    import diffusers.models.transformers as transformers
    from diffusers import ModelMixin

    out = {}
    for name in dir(transformers):
        try:
            obj = getattr(transformers, name)
        except Exception:  # noqa: BLE001 - a lazily imported class whose module fails to import
            continue
        if isinstance(obj, type) and issubclass(obj, ModelMixin) and obj is not ModelMixin:
            out[name] = obj
    return dict(sorted(out.items()))


def build(cls, config):
    """The tiny model with its seeded random weights; 1-D parameters (norm weights, biases) and
    the ones initialized to zero (gates, zero-init projections) moved off their init, so every
    norm weight and branch takes part in the comparison."""
    torch.manual_seed(0)
    model = cls(**config).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point():
                continue
            if p.dim() == 1:
                p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.dtype))
            elif not p.any():
                p.copy_(0.02 * torch.randn(p.shape, generator=g).to(p.dtype))
    return model


def tensors_of(out):
    """The floating-point tensors of a model's output, in order (tuples, lists, dicts and output
    dataclasses opened)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in tensors_of(o)]
    return []


def forward(model, make_inputs):
    kwargs = make_inputs(Rand())
    if "return_dict" in inspect.signature(model.forward).parameters:
        kwargs.setdefault("return_dict", False)
    with torch.no_grad():
        return tensors_of(model(**kwargs))


def max_rel_diff(outs, refs) -> float:
    """Max abs difference over the unpatched outputs' max abs, over all outputs."""
    if len(outs) != len(refs) or any(o.shape != r.shape for o, r in zip(outs, refs)):
        return float("inf")
    diff = max(((o.double() - r.double()).abs().max().item() for o, r in zip(outs, refs)), default=0.0)
    scale = max((r.double().abs().max().item() for r in refs), default=0.0)
    return diff / max(scale, 1e-30)


def where(e: BaseException) -> str:
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"{frame.filename.split('/')[-1]}:{frame.lineno}"


_HOST_READS = ("item", "tolist", "nonzero", "cpu", "numpy", "__bool__", "__int__", "__float__")


@contextlib.contextmanager
def host_reads_after_first_block(model):
    """Counts, by ``file:line``, the host reads of tensors made inside the model's repeated
    blocks (``_repeated_blocks``, the classes regional compile compiles; else the modules of
    its ``...blocks`` and ``...layers`` lists) after the first one."""
    reads, state = Counter(), {"inside": 0, "blocks_done": 0}
    kinds = set(getattr(model, "_repeated_blocks", None) or ())
    blocks = ([m for m in model.modules() if type(m).__name__ in kinds] if kinds else
              [b for name, m in model.named_children() if isinstance(m, torch.nn.ModuleList)
               and name.endswith(("blocks", "layers")) for b in m])

    def counting(real, name):
        def read(*args, **kwargs):
            if state["inside"] and state["blocks_done"] > 0:
                frame = traceback.extract_stack(limit=2)[0]
                reads[f"{name}@{frame.filename.split('/')[-1]}:{frame.lineno}"] += 1
            return real(*args, **kwargs)
        return read

    def enter(*_):
        state["inside"] += 1

    def leave(*_):
        state["inside"] -= 1
        state["blocks_done"] += state["inside"] == 0

    saved = [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in _HOST_READS]
    saved.append((torch, "nonzero", torch.nonzero))
    hooks = [h for b in blocks for h in (b.register_forward_pre_hook(enter),
                                         b.register_forward_hook(leave, always_call=True))]
    try:
        for owner, name, real in saved:
            setattr(owner, name, counting(real, name))
        yield reads
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)
        for h in hooks:
            h.remove()


def sweep_one(name: str, cls, tol: float) -> str:
    import fusebox

    if name not in TINY:
        return "skip (no inputs)"
    config, make_inputs = TINY[name]
    try:
        model = build(cls, config)
        try:
            patched = copy.deepcopy(model)
        except Exception:  # noqa: BLE001 - a model that does not copy is built again
            patched = build(cls, config)
        with host_reads_after_first_block(model) as reads_unpatched:
            ref = forward(model, make_inputs)
        if not ref:
            return "skip: no floating-point output"
    except Exception as e:  # noqa: BLE001
        return f"skip: the unpatched model does not run ({type(e).__name__}: {str(e)[:100]})"
    del model
    try:
        report = fusebox.patch(patched)
        with host_reads_after_first_block(patched) as reads_patched:
            out = forward(patched, make_inputs)
    except Exception as e:  # noqa: BLE001
        return f"FAIL {type(e).__name__}: {str(e)[:160]} ({where(e)})"
    err = max_rel_diff(out, ref)
    if not err <= tol:
        return f"MISMATCH max rel diff {err:.1e}"
    if report.num_patched == 0:
        return "untouched: no module fusebox recognizes"
    kinds = Counter(e.kind for e in report.patched)
    family = f" [{report.family}]" if report.family else ""
    fused = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
    reads = (f"; host reads in blocks after the first: {sum(reads_patched.values())} "
             f"(unpatched {sum(reads_unpatched.values())}): {dict(reads_patched)}"
             if reads_patched else "")
    return f"OK max rel diff {err:.1e}, {report.num_patched} modules{family}: {fused}{reads}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="classes to run (default: all)")
    ap.add_argument("--tol", type=float, default=TOL)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    classes = model_classes()
    if args.only:
        wanted = [n.lower() for n in args.only]
        classes = {k: v for k, v in classes.items()
                   if k in args.only or any(w in k.lower() for w in wanted)}
    print(f"diffusers {diffusers.__version__}, torch {torch.__version__}, {len(classes)} model classes")
    counts = Counter()
    width = max((len(k) for k in classes), default=0) + 1
    for name, cls in classes.items():
        start = time.perf_counter()
        line = sweep_one(name, cls, args.tol)
        counts[line.split()[0].rstrip(":")] += 1
        print(f"{name:{width}s} {line} ({time.perf_counter() - start:.1f}s)", flush=True)
        gc.collect()
    print("summary: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 1 if counts["MISMATCH"] or counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
