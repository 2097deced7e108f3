"""fusebox.patch on transformers decoder LLMs: tiny random models of each supported family
(no downloads) give the same logits and greedy tokens patched and unpatched, keep accelerate
hooks, fall back under autograd, compile without graph breaks, and unpatch exactly."""

import copy
import json
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fusebox  # noqa: E402
from fusebox.patch import _common  # noqa: E402
from helpers import (  # noqa: E402
    DEVICES,
    FALCON_VARIANTS,
    LLM_FAMILIES,
    LLM_KINDS_LEFT,
    FuseboxOps,
    GraphOps,
    TINY_LLM,
    causal_lm,
    rel_err,
    requires_cuda,
    tiny_falcon,
    tiny_llm,
    token_ids,
)

# what a full patch of a 2-layer model touches: every norm, MLP, attention and decoder layer
FUSED_LAYER_KINDS = ("Attention", "DecoderLayer", "MLP", "RMSNorm")


@torch.no_grad()
def logits(model, ids):
    return model(ids).logits


def build(name, device="cpu", **kwargs):
    """A tiny model of a family (LLM_FAMILIES), of a Falcon layout (FALCON_VARIANTS), of a
    LayerNorm LLM (LAYER_NORM_LLMS), of MORE_ATTENTION's families, Gemma 4, Qwen3.5 or
    DeepSeek-V3, on ``device``."""
    if name in FALCON_VARIANTS:
        return tiny_falcon(name, device=device, **kwargs)
    if name in LAYER_NORM_LLMS:
        return tiny_layer_norm_llm(name, device=device, **kwargs)
    if name in LLM_FAMILIES:
        return tiny_llm(name, device=device, **kwargs)
    if name == "gemma4_text":
        model = tiny_gemma4()
    elif name == "gemma3n_text":
        model = tiny_gemma3n()
    elif name == "qwen3_5_text":
        model = tiny_qwen3_5()
    elif name in LATENT_ATTENTION:
        model = tiny_latent_attention(name)
    else:
        cls_name, extra, _ = MORE_ATTENTION[name]
        model = causal_lm(getattr(transformers, cls_name)(**{**_TINY_BASE, **extra}))
    return model.to(device)


def fused_forwards(model):
    return {n: m.__dict__[_common.TAG_ATTR] for n, m in _common.patched_modules(model)}


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(LLM_FAMILIES))
def test_fp32_logits_match(family, device):
    model = tiny_llm(family, device=device)
    ids = token_ids(device=device)
    ref = logits(model, ids)
    report = fusebox.patch(model)
    assert report.family.startswith(family)
    left = LLM_KINDS_LEFT.get(family, ())
    for kind in FUSED_LAYER_KINDS:
        if kind not in left:
            assert any(e.kind.endswith(kind) for e in report.patched), (kind, str(report))
    assert all(e.kind.endswith(left) for e in report.skipped) if left else not report.skipped, \
        str(report)
    out = logits(model, ids)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "qwen3_moe", "glm4_moe", "gpt_oss",
                                    "olmo2", "smollm3", "llama4", "falcon-7b", "falcon-40b"])
def test_bf16_within_bf16_spread(family, device):
    """bf16 patched is no further from the fp32 model than bf16 unpatched is."""
    model32 = build(family, device=device)
    ids = token_ids(device=device)
    ref = logits(model32, ids)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    err_unpatched = rel_err(logits(model16, ids), ref)
    fusebox.patch(model16)
    err_patched = rel_err(logits(model16, ids), ref)
    assert err_patched <= 1.5 * err_unpatched + 2e-3, (err_patched, err_unpatched)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(LLM_FAMILIES) + list(FALCON_VARIANTS))
def test_greedy_generate_same_tokens(family, device):
    model = build(family, device=device)
    prompt = token_ids(batch=1, seq=6, device=device)
    kwargs = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, use_cache=True,
                  pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(prompt, **kwargs)
        fusebox.patch(model)
        out = model.generate(prompt, **kwargs)
    assert out.shape[1] == prompt.shape[1] + 32
    assert torch.equal(out, ref)


def test_glm4_moe_without_qk_norms():
    """GLM-4.5 configs without q/k norms (use_qk_norm=False) get the plain rotary."""
    model = tiny_llm("glm4_moe", use_qk_norm=False)
    ids = token_ids()
    ref = logits(model, ids)
    report = fusebox.patch(model)
    assert {e.what for e in report.patched if e.kind == "Glm4MoeAttention"} == {"rope"}
    assert rel_err(logits(model, ids), ref) < 1e-5


@pytest.mark.parametrize("family", ["llama", "gemma3", "falcon-40b"])
def test_eager_attention_returns_the_same_weights(family):
    """The attention interface of the config is used, and the patched attention returns what
    the original returns (attention probabilities with output_attentions)."""
    model = build(family)
    model.set_attn_implementation("eager")
    ids = token_ids()
    with torch.no_grad():
        ref = model(ids, output_attentions=True, output_hidden_states=True)
        fusebox.patch(model)
        out = model(ids, output_attentions=True, output_hidden_states=True)
    assert len(out.attentions) == len(ref.attentions) == 2
    for a, b in zip(out.attentions + out.hidden_states, ref.attentions + ref.hidden_states):
        assert rel_err(a, b) < 1e-5


def test_fused_operators_run(monkeypatch):
    """The fused path is taken (not a silent fallback): count the fusebox calls of a forward."""
    from fusebox import functional

    calls = {}
    for name in ("rms_norm", "fused_add_rms_norm", "qk_norm_rope", "rope", "gated_activation"):
        fn = getattr(functional, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)
        monkeypatch.setattr(functional, name, counted)
    model = tiny_llm("qwen3")
    fusebox.patch(model)
    logits(model, token_ids())
    # 2 layers: input norm each + final norm; one fused add+norm, qk-norm+rope, MLP per layer
    assert calls == {"rms_norm": 3, "fused_add_rms_norm": 2, "qk_norm_rope": 2,
                     "gated_activation": 2}


@pytest.mark.parametrize("family, expected", [
    # post-norm layers: each branch's norm and the residual add after it
    ("olmo2", {"rms_norm_add": 4, "fused_add_rms_norm": 0}),
    # sandwich layers: attention add + pre-feedforward norm, post-feedforward norm + add
    ("gemma3", {"rms_norm_add": 2, "fused_add_rms_norm": 2}),
])
def test_norm_then_residual_add_fused(monkeypatch, family, expected):
    from fusebox import functional

    calls = dict.fromkeys(expected, 0)
    for name in expected:
        fn = getattr(functional, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(functional, name, counted)
    model = tiny_llm(family)
    ids = token_ids()
    ref = logits(model, ids)
    report = fusebox.patch(model)
    assert any("rms_norm_add" in e.what for e in report.patched), str(report)
    assert rel_err(logits(model, ids), ref) < 1e-5
    assert calls == expected


def test_fp32_tables_fused_where_the_model_rounds_after_rotating(monkeypatch):
    """OLMo-2 keeps its rotary tables in fp32 and rounds the rotated q and k back to their
    dtype: the fused op (fp32 math, q's dtype out) takes those tables, in bf16 too. Llama's
    rotary returns the promoted dtype, so fp32 tables would not be its result."""
    import transformers.models.llama.modeling_llama as llama_module
    import transformers.models.olmo2.modeling_olmo2 as olmo2_module

    from fusebox import functional
    from fusebox.layers import rotary_rounds_to_input

    assert rotary_rounds_to_input(olmo2_module.apply_rotary_pos_emb, "half")
    assert not rotary_rounds_to_input(llama_module.apply_rotary_pos_emb, "half")
    calls = []
    fn = functional.qk_norm_rope
    monkeypatch.setattr(functional, "qk_norm_rope", lambda *a, **k: calls.append(1) or fn(*a, **k))
    model = tiny_llm("olmo2", dtype=torch.bfloat16)
    with torch.no_grad():
        cos, _ = model.model.rotary_emb(torch.zeros(1, dtype=torch.bfloat16), torch.arange(4)[None])
    assert cos.dtype == torch.float32
    fusebox.patch(model)
    logits(model, token_ids())
    assert len(calls) == 2


def test_post_norm_layer_with_differing_norms_left_alone():
    """The fused post-norm forward applies one formula to both norms: a layer whose norms
    differ (here in eps) keeps its forward, and says why."""
    model = tiny_llm("olmo2")
    model.model.layers[0].post_feedforward_layernorm.variance_epsilon = 1e-3
    report = fusebox.patch(model)
    skipped = [e for e in report.skipped if e.kind.endswith("DecoderLayer")]
    assert len(skipped) == 1 and "differ" in skipped[0].what, str(report)


# --------------------------------------------------------------------------- grouped keys under a mask


def _grouped_attention_inputs(device, dtype, batch=2, heads=4, kv_heads=2, seq=24, head_dim=64):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(batch, h, seq, head_dim, generator=gen).to(device, dtype)
               for h in (heads, kv_heads, kv_heads))
    i = torch.arange(seq)
    window = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 8)
    mask = window.expand(batch, 1, seq, seq).clone()
    mask[0, :, :, :3] = False            # a padded prompt: its first keys masked for every query
    mask[0, :, torch.arange(3), torch.arange(3)] = True
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.scaling = heads // kv_heads, True, 0.125
    return module, q, k, v, mask.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_masked_sdpa_matches_transformers(device, dtype):
    """Grouped keys with a mask through SDPA's grouped heads give transformers' result, where
    it repeats the keys and values over the query heads."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from fusebox.patch import llm

    module, q, k, v, mask = _grouped_attention_inputs(device, dtype)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=module.scaling)
    out, weights = llm._grouped_masked_sdpa(module, q, k, v, mask, scaling=module.scaling,
                                            sliding_window=8)
    assert weights is None and out.shape == ref.shape == (2, 24, 4, 64) and out.is_contiguous()
    assert not out.isnan().any()
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_grouped_sdpa_choice_unknown_keeps_transformers_path(monkeypatch):
    """A torch that cannot say which SDPA kernel grouped heads would get keeps the repeat."""
    from fusebox.patch import llm

    module, q, k, v, mask = _grouped_attention_inputs("cpu", torch.float32)

    def no_choice(*a, **k):
        raise AttributeError("_fused_sdp_choice")
    monkeypatch.setattr(torch, "_fused_sdp_choice", no_choice)
    assert llm._fused_grouped_kernel(q, k, v, mask, 0.125) is False


def test_additive_mask_formed_once_per_mask():
    from fusebox.patch import llm

    mask = torch.rand(1, 1, 5, 7) > 0.5
    bias = llm._additive_mask(mask, torch.bfloat16)
    assert bias.dtype == torch.bfloat16 and bias.shape == mask.shape
    assert torch.equal(bias == 0, mask) and torch.isneginf(bias[~mask]).all()
    assert llm._additive_mask(mask, torch.bfloat16) is bias          # the next layer's call
    assert llm._additive_mask(mask.clone(), torch.bfloat16) is not bias
    additive = torch.zeros(1, 1, 5, 7)
    assert llm._additive_mask(additive, torch.float32) is additive   # already additive


@pytest.mark.gpu
@requires_cuda
def test_grouped_masked_sdpa_taken_on_cuda(monkeypatch):
    """A patched bf16 model with grouped keys and a sliding window reaches SDPA through the
    grouped path where SDPA has a fused kernel for it, with the unpatched model's logits."""
    from fusebox.patch import llm

    module, q, k, v, mask = _grouped_attention_inputs("cuda", torch.bfloat16)
    fused_kernel = torch._fused_sdp_choice(
        q, k, v, llm._additive_mask(mask, q.dtype), 0.0, False, scale=0.125,
        enable_gqa=True) != int(torch.nn.attention.SDPBackend.MATH)
    calls = []
    original = llm._grouped_masked_sdpa

    def counted(*a, **kw):
        calls.append(1)
        return original(*a, **kw)
    monkeypatch.setattr(llm, "_grouped_masked_sdpa", counted)
    model = tiny_llm("mistral", head_dim=64, dtype=torch.bfloat16, device="cuda")
    ids = token_ids(device="cuda")
    ref = logits(model, ids)
    fusebox.patch(model)
    out = logits(model, ids)
    assert len(calls) == (2 if fused_kernel else 0)
    assert not out.isnan().any() and rel_err(out, ref) < 2e-2


