"""fusebox.patch on the diffusers video transformers (LTX-Video, Wan): tiny random models,
patched vs unpatched outputs, the fused ops actually running, unpatch, the report, offload
hooks, autograd fallback, torch.compile of a patched block, and the e2e bench CLI."""

import copy

from collections import Counter

import pytest
import torch

from helpers import (
    DEVICES,
    requires_cuda,
    FuseboxOps,
    GraphOps,
    assert_patch_falls_back,
    assert_unpatch_keeps_hooks,
    offload_and_patch,
    rel_err,
)

diffusers = pytest.importorskip("diffusers")

import fusebox  # noqa: E402
from fusebox.patch import _common  # noqa: E402

# fp32: every fused op rounds once where diffusers rounds after each elementwise op, so the two
# differ by fp32 rounding only; over 2 blocks of attention + FFN that stays near 1e-7.
FP32_TOL = 1e-5


# --------------------------------------------------------------------------- models


def tiny_ltx(device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
        cross_attention_dim=32, caption_channels=32, num_layers=2)
    return keep_fp32(model.to(device).eval(), dtype)


def ltx_inputs(device="cpu", dtype=torch.float32, per_token=False):
    g = torch.Generator().manual_seed(1)
    b, f, h, w, text = 2, 2, 3, 4, 5
    s = f * h * w
    mask = torch.ones(b, text)
    mask[0, -2:] = 0
    timestep = torch.rand(b, s, generator=g) * 1000 if per_token else torch.tensor([300.0, 700.0])
    tensors = dict(hidden_states=torch.randn(b, s, 8, generator=g),
                   encoder_hidden_states=torch.randn(b, text, 32, generator=g))
    kw = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    kw.update(timestep=timestep.to(device), encoder_attention_mask=mask.to(device), num_frames=f,
              height=h, width=w, rope_interpolation_scale=(8 / 25, 32, 32), return_dict=False)
    return kw


def tiny_wan(device="cpu", dtype=torch.float32, **config):
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=24, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=96, num_layers=2, rope_max_seq_len=64,
        **config)
    model = model.to(device=device).eval()
    return keep_fp32(model, dtype)


def tiny_skyreels(device="cpu", dtype=torch.float32, **config):
    """SkyReels-V2: Wan 2.1's blocks; ``num_frame_per_block`` 2 gives diffusion forcing's
    causal frame-block mask."""
    torch.manual_seed(0)
    model = diffusers.SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=24, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=96, num_layers=2, rope_max_seq_len=64,
        **config)
    return keep_fp32(model.to(device=device).eval(), dtype)


def skyreels_inputs(device="cpu", dtype=torch.float32, forcing=False):
    """Four latent frames; with ``forcing``, a timestep per frame (per-token modulation)."""
    g = torch.Generator().manual_seed(1)
    b, f, h, w = 2, 4, 4, 6
    timestep = torch.rand(b, f, generator=g) * 1000 if forcing else torch.tensor([300.0, 700.0])
    tensors = dict(hidden_states=torch.randn(b, 4, f, h, w, generator=g),
                   encoder_hidden_states=torch.randn(b, 7, 32, generator=g))
    kw = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    kw.update(timestep=timestep.to(device), enable_diffusion_forcing=forcing, return_dict=False)
    return kw


def keep_fp32(model, dtype):
    """``model`` in ``dtype`` with its ``_keep_in_fp32_modules`` in fp32, as from_pretrained
    loads it."""
    from fusebox.bench.e2e.dit import keep_fp32_modules

    return model if dtype == torch.float32 else keep_fp32_modules(model.to(dtype))


def wan_inputs(device="cpu", dtype=torch.float32, per_token=False, image=False):
    g = torch.Generator().manual_seed(1)
    b, f, h, w = 2, 3, 4, 6
    s = f * (h // 2) * (w // 2)
    timestep = torch.rand(b, s, generator=g) * 1000 if per_token else torch.tensor([300.0, 700.0])
    tensors = dict(hidden_states=torch.randn(b, 4, f, h, w, generator=g),
                   encoder_hidden_states=torch.randn(b, 512 if image else 7, 32, generator=g))
    if image:
        tensors["encoder_hidden_states_image"] = torch.randn(b, 5, 16, generator=g)
    kw = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    kw.update(timestep=timestep.to(device), return_dict=False)
    return kw


CASES = {
    "ltx-t2v": (tiny_ltx, {}, dict(per_token=False)),
    "ltx-i2v": (tiny_ltx, {}, dict(per_token=True)),
    "wan-t2v": (tiny_wan, {}, dict(per_token=False)),
    "wan-ti2v": (tiny_wan, {}, dict(per_token=True)),
    "wan-i2v": (tiny_wan, dict(image_dim=16, added_kv_proj_dim=48), dict(image=True)),
    "skyreels-t2v": (tiny_skyreels, {}, {}),
    "skyreels-forcing": (tiny_skyreels, dict(num_frame_per_block=2), dict(forcing=True)),
}
INPUTS = {tiny_ltx: ltx_inputs, tiny_wan: wan_inputs, tiny_skyreels: skyreels_inputs}
FAMILY = {"ltx": "ltx-video", "wan": "wan", "skyreels": "skyreels-v2"}


def build(case, device, dtype=torch.float32):
    make, config, inputs = CASES[case]
    model = make(device, dtype, **config)
    return model, INPUTS[make](device, dtype, **inputs)


def run(model, kw):
    with torch.no_grad():
        return model(**kw)[0]


# Per block: LTX runs fused_norm x2 (adaln, residual+norm), gated_residual x3 (the modulation
# sum and two residuals), rotary x1 (attn1; attn2 norms q and k with rms_norm), act x1. Wan:
# fused_norm x3, gated_residual x2 (the modulation sum, the feed-forward residual).
EXPECTED_OPS = {
    "ltx": {"fused_norm": 4, "gated_residual": 6, "rotary": 2, "rms_norm": 4, "act": 2},
    "wan": {"fused_norm": 6, "gated_residual": 4, "rotary": 2, "rms_norm": 4, "act": 2},
}
EXPECTED_OPS["skyreels"] = EXPECTED_OPS["wan"]
# Per-token Wan and SkyReels-V2 blocks pass the table and the projection to the fused ops (split
# modulation): no modulation sum, so one gated_residual per block
SPLIT_MODULATION = {"wan-ti2v", "skyreels-forcing"}


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_patched_matches_unpatched(case, device):
    model, kw = build(case, device)
    ref = run(model, kw)
    report = fusebox.patch(model)
    assert report.family == FAMILY[case.split("-")[0]]
    with FuseboxOps() as ops:
        out = run(model, kw)
    expected = dict(EXPECTED_OPS[case.split("-")[0]])
    if case == "wan-i2v":   # the image cross-attention keeps diffusers' processor
        expected.pop("rms_norm")
    if case in SPLIT_MODULATION:
        expected["gated_residual"] = 2
        assert ops.calls.get("gated_residual", 0) == 2, "the per-token modulation sum was formed"
    for op, n in expected.items():
        assert ops.calls.get(op, 0) >= n, f"{op}: ran {ops.calls.get(op, 0)} times, expected {n}"
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["ltx-t2v", "ltx-i2v", "wan-t2v", "wan-ti2v", "skyreels-forcing"])
def test_bf16_within_bf16_spread(case, device):
    """bf16 patched output is as close to the fp32 model as bf16 eager is (same weights)."""
    model, kw = build(case, device)
    ref32 = run(model, kw)
    model, kw16 = build(case, device, torch.bfloat16)
    eager16 = run(model, kw16)
    fusebox.patch(model)
    patched16 = run(model, kw16)
    assert patched16.dtype == torch.bfloat16 and bool(torch.isfinite(patched16).all())
    spread = rel_err(eager16, ref32)
    assert 1e-4 < spread < 5e-2, spread      # bf16 really ran, and not broken
    # fusebox rounds once where diffusers rounds after every op: never farther from fp32
    # than bf16 eager beyond noise, and patched-vs-eager within the spread
    assert rel_err(patched16, ref32) < 1.25 * spread
    assert rel_err(patched16, eager16) < 1.5 * spread


# --------------------------------------------------------------------------- patch lifecycle


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("per_token", [False, True], ids=["sample", "token"])
def test_modulation_sum_exact_in_one_launch(device, dtype, per_token):
    """A block's ``scale_shift_table + temb`` (LTX-Video's [B, T, 6, D] layout) runs as one
    fusebox launch and equals the eager sum bit for bit; a table of another dtype takes the eager
    sum."""
    from fusebox.patch.dit._shared import modulation_sum

    g = torch.Generator().manual_seed(3)
    table = torch.randn(6, 37, generator=g).to(device, dtype)[None, None]
    emb = torch.randn(2, 5 if per_token else 1, 6, 37, generator=g).to(device, dtype)
    with FuseboxOps() as ops:
        out = modulation_sum(table, emb)
    assert ops.calls == {"gated_residual": 1}
    assert out.shape == emb.shape and out.dtype == dtype
    assert torch.equal(out, table + emb)
    with FuseboxOps() as ops:
        mixed = modulation_sum(table.double(), emb)
    assert not ops.calls and torch.equal(mixed, table.double() + emb)


