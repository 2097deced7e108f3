"""fusebox.patch on diffusers image transformers (FLUX.1, FLUX.2, FLUX.3, SD3, PixArt,
Qwen-Image, Z-Image) and HunyuanVideo, plus the
generic diffusers modules every model gets (a DiT with no family patcher, single modules).

Tiny random configs; each model is compared with its own unpatched forward on the same inputs.
"""

import copy
import importlib
import inspect
from collections import Counter

import pytest
import torch

pytest.importorskip("diffusers")

import fusebox  # noqa: E402
from diffusers import (  # noqa: E402
    ChromaTransformer2DModel,
    DiTTransformer2DModel,
    Flux2Transformer2DModel,
    Flux3Transformer2DModel,
    FluxTransformer2DModel,
    HunyuanVideo15Transformer3DModel,
    HunyuanVideoFramepackTransformer3DModel,
    HunyuanVideoTransformer3DModel,
    LongCatImageTransformer2DModel,
    OvisImageTransformer2DModel,
    BriaFiboTransformer2DModel,
    PixArtTransformer2DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
)
from diffusers.models.attention import FeedForward  # noqa: E402
from diffusers.models.normalization import (  # noqa: E402
    AdaLayerNormContinuous,
    FP32LayerNorm,
    RMSNorm,
)
from fusebox.patch import _common  # noqa: E402
from fusebox.patch.dit import _modules  # noqa: E402
from helpers import (  # noqa: E402
    FuseboxOps,
    GraphOps,
    assert_patch_falls_back,
    assert_close,
    assert_unpatch_keeps_hooks,
    offload_and_patch,
    poison_allocator,
    rel_err,
)

B = 2


# --------------------------------------------------------------------------- tiny models


def _flux_inputs(**extra):
    """12 image tokens on a 3x4 grid and 5 text tokens (positions not all 0), FLUX.1's 3-axis
    ids."""
    img_ids = torch.stack([torch.zeros(12), torch.arange(12) // 4, torch.arange(12) % 4], 1)
    txt_ids = torch.stack([torch.arange(5.0), torch.zeros(5), torch.zeros(5)], 1)
    return dict(hidden_states=torch.randn(B, 12, 8), encoder_hidden_states=torch.randn(B, 5, 32),
                timestep=torch.tensor([0.2, 0.9]), img_ids=img_ids, txt_ids=txt_ids, **extra)


# the widths of every tiny FLUX-style model (FLUX.1 and the models that copy its blocks)
FLUX_TINY = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2,
                 attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                 axes_dims_rope=(4, 6, 6))


def _flux():
    model = FluxTransformer2DModel(**FLUX_TINY, pooled_projection_dim=16, guidance_embeds=True)
    return model, _flux_inputs(pooled_projections=torch.randn(B, 16),
                               guidance=torch.full((B,), 3.5))


def _longcat_image():
    """LongCat-Image: FLUX's blocks and attention copied under its own class names."""
    return LongCatImageTransformer2DModel(**FLUX_TINY, pooled_projection_dim=16), _flux_inputs()


def _ovis_image():
    """Ovis-Image: FLUX's double-stream blocks and attention; its single-stream blocks gate
    their MLP (SwiGLU) and keep their forward."""
    return OvisImageTransformer2DModel(**FLUX_TINY, out_channels=8), _flux_inputs()


def _bria_fibo():
    """Bria FIBO: FLUX's double-stream blocks and attention, a text-encoder layer per block."""
    model = BriaFiboTransformer2DModel(**FLUX_TINY, text_encoder_dim=24)
    return model, _flux_inputs(text_encoder_layers=[torch.randn(B, 5, 24) for _ in range(4)])


def _flux2():
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, timestep_guidance_channels=16,
        axes_dims_rope=(4, 4, 4, 4))
    img_ids = torch.stack([torch.zeros(12), torch.zeros(12), torch.arange(12) // 4,
                           torch.arange(12) % 4], 1)
    txt_ids = torch.stack([torch.zeros(5), torch.zeros(5), torch.zeros(5), torch.arange(5.0)], 1)
    inputs = dict(hidden_states=torch.randn(B, 12, 8), encoder_hidden_states=torch.randn(B, 5, 32),
                  timestep=torch.tensor([0.2, 0.9]), img_ids=img_ids, txt_ids=txt_ids,
                  guidance=torch.full((B,), 3.5))
    return model, inputs


def _flux3():
    """FLUX.3 with reference-image tokens (three token modes), q/k norm weights off their init;
    the per-token modulation comes from random projections (no zero init)."""
    model = Flux3Transformer2DModel(
        in_channels=8, cond_in_channels=8, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
        timestep_channels=16, axes_dims_rope=(4, 4, 4, 4))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    # (t, h, w, l) positions: image and reference grids (the reference at l = -1), text along l
    img_ids = torch.stack([torch.zeros(12), torch.arange(12) // 4, torch.arange(12) % 4,
                           torch.zeros(12)], 1)
    cond_ids = torch.stack([torch.zeros(6), torch.arange(6) // 3, torch.arange(6) % 3,
                            -torch.ones(6)], 1)
    txt_ids = torch.stack([torch.zeros(5), torch.zeros(5), torch.zeros(5), torch.arange(5.0)], 1)
    inputs = dict(hidden_states=torch.randn(B, 12, 8), encoder_hidden_states=torch.randn(B, 5, 32),
                  timestep=torch.tensor([0.2, 0.9]), img_ids=img_ids, txt_ids=txt_ids,
                  image_cond_hidden_states=torch.randn(B, 6, 8), image_cond_ids=cond_ids)
    return model, inputs


def _chroma():
    """FLUX's attention and Chroma's pruned AdaLN layers in a model without a family patcher:
    the generic pass fuses them."""
    model = ChromaTransformer2DModel(
        **FLUX_TINY, approximator_num_channels=16, approximator_hidden_dim=32,
        approximator_layers=1)
    mask = torch.ones(B, 5 + 12)
    mask[1, 3:5] = 0    # padded text in the second sample (the blocks square the mask)
    return model, _flux_inputs(attention_mask=mask)


def _sd3():
    # layer 0 is an SD3.5 dual-attention layer; the last block is context_pre_only
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64,
        pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16,
        dual_attention_layers=(0,), qk_norm="rms_norm")
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8),
                  encoder_hidden_states=torch.randn(B, 5, 32),
                  pooled_projections=torch.randn(B, 16), timestep=torch.tensor([10, 500]))
    return model, inputs


def _pixart():
    model = PixArtTransformer2DModel(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=64, sample_size=8, caption_channels=32, use_additional_conditions=False)
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8),
                  encoder_hidden_states=torch.randn(B, 6, 32), timestep=torch.tensor([10, 500]),
                  added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    return model, inputs


def _hunyuan_video():
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2,
        num_single_layers=2, num_refiner_layers=1, patch_size=2, patch_size_t=1,
        text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(4, 6, 6), guidance_embeds=True)
    mask = torch.ones(B, 7, dtype=torch.bool)
    mask[1, 5:] = False   # padded text in the second sample
    inputs = dict(hidden_states=torch.randn(B, 4, 3, 8, 8), timestep=torch.tensor([10, 500]),
                  encoder_hidden_states=torch.randn(B, 7, 32), encoder_attention_mask=mask,
                  pooled_projections=torch.randn(B, 16), guidance=torch.tensor([3.0, 3.0]))
    return model, inputs


def _hunyuan_video_framepack():
    """FramePack: HunyuanVideo's blocks, with SigLIP image tokens and the clean / 2x / 4x
    history latents packed before the noisy ones (one rotary table for all of them)."""
    model = HunyuanVideoFramepackTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2,
        num_single_layers=2, num_refiner_layers=1, patch_size=2, patch_size_t=1,
        text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(4, 6, 6), guidance_embeds=True,
        has_image_proj=True, image_proj_dim=20, has_clean_x_embedder=True)
    mask = torch.ones(B, 7, dtype=torch.bool)
    mask[:, 5:] = False   # padded text
    inputs = dict(hidden_states=torch.randn(B, 4, 3, 8, 8), timestep=torch.tensor([10, 500]),
                  encoder_hidden_states=torch.randn(B, 7, 32), encoder_attention_mask=mask,
                  pooled_projections=torch.randn(B, 16), image_embeds=torch.randn(B, 5, 20),
                  indices_latents=torch.arange(3), guidance=torch.tensor([3.0, 3.0]),
                  latents_clean=torch.randn(B, 4, 2, 8, 8), indices_latents_clean=torch.tensor([3, 4]),
                  latents_history_2x=torch.randn(B, 4, 2, 8, 8),
                  indices_latents_history_2x=torch.tensor([5, 6]),
                  latents_history_4x=torch.randn(B, 4, 4, 8, 8),
                  indices_latents_history_4x=torch.tensor([7, 8, 9, 10]))
    return model, inputs


def _qwen_image():
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
    mask = torch.ones(B, 5)
    mask[1, 3:] = 0   # padded text in the second sample
    inputs = dict(hidden_states=torch.randn(B, 12, 16), encoder_hidden_states=torch.randn(B, 5, 32),
                  encoder_hidden_states_mask=mask, timestep=torch.tensor([0.2, 0.9]),
                  img_shapes=[(1, 3, 4)] * B)
    return model, inputs