# --------------------------------------------------------------------------- report, unpatch


def test_report_lists_patched_modules():
    model = tiny_llm("gemma3")
    report = fusebox.patch(model)
    paths = {e.path: e.what for e in report.patched}
    assert paths["model.layers.0.self_attn"] == "qk_norm_rope"
    assert paths["model.layers.1.mlp"] == "gated_activation (gelu_tanh)"
    assert paths["model.norm"] == "rms_norm"
    assert paths["model.layers.0"].startswith("fused_add_rms_norm")
    assert "pre_feedforward_layernorm" in paths["model.layers.0"]
    assert report.num_patched == 19 and "Gemma3Attention: qk_norm_rope" in str(report)


def test_patch_twice_is_idempotent_and_unpatch_restores():
    model = tiny_llm("llama")
    ids = token_ids()
    ref = logits(model, ids)
    before = {n: dict(m.__dict__) for n, m in model.named_modules()}
    first = fusebox.patch(model)
    second = fusebox.patch(model)
    assert first.summary() == second.summary()
    assert fusebox.is_patched(model)
    assert rel_err(logits(model, ids), ref) < 1e-5
    assert fusebox.unpatch(model) == first.num_patched
    assert not fusebox.is_patched(model)
    after = {n: dict(m.__dict__) for n, m in model.named_modules()}
    assert after.keys() == before.keys()
    for name in before:
        assert after[name].keys() == before[name].keys(), name
        assert "forward" not in after[name]
    assert torch.equal(logits(model, ids), ref)


def test_module_with_a_foreign_forward_is_skipped():
    """A forward replaced by something fusebox does not know (e.g. kernels' kernelize) is
    left as it is and reported; the rest of the model is patched."""
    model = tiny_llm("llama")
    ids = token_ids()
    ref = logits(model, ids)
    norm = model.model.norm
    norm.forward = lambda hidden_states: type(norm).forward(norm, hidden_states)
    report = fusebox.patch(model)
    skipped = {e.path: e.what for e in report.skipped}
    assert "wrapped" in skipped["model.norm"] and report.num_patched == 10
    assert rel_err(logits(model, ids), ref) < 1e-5


def test_unknown_model_untouched():
    # CPM-Ant: its own attention (a position bias, no rotary), its own norm and FFN classes
    model = causal_lm(transformers.CpmAntConfig(
        vocab_size=TINY_LLM["vocab_size"], hidden_size=64, num_attention_heads=4, dim_head=16,
        dim_ff=128, num_hidden_layers=2))
    ids = token_ids()
    ref = logits(model, ids)
    report = fusebox.patch(model)
    assert report.num_patched == 0 and not fusebox.is_patched(model)
    assert any("untouched" in n for n in report.notes)
    assert torch.equal(logits(model, ids), ref)


FALCON_ATTENTION = ("rope (q/k read from the fused QKV projection); multi-query keys expanded so "
                    "SDPA runs a fused kernel")