@pytest.mark.parametrize("layout", ["sample", "token", "token terms first"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["f32", "bf16", "f32-table", "f32-temb"])
def test_wan_modulation_terms_exact(layout, dtypes):
    """The Wan block's six modulation terms equal the model's fp32 ``table + temb.float()``
    bit for bit, whatever the table's and temb's dtypes (a 16-bit temb is widened inside the
    add instead of copied first). Per token with an fp32 table and temb in x's dtype they come
    split, as the table's rows and views of temb, whose fp32 sum (what the fused ops add) is the
    model's term."""
    from fusebox.patch.dit.wan import _modulation

    table_dtype, temb_dtype = dtypes
    g = torch.Generator().manual_seed(5)
    table = torch.randn(1, 6, 37, generator=g).to(table_dtype)
    shape = {"sample": (2, 6, 37), "token": (2, 5, 6, 37), "token terms first": (2, 6, 5, 37)}[layout]
    temb = torch.randn(*shape, generator=g).to(temb_dtype)
    terms, tables = _modulation(table, temb, layout == "token terms first", x_dtype=temb_dtype)
    if layout == "sample":
        expected = (table + temb.float()).chunk(6, dim=1)
    elif layout == "token":
        expected = [t.squeeze(2) for t in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    else:
        expected = [t.squeeze(1) for t in (table.unsqueeze(2) + temb.float()).chunk(6, dim=1)]
    split = layout != "sample" and table_dtype == torch.float32
    assert len(terms) == len(tables) == 6
    assert all((t is not None) == split for t in tables)
    for got, row, want in zip(terms, tables, expected):
        if split:
            assert got.dtype == temb_dtype and row.shape == (37,) and row.is_contiguous()
            got = row + got.float()
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got, want)


def test_wan_modulation_split_needs_unit_stride():
    """A per-token temb whose channels are strided (not a layout the model makes) takes the
    summed fp32 terms: the fused ops read unit-stride rows only."""
    from fusebox.patch.dit.wan import _modulation

    g = torch.Generator().manual_seed(6)
    table = torch.randn(1, 6, 37, generator=g)
    temb = torch.randn(2, 5, 37, 6, generator=g).to(torch.bfloat16).transpose(2, 3)
    terms, tables = _modulation(table, temb, False, x_dtype=torch.bfloat16)
    assert all(t is None for t in tables)
    expected = (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
    assert all(torch.equal(got, want.squeeze(2)) for got, want in zip(terms, expected))


def _state(model):
    return {name: (type(getattr(m, "processor", None)).__name__, "forward" in m.__dict__)
            for name, m in model.named_modules()}


@pytest.mark.parametrize("case", ["ltx-t2v", "wan-i2v", "skyreels-forcing"])
def test_unpatch_restores(case):
    model, kw = build(case, "cpu")
    before = _state(model)
    ref = run(model, kw)
    fusebox.patch(model)
    assert fusebox.is_patched(model)
    n = fusebox.unpatch(model)
    assert n > 0 and not fusebox.is_patched(model)
    assert _state(model) == before
    assert not any("_fusebox_undo" in m.__dict__ for m in model.modules())
    assert torch.equal(run(model, kw), ref)


def test_patch_twice_is_one_patch():
    model, kw = build("ltx-t2v", "cpu")
    fusebox.patch(model)
    out = run(model, kw)
    fusebox.patch(model)
    attn = model.transformer_blocks[0].attn1
    assert type(attn.processor.original).__name__ == "LTXVideoAttnProcessor"
    assert torch.equal(run(model, kw), out)
    fusebox.unpatch(model)
    assert type(attn.processor).__name__ == "LTXVideoAttnProcessor"


def test_report_ltx():
    model, _ = build("ltx-t2v", "cpu")
    report = fusebox.patch(model)
    patched = {e.path: e for e in report.patched}
    assert report.family == "ltx-video"
    for i in range(2):
        assert "adaln" in patched[f"transformer_blocks.{i}"].what
        assert "qk_norm_rope" in patched[f"transformer_blocks.{i}.attn1"].what
        assert f"transformer_blocks.{i}.attn2" in patched
    # the final norm is a generic LayerNorm patch; its modulation stays eager
    assert patched["norm_out"].what == "layer_norm"
    assert "[1, S, D]" in patched["rope"].what
    # the feed-forward GELU is the generic GELU patch
    assert "gelu_tanh" in patched["transformer_blocks.0.ff.net.0"].what
    # the children a block or processor fuses are marked, so the generic module pass leaves
    # them alone (and says so); their own forwards are untouched
    skipped = {e.path: e.what for e in report.skipped}
    block = model.transformer_blocks[0]
    for name in ("norm1", "norm2", "attn1.norm_q", "attn1.norm_k", "attn2.norm_q"):
        assert skipped[f"transformer_blocks.0.{name}"].startswith("done by the ")
        assert not _common.is_patched(block.get_submodule(name))
    assert "LTXVideoTransformerBlock" in str(report)


def test_report_wan():
    model, _ = build("wan-t2v", "cpu")
    report = fusebox.patch(model)
    patched = {e.path: e.what for e in report.patched}
    skipped = {e.path: e.what for e in report.skipped}
    assert patched["norm_out"] == "layer_norm"
    assert "gelu_tanh" in patched["blocks.0.ffn.net.0"]
    for name in ("norm1", "norm2", "norm3", "attn1.norm_q", "attn2.norm_k"):
        assert skipped[f"blocks.0.{name}"].startswith("done by the ")


@pytest.mark.parametrize("case", ["ltx-t2v", "ltx-i2v"])
def test_ltx_rope_one_table_for_the_batch(case):
    """Same grid for every sample: one [1, S, D] table, equal to each row of diffusers' own."""
    model, kw = build(case, "cpu")
    args = (kw["hidden_states"], kw["num_frames"], kw["height"], kw["width"],
            kw["rope_interpolation_scale"])
    ref_cos, ref_sin = model.rope(*args)
    fusebox.patch(model)
    cos, sin = model.rope(*args)
    assert cos.shape == (1,) + ref_cos.shape[1:] and ref_cos.shape[0] == 2
    assert torch.equal(cos.expand_as(ref_cos), ref_cos)
    assert torch.equal(sin.expand_as(ref_sin), ref_sin)
    # and diffusers' own processor (the fallback) broadcasts the batch-1 table the same way
    attn = model.transformer_blocks[0].attn1
    x = torch.randn(2, ref_cos.shape[1], attn.query_dim)
    with torch.no_grad():
        full = attn.processor.original(attn, x, image_rotary_emb=(ref_cos, ref_sin))
        one = attn.processor.original(attn, x, image_rotary_emb=(cos, sin))
        fused = attn.processor(attn, x, image_rotary_emb=(cos, sin))
    assert torch.equal(one, full)
    assert rel_err(fused, full) < FP32_TOL


def test_ltx_rope_per_sample_scale_keeps_per_sample_tables():
    model, kw = build("ltx-t2v", "cpu")
    scale = (torch.tensor([0.32, 0.5]).view(2, 1, 1, 1, 1), 32, 32)   # one per sample
    args = (kw["hidden_states"], kw["num_frames"], kw["height"], kw["width"], scale)
    ref_cos, _ = model.rope(*args)
    fusebox.patch(model)
    cos, _ = model.rope(*args)
    assert cos.shape[0] == 2 and torch.equal(cos, ref_cos)
    assert not torch.equal(cos[0], cos[1])


def test_report_wan_i2v_note():
    model, _ = build("wan-i2v", "cpu")
    report = fusebox.patch(model)
    assert report.family == "wan"
    skipped = {e.path: e.what for e in report.skipped}
    assert all("I2V" in skipped[f"blocks.{i}.attn2"] for i in range(2))
    assert any("image" in n for n in report.notes)
    assert sum(e.kind == "WanTransformerBlock" for e in report.patched) == 2


def test_custom_processor_left_alone():
    model, kw = build("wan-t2v", "cpu")
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    class Custom(WanAttnProcessor):
        pass

    model.blocks[0].attn1.set_processor(Custom())
    report = fusebox.patch(model)
    assert any(e.path == "blocks.0.attn1" and "custom" in e.what for e in report.skipped)
    assert type(model.blocks[0].attn1.processor) is Custom


def test_attention_backend_reaches_the_replaced_processor():
    model, _ = build("ltx-t2v", "cpu")
    fusebox.patch(model)
    model.set_attention_backend("native")
    processor = model.transformer_blocks[0].attn1.processor
    assert processor.original._attention_backend == processor._attention_backend
    assert processor._attention_backend.value == "native"


# --------------------------------------------------------------------------- fallbacks


@pytest.mark.parametrize("case", ["ltx-t2v", "wan-t2v", "skyreels-forcing"])
def test_autograd_falls_back(case):
    model, kw = build(case, "cpu")
    out = assert_patch_falls_back(model, lambda m: m(**kw)[0])   # every fused forward fell back
    out.sum().backward()
    assert all(p.grad is not None for p in model.transformer_blocks[0].parameters()) \
        if case.startswith("ltx") else model.blocks[0].scale_shift_table.grad is not None


def test_float64_falls_back():
    model, kw = build("ltx-i2v", "cpu", torch.float64)
    assert_patch_falls_back(model, lambda m: run(m, kw))


# --------------------------------------------------------------------------- hooks


@pytest.mark.parametrize("case", ["ltx-t2v", "wan-t2v"])
@pytest.mark.parametrize("order", ["patch-then-offload", "offload-then-patch"])
def test_accelerate_cpu_offload(case, order):
    model, kw = build(case, "cpu")
    ref = run(model, kw)
    offload_and_patch(model, order)
    blocks = model.transformer_blocks if case.startswith("ltx") else model.blocks
    assert _common.has_hooks(blocks[0])
    with FuseboxOps() as ops:
        out = run(model, kw)
    assert ops.calls.get("gated_residual", 0) >= 2 * len(blocks)   # the fused blocks ran
    assert rel_err(out, ref) < FP32_TOL
    assert_unpatch_keeps_hooks(model, lambda m: run(m, kw), ref)


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_diffusers_group_offload(offload_type):
    model, kw = build("ltx-i2v", "cpu")
    ref = run(model, kw)
    fusebox.patch(model)
    options = dict(num_blocks_per_group=1) if offload_type == "block_level" else {}
    model.enable_group_offload(onload_device=torch.device("cpu"), offload_type=offload_type,
                               **options)
    with FuseboxOps() as ops:
        out = run(model, kw)
    assert ops.calls.get("gated_residual", 0) >= 4     # the fused blocks ran
    assert rel_err(out, ref) < FP32_TOL
    fusebox.unpatch(model)                              # the group offload hooks stay
    assert _common.has_hooks(model.transformer_blocks[0])
    with FuseboxOps() as ops:
        out = run(model, kw)
    assert not ops.calls
    assert torch.equal(out, ref)


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["ltx-i2v", "wan-t2v", "skyreels-forcing"])
def test_compiled_patched_block_fullgraph(case, device):
    model, kw = build(case, device)
    captured = {}

    def grab(module, args, kwargs):
        captured.setdefault("args", (args, kwargs))

    blocks = model.transformer_blocks if case.startswith("ltx") else model.blocks
    handle = blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    run(model, kw)
    handle.remove()
    args, kwargs = captured["args"]
    block = blocks[0]
    fusebox.patch(model)
    torch._dynamo.reset()
    backend = GraphOps()
    with torch.no_grad():
        eager = block(*args, **kwargs)
        out = torch.compile(block, fullgraph=True, backend=backend)(*args, **kwargs)
    assert {"rotary", "fused_norm"} <= backend.ops      # the fused path is what was traced
    assert rel_err(out, eager) < FP32_TOL


@pytest.mark.parametrize("case", ["ltx-i2v", "wan-ti2v", "skyreels-forcing"])
def test_compiled_patched_model_fullgraph(case):
    model, kw = build(case, "cpu")
    ref = run(model, kw)
    fusebox.patch(model)
    torch._dynamo.reset()
    backend = GraphOps()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    assert rel_err(run(compiled, kw), ref) < FP32_TOL
    assert {"rotary", "fused_norm"} <= backend.ops      # the fused path was traced


def test_skyreels_block_takes_its_mask_by_keyword_too():
    """SkyReels-V2's block signature names the mask; a caller may pass it by keyword."""
    model, kw = build("skyreels-forcing", "cpu")
    captured = {}
    handle = model.blocks[0].register_forward_pre_hook(
        lambda module, args: captured.setdefault("args", args))
    run(model, kw)
    handle.remove()
    *head, mask = captured["args"]
    assert mask is not None
    block = model.blocks[0]
    with torch.no_grad():
        ref = block(*head, mask)
        fusebox.patch(model)
        positional, keyword = block(*head, mask), block(*head, attention_mask=mask)
    assert torch.equal(positional, keyword) and rel_err(keyword, ref) < FP32_TOL


# --------------------------------------------------------------------------- layouts


def test_ltx_video_coords():
    """Per-sample coordinates (LTX condition pipeline) keep one cos/sin table per sample."""
    model, kw = build("ltx-i2v", "cpu")
    b, s = kw["hidden_states"].shape[:2]
    g = torch.Generator().manual_seed(2)
    kw["video_coords"] = torch.rand(b, 3, s, generator=g) * torch.tensor([20.0, 2048, 2048])[:, None]
    ref = run(model, kw)
    fusebox.patch(model)
    assert rel_err(run(model, kw), ref) < FP32_TOL


def test_wan_fused_qkv_projections():
    """``fuse_qkv_projections`` gives q/k as strided chunks of one projection: read in place."""
    model, kw = build("wan-t2v", "cpu")
    ref = run(model, kw)
    model.fuse_qkv_projections()
    fusebox.patch(model)
    with FuseboxOps() as ops:
        out = run(model, kw)
    assert ops.calls.get("rotary", 0) == 2
    assert rel_err(out, ref) < FP32_TOL


# --------------------------------------------------------------------------- bench CLI


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wan_vace(device, dtype):
    """WanVACE: its WanTransformerBlocks get the Wan fusions although the model hands the first
    one the patch embedding's transposed (strided) output; its VACE blocks keep their forward."""
    torch.manual_seed(0)
    model = diffusers.WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=24, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=96, num_layers=2, rope_max_seq_len=64,
        vace_layers=[0], vace_in_channels=8).to(device).eval()
    g = torch.Generator().manual_seed(1)
    b, f, h, w = 2, 3, 4, 6
    inputs = dict(hidden_states=torch.randn(b, 4, f, h, w, generator=g),
                  encoder_hidden_states=torch.randn(b, 7, 32, generator=g),
                  control_hidden_states=torch.randn(b, 8, f, h, w, generator=g))
    inputs = {k: v.to(device) for k, v in inputs.items()}
    timestep = torch.tensor([300.0, 700.0], device=device)
    with torch.no_grad():
        ref = model(timestep=timestep, **inputs, return_dict=False)[0]
        half = keep_fp32(copy.deepcopy(model), dtype)
        half_inputs = {k: v.to(dtype) for k, v in inputs.items()}
        eager = half(timestep=timestep, **half_inputs, return_dict=False)[0]
        report = fusebox.patch(half)
        out = half(timestep=timestep, **half_inputs, return_dict=False)[0]
    assert sum(e.kind == "WanTransformerBlock" for e in report.patched) == 2, str(report)
    if dtype == torch.float32:
        assert rel_err(out, ref) < 1e-5
    else:
        assert rel_err(out, ref) <= 1.5 * rel_err(eager, ref), (rel_err(out, ref), rel_err(eager, ref))