def _hunyuan_video15():
    model = HunyuanVideo15Transformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2,
        num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=32,
        text_embed_2_dim=24, image_embed_dim=20, rope_axes_dim=(4, 6, 6))
    mask, mask_2 = torch.ones(B, 7), torch.ones(B, 3)
    mask[1, 5:] = 0     # padded text in the second sample,
    mask_2[0, 2:] = 0   # padded ByT5 tokens in the first
    inputs = dict(hidden_states=torch.randn(B, 4, 3, 8, 8), timestep=torch.tensor([10.0, 500.0]),
                  encoder_hidden_states=torch.randn(B, 7, 32), encoder_attention_mask=mask,
                  encoder_hidden_states_2=torch.randn(B, 3, 24), encoder_attention_mask_2=mask_2,
                  image_embeds=torch.zeros(B, 4, 20))
    return model, inputs


def _dit():
    model = DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=16, in_channels=4,
                                  out_channels=8, num_layers=2, sample_size=8,
                                  num_embeds_ada_norm=10)
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), timestep=torch.tensor([10, 500]),
                  class_labels=torch.tensor([1, 3]))
    return model, inputs


# name -> (builder, family, fusebox operators every patched forward must run)
MODELS = {
    "flux": (_flux, "flux", {"rotary", "fused_norm", "gated_residual", "act"}),
    "longcat_image": (_longcat_image, "flux", {"rotary", "fused_norm", "gated_residual", "act"}),
    "ovis_image": (_ovis_image, "flux", {"rotary", "fused_norm", "gated_residual"}),
    "bria_fibo": (_bria_fibo, "flux", {"rotary", "fused_norm", "gated_residual"}),
    "flux2": (_flux2, "flux2", {"rotary", "fused_norm", "gated_residual", "gated_act_packed"}),
    "flux3": (_flux3, "flux3", {"rotary", "fused_norm", "gated_residual", "gated_act_packed"}),
    "sd3": (_sd3, "sd3", {"rms_norm", "fused_norm", "gated_residual", "act"}),
    "pixart": (_pixart, "pixart", {"fused_norm", "gated_residual", "act"}),
    "hunyuan_video": (_hunyuan_video, "hunyuan-video",
                      {"rotary", "rms_norm", "fused_norm", "gated_residual", "act"}),
    "hunyuan_video_framepack": (_hunyuan_video_framepack, "hunyuan-video-framepack",
                                {"rotary", "rms_norm", "fused_norm", "gated_residual", "act"}),
    "hunyuan_video15": (_hunyuan_video15, "hunyuan-video-1.5",
                        {"rotary", "rms_norm", "fused_norm", "gated_residual", "act"}),
    "qwen_image": (_qwen_image, "qwen-image", {"rotary", "fused_norm", "gated_residual", "act"}),
    "chroma": (_chroma, "chroma", {"rotary", "fused_norm", "gated_residual", "act"}),
    "dit": (_dit, "", {"fused_norm", "layer_norm", "act"}),
}


def build(name, device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    model, inputs = MODELS[name][0]()
    model = model.eval().to(device=device, dtype=dtype)

    def moved(v):
        if isinstance(v, list):
            return [moved(t) for t in v]
        if isinstance(v, torch.Tensor):
            return v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
        return v

    return model, {k: moved(v) for k, v in inputs.items()}


def forward(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


@pytest.fixture(autouse=True)
def _quiet_diffusers():
    from diffusers.utils import logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    yield
    logging.set_verbosity(level)


# --------------------------------------------------------------------------- whole models


@pytest.mark.parametrize("name", list(MODELS))
def test_fp32_matches_unpatched(name, device):
    model, inputs = build(name, device)
    ref = forward(model, inputs)
    report = fusebox.patch(model)
    assert report.family == MODELS[name][1]
    with FuseboxOps() as ops:
        out = forward(model, inputs)
    assert MODELS[name][2] <= set(ops.calls), ops.calls
    assert out.dtype == ref.dtype and out.shape == ref.shape
    # fp32 math everywhere; only the summation order differs
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_half_within_eager_half_spread(name, dtype, device):
    model, inputs = build(name, device)
    ref = forward(model, inputs)
    model_half, inputs_half = build(name, device, dtype)
    eager = forward(model_half, inputs_half)
    fusebox.patch(model_half)
    with FuseboxOps() as ops:
        patched = forward(model_half, inputs_half)
    assert MODELS[name][2] <= set(ops.calls), ops.calls
    assert patched.dtype == dtype
    # fused kernels round once where eager 16-bit code rounds after every op: the patched model
    # must sit inside the error that eager 16-bit itself makes against the fp32 model
    assert rel_err(patched, ref) <= 1.5 * rel_err(eager, ref), (rel_err(patched, ref), rel_err(eager, ref))


def _processors(model):
    return {n: m.processor for n, m in model.named_modules() if hasattr(m, "processor")}


def _module_hooks(model):
    return {n: (list(m._forward_pre_hooks), list(m._forward_hooks))
            for n, m in model.named_modules()}


@pytest.mark.parametrize("name", list(MODELS))
def test_unpatch_restores_exactly(name, device):
    model, inputs = build(name, device)
    ref = forward(model, inputs)
    processors = _processors(model)
    dicts = {n: set(m.__dict__) for n, m in model.named_modules()}
    hooks = _module_hooks(model)

    fusebox.patch(model)
    fusebox.patch(model)   # patching twice changes nothing more
    assert fusebox.is_patched(model)
    assert fusebox.unpatch(model) > 0
    assert not fusebox.is_patched(model)

    after = _processors(model)
    assert all(after[n] is p for n, p in processors.items())
    assert {n: set(m.__dict__) for n, m in model.named_modules()} == dicts
    assert _module_hooks(model) == hooks
    with FuseboxOps() as ops:
        out = forward(model, inputs)
    assert not ops.calls
    assert torch.equal(out, ref)


def test_report_flux():
    model, _ = build("flux")
    report = fusebox.patch(model)
    patched = Counter(e.kind for e in report.patched)
    assert patched == Counter({"FluxAttention": 4, "AdaLayerNormZero": 4, "GELU": 4,
                               "FluxTransformerBlock": 2, "FluxSingleTransformerBlock": 2,
                               "AdaLayerNormZeroSingle": 2, "AdaLayerNormContinuous": 1})
    skipped = Counter(e.what for e in report.skipped)
    assert skipped["done by the block's gated_residual_norm"] == 4      # norm2, norm2_context
    assert skipped["done by the parent AdaLayerNorm's adaln"] == 7
    assert "transformer_blocks.0.attn" in {e.path for e in report.patched}
    assert "[flux]" in str(report)



def test_flux_copies_are_found_by_their_source():
    """A class named like FLUX's with another prefix gets FLUX's fusions only when its code reads
    as FLUX's: LongCat-Image's single-stream block does, Ovis-Image's (a gated MLP) and
    Chroma's (its own modulation) do not; the report names the model's matched classes."""
    from diffusers.models.transformers import (
        transformer_chroma,
        transformer_flux,
        transformer_longcat_image,
        transformer_ovis_image,
    )

    from fusebox.patch.dit.flux import reads_as_flux

    single = transformer_flux.FluxSingleTransformerBlock
    assert reads_as_flux(single, single)
    assert reads_as_flux(transformer_longcat_image.LongCatImageSingleTransformerBlock, single)
    assert not reads_as_flux(transformer_ovis_image.OvisImageSingleTransformerBlock, single)
    assert not reads_as_flux(transformer_chroma.ChromaSingleTransformerBlock, single)
    assert reads_as_flux(transformer_longcat_image.LongCatImageAttnProcessor,
                         transformer_flux.FluxAttnProcessor, "__call__")

    model, _ = build("ovis_image")
    report = fusebox.patch(model)
    patched = Counter(e.kind for e in report.patched)
    assert patched["OvisImageTransformerBlock"] == 2 and patched["OvisImageAttention"] == 4
    assert "OvisImageSingleTransformerBlock" not in patched
    assert "read as FLUX's" in str(report)


def _controlnet(name):
    """(ControlNet on the family's own block classes, its inputs, its family)."""
    import diffusers

    if name == "flux":
        model = diffusers.FluxControlNetModel(**FLUX_TINY, pooled_projection_dim=16,
                                              guidance_embeds=True)
        return model, _flux_inputs(controlnet_cond=torch.randn(B, 12, 8),
                                   pooled_projections=torch.randn(B, 16),
                                   guidance=torch.full((B,), 3.5)), "flux"
    if name == "qwen_image":
        model = diffusers.QwenImageControlNetModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
        mask = torch.ones(B, 5)
        mask[1, 3:] = 0
        return model, dict(hidden_states=torch.randn(B, 12, 16),
                           controlnet_cond=torch.randn(B, 12, 16),
                           encoder_hidden_states=torch.randn(B, 5, 32),
                           encoder_hidden_states_mask=mask, timestep=torch.tensor([0.2, 0.9]),
                           img_shapes=[(1, 3, 4)] * B), "qwen-image"
    model = diffusers.SD3ControlNetModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64,
        pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16, qk_norm="rms_norm")
    return model, dict(hidden_states=torch.randn(B, 4, 8, 8),
                       controlnet_cond=torch.randn(B, 4, 8, 8),
                       encoder_hidden_states=torch.randn(B, 7, 32),
                       pooled_projections=torch.randn(B, 16),
                       timestep=torch.tensor([10, 500])), "sd3"


@pytest.mark.parametrize("name", ["flux", "qwen_image", "sd3"])
def test_controlnet_gets_its_family_fusions(name, device):
    """A ControlNet runs its family's own block classes: they get the family's fused forwards,
    and every block sample matches unpatched (zero-initialized projections moved off zero)."""
    torch.manual_seed(0)
    model, inputs, family = _controlnet(name)
    model = model.eval().to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)
        report = fusebox.patch(model)
        with FuseboxOps() as ops:
            out = model(**inputs, return_dict=False)
    assert report.family == family and {"fused_norm", "gated_residual"} <= set(ops.calls)
    samples = [(o, r) for outs, refs in zip(out, ref) for o, r in zip(outs, refs)]
    assert len(samples) >= 2 and all(rel_err(o, r) < 1e-5 for o, r in samples)

