"""End-to-end timing of diffusers transformers (video and image DiTs).

Each model is built from its published ``transformer/config.json`` with random weights in the
benchmark dtype (``_keep_in_fp32_modules`` kept in fp32, as ``from_pretrained`` loads them) and
fed the inputs of one denoising step of a typical generation. One step is one transformer forward
under ``torch.inference_mode`` (two for Wan, whose pipeline runs the two CFG branches as separate
forwards); the run is ``steps`` of them.

Variants: ``eager``, ``patched`` (:func:`fusebox.patch`), ``compile`` (whole model),
``compile-regional`` (``compile_repeated_blocks``, else each block), ``graphs`` (the forward
captured once in a CUDA graph and replayed: no host time per launch), and ``patched+`` each of
those. The graph variants are opt-in (``--variants``).
Every variant's output is compared with eager's; the bf16 spread (bf16 eager vs the fp32 model of
the same weights) says how large a difference bf16 itself makes.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch

from ..suite import DTYPES
from . import common

DEFAULT_VARIANTS = ("eager", "patched", "compile", "compile-regional", "patched+compile",
                    "patched+compile-regional")
ALL_VARIANTS = DEFAULT_VARIANTS + ("graphs", "patched+graphs")
# whole-model compiles of 30-60 block models take minutes each: --quick keeps the regional ones
QUICK_VARIANTS = ("eager", "patched", "compile-regional", "patched+compile-regional")
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "layers")


@dataclass
class Spec:
    description: str
    cls: str                                  # diffusers class name
    config: Dict[str, object]                 # the published transformer/config.json
    inputs: Callable[..., dict]               # (device, dtype) -> forward kwargs
    workload: str
    steps: int = 30
    forwards_per_step: int = 1


def _randn(*shape, device, dtype, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def _gen():
    return torch.Generator().manual_seed(0)


# --------------------------------------------------------------------------- inputs


def _latent_inputs(latent_shape, text, timestep, text_dim=4096, **extra):
    """``(device, dtype) -> forward kwargs``: latents ``latent_shape`` ([B, ...]) and text states
    [B, text, text_dim] drawn from one seeded generator, the timestep (B copies of a number, or
    a ``(device, dtype, gen) -> tensor``), then ``extra`` in order (values, or such callables,
    drawn from the same generator)."""
    batch = latent_shape[0]

    def value(v, device, dtype, g):
        return v(device, dtype, g) if callable(v) else v

    def make(device, dtype):
        g = _gen()
        inputs = dict(
            hidden_states=_randn(*latent_shape, device=device, dtype=dtype, gen=g),
            encoder_hidden_states=_randn(batch, text, text_dim, device=device, dtype=dtype,
                                         gen=g))
        inputs["timestep"] = (value(timestep, device, dtype, g) if callable(timestep)
                              else torch.full((batch,), timestep, device=device))
        inputs.update({name: value(v, device, dtype, g) for name, v in extra.items()})
        return dict(inputs, return_dict=False)
    return make


def _drawn(*shape):
    """An extra input drawn from the generator, in the benchmark dtype."""
    return lambda device, dtype, g: _randn(*shape, device=device, dtype=dtype, gen=g)


def _filled(n, fill):
    """``n`` copies of ``fill`` in the benchmark dtype."""
    return lambda device, dtype, g: torch.full((n,), fill, device=device, dtype=dtype)


def _mask(batch, text, valid=None):
    """An fp32 text attention mask: 1 for the first ``valid`` tokens (all by default), 0 for the
    padding after them."""
    def make(device, dtype, g):
        mask = torch.zeros(batch, text, device=device)
        mask[:, :text if valid is None else valid] = 1
        return mask
    return make


def _ltx_inputs(frames, height, width, batch=2, text=128, channels=128, caption=4096):
    """LTX-Video latents: 8x temporal / 32x spatial VAE, batched CFG (batch 2)."""
    f, h, w = (frames - 1) // 8 + 1, height // 32, width // 32
    return _latent_inputs((batch, f * h * w, channels), text, 500.0, caption,
                          encoder_attention_mask=_mask(batch, text), num_frames=f, height=h,
                          width=w, rope_interpolation_scale=(8 / 25, 32, 32))


def _ltx2_inputs(frames, height, width, fps=24.0, batch=2, text=1024, caption=3840):
    """LTX-2 latents: the video as LTX-Video's (8x temporal / 32x spatial VAE, 128 channels), the
    audio at 25 latents a second (16 kHz, mel hop 160, 4x VAE; 8 channels x 16 mel bins), the
    text connectors' 1024 tokens for each stream, batched CFG (batch 2)."""
    f, h, w = (frames - 1) // 8 + 1, height // 32, width // 32
    audio = round(frames / fps * 25)
    return _latent_inputs((batch, f * h * w, 128), text, 500.0, caption,
                          audio_hidden_states=_drawn(batch, audio, 128),
                          audio_encoder_hidden_states=_drawn(batch, text, caption),
                          encoder_attention_mask=_mask(batch, text),
                          audio_encoder_attention_mask=_mask(batch, text), num_frames=f,
                          height=h, width=w, fps=fps, audio_num_frames=audio)


def _flux_image_ids(h, w):
    def ids(device, dtype, g):
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3)
        return img_ids.to(device=device, dtype=dtype)
    return ids


def _flux_inputs(size=1024, text=512):
    h = w = size // 16                     # 8x VAE, 2x2 packing
    return _latent_inputs(
        (1, h * w, 64), text, _filled(1, 0.5), pooled_projections=_drawn(1, 768),
        img_ids=_flux_image_ids(h, w),
        txt_ids=lambda device, dtype, g: torch.zeros(text, 3, device=device, dtype=dtype),
        guidance=_filled(1, 3.5))