def _patch_against_unpatched(model, inputs):
    """(report, fused ops run, patched output, unpatched output) of one forward on ``inputs``."""
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
        report = fusebox.patch(model)
        with FuseboxOps() as ops:
            out = model(**inputs, return_dict=False)[0]
    return report, ops, out, ref


def test_chronoedit_gets_the_wan_fusions(device):
    """ChronoEdit defines its own WanTransformerBlock / WanAttention / WanAttnProcessor classes,
    which read as Wan's: the Wan family patches them, with the same result as unpatched."""
    torch.manual_seed(0)
    model = diffusers.ChronoEditTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=24, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=96, num_layers=2,
        rope_max_seq_len=64).to(device).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 4, 3, 4, 6, generator=g).to(device),
                  timestep=torch.tensor([300.0, 700.0], device=device),
                  encoder_hidden_states=torch.randn(2, 7, 32, generator=g).to(device))
    report, ops, out, ref = _patch_against_unpatched(model, inputs)
    assert report.family == "wan"
    assert ops.calls["rotary"] == 2 and ops.calls["gated_residual"] == 4, ops.calls
    assert rel_err(out, ref) < 1e-5


def test_wan_animate_gets_the_wan_fusions(device):
    """Wan-Animate copies Wan's block, attention and processor classes under Wan's names, with
    pose latents, a face motion encoder and face blocks around them: the Wan family fuses the
    blocks, with the unpatched result (weights moved off their init values)."""
    torch.manual_seed(0)
    model = diffusers.WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=24, in_channels=36,
        latent_channels=16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=96, num_layers=2,
        image_dim=16, rope_max_seq_len=64, motion_encoder_size=32, motion_style_dim=32,
        motion_dim=8, motion_encoder_dim=48, face_encoder_hidden_dim=48,
        face_encoder_num_heads=2, inject_face_latents_blocks=1).to(device).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    tensors = dict(hidden_states=torch.randn(1, 36, 3, 4, 6, generator=g),
                   encoder_hidden_states=torch.randn(1, 7, 32, generator=g),
                   encoder_hidden_states_image=torch.randn(1, 5, 16, generator=g),
                   pose_hidden_states=torch.randn(1, 16, 2, 4, 6, generator=g),
                   face_pixel_values=torch.randn(1, 3, 5, 32, 32, generator=g))
    inputs = {k: v.to(device) for k, v in tensors.items()}
    inputs["timestep"] = torch.tensor([500.0], device=device)
    report, ops, out, ref = _patch_against_unpatched(model, inputs)
    assert report.family == "wan"
    assert ops.calls["rotary"] == 2 and ops.calls["fused_norm"] >= 6, ops.calls
    assert rel_err(out, ref) < 1e-5


# --------------------------------------------------------------------------- LTX-2

# diffusers' own tiny LTX-2 (tests/models/transformers/test_models_transformer_ltx2.py)
LTX2_TINY = dict(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1,
                 num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                 audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
                 audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
                 qk_norm="rms_norm_across_heads", caption_channels=16,
                 rope_double_precision=False)
# LTX-2.3's additions: per-head attention gates, modulated text cross-attention (queries and
# the text keys/values, the latter from sigma), affine block norms
LTX23 = dict(gated_attn=True, audio_gated_attn=True, cross_attn_mod=True,
             audio_cross_attn_mod=True, norm_elementwise_affine=True)
LTX2_CASES = {
    "ltx2-interleaved": (dict(rope_type="interleaved"), {}),
    "ltx2-split": (dict(rope_type="split"), {}),      # the LTX-2.0 checkpoints' RoPE
    "ltx2-split-token": (dict(rope_type="split"), dict(per_token=True)),
    "ltx2.3-split": (dict(rope_type="split", **LTX23), dict(sigma=True)),
    "ltx2.3-interleaved-token": (dict(rope_type="interleaved", **LTX23),
                                 dict(sigma=True, per_token=True)),
    "ltx2-split-isolated": (dict(rope_type="split"), dict(isolate_modalities=True)),
}


def tiny_ltx2(device="cpu", dtype=torch.float32, **config):
    """diffusers' tiny LTX-2 with every RMSNorm weight (q/k norms, affine block norms) moved
    off 1 and the modulation tables off their init, so a fusion that dropped a weight, a table
    or a ``1 +`` would show."""
    torch.manual_seed(0)
    model = diffusers.LTX2VideoTransformer3DModel(**dict(LTX2_TINY, **config))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif "scale_shift_table" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    return keep_fp32(model.to(device).eval(), dtype)


def ltx2_inputs(device="cpu", dtype=torch.float32, per_token=False, sigma=False,
                isolate_modalities=False):
    """2x4x4 video tokens, 9 audio tokens, 8 text tokens (2 of them padding in sample 0); a
    timestep per sample or, ``per_token``, per video token (the audio one per sample)."""
    g = torch.Generator().manual_seed(1)
    b, f, h, w, audio, text = 2, 2, 4, 4, 9, 8
    mask = torch.ones(b, text)
    mask[0, -2:] = 0
    tensors = dict(hidden_states=torch.randn(b, f * h * w, 4, generator=g),
                   audio_hidden_states=torch.randn(b, audio, 4, generator=g),
                   encoder_hidden_states=torch.randn(b, text, 16, generator=g),
                   audio_encoder_hidden_states=torch.randn(b, text, 16, generator=g))
    kw = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    timestep = torch.tensor([300.0, 700.0])
    if per_token:
        kw["audio_timestep"] = timestep.to(device)
        timestep = torch.rand(b, f * h * w, generator=g) * 1000
    kw.update(timestep=timestep.to(device), encoder_attention_mask=mask.to(device),
              audio_encoder_attention_mask=mask.to(device), num_frames=f, height=h, width=w,
              audio_num_frames=audio, fps=25.0, isolate_modalities=isolate_modalities,
              return_dict=False)
    if sigma:
        kw["sigma"] = torch.tensor([0.3, 0.7], device=device)
    return kw


def build_ltx2(case, device, dtype=torch.float32):
    config, inputs = LTX2_CASES[case]
    return tiny_ltx2(device, dtype, **config), ltx2_inputs(device, dtype, **inputs)


def run_ltx2(model, kw):
    """(video, audio) outputs."""
    with torch.no_grad():
        return tuple(model(**kw))


def ltx2_expected_ops(case):
    """Fused ops per forward of the 2-block tiny LTX-2. Per block and stream: fused_norm x5
    (adaln, the residual + norm2, the residual + cross-modal norm, its second modulation, the
    residual + norm3), gated_residual x4 (3 modulation sums, the feed-forward residual).
    Interleaved RoPE: rotary x1 per self-attention, x2 per cross-modal one (k has its own
    tables); split RoPE: rms_norm of q and of k then rotary. Text cross-attention: rms_norm x2."""
    per_stream = {"fused_norm": 5, "gated_residual": 4, "rotary": 3, "rms_norm": 2}
    if "split" in case:
        per_stream["rms_norm"] += 4
    if "isolated" in case:   # no cross-modal attention: its norms, sums and rotaries go
        per_stream = {"fused_norm": 3, "gated_residual": 2, "rotary": 1,
                      "rms_norm": per_stream["rms_norm"] - 2 * ("split" in case)}
    return {op: 2 * 2 * n for op, n in per_stream.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(LTX2_CASES))