def test_report_flux2():
    model, _ = build("flux2")
    report = fusebox.patch(model)
    patched = Counter(e.kind for e in report.patched)
    assert patched == Counter({"Flux2SwiGLU": 6, "Flux2TransformerBlock": 2,
                               "Flux2SingleTransformerBlock": 2, "Flux2Attention": 2,
                               "Flux2ParallelSelfAttention": 2, "AdaLayerNormContinuous": 1}), \
        str(report)
    assert all(e.kind == "LayerNorm" and e.what.startswith("done by") for e in report.skipped)


def test_report_flux3():
    model, _ = build("flux3")
    report = fusebox.patch(model)
    assert report.family == "flux3"
    patched = Counter(e.kind for e in report.patched)
    # two per-mode blocks for each of image, reference image and text, two joint blocks
    assert patched == Counter({"Flux3ModeTransformerBlock": 6, "Flux3SingleTransformerBlock": 2,
                               "Flux3Attention": 8, "Flux3SwiGLU": 8, "Flux3AdaLayerNorm": 1}), \
        str(report)
    skipped = Counter((e.kind, e.what) for e in report.skipped)
    assert skipped == Counter({("LayerNorm", "done by the block's adaln"): 8,
                               ("LayerNorm", "done by the parent's adaln"): 1}), str(report)


def _flux3_run(model, inputs):
    with FuseboxOps() as ops:
        out = forward(model, inputs)
    return out, ops.calls


def test_flux3_fused_launches(monkeypatch):
    """What one forward runs: per block an adaln per stream and a gated_residual per stream, the
    feed-forward's output GEMM accumulating onto the attention output (no separate add), one
    qk_norm_rope per attention, one SwiGLU per feed-forward, the output norm's adaln."""
    model, inputs = build("flux3")
    fusebox.patch(model)
    addmm, seen = torch.addmm, Counter()

    def counting_addmm(*args, **kwargs):
        seen["addmm"] += 1
        return addmm(*args, **kwargs)

    monkeypatch.setattr(torch, "addmm", counting_addmm)
    _, calls = _flux3_run(model, inputs)
    # 6 per-mode blocks + 2 joint blocks x 2 streams (+ the output norm)
    assert calls["fused_norm"] == 6 + 2 * 2 + 1 and calls["gated_residual"] == 6 + 2 * 2, calls
    assert calls["rotary"] == 8 and calls["gated_act_packed"] == 8, calls
    assert seen["addmm"] == 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_flux3_half_with_fp32_qk_norms(dtype, device):
    """The q/k norms kept in fp32 as ``from_pretrained`` keeps them (``_keep_in_fp32_modules``)
    in a 16-bit model: the fused q/k norm + RoPE reads the fp32 weights, inside the spread."""
    model, inputs = build("flux3", device)
    ref = forward(model, inputs)
    model_half, inputs_half = build("flux3", device, dtype)
    for module in model_half.modules():
        if type(module).__name__ == "Flux3Attention":
            module.norm_q.float()
            module.norm_k.float()
    eager = forward(model_half, inputs_half)
    fusebox.patch(model_half)
    with FuseboxOps() as ops:
        patched = forward(model_half, inputs_half)
    assert ops.calls["rotary"] == 8, ops.calls
    assert patched.dtype == dtype
    assert rel_err(patched, ref) <= 1.5 * rel_err(eager, ref), (rel_err(patched, ref),
                                                               rel_err(eager, ref))


def test_flux3_without_reference_image_and_fused_qkv(device):
    """Text-to-image (no reference tokens) with the q/k/v projections fused into one
    (``fuse_qkv_projections``): q and k read in place from the fused projection."""
    model, inputs = build("flux3", device)
    del inputs["image_cond_hidden_states"], inputs["image_cond_ids"]
    with torch.no_grad():
        model.fuse_qkv_projections()
    assert model.single_transformer_blocks[0].attn.fused_projections
    ref = forward(model, inputs)
    fusebox.patch(model)
    out, calls = _flux3_run(model, inputs)
    assert calls["rotary"] == 6, calls      # the reference-image blocks do not run
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("case", ["autograd", "float64"])
def test_flux3_falls_back_to_original(case):
    model, inputs = build("flux3", dtype=torch.float64 if case == "float64" else torch.float32)
    if case == "autograd":
        inputs["hidden_states"].requires_grad_(True)
        out = assert_patch_falls_back(model, lambda m: m(**inputs, return_dict=False)[0])
        out.square().mean().backward()
        assert inputs["hidden_states"].grad is not None
    else:
        assert_patch_falls_back(model, lambda m: forward(m, inputs))


def test_report_qwen_image():
    model, _ = build("qwen_image")
    report = fusebox.patch(model)
    patched = Counter(e.kind for e in report.patched)
    assert patched["QwenImageTransformerBlock"] == 2 and patched["Attention"] == 2, str(report)
    fused_into = Counter(e.what for e in report.skipped if e.kind == "LayerNorm")
    assert fused_into == Counter({"done by the block's adaln": 4,
                                  "done by the block's gated_residual_norm": 4,
                                  "done by the parent AdaLayerNorm's adaln": 1}), str(report)


def test_qwen_image_under_inference_mode(device):
    """The rotary tables formed once per forward come from inference tensors here (no version
    counter)."""
    model, inputs = build("qwen_image", device)
    ref = forward(model, inputs)
    fusebox.patch(model)
    with torch.inference_mode():
        out = model(**inputs, return_dict=False)[0]
        again = model(**inputs, return_dict=False)[0]
    assert rel_err(out, ref) < 1e-5 and torch.equal(out, again)


@pytest.mark.parametrize("layer3d_rope", [False, True])
def test_qwen_image_edit_models_keep_their_block_forward(layer3d_rope, device):
    """Edit models (``zero_cond_t``) modulate the reference image's tokens otherwise than the
    noisy ones: their blocks keep diffusers' forward, their attention is still fused."""
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
        zero_cond_t=True, use_layer3d_rope=layer3d_rope).eval().to(device)
    inputs = dict(hidden_states=torch.randn(B, 24, 16, device=device),
                  encoder_hidden_states=torch.randn(B, 5, 32, device=device),
                  encoder_hidden_states_mask=torch.ones(B, 5, device=device),
                  timestep=torch.tensor([0.2, 0.9], device=device),
                  img_shapes=[[(1, 3, 4), (1, 3, 4)]] * B)
    ref = forward(model, inputs)
    fusebox.patch(model)
    with FuseboxOps() as ops:
        out = forward(model, inputs)
    assert "rotary" in ops.calls and "gated_residual" not in ops.calls, ops.calls
    assert rel_err(out, ref) < 1e-5



def _text_mask(padding, device, text=5):
    mask = torch.ones(B, text, dtype=torch.bool, device=device)
    if padding == "same suffix":
        mask[:, 3:] = False
    elif padding == "per sample":
        mask[1, 2:] = False
    return mask


def _with_mask(name, args, mask):
    """The block arguments of ``_block_cases`` with the text mask in the form the model hands
    its blocks: HunyuanVideo's ``[B, 1, 1, video + text]``, the others' ``[B, text]``."""
    if name == "hunyuan_video":
        x = args[0]
        full = torch.cat([torch.ones(B, x.shape[1], dtype=torch.bool, device=x.device), mask], 1)
        return args[:3] + (full.view(B, 1, 1, -1),) + args[4:]
    at = 2 if name == "qwen_image" else 3
    return args[:at] + (mask,) + args[at + 1:]


# how many keys reach attention unmasked (None: all of them, masked)
_CUT = {"hunyuan_video15": {"none": 5, "same suffix": 3, "per sample": None},
        "hunyuan_video": {"none": 5, "same suffix": 3, "per sample": None},
        "qwen_image": {"none": 5, "same suffix": None, "per sample": None}}