# layer_norm modules of a 2-layer model: per layer input (+ post-attention, or the attention and
# MLP norms of the new architecture), plus the final ln_f
FALCON_LAYER_NORMS = {"falcon-7b": 3, "falcon-40b": 5, "falcon-rw": 5}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(FALCON_VARIANTS))
def test_falcon_fp32_logits_match(variant, device):
    model = tiny_falcon(variant, device=device)
    ids = token_ids(device=device)
    ref = logits(model, ids)
    report = fusebox.patch(model)
    patched = report.summary()["patched"]
    assert patched["FalconAttention: " + FALCON_ATTENTION] == 2
    assert patched["LayerNorm: layer_norm"] == FALCON_LAYER_NORMS[variant]
    with FuseboxOps() as ops:
        out = logits(model, ids)
    # (its MLP is not gated: the GELU module runs as fusebox's activation)
    assert ops.calls == {"rotary": 2, "layer_norm": FALCON_LAYER_NORMS[variant], "act": 2}
    assert rel_err(out, ref) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_falcon_multi_query_attention_runs_a_fused_kernel():
    """Falcon-7B's single key head: unpatched, SDPA can only take its math path; patched, the
    keys are expanded and the math path can be forbidden."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model32 = tiny_falcon("falcon-7b", device="cuda")
    ids = token_ids(device="cuda")
    ref = logits(model32, ids)
    model = copy.deepcopy(model32).to(torch.bfloat16)
    err_unpatched = rel_err(logits(model, ids), ref)
    fused_only = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                  SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused_only), pytest.raises(RuntimeError):
        logits(model, ids)
    fusebox.patch(model)
    with sdpa_kernel(fused_only):
        out = logits(model, ids)
    assert torch.isfinite(out).all()
    err_patched = rel_err(out, ref)
    assert err_patched <= 1.5 * err_unpatched + 2e-3, (err_patched, err_unpatched)


# Cohere's tiny configs: Command R with its per-head q/k norms, Command R7B with a sliding layer
COHERE_CONFIGS = {"cohere": ("CohereConfig", {"use_qk_norm": True}),
                  "cohere2": ("Cohere2Config", {"sliding_window": 8,
                                                "layer_types": ["sliding_attention", "full_attention"]})}


@pytest.mark.parametrize("family", list(COHERE_CONFIGS))
def test_cohere_layer_norms_fused(family):
    """Cohere's fp32 LayerNorm without a bias runs as layer_norm, its per-head q/k norms keep
    their code: fp32 logits as unpatched, bf16 within the bf16 spread, and a compiled forward
    holds the operator without a graph break."""
    cls_name, extra = COHERE_CONFIGS[family]
    model = causal_lm(getattr(transformers, cls_name)(**{**TINY_LLM, **extra, "eos_token_id": 2,
                                                          "pad_token_id": 0, "bos_token_id": 1}))
    ids = token_ids()
    ref = logits(model, ids)
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    err_unpatched = rel_err(logits(model16, ids), ref)
    report = fusebox.patch(model)
    norms = [e for e in report.patched if e.kind.endswith("LayerNorm")]
    assert norms and all(e.what == "layer_norm" for e in norms), str(report)
    per_head = [e for e in report.skipped if e.kind.endswith("LayerNorm")]
    assert bool(per_head) == extra.get("use_qk_norm", False), str(report)
    with FuseboxOps() as ops:
        out = logits(model, ids)
    assert "layer_norm" in ops.calls, ops.calls
    assert rel_err(out, ref) < 1e-5
    fusebox.patch(model16)
    assert rel_err(logits(model16, ids), ref) <= 1.5 * err_unpatched + 2e-3
    torch._dynamo.reset()
    backend = GraphOps()
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, backend=backend)(ids).logits
    assert "layer_norm" in backend.ops
    assert rel_err(compiled, ref) < 1e-5


# LayerNorm LLMs: every torch.nn.LayerNorm runs as layer_norm, and the MLPs that read
# out(act(in(x))) run their activation fused (GELU-tanh in the first projection's GEMM
# epilogue on CUDA), and the partial rotary of Phi and GPT-NeoX runs as rope. family -> (config
# class, tiny values, LayerNorms of 2 layers, MLP's what, attention's what)
LAYER_NORM_LLMS = {
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64), 5,
             "c_fc with gelu_tanh in its GEMM epilogue (CUDA)", None),
    "gpt_neox": ("GPTNeoXConfig", dict(rotary_pct=0.25), 5, "activation (gelu)",
                 "rope (q/k read from the fused QKV projection)"),
    "phi": ("PhiConfig", dict(partial_rotary_factor=0.5), 3,
            "fc1 with gelu_tanh in its GEMM epilogue (CUDA)", "rope"),
    "starcoder2": ("Starcoder2Config", dict(residual_dropout=0.1), 5,
                   "c_fc with gelu_tanh in its GEMM epilogue (CUDA)", "rope"),
    "gptj": ("GPTJConfig", dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64), 3,
             "fc_in with gelu_tanh in its GEMM epilogue (CUDA)", "rope"),
    "opt": ("OPTConfig", dict(ffn_dim=128, word_embed_proj_dim=64), 5, None, None),
}


def assert_bf16_and_greedy_as_unpatched(model, model16, ref, err_unpatched, ids):
    """``model`` is patched, ``model16`` its unpatched bf16 copy: patched, the copy's logits
    stay within the bf16 spread of the fp32 ``ref``, and ``model`` decodes the same greedy
    tokens as after ``unpatch``."""
    fusebox.patch(model16)
    assert rel_err(logits(model16, ids), ref) <= 1.5 * err_unpatched + 2e-3
    prompt = token_ids(batch=1, seq=6, device=ids.device)
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        patched_tokens = model.generate(prompt, **kwargs)
        fusebox.unpatch(model)
        assert torch.equal(model.generate(prompt, **kwargs), patched_tokens)


def tiny_layer_norm_llm(family, dtype=torch.float32, device="cpu", **config):
    cls_name, extra, _, _, _ = LAYER_NORM_LLMS[family]
    config = getattr(transformers, cls_name)(**{**TINY_LLM, **extra, **config, "bos_token_id": 1,
                                                 "eos_token_id": 2, "pad_token_id": 0})
    return causal_lm(config).to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(LAYER_NORM_LLMS))
def test_layer_norm_llm_fused(family, device, monkeypatch):
    """fp32 logits as unpatched, every LayerNorm and the MLPs' activations fused (the tanh GELU
    by the GEMM epilogue on CUDA), the partial rotary as rope where the family's attention is
    known, bf16 within the bf16 spread, greedy tokens unchanged."""
    _, _, norms, mlp_what, attention_what = LAYER_NORM_LLMS[family]
    epilogues = []
    real = torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation",
                        lambda *a, **k: (epilogues.append(1), real(*a, **k))[1])
    model = tiny_layer_norm_llm(family, device=device)
    ids = token_ids(device=device)
    ref = logits(model, ids)
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    err_unpatched = rel_err(logits(model16, ids), ref)
    report = fusebox.patch(model)
    patched = report.summary()["patched"]
    assert patched["LayerNorm: layer_norm"] == norms, str(report)
    mlps = {k: v for k, v in patched.items() if k.split(":")[0].endswith("MLP")}
    assert mlps == ({} if mlp_what is None else {f"{k.split(':')[0]}: {mlp_what}": 2 for k in mlps})
    assert bool(mlps) == (mlp_what is not None), str(report)
    assert not any(k.split(":")[0].endswith("Activation") for k in patched), str(report)
    attention = {k: v for k, v in patched.items() if k.split(":")[0].endswith("Attention")}
    assert attention == ({} if attention_what is None else
                         {f"{k.split(':')[0]}: {attention_what}": 2 for k in attention}), attention
    assert bool(attention) == (attention_what is not None), str(report)
    with FuseboxOps() as ops:
        out = logits(model, ids)
    expected = {"layer_norm": norms}
    if mlp_what is not None:
        expected["act"] = 2
    if attention_what is not None:
        expected["rotary"] = 2
    assert ops.calls == expected, ops.calls
    assert len(epilogues) == (2 if device == "cuda" and "epilogue" in (mlp_what or "") else 0)
    assert rel_err(out, ref) < 1e-5
    assert_bf16_and_greedy_as_unpatched(model, model16, ref, err_unpatched, ids)


@pytest.mark.parametrize("device", DEVICES)
def test_phi_qk_layernorm_before_the_partial_rotary(device):
    """Phi with per-head q/k LayerNorms: both run as layer_norm ahead of the rope of the first
    rotary_ndims channels, as in the model (which norms [B, H, S, D], fusebox [B, S, H, D])."""
    model = tiny_layer_norm_llm("phi", device=device, qk_layernorm=True)
    ids = token_ids(device=device)
    ref = logits(model, ids)
    report = fusebox.patch(model)
    assert report.summary()["patched"]["PhiAttention: rope"] == 2, str(report)
    with FuseboxOps() as ops:
        out = logits(model, ids)
    assert ops.calls["layer_norm"] == 3 + 2 * 2 and ops.calls["rotary"] == 2, ops.calls
    assert rel_err(out, ref) < 1e-5


# StableLM and Persimmon: Phi's sliced rotary behind the older attention signature
# (position_ids, output_attentions, use_cache). family -> (config class, tiny values, what)
SLICED_ROTARY_LLMS = {
    "stablelm": ("StableLmConfig", dict(partial_rotary_factor=0.25), "rope"),
    "persimmon": ("PersimmonConfig", dict(partial_rotary_factor=0.5, num_key_value_heads=4),
                  "rope (q/k read from the fused QKV projection)"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qk_layernorm", [False, True], ids=["plain", "qk_layernorm"])
@pytest.mark.parametrize("family", list(SLICED_ROTARY_LLMS))
def test_sliced_rotary_attention_of_the_older_signature(family, qk_layernorm, device):
    """The rotary of the first rotary_ndims channels as one rope, after the q/k LayerNorms where
    the model has them (StableLM's, one per head, split the heads on dim 1): fp32 logits as
    unpatched, bf16 within the bf16 spread, greedy tokens unchanged."""
    cls_name, extra, what = SLICED_ROTARY_LLMS[family]
    config = getattr(transformers, cls_name)(**{**TINY_LLM, **extra, "qk_layernorm": qk_layernorm,
                                                 "bos_token_id": 1, "eos_token_id": 2,
                                                 "pad_token_id": 0})
    model = causal_lm(config).to(device)
    if qk_layernorm:   # norms off their init, so a wrong head or axis shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "layernorm.norms" in name or "q_layernorm" in name or "k_layernorm" in name:
                    p.add_(0.3 * torch.randn_like(p))
    ids = token_ids(device=device)
    ref = logits(model, ids)
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    err_unpatched = rel_err(logits(model16, ids), ref)
    report = fusebox.patch(model)
    attention = f"{type(model.model.layers[0].self_attn).__name__}: {what}"
    assert report.summary()["patched"][attention] == 2, str(report)
    with FuseboxOps() as ops:
        out = logits(model, ids)
    assert ops.calls["rotary"] == 2, ops.calls
    assert rel_err(out, ref) < 1e-5
    assert_bf16_and_greedy_as_unpatched(model, model16, ref, err_unpatched, ids)


# family -> the fused ops that step aside in train mode (None: not checked by name) and run in eval
STEPS_ASIDE = {"phi3": None, "starcoder2": ("act", "rotary"), "seed_oss": ("gated_act", "rotary")}


@pytest.mark.parametrize("family", list(STEPS_ASIDE))
def test_fused_forward_steps_aside_while_its_dropout_is_active(family):
    """Dropouts of train mode are applied as the model applies them: Phi-3's residual dropouts
    (its fused layer has none), StarCoder2's after its attention's and MLP's output projections,
    Seed-OSS's likewise (its fused attention and MLP have none). The fused forwards step aside,
    so the same random masks come out."""
    model = (tiny_layer_norm_llm("starcoder2") if family == "starcoder2" else
             build(family) if family in MORE_ATTENTION else tiny_llm(family)).train()
    ids = token_ids()
    torch.manual_seed(3)
    ref = logits(model, ids)
    fusebox.patch(model)
    torch.manual_seed(3)
    with FuseboxOps() as ops:
        out = logits(model, ids)
    aside = STEPS_ASIDE[family] or ()
    assert not any(op in ops.calls for op in aside), ops.calls
    if family == "starcoder2":
        assert ops.calls["layer_norm"] == 5
    assert rel_err(out, ref) < 1e-5
    model.eval()
    with FuseboxOps() as ops:
        assert rel_err(logits(model, ids), ref) > 1e-3   # (the masks did change the result)
    assert all(ops.calls[op] == 2 for op in aside), ops.calls


@pytest.mark.parametrize("module, cls, layout", [
    ("gpt2", "GPT2MLP", ("c_fc", "act", "c_proj")),
    ("starcoder2", "Starcoder2MLP", ("c_fc", "act", "c_proj")),
    ("phi", "PhiMLP", ("fc1", "activation_fn", "fc2")),
    ("gpt_neox", "GPTNeoXMLP", ("dense_h_to_4h", "act", "dense_4h_to_h")),
    ("falcon", "FalconMLP", None),      # the calls nested in one statement
    ("mpt", "MptMLP", None),            # adds the residual
    ("nemotron", "NemotronMLP", None),  # one nested return
    ("bloom", "BloomMLP", None),        # tensor-parallel slices, the residual
    ("llama", "LlamaMLP", None),        # gated
])
def test_plain_mlp_layout_read_from_the_forward(module, cls, layout):
    import importlib

    from fusebox.patch import llm

    mlp = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)
    found = llm.plain_mlp_layout(mlp)
    assert (found if found is None else tuple(found)) == layout


@pytest.mark.parametrize("act", ["gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu"])
def test_activation_module_fused_where_its_mlp_is_not(act):
    """An activation module of an MLP fusebox does not run as a whole (Falcon's: not gated, no
    ``out(act(in(x)))`` forward) runs as one fusebox pass: GELU-tanh as transformers writes it
    out (NewGELU, FastGELU) or calls it, and the exact GELU."""
    model = tiny_falcon("falcon-7b", activation=act)
    ids = token_ids()
    ref = logits(model, ids)
    report = fusebox.patch(model)
    kind = "gelu" if act == "gelu" else "gelu_tanh"
    acts = {k: v for k, v in report.summary()["patched"].items() if "activation" in k}
    assert list(acts.values()) == [2] and list(acts)[0].endswith(f": activation ({kind})"), acts
    with FuseboxOps() as ops:
        out = logits(model, ids)
    assert ops.calls["act"] == 2
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family,module", [
    ("llama", "model.layers.0.input_layernorm"),                 # RMSNorm
    ("gemma3", "model.layers.0.self_attn.k_norm"),                # (1 + w) RMSNorm of a head
    ("gpt2", "transformer.h.0.ln_1"),                              # LayerNorm
    ("falcon-7b", "transformer.h.0.mlp.act"),                      # activation module
])
def test_module_input_strided_along_its_rows(family, module, device):
    """A patched norm or activation called on a view whose last dimension is strided (Inkling's
    k_norm gets its short convolution's output transposed) returns what the unpatched module
    returns, where the operators alone refuse such a view."""
    model = (tiny_layer_norm_llm(family, device=device) if family in LAYER_NORM_LLMS
             else build(family, device=device) if family in FALCON_VARIANTS
             else tiny_llm(family, device=device))
    target = model.get_submodule(module)
    width = target.weight.shape[0] if getattr(target, "weight", None) is not None else 48
    x = torch.randn(2, width, 7, device=device).transpose(1, 2)   # [2, 7, width], row stride 7
    assert x.stride(-1) != 1
    with torch.no_grad():
        ref = target(x)
        fusebox.patch(model)
        assert _common.TAG_ATTR in target.__dict__, module
        with FuseboxOps() as ops:
            out = target(x)
    assert sum(ops.calls.values()) == 1, ops.calls
    assert out.shape == ref.shape and rel_err(out, ref) < 1e-6


def test_activation_without_a_kernel_reported_by_its_mlp():
    model = tiny_llm("llama", hidden_act="relu2")
    report = fusebox.patch(model)
    skipped = {e.kind: e.what for e in report.skipped}
    assert skipped["LlamaMLP"] == "activation ReLUSquaredActivation has no fused kernel"
    assert "ReLUSquaredActivation" not in skipped


def test_falcon_alibi_attention_left_alone():
    model = tiny_falcon("falcon-7b", alibi=True)
    ids = token_ids()
    ref = logits(model, ids)
    report = fusebox.patch(model)
    reasons = {e.kind: e.what for e in report.skipped}
    assert "ALiBi" in reasons["FalconAttention"]
    assert "residual adds kept" in reasons["FalconDecoderLayer"]
    assert report.summary()["patched"] == {"LayerNorm: layer_norm": 3,
                                           "GELUActivation: activation (gelu)": 2}
    assert rel_err(logits(model, ids), ref) < 1e-5
    fusebox.unpatch(model)
    assert torch.equal(logits(model, ids), ref)


def test_attention_left_alone_when_its_rotary_differs(monkeypatch):
    """A known attention class whose module rotates otherwise than any form fusebox runs (as a
    later transformers could write it) keeps its forward and the report says why."""
    import sys

    from fusebox.patch import llm

    def other_rotary(q, k, cos, sin, unsqueeze_dim=1):
        # pairs (i, i + 1) of neighbouring channels, overlapping: no rotation fusebox runs
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + q.roll(1, dims=-1) * sin, k * cos + k.roll(1, dims=-1) * sin

    model = tiny_llm("llama")
    ids = token_ids()
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    monkeypatch.setattr(module, "apply_rotary_pos_emb", other_rotary)
    llm._rotary_form.cache_clear()
    try:
        ref = logits(model, ids)
        report = fusebox.patch(model)
        reasons = {e.kind: e.what for e in report.skipped}
        assert "none of the rotations" in reasons["LlamaAttention"], str(report)
        assert not any(e.kind == "LlamaAttention" for e in report.patched)
        assert rel_err(logits(model, ids), ref) < 1e-5
    finally:
        llm._rotary_form.cache_clear()


_TINY_BASE = dict(TINY_LLM, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# tiny multi-head latent attention: LoRA ranks, 8 rotated of each head's 16 q/k channels
_MLA = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        "v_head_dim": 16, "num_key_value_heads": 4}
_MLA_MOE = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
# Families fused through classes whose forward reads as a named family's: (config class, extra
# config values, the classes fused)
BY_SOURCE = {
    "arcee": ("ArceeConfig", {}, ("ArceeAttention", "ArceeDecoderLayer")),
    "granite": ("GraniteConfig", {"residual_multiplier": 0.5, "attention_multiplier": 0.3,
                                  "embedding_multiplier": 2.0, "logits_scaling": 2.0},
                ("GraniteAttention",)),
    "deepseek_v3": ("DeepseekV3Config", {**_MLA, **_MLA_MOE},
                    ("DeepseekV3Attention", "DeepseekV3DecoderLayer")),
    # GLM-4.7-Flash: DeepSeek-V3's latent attention, word for word
    "glm4_moe_lite": ("Glm4MoeLiteConfig", {**_MLA, **_MLA_MOE}, ("Glm4MoeLiteAttention",)),
    # Gemma 4 Unified: Gemma 4's shared-KV attention, word for word
    "gemma4_unified_text": ("Gemma4UnifiedTextConfig", {
        "head_dim": 16, "global_head_dim": 32, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"], "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": TINY_LLM["vocab_size"]}, ("Gemma4UnifiedTextAttention",)),
    # interleaved pairs turned by the tables' first half, behind a Llama-like attention forward
    # (GLM-4: over half the head)
    "ernie4_5": ("Ernie4_5Config", {}, ("Ernie4_5Attention", "Ernie4_5DecoderLayer")),
    "glm4": ("Glm4Config", {"head_dim": 16, "partial_rotary_factor": 0.5},
             ("Glm4Attention", "Glm4MLP")),
}


# Attention classes named in the table whose forward differs from Llama's in what the fused
# forward checks or applies: OLMo's clip_qkv (patched where unset), Seed-OSS's output dropout,
# Ministral 3's q scale, HunYuan's q/k norms after the rotary, EXAONE 4's global NoPE layers,
# Nemotron's partial rotary (and its LayerNorm1P), MiniMax-M2's q/k norms across heads over a
# partial rotary, LFM2's names; FlexOlmo's reads as OLMo-2's
MORE_ATTENTION = {
    "apertus": ("ApertusConfig", {}, ("ApertusAttention",)),
    "nemotron": ("NemotronConfig", {"partial_rotary_factor": 0.5},
                 ("NemotronAttention", "NemotronLayerNorm1P")),
    "minimax_m2": ("MiniMaxM2Config", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                       "head_dim": 16, "rotary_dim": 8},
                   ("MiniMaxM2Attention", "MiniMaxM2DecoderLayer")),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", {"head_dim": 16}, ("HunYuanDenseV1Attention",)),
    # a short-convolution layer, then attention with q_layernorm / k_layernorm and out_proj
    "lfm2": ("Lfm2Config", {"layer_types": ["conv", "full_attention"]}, ("Lfm2Attention",)),
    "lfm2_moe": ("Lfm2MoeConfig", {"layer_types": ["conv", "full_attention"], "num_experts": 4,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                   "num_dense_layers": 1}, ("Lfm2MoeAttention",)),
    # q/k LayerNorms of a weight row per head, called as they are, then the interleaved rotary
    "cohere": ("CohereConfig", {"use_qk_norm": True}, ("CohereAttention",)),
    # Command R7B / A: rotary on the sliding layer, none on the global one
    "cohere2": ("Cohere2Config", {"sliding_window": 8,
                                  "layer_types": ["sliding_attention", "full_attention"]},
                ("Cohere2Attention",)),
    # a sliding layer with its rotary, then a global layer without (NoPE)
    "exaone4": ("Exaone4Config", {"sliding_window": 8,
                                  "layer_types": ["sliding_attention", "full_attention"]},
                ("Exaone4Attention",)),
    # Cohere2's, with the rotary also on the global layers where force_rope is set
    "cohere2_moe": ("Cohere2MoeConfig", {"sliding_window": 8, "num_experts": 4,
                                         "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "layer_types": ["sliding_attention", "full_attention"]},
                    ("Cohere2MoeAttention",)),
    "cohere2_moe_force_rope": ("Cohere2MoeConfig", {   # (dense layers of that pattern)
        "sliding_window": 8, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "mlp_layer_types": ["dense", "dense"],
        "prefix_dense_sliding_window_pattern": 1,
        "layer_types": ["sliding_attention", "full_attention"]}, ("Cohere2MoeAttention",)),
    "exaone_moe": ("ExaoneMoeConfig", {"sliding_window": 8, "num_experts": 4,
                                       "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                       "layer_types": ["sliding_attention", "full_attention"]},
                   ("ExaoneMoeAttention",)),
    "hy_v3": ("HYV3Config", {"num_experts": 4, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 32}, ("HYV3Attention",)),
    # Falcon-H1's attention (beside its Mamba mixer): the keys scaled before the rotary
    "falcon_h1": ("FalconH1Config", {"key_multiplier": 0.5, "mamba_d_ssm": 64, "mamba_n_heads": 8,
                                     "mamba_d_head": 8, "mamba_d_state": 16,
                                     "mamba_chunk_size": 16}, ("FalconH1Attention",)),
    # BitNet: the attention output normed (attn_sub_norm) before its projection
    "bitnet": ("BitNetConfig", {}, ("BitNetAttention",)),
    # attention sinks, a sliding layer with its rotary, a global one without (no position
    # embeddings reach it: the model's forward runs)
    "granite_swa": ("GraniteSWAConfig", {"layer_rope_theta": [10000.0, 0.0], "sliding_window": 8},
                    ("GraniteSWAAttention",)),
    # values of their own head size, scaled; sinks and twice the kv heads on the sliding layer;
    # rotary on a third of the head
    "mimo_v2_flash": ("MiMoV2FlashConfig", {
        "head_dim": 24, "v_head_dim": 16, "attention_value_scale": 0.5, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"], "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32}, ("MiMoV2FlashAttention",)),
    "olmo": ("OlmoConfig", {}, ("OlmoAttention",)),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2},
              ("OlmoeAttention", "OlmoeDecoderLayer")),
    "flex_olmo": ("FlexOlmoConfig", {"num_experts": 4, "num_experts_per_tok": 2},
                  ("FlexOlmoAttention",)),
    "seed_oss": ("SeedOssConfig", {"residual_dropout": 0.1}, ("SeedOssAttention",)),
    # q scaled by 1 + beta * log(1 + floor(position / 4)) after the rotary: tokens 4 and on
    "ministral3": ("Ministral3Config", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 64.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4, "llama_4_scaling_beta": 0.5}},
        ("Ministral3Attention", "Ministral3DecoderLayer")),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(BY_SOURCE) + list(MORE_ATTENTION))
def test_families_fused_by_their_forward_source(family, device):
    """Classes not named in the tables get a named family's fused forward where theirs reads
    the same, with the rotation the probe finds, and the named classes of MORE_ATTENTION theirs;
    logits as unpatched."""
    cls_name, extra, fused = {**BY_SOURCE, **MORE_ATTENTION}[family]
    # norm weights off their init, so where a norm applies shows
    model = vectors_off_init(causal_lm(getattr(transformers, cls_name)(**{**_TINY_BASE, **extra})))
    model = model.to(device)
    ids = token_ids(device=device)
    ref = logits(model, ids)
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    err_unpatched = rel_err(logits(model16, ids), ref)
    report = fusebox.patch(model)
    assert set(fused) <= {e.kind for e in report.patched}, str(report)
    assert rel_err(logits(model, ids), ref) < 1e-5
    fusebox.patch(model16)
    err_patched = rel_err(logits(model16, ids), ref)
    assert err_patched <= 1.5 * err_unpatched + 2e-3, (err_patched, err_unpatched)


def vectors_off_init(model, scale=0.3):
    """``model`` with every 1-D parameter (norm weights, biases) moved off its init: a norm
    applied in the wrong place or order then changes the logits."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(scale * torch.randn_like(p))
    return model


LATENT_ATTENTION = {
    # (config class, its extra values, the attention class)
    "deepseek_v3": ("DeepseekV3Config", {**_MLA, **_MLA_MOE}, "DeepseekV3Attention"),
    "deepseek_v2": ("DeepseekV2Config", {**_MLA, **_MLA_MOE}, "DeepseekV2Attention"),
    "minicpm3": ("MiniCPM3Config", _MLA, "MiniCPM3Attention"),
}


def tiny_latent_attention(family="deepseek_v3", device="cpu", **config):
    """2 layers of a latent-attention family (DeepSeek: a dense one, then a MoE one), with a q
    LoRA unless ``q_lora_rank=None``; the norm weights off their init."""
    cls_name, extra, _ = LATENT_ATTENTION[family]
    config = getattr(transformers, cls_name)(**{**_TINY_BASE, **extra, **config})
    return vectors_off_init(causal_lm(config)).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family,config", [
    ("deepseek_v3", {}), ("deepseek_v3", {"q_lora_rank": None}),
    ("deepseek_v3", {"rope_interleave": False}), ("deepseek_v2", {}),
    ("deepseek_v2", {"q_lora_rank": None}), ("minicpm3", {})],
    ids=["v3", "v3-q_proj", "v3-half", "v2", "v2-q_proj", "minicpm3"])