def _chroma_inputs(size=1024, text=512, valid_text=300):
    """Chroma: FLUX.1's latents and ids without pooled projections or guidance, and the
    pipeline's attention mask over text + image tokens (T5 padding past ``valid_text`` plus one
    token, which Chroma keeps)."""
    h = w = size // 16

    def mask(device, dtype, g):
        m = torch.ones(1, text + h * w, device=device)
        m[:, valid_text + 1:text] = 0
        return m
    return _latent_inputs(
        (1, h * w, 64), text, _filled(1, 0.5), img_ids=_flux_image_ids(h, w),
        txt_ids=lambda device, dtype, g: torch.zeros(text, 3, device=device, dtype=dtype),
        attention_mask=mask)


def _flux2_inputs(size=1024, text=512):
    """FLUX.2: 32-channel latents at 1/8 packed 2x2 (128 channels), 4-axis positions (time,
    row, column, layer; text tokens count along the last), Mistral text states (3 layers of
    5120), guidance 4.0."""
    h = w = size // 16

    def img_ids(device, dtype, g):
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        zeros = torch.zeros_like(rows)
        return torch.stack([zeros, rows, cols, zeros], -1).reshape(-1, 4).to(device=device,
                                                                           dtype=dtype)

    def txt_ids(device, dtype, g):
        ids = torch.zeros(text, 4)
        ids[:, 3] = torch.arange(text)
        return ids.to(device=device, dtype=dtype)
    return _latent_inputs((1, h * w, 128), text, _filled(1, 0.5), 15360, img_ids=img_ids,
                          txt_ids=txt_ids, guidance=_filled(1, 4.0))


def _flux3_inputs(size=1024, text=160):
    """FLUX.3: FLUX.2's 128-channel packed latents, 4-axis positions (time, row, column, layer)
    with the image's rows and columns at half scale (the pipeline's ``image_rope_scale``) and
    the text counting along the last, Qwen3-VL states of 8 layers stacked (8 x 2560 = 20480) in
    a window the pipeline pads to a multiple of 80 tokens, a flow timestep in [0, 1]."""
    h = w = size // 16

    def img_ids(device, dtype, g):
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        zeros = torch.zeros_like(rows)
        ids = torch.stack([zeros, rows, cols, zeros], -1).reshape(-1, 4).float()
        ids[:, 1:3] *= 0.5
        return ids.to(device)

    def txt_ids(device, dtype, g):
        ids = torch.zeros(text, 4)
        ids[:, 3] = torch.arange(text)
        return ids.to(device)
    return _latent_inputs((1, h * w, 128), text, _filled(1, 0.5), 20480, img_ids=img_ids,
                          txt_ids=txt_ids)


def _video_latents(frames, height, width):
    """[1, 16, F, H, W] latents of a 4x temporal / 8x spatial VAE (Wan 2.1, HunyuanVideo)."""
    return 1, 16, (frames - 1) // 4 + 1, height // 8, width // 8


def _wan_inputs(frames, height, width, text=512):
    """Wan 2.1 latents, one CFG branch per forward."""
    return _latent_inputs(_video_latents(frames, height, width), text, 500.0)


def _skyreels_df_inputs(frames, height, width, text=512):
    """SkyReels-V2 diffusion forcing (synchronous): Wan 2.1 latents with a timestep per latent
    frame, so the blocks modulate per token."""
    latents = _video_latents(frames, height, width)
    per_frame = torch.linspace(900.0, 300.0, latents[2])
    return _latent_inputs(latents, text,
                          lambda device, dtype, g: per_frame[None].to(device),
                          enable_diffusion_forcing=True)