@pytest.mark.parametrize("padding", ["none", "same suffix", "per sample"])
@pytest.mark.parametrize("name", list(_CUT))
def test_attention_over_valid_keys(name, padding, device, monkeypatch):
    """A patched block's streams match diffusers' (padded text rows included) whether the keys
    are cut to the valid prefix every sample shares (no mask reaches attention: SDPA's
    unmasked kernels) or masked; the whole model matches too, also under inference_mode."""
    from fusebox.patch.dit import _shared

    model, inputs = build(name, device)
    mask = _text_mask(padding, device)
    cases = [(block, _with_mask(name, args, mask))
             for block, args in _block_cases(name, model, inputs, device)]
    with torch.no_grad():
        refs = [block(*args) for block, args in cases]
    fusebox.patch(model)
    seen = []
    original = _shared.dispatch_attention_fn

    def recording(query, key, value, attn_mask=None, **kwargs):
        seen.append((query.shape[1] - key.shape[1], attn_mask is None))
        return original(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(_shared, "dispatch_attention_fn", recording)
    for (block, args), ref in zip(cases, refs):
        seen.clear()
        with torch.no_grad():
            out = block(*args)
        for r, o in zip(ref, out):
            assert torch.isfinite(o).all() and rel_err(o, r) < 1e-5
        valid = _CUT[name][padding]
        assert seen == [(0 if valid is None else 5 - valid, valid is not None)], seen

    if padding == "none":       # the model's text masks let every token through
        inputs = {k: torch.ones_like(v) if "mask" in k else v for k, v in inputs.items()}
    fusebox.unpatch(model)
    ref = forward(model, inputs)
    fusebox.patch(model)
    seen.clear()
    out = forward(model, inputs)
    assert rel_err(out, ref) < 1e-5
    assert seen and all(no_mask for _, no_mask in seen) == (padding == "none"), seen
    with torch.inference_mode():     # masks made there are inference tensors
        assert torch.equal(model(**inputs, return_dict=False)[0], out)


# --------------------------------------------------------------------------- text padding at the input


def _sdpa_masked(gm):
    """Whether each SDPA call of a captured graph gets a mask."""
    calls = [n for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    return [n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None) is not None
            for n in calls]


# name -> case -> (text tokens the blocks get, attention unmasked). The tiny models' inputs:
# HunyuanVideo 1.5 7 text + 3 glyph + 4 image tokens, HunyuanVideo 7 text tokens, Qwen-Image 5.
_TRIMMED = {
    "hunyuan_video15": {
        "shared suffix": (4 + 2, True),          # the image tokens (all zero) dropped too
        "per sample": (5 + 3, False),
        "no glyphs": (4, True),
        "image": (4 + 2 + 4, True),              # image-to-video: its tokens are all valid
        "image, per sample": (5 + 3 + 4, False),
    },
    "hunyuan_video": {"shared suffix": (4, True), "per sample": (5, False)},
    "qwen_image": {"shared suffix": (4, True), "per sample": (5, False)},
}
_MASK_INPUT = {"qwen_image": "encoder_hidden_states_mask"}   # the others': encoder_attention_mask


def _padded_inputs(name, case, device, gen):
    """The tiny model of ``name`` and its inputs, the text padded as ``case`` says, the text and
    image states drawn afresh."""
    model, inputs = build(name, device)

    def randn(like):
        return torch.randn(like.shape, generator=gen).to(like)

    mask_input = _MASK_INPUT.get(name, "encoder_attention_mask")
    text = inputs["encoder_hidden_states"].shape[1]
    mask = torch.ones(B, text, device=device, dtype=inputs[mask_input].dtype)
    if "per sample" in case:
        mask[0, 5:], mask[1, 3:] = 0, 0
    else:
        mask[:, 4:] = 0
    inputs.update({mask_input: mask,
                   "encoder_hidden_states": randn(inputs["encoder_hidden_states"])})
    if name == "hunyuan_video15":
        mask_2 = torch.ones(B, 3, device=device)
        if case == "no glyphs":
            mask_2[:] = 0
        elif "per sample" in case:
            mask_2[1, 1:] = 0
        else:
            mask_2[:, 2:] = 0
        inputs.update(encoder_attention_mask_2=mask_2,
                      encoder_hidden_states_2=randn(inputs["encoder_hidden_states_2"]))
        if "image" in case:
            inputs["image_embeds"] = randn(inputs["image_embeds"])
        else:
            assert not inputs["image_embeds"].any()     # text-to-video
    return model, inputs


def _record_text_length(block, seen):
    """Appends to ``seen`` the text length of each call of ``block``, whose text comes second
    or as ``encoder_hidden_states``."""
    def hook(module, args, kwargs):
        seen.append((args[1] if len(args) > 1 else kwargs["encoder_hidden_states"]).shape[1])
    return block.register_forward_pre_hook(hook, with_kwargs=True)


def _call(model, inputs, style):
    """The model's forward with ``inputs`` by keyword, or positionally up to the last of them."""
    if style == "keyword":
        return forward(model, inputs)
    parameters = inspect.signature(model.forward).parameters
    names = list(parameters)
    last = max(names.index(name) for name in inputs)
    args = [inputs.get(name, parameters[name].default) for name in names[:last + 1]]
    with torch.no_grad():
        return model(*args, return_dict=False)[0]


@pytest.mark.parametrize("style", ["keyword", "positional"])
@pytest.mark.parametrize("name, case", [(n, c) for n in _TRIMMED for c in _TRIMMED[n]])
def test_text_padding_trimmed_at_the_input(name, case, style, device, gen, monkeypatch):
    """The patched model drops the text (and text-to-video image) tokens that are padding in
    every sample before its blocks run, and attends unmasked when none is left; its output
    matches the unpatched model's."""
    from fusebox.patch.dit import _shared

    model, inputs = _padded_inputs(name, case, device, gen)
    ref = forward(model, inputs)
    fusebox.patch(model)
    text_seen, unmasked = [], []
    _record_text_length(model.transformer_blocks[0], text_seen)
    original = _shared.dispatch_attention_fn

    def recording(query, key, value, attn_mask=None, **kwargs):
        unmasked.append(attn_mask is None)
        return original(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(_shared, "dispatch_attention_fn", recording)
    out = _call(model, inputs, style)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-5
    text, no_mask = _TRIMMED[name][case]
    assert text_seen == [text]
    assert unmasked and set(unmasked) == {no_mask}, unmasked


def test_text_padding_state_cleared_after_forward_and_error(device, gen):
    """The processors hear "all valid" only during the forward whose inputs were trimmed: not
    after it, nor after a forward that raised; the next call is then masked as it must be."""
    model, inputs = _padded_inputs("hunyuan_video15", "shared suffix", device, gen)
    _, per_sample = _padded_inputs("hunyuan_video15", "per sample", device, gen)
    ref = forward(model, per_sample)
    fusebox.patch(model)
    state = model.transformer_blocks[0].attn.processor.text_padding
    assert all(b.attn.processor.text_padding is state for b in model.transformer_blocks)
    during = []
    hook = model.transformer_blocks[0].register_forward_pre_hook(
        lambda block, args: during.append(state.all_valid))
    forward(model, inputs)
    assert during == [True] and not state.all_valid

    def failing(block, args):
        raise RuntimeError("block failed")

    failure = model.transformer_blocks[1].register_forward_pre_hook(failing)
    with pytest.raises(RuntimeError, match="block failed"):
        forward(model, inputs)
    assert during == [True, True] and not state.all_valid
    failure.remove()
    assert rel_err(forward(model, per_sample), ref) < 1e-5
    assert during[-1] is False
    hook.remove()


@pytest.mark.parametrize("name", list(_TRIMMED))
def test_compiled_block_follows_text_padding_state(name, device):
    """A block compiled with fullgraph runs attention unmasked while the model's state says all
    text is valid and masked otherwise: flipping the state recompiles (once per value) rather
    than reusing the graph traced for the other value. The padded text of the mask shows which
    graph ran."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model, inputs = build(name, device)
    fusebox.patch(model)
    state = model.transformer_blocks[0].attn.processor.text_padding
    mask = _text_mask("per sample", device)
    for block, args in _block_cases(name, model, inputs, device):
        args = _with_mask(name, args, mask)
        masked = []

        def backend(gm, example_inputs):
            masked.append(_sdpa_masked(gm))
            return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

        counter = CompileCounterWithBackend(backend)
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True, backend=counter)
        video_out = {}
        try:
            with torch.no_grad():
                for all_valid in (False, True, False, True):
                    state.all_valid = all_valid
                    eager, out = block(*args), compiled(*args)
                    for e, o in zip(eager, out):
                        assert torch.allclose(e, o, rtol=1e-5, atol=1e-6)
                    video_out[all_valid] = out[0]
        finally:
            state.all_valid = False
        assert counter.frame_count == 2 and masked == [[True], [False]], masked
        assert not torch.allclose(video_out[True], video_out[False])


def test_regional_compile_attends_unmasked_after_trim(gen):
    """``compile_repeated_blocks(fullgraph=True)``: the compiled blocks of a call whose text is
    all valid once trimmed run attention unmasked, those of a call with per-sample padding
    masked, each matching the unpatched model."""
    model, inputs = _padded_inputs("hunyuan_video15", "shared suffix", "cpu", gen)
    _, per_sample = _padded_inputs("hunyuan_video15", "per sample", "cpu", gen)
    refs = [forward(model, inputs), forward(model, per_sample)]
    fusebox.patch(model)
    block_graphs = []

    def backend(gm, example_inputs):
        if any("fusebox.rotary" in str(n.target) for n in gm.graph.nodes):
            block_graphs.append(_sdpa_masked(gm))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    model.compile_repeated_blocks(fullgraph=True, backend=backend)
    try:
        for call_inputs, ref, masked in zip((inputs, per_sample), refs, (False, True)):
            block_graphs.clear()
            assert rel_err(forward(model, call_inputs), ref) < 1e-5
            assert block_graphs and all(g == [masked] for g in block_graphs), block_graphs
    finally:
        torch._dynamo.reset()


def test_whole_model_compile_matches_unpatched(gen):
    """Under a whole-model ``torch.compile`` dynamo also runs the model's hooks (each in a frame
    of its own), so the pre-hook does nothing (no host read in a graph): the output matches the
    unpatched model's, and the state an earlier eager call set never leaks in."""
    model, inputs = _padded_inputs("hunyuan_video15", "per sample", "cpu", gen)
    ref = forward(model, inputs)
    fusebox.patch(model)
    state = model.transformer_blocks[0].attn.processor.text_padding
    all_valid = {k: torch.ones_like(v) if "mask" in k else v for k, v in inputs.items()}
    forward(model, all_valid)      # an eager call that sets the state, then clears it
    torch._dynamo.reset()
    try:
        out = forward(torch.compile(model, backend="aot_eager"), inputs)
    finally:
        torch._dynamo.reset()
    assert rel_err(out, ref) < 1e-5 and not state.all_valid


@pytest.mark.parametrize("name", list(_TRIMMED))
def test_unpatch_removes_text_trim(name, gen):
    """Patching twice installs one pre-hook and one forward hook sharing one state with every
    fused processor; unpatch removes both hooks and the state, and the model again hands its
    blocks the untrimmed text."""
    from fusebox.patch.dit import _shared

    model, inputs = _padded_inputs(name, "shared suffix", "cpu", gen)
    ref = forward(model, inputs)
    fusebox.patch(model)
    fusebox.patch(model)
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    state = model.__dict__[_shared.TEXT_PADDING_ATTR]
    processors = [m.processor for m in model.modules()
                  if isinstance(getattr(m, "processor", None), _shared.FusedAttnProcessor)]
    assert processors and all(p.text_padding is state for p in processors)
    fusebox.unpatch(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not model._forward_pre_hooks_with_kwargs and not model._forward_hooks_always_called
    assert _shared.TEXT_PADDING_ATTR not in model.__dict__
    text_seen = []
    _record_text_length(model.transformer_blocks[0], text_seen)
    assert torch.equal(forward(model, inputs), ref)
    assert text_seen == [{"hunyuan_video15": 7 + 3 + 4, "qwen_image": 5}.get(name, 7)]


def test_report_sd3_pixart_hunyuan_dit():
    summary = {name: fusebox.patch(build(name)[0]).summary() for name in
               ("sd3", "pixart", "hunyuan_video", "dit")}
    sd3 = summary["sd3"]["patched"]
    assert sd3["JointTransformerBlock: gated_residual_norm + gated_residual, both streams"] == 2
    assert sd3["JointTransformerBlock: gated_residual_norm + gated_residual, image stream"] == 1
    assert sd3["SD35AdaLayerNormZeroX: adaln x2 (layer)"] == 1
    assert sd3["RMSNorm: rms_norm"] == 14           # per-head q/k norms of 3 joint + 1 dual attn
    assert sd3["Attention: processor: joint attention on [B, S, H, D] q/k/v (no layout copies)"] == 4
    pixart = summary["pixart"]
    assert pixart["patched"]["BasicTransformerBlock: adaln + gated_residual + "
                             "gated_residual_norm + gated_residual"] == 2
    assert pixart["skipped"]["LayerNorm: done by the block's adaln"] == 2
    hunyuan = summary["hunyuan_video"]
    assert hunyuan["patched"]["Attention: qk_norm_rope per head (interleaved) on video tokens"] == 4
    assert hunyuan["skipped"]["RMSNorm: done by the attention processor"] == 12
    dit = summary["dit"]["patched"]
    assert dit == {"AdaLayerNormZero: adaln (layer)": 2, "GELU: linear + gelu_tanh(+bias)": 2,
                   "LayerNorm: layer_norm": 3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["joint", "context_pre_only", "dual_attn2"])
def test_sd3_joint_processor_matches_diffusers(which, dtype, device):
    # the [B, S, H, D] processor against diffusers' JointAttnProcessor2_0 on the same module
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    model, _ = build("sd3", device, dtype)
    block = {"joint": model.transformer_blocks[1], "context_pre_only": model.transformer_blocks[2],
             "dual_attn2": model.transformer_blocks[0]}[which]
    attn = block.attn2 if which == "dual_attn2" else block.attn
    d = model.config.num_attention_heads * model.config.attention_head_dim
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, 12, d, generator=gen).to(device, dtype)
    c = None if which == "dual_attn2" else torch.randn(B, 5, d, generator=gen).to(device, dtype)
    with torch.no_grad():
        ref = attn(x, encoder_hidden_states=c)
        fusebox.patch(model)
        assert type(attn.processor).__name__ == "SD3JointAttnProcessor"
        assert isinstance(attn.processor.original, JointAttnProcessor2_0)
        out = attn(x, encoder_hidden_states=c)
    ref = ref if isinstance(ref, tuple) else (ref,)
    out = out if isinstance(out, tuple) else (out,)
    assert len(out) == len(ref)
    for r, o in zip(ref, out):
        assert o.dtype == r.dtype and o.shape == r.shape and torch.isfinite(o).all()
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(o, r, **tol)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_on_a_stream_slice(bias, dtype, device, monkeypatch):
    # one stream's slice of a joint [B, S, C] output: multiplied where it lies, one GEMM per
    # batch with the bias inside it, equal to F.linear of the same slice
    from fusebox.patch.dit import _shared

    gen = torch.Generator().manual_seed(5)
    proj = torch.nn.Linear(24, 40, bias=bias).to(device, dtype)
    joint = torch.randn(3, 17, 24, generator=gen).to(device, dtype)
    image, context = joint[:, :11], joint[:, 11:]
    calls = Counter()
    for name in ("mm", "addmm"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _r=real, _n=name, **k: (calls.update([_n]), _r(*a, **k))[1])
    with torch.no_grad():
        for part in (image, context):
            assert not part.is_contiguous()
            out = _shared.linear_rows(proj, part)
            ref = torch.nn.functional.linear(part.contiguous(), proj.weight, proj.bias)
            assert out.shape == ref.shape and out.dtype == ref.dtype and torch.isfinite(out).all()
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(out, ref, **tol)
    assert calls["addmm" if bias else "mm"] == 2 * 3      # one per batch of each slice
    # inputs it leaves to the module: one batch (already contiguous), and a call autograd must
    # record (grad enabled, the parameters require grad)
    calls.clear()
    with torch.no_grad():
        _shared.linear_rows(proj, joint[:1, :11])
    _shared.linear_rows(proj, image)
    assert not calls


@pytest.mark.parametrize("epilogue", [True, False])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_linear_gelu_matches_float64(dtype, approximate, epilogue, device, monkeypatch):
    # gelu(x @ W^T + b) of the feed-forward's first projection, against a float64 reference:
    # on CUDA the tanh form runs as one GEMM with the bias + GELU epilogue (unless switched
    # off), every other case as the matmul then fusebox's bias + GELU pass
    from fusebox.patch.dit import _shared

    monkeypatch.setattr(_common, "GEMM_GELU", epilogue)
    calls = Counter()
    real = torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation",
                        lambda *a, **k: (calls.update(["epilogue"]), real(*a, **k))[1])
    gen = torch.Generator().manual_seed(11)
    cases = [((2, 37, 24), 40), ((3, 5, 64), 129), ((1, 1, 16), 8), ((7, 33), 72)]
    for shape, n in cases:
        proj = torch.nn.Linear(shape[-1], n).to(device, dtype)
        with torch.no_grad():
            proj.weight.copy_(torch.randn(n, shape[-1], generator=gen) / shape[-1] ** 0.5)
            proj.bias.copy_(torch.randn(n, generator=gen))
        x = torch.randn(*shape, generator=gen).to(device, dtype)
        inputs = [x]
        if x.dim() == 3:  # rows of a longer sequence: not contiguous
            inputs.append(torch.randn(shape[0], shape[1] + 4, shape[2], generator=gen)
                          .to(device, dtype)[:, 2:-2])
        for xin in inputs:
            with torch.no_grad(), poison_allocator(device):
                out = _shared.linear_gelu(proj, xin, approximate)
            ref = torch.nn.functional.gelu(
                torch.nn.functional.linear(xin.double(), proj.weight.double(), proj.bias.double()),
                approximate=approximate)
            assert_close(out, ref.to(device), dtype, name=f"linear_gelu {tuple(xin.shape)}->{n}")
    expect_epilogue = device == "cuda" and approximate == "tanh" and epilogue
    assert calls["epilogue"] == (7 if expect_epilogue else 0)   # 3 cases x 2 inputs + 1