def test_latent_attention(family, config, device):
    """Multi-head latent attention: the rotary of q's last channels and of the shared key
    channels in one ``rope`` (DeepSeek-V3's interleaved pairs written back de-interleaved, as
    the model lays them out; V2's turned by its complex table; MiniCPM3's half-split), so the
    cache holds what it holds unpatched; fp32 logits as unpatched, bf16 within the bf16
    spread, greedy tokens unchanged."""
    model = tiny_latent_attention(family, device, **config)
    ids = token_ids(device=device)

    def run(m):
        with torch.no_grad():
            out = m(ids, use_cache=True)
        return out.logits, [(layer.keys, layer.values) for layer in out.past_key_values.layers]

    ref, ref_cache = run(model)
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    err_unpatched = rel_err(logits(model16, ids), ref)
    report = fusebox.patch(model)
    assert LATENT_ATTENTION[family][2] in {e.kind for e in report.patched}, str(report)
    with FuseboxOps() as ops:
        out, cache = run(model)
    assert ops.calls["rotary"] == 2, ops.calls     # one a layer
    assert rel_err(out, ref) < 1e-5
    for (keys, values), (ref_keys, ref_values) in zip(cache, ref_cache):
        assert rel_err(keys, ref_keys) < 1e-6 and rel_err(values, ref_values) < 1e-6
    assert_bf16_and_greedy_as_unpatched(model, model16, ref, err_unpatched, ids)