def _wan22_ti2v_inputs(frames, height, width, text=512):
    """Wan 2.2 TI2V: 48-channel latents of a 4x temporal / 16x spatial VAE and a timestep per
    token ([1, S], the pipeline's ``expand_timesteps``), the first latent frame's tokens at 0
    as image-to-video conditions them, so the blocks modulate per token."""
    latents = (1, 48, (frames - 1) // 4 + 1, height // 16, width // 16)
    per_frame = latents[3] // 2 * (latents[4] // 2)

    def timestep(device, dtype, g):
        t = torch.full((latents[2], per_frame), 700.0)
        t[0] = 0.0
        return t.reshape(1, -1).to(device)
    return _latent_inputs(latents, text, timestep)


def _hunyuan_inputs(frames, height, width, text=256):
    return _latent_inputs(_video_latents(frames, height, width), text, 500.0,
                          encoder_attention_mask=_mask(1, text),
                          pooled_projections=_drawn(1, 768), guidance=_filled(1, 6000.0))


def _hunyuan15_inputs(frames, height, width, text=1000, valid_text=128, glyph_text=256):
    """HunyuanVideo 1.5 text-to-video as the diffusers pipeline feeds it: 32-channel latents of
    a 4x temporal / 16x spatial VAE with the condition channels and mask (65), Qwen2.5-VL text
    states padded to the tokenizer's 1000 (``valid_text`` of them valid), ByT5 glyph states
    padded to 256 with none valid (a prompt without glyph text) and the all-zero SigLIP image
    states of text-to-video (729 tokens)."""
    latents = (1, 65, (frames - 1) // 4 + 1, height // 16, width // 16)
    # the timestep in the model's dtype: its embedding runs in the timestep's
    return _latent_inputs(latents, text, _filled(1, 500.0), 3584,
                          encoder_attention_mask=_mask(1, text, valid_text),
                          encoder_hidden_states_2=_drawn(1, glyph_text, 1472),
                          encoder_attention_mask_2=_mask(1, glyph_text, 0),
                          image_embeds=lambda device, dtype, g: torch.zeros(
                              1, 729, 1152, device=device, dtype=dtype))


def _hunyuan_image_inputs(size=2048, text=1000, valid_text=128, glyph_text=128):
    """HunyuanImage 2.1 text-to-image as the diffusers pipeline feeds it: 64-channel latents of a
    32x VAE, one CFG branch per forward (its guider splits them), Qwen2.5-VL text states padded
    to the tokenizer's 1000 (``valid_text`` of them valid) and ByT5 glyph states padded to 128
    with none valid (a prompt without quoted text)."""
    latents = (1, 64, size // 32, size // 32)
    # the timestep in the latents' dtype, as the pipeline hands it
    return _latent_inputs(latents, text, _filled(1, 500.0), 3584,
                          encoder_attention_mask=_mask(1, text, valid_text),
                          encoder_hidden_states_2=_drawn(1, glyph_text, 1472),
                          encoder_attention_mask_2=_mask(1, glyph_text, 0))


def _sd3_inputs(size=1024, text=333):
    """SD3.5: 16-channel latents at 1/8, batched CFG, 77 CLIP + 256 T5 tokens."""
    return _latent_inputs((2, 16, size // 8, size // 8), text, 500.0,
                          pooled_projections=_drawn(2, 2048))


def _qwen_image_inputs(size=1024, text=256):
    """Qwen-Image: 16-channel latents at 1/8 packed 2x2 (64 channels), one CFG branch per
    forward, Qwen2.5-VL text states (3584 wide) with their mask."""
    h = w = size // 16
    return _latent_inputs((1, h * w, 64), text, _filled(1, 0.5), 3584,
                          encoder_hidden_states_mask=_mask(1, text), img_shapes=[(1, h, w)])


def _z_image_inputs(size=1024, text=256):
    """Z-Image: one sample (Turbo runs without CFG), 16-channel latents at 1/8 as a list of
    ``[C, F, H, W]``, Qwen3-4B caption states (2560 wide)."""
    def make(device, dtype):
        g = _gen()
        return dict(x=[_randn(16, 1, size // 8, size // 8, device=device, dtype=dtype, gen=g)],
                    cap_feats=[_randn(text, 2560, device=device, dtype=dtype, gen=g)],
                    t=torch.full((1,), 0.5, device=device, dtype=dtype), return_dict=False)
    return make


def _pixart_inputs(size=1024, text=300):
    return _latent_inputs((2, 4, size // 8, size // 8), text, 500,   # an integer timestep
                          added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                          encoder_attention_mask=_mask(2, text))


def _mochi_inputs(frames, height, width, text=256, valid_text=64):
    """Mochi latents (12 channels, 6x temporal / 8x spatial VAE), batched CFG as the pipeline
    runs it: the negative prompt "" with no valid text token (the pipeline's all-False mask),
    then the prompt with its first ``valid_text``."""
    latents = (2, 12, (frames - 1) // 6 + 1, height // 8, width // 8)

    def mask(device, dtype, g):
        valid = torch.zeros(2, text, dtype=torch.bool, device=device)
        valid[1, :valid_text] = True
        return valid
    return _latent_inputs(latents, text, 500.0, encoder_attention_mask=mask)


def _krea2_inputs(size=1024, text=256, text_layers=12, text_dim=2560):
    """Krea 2: one sample (its pipeline runs CFG as two forwards), 64-channel packed latents (8x
    VAE, 2x2 patches), the text encoder's states of ``text_layers`` layers per token, and the
    pipeline's position ids (text at the origin, image tokens at their grid cells)."""
    grid = size // 16

    def make(device, dtype):
        g = _gen()
        positions = torch.zeros(text + grid * grid, 3, device=device)
        positions[text:, 1] = torch.arange(grid, device=device).repeat_interleave(grid)
        positions[text:, 2] = torch.arange(grid, device=device).repeat(grid)
        return dict(hidden_states=_randn(1, grid * grid, 64, device=device, dtype=dtype, gen=g),
                    encoder_hidden_states=_randn(1, text, text_layers, text_dim, device=device,
                                                 dtype=dtype, gen=g),
                    timestep=torch.full((1,), 0.5, device=device), position_ids=positions,
                    return_dict=False)
    return make


def _cogvideox_inputs(frames=49, height=480, width=720, batch=2, text=226):
    """CogVideoX 1.0 as its pipeline feeds it: 16-channel latents [B, F, C, H, W] of a 4x
    temporal / 8x spatial VAE, batched CFG (batch 2), T5 states padded to 226 tokens, and the
    pipeline's 3-D RoPE tables ([S, 64] cos and sin, fp32) for the 2x2 patch grid; at the
    model's base resolution (480x720) the grid's crop region is the whole grid."""
    f, h, w = (frames - 1) // 4 + 1, height // 8, width // 8

    def rotary(device, dtype, g):
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        grid = (h // 2, w // 2)
        return get_3d_rotary_pos_embed(64, ((0, 0), grid), grid, f, device=torch.device(device))
    return _latent_inputs((batch, f, 16, h, w), text, 500.0, image_rotary_emb=rotary)


# --------------------------------------------------------------------------- models

LTX_CONFIG = dict(  # Lightricks/LTX-Video (0.9.x, 2B)
    in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
    attention_head_dim=64, cross_attention_dim=2048, num_layers=28,
    activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6,
    caption_channels=4096, attention_bias=True, attention_out_bias=True)
LTX2_CONFIG = dict(  # Lightricks/LTX-2 (2.0, 19B): scripts/convert_ltx2_to_diffusers.py's "2.0"
    in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
    attention_head_dim=128, cross_attention_dim=4096, vae_scale_factors=(8, 32, 32),
    pos_embed_max_pos=20, base_height=2048, base_width=2048, audio_in_channels=128,
    audio_out_channels=128, audio_patch_size=1, audio_patch_size_t=1,
    audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=2048,
    audio_scale_factor=4, audio_pos_embed_max_pos=20, audio_sampling_rate=16000,
    audio_hop_length=160, num_layers=48, activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6,
    caption_channels=3840, attention_bias=True, attention_out_bias=True, rope_theta=10000.0,
    rope_double_precision=True, causal_offset=1, timestep_scale_multiplier=1000,
    cross_attn_timestep_scale_multiplier=1000, rope_type="split")
WAN_BASE = dict(  # Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers
    patch_size=[1, 2, 2], attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
    freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
    image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024)

SPECS: Dict[str, Spec] = {
    "ltx-video": Spec(
        "LTX-Video 0.9 2B, 49x512x768 (2688 tokens), CFG batch 2, 30 steps",
        "LTXVideoTransformer3DModel", LTX_CONFIG, _ltx_inputs(49, 512, 768),
        "49 frames 512x768 -> latent 7x16x24 = 2688 tokens x 128 ch, batch 2 (CFG), text 128",
        steps=30),
    "ltx-2": Spec(
        "LTX-2 19B (video + audio), 121x512x768 at 24 fps (6144 video + 126 audio tokens), "
        "CFG batch 2, 30 steps",
        "LTX2VideoTransformer3DModel", LTX2_CONFIG, _ltx2_inputs(121, 512, 768),
        "121 frames 512x768 -> latent 16x16x24 = 6144 video tokens + 126 audio tokens x 128 ch, "
        "batch 2 (CFG), text 1024 per stream; the pipeline's guidance forwards (STG, modality) "
        "not counted", steps=30),
    "flux-dev": Spec(
        "FLUX.1-dev 12B, 1024x1024 (4096 image + 512 text tokens), 28 steps",
        "FluxTransformer2DModel",
        dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
             attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
             pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=[16, 56, 56]),
        _flux_inputs(), "1024x1024 -> 4096 image tokens + 512 text, guidance 3.5, batch 1",
        steps=28),
    "chroma1-hd": Spec(
        "Chroma1-HD 8.9B, 1024x1024 (4096 image + 512 text tokens, 300 of them valid), 40 steps",
        "ChromaTransformer2DModel",
        dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
             attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
             axes_dims_rope=[16, 56, 56], approximator_num_channels=64,
             approximator_hidden_dim=5120, approximator_layers=5),
        _chroma_inputs(), "1024x1024 -> 4096 image tokens + 512 text (300 valid), batch 1",
        steps=40),
    "flux2-dev": Spec(
        "FLUX.2-dev 32B, 1024x1024 (4096 image + 512 text tokens), 50 steps",
        "Flux2Transformer2DModel",
        dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48,
             attention_head_dim=128, num_attention_heads=48, joint_attention_dim=15360,
             timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=[32, 32, 32, 32],
             rope_theta=2000, eps=1e-6, guidance_embeds=True),
        _flux2_inputs(), "1024x1024 -> 4096 image tokens + 512 text, guidance 4.0, batch 1",
        steps=50),
    "flux3": Spec(
        "FLUX.3 (5.5B), 1024x1024 (4096 image + 160 text tokens), CFG as 2 forwards, 50 steps",
        "Flux3Transformer2DModel",
        # the class's (documented) defaults: 5 per-mode blocks per token mode, 28 joint blocks,
        # 24 x 128 heads, text width 20480 = the pipeline's 8 stacked Qwen3-VL layers x 2560
        dict(in_channels=128, cond_in_channels=128, num_layers=5, num_single_layers=28,
             attention_head_dim=128, num_attention_heads=24, joint_attention_dim=20480,
             timestep_channels=256, mlp_ratio=3.0, axes_dims_rope=[32, 32, 32, 32],
             rope_theta=10000, eps=1e-6, flow_map=False),
        _flux3_inputs(), "1024x1024 -> 4096 image tokens + 160 text (a window of 2 x 80), "
        "text-to-image, batch 1", steps=50, forwards_per_step=2),
    "wan-1.3b": Spec(
        "Wan2.1-T2V-1.3B, 81x480x832 (32760 tokens), CFG as 2 forwards, 50 steps",
        "WanTransformer3DModel",
        dict(WAN_BASE, num_attention_heads=12, ffn_dim=8960, num_layers=30),
        _wan_inputs(81, 480, 832),
        "81 frames 480x832 -> latent 21x60x104 -> 32760 tokens, text 512",
        steps=50, forwards_per_step=2),
    "skyreels-v2-df-1.3b": Spec(
        "SkyReels-V2-DF-1.3B-540P, 97x544x960 (51000 tokens), a timestep per latent frame, "
        "CFG as 2 forwards, 30 steps",
        "SkyReelsV2Transformer3DModel",
        dict(WAN_BASE, num_attention_heads=12, ffn_dim=8960, num_layers=30, pos_embed_seq_len=None,
             inject_sample_info=False, num_frame_per_block=1),
        _skyreels_df_inputs(97, 544, 960),
        "97 frames 544x960 -> latent 25x68x120 -> 51000 tokens, text 512, diffusion forcing "
        "(per-frame timesteps)", steps=30, forwards_per_step=2),
    "wan2.2-ti2v-5b": Spec(
        "Wan2.2-TI2V-5B, 121x704x1280 (27280 tokens), a timestep per token, CFG as 2 forwards, "
        "50 steps",
        "WanTransformer3DModel",
        dict(WAN_BASE, in_channels=48, out_channels=48, num_attention_heads=24, ffn_dim=14336,
             num_layers=30),
        _wan22_ti2v_inputs(121, 704, 1280),
        "121 frames 704x1280 -> latent 31x44x80 -> 27280 tokens, text 512, per-token timesteps "
        "(first frame at 0)", steps=50, forwards_per_step=2),
    "wan-14b": Spec(
        "Wan2.1-T2V-14B, 81x480x832 (32760 tokens), CFG as 2 forwards, 50 steps",
        "WanTransformer3DModel",
        dict(WAN_BASE, num_attention_heads=40, ffn_dim=13824, num_layers=40),
        _wan_inputs(81, 480, 832), "81 frames 480x832 (480p) -> 32760 tokens, text 512",
        steps=50, forwards_per_step=2),
    "hunyuan-video": Spec(
        "HunyuanVideo 13B, 17x720x1280 (18000 tokens), 50 steps",
        "HunyuanVideoTransformer3DModel",
        dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128,
             num_layers=20, num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0,
             patch_size=2, patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True,
             text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0,
             rope_axes_dim=[16, 56, 56]),
        _hunyuan_inputs(17, 720, 1280),
        "17 frames 720x1280 -> latent 5x90x160 -> 18000 tokens + 256 text (129 frames, 118800 "
        "tokens, is the pipeline default; fewer frames keep a step near a second)",
        steps=50),
    "hunyuan-video-1.5": Spec(
        "HunyuanVideo 1.5 8.3B, text-to-video 33x480x848 (14310 tokens), pipeline-padded text, "
        "50 steps",
        "HunyuanVideo15Transformer3DModel",
        dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128,
             num_layers=54, num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1,
             qk_norm="rms_norm", text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152,
             rope_theta=256.0, rope_axes_dim=[16, 56, 56], target_size=640, task_type="t2v",
             use_meanflow=False),
        _hunyuan15_inputs(33, 480, 848),
        "33 frames 480x848 -> latent 9x30x53 -> 14310 tokens + 1000 text (128 valid) + 256 glyph "
        "(none valid) + 729 image (all zero: text-to-video), padded as the pipeline pads them "
        "(121 frames, 49290 tokens, is the pipeline default)", steps=50),
    "hunyuan-image-2.1": Spec(
        "HunyuanImage 2.1 17B, 2048x2048 (4096 image tokens), pipeline-padded text, CFG as 2 "
        "forwards, 50 steps",
        "HunyuanImageTransformer2DModel",
        # diffusers' conversion script's config of the released base model
        dict(in_channels=64, out_channels=64, num_attention_heads=28, attention_head_dim=128,
             num_layers=20, num_single_layers=40, num_refiner_layers=2, patch_size=[1, 1],
             qk_norm="rms_norm", guidance_embeds=False, text_embed_dim=3584,
             text_embed_2_dim=1472, rope_theta=256.0, rope_axes_dim=[64, 64]),
        _hunyuan_image_inputs(),
        "2048x2048 -> latent 64x64 -> 4096 tokens + 1000 text (128 valid) + 128 glyph (none "
        "valid), padded as the pipeline pads them, batch 1", steps=50, forwards_per_step=2),
    "sd3.5-large": Spec(
        "Stable Diffusion 3.5 Large 8B, 1024x1024 (4096 tokens), CFG batch 2, 28 steps",
        "SD3Transformer2DModel",
        dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
             num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
             pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192,
             dual_attention_layers=[], qk_norm="rms_norm"),
        _sd3_inputs(), "1024x1024 -> 4096 tokens + 333 text (77 CLIP + 256 T5), batch 2 (CFG)",
        steps=28),
    "qwen-image": Spec(
        "Qwen-Image 20B, 1024x1024 (4096 image + 256 text tokens), CFG as 2 forwards, 50 steps",
        "QwenImageTransformer2DModel",
        dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
             num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
             axes_dims_rope=[16, 56, 56]),
        _qwen_image_inputs(), "1024x1024 -> 4096 image tokens + 256 text, batch 1",
        steps=50, forwards_per_step=2),
    "z-image-turbo": Spec(
        "Z-Image-Turbo 6B, 1024x1024 (4096 image + 256 caption tokens), 8 steps",
        "ZImageTransformer2DModel",
        dict(all_patch_size=[2], all_f_patch_size=[1], in_channels=16, dim=3840, n_layers=30,
             n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True,
             cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48],
             axes_lens=[1536, 512, 512]),
        _z_image_inputs(), "1024x1024 -> 4096 image tokens + 256 caption, batch 1", steps=8),
    "krea-2": Spec(
        "Krea 2 (28 blocks, 6144 wide), 1024x1024 (4096 image + 256 text tokens), CFG as 2 "
        "forwards, 28 steps",
        "Krea2Transformer2DModel",
        # the class's defaults, which diffusers documents as the released model's
        dict(in_channels=64, num_layers=28, attention_head_dim=128, num_attention_heads=48,
             num_key_value_heads=12, intermediate_size=16384, timestep_embed_dim=256,
             text_hidden_dim=2560, num_text_layers=12, text_num_attention_heads=20,
             text_num_key_value_heads=20, text_intermediate_size=6912,
             num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=[32, 48, 48],
             rope_theta=1000.0, norm_eps=1e-5),
        _krea2_inputs(), "1024x1024 -> 4096 image tokens + 256 text (12 encoder layers each), "
        "batch 1", steps=28, forwards_per_step=2),
    "pixart-sigma": Spec(
        "PixArt-Sigma XL-2 1024 (0.6B), 1024x1024 (4096 tokens), CFG batch 2, 20 steps",
        "PixArtTransformer2DModel",
        dict(activation_fn="gelu-approximate", attention_bias=True, attention_head_dim=72,
             attention_type="default", caption_channels=4096, cross_attention_dim=1152,
             double_self_attention=False, dropout=0.0, in_channels=4, interpolation_scale=2,
             norm_elementwise_affine=False, norm_eps=1e-6, norm_num_groups=32,
             norm_type="ada_norm_single", num_attention_heads=16, num_embeds_ada_norm=1000,
             num_layers=28, only_cross_attention=False, out_channels=8, patch_size=2,
             sample_size=128, upcast_attention=False, use_additional_conditions=False,
             use_linear_projection=False),
        _pixart_inputs(), "1024x1024 -> 4096 tokens, text 300, batch 2 (CFG)", steps=20),
    "mochi-1-preview": Spec(
        "Mochi 1 preview 10B, 19x480x848 (6360 tokens), CFG batch 2, 64 steps",
        "MochiTransformer3DModel",
        dict(patch_size=2, num_attention_heads=24, attention_head_dim=128, num_layers=48,
             pooled_projection_dim=1536, in_channels=12, out_channels=None, qk_norm="rms_norm",
             text_embed_dim=4096, time_embed_dim=256, activation_fn="swiglu",
             max_sequence_length=256),
        _mochi_inputs(19, 480, 848),
        "19 frames 480x848 (the pipeline defaults) -> latent 4x60x106 -> 6360 tokens, text 256 "
        "(64 valid in the prompt, none in the negative one), batch 2 (CFG)", steps=64),
    "cogvideox-5b": Spec(
        "CogVideoX-5B, 49x480x720 (17550 video + 226 text tokens), CFG batch 2, 50 steps",
        "CogVideoXTransformer3DModel",
        # THUDM/CogVideoX-5b transformer/config.json
        dict(activation_fn="gelu-approximate", attention_bias=True, attention_head_dim=64,
             dropout=0.0, flip_sin_to_cos=True, freq_shift=0, in_channels=16,
             max_text_seq_length=226, norm_elementwise_affine=True, norm_eps=1e-5,
             num_attention_heads=48, num_layers=42, out_channels=16, patch_size=2,
             sample_frames=49, sample_height=60, sample_width=90, spatial_interpolation_scale=1.875,
             temporal_compression_ratio=4, temporal_interpolation_scale=1.0, text_embed_dim=4096,
             time_embed_dim=512, timestep_activation_fn="silu",
             use_rotary_positional_embeddings=True, use_learned_positional_embeddings=False),
        _cogvideox_inputs(),
        "49 frames 480x720 -> latent 13x60x90 -> 13x30x45 = 17550 tokens + 226 text, batch 2 "
        "(CFG)", steps=50),
    "tiny-dit": Spec(
        "tiny LTX-Video (2 layers, width 32): a functional run, CPU included",
        "LTXVideoTransformer3DModel",
        dict(LTX_CONFIG, in_channels=8, out_channels=8, num_attention_heads=2,
             attention_head_dim=16, cross_attention_dim=32, caption_channels=32, num_layers=2),
        _ltx_inputs(17, 96, 128, text=8, channels=8, caption=32),
        "17 frames 96x128 -> latent 3x3x4 = 36 tokens, batch 2, text 8", steps=4),
}

MODELS = {name: spec.description for name, spec in SPECS.items()}


# --------------------------------------------------------------------------- building


def keep_fp32_modules(model: torch.nn.Module) -> torch.nn.Module:
    """Puts the modules and parameters a model names in ``_keep_in_fp32_modules`` back in fp32,
    as ``from_pretrained(torch_dtype=...)`` leaves them."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    for name, module in model.named_modules():
        if keep & set(name.split(".")):
            module.float()
    for name, param in model.named_parameters():
        if name.split(".")[-1] in keep:
            param.data = param.data.float()
    return model


@contextlib.contextmanager
def _default_dtype(dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def build(spec: Spec, device, dtype) -> torch.nn.Module:
    """The model with random weights created in ``dtype`` on ``device`` (a 14B model never
    exists in fp32)."""
    import diffusers

    cls = getattr(diffusers, spec.cls)
    # config.json keys the class does not take are ignored, as from_pretrained ignores them
    accepted = inspect.signature(cls.__init__).parameters
    config = {k: v for k, v in spec.config.items() if k in accepted}
    torch.manual_seed(0)
    with _default_dtype(dtype), torch.device(device):
        model = cls(**config)
    return keep_fp32_modules(model.to(device=device, dtype=dtype).eval())


def _output(out):
    out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)
    return torch.stack(out) if isinstance(out, list) else out   # Z-Image: a tensor per sample


def _block_modules(model) -> List[torch.nn.Module]:
    return [b for name in BLOCK_LISTS for b in getattr(model, name, None) or []]


def graphed(model, inputs: dict, device) -> Callable[[], torch.Tensor]:
    """One forward on ``inputs`` captured in a CUDA graph (after warm-up forwards on a side
    stream, as capture requires); returns a call that replays it and gives its output."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            _output(model(**inputs))
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _output(model(**inputs))

    def replay():
        graph.replay()
        return out

    return replay


@contextlib.contextmanager
def compiled(model, mode: str, fullgraph: bool):
    """Yields the callable of a compile mode ("" eager, "compile", "compile-regional"), undoing
    regional compilation afterwards."""
    if not mode:
        yield model
        return
    if mode == "compile":
        yield torch.compile(model, fullgraph=fullgraph)
        return
    try:
        if getattr(model, "_repeated_blocks", None):
            model.compile_repeated_blocks(fullgraph=fullgraph)
        else:
            for block in _block_modules(model):
                block.compile(fullgraph=fullgraph)
        yield model
    finally:
        for module in model.modules():
            module._compiled_call_impl = None


# --------------------------------------------------------------------------- variants


def _time_graphed(model, inputs, device, quick, rec):
    """(timing, output) of replaying one captured forward."""
    if device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    with torch.inference_mode():
        t0 = time.perf_counter()
        call = graphed(model, inputs, device)
        rec["capture_s"] = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        warmup, iters = (1, 3) if quick else (3, 10)
        t = common.time_ms(call, device, warmup=warmup, iters=iters)
        rec["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        return t, call().clone()


def _time_compiled(model, inputs, mode, device, quick, rec):
    """(timing, output) of the forward under a compile mode ("" eager); a compile that breaks
    the graph under ``fullgraph=True`` is retried without it (the error is recorded)."""
    for fullgraph in ((True, False) if mode else (True,)):
        try:
            with compiled(model, mode, fullgraph) as fn, torch.inference_mode():
                call = lambda: _output(fn(**inputs))  # noqa: E731
                t0 = time.perf_counter()
                out = call()
                common.sync(device)
                if mode:
                    rec["compile_s"] = time.perf_counter() - t0
                    rec["fullgraph"] = int(fullgraph)
                warmup, iters = (1, 3) if quick else (3, 10)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t = common.time_ms(call, device, warmup=warmup, iters=iters)
                if device.type == "cuda":
                    rec["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
                return t, out
        except Exception as e:  # noqa: BLE001  (a graph break under fullgraph: retry without)
            if not fullgraph or not mode:
                raise
            rec["fullgraph_error"] = common.error_text(e)
            torch._dynamo.reset()
    raise AssertionError("unreachable")


def _timing_fields(forward_ms: float, forward_min_ms: float, spec: Spec) -> Dict[str, float]:
    step_ms = forward_ms * spec.forwards_per_step
    return dict(forward_ms=forward_ms, forward_min_ms=forward_min_ms, step_ms=step_ms,
                run_s=step_ms * spec.steps / 1e3, steps_per_s=1e3 / step_ms)


def _merge_rounds(recs: List[dict], spec: Spec) -> dict:
    """One variant's record over several rounds (:func:`common.merge_rounds` of the forward
    time), the step times derived from the median forward, the fastest forward of any round."""
    merged = common.merge_rounds(recs, ("forward_ms",))
    if "forward_ms_rounds" in merged:
        merged.update(_timing_fields(merged["forward_ms"],
                                     min(r["forward_min_ms"] for r in recs if "forward_ms" in r),
                                     spec))
    return merged


def _run_variant(model, inputs, variant, spec, device, quick, eager_out):
    import fusebox

    patched = variant.startswith("patched")
    mode = variant.split("+", 1)[1] if "+" in variant else ("" if variant in ("eager", "patched")
                                                           else variant)
    rec: Dict[str, object] = {}
    torch._dynamo.reset()
    if patched:
        report = fusebox.patch(model)
        rec["modules_patched"] = report.num_patched
        rec["patch_summary"] = report.summary()
    try:
        if mode == "graphs":
            t, out = _time_graphed(model, inputs, device, quick, rec)
        else:
            t, out = _time_compiled(model, inputs, mode, device, quick, rec)
        rec.update(_timing_fields(t["median_ms"], t["min_ms"], spec))
        if eager_out is not None:
            rec["rel_diff_vs_eager"] = common.rel_diff(out.float(), eager_out.float())
        return rec, out
    finally:
        if patched:
            fusebox.unpatch(model)


def _variants(args) -> List[str]:
    if args.variants is None:
        return list(QUICK_VARIANTS if args.quick else DEFAULT_VARIANTS)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in ALL_VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {list(ALL_VARIANTS)}")
    if "eager" in names:      # eager first: the others are compared with it
        names.remove("eager")
    return ["eager"] + names


# --------------------------------------------------------------------------- bf16 spread


def _truncate_blocks(model, keep: float) -> int:
    """Keeps the first ``keep`` fraction of every block list; returns the blocks left."""
    left = 0
    for name in BLOCK_LISTS:
        blocks = getattr(model, name, None)
        if blocks is None or len(blocks) == 0:
            continue
        n = max(1, int(len(blocks) * keep))
        setattr(model, name, torch.nn.ModuleList(list(blocks)[:n]))
        left += n
    return left


def _to_float(value):
    if isinstance(value, list):
        return [_to_float(v) for v in value]
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value


def bf16_spread(model, inputs, eager_out, device) -> Dict[str, object]:
    """``rel_diff(bf16 eager, fp32 eager)`` with the same weights (bf16 values are exact in
    fp32). Converts ``model`` to fp32 in place; where that does not fit in GPU memory the spread
    is measured on the first blocks only, and the result says how many."""
    total = len(_block_modules(model))
    out: Dict[str, object] = {"spread_blocks": total, "blocks": total}
    if torch.device(device).type == "cuda":
        params = sum(p.numel() for p in model.parameters())
        free, _ = torch.cuda.mem_get_info()
        extra_needed = params * 2 + (4 << 30)       # bf16 -> fp32 doubles the weights, + margin
        if extra_needed > free:
            keep = max(0.05, (free - (4 << 30)) / (params * 4))
            out["spread_blocks"] = _truncate_blocks(model, min(keep, 1.0))
            with torch.inference_mode():
                eager_out = _output(model(**inputs))
    model.float()
    with torch.inference_mode():
        ref = _output(model(**{k: _to_float(v) for k, v in inputs.items()}))
    out["bf16_spread"] = common.rel_diff(eager_out.float(), ref)
    return out


# --------------------------------------------------------------------------- pipeline

LTX_SCHEDULER = dict(  # Lightricks/LTX-Video scheduler/scheduler_config.json
    base_image_seq_len=1024, base_shift=0.95, invert_sigmas=False, max_image_seq_len=4096,
    max_shift=2.05, num_train_timesteps=1000, shift=1.0, shift_terminal=0.1,
    use_dynamic_shifting=True)
PIPELINE_VIDEO = {"ltx-video": (49, 512, 768), "tiny-dit": (17, 96, 128)}


def _ltx_pipeline(spec: Spec, device, dtype):
    """LTXPipeline with the benchmark transformer, a random-weight VAE of the released layout (a
    narrow one for ``tiny-dit``) and a 2-layer random T5 encoder (no tokenizer: prompts are random
    token ids, encoded by the pipeline's text encoder outside the timed denoising loop)."""
    import diffusers
    from transformers import T5Config, T5EncoderModel

    transformer = build(spec, device, dtype)
    width = spec.config["caption_channels"]
    vae_config = {} if spec.config["in_channels"] == 128 else dict(
        latent_channels=spec.config["in_channels"], block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1))
    torch.manual_seed(0)
    with _default_dtype(dtype), torch.device(device):
        vae = diffusers.AutoencoderKLLTXVideo(**vae_config)
        text_encoder = T5EncoderModel(T5Config(vocab_size=32128, d_model=width, d_kv=64, d_ff=1024,
                                               num_layers=2, num_heads=8))
    pipe = diffusers.LTXPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**LTX_SCHEDULER),
        vae=vae.to(device=device, dtype=dtype).eval(),
        text_encoder=text_encoder.to(device=device, dtype=dtype).eval(), tokenizer=None,
        transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _prompt_embeds(pipe, device, text=128):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32128, (2, text), generator=g).to(device)
    mask = torch.ones(2, text, dtype=torch.long, device=device)
    with torch.inference_mode():
        embeds = pipe.text_encoder(ids, attention_mask=mask)[0]
    return dict(prompt_embeds=embeds[:1], prompt_attention_mask=mask[:1],
                negative_prompt_embeds=embeds[1:], negative_prompt_attention_mask=mask[1:])