def test_processor_keeps_attention_backend():
    model, _ = build("flux")
    attn = model.transformer_blocks[0].attn
    attn.processor._attention_backend = "native"
    fusebox.patch(model)
    assert type(attn.processor).__name__ == "FluxFusedAttnProcessor"
    assert attn.processor._attention_backend == "native"
    assert model.transformer_blocks[1].attn.processor._attention_backend is None


# --------------------------------------------------------------------------- fallbacks


def test_autograd_falls_back_to_original():
    model, inputs = build("flux")
    inputs["hidden_states"].requires_grad_(True)
    out = assert_patch_falls_back(model, lambda m: m(**inputs, return_dict=False)[0])
    out.square().mean().backward()
    assert inputs["hidden_states"].grad is not None


def test_float64_falls_back_to_original():
    model, inputs = build("hunyuan_video", dtype=torch.float64)
    assert_patch_falls_back(model, lambda m: forward(m, inputs))


# --------------------------------------------------------------------------- hooks, compile


@pytest.mark.parametrize("name", ["flux", "flux3", "hunyuan_video"])
@pytest.mark.parametrize("order", ["patch_then_offload", "offload_then_patch"])
def test_cpu_offload_hooks_kept(name, order):
    model, inputs = build(name)
    ref = forward(model, inputs)
    offload_and_patch(model, order)
    linear = model.proj_out
    assert "_hf_hook" in linear.__dict__
    assert linear.weight.device.type == "meta"      # offloaded: only the hook brings it in
    with FuseboxOps() as ops:
        out = forward(model, inputs)
    assert {"fused_norm", "gated_residual"} <= set(ops.calls)
    assert rel_err(out, ref) < 1e-5
    assert_unpatch_keeps_hooks(model, lambda m: forward(m, inputs), ref)