def tiny_gemma4(device="cpu"):
    """Gemma 4 text, 4 layers: sliding and full layers of two head sizes, the last two reusing
    the keys and values of the first two, full layers' values from their keys, per-layer
    inputs; the norm weights and layer scalars off their init."""
    config = transformers.Gemma4TextConfig(**{
        **_TINY_BASE, "num_hidden_layers": 4, "head_dim": 16, "global_head_dim": 32,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 8,
        "num_kv_shared_layers": 2, "attention_k_eq_v": True, "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": TINY_LLM["vocab_size"]})
    model = vectors_off_init(causal_lm(config))
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.6 + 0.2 * i)
    return model.to(device)


def tiny_gemma3n(device="cpu"):
    """Gemma 3n text, 4 layers: sliding and full layers, the last two reusing the keys and
    values of the first two, AltUp and LAuReL blocks, per-layer inputs, activation sparsity on
    the first layer's MLP; the norm weights off their init."""
    config = transformers.Gemma3nTextConfig(**{
        **_TINY_BASE, "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": TINY_LLM["vocab_size"],
        "laurel_rank": 8, "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0]})
    return vectors_off_init(causal_lm(config)).to(device)


# Gemma 4 and Gemma 3n (text): (tiny model, entries of the patch summary, fusebox operator calls
# of a forward)
SHARED_KV_MODELS = {
    "gemma4_text": (tiny_gemma4, {
        "Gemma4TextAttention: qk_norm_rope": 4,
        "Gemma4RMSNorm: rms_norm (no weight)": 2,       # the two layers' v_norm
        "Gemma4TextDecoderLayer: fused_add_rms_norm (attention residual + "
        "pre_feedforward_layernorm), rms_norm_add (post_feedforward_layernorm + residual and "
        "post_per_layer_input_norm + residual)": 4},
        {"rotary": 4, "gated_act": 4, "fused_add_rms_norm": 4, "rms_norm_add": 8}),
    "gemma3n_text": (tiny_gemma3n, {
        "Gemma3nTextAttention: qk_norm_rope": 4,
        "Gemma3nRMSNorm: rms_norm (no weight)": 2},
        {"rotary": 4}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(SHARED_KV_MODELS))
def test_shared_kv_models(family, device):
    """Gemma 4 and Gemma 3n: their RMSNorms (the weightless v_norm included) as rms_norm, q and
    k normed and rotated per head in one launch (q alone in the layers that reuse an earlier
    layer's keys and values, found by layer type in Gemma 4, by layer index in Gemma 3n); Gemma
    4's layer residual adds with their norms; fp32 logits as unpatched, bf16 within the bf16
    spread, greedy tokens unchanged."""
    build_tiny, entries, calls = SHARED_KV_MODELS[family]
    model = build_tiny(device)
    ids = token_ids(device=device)
    ref = logits(model, ids)
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    err_unpatched = rel_err(logits(model16, ids), ref)
    patched = fusebox.patch(model).summary()["patched"]
    assert {k: patched.get(k) for k in entries} == entries, patched
    with FuseboxOps() as ops:
        out = logits(model, ids)
    assert {k: ops.calls[k] for k in calls} == calls, ops.calls
    assert rel_err(out, ref) < 1e-5
    assert_bf16_and_greedy_as_unpatched(model, model16, ref, err_unpatched, ids)


@pytest.mark.parametrize("device", DEVICES)
def test_mllama_text_self_attention(device):
    """Llama 3.2 Vision's text model: its self-attention (attention mask before the position
    embeddings in its signature) with the rotary as rope; the cross-attention layer between,
    skipped without an image, keeps its code; fp32 logits as unpatched, bf16 within the bf16
    spread, greedy tokens unchanged."""
    config = transformers.MllamaTextConfig(**{**_TINY_BASE, "num_hidden_layers": 3,
                                              "cross_attention_layers": [1]})
    torch.manual_seed(0)
    model = vectors_off_init(transformers.MllamaForCausalLM(config).eval()).to(device)
    ids = token_ids(device=device)
    ref = logits(model, ids)
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    err_unpatched = rel_err(logits(model16, ids), ref)
    patched = fusebox.patch(model).summary()["patched"]
    assert patched["MllamaTextSelfAttention: rope"] == 2, patched
    with FuseboxOps() as ops:
        out = logits(model, ids)
    assert ops.calls["rotary"] == 2, ops.calls
    assert rel_err(out, ref) < 1e-5
    assert_bf16_and_greedy_as_unpatched(model, model16, ref, err_unpatched, ids)


def tiny_qwen3_5(device="cpu", moe=False):
    """Qwen3.5 text, 4 layers: linear attention, then gated self-attention (q and an output gate
    from one projection, per-head (1 + w) q/k norms, rotary on a quarter of the head), twice;
    the norm weights off their init."""
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32) if moe else {}
    config = getattr(transformers, "Qwen3_5MoeTextConfig" if moe else "Qwen3_5TextConfig")(**{
        **_TINY_BASE, "num_hidden_layers": 4, "head_dim": 16, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "layer_types": ["linear_attention", "full_attention"] * 2, **extra})
    return vectors_off_init(causal_lm(config)).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_qwen3_5_text(device, moe):
    """Qwen3.5: the gated self-attention's q/k norms and rotary in one launch, the output gate
    as the model applies it; every layer's mixer add and post_attention_layernorm in one op,
    after linear attention too; fp32 logits as unpatched, bf16 within the bf16 spread, greedy
    tokens unchanged."""
    model = tiny_qwen3_5(device, moe)
    ids = token_ids(device=device)
    ref = logits(model, ids)
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    err_unpatched = rel_err(logits(model16, ids), ref)
    patched = fusebox.patch(model).summary()["patched"]
    prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
    assert patched[f"{prefix}Attention: qk_norm_rope"] == 2, patched
    assert patched[f"{prefix}DecoderLayer: fused_add_rms_norm (token mixer residual + "
                   "post_attention_layernorm)"] == 4, patched
    with FuseboxOps() as ops:
        out = logits(model, ids)
    assert ops.calls["rotary"] == 2 and ops.calls["fused_add_rms_norm"] == 4, ops.calls
    assert rel_err(out, ref) < 1e-5
    assert_bf16_and_greedy_as_unpatched(model, model16, ref, err_unpatched, ids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_llama4_rotary_layers(device, rope):
    """Llama 4 rotates q and k by complex products, then normalizes them without a weight: one
    qk_norm_rope with the complex table written out as interleaved cos/sin (a rotation by
    tables of modulus one keeps the norm, so the order does not matter). YaRN's tables carry an
    attention scaling, which the norm after the rotation takes out: there the rope runs, then
    the norm. Its NoPE layer keeps its code."""
    scaled = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5,
                                  "original_max_position_embeddings": 64}}
    model = build("llama4", device=device, **(scaled if rope == "yarn" else {}))
    ids = token_ids(device=device)
    ref = logits(model, ids)
    report = fusebox.patch(model)
    what = "qk_norm_rope" if rope == "default" else "rope, then qk_norm"
    assert report.summary()["patched"][f"Llama4TextAttention: {what}"] == 1, str(report)
    skipped = {e.path: e.what for e in report.skipped}
    assert skipped["model.layers.1.self_attn"].startswith("a NoPE layer"), skipped
    with FuseboxOps() as ops:
        out = logits(model, ids)
    assert ops.calls["rotary"] == 1, ops.calls
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("family", ["olmo", "olmoe"])
def test_attention_with_clip_qkv_left_alone(family):
    """OLMo's clip_qkv clamps q, k and v, which the fused forward does not: a model that sets
    it keeps its attention, and the report says why."""
    cls_name, extra, _ = MORE_ATTENTION[family]
    model = causal_lm(getattr(transformers, cls_name)(**{**_TINY_BASE, **extra, "clip_qkv": 0.5}))
    ids = token_ids()
    ref = logits(model, ids)
    report = fusebox.patch(model)
    reasons = {e.kind: e.what for e in report.skipped}
    kind = type(model.model.layers[0].self_attn).__name__
    assert reasons[kind] == "config.clip_qkv is set (the fused forward does not apply it)"
    with FuseboxOps() as ops:
        assert rel_err(logits(model, ids), ref) < 1e-5
    assert "rotary" not in ops.calls


def test_non_transformers_module_untouched():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    report = fusebox.patch(module)
    assert report.num_patched == 0 and report.skipped


# --------------------------------------------------------------------------- safe orders and modes


@pytest.mark.parametrize("device", DEVICES)
def test_move_after_patch(device):
    """Patched on the CPU in fp32, then moved and cast: the fused forwards read the moved
    weights."""
    model = tiny_llm("qwen2")
    fusebox.patch(model)
    model.to(device=device, dtype=torch.bfloat16)
    ids = token_ids(device=device)
    ref = tiny_llm("qwen2", dtype=torch.bfloat16, device=device)
    with FuseboxOps() as ops:
        out = logits(model, ids)
    assert ops.calls["rms_norm"] and ops.calls["fused_add_rms_norm"] and ops.calls["gated_act"]
    assert rel_err(out.float(), logits(ref, ids).float()) < 2e-2
    model.model.norm.weight.data.zero_()    # the fused final norm reads the moved tensor itself
    assert not logits(model, ids).any()


def _offload(model, how):
    accelerate = pytest.importorskip("accelerate")
    if how == "cpu_offload":     # hooks on every module with weights (norms, Linears)
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
        return model.model.layers[0].input_layernorm
    # dispatch_model: one hook per device_map entry (here whole decoder layers)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu",
                  "lm_head": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu"}
    accelerate.dispatch_model(model, device_map=device_map, force_hooks=True)
    return model.model.layers[0]


@pytest.mark.parametrize("patch_first", [False, True], ids=["hooks-then-patch", "patch-then-hooks"])
@pytest.mark.parametrize("how", ["cpu_offload", "dispatch_model"])
def test_accelerate_hooks_survive(how, patch_first):
    model = tiny_llm("qwen3")
    ids = token_ids()
    ref = logits(model, ids)
    if patch_first:
        fusebox.patch(model)
    hooked = _offload(model, how)
    if not patch_first:
        fusebox.patch(model)
    assert "_hf_hook" in hooked.__dict__ and _common.is_patched(hooked)
    with FuseboxOps() as ops:
        out = logits(model, ids)
    assert ops.calls["rms_norm"] and ops.calls["rotary"]     # the fused forwards ran
    assert rel_err(out, ref) < 1e-5
    if not patch_first:
        fusebox.unpatch(model)
        assert "_hf_hook" in hooked.__dict__ and not fusebox.is_patched(model)
        assert torch.equal(logits(model, ids), ref)


def test_unpatch_after_hooks_added_keeps_them():
    accelerate = pytest.importorskip("accelerate")
    model = tiny_llm("qwen3")
    ids = token_ids()
    ref = logits(model, ids)
    fusebox.patch(model)
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    fusebox.unpatch(model)
    assert "_hf_hook" in model.__dict__ and not fusebox.is_patched(model)
    assert torch.equal(logits(model, ids), ref)


def test_training_with_grads_falls_back():
    model = tiny_llm("gemma3")
    ids = token_ids()
    model.train()
    ref = model(ids).logits
    fusebox.patch(model)
    out = model(ids).logits
    assert torch.equal(out, ref)          # the original forwards ran
    out.float().pow(2).mean().backward()
    assert model.model.layers[0].mlp.gate_proj.weight.grad is not None


@pytest.mark.parametrize("family", ["mistral", "gpt_oss"])
def test_inference_mode(family):
    """Patched models run under inference_mode (GPT-OSS: its tables written out for both halves
    are formed once per forward from inference tensors, which keep no version counter)."""
    model = tiny_llm(family)
    ids = token_ids()
    ref = logits(model, ids)
    fusebox.patch(model)
    with torch.inference_mode():
        out = model(ids).logits
    assert rel_err(out, ref) < 1e-5


def test_grouped_rms_norm_left_alone():
    """Qwen4-Exp normalizes its hyper-connection streams with an RMSNorm over groups of a row
    (``group_size``), written with Gemma's formula otherwise: a row norm would change it."""
    if not hasattr(transformers, "Qwen4ExpTextConfig"):
        pytest.skip("this transformers has no Qwen4-Exp")
    torch.manual_seed(0)
    config = transformers.Qwen4ExpTextConfig(
        **{**TINY_LLM, "head_dim": 16}, layer_types=["linear_attention", "qwen_sparse_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    model = causal_lm(config)
    ids = token_ids()
    ref = logits(model, ids)
    report = fusebox.patch(model)
    patched = {e.path for e in report.patched}
    grouped = [p for p, m in model.named_modules() if getattr(m, "group_size", None)]
    assert grouped and not patched & set(grouped), str(report)
    assert "model.layers.1.self_attn.q_norm" in patched, str(report)   # row norms still fused
    assert rel_err(logits(model, ids), ref) < 1e-5


# --------------------------------------------------------------------------- torch.compile


# the fused operators each family's compiled graph must hold
COMPILED_OPS = {"llama": {"rms_norm", "rotary", "gated_act"},
                "gemma3": {"rms_norm", "rotary", "gated_act", "rms_norm_add"},
                "gpt_oss": {"rms_norm", "rotary"},
                "qwen3_moe": {"rms_norm", "rotary", "gated_act"},
                "glm4_moe": {"rms_norm", "rotary", "gated_act"},
                "mixtral": {"rms_norm", "rotary"},
                "olmo2": {"rms_norm", "rotary", "gated_act", "rms_norm_add"},
                "smollm3": {"rms_norm", "rotary", "gated_act"},
                "phi3": {"rms_norm", "rotary", "gated_act_packed"},
                "llama4": {"rms_norm", "gated_act", "rotary"},
                "falcon-40b": {"rotary", "layer_norm"},
                "gpt2": {"layer_norm", "act"},
                "phi": {"layer_norm", "act", "rotary"},
                "gpt_neox": {"layer_norm", "act", "rotary"},
                "ministral3": {"rms_norm", "rotary", "gated_act"},
                "nemotron": {"layer_norm", "rotary"},
                "hunyuan_v1_dense": {"rms_norm", "rotary", "gated_act"},
                "gemma4_text": {"rms_norm", "rotary", "gated_act", "fused_add_rms_norm",
                                "rms_norm_add"},
                "qwen3_5_text": {"rms_norm", "rotary", "gated_act", "fused_add_rms_norm"},
                "deepseek_v3": {"rms_norm", "rotary", "gated_act", "fused_add_rms_norm"},
                "deepseek_v2": {"rms_norm", "rotary", "gated_act", "fused_add_rms_norm"},
                # its MLP (activation sparsity) keeps its code; the act_fn it calls alone is
                # left to the compiler, which fuses it with the product around it
                "gemma3n_text": {"rms_norm", "rotary"},
                "gptj": {"layer_norm", "act", "rotary"}}


@pytest.mark.parametrize("family", list(COMPILED_OPS))
def test_compile_fullgraph_no_graph_break(family):
    model = build(family)
    ids = token_ids()
    ref = logits(model, ids)
    fusebox.patch(model)
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    backend = GraphOps()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with torch.no_grad():
        out = compiled(ids).logits
    assert COMPILED_OPS[family] <= backend.ops   # the fused path was traced
    assert rel_err(out, ref) < 1e-5


MOE_LAYERS = {"qwen3_moe": 1, "qwen2_moe": 2, "mixtral": 2, "glm4_moe": 1, "deepseek_v2": 1}
# the routers run as one moe_topk a MoE layer (GLM-4.5's: sigmoid scores, a bias, groups)
ROUTED_LAYERS = MOE_LAYERS


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(MOE_LAYERS))
def test_grouped_experts_fused_eager_original_compiled(family, device, monkeypatch):
    """transformers' grouped experts (its default experts implementation) sort their pairs as
    one moe_sort, run their gate as one gated_activation_packed and their combine as one
    moe_combine a MoE layer and match the original in fp32; compiled, and with the
    experts split over ranks or another experts implementation, the original runs."""
    model = build(family, device=device)
    ids = token_ids(device=device)
    ref = logits(model, ids)
    report = fusebox.patch(model)
    assert any(e.kind.endswith("Experts") and "grouped experts" in e.what
               for e in report.patched), str(report)
    with FuseboxOps() as ops:
        out = logits(model, ids)
    assert ops.calls.get("gated_act_packed", 0) == MOE_LAYERS[family], ops.calls
    assert ops.calls.get("moe_combine", 0) == MOE_LAYERS[family], ops.calls
    assert ops.calls.get("moe_sort", 0) == MOE_LAYERS[family], ops.calls
    assert ops.calls.get("moe_topk", 0) == ROUTED_LAYERS[family], ops.calls
    assert rel_err(out, ref) < 1e-5
    torch._dynamo.reset()
    backend = GraphOps()
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, backend=backend)(ids).logits
    assert not {"gated_act_packed", "moe_combine", "moe_sort"} & backend.ops, backend.ops
    assert rel_err(compiled, ref) < 1e-5
    from fusebox.patch import llm as patch_llm
    for setting in ("ranks", "implementation"):
        with monkeypatch.context() as m:
            if setting == "ranks":
                m.setattr(patch_llm, "_expert_parallel", lambda: True)
            else:
                m.setattr(model.config, "_experts_implementation_internal", "batched_mm")
            with FuseboxOps() as ops:
                out = logits(model, ids)
        assert not {"gated_act_packed", "moe_combine", "moe_sort"} & set(ops.calls), \
            (setting, ops.calls)
        assert rel_err(out, ref) < 1e-5, setting


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family,config", [
    ("qwen3_moe", {}), ("qwen2_moe", {}), ("mixtral", {}), ("deepseek_v2", {}), ("glm4_moe", {}),
    ("deepseek_v3", {"n_routed_experts": 8, "n_group": 4, "topk_group": 2})])