def test_ltx2_fp32_patched_matches_unpatched(case, device):
    model, kw = build_ltx2(case, device)
    ref = run_ltx2(model, kw)
    report = fusebox.patch(model)
    assert report.family == "ltx-2"
    with FuseboxOps() as ops:
        out = run_ltx2(model, kw)
    for op, n in ltx2_expected_ops(case).items():
        assert ops.calls.get(op, 0) == n, f"{op}: ran {ops.calls.get(op, 0)} times, expected {n}"
    assert ops.calls.get("act", 0) == 4     # the feed-forward GELU (generic pass)
    for got, want in zip(out, ref):        # video, then audio
        assert got.shape == want.shape and got.dtype == want.dtype
        assert rel_err(got, want) < FP32_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["ltx2-interleaved", "ltx2-split", "ltx2.3-interleaved-token"])
def test_ltx2_bf16_within_bf16_spread(case, device):
    """bf16 patched outputs (video and audio) are as close to the fp32 model as bf16 eager
    is (same weights)."""
    model, kw = build_ltx2(case, device)
    refs32 = run_ltx2(model, kw)
    model, kw16 = build_ltx2(case, device, torch.bfloat16)
    eagers16 = run_ltx2(model, kw16)
    fusebox.patch(model)
    patched16s = run_ltx2(model, kw16)
    for ref32, eager16, patched16 in zip(refs32, eagers16, patched16s):
        assert patched16.dtype == torch.bfloat16 and bool(torch.isfinite(patched16).all())
        spread = rel_err(eager16, ref32)
        assert 1e-4 < spread < 5e-2, spread
        assert rel_err(patched16, ref32) < 1.25 * spread
        assert rel_err(patched16, eager16) < 1.5 * spread