def _block_cases(name, model, inputs, device):
    """(block, args) of the patched blocks of each kind, with activations of the model's width."""
    d = model.config.num_attention_heads * model.config.attention_head_dim

    def randn(*shape):
        return torch.randn(*shape, device=device)

    x, c, temb = randn(B, 12, d), randn(B, 5, d), randn(B, d)
    if name in ("flux", "longcat_image"):
        rotary = model.pos_embed(torch.cat([inputs["txt_ids"], inputs["img_ids"]]))
        return [(model.transformer_blocks[0], (x, c, temb, rotary)),
                (model.single_transformer_blocks[0], (x, c, temb, rotary))]
    if name == "chroma":
        rotary = model.pos_embed(torch.cat([inputs["txt_ids"], inputs["img_ids"]]))
        mask = torch.ones(B, 5 + 12, device=device)
        mask[1, 3:5] = 0
        return [(model.transformer_blocks[0], (x, c, randn(B, 12, d), rotary, mask)),
                (model.single_transformer_blocks[0], (torch.cat([c, x], 1), randn(B, 3, d),
                                                      rotary, mask))]
    if name == "flux2":
        rotary = model.pos_embed(torch.cat([inputs["txt_ids"], inputs["img_ids"]]))
        mod_img, mod_txt, mod_single = randn(B, 6 * d), randn(B, 6 * d), randn(B, 3 * d)
        return [(model.transformer_blocks[0], (x, c, mod_img, mod_txt, rotary)),
                (model.single_transformer_blocks[0], (torch.cat([c, x], 1), None, mod_single,
                                                      rotary))]
    if name == "flux3":
        image_rotary = model.pos_embed(inputs["img_ids"])
        joint_rotary = model.pos_embed(torch.cat([inputs["txt_ids"], inputs["img_ids"]]))
        mod, mod_txt = randn(B, 12, 3 * d), randn(B, 5, 3 * d)    # per token
        return [(model.mode_blocks["image"][0], (x, mod, image_rotary)),
                (model.single_transformer_blocks[0], (x, c, mod, mod_txt, joint_rotary))]
    if name == "sd3":
        return [(block, (x, c, temb)) for block in model.transformer_blocks]
    if name == "pixart":
        return [(model.transformer_blocks[0], (x, None, randn(B, 6, 64), None, randn(B, 6 * d)))]
    if name == "hunyuan_video15":
        rotary = model.rope(randn(B, 4, 3, 8, 8))      # 3 x 4 x 4 = 48 video tokens
        mask = torch.ones(B, 5, dtype=torch.bool, device=device)
        mask[1, 3:] = False
        return [(model.transformer_blocks[0], (randn(B, 48, d), c, temb, mask, rotary))]
    if name == "qwen_image":
        rotary = model.pos_embed([(1, 3, 4)], max_txt_seq_len=5, device=device)
        mask = torch.ones(B, 5, device=device)
        return [(model.transformer_blocks[0], (x, c, mask, temb, rotary))]
    rotary = model.rope(randn(B, 4, 3, 4, 8))      # 3 x 2 x 4 = 24 video tokens
    x = randn(B, 24, d)
    mask = torch.ones(B, 1, 1, 29, dtype=torch.bool, device=device)
    return [(model.transformer_blocks[0], (x, c, temb, mask, rotary)),
            (model.single_transformer_blocks[0], (x, c, temb, mask, rotary))]


@pytest.mark.parametrize("name", ["flux", "longcat_image", "chroma", "flux2", "flux3", "sd3",
                                  "pixart", "hunyuan_video", "hunyuan_video15", "qwen_image"])
def test_compiled_block_has_no_graph_break(name, device):
    model, inputs = build(name, device)
    fusebox.patch(model)
    torch.manual_seed(1)
    backend = GraphOps()
    for block, args in _block_cases(name, model, inputs, device):
        torch._dynamo.reset()
        with torch.no_grad():
            ref = block(*args)
            out = torch.compile(block, fullgraph=True, backend=backend)(*args)
        ref = ref if isinstance(ref, tuple) else (ref,)
        out = out if isinstance(out, tuple) else (out,)
        for r, o in zip(ref, out):
            assert (r is None and o is None) or torch.allclose(r, o, rtol=1e-5, atol=1e-6)
    assert MODELS[name][2] <= backend.ops      # the fused path is what was traced


def test_compiled_pixart_block_forms_the_modulation_sum_once(monkeypatch):
    """Under inductor, the block's ``scale_shift_table + timestep`` formed by one fusebox launch
    leaves one buffer whose views feed the fused operators; formed by the eager add, inductor
    recomputes it into a buffer per term, in kernels of its own."""
    from torch._inductor import metrics

    from fusebox.patch.dit import pixart

    model, inputs = build("pixart", "cpu")
    fusebox.patch(model)
    block, args = _block_cases("pixart", model, inputs, "cpu")[0]

    def compiled_kernels():
        torch._dynamo.reset()
        metrics.reset()
        with torch.no_grad():
            torch.compile(block, fullgraph=True, backend="inductor")(*args)
        return metrics.generated_kernel_count

    fused = compiled_kernels()
    monkeypatch.setattr(pixart, "modulation_sum", lambda table, emb: table + emb)
    eager_add = compiled_kernels()
    assert fused < eager_add, (fused, eager_add)


# --------------------------------------------------------------------------- generic modules


def _generic_cases():
    bf16, f32 = torch.bfloat16, torch.float32
    norm_fp32_weight = RMSNorm(64, eps=1e-6)                # kept fp32 in a bf16 model
    cases = {
        "rms_norm": (RMSNorm(64, eps=1e-6), f32, f32),
        "rms_norm_bf16": (RMSNorm(64, eps=1e-6).to(bf16), bf16, bf16),
        "rms_norm_fp32_weight_bf16_input": (norm_fp32_weight, bf16, f32),
        "rms_norm_no_weight": (RMSNorm(64, eps=1e-5, elementwise_affine=False), bf16, bf16),
        "layer_norm_affine": (torch.nn.LayerNorm(64, eps=1e-5), f32, f32),
        "fp32_layer_norm": (FP32LayerNorm(64, eps=1e-6).to(bf16), bf16, bf16),
        "ff_gelu_tanh": (FeedForward(64, activation_fn="gelu-approximate"), f32, f32),
        "ff_gelu": (FeedForward(64, activation_fn="gelu"), f32, f32),
        "ff_geglu": (FeedForward(64, activation_fn="geglu"), f32, f32),
        "ff_swiglu": (FeedForward(64, activation_fn="swiglu"), f32, f32),
    }
    # the fp32 RMSNorms of single families (each in a diffusers that has it)
    for module, cls, weight_dtype in (("transformer_cosmos3", "Cosmos3NemotronRMSNorm", bf16),
                                      ("transformer_stable_audio3", "StableAudio3RMSNorm", f32)):
        try:
            norm = getattr(importlib.import_module(f"diffusers.models.transformers.{module}"), cls)
        except (ImportError, AttributeError):
            continue
        cases[cls] = (norm(64, eps=1e-5).to(weight_dtype), bf16, bf16)
    return cases


GENERIC = _generic_cases()


