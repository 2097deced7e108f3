"""Shared test helpers: devices, dtype cases, tolerances, seeded inputs, strided views,
allocator poisoning and the output check every test uses; for the model patching tests, the
fusebox operator counter, the fallback and offload-hook checks, and tiny transformers LLMs."""

import contextlib
import math
from collections import Counter

import pytest
import torch
import torch.utils.deterministic
from torch.utils._python_dispatch import TorchDispatchMode

import reference

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])]

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [pytest.param(F32, id="f32"), pytest.param(F16, id="f16"), pytest.param(BF16, id="bf16")]

# Upper bounds of rel = ||out - ref|| / ||ref|| against a float64 reference, by output dtype:
# fp32-internal math with one final rounding.
TOL = {F32: 1e-5, F16: 2e-3, BF16: 8e-3}

# (dtype of the main input, dtype of the small operands: weight/bias/scale/shift/gate/cos/sin)
DTYPE_CASES = [
    pytest.param((F32, F32), id="f32"),
    pytest.param((F16, F16), id="f16"),
    pytest.param((BF16, BF16), id="bf16"),
    pytest.param((BF16, F32), id="bf16-f32small"),
    pytest.param((F16, F32), id="f16-f32small"),
]

# Row widths: tiny, odd, not a multiple of any vector width, typical, and big.
WIDTHS = [1, 7, 128, 769, 2048, 4096, 5125, pytest.param(16384, marks=pytest.mark.large)]
ODD_ROWS = [3, 17]


def big_rows(device: str) -> int:
    """Row count of the `large` cases: full size on CUDA, small on CPU (the CPU path is a
    scalar reference implementation and the float64 reference is slow at that size)."""
    return 1031 if torch.device(device).type == "cuda" else 5


# --------------------------------------------------------------------------- inputs


def randn(gen, shape, dtype=F32, device="cpu", scale=1.0, offset=0.0):
    """``offset + scale * randn(shape)`` drawn from `gen` on the CPU (same values on every
    device), then cast and moved."""
    t = torch.randn(tuple(shape), generator=gen, dtype=torch.float32)
    return (offset + scale * t).to(dtype=dtype, device=device)


def weight(gen, n, dtype=F32, device="cpu"):
    """A norm weight near one (never exactly ones)."""
    return randn(gen, (n,), dtype, device, scale=0.1, offset=1.0)


def small(gen, shape, dtype=F32, device="cpu"):
    """A scale/shift/gate/bias-like operand."""
    return randn(gen, shape, dtype, device, scale=0.5)


def row_slice(gen, shape, dtype=F32, device="cpu", pad=5, start=3):
    """A view of `shape` whose rows are a slice ``[start:start + D]`` of wider rows: unit last
    stride, row stride D + pad + start, storage offset `start` (deliberately unaligned)."""
    *lead, d = shape
    return randn(gen, (*lead, d + pad + start), dtype, device)[..., start:start + d]


def swapped_leading(gen, shape, dtype=F32, device="cpu"):
    """A [A, B, ..., D] view made by transposing a contiguous [B, A, ..., D] tensor."""
    a, b, *rest = shape
    return randn(gen, (b, a, *rest), dtype, device).transpose(0, 1)


# How a main input [A, B, ..., D] is laid out in memory.
LAYOUTS = ["contiguous", "row_slice", "swapped"]


def make_input(gen, layout, shape, dtype=F32, device="cpu", scale=1.0):
    """A main input of `shape` (at least 3-D for "swapped") in the given layout."""
    if layout == "contiguous":
        t = randn(gen, shape, dtype, device)
    elif layout == "row_slice":
        t = row_slice(gen, shape, dtype, device)
    elif layout == "swapped":
        t = swapped_leading(gen, shape, dtype, device)
    else:
        raise ValueError(layout)
    return t if scale == 1.0 else (t * scale).to(dtype)


# How scale/shift/gate broadcast against x [B, S, D].
MOD_KINDS = ["sample", "token", "sample_chunk", "token_chunk", "sample_expanded", "shared"]