def test_router_matches_the_original(family, config, device, dtype):
    """A fused router returns the original's logits, the same experts and weights of the same
    dtype within fp32 rounding (the unsorted top-k of DeepSeek's and GLM's compared by expert),
    eager and compiled, in one moe_topk; DeepSeek-V3's with a bias and 2 of 4 groups."""
    model = (tiny_latent_attention(family, device=device, **config) if family in LATENT_ATTENTION
             else build(family, device=device)).to(dtype)
    router = next(m for m in model.modules() if type(m).__name__.endswith("Router"))
    assert getattr(router, "num_group", 1) == config.get("n_group", getattr(router, "num_group", 1))
    gen = torch.Generator().manual_seed(3)
    if hasattr(router, "e_score_correction_bias"):
        router.e_score_correction_bias.copy_(0.1 * torch.randn(router.e_score_correction_bias.shape,
                                                               generator=gen))
    x = torch.randn(37, model.config.hidden_size, generator=gen).to(device, dtype)
    with torch.no_grad():
        want = router(x)
    fusebox.patch(model)
    with FuseboxOps() as ops, torch.no_grad():
        got = router(x)
    assert ops.calls.get("moe_topk") == 1, ops.calls
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(router, fullgraph=True)(x)
    for out in (got, compiled):
        assert torch.equal(out[0], want[0])
        index, order = out[2].sort(-1)
        want_index, want_order = want[2].sort(-1)
        assert torch.equal(index, want_index)
        weights, want_weights = out[1].gather(-1, order), want[1].gather(-1, want_order)
        assert weights.dtype == want_weights.dtype
        tol = 1e-6 if weights.dtype == torch.float32 else 1e-2
        assert torch.allclose(weights.float(), want_weights.float(), rtol=tol, atol=0)