@pytest.mark.parametrize("case", list(GENERIC))
def test_generic_module(case, device):
    torch.manual_seed(0)
    module, x_dtype, out_dtype = copy.deepcopy(GENERIC[case])
    module = module.to(device)
    for p in module.parameters():   # weights off their init values
        p.data += 0.1 * torch.randn_like(p)
    x = torch.randn(B, 9, 64, device=device).to(x_dtype)
    ref = forward_module(module, x)
    assert _modules_patch(module).num_patched >= 1
    with FuseboxOps() as ops:
        out = forward_module(module, x)
    assert ops.calls
    assert out.dtype == ref.dtype == out_dtype
    # in 16-bit, eager rounds intermediates that the fused op keeps in fp32
    assert rel_err(out, ref) < (1e-5 if x_dtype == torch.float32 else 8e-3)


def forward_module(module, *args):
    with torch.no_grad():
        return module(*args)


@pytest.mark.parametrize("norm_type", ["layer_norm", "rms_norm"])
def test_generic_ada_layer_norm_continuous(norm_type, device):
    torch.manual_seed(0)
    module = AdaLayerNormContinuous(64, 32, elementwise_affine=True, eps=1e-6,
                                    norm_type=norm_type).to(device)
    for p in module.parameters():
        p.data += 0.1 * torch.randn_like(p)
    x, cond = torch.randn(B, 9, 64, device=device), torch.randn(B, 32, device=device)
    ref = forward_module(module, x, cond)
    fusebox.patch(module)
    with FuseboxOps() as ops:
        out = forward_module(module, x, cond)
    assert ops.calls == Counter({"fused_norm": 1})
    assert rel_err(out, ref) < 1e-5


def test_generic_skips_what_it_cannot_fuse():
    module = torch.nn.ModuleDict({
        "biased": RMSNorm(64, eps=1e-6, bias=True),
        "two_dims": torch.nn.LayerNorm((4, 16)),
        "ff": FeedForward(64, activation_fn="gelu-approximate"),
    })
    report = _modules_patch(module)
    assert {e.path: e.what for e in report.skipped} == {
        "biased": "RMSNorm with a bias or over several dims",
        "two_dims": "LayerNorm over several dims"}
    assert [e.path for e in report.patched] == ["ff.net.0"]
    assert _common.is_patched(module["ff"].net[0])


def _modules_patch(module):
    from fusebox.patch.report import PatchReport
    report = PatchReport()
    _modules.patch_generic(module, report)
    return report


@pytest.mark.parametrize("activation_fn", ["geglu", "swiglu", "gelu-approximate"])
def test_generic_activation_fused_under_cpu_offload(activation_fn):
    """The projection's weight is offloaded (its own hook loads it): the gated activation still
    runs fused on the projection's output."""
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    module = FeedForward(64, activation_fn=activation_fn).eval()
    x = torch.randn(B, 9, 64)
    ref = forward_module(module, x)
    _modules_patch(module)
    accelerate.cpu_offload(module, execution_device="cpu")
    assert module.net[0].proj.weight.device.type == "meta"
    with FuseboxOps() as ops:
        out = forward_module(module, x)
    assert ops.calls
    assert rel_err(out, ref) < 1e-5


# --------------------------------------------------------------------------- Z-Image


def _z_image(device="cpu", dtype=torch.float32, **overrides):
    """A tiny Z-Image (a noise refiner, a caption refiner and two main layers) with norm weights
    off their init, and inputs of two samples with captions of different lengths (padded)."""
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(0)
    model = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=64, n_layers=2,
        n_refiner_layers=1, n_heads=4, n_kv_heads=4, cap_feat_dim=32, axes_dims=[4, 6, 6],
        axes_lens=[64, 32, 32], **overrides).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model = model.to(device=device, dtype=dtype)
    inputs = dict(x=[torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)],
                  cap_feats=[torch.randn(7, 32), torch.randn(5, 32)], t=torch.tensor([0.3, 0.8]))
    inputs = {k: [t.to(device, dtype) for t in v] if isinstance(v, list) else v.to(device, dtype)
              for k, v in inputs.items()}
    return model, inputs


def _z_forward(model, inputs):
    with torch.no_grad():
        return torch.stack(model(**inputs, return_dict=False)[0])


def test_z_image_fp32_matches_unpatched(device):
    model, inputs = _z_image(device)
    ref = _z_forward(model, inputs)
    report = fusebox.patch(model)
    assert report.family == "z-image"
    patched = Counter(e.kind for e in report.patched)
    # the noise refiner and the main layers are modulated; the caption refiner is not
    assert patched["ZImageTransformerBlock"] == 3 and patched["Attention"] == 4, str(report)
    assert patched["FeedForward"] == 4, str(report)
    with FuseboxOps() as ops:
        out = _z_forward(model, inputs)
    assert {"rotary", "fused_norm", "gated_residual", "gated_act", "rms_norm"} <= set(ops.calls)
    assert rel_err(out, ref) < 1e-5


def test_z_image_compiled_block_has_no_graph_break(device):
    model, inputs = _z_image(device)
    fusebox.patch(model)
    block = model.layers[0]
    torch.manual_seed(1)
    x = torch.randn(B, 20, 64, device=device)
    mask = torch.ones(B, 20, dtype=torch.bool, device=device)
    freqs = torch.polar(torch.ones(B, 20, 8, device=device), torch.randn(B, 20, 8, device=device))
    adaln_input = torch.randn(B, 64, device=device)
    backend = GraphOps()
    torch._dynamo.reset()
    with torch.no_grad():
        ref = block(x, mask, freqs, adaln_input)
        out = torch.compile(block, fullgraph=True, backend=backend)(x, mask, freqs, adaln_input)
    assert torch.allclose(ref, out, rtol=1e-5, atol=1e-6)
    assert {"rotary", "fused_norm", "gated_residual"} <= backend.ops


# --------------------------------------------------------------------------- Krea 2


def _krea2(device, dtype=torch.float32):
    from diffusers import Krea2Transformer2DModel

    torch.manual_seed(0)
    model = Krea2Transformer2DModel(
        in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, timestep_embed_dim=16, text_hidden_dim=48,
        num_text_layers=3, text_num_attention_heads=2, text_num_key_value_heads=1,
        text_intermediate_size=40, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
        axes_dims_rope=(4, 6, 6), rope_theta=1000.0, norm_eps=1e-5).eval()
    with torch.no_grad():   # the zero-centred norm weights and the modulation tables start at 0
        for p in model.parameters():
            if p.dim() == 1 or not p.any():
                p.add_(0.1 * torch.randn_like(p))
    model = model.to(device=device, dtype=dtype)
    text, grid = 6, 4
    position_ids = torch.zeros(text + grid * grid, 3)
    position_ids[text:, 1] = torch.arange(grid).repeat_interleave(grid)
    position_ids[text:, 2] = torch.arange(grid).repeat(grid)
    mask = torch.ones(B, text, dtype=torch.bool)
    mask[1, -2:] = False   # the second prompt is shorter
    inputs = dict(hidden_states=torch.randn(B, grid * grid, 16),
                  encoder_hidden_states=torch.randn(B, text, 3, 48),
                  timestep=torch.tensor([0.3, 0.8]), position_ids=position_ids,
                  encoder_attention_mask=mask)
    return model, {k: v.to(device, dtype) if v.is_floating_point() and k != "position_ids"
                   else v.to(device) for k, v in inputs.items()}