def _write_video(frames, path_stem: str) -> str:
    """mp4 when imageio can write one, else an animated GIF (Pillow, a diffusers dependency)."""
    import numpy as np

    try:
        from diffusers.utils import export_to_video

        return export_to_video(list(frames), path_stem + ".mp4", fps=25)
    except Exception:  # noqa: BLE001  (no imageio/ffmpeg)
        from PIL import Image

        images = [Image.fromarray((np.clip(f, 0, 1) * 255).round().astype(np.uint8)) for f in frames]
        images[0].save(path_stem + ".gif", save_all=True, append_images=images[1:], duration=40, loop=0)
        return path_stem + ".gif"


def run_pipeline(name: str, args, rec: dict) -> None:
    """Full LTX-Video pipeline (text encoder, denoising loop with batched CFG, VAE decode),
    unpatched then patched; writes the patched run's video next to the results."""
    import os

    import fusebox

    if name not in PIPELINE_VIDEO:
        rec["summary"]["pipeline"] = "pipeline mode covers LTX-Video (ltx-video, tiny-dit)"
        return
    spec, device, dtype = SPECS[name], torch.device(args.device), DTYPES[args.dtype]
    frames, height, width = PIPELINE_VIDEO[name]
    steps = 4 if args.quick else spec.steps
    pipe = _ltx_pipeline(spec, device, dtype)
    prompt = _prompt_embeds(pipe, device)
    out_dir = args.out or common.default_out_dir()
    os.makedirs(out_dir, exist_ok=True)
    for variant in ("eager", "patched"):
        if variant == "patched":
            fusebox.patch(pipe)
        call = lambda: pipe(**prompt, height=height, width=width, num_frames=frames,  # noqa: E731
                            num_inference_steps=steps, guidance_scale=3.0, output_type="np",
                            generator=torch.Generator().manual_seed(0)).frames[0]
        call()                                           # warm-up
        common.sync(device)
        t0 = time.perf_counter()
        video = call()
        common.sync(device)
        rec["variants"][f"pipeline:{variant}"] = {"pipeline_s": time.perf_counter() - t0,
                                                  "pipeline_steps": steps}
    rec["summary"]["video"] = _write_video(video, os.path.join(out_dir, f"{name}_patched"))
    fusebox.unpatch(pipe)