@pytest.mark.parametrize("heads_first_rows", [False, True], ids=["self", "cross"])
def test_ltx2_split_rope_matches_diffusers(heads_first_rows):
    """The split layout (q/k RMSNorm over all heads, then each head's pairs (j, j + D/2) turned
    by its own table) equals diffusers' norm + ``apply_split_rotary_emb``, k with q's tables
    (self-attention) or with its own over another length (cross-modal attention)."""
    from diffusers.models.transformers.transformer_ltx2 import apply_split_rotary_emb

    from fusebox.patch.dit._shared import qk_norm_rope_across_heads

    g = torch.Generator().manual_seed(7)
    b, s, heads, d = 2, 5, 3, 8
    s_k = 7 if heads_first_rows else s
    q, k = torch.randn(b, s, heads * d, generator=g), torch.randn(b, s_k, heads * d, generator=g)
    norm_q, norm_k = (torch.nn.RMSNorm(heads * d, eps=1e-6) for _ in range(2))
    with torch.no_grad():
        norm_q.weight.uniform_(0.5, 1.5)
        norm_k.weight.uniform_(0.5, 1.5)

    def tables(n):
        angles = torch.rand(b, heads, n, d // 2, generator=g) * 6
        return angles.cos(), angles.sin()

    rotary = tables(s)
    key_rotary = tables(s_k) if heads_first_rows else None
    with torch.no_grad():
        want_q = apply_split_rotary_emb(norm_q(q), rotary)
        want_k = apply_split_rotary_emb(norm_k(k), key_rotary or rotary)
    with FuseboxOps() as ops:
        got_q, got_k = qk_norm_rope_across_heads(q, k, heads, norm_q.weight, norm_k.weight, 1e-6,
                                                 rotary, key_rotary, layout="split")
    assert ops.calls == {"rms_norm": 2, "rotary": 2 if heads_first_rows else 1}
    assert got_q.shape == (b, s, heads, d) and got_k.shape == (b, s_k, heads, d)
    assert rel_err(got_q.flatten(2), want_q) < 1e-6
    assert rel_err(got_k.flatten(2), want_k) < 1e-6


def test_ltx2_unpatch_restores():
    model, kw = build_ltx2("ltx2.3-split", "cpu")
    before = _state(model)
    ref = run_ltx2(model, kw)
    fusebox.patch(model)
    assert fusebox.is_patched(model)
    assert fusebox.unpatch(model) > 0 and not fusebox.is_patched(model)
    assert _state(model) == before
    assert not any("_fusebox_undo" in m.__dict__ or "_fusebox_fused_into" in m.__dict__
                   for m in model.modules())
    out = run_ltx2(model, kw)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


@pytest.mark.parametrize("rope_type", ["interleaved", "split"])
def test_report_ltx2(rope_type):
    model = tiny_ltx2(rope_type=rope_type)
    report = fusebox.patch(model)
    assert report.family == "ltx-2"
    kinds = Counter(e.kind for e in report.patched)
    # 2 blocks of 6 attentions (self, text and cross-modal, per stream)
    assert kinds["LTX2VideoTransformerBlock"] == 2 and kinds["LTX2Attention"] == 12
    assert kinds["GELU"] == 4 and kinds["LayerNorm"] == 2      # generic: ff, norm_out
    patched = {e.path: e.what for e in report.patched}
    assert "adaln" in patched["transformer_blocks.0"]
    assert rope_type in patched["transformer_blocks.0.audio_to_video_attn"]
    skipped = {e.path: e.what for e in report.skipped}
    block = model.transformer_blocks[1]
    for name in ("norm1", "audio_norm1", "norm2", "audio_to_video_norm", "video_to_audio_norm",
                 "audio_norm3", "attn1.norm_q", "video_to_audio_attn.norm_k"):
        assert skipped[f"transformer_blocks.1.{name}"].startswith("done by the ")
        assert not _common.is_patched(block.get_submodule(name))
    assert "LTX2VideoTransformerBlock" in str(report)


def test_ltx2_custom_processor_left_alone():
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoAttnProcessor

    class Custom(LTX2AudioVideoAttnProcessor):
        pass

    model = tiny_ltx2()
    model.transformer_blocks[0].attn1.set_processor(Custom())
    report = fusebox.patch(model)
    skipped = {e.path: e.what for e in report.skipped}
    assert "custom" in skipped["transformer_blocks.0.attn1"]
    assert type(model.transformer_blocks[0].attn1.processor) is Custom


def test_ltx2_attention_backend_reaches_the_replaced_processor():
    model = tiny_ltx2()
    fusebox.patch(model)
    model.set_attention_backend("native")
    processor = model.transformer_blocks[0].audio_to_video_attn.processor
    assert processor.original._attention_backend == processor._attention_backend
    assert processor._attention_backend.value == "native"


def test_ltx2_perturbed_attention():
    """``perturbed_attn`` models (spatio-temporal guidance): blocks outside the guidance fuse
    their attention; the perturbed ones (values instead of attention for the samples the mask
    zeroes) run diffusers' processor, with the unpatched result."""
    model = tiny_ltx2(rope_type="split", perturbed_attn=True)
    kw = ltx2_inputs()
    kw.update(spatio_temporal_guidance_blocks=[0], perturbation_mask=torch.tensor([1.0, 0.0]))
    ref = run_ltx2(model, kw)
    report = fusebox.patch(model)
    assert sum(e.kind == "LTX2Attention" for e in report.patched) == 12
    with FuseboxOps() as ops:
        out = run_ltx2(model, kw)
    # split RoPE: a rotary launch per self-attention, two per cross-modal one (k has its own
    # tables); block 0's perturbed self-attentions run diffusers' processor
    assert ops.calls["rotary"] == (2 + 4) + 4, ops.calls
    assert all(rel_err(a, b) < FP32_TOL for a, b in zip(out, ref))


def test_ltx2_autograd_falls_back():
    model, kw = build_ltx2("ltx2.3-split", "cpu")
    out = assert_patch_falls_back(model, lambda m: m(**kw)[1])   # every fused forward fell back
    out.sum().backward()
    assert model.transformer_blocks[0].audio_scale_shift_table.grad is not None


def test_ltx2_float64_falls_back():
    model, kw = build_ltx2("ltx2-split", "cpu", torch.float64)
    assert_patch_falls_back(model, lambda m: torch.cat([t.flatten() for t in run_ltx2(m, kw)]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["ltx2-interleaved", "ltx2-split", "ltx2.3-interleaved-token"])
def test_ltx2_compiled_patched_block_fullgraph(case, device):
    """Compiled, the split RoPE is left to the compiler (torch operations reading the per-head
    tables in place, no rows formed per block); the interleaved one keeps the operator."""
    model, kw = build_ltx2(case, device)
    ops = {"fused_norm", "gated_residual", "rms_norm"}
    split = "split" in case
    assert_compiled_first_block(model, lambda: run_ltx2(model, kw),
                                ops if split else ops | {"rotary"},
                                absent={"rotary"} if split else set())


@pytest.mark.parametrize("device", DEVICES)
def test_ltx2_compiled_split_rope_kernel_knob(device, monkeypatch):
    """FUSEBOX_COMPILED_SPLIT_ROTARY=kernel keeps the rotary operator in the compiled block."""
    from fusebox.patch.dit import _shared

    monkeypatch.setattr(_shared, "COMPILED_SPLIT_ROTARY", "kernel")
    model, kw = build_ltx2("ltx2-split", device)
    assert_compiled_first_block(model, lambda: run_ltx2(model, kw),
                                {"rotary", "fused_norm", "gated_residual", "rms_norm"})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_ltx2_split_rope_in_torch_matches_the_operator(dtype, device):
    """The compiled split RoPE's torch form equals the operator on the rows it would be given
    and diffusers' ``apply_split_rotary_emb``, for tables as diffusers makes them (a transposed
    view of ``[B, S, H, D/2]``), q/k read from a wider projection (strided rows), odd sizes."""
    from diffusers.models.transformers.transformer_ltx2 import apply_split_rotary_emb

    from fusebox.patch.dit._shared import _split_rope, _split_rope_in_torch

    g = torch.Generator().manual_seed(11)
    b, s, s_k, heads, d = 2, 13, 7, 3, 10
    qkv = torch.randn(b, s, 3 * heads * d, generator=g).to(device, dtype)
    q = qkv[..., :heads * d]
    k = torch.randn(b, s_k, heads * d, generator=g).to(device, dtype)

    def tables(n):   # diffusers: [B, S, H, D/2] computed, returned swapped to [B, H, S, D/2]
        angles = torch.rand(b, n, heads, d // 2, generator=g) * 6
        return tuple(t.to(device).swapaxes(1, 2) for t in (angles.cos(), angles.sin()))

    rotary, key_rotary = tables(s), tables(s_k)
    for x, rot in ((q, rotary), (k, key_rotary)):
        ref = apply_split_rotary_emb(x.double(), tuple(t.double() for t in rot))
        x_out = torch.full((b, x.shape[1], heads, d), float("nan"), device=device, dtype=dtype)
        x_out.copy_(_split_rope_in_torch(x, heads, *rot).view(x_out.shape))
        with torch.no_grad():
            op_out = _split_rope(x, None, heads, rot)[0]
        assert not x_out.isnan().any()
        assert x_out.dtype == dtype and x_out.shape == op_out.shape
        fp32 = dtype == torch.float32
        assert rel_err(x_out.flatten(2), ref) < (1e-6 if fp32 else 1e-2)
        assert rel_err(x_out, op_out) < (1e-6 if fp32 else 2e-3)   # one rounding each
    assert _split_rope_in_torch(None, heads, *rotary) is None


def assert_compiled_first_block(model, run, ops, absent=frozenset()):
    """The first block, patched and compiled fullgraph on the inputs an unpatched ``run()``
    hands it, traces ``ops`` (the fused path) and none of ``absent``, and matches the patched
    eager block."""
    captured = {}

    def grab(module, args, kwargs):
        captured.setdefault("args", (args, kwargs))

    block = model.transformer_blocks[0]
    handle = block.register_forward_pre_hook(grab, with_kwargs=True)
    run()
    handle.remove()
    args, kwargs = captured["args"]
    fusebox.patch(model)
    torch._dynamo.reset()
    backend = GraphOps()
    with torch.no_grad():
        eager = block(*args, **kwargs)
        out = torch.compile(block, fullgraph=True, backend=backend)(*args, **kwargs)
    assert ops <= backend.ops, backend.ops
    assert not (set(absent) & backend.ops), backend.ops
    assert all(rel_err(a, b) < FP32_TOL for a, b in zip(out, eager))


def _spec_names():
    from fusebox.bench.e2e import dit

    return [n for n in dit.SPECS if not n.startswith("tiny")]


@pytest.mark.parametrize("name", _spec_names())
def test_e2e_spec_builds_its_class(name):
    """Each end-to-end spec's published config builds its diffusers class as the harness builds
    it (on the meta device: no memory, no init work) and its inputs are arguments of that
    class's forward."""
    import inspect

    from fusebox.bench.e2e import dit

    spec = dit.SPECS[name]
    model = dit.build(spec, "meta", torch.bfloat16)
    assert type(model).__name__ == spec.cls and sum(p.numel() for p in model.parameters()) > 1e8
    inputs = spec.inputs("meta", torch.bfloat16)
    assert set(inputs) <= set(inspect.signature(model.forward).parameters), name

def test_bench_tiny_cli(tmp_path, capsys):
    from fusebox.bench.e2e import main

    rc = main(["--model", "tiny-dit", "--device", "cpu", "--quick", "--dtype", "fp32",
               "--variants", "eager,patched", "--pipeline", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "tiny-dit" in out
    assert "  patched ...\n" in out and "  patched: forward_ms " in out   # progress per variant
    import json

    doc = json.loads((tmp_path / "results_e2e.json").read_text())
    rec = doc["models"]["tiny-dit"]
    for variant in ("eager", "patched"):
        assert not rec["variants"][variant].get("error"), rec["variants"][variant]
        v = rec["variants"][variant]
        assert v["step_ms"] > 0 and 0 < v["forward_min_ms"] <= v["forward_ms"]
    assert rec["variants"]["patched"]["rel_diff_vs_eager"] < 1e-4
    assert rec["variants"]["pipeline:patched"]["pipeline_s"] > 0
    assert (tmp_path / rec["summary"]["video"].split("/")[-1]).exists()


def test_bench_rounds_reverse_the_order(tmp_path, capsys):
    """--rounds 3: the variants run forward, reversed, forward; each reports the median of its
    rounds' forward times, every round's time kept."""
    import json
    import statistics

    from fusebox.bench.e2e import main

    rc = main(["--model", "tiny-dit", "--device", "cpu", "--quick", "--dtype", "fp32",
               "--variants", "eager,patched", "--rounds", "3", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    starts = [line.strip()[:-4] for line in out.splitlines() if line.endswith(" ...")]
    assert starts == ["eager", "patched", "patched", "eager", "eager", "patched"], starts
    rec = json.loads((tmp_path / "results_e2e.json").read_text())["models"]["tiny-dit"]
    for variant in ("eager", "patched"):
        v = rec["variants"][variant]
        assert not v.get("error"), v
        assert len(v["forward_ms_rounds"]) == 3
        assert v["forward_ms"] == statistics.median(v["forward_ms_rounds"])
        assert v["step_ms"] == v["forward_ms"] * rec["summary"]["forwards_per_step"]
        assert 0 < v["forward_min_ms"] <= min(v["forward_ms_rounds"])
    assert rec["variants"]["patched"]["rel_diff_vs_eager"] < 1e-4
    assert rec["summary"]["rounds"].startswith("3,")


def test_bench_rounds_must_be_positive(capsys):
    from fusebox.bench.e2e import main

    with pytest.raises(SystemExit):
        main(["--model", "tiny-dit", "--device", "cpu", "--rounds", "0"])
    assert "--rounds must be 1 or more; got 0" in capsys.readouterr().err


def test_bench_attention_backend_reaches_every_variant(tmp_path, monkeypatch):
    # --attention-backend is set once on the model; the patched processors share it
    from diffusers.models import attention_dispatch

    from fusebox.bench.e2e import main

    seen = []
    real = attention_dispatch.dispatch_attention_fn

    def spy(*args, backend=None, **kwargs):
        seen.append(str(getattr(backend, "value", backend)))
        return real(*args, backend=backend, **kwargs)

    import importlib

    for mod in ("diffusers.models.transformers.transformer_ltx", "fusebox.patch.dit._shared"):
        monkeypatch.setattr(importlib.import_module(mod), "dispatch_attention_fn", spy)
    rc = main(["--model", "tiny-dit", "--device", "cpu", "--quick", "--dtype", "fp32",
               "--variants", "eager,patched", "--attention-backend", "_native_math",
               "--out", str(tmp_path)])
    assert rc == 0
    import json

    rec = json.loads((tmp_path / "results_e2e.json").read_text())["models"]["tiny-dit"]
    assert rec["summary"]["attention_backend"] == "_native_math"
    for variant in ("eager", "patched"):
        assert not rec["variants"][variant].get("error"), rec["variants"][variant]
    assert rec["variants"]["patched"]["rel_diff_vs_eager"] < 1e-4
    assert seen and set(seen) == {"_native_math"}


def test_bench_graph_variants_need_cuda(tmp_path):
    # the CUDA-graph variants are opt-in; without a GPU they record why they did not run
    from fusebox.bench.e2e import main

    rc = main(["--model", "tiny-dit", "--device", "cpu", "--quick", "--dtype", "fp32",
               "--variants", "patched,graphs,patched+graphs", "--out", str(tmp_path)])
    assert rc == 0
    import json

    rec = json.loads((tmp_path / "results_e2e.json").read_text())["models"]["tiny-dit"]
    assert list(rec["variants"]) == ["eager", "patched", "graphs", "patched+graphs"]
    assert rec["variants"]["patched"]["rel_diff_vs_eager"] < 1e-4
    for variant in ("graphs", "patched+graphs"):
        assert "CUDA graphs need a CUDA device" in rec["variants"][variant]["error"]


@pytest.mark.gpu
@requires_cuda
def test_bench_graph_variants_replay_the_forward(tmp_path):
    # on CUDA a captured forward replays to the eager output, patched or not
    from fusebox.bench.e2e import main

    rc = main(["--model", "tiny-dit", "--device", "cuda", "--quick", "--dtype", "fp32",
               "--variants", "patched,graphs,patched+graphs", "--out", str(tmp_path)])
    assert rc == 0
    import json

    rec = json.loads((tmp_path / "results_e2e.json").read_text())["models"]["tiny-dit"]
    for variant in ("patched", "graphs", "patched+graphs"):
        v = rec["variants"][variant]
        assert not v.get("error"), v
        assert v["forward_ms"] > 0 and v["rel_diff_vs_eager"] < 1e-4, v
    assert rec["variants"]["patched+graphs"]["capture_s"] > 0


def test_bench_variants_default_and_explicit():
    # an explicit list is run as given, even when it names the LLM default set in --quick mode
    from types import SimpleNamespace

    from fusebox.bench.e2e import dit

    quick = SimpleNamespace(variants=None, quick=True)
    assert dit._variants(quick) == list(dit.QUICK_VARIANTS)
    assert dit._variants(SimpleNamespace(variants=None, quick=False)) == list(dit.DEFAULT_VARIANTS)
    explicit = SimpleNamespace(variants="eager,patched,compile,patched+compile", quick=True)
    assert dit._variants(explicit) == ["eager", "patched", "compile", "patched+compile"]
    assert dit._variants(SimpleNamespace(variants="graphs", quick=True)) == ["eager", "graphs"]
    with pytest.raises(ValueError, match="unknown variant"):
        dit._variants(SimpleNamespace(variants="eager,fast", quick=True))


def test_pipeline_video_falls_back_to_gif(tmp_path, monkeypatch):
    # without imageio the pipeline's video is written as an animated GIF of its frames
    import numpy as np
    from diffusers import utils as diffusers_utils
    from PIL import Image

    from fusebox.bench.e2e import dit

    def no_imageio(*args, **kwargs):
        raise ImportError("imageio")

    monkeypatch.setattr(diffusers_utils, "export_to_video", no_imageio)
    frames = np.random.default_rng(0).random((3, 8, 12, 3), dtype=np.float32)
    path = dit._write_video(frames, str(tmp_path / "clip"))
    assert path.endswith(".gif")
    with Image.open(path) as gif:
        assert gif.n_frames == 3 and gif.size == (12, 8)


def test_vae_channel_rms_norm_keeps_diffusers_forward():
    # the LTX-Video VAE normalizes channels through a permuted view: patched, those norms keep
    # diffusers' forward (a copy into rows would cost two passes), contiguous rows take fusebox's
    from diffusers.models.normalization import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-6, elementwise_affine=True)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 16, 3, 5, 7)
    channels_last = x.permute(0, 2, 3, 4, 1)
    ref_strided, ref_rows = norm(channels_last), norm(channels_last.contiguous())
    report = fusebox.patch(norm)
    assert report.num_patched == 1
    with torch.inference_mode():
        with FuseboxOps() as ops:
            out = norm(channels_last)
        assert not ops.calls
        assert out.stride() == ref_strided.stride()
        torch.testing.assert_close(out, ref_strided)
        with FuseboxOps() as ops:
            out = norm(channels_last.contiguous())
        assert ops.calls["rms_norm"] == 1
        torch.testing.assert_close(out, ref_rows, rtol=1e-5, atol=1e-6)
    fusebox.unpatch(norm)


# --------------------------------------------------------------------------- Mochi

# diffusers' own tiny Mochi (tests/models/transformers/test_models_transformer_mochi.py); the
# last of the 2 blocks is context_pre_only (MochiLayerNormContinuous, no text tail)
MOCHI_TINY = dict(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                  pooled_projection_dim=16, in_channels=4, out_channels=None,
                  qk_norm="rms_norm", text_embed_dim=16, time_embed_dim=4,
                  activation_fn="swiglu", max_sequence_length=16)
# text masks of the 2 samples x 8 tokens: every token valid; the same padded suffix (trimmed
# at the model's input); a suffix of another length per sample (diffusers' per-sample loop);
# a hole inside the valid text (the loop lays the text outputs out compacted); no valid text
# in one sample (CFG's empty negative prompt, as the Mochi pipeline masks it)
MOCHI_MASKS = {"all-valid": ((8, 8), ()), "same-suffix": ((6, 6), ()),
               "ragged": ((8, 5), ()), "holes": ((8, 6), ((0, 2),)),
               "one-empty": ((5, 0), ())}


def tiny_mochi(device="cpu", dtype=torch.float32):
    """diffusers' tiny Mochi with the q/k norm weights moved off 1, the rotary frequencies off
    their zero init (so the rotary turns) and the modulation linears shifted, so a fusion that
    dropped a weight, a ``1 +``, a gate or a rotary pair would show."""
    torch.manual_seed(0)
    model = diffusers.MochiTransformer3DModel(**MOCHI_TINY)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight") and p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name == "pos_frequencies":   # angles of a few radians at the tiny grid's
                p.copy_(0.05 * torch.randn(p.shape, generator=g))   # positions (up to 96)
            elif "norm1" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.to(device=device, dtype=dtype).eval()


def mochi_inputs(device="cpu", dtype=torch.float32, mask="ragged"):
    """2 frames of 4x4 patches, 8 text tokens (the mask as ``MOCHI_MASKS`` says)."""
    g = torch.Generator().manual_seed(1)
    lengths, holes = MOCHI_MASKS[mask]
    valid = torch.zeros(2, 8, dtype=torch.bool)
    for i, n in enumerate(lengths):
        valid[i, :n] = True
    for i, j in holes:
        valid[i, j] = False
    return dict(hidden_states=torch.randn(2, 4, 2, 8, 8, generator=g).to(device, dtype),
                encoder_hidden_states=torch.randn(2, 8, 16, generator=g).to(device, dtype),
                timestep=torch.tensor([300, 700], device=device),
                encoder_attention_mask=valid.to(device), return_dict=False)


def build_mochi(device, dtype=torch.float32, mask="ragged"):
    return tiny_mochi(device, dtype), mochi_inputs(device, dtype, mask)


# Per forward: fused_norm x8 (per block adaln x2 and gated_residual_norm x2, x1 in the last
# block without a text tail; the output AdaLayerNormContinuous), rms_norm x10 (text q/k x2 per
# block, norm2/norm4 x2 per stream), rotary x2 (one per attention), gated_residual x3 (one per
# stream's feed-forward residual), gated_act_packed x3 (SwiGLU, generic pass)
MOCHI_OPS = {"fused_norm": 8, "rms_norm": 10, "rotary": 2, "gated_residual": 3,
             "gated_act_packed": 3}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask", list(MOCHI_MASKS))
def test_mochi_fp32_patched_matches_unpatched(mask, device):
    model, kw = build_mochi(device, mask=mask)
    ref = run(model, kw)
    report = fusebox.patch(model)
    assert report.family == "mochi"
    with FuseboxOps() as ops:
        out = run(model, kw)
    for op, n in MOCHI_OPS.items():
        assert ops.calls.get(op, 0) == n, f"{op}: ran {ops.calls.get(op, 0)} times, expected {n}"
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_mochi_half_within_eager_spread(dtype, device):
    """fp16/bf16 patched output is as close to the fp32 model as eager half precision is."""
    model, kw = build_mochi(device)
    ref32 = run(model, kw)
    model, kw16 = build_mochi(device, dtype)
    eager16 = run(model, kw16)
    fusebox.patch(model)
    patched16 = run(model, kw16)
    assert patched16.dtype == dtype and bool(torch.isfinite(patched16).all())
    spread = rel_err(eager16, ref32)
    assert 1e-5 < spread < 5e-2, spread
    assert rel_err(patched16, ref32) <= 1.5 * spread


def _mochi_block_call(model, kw, index=0):
    """The arguments the model hands block ``index`` (unpatched, so untrimmed)."""
    captured = {}

    def grab(module, args, kwargs):
        captured.setdefault("args", (args, kwargs))

    handle = model.transformer_blocks[index].register_forward_pre_hook(grab, with_kwargs=True)
    run(model, kw)
    handle.remove()
    return captured["args"]


@pytest.mark.parametrize("mask", ["same-suffix", "ragged", "holes"])
@pytest.mark.parametrize("index", [0, 1], ids=["two-stream", "context-pre-only"])
def test_mochi_block_both_streams(mask, index):
    """A patched block's video and text outputs equal diffusers' for each mask: the same text
    prefix in both samples (one attention call), others (the per-sample loop)."""
    model, kw = build_mochi("cpu", mask=mask)
    args, kwargs = _mochi_block_call(model, kw, index)
    block = model.transformer_blocks[index]
    with torch.no_grad():
        want = block(*args, **kwargs)
        fusebox.patch(model)
        with FuseboxOps() as ops:
            got = block(*args, **kwargs)
    assert ops.calls["rotary"] == 1 and ops.calls["fused_norm"] == 4 - index
    for a, b in zip(got, want):
        assert a.shape == b.shape and rel_err(a, b) < FP32_TOL


@pytest.mark.parametrize("mask", ["ragged", "one-empty"])
def test_mochi_ragged_text_sliced_without_host_reads_in_blocks(mask, monkeypatch):
    """Each sample's valid text a prefix of its own length: the patched blocks slice it by the
    counts read once a forward, with no ``nonzero`` (a host read per sample and block), and
    give diffusers' loop's output, zeros after each sample's valid text outputs included."""
    model, kw = build_mochi("cpu", mask=mask)
    args, kwargs = _mochi_block_call(model, kw, 0)
    block = model.transformer_blocks[0]
    with torch.no_grad():
        want = block(*args, **kwargs)
    ref = run(model, kw)
    fusebox.patch(model)
    monkeypatch.setattr(torch, "nonzero", lambda *a, **k: pytest.fail("nonzero in a block"))
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real_tolist(t))
    out = run(model, kw)
    assert len(reads) == 2, reads    # the input trim, then the blocks' counts (once, not a block)
    assert rel_err(out, ref) < FP32_TOL
    with torch.no_grad():
        got = block(*args, **kwargs)
    for a, b in zip(got, want):
        assert a.shape == b.shape and rel_err(a, b) < FP32_TOL
    text_out = got[1]
    assert bool(torch.isfinite(text_out).all())


def test_mochi_rotary_pairs_are_interleaved_per_head():
    """The fused q/k norm + rotary equals diffusers' MochiRMSNorm then its rotary with per-head
    tables [S, H, D/2] turning pairs (2j, 2j + 1)."""
    from fusebox.patch.dit.mochi import _rotary_rows

    g = torch.Generator().manual_seed(0)
    s, h, d = 6, 3, 8
    q, k = torch.randn(2, s, h, d, generator=g), torch.randn(2, s, h, d, generator=g)
    angles = torch.randn(s, h, d // 2, generator=g)
    cos, sin = angles.cos(), angles.sin()
    wq, wk = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5

    def want(x, w):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)

    c, s_ = _rotary_rows(cos, sin)
    got_q, got_k = fusebox.functional.qk_norm_rope(q.flatten(1, 2).unsqueeze(2),
                                                   k.flatten(1, 2).unsqueeze(2), wq, wk, c, s_,
                                                   1e-5, interleaved=True)
    assert rel_err(got_q.view(q.shape), want(q, wq)) < 1e-6
    assert rel_err(got_k.view(k.shape), want(k, wk)) < 1e-6


def test_mochi_unpatch_restores():
    model, kw = build_mochi("cpu")
    before = _state(model)
    processors = [m.processor for m in model.modules() if hasattr(m, "processor")]
    ref = run(model, kw)
    fusebox.patch(model)
    assert fusebox.is_patched(model)
    assert fusebox.unpatch(model) > 0 and not fusebox.is_patched(model)
    assert _state(model) == before
    assert [m.processor for m in model.modules() if hasattr(m, "processor")] == processors
    assert not any("_fusebox_undo" in m.__dict__ or "_fusebox_fused_into" in m.__dict__
                   for m in model.modules())
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert torch.equal(run(model, kw), ref)


def test_report_mochi():
    model = tiny_mochi()
    report = fusebox.patch(model)
    assert report.family == "mochi"
    kinds = Counter(e.kind for e in report.patched)
    assert kinds["MochiTransformerBlock"] == 2 and kinds["MochiAttention"] == 2
    assert kinds["SwiGLU"] == 3 and kinds["AdaLayerNormContinuous"] == 1   # generic pass
    skipped = {e.path: e.what for e in report.skipped}
    for name in ("0.norm1.norm", "0.norm2_context.norm", "0.norm4.norm", "1.norm1_context.norm.norm",
                 "1.attn1.norm_q", "0.attn1.norm_added_k"):
        assert skipped[f"transformer_blocks.{name}"].startswith("done by the ")
    assert "MochiTransformerBlock" in str(report)


def test_mochi_custom_processor_left_alone():
    from diffusers.models.attention_processor import MochiAttnProcessor2_0

    class Custom(MochiAttnProcessor2_0):
        pass

    model = tiny_mochi()
    model.transformer_blocks[0].attn1.processor = custom = Custom()
    report = fusebox.patch(model)
    assert model.transformer_blocks[0].attn1.processor is custom
    skipped = {e.path: e.what for e in report.skipped}
    assert skipped["transformer_blocks.0.attn1"] == "processor Custom kept"
    assert type(model.transformer_blocks[1].attn1.processor).__name__ == "MochiFusedAttnProcessor"


def test_mochi_autograd_falls_back():
    model, kw = build_mochi("cpu")
    out = assert_patch_falls_back(model, lambda m: m(**kw)[0])
    out.sum().backward()
    assert model.transformer_blocks[0].norm1.linear.weight.grad is not None


def test_mochi_float64_falls_back():
    model, kw = build_mochi("cpu", torch.float64)
    assert_patch_falls_back(model, lambda m: run(m, kw))


def _mochi_patched_first_block(mask, device):
    """(block, args, kwargs, unpatched output) of the first block of a tiny Mochi, the model
    patched after that output was taken."""
    model, kw = build_mochi(device, mask=mask)
    args, kwargs = _mochi_block_call(model, kw)
    block = model.transformer_blocks[0]
    with torch.no_grad():
        want = block(*args, **kwargs)
    fusebox.patch(model)
    return block, args, kwargs, want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask", ["all-valid", "ragged", "holes"])
def test_mochi_compiled_patched_block_fullgraph(mask, device, monkeypatch):
    """Compiled, the block reads no mask on the host: diffusers' per-sample loop over each
    sample's valid text, its ``nonzero`` traced as a data-dependent size, in one graph."""
    from fusebox.patch.dit import mochi as mochi_patch

    def masked_call(*_):
        raise AssertionError("the compiled block took the masked call, not the per-sample loop")

    block, args, kwargs, want = _mochi_patched_first_block(mask, device)
    torch._dynamo.reset()
    monkeypatch.setattr(mochi_patch, "_compact_text", masked_call)
    backend = GraphOps()
    with torch.no_grad():
        got = torch.compile(block, fullgraph=True, backend=backend)(*args, **kwargs)
    assert {"rotary", "fused_norm", "gated_residual", "rms_norm"} <= backend.ops
    for a, b in zip(got, want):
        assert rel_err(a, b) < FP32_TOL


@pytest.mark.parametrize("device", DEVICES)
def test_mochi_blocks_compiled_slice_by_the_input_counts(device, monkeypatch):
    """Blocks compiled one by one (regional compile), the model's input eager: its hook counts
    each sample's valid text once a forward, and the compiled blocks slice by those counts (no
    ``nonzero``). The second text length recompiles each block once (the text length becomes
    dynamic, as for any input); later lengths and counts, a sample without text included, run
    the same graphs."""
    model, kw = build_mochi(device, mask="ragged")
    fusebox.patch(model)
    refs = {}
    masks = {"ragged": ((8, 5), ()), "other": ((7, 3), ()), "third": ((6, 2), ()),
             "one-empty": ((5, 0), ())}
    for name, lengths in masks.items():
        monkeypatch.setitem(MOCHI_MASKS, name, lengths)
        refs[name] = (mochi_inputs(device, mask=name), None)
    model_ref, _ = build_mochi(device)
    for name, (inputs, _) in refs.items():
        refs[name] = (inputs, run(model_ref, inputs))
    torch._dynamo.reset()
    backend = GraphOps()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return backend(gm, example_inputs)

    for block in model.transformer_blocks:
        block.compile(fullgraph=True, backend=counting)
    monkeypatch.setattr(torch, "nonzero", lambda *a, **k: pytest.fail("nonzero in a block"))
    try:
        for name in masks:
            inputs, want = refs[name]
            assert rel_err(run(model, inputs), want) < FP32_TOL, name
            if name == "other":
                settled = len(graphs)
        assert settled == 2 * len(model.transformer_blocks), settled
        assert len(graphs) == settled, len(graphs)
    finally:
        for block in model.transformer_blocks:
            block._compiled_call_impl = None
    assert {"rotary", "fused_norm", "rms_norm"} <= backend.ops


@pytest.mark.parametrize("mask", ["all-valid", "ragged", "holes"])
def test_mochi_compiled_patched_model_fullgraph(mask):
    """The whole patched model in one graph: the text is not trimmed at its input (no host read
    while compiling), and attention takes each sample's valid text by the per-sample loop."""
    model, kw = build_mochi("cpu", mask=mask)
    ref = run(model, kw)
    fusebox.patch(model)
    torch._dynamo.reset()
    backend = GraphOps()
    out = run(torch.compile(model, fullgraph=True, backend=backend), kw)
    assert {"rotary", "fused_norm", "gated_residual", "rms_norm"} <= backend.ops
    assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask", ["ragged", "holes"])
def test_mochi_masked_attention_matches_loop(mask, device, monkeypatch):
    """Where the mask cannot be read on the host and no size may depend on it (a captured CUDA
    graph), one masked attention call; its text outputs laid out as diffusers' loop lays them
    out (valid ones first, then zeros)."""
    from fusebox.patch.dit import mochi as mochi_patch

    block, args, kwargs, want = _mochi_patched_first_block(mask, device)
    monkeypatch.setattr(mochi_patch, "host_readable", lambda *_: False)
    with torch.no_grad(), FuseboxOps() as ops:
        got = block(*args, **kwargs)
    assert ops.calls.get("rotary", 0) == 1
    for a, b in zip(got, want):
        assert rel_err(a, b) < FP32_TOL


@pytest.mark.parametrize("order", ["patch-then-offload", "offload-then-patch"])
def test_mochi_accelerate_cpu_offload(order):
    """The blocks stay fused under accelerate's hooks; attention, whose q/k norm weights arrive
    only in the norms' own hooked forwards, takes diffusers' path."""
    model, kw = build_mochi("cpu")
    ref = run(model, kw)
    offload_and_patch(model, order)
    with FuseboxOps() as ops:
        out = run(model, kw)
    assert ops.calls["gated_residual"] == 3 and "rotary" not in ops.calls
    assert rel_err(out, ref) < FP32_TOL
    assert_unpatch_keeps_hooks(model, lambda m: run(m, kw), ref)


def test_mochi_group_offload_leaf_level():
    """Leaf-level group offload hooks the q/k norms (their weights arrive in their own
    forward): attention keeps diffusers' processor path, the blocks stay fused."""
    model, kw = build_mochi("cpu")
    ref = run(model, kw)
    fusebox.patch(model)
    model.enable_group_offload(onload_device=torch.device("cpu"), offload_type="leaf_level")
    with FuseboxOps() as ops:
        out = run(model, kw)
    assert ops.calls["gated_residual"] == 3 and "rotary" not in ops.calls
    assert rel_err(out, ref) < FP32_TOL


# --------------------------------------------------------------------------- CogVideoX, ConsisID

# diffusers' tiny CogVideoX (tests/models/transformers/test_models_transformer_cogvideox.py),
# 2 blocks, with the RoPE of the released 5B models; 1.5 adds a temporal patch and the I2V "ofs"
# embedding; ConsisID (the compat sweep's tiny config) runs CogVideoX's blocks and attention
COGVIDEOX_TINY = dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                      time_embed_dim=8, text_embed_dim=8, num_layers=2, sample_width=8,
                      sample_height=8, sample_frames=9, patch_size=2, temporal_compression_ratio=4,
                      max_text_seq_length=6, use_rotary_positional_embeddings=True)
# the compat sweep's tiny ConsisID (8 channels a head), with RoPE and the face branch
CONSISID_TINY = dict(COGVIDEOX_TINY, attention_head_dim=8, time_embed_dim=2,
                     max_text_seq_length=8, sample_frames=8, cross_attn_interval=1, is_kps=False,
                     is_train_face=True, cross_attn_dim_head=1, cross_attn_num_heads=1,
                     LFE_id_dim=2, LFE_vit_dim=2, LFE_depth=5, LFE_dim_head=8, LFE_num_heads=2,
                     LFE_num_id_token=1, LFE_num_querie=1, LFE_output_dim=10, LFE_ff_mult=1,
                     LFE_num_scale=1)
COGVIDEOX_CASES = {
    "cogvideox": ("CogVideoXTransformer3DModel", {}, {}),
    "cogvideox-1.5": ("CogVideoXTransformer3DModel", dict(patch_size_t=2, ofs_embed_dim=8),
                      dict(frames=4, ofs=True)),
    "cogvideox-no-rope": ("CogVideoXTransformer3DModel",
                          dict(use_rotary_positional_embeddings=False), dict(rotary=False)),
    "consisid": ("ConsisIDTransformer3DModel", {}, dict(face=True)),
}


def _cogvideox_config(case):
    cls, config, _ = COGVIDEOX_CASES[case]
    return cls, dict(CONSISID_TINY if cls.startswith("ConsisID") else COGVIDEOX_TINY, **config)


def tiny_cogvideox(case, device="cpu", dtype=torch.float32):
    """The case's tiny model with its norm weights and biases (the blocks', the q/k LayerNorms')
    moved off 1 and 0, so a fusion that dropped one would show."""
    cls, config = _cogvideox_config(case)
    torch.manual_seed(0)
    model = getattr(diffusers, cls)(**config)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return keep_fp32(model.to(device).eval(), dtype)


def cogvideox_inputs(case, device="cpu", dtype=torch.float32):
    """3 latent frames (4 with 1.5's temporal patch of 2) of 8x8 at 4 channels, 6 text tokens,
    RoPE tables [S, D] as the pipeline makes them (fp32; each angle on both channels of a
    pair)."""
    _, config = _cogvideox_config(case)
    opts = COGVIDEOX_CASES[case][2]
    g = torch.Generator().manual_seed(1)
    b, f, h, w, text = 2, opts.get("frames", 3), 8, 8, 6
    tensors = dict(hidden_states=torch.randn(b, f, 4, h, w, generator=g),
                   encoder_hidden_states=torch.randn(b, text, 8, generator=g))
    kw = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    kw.update(timestep=torch.tensor([300.0, 700.0], device=device), return_dict=False)
    if opts.get("rotary", True):
        tokens = f // config.get("patch_size_t", 1) * (h // 2) * (w // 2)
        angles = torch.rand(tokens, config["attention_head_dim"] // 2, generator=g) * 6
        kw["image_rotary_emb"] = tuple(t.repeat_interleave(2, -1).to(device)
                                       for t in (angles.cos(), angles.sin()))
    if opts.get("ofs"):
        kw["ofs"] = torch.tensor([2.0, 2.0], device=device)
    if opts.get("face"):
        kw.update(id_cond=torch.randn(b, 2, generator=g).to(device),
                  id_vit_hidden=[torch.randn(b, 2, 2, generator=g).to(device)])
    return kw


def cogvideox_expected_ops(case):
    """Fused ops per forward of the 2-block tiny models. Per block: fused_norm x4 (each stream's
    adaln, each stream's residual + norm2), gated_residual x2 (the feed-forward residuals),
    layer_norm x2 (q and k), rotary x1 (the video tokens of q and k), act x1 (the feed-forward,
    generic pass); then norm_final (layer_norm) and norm_out (fused_norm)."""
    ops = {"fused_norm": 2 * 4 + 1, "gated_residual": 2 * 2, "layer_norm": 2 * 2 + 1,
           "rotary": 2, "act": 2}
    if "no-rope" in case:
        ops.pop("rotary")
    return ops


def run_cogvideox(model, kw):
    with torch.no_grad():
        return model(**kw)[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(COGVIDEOX_CASES))
def test_cogvideox_fp32_patched_matches_unpatched(case, device):
    model, kw = tiny_cogvideox(case, device), cogvideox_inputs(case, device)
    ref = run_cogvideox(model, kw)
    report = fusebox.patch(model)
    assert report.family == case.split("-")[0]
    with FuseboxOps() as ops:
        out = run_cogvideox(model, kw)
    expected = cogvideox_expected_ops(case)
    for op, n in expected.items():
        got = ops.calls.get(op, 0)
        # ConsisID's face extractor and cross-attentions hold LayerNorms of their own
        assert got == n or (op == "layer_norm" and case == "consisid" and got > n), (op, got, n)
    assert "rotary" in ops.calls or "no-rope" in case
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["cogvideox", "cogvideox-1.5", "consisid"])
def test_cogvideox_bf16_within_bf16_spread(case, device):
    """bf16 patched output is as close to the fp32 model as bf16 eager is (same weights)."""
    model, kw = tiny_cogvideox(case, device), cogvideox_inputs(case, device)
    ref32 = run_cogvideox(model, kw)
    model = tiny_cogvideox(case, device, torch.bfloat16)
    kw16 = cogvideox_inputs(case, device, torch.bfloat16)
    eager16 = run_cogvideox(model, kw16)
    fusebox.patch(model)
    patched16 = run_cogvideox(model, kw16)
    assert patched16.dtype == torch.bfloat16 and bool(torch.isfinite(patched16).all())
    spread = rel_err(eager16, ref32)
    assert 1e-4 < spread < 5e-2, spread
    assert rel_err(patched16, ref32) < 1.25 * spread
    assert rel_err(patched16, eager16) < 1.5 * spread


@pytest.mark.parametrize("device", DEVICES)
def test_cogvideox_attention_matches_diffusers(device, monkeypatch):
    """The fused processor alone against ``CogVideoXAttnProcessor2_0`` on the same module: per-head
    LayerNorm of q and k, the video tokens rotated, the text tokens (first) not; the tables
    with the text's identity rows are formed once for all blocks of a forward."""
    from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0

    from fusebox.patch.dit.cogvideox import CogVideoXFusedAttnProcessor

    model = tiny_cogvideox("cogvideox", device)
    attn = model.transformer_blocks[0].attn1
    g = torch.Generator().manual_seed(5)
    b, text, video, d = 2, 3, 7, attn.inner_dim
    hs, ehs = (torch.randn(b, n, d, generator=g).to(device) for n in (video, text))
    angles = torch.rand(video, 8, generator=g) * 6
    rotary = tuple(t.repeat_interleave(2, -1).to(device) for t in (angles.cos(), angles.sin()))
    with torch.no_grad():
        want = CogVideoXAttnProcessor2_0()(attn, hs, ehs, image_rotary_emb=rotary)
        fused = CogVideoXFusedAttnProcessor(CogVideoXAttnProcessor2_0())
        cats = []
        cat = torch.cat
        monkeypatch.setattr(torch, "cat", lambda *a, **k: cats.append(1) or cat(*a, **k))
        with FuseboxOps() as ops:
            got = fused(attn, hs, ehs, image_rotary_emb=rotary)
            fused(attn, hs, ehs, image_rotary_emb=rotary)
    assert ops.calls == {"layer_norm": 4, "rotary": 2}
    assert len(cats) == 2 + 2      # text + video per call; cos and sin with text rows once
    for a, w in zip(got, want):       # video, then text
        assert a.shape == w.shape
        assert rel_err(a, w) < 1e-6


def test_cogvideox_attention_mask_keeps_diffusers_processor():
    from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0

    from fusebox.patch.dit.cogvideox import CogVideoXFusedAttnProcessor

    model = tiny_cogvideox("cogvideox")
    attn = model.transformer_blocks[0].attn1
    hs, ehs = torch.randn(2, 5, attn.inner_dim), torch.randn(2, 3, attn.inner_dim)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 2] = False
    with torch.no_grad():
        want = CogVideoXAttnProcessor2_0()(attn, hs, ehs, attention_mask=mask)
        with FuseboxOps() as ops:
            got = CogVideoXFusedAttnProcessor(CogVideoXAttnProcessor2_0())(
                attn, hs, ehs, attention_mask=mask)
    assert not ops.calls
    assert all(torch.equal(a, w) for a, w in zip(got, want))


def test_cogvideox_fused_qkv_projections():
    """After ``fuse_qkv_projections`` (``FusedCogVideoXAttnProcessor2_0``, one QKV projection)
    q, k and v are chunks of one tensor, read in place."""
    model, kw = tiny_cogvideox("cogvideox"), cogvideox_inputs("cogvideox")
    ref = run_cogvideox(model, kw)
    model.fuse_qkv_projections()
    report = fusebox.patch(model)
    assert sum(e.kind == "Attention" for e in report.patched) == 2
    with FuseboxOps() as ops:
        out = run_cogvideox(model, kw)
    assert ops.calls["rotary"] == 2 and ops.calls["layer_norm"] == 5, ops.calls
    assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("case", ["cogvideox", "consisid"])
def test_report_cogvideox(case):
    model = tiny_cogvideox(case)
    report = fusebox.patch(model)
    assert report.family == case
    kinds = Counter(e.kind for e in report.patched)
    block = "ConsisIDBlock" if case == "consisid" else "CogVideoXBlock"
    assert kinds[block] == 2 and kinds["Attention"] == 2 and kinds["AdaLayerNorm"] == 1
    assert kinds["GELU"] == 2
    skipped = {e.path: e.what for e in report.skipped}
    for name in ("norm1.norm", "norm2.norm", "attn1.norm_q", "attn1.norm_k"):
        assert skipped[f"transformer_blocks.1.{name}"].startswith("done by the ")
        assert not _common.is_patched(model.transformer_blocks[1].get_submodule(name))
    assert skipped["norm_out.norm"].startswith("done by the ")
    assert block in str(report)


def test_cogvideox_unpatch_restores():
    model, kw = tiny_cogvideox("cogvideox"), cogvideox_inputs("cogvideox")
    before = _state(model)
    ref = run_cogvideox(model, kw)
    fusebox.patch(model)
    fusebox.patch(model)       # a second patch is one patch
    assert fusebox.unpatch(model) > 0 and not fusebox.is_patched(model)
    assert _state(model) == before
    assert not any("_fusebox_undo" in m.__dict__ or "_fusebox_fused_into" in m.__dict__
                   for m in model.modules())
    assert torch.equal(run_cogvideox(model, kw), ref)


def test_cogvideox_custom_processor_left_alone():
    from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0

    class Custom(CogVideoXAttnProcessor2_0):
        pass

    model = tiny_cogvideox("cogvideox")
    model.transformer_blocks[0].attn1.set_processor(Custom())
    report = fusebox.patch(model)
    skipped = {e.path: e.what for e in report.skipped}
    assert "custom" in skipped["transformer_blocks.0.attn1"]
    assert type(model.transformer_blocks[0].attn1.processor) is Custom


@pytest.mark.parametrize("case", ["cogvideox", "consisid"])
def test_cogvideox_autograd_falls_back(case):
    """Training with gradient checkpointing (the blocks take their arguments positionally, the
    attention kwargs too): every fused forward falls back."""
    model, kw = tiny_cogvideox(case), cogvideox_inputs(case)
    model.enable_gradient_checkpointing()
    out = assert_patch_falls_back(model, lambda m: m(**kw)[0])
    out.sum().backward()
    assert model.transformer_blocks[0].norm1.linear.weight.grad is not None


def test_cogvideox_float64_falls_back():
    model = tiny_cogvideox("cogvideox", dtype=torch.float64)
    kw = cogvideox_inputs("cogvideox", dtype=torch.float64)
    assert_patch_falls_back(model, lambda m: run_cogvideox(m, kw))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["cogvideox", "consisid"])
def test_cogvideox_compiled_patched_block_fullgraph(case, device):
    model, kw = tiny_cogvideox(case, device), cogvideox_inputs(case, device)
    assert_compiled_first_block(model, lambda: run_cogvideox(model, kw),
                                {"rotary", "fused_norm", "gated_residual", "layer_norm"})


@pytest.mark.parametrize("order", ["patch-then-offload", "offload-then-patch"])
def test_cogvideox_accelerate_cpu_offload(order):
    """Under accelerate's hooks the norms' weights arrive with their own forwards: the blocks and
    the processor run those modules (the hooked LayerNorms eagerly) and fuse the rest: per
    block each stream's attention and feed-forward residuals, the RoPE of q and k."""
    model, kw = tiny_cogvideox("cogvideox"), cogvideox_inputs("cogvideox")
    ref = run_cogvideox(model, kw)
    offload_and_patch(model, order)
    assert _common.has_hooks(model.transformer_blocks[0].norm1.norm)
    with FuseboxOps() as ops:
        out = run_cogvideox(model, kw)
    assert ops.calls["gated_residual"] == 2 * 4 and ops.calls["rotary"] == 2, ops.calls
    assert rel_err(out, ref) < FP32_TOL
    assert_unpatch_keeps_hooks(model, lambda m: run_cogvideox(m, kw), ref)


def test_cogvideox_diffusers_group_offload():
    model, kw = tiny_cogvideox("cogvideox"), cogvideox_inputs("cogvideox")
    ref = run_cogvideox(model, kw)
    fusebox.patch(model)
    model.enable_group_offload(onload_device=torch.device("cpu"), offload_type="leaf_level")
    with FuseboxOps() as ops:
        out = run_cogvideox(model, kw)
    assert ops.calls["gated_residual"] == 2 * 4 and ops.calls["rotary"] == 2, ops.calls
    assert rel_err(out, ref) < FP32_TOL
