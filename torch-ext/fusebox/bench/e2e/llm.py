"""transformers decoder LLMs end to end: prefill and decode, eager vs ``fusebox.patch``.

Each model is built from the values of its published ``config.json`` with random weights
(std 0.02, no download). The weights are rounded to the benchmark dtype first, so the fp32
reference and the bf16 runs hold the very same weights and the bf16 spread (eager bf16 vs
fp32) is the compute error alone.

Measured per variant:

- ``prefill_ms``: one forward of ``PREFILL_TOKENS`` tokens at batch 1 (last-token logits, as
  ``generate`` asks for), and ``peak_mb`` for it;
- ``decode_tok_s_b1`` / ``decode_tok_s_b16``: greedy ``generate`` from a short prompt, each
  decode step timed on its own (a logits processor stamps the synchronized time after every
  step; generate synchronizes every step anyway), median over steps and runs;
- ``rel_diff_vs_fp32``: last-position logits of the prefill against the fp32 model (the
  same weights, every layer, run before the cast).

Variants:

- ``eager``, ``patched``: plain forwards; decode with transformers' dynamic cache;
- ``compile``, ``patched+compile``: prefill with each decoder layer under
  ``torch.compile(fullgraph=True)`` (regional compilation: the layers share one graph, so
  compiling costs one layer, and a graph break in a fused forward fails the variant); decode
  through transformers' compiled decode step on a static cache (not with ``--quick``);
- ``graphs``, ``patched+graphs`` (default on CUDA): decode only, on a static cache with the step
  compiled with ``mode="reduce-overhead"`` (CUDA graphs).

On CUDA every variant that compiles runs in a process of its own (``--same-process`` runs them
here), as a user's process compiles one model once: in one process, the graphs recorded after the
first recording launch slower (0.2-0.5 ms a decode step more, which made the second of the pair
7-11% slower whichever it was), and the second compiled prefill ran slower too, whichever it
was (DeepSeek-V2-Lite on an H100: compile 31.97 ms then patched + compile 43.53; in the other
order patched + compile 35.19 then compile 73.6).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch

from ..suite import DTYPES
from . import common

TINY = "tiny-llm"   # model names are shared by all e2e families (`--model tiny` runs every tiny-*)
MODELS = {
    "qwen3-8b": "Qwen/Qwen3-8B: 36 layers, 4096 wide, GQA 32/8, q/k RMSNorm",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B: 32 layers, 4096 wide, GQA 32/8",
    "mistral-7b": "mistralai/Mistral-7B-v0.1: 32 layers, 4096 wide, GQA 32/8, sliding window 4096",
    "gemma3-4b": "google/gemma-3-4b-it text model: 34 layers, 2560 wide, sandwich norms, q/k norm",
    "falcon-7b": "tiiuae/falcon-7b: 32 layers, 4544 wide, multi-query 71/1, LayerNorm, parallel MLP",
    "smollm3-3b": "HuggingFaceTB/SmolLM3-3B: 36 layers, 2048 wide, GQA 16/4, every 4th layer NoPE",
    "olmo2-7b": "allenai/OLMo-2-1124-7B: 32 layers, 4096 wide, q/k norms across heads, post-norm",
    "phi-2": "microsoft/phi-2: 32 layers, 2560 wide, LayerNorm, parallel attention + MLP, gelu_new, "
             "rotary on 32 of 80 head channels",
    "pythia-2.8b": "EleutherAI/pythia-2.8b (GPT-NeoX): 32 layers, 2560 wide, LayerNorm, parallel "
                   "residual, fused QKV, rotary on 20 of 80 head channels",
    "starcoder2-3b": "bigcode/starcoder2-3b: 30 layers, 3072 wide, GQA 24/2, LayerNorm, gelu-tanh MLP",
    "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite: 27 layers, 2048 wide, latent attention "
                        "(kv rank 512, rotary on 64 of 192 q/k channels), 64 experts, 6 a token",
    "olmoe-1b-7b": "allenai/OLMoE-1B-7B-0924: 16 layers, 2048 wide, q/k norms across heads, "
                   "64 experts of 1024, 8 a token",
    "moonlight-16b-a3b": "moonshotai/Moonlight-16B-A3B (DeepSeek-V3's architecture): 27 layers, "
                         "2048 wide, latent attention, 64 experts of 1408, 6 a token by sigmoid "
                         "scores with a bias",
    TINY: "2-layer Qwen3-style model, 128 wide (functional check; runs on CPU)",
}

# Values of the published config.json files (legacy key names; transformers converts them).
CONFIGS: Dict[str, dict] = {
    "qwen3-8b": dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_scaling=None, vocab_size=151936,
        max_position_embeddings=40960, max_window_layers=36, use_sliding_window=False,
        sliding_window=None, attention_bias=False, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645, initializer_range=0.02),
    "llama-3-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, hidden_act="silu", rms_norm_eps=1e-5,
        rope_theta=500_000.0, rope_scaling=None, vocab_size=128256, max_position_embeddings=8192,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001, initializer_range=0.02),
    "mistral-7b": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, hidden_act="silu", rms_norm_eps=1e-5,
        rope_theta=10000.0, sliding_window=4096, vocab_size=32000, max_position_embeddings=32768,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.02),
    "gemma3-4b": dict(
        model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        rope_local_base_freq=10000.0, rope_scaling={"factor": 8.0, "rope_type": "linear"},
        sliding_window=1024, sliding_window_pattern=6, vocab_size=262208,
        max_position_embeddings=131072, final_logit_softcapping=None,
        attn_logit_softcapping=None, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        initializer_range=0.02),
    "falcon-7b": dict(
        model_type="falcon", hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
        multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False,
        alibi=False, layer_norm_epsilon=1e-5, vocab_size=65024, bos_token_id=11,
        eos_token_id=11, initializer_range=0.02),
    "smollm3-3b": dict(
        model_type="smollm3", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=4, hidden_act="silu", rms_norm_eps=1e-6,
        rope_theta=5_000_000.0, vocab_size=128256, max_position_embeddings=65536,
        no_rope_layer_interval=4, use_sliding_window=False, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_id=128012, pad_token_id=128004, initializer_range=0.02),
    "olmo2-7b": dict(
        model_type="olmo2", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, hidden_act="silu", rms_norm_eps=1e-6,
        rope_theta=500_000.0, rope_scaling=None, vocab_size=100352, max_position_embeddings=4096,
        attention_bias=False, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=100257, pad_token_id=100277, initializer_range=0.02),
    "phi-2": dict(
        model_type="phi", hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, hidden_act="gelu_new",
        layer_norm_eps=1e-5, partial_rotary_factor=0.4, rope_theta=10000.0, rope_scaling=None,
        qk_layernorm=False, vocab_size=51200, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=50256, eos_token_id=50256,
        initializer_range=0.02),
    "pythia-2.8b": dict(
        model_type="gpt_neox", hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
        num_attention_heads=32, hidden_act="gelu", rotary_pct=0.25, rotary_emb_base=10000,
        layer_norm_eps=1e-5, use_parallel_residual=True, vocab_size=50304,
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0, initializer_range=0.02),
    "starcoder2-3b": dict(
        model_type="starcoder2", hidden_size=3072, intermediate_size=12288, num_hidden_layers=30,
        num_attention_heads=24, num_key_value_heads=2, hidden_act="gelu_pytorch_tanh",
        norm_epsilon=1e-5, rope_theta=999999.4420358813, sliding_window=4096, use_bias=True,
        vocab_size=49152, max_position_embeddings=16384, bos_token_id=0, eos_token_id=0,
        initializer_range=0.018042),
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
        first_k_dense_replace=1, moe_layer_freq=1, norm_topk_prob=False,
        routed_scaling_factor=1.0, topk_method="greedy", hidden_act="silu", rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32,
                                          "beta_slow": 1, "mscale": 0.707,
                                          "mscale_all_dim": 0.707,
                                          "original_max_position_embeddings": 4096},
        max_position_embeddings=163840, vocab_size=102400, tie_word_embeddings=False,
        bos_token_id=100000, eos_token_id=100001, initializer_range=0.02),
    "moonlight-16b-a3b": dict(
        model_type="deepseek_v3", hidden_size=2048, intermediate_size=11264, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
        first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.446, scoring_func="sigmoid", topk_method="noaux_tc",
        hidden_act="silu", rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=8192,
        vocab_size=163840, tie_word_embeddings=False, bos_token_id=163584, eos_token_id=163586,
        initializer_range=0.02),
    "olmoe-1b-7b": dict(
        model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=False, clip_qkv=None, hidden_act="silu", rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=4096, vocab_size=50304,
        tie_word_embeddings=False, pad_token_id=1, eos_token_id=50279, initializer_range=0.02),
    TINY: dict(
        model_type="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_act="silu",
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, vocab_size=512, max_position_embeddings=4096,
        tie_word_embeddings=False, initializer_range=0.02),
}

VARIANTS = ("eager", "patched", "compile", "patched+compile", "graphs", "patched+graphs")


def workload(name: str, args) -> dict:
    """Token counts and repetitions; ``--quick`` keeps the shapes but repeats less and decodes
    at batch 1 only."""
    tiny = name == TINY
    return {
        "prefill_tokens": 64 if tiny else 2048,
        "prompt_tokens": 8 if tiny else 32,
        "decode_steps": 8 if tiny else (16 if args.quick else 64),
        "decode_batches": (1,) if args.quick else (1, 16),
        # three with --quick: a median of two is their mean, which one slow forward moves (a
        # compiled DeepSeek-V2-Lite prefill read 37.7 ms against a minimum of 31.6)
        "iters": 3 if args.quick else 5,
        "warmup": 1 if args.quick else 2,
    }


def build_model(name: str, device: torch.device, dtype: torch.dtype):
    """The model in fp32 on ``device`` with weights already rounded to ``dtype``."""
    import transformers

    values = dict(CONFIGS[name])
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            if name == TINY and p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))   # norms off their init, so the check sees them
            p.copy_(p.to(dtype))
    return model


def _tokens(batch: int, length: int, vocab: int, device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).to(device)


def _set_variant(model, variant: str) -> None:
    import fusebox

    fusebox.unpatch(model)
    if variant.startswith("patched"):
        fusebox.patch(model)
    # transformers caches its compiled decode step on the model; it must see the new forwards
    model.__dict__.pop("_compiled_call", None)
    torch._dynamo.reset()


@contextlib.contextmanager
def _compiled_layers(model):
    """Each decoder layer under ``torch.compile(fullgraph=True)`` for the duration."""
    decoder = model.get_decoder()
    layers = decoder.layers if hasattr(decoder, "layers") else decoder.h   # Falcon: h
    originals = list(layers)
    for i, layer in enumerate(originals):
        layers[i] = torch.compile(layer, fullgraph=True)
    try:
        yield
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer


def _generate_kwargs(model, variant: str, max_cache_len: int) -> Callable[[], dict]:
    """generate() options of the variant; a callable since each call needs a fresh cache."""
    from transformers import StaticCache
    from transformers.generation import CompileConfig

    base = dict(do_sample=False, pad_token_id=0)
    if variant in ("eager", "patched"):
        return lambda: dict(base, disable_compile=True)
    mode = "reduce-overhead" if variant.endswith("graphs") else "default"
    compile_config = CompileConfig(fullgraph=True, mode=mode)
    return lambda: dict(base, compile_config=compile_config,
                        past_key_values=StaticCache(config=model.config,
                                                    max_cache_len=max_cache_len))


def _step_clock(device, stamps: List[float]):
    """A logits processor that records the synchronized time after each forward of generate."""
    from transformers import LogitsProcessor

    class StepClock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            common.sync(device)
            stamps.append(time.perf_counter())
            return scores

    return StepClock()


def decode_tokens_per_s(model, variant: str, batch: int, work: dict, device) -> float:
    from transformers import LogitsProcessorList

    steps = work["decode_steps"]
    prompt = _tokens(batch, work["prompt_tokens"], model.config.vocab_size, device, seed=2)
    options = _generate_kwargs(model, variant, work["prompt_tokens"] + steps + 1)
    step_ms: List[float] = []
    for run in range(work["warmup"] + work["iters"]):
        stamps: List[float] = []
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps + 1,
                       min_new_tokens=steps + 1,
                       logits_processor=LogitsProcessorList([_step_clock(device, stamps)]),
                       **options())
        if run >= work["warmup"]:   # stamps[0] closes the prefill; the rest are decode steps
            step_ms += [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    return batch * 1e3 / statistics.median(step_ms)


def _last_logits(forward, ids) -> torch.Tensor:
    return forward(ids, use_cache=False, logits_to_keep=1).logits[:, -1].float()


def run_variant(model, variant: str, work: dict, device, ids, ref_logits, quick: bool) -> dict:
    """Times one variant; ``ids`` is the prefill input, ``ref_logits`` its fp32 logits."""
    _set_variant(model, variant)
    out: Dict[str, Optional[float]] = {}
    logits = None
    if not variant.endswith("graphs"):
        with torch.inference_mode(), contextlib.ExitStack() as stack:
            if "compile" in variant:
                stack.enter_context(_compiled_layers(model))
            logits = _last_logits(model, ids)
            out["rel_diff_vs_fp32"] = common.rel_diff(logits, ref_logits)

            def forward():
                return model(ids, use_cache=False, logits_to_keep=1)

            t = common.time_ms(forward, device, warmup=work["warmup"], iters=work["iters"])
            out["prefill_ms"], out["prefill_min_ms"] = t["median_ms"], t["min_ms"]
            out["peak_mb"] = common.peak_memory_mb(forward, device)
    if quick and "compile" in variant:
        return out, logits
    with torch.no_grad():
        for batch in work["decode_batches"]:
            out[f"decode_tok_s_b{batch}"] = decode_tokens_per_s(model, variant, batch, work,
                                                                device)
    return out, logits


DEFAULT_VARIANTS = "eager,patched,compile,patched+compile"  # plus the graph pair on a GPU


def _variants(args, device) -> list:
    names = [v.strip() for v in (args.variants or DEFAULT_VARIANTS).split(",") if v.strip()]
    if args.variants is None and device.type == "cuda":
        names += ["graphs", "patched+graphs"]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    return names


def run(name: str, args) -> dict:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    work = workload(name, args)
    variants = _variants(args, device)
    elsewhere = [v for v in variants if _runs_in_own_process(v, args, device)]
    here = [v for v in variants if v not in elsewhere]

    record = {"model": name, "description": MODELS[name], "variants": dict.fromkeys(variants),
              "summary": {}, "dtype": args.dtype, "device": str(device),
              "workload": {k: v for k, v in work.items() if k not in ("iters", "warmup")}}
    logits = {}
    if here:
        model = build_model(name, device, dtype)
        ids = _tokens(1, work["prefill_tokens"], model.config.vocab_size, device, seed=1)
        ref_logits = None
        if any(not v.endswith("graphs") for v in here):   # the graph variants time decode alone
            with torch.inference_mode():
                ref_logits = _last_logits(model, ids)
        model.to(dtype)
        for variant in here:
            record["variants"][variant], logits[variant] = common.run_guarded(
                variant, device,
                lambda: run_variant(model, variant, work, device, ids, ref_logits, args.quick))
        _set_variant(model, "eager")
        del model, ids, ref_logits
        common.release(device)
    # each child builds its own model, so this process holds none while they run; with
    # --rounds N the children run N times, every other round in the reverse order (one
    # variant's decode rate moved up to 15% from one process to the next: bench/results/
    # 2026-12-05_h100_0e9703a/), and each variant reports its medians
    rounds = getattr(args, "rounds", 1)
    per_round: Dict[str, List[dict]] = {v: [] for v in elsewhere}
    for r in range(rounds):
        for variant in elsewhere if r % 2 == 0 else elsewhere[::-1]:
            per_round[variant].append(common.run_guarded(
                variant, device, lambda: (run_in_own_process(name, variant, args), None))[0])
    for variant, recs in per_round.items():
        keys = sorted({k for rec in recs for k, v in rec.items()
                       if k.startswith(("decode_tok_s", "prefill_ms", "prefill_min_ms"))
                       and isinstance(v, (int, float))})
        record["variants"][variant], logits[variant] = common.merge_rounds(recs, keys), None
    record["summary"] = summarize(record["variants"], logits)
    if getattr(args, "attention_backend", None):
        record["summary"]["attention_backend"] = "not applied (a diffusers option)"
    return record


def _runs_in_own_process(variant: str, args, device) -> bool:
    """The variants that compile (``compile``, CUDA graphs), on CUDA, unless ``--same-process``."""
    return (("compile" in variant or variant.endswith("graphs")) and device.type == "cuda"
            and not getattr(args, "same_process", False))


def run_in_own_process(name: str, variant: str, args) -> dict:
    """The result of one variant timed by ``fusebox bench e2e`` in a child process."""
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, "-m", "fusebox", "bench", "e2e", "--model", name, "--variants", variant,
                "--dtype", args.dtype, "--device", args.device, "--same-process", "--out", out]
        # the child imports the fusebox this process runs
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (package_root, os.environ.get("PYTHONPATH")) if p))
        done = subprocess.run(argv + (["--quick"] if args.quick else []), capture_output=True,
                              text=True, env=env)
        try:
            with open(f"{out}/results_e2e.json") as f:
                result = json.load(f)["models"][name]["variants"][variant]
        except (OSError, KeyError, ValueError):
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the child process (exit {done.returncode}) wrote no result: "
                               f"{last}") from None
    result["process"] = "own"
    return result


def summarize(results: Dict[str, dict], logits: Dict[str, torch.Tensor]) -> dict:
    summary = {}
    if logits.get("eager") is not None and logits.get("patched") is not None:
        # the patched error beside the spread of the dtype itself (eager against fp32)
        summary["patched_vs_eager_rel_diff"] = common.rel_diff(logits["patched"], logits["eager"])
        summary["eager_vs_fp32_rel_diff"] = results["eager"].get("rel_diff_vs_fp32")
        summary["patched_vs_fp32_rel_diff"] = results["patched"].get("rel_diff_vs_fp32")
    for base, fused in (("eager", "patched"), ("compile", "patched+compile"),
                        ("graphs", "patched+graphs")):
        a, b = results.get(base, {}), results.get(fused, {})
        for key in ("prefill_ms",):
            if a.get(key) and b.get(key):
                summary[f"{key} speedup {fused} vs {base}"] = round(a[key] / b[key], 3)
        for key in (k for k, v in b.items()
                    if k.startswith("decode_tok_s") and isinstance(v, (int, float))):
            if a.get(key) and b.get(key):
                summary[f"{key} speedup {fused} vs {base}"] = round(b[key] / a[key], 3)
    return summary


__all__ = ["CONFIGS", "MODELS", "build_model", "run"]