def modulation(gen, kind, x_shape, count, dtype=F32, device="cpu"):
    """`count` modulation operands (scale, shift, gate, ...) for x of shape [B, S, D]:
    "sample" [B, 1, D]; "token" [B, S, D]; "sample_chunk" chunks of one [B, 6, D] table
    (as ``table.chunk(6, dim=1)``); "token_chunk" slices of one [B, S, 6, D] table (Wan 2.2);
    "sample_expanded" [B, 1, D] expanded to [B, S, D] (stride 0); "shared" [1, 1, D]."""
    b, s, d = x_shape
    if kind == "sample_chunk":
        table = small(gen, (b, 6, d), dtype, device)
        return list(table.chunk(6, dim=1))[:count]
    if kind == "token_chunk":
        table = small(gen, (b, s, 6, d), dtype, device)
        return [table[:, :, i] for i in range(count)]
    shape = {"sample": (b, 1, d), "token": (b, s, d), "sample_expanded": (b, 1, d),
             "shared": (1, 1, d)}[kind]
    out = [small(gen, shape, dtype, device) for _ in range(count)]
    if kind == "sample_expanded":
        out = [t.expand(b, s, d) for t in out]
    return out


# --------------------------------------------------------------------------- poisoning


@contextlib.contextmanager
def poison_allocator(device):
    """Make memory that an op allocates for its outputs read as NaN unless the op writes it.

    On CUDA, a NaN-filled set of blocks (small and large pool) is released to the caching
    allocator, which hands the same memory back for the op's outputs. On every device,
    ``torch.utils.deterministic.fill_uninitialized_memory`` with deterministic mode (warn
    only) makes every ``at::empty`` (the binding's output allocation) fill its result with
    NaN. Combine with the finiteness check in :func:`assert_close`.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        blocks = [torch.full((1 << 18,), math.nan, device=dev) for _ in range(8)]  # small pool
        blocks.append(torch.full((1 << 24,), math.nan, device=dev))  # 64 MiB, large pool
        del blocks
    else:  # best effort: glibc may hand the same pages back
        block = torch.full((1 << 20,), math.nan)
        del block
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]


def call(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` with the allocator of its first tensor argument poisoned."""
    device = next(a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
    with poison_allocator(device):
        out = fn(*args, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


# --------------------------------------------------------------------------- checks


def rel_err(out, ref):
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def assert_close(out, ref, dtype, tol=None, name="out"):
    """`out` has `dtype`, ref's shape and device, no NaN/Inf, and rel error below the
    tolerance of its dtype (or `tol`)."""
    assert isinstance(out, torch.Tensor), f"{name}: expected a tensor, got {type(out)}"
    assert out.dtype == dtype, f"{name}: dtype {out.dtype}, expected {dtype}"
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    assert out.device == ref.device, f"{name}: device {out.device}, expected {ref.device}"
    bad = (~torch.isfinite(out)).sum().item()
    assert bad == 0, f"{name}: {bad} of {out.numel()} values are NaN/Inf"
    if ref.numel() == 0:
        return
    assert ref.norm().item() > 0, f"{name}: degenerate reference (zero norm)"
    tol = TOL[dtype] if tol is None else tol
    r = rel_err(out, ref)
    assert r < tol, f"{name}: rel error {r:.3e} >= {tol:.0e} ({dtype}, shape {tuple(out.shape)})"


# --------------------------------------------------------------------------- rotary inputs

# q/k layouts: [B, S, H, D]; [B, H, S, D] (heads_first); flat [B, S, W] (LTX-Video).
ROPE_LAYOUTS = ["bshd", "bhsd", "flat"]
# cos/sin table shapes: [S, R]; [B, S, R]; [1, S, R] (batch broadcast); [S, R] expanded to
# [B, S, R] (stride 0); 4-D in q's layout with a size-1 head dim ([B, 1, S, R] heads_first,
# [B, S, 1, R] otherwise).
TABLE_KINDS = ["S", "BS", "1S", "BS_expand", "4d"]


def qk_pair(gen, layout, b, s, hq, hk, d, dtype=F32, device="cpu", strided=False):
    """q and k (hk heads, GQA) in `layout`. With `strided`, both are views of one fused qkv
    projection (``qkv.split`` over heads; for "bhsd" then transposed to [B, H, S, D]);
    for "flat", column slices of one [B, S, 3W + 5] tensor."""
    if layout == "flat":
        if strided:
            qkv = randn(gen, (b, s, 3 * d + 5), dtype, device)
            return qkv[..., :d], qkv[..., d:2 * d]
        return randn(gen, (b, s, d), dtype, device), randn(gen, (b, s, d), dtype, device)
    if strided:
        qkv = randn(gen, (b, s, (hq + 2 * hk) * d), dtype, device).unflatten(-1, (-1, d))
        q, k, _ = qkv.split([hq, hk, hk], dim=2)
        return (q.transpose(1, 2), k.transpose(1, 2)) if layout == "bhsd" else (q, k)
    shape = (lambda h: (b, h, s, d)) if layout == "bhsd" else (lambda h: (b, s, h, d))
    return randn(gen, shape(hq), dtype, device), randn(gen, shape(hk), dtype, device)


def rope_angles(gen, b, s, r, theta=10000.0):
    """[B, S, R/2] float64 angles of positions that differ per batch (random start)."""
    start = torch.randint(0, 64, (b, 1), generator=gen).double()
    pos = start + torch.arange(s, dtype=torch.float64)[None, :]
    inv_freq = theta ** (-2.0 * torch.arange(r // 2, dtype=torch.float64) / r)
    return pos[..., None] * inv_freq


def rope_tables(gen, kind, layout, b, s, r, interleaved, dtype=F32, device="cpu",
                independent=False):
    """cos, sin of shape `kind` for q in `layout`. Realistic tables repeat each angle for both
    channels of a pair; `independent` draws a separate angle per channel (the kernel must
    read each channel's own entry)."""
    if independent:
        angles = randn(gen, (b, s, r), torch.float64, scale=3.0)
        cos, sin = angles.cos(), angles.sin()
    else:
        cos, sin = reference.rope_table(rope_angles(gen, b, s, r), interleaved)
    cos, sin = cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)
    if kind == "S":
        cos, sin = cos[0], sin[0]
    elif kind == "1S":
        cos, sin = cos[:1], sin[:1]
    elif kind == "BS_expand":
        cos, sin = cos[:1].expand(b, s, r), sin[:1].expand(b, s, r)
    elif kind == "4d":
        dim = 1 if layout == "bhsd" else 2
        cos, sin = cos.unsqueeze(dim), sin.unsqueeze(dim)
    elif kind != "BS":
        raise ValueError(kind)
    return cos, sin


# --------------------------------------------------------------------------- patched models


# A DiT feed-forward's bias + GELU-tanh runs as fusebox's act pass or, on CUDA, in the epilogue
# of the projection's GEMM (aten._addmm_activation): the counters below count both as "act".
GEMM_GELU_OP = "_addmm_activation"


class FuseboxOps(TorchDispatchMode):
    """Counts the fusebox operators a region runs (``calls``: operator name -> count)."""

    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fusebox":
            self.calls[func._opname] += 1
        elif func._opname == GEMM_GELU_OP:
            self.calls["act"] += 1
        return func(*args, **(kwargs or {}))


class GraphOps:
    """A torch.compile backend that records the fusebox operators of the captured graphs
    (``ops``) and compiles them with aot_eager (which traces the operators' fake
    implementations). A dispatch mode such as :class:`FuseboxOps` would make dynamo skip the
    frame, so compiled regions are checked through their graphs instead."""

    def __init__(self):
        self.ops = set()

    def __call__(self, gm, example_inputs):
        targets = [str(n.target) for n in gm.graph.nodes]
        self.ops |= {t.split(".")[1] for t in targets if t.startswith("fusebox.")}
        if any(GEMM_GELU_OP in t for t in targets):
            self.ops.add("act")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def assert_patch_falls_back(model, run):
    """``run(model)`` before and after :func:`fusebox.patch`: patched, it runs no fusebox
    operator (every fused forward falls back) and gives the same output exactly. Returns the
    patched output."""
    import fusebox

    ref = run(model)
    fusebox.patch(model)
    with FuseboxOps() as ops:
        out = run(model)
    assert not ops.calls, ops.calls
    assert torch.equal(out, ref)
    return out


def offload_and_patch(model, order):
    """accelerate's ``cpu_offload`` and :func:`fusebox.patch`, patch first when ``order``
    starts with "patch", else offload first."""
    import fusebox

    accelerate = pytest.importorskip("accelerate")
    if order.startswith("patch"):
        fusebox.patch(model)
        accelerate.cpu_offload(model, execution_device="cpu")
    else:
        accelerate.cpu_offload(model, execution_device="cpu")
        fusebox.patch(model)


def assert_unpatch_keeps_hooks(model, run, ref):
    """:func:`fusebox.unpatch` puts the original forwards back inside accelerate's hooks,
    whichever came first; ``run(model)`` then runs no fusebox operator and gives ``ref``."""
    import fusebox
    from fusebox.patch import _common

    hooked = [m for m in model.modules() if "_hf_hook" in m.__dict__]
    fusebox.unpatch(model)
    assert not fusebox.is_patched(model)
    for m in hooked:
        assert "forward" in m.__dict__ and _common._is_original(m.__dict__.get("_old_forward"), m)
    with FuseboxOps() as ops:
        out = run(model)
    assert not ops.calls
    assert torch.equal(out, ref)


# --------------------------------------------------------------------------- tiny LLMs

LLM_VOCAB = 128
TINY_LLM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=LLM_VOCAB,
                 max_position_embeddings=256)
# family -> (transformers config class name, extra config values)
LLM_FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 16}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "ministral": ("MinistralConfig", {"head_dim": 16, "sliding_window": 16}),
    # MoE: 4 experts, 2 a token; Qwen3-MoE's second layer dense (a gated MLP to fuse), Qwen2-MoE's
    # shared expert a gated MLP; Mixtral has experts only
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "mlp_only_layers": [1]}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 64}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                  "sliding_window": 16}),
    # q/k norms across heads; NoPE layers (every 2nd without rotary) and a sliding window
    # fused QKV and gate/up projections, partial rotary (Phi-4-mini's 0.75), residual dropouts
    "phi3": ("Phi3Config", {"partial_rotary_factor": 0.75, "resid_pdrop": 0.1,
                            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", {"sliding_window": 8,
                              "layer_types": ["sliding_attention", "full_attention"]}),
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2, "sliding_window": 8,
                                  "use_sliding_window": True, "pad_token_id": 0,
                                  "bos_token_id": 1, "eos_token_id": 2}),
    # GLM-4.5: q/k norms per head, partial rotary (half the head), a dense first layer
    "glm4_moe": ("Glm4MoeConfig", {"head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                                   "use_qk_norm": True, "partial_rotary_factor": 0.5,
                                   "n_group": 1, "topk_group": 1}),
    # attention sinks, a sliding and a full layer, half-width rotary tables
    "gpt_oss": ("GptOssConfig", {"head_dim": 16, "num_local_experts": 4,
                                 "num_experts_per_tok": 2, "sliding_window": 8,
                                 "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 8}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 8,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
    # Llama 4: a dense layer with rotary and weightless q/k norms, then an MoE layer without
    # rotary (its shared expert a gated MLP); chunked attention
    "llama4": ("Llama4TextConfig", {"head_dim": 16, "intermediate_size_mlp": 128,
                                    "num_local_experts": 4, "num_experts_per_tok": 1,
                                    "interleave_moe_layer_step": 2, "use_qk_norm": True,
                                    "attention_chunk_size": 8, "no_rope_layers": [1, 0]}),
}


# module kinds a family has no fused forward for: MoE blocks (their router and experts modules
# have fused forwards of their own), GPT-OSS's experts (biases, interleaved gate/up,
# a clamped gate), Llama 4's attention on its NoPE layers (their temperature tuning keeps the
# model's code)
LLM_KINDS_LEFT = {"mixtral": ("MLP",), "gpt_oss": ("MLP", "Experts"), "llama4": ("Attention",)}


def tiny_llm(family, dtype=torch.float32, device="cpu", **overrides):
    """A 2-layer random transformers causal LM; norm weights get noise so (1 + w) and w both
    matter."""
    import transformers

    cls_name, extra = LLM_FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**TINY_LLM, **extra, **overrides})
    return causal_lm(config).to(device=device, dtype=dtype)


def causal_lm(config):
    """A random transformers causal LM of ``config`` (seeded), its 1-D parameters (norm weights,
    biases) given noise."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


# Falcon's three attention layouts: multi-query with a parallel MLP (7B), grouped keys with two
# norms (new decoder architecture: 40B/180B), one key per head with sequential residuals and
# biases (RW)
FALCON_VARIANTS = {
    "falcon-7b": dict(multi_query=True, parallel_attn=True),
    "falcon-40b": dict(new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True),
    "falcon-rw": dict(multi_query=False, parallel_attn=False, bias=True),
}


def tiny_falcon(variant, dtype=torch.float32, device="cpu", **overrides):
    """A 2-layer random FalconForCausalLM (rotary unless ``alibi=True`` is passed); 1-D
    parameters (norm weights, biases) get noise."""
    import transformers

    config = transformers.FalconConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=128,
        vocab_size=LLM_VOCAB, **{**FALCON_VARIANTS[variant], **overrides})
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(device=device, dtype=dtype)


def token_ids(batch=2, seq=24, device="cpu"):
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, LLM_VOCAB, (batch, seq), generator=gen).to(device)