def test_router_group_limited_keeps_its_code():
    """DeepSeek-V2's group-limited top-k is not fused: the router keeps its code and says why."""
    model = tiny_latent_attention("deepseek_v2", n_group=2, topk_group=1,
                                  topk_method="group_limited_greedy")
    ids = token_ids()
    ref = logits(model, ids)
    report = fusebox.patch(model)
    assert any(e.kind == "DeepseekV2TopkRouter" and "greedy alone is fused" in e.what
               for e in report.skipped), str(report)
    with FuseboxOps() as ops:
        out = logits(model, ids)
    assert "moe_topk" not in ops.calls and ops.calls.get("moe_combine") == 1, ops.calls
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("family", ["gemma3n_text"])
def test_activation_module_alone_runs_the_kernel_eager_and_torch_compiled(family):
    """A patched activation module called alone (Gemma 3n's sparse MLP; the act_fn of experts
    left to their own code) runs the operator in eager calls and its own torch form compiled,
    where the compiler fuses it with the product its caller forms."""
    model = build(family)
    ids = token_ids()
    ref = logits(model, ids)
    report = fusebox.patch(model)
    assert any(e.what.startswith("activation (") for e in report.patched), str(report)
    with FuseboxOps() as ops:
        eager = logits(model, ids)
    assert ops.calls.get("act", 0) > 0, ops.calls
    torch._dynamo.reset()
    backend = GraphOps()
    with torch.no_grad():
        out = torch.compile(model, fullgraph=True, backend=backend)(ids).logits
    assert "act" not in backend.ops and "rms_norm" in backend.ops, backend.ops
    assert rel_err(eager, ref) < 1e-5 and rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen3", "phi", "gptj", "deepseek_v3"])
def test_compiled_decode_step_leaves_its_rotary_to_the_compiler(family, device):
    # a one-token step compiled as generate compiles it (static cache, fullgraph): its rotary
    # is torch operations the compiler fuses with the cache write, the norms stay fused
    model = build(family, device=device)
    ids = token_ids(device=device)
    prompt, step = ids[:, :-1], ids[:, -1:]
    position = torch.tensor([prompt.shape[1]], device=device)

    def decode(model, run_step):
        cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + 4)
        with torch.no_grad():
            model(prompt, past_key_values=cache, use_cache=True)
            return run_step(step, past_key_values=cache, cache_position=position,
                            use_cache=True).logits

    ref = decode(model, model)
    fusebox.patch(model)
    torch._dynamo.reset()
    backend = GraphOps()
    out = decode(model, torch.compile(model, fullgraph=True, backend=backend))
    assert "rotary" not in backend.ops and backend.ops & {"rms_norm", "layer_norm"}, backend.ops
    assert rel_err(out, ref) < 1e-5


# --------------------------------------------------------------------------- guards


def _guard_trees(monkeypatch, model, ids):
    """The guard tree of ``model.__call__`` compiled as transformers' generate compiles its
    decode step (the model an argument, so every module reached is guarded), from dynamo's
    internals; skips where this torch does not expose them."""
    guards = pytest.importorskip("torch._dynamo.guards")
    if not hasattr(guards, "profile_guard_manager"):
        pytest.skip("this torch does not time its guards where the test looks for them")
    roots = []
    monkeypatch.setattr(guards, "profile_guard_manager",
                        lambda root, scope, iters: roots.append(root) or 0.0)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model.__call__, fullgraph=True, backend="eager")(ids)
    torch._dynamo.reset()
    assert len(roots) == 1
    if not hasattr(roots[0], "is_tag_safe_root"):
        pytest.skip("this torch has no dict-tag guard skipping")
    return roots[0]


def _children(manager):
    children = list(manager.get_child_managers())
    for pair in getattr(manager, "get_key_value_managers", dict)().values():
        children += [m for m in pair if m is not None]
    return children


def _tag_safe_roots(manager, out):
    """Sources of the modules whose guards dynamo skips while their ``__dict__`` is unchanged."""
    if manager.is_tag_safe_root():
        out.add(manager.get_source())
    for child in _children(manager):
        _tag_safe_roots(child, out)
    return out