# --------------------------------------------------------------------------- run


def run(name: str, args) -> dict:
    spec = SPECS[name]
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    rec = {"model": name, "description": spec.description, "variants": {},
           "summary": {"workload": spec.workload, "dtype": args.dtype, "steps": spec.steps,
                       "forwards_per_step": spec.forwards_per_step}}
    model = build(spec, device, dtype)
    backend = getattr(args, "attention_backend", None)
    if backend:  # before any variant: the patched processors share it with the originals
        model.set_attention_backend(backend)
        rec["summary"]["attention_backend"] = backend
    inputs = spec.inputs(device, dtype)
    rec["summary"]["params_b"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 3)
    # Rounds after the first run the variants in the reverse order: a variant's place in the
    # run moved its time by a few percent (FLUX.3 on an H100, 2.5-4.6%, cause not settled:
    # bench/results/2026-12-05_h100_9f0ad78/).
    order, rounds = _variants(args), getattr(args, "rounds", 1)
    per_round: Dict[str, List[dict]] = {v: [] for v in order}
    eager_out = None
    for r in range(rounds):
        if rounds > 1:
            print(f"  round {r + 1} of {rounds}", flush=True)
        for variant in order if r % 2 == 0 else order[::-1]:
            against = None if variant == "eager" else eager_out
            variant_rec, out = common.run_guarded(
                variant, device,
                lambda: _run_variant(model, inputs, variant, spec, device, args.quick, against))
            per_round[variant].append(variant_rec)
            if variant == "eager" and eager_out is None:
                eager_out = out
    for variant, recs in per_round.items():
        rec["variants"][variant] = _merge_rounds(recs, spec)
    if rounds > 1:
        rec["summary"]["rounds"] = f"{rounds}, every other one in reverse order; forward_ms is the median"
    torch._dynamo.reset()
    if eager_out is not None and dtype != torch.float32:
        try:
            rec["summary"].update(bf16_spread(model, inputs, eager_out, device))
        except Exception as e:  # noqa: BLE001
            rec["summary"]["bf16_spread_error"] = common.error_text(e)
    eager = rec["variants"].get("eager", {})
    for variant, v in rec["variants"].items():
        if variant != "eager" and v.get("step_ms") and eager.get("step_ms"):
            v["speedup_vs_eager"] = eager["step_ms"] / v["step_ms"]
    del model
    common.release(device)
    if args.pipeline:
        run_pipeline(name, args, rec)
    return rec


def profile_target(name: str, device, dtype):
    """(model, call) for scripts/profile_e2e.py: the benchmark model and one forward on its
    inputs."""
    spec = SPECS[name]
    model = build(spec, device, dtype)
    inputs = spec.inputs(device, dtype)
    return model, lambda: _output(model(**inputs))