def _krea2_forward(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def test_krea2_fp32_matches_unpatched(device):
    model, inputs = _krea2(device)
    ref = _krea2_forward(model, inputs)
    report = fusebox.patch(model)
    assert report.family == "krea2"
    patched = Counter(e.kind for e in report.patched)
    # 2 image blocks; the text fusion's layerwise and refiner blocks have attention and SwiGLU
    # too, and their norms (2 each), the text projection's and the final layer's run alone
    assert patched == Counter({"Krea2TransformerBlock": 2, "Krea2Attention": 4,
                               "Krea2SwiGLU": 4, "Krea2RMSNorm": 6}), str(report)
    with FuseboxOps() as ops:
        out = _krea2_forward(model, inputs)
    assert {"rotary", "fused_norm", "gated_residual", "gated_act", "rms_norm"} <= set(ops.calls)
    assert rel_err(out, ref) < 1e-5


def test_krea2_compiled_block_has_no_graph_break(device):
    model, inputs = _krea2(device)
    fusebox.patch(model)
    block = model.transformer_blocks[0]
    torch.manual_seed(1)
    x = torch.randn(B, 22, 64, device=device)
    temb = torch.randn(B, 1, 6 * 64, device=device)
    cos, sin = model.rotary_emb(inputs["position_ids"])
    mask = torch.ones(B, 1, 1, 22, dtype=torch.bool, device=device)
    mask[0, ..., :3] = False
    backend = GraphOps()
    torch._dynamo.reset()
    with torch.no_grad():
        ref = block(x, temb, (cos, sin), mask)
        out = torch.compile(block, fullgraph=True, backend=backend)(x, temb, (cos, sin), mask)
    assert torch.allclose(ref, out, rtol=1e-5, atol=1e-6)
    assert {"rotary", "fused_norm", "gated_residual", "gated_act"} <= backend.ops


# families built and run by functions of their own: (build(device, dtype), forward(model, inputs))
OWN_BUILDERS = {"z-image": (_z_image, _z_forward), "krea2": (_krea2, _krea2_forward)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("family", list(OWN_BUILDERS))
def test_own_builder_half_within_eager_half_spread(family, dtype, device):
    build, forward = OWN_BUILDERS[family]
    model, inputs = build(device)
    ref = forward(model, inputs)
    model_half, inputs_half = build(device, dtype)
    eager = forward(model_half, inputs_half)
    fusebox.patch(model_half)
    patched = forward(model_half, inputs_half)
    assert patched.dtype == dtype
    assert rel_err(patched, ref) <= 1.5 * rel_err(eager, ref), (rel_err(patched, ref),
                                                               rel_err(eager, ref))


@pytest.mark.parametrize("family", list(OWN_BUILDERS))
def test_own_builder_unpatch_restores_exactly(family, device):
    build, forward = OWN_BUILDERS[family]
    model, inputs = build(device)
    ref = forward(model, inputs)
    processors = _processors(model)
    fusebox.patch(model)
    assert fusebox.unpatch(model) > 0
    assert all(_processors(model)[n] is p for n, p in processors.items())
    with FuseboxOps() as ops:
        out = forward(model, inputs)
    assert not ops.calls
    assert torch.equal(out, ref)


# --------------------------------------------------------------------------- HunyuanImage 2.1


# text padding of the Qwen stream [B, 7] and the ByT5 glyph stream [B, 3] (rows: samples)
_HYIMG_PADDING = {
    "none": ([7, 7], [3, 3]),                 # nothing to trim: unmasked attention
    "per sample": ([7, 5], [2, 3]),           # masked attention over all kept keys
    "same suffix": ([4, 4], [0, 0]),          # the glyph stream goes, the Qwen suffix too
}


def _hunyuan_image(device="cpu", dtype=torch.float32, padding="per sample", **overrides):
    """A tiny HunyuanImage 2.1 (the ByT5 glyph stream on) with norm weights off their init, and
    inputs whose text streams are padded as ``padding`` says (valid tokens first per sample)."""
    from diffusers import HunyuanImageTransformer2DModel

    torch.manual_seed(0)
    config = dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16,
                  num_layers=2, num_single_layers=2, num_refiner_layers=1, patch_size=(1, 1),
                  text_embed_dim=32, text_embed_2_dim=24, rope_axes_dim=(8, 8))
    model = HunyuanImageTransformer2DModel(**dict(config, **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model = model.to(device=device, dtype=dtype)

    def mask(valid, n):
        return (torch.arange(n)[None] < torch.tensor(valid)[:, None]).float()

    valid, valid_2 = _HYIMG_PADDING[padding]
    inputs = dict(hidden_states=torch.randn(B, 4, 4, 6), timestep=torch.tensor([10.0, 500.0]),
                  encoder_hidden_states=torch.randn(B, 7, 32),
                  encoder_attention_mask=mask(valid, 7),
                  encoder_hidden_states_2=torch.randn(B, 3, 24),
                  encoder_attention_mask_2=mask(valid_2, 3))
    return model, {k: v.to(device, dtype if "mask" not in k else v.dtype)
                   for k, v in inputs.items()}


def _hyimg_forward(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


HYIMG_OPS = {"rotary", "rms_norm", "fused_norm", "gated_residual", "act"}


@pytest.mark.parametrize("padding", list(_HYIMG_PADDING))
def test_hunyuan_image_fp32_matches_unpatched(padding, device):
    model, inputs = _hunyuan_image(device, padding=padding)
    ref = _hyimg_forward(model, inputs)
    report = fusebox.patch(model)
    assert report.family == "hunyuan-image"
    patched = Counter(e.kind for e in report.patched)
    assert patched["HunyuanImageTransformerBlock"] == 2, str(report)
    assert patched["HunyuanImageSingleTransformerBlock"] == 2, str(report)
    # the blocks' attention; the refiner's (a plain AttnProcessor2_0) is not HunyuanImage's
    assert patched["Attention"] == 4, str(report)
    assert patched["AdaLayerNormZero"] == 4 and patched["AdaLayerNormZeroSingle"] == 2, str(report)
    seen = []
    model.transformer_blocks[0].register_forward_pre_hook(
        lambda m, args: seen.append(args[1].shape[1]))
    with FuseboxOps() as ops:
        out = _hyimg_forward(model, inputs)
    assert HYIMG_OPS <= set(ops.calls), ops.calls
    # the blocks see the text without the padding after every sample's last valid token
    assert seen == [{"none": 10, "per sample": 10, "same suffix": 4}[padding]]
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_hunyuan_image_half_within_eager_half_spread(dtype, device):
    model, inputs = _hunyuan_image(device)
    ref = _hyimg_forward(model, inputs)
    model_half, inputs_half = _hunyuan_image(device, dtype)
    eager = _hyimg_forward(model_half, inputs_half)
    fusebox.patch(model_half)
    with FuseboxOps() as ops:
        patched = _hyimg_forward(model_half, inputs_half)
    assert HYIMG_OPS <= set(ops.calls), ops.calls
    assert patched.dtype == dtype
    assert rel_err(patched, ref) <= 1.5 * rel_err(eager, ref), (rel_err(patched, ref),
                                                               rel_err(eager, ref))


def test_hunyuan_image_unpatch_restores_exactly(device):
    model, inputs = _hunyuan_image(device, padding="same suffix")
    ref = _hyimg_forward(model, inputs)
    processors = _processors(model)
    dicts = {n: set(m.__dict__) for n, m in model.named_modules()}
    hooks = _module_hooks(model)
    fusebox.patch(model)
    fusebox.patch(model)   # patching twice changes nothing more
    assert fusebox.unpatch(model) > 0
    assert all(_processors(model)[n] is p for n, p in processors.items())
    assert {n: set(m.__dict__) for n, m in model.named_modules()} == dicts
    assert _module_hooks(model) == hooks
    with FuseboxOps() as ops:
        out = _hyimg_forward(model, inputs)
    assert not ops.calls
    assert torch.equal(out, ref)


def test_hunyuan_image_autograd_falls_back_to_original():
    model, inputs = _hunyuan_image(padding="none")
    inputs["hidden_states"].requires_grad_(True)
    out = assert_patch_falls_back(model, lambda m: m(**inputs, return_dict=False)[0])
    out.square().mean().backward()
    assert inputs["hidden_states"].grad is not None


def test_hunyuan_image_blocks_read_as_hunyuan_video(monkeypatch):
    """HunyuanImage's blocks and processor take HunyuanVideo's fused code because their source
    reads as HunyuanVideo's; a class whose source drifts keeps its own forward."""
    from diffusers.models.transformers import transformer_hunyuan_video as hv
    from diffusers.models.transformers import transformer_hunyuanimage as hi
    from fusebox.patch.dit import hunyuan_image

    reads = hunyuan_image.reads_as_hunyuan_video
    assert reads(hi.HunyuanImageTransformerBlock.forward, hv.HunyuanVideoTransformerBlock.forward)
    assert reads(hi.HunyuanImageSingleTransformerBlock.forward,
                 hv.HunyuanVideoSingleTransformerBlock.forward)
    assert reads(hi.HunyuanImageAttnProcessor.__call__, hv.HunyuanVideoAttnProcessor2_0.__call__)
    assert not reads(hi.HunyuanImageTransformerBlock.forward,
                     hv.HunyuanVideoSingleTransformerBlock.forward)

    monkeypatch.setattr(hunyuan_image, "reads_as_hunyuan_video", lambda fn, video_fn: False)
    model, inputs = _hunyuan_image(padding="none")
    ref = _hyimg_forward(model, inputs)
    report = fusebox.patch(model)
    patched = Counter(e.kind for e in report.patched)
    assert not patched["HunyuanImageTransformerBlock"] and not patched["Attention"], str(report)
    assert rel_err(_hyimg_forward(model, inputs), ref) < 1e-5


def test_hunyuan_image_compiled_block_has_no_graph_break(device):
    model, inputs = _hunyuan_image(device)
    fusebox.patch(model)
    torch.manual_seed(1)
    d = 64
    rotary = model.rope(torch.randn(B, 4, 3, 4, device=device))      # 12 image tokens
    x, c, temb = (torch.randn(B, 12, d, device=device), torch.randn(B, 5, d, device=device),
                  torch.randn(B, d, device=device))
    mask = torch.ones(B, 1, 1, 17, dtype=torch.bool, device=device)
    mask[1, ..., 15:] = False
    backend = GraphOps()
    for block in (model.transformer_blocks[0], model.single_transformer_blocks[0]):
        torch._dynamo.reset()
        with torch.no_grad():
            ref = block(x, c, temb, attention_mask=mask, image_rotary_emb=rotary)
            out = torch.compile(block, fullgraph=True, backend=backend)(
                x, c, temb, attention_mask=mask, image_rotary_emb=rotary)
        for r, o in zip(ref, out):
            assert torch.allclose(r, o, rtol=1e-5, atol=1e-6)
    assert HYIMG_OPS <= backend.ops      # the fused path is what was traced