def _checked_every_call(manager, out):
    """Sources of the guards outside every skippable module: dynamo checks these on each call."""
    if manager.is_tag_safe_root():
        return out
    out.add(manager.get_source())
    for child in _children(manager):
        _checked_every_call(child, out)
    return out


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "qwen3_moe", "gemma2", "gemma3",
                                    "gpt_oss", "glm4_moe", "olmo2", "smollm3", "phi3", "llama4"])
def test_compiled_patched_modules_keep_cheap_guards(family, monkeypatch):
    """A compiled forward checks its guards on every call: for a decode step of Gemma3-4B that
    was 0.19 ms unpatched, and 0.5-0.85 ms patched while the fused forwards held dataclasses and
    shared objects (torch.compile cannot skip a module's guards then, and checks each shared
    object's identity in Python, for every layer). Each module the patch replaces keeps the
    skipping it had unpatched, and no fused forward adds an identity check per layer. The
    decoder layers are checked on every call, patched or not, so their fused forwards hold no
    closure values (a dozen checks a layer when they did)."""
    model = tiny_llm(family)
    ids = token_ids()
    unpatched = _tag_safe_roots(_guard_trees(monkeypatch, model, ids), set())
    fusebox.patch(model)
    root = _guard_trees(monkeypatch, model, ids)
    patched = _tag_safe_roots(root, set())
    replaced = {"L['self']" + "".join(f"._modules['{p}']" for p in path.split("."))
                for path in fused_forwards(model)}
    assert replaced & unpatched   # the check below has modules to look at
    assert replaced & unpatched <= patched, sorted(replaced & unpatched - patched)
    per_layer_identity = [part for guard in root.get_epilogue_lambda_guards()
                          for part in guard.verbose_code_parts() if "__closure__" in part]
    assert not per_layer_identity, per_layer_identity
    closures = sorted(src for src in _checked_every_call(root, set())
                      if src.startswith("L['self']") and "__closure__" in src)
    assert not closures, closures[:4]


# --------------------------------------------------------------------------- e2e bench smoke


def _e2e_llm_configs():
    from fusebox.bench.e2e import llm as e2e_llm
    return [name for name in e2e_llm.CONFIGS if name != e2e_llm.TINY]


@pytest.mark.parametrize("name", _e2e_llm_configs())
def test_e2e_configs_build_and_fuse_their_attention(name):
    """Each end-to-end LLM config (the published values) builds, on the meta device, and gets
    its norms and attention fused, and its experts where it has them."""
    from fusebox.bench.e2e import llm as e2e_llm

    values = dict(e2e_llm.CONFIGS[name])
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    kinds = {e.kind for e in fusebox.patch(model).patched}
    assert any(k.endswith("Attention") for k in kinds), kinds
    assert any(k.endswith(("RMSNorm", "LayerNorm")) for k in kinds), kinds
    if any(type(m).__name__.endswith("Experts") for m in model.modules()):
        assert any(k.endswith("Experts") for k in kinds), kinds


def test_e2e_bench_tiny_on_cpu(tmp_path):
    """``fusebox bench e2e --model tiny-llm --device cpu``: the CI smoke run of the LLM bench."""
    from fusebox.__main__ import main

    rc = main(["bench", "e2e", "--model", "tiny-llm", "--device", "cpu", "--dtype", "fp32",
               "--quick", "--variants", "eager,patched", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "results_e2e.json").read_text())
    rec = doc["models"]["tiny-llm"]
    for variant in ("eager", "patched"):
        assert not rec["variants"][variant].get("error"), rec["variants"][variant]
        v = rec["variants"][variant]
        assert 0 < v["prefill_min_ms"] <= v["prefill_ms"]
    assert rec["variants"]["patched"]["decode_tok_s_b1"] > 0
    assert rec["summary"]["patched_vs_eager_rel_diff"] < 1e-4


def test_e2e_variant_in_own_process():
    """The CUDA-graph variants run in a child ``fusebox bench e2e``: its result comes back whole,
    and a child that fails says why."""
    import argparse

    from fusebox.bench.e2e import llm

    args = argparse.Namespace(dtype="fp32", device="cpu", quick=True)
    result = llm.run_in_own_process("tiny-llm", "patched", args)
    assert result["process"] == "own"
    assert not result.get("error"), result
    assert 0 < result["prefill_min_ms"] <= result["prefill_ms"]
    assert result["decode_tok_s_b1"] > 0
    assert result["rel_diff_vs_fp32"] < 1e-4
    with pytest.raises(RuntimeError, match="wrote no result"):
        llm.run_in_own_process("tiny-llm", "no-such-variant", args)


@pytest.mark.parametrize("variants", ["eager,patched", "patched"])
def test_e2e_parent_holds_no_model_while_a_child_runs(monkeypatch, variants):
    """Variants run in a child come after the ones run here, whose model is gone by then; the
    record keeps the order asked for, and a parent with nothing to run here builds no model."""
    import argparse

    from fusebox.bench.e2e import llm

    built, alive_at_child = [], []
    real_build, real_child = llm.build_model, llm.run_in_own_process

    def build(*a, **k):
        model = real_build(*a, **k)
        built.append(weakref.ref(model))
        return model

    def child(*a, **k):
        alive_at_child.append(sum(ref() is not None for ref in built))
        return real_child(*a, **k)

    monkeypatch.setattr(llm, "build_model", build)
    monkeypatch.setattr(llm, "run_in_own_process", child)
    monkeypatch.setattr(llm, "_runs_in_own_process", lambda v, a, d: v == "patched")
    args = argparse.Namespace(dtype="fp32", device="cpu", quick=True, variants=variants)
    record = llm.run("tiny-llm", args)
    assert list(record["variants"]) == variants.split(",")
    assert record["variants"]["patched"]["process"] == "own"
    assert record["variants"]["patched"]["decode_tok_s_b1"] > 0
    assert len(built) == (1 if "eager" in variants else 0)
    assert alive_at_child == [0]
    if "eager" in variants:
        assert "process" not in record["variants"]["eager"]
        assert record["summary"]["prefill_ms speedup patched vs eager"] > 0


def test_e2e_compiling_variants_run_in_own_process_on_cuda():
    """On CUDA every variant that compiles gets a process of its own (the second compiled
    prefill of a process ran slower, whichever variant it was); eager ones stay, the CPU keeps
    all, and --same-process keeps all."""
    import argparse

    from fusebox.bench.e2e import llm

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    args = argparse.Namespace(same_process=False)
    own = [v for v in llm.VARIANTS if llm._runs_in_own_process(v, args, cuda)]
    assert sorted(own) == sorted(v for v in llm.VARIANTS if "compile" in v or "graphs" in v)
    assert {"compile", "patched+compile", "graphs", "patched+graphs"} <= set(own)
    assert not any(llm._runs_in_own_process(v, args, cpu) for v in llm.VARIANTS)
    args.same_process = True
    assert not any(llm._runs_in_own_process(v, args, cuda) for v in llm.VARIANTS)


def test_e2e_own_process_rounds_alternate_and_report_medians(monkeypatch):
    """--rounds 3 on the variants timed in processes of their own: a child a variant a round,
    forward, reversed, forward; each variant reports the median of its rounds' decode rates,
    every round's rate kept, and a failed round's error beside them."""
    import argparse

    from fusebox.bench.e2e import llm

    calls = []
    rates = {"graphs": iter([180.0, 170.0, 190.0]), "patched+graphs": iter([200.0, 160.0, None])}

    def child(name, variant, args):
        calls.append(variant)
        rate = next(rates[variant])
        if rate is None:
            raise RuntimeError("the child process (exit 1) wrote no result: boom")
        return {"decode_tok_s_b1": rate, "decode_tok_s_b16": 10 * rate, "prefill_ms": rate / 10,
                "peak_mb": 5.0, "process": "own"}

    monkeypatch.setattr(llm, "run_in_own_process", child)
    monkeypatch.setattr(llm, "_runs_in_own_process", lambda v, a, d: True)
    args = argparse.Namespace(dtype="fp32", device="cpu", quick=True,
                              variants="graphs,patched+graphs", rounds=3)
    record = llm.run("tiny-llm", args)
    assert calls == ["graphs", "patched+graphs", "patched+graphs", "graphs", "graphs",
                     "patched+graphs"]
    graphs, patched = record["variants"]["graphs"], record["variants"]["patched+graphs"]
    assert graphs["decode_tok_s_b1"] == 180.0 and graphs["decode_tok_s_b1_rounds"] == [180.0, 170.0, 190.0]
    assert graphs["decode_tok_s_b16"] == 1800.0 and "round_errors" not in graphs
    assert graphs["prefill_ms"] == 18.0 and graphs["prefill_ms_rounds"] == [18.0, 17.0, 19.0]
    assert graphs["peak_mb"] == 5.0 and "peak_mb_rounds" not in graphs
    assert patched["decode_tok_s_b1"] == 180.0 and patched["decode_tok_s_b1_rounds"] == [200.0, 160.0]
    assert patched["round_errors"] == ["RuntimeError: the child process (exit 1) wrote no result: boom"]
    assert record["summary"]["decode_tok_s_b1 speedup patched+graphs vs graphs"] == 1.0
    # one round: each child's record as it came
    calls.clear()
    rates = {"graphs": iter([150.0]), "patched+graphs": iter([165.0])}
    record = llm.run("tiny-llm", argparse.Namespace(dtype="fp32", device="cpu", quick=True,
                                                    variants="graphs,patched+graphs"))
    assert calls == ["graphs", "patched+graphs"]
    assert record["variants"]["patched+graphs"] == {"decode_tok_s_b1": 165.0,
                                                    "decode_tok_s_b16": 1650.0,
                                                    "prefill_ms": 16.5, "peak_mb": 5.0,
                                                    "process": "own"}
