"""Runs ``fusebox.patch`` over every causal-LM architecture of the installed transformers: each
model type is built tiny with random weights (2 layers, width 64), run, patched and run again
on the same tokens, in fp32 on the CPU. A type that is too large at the tiny settings, or does
not run with them, is tried again with its expert, latent-attention, state-space, per-layer-input
and layer-pattern sizes shrunk (SHRUNK, LAYER_PATTERNS; "(shrunk config)" on its line), and a
text + vision model once more with that text part and a one-layer vision tower. Prints
one line per model type: OK (logits within 1e-5 of unpatched) with what was fused, untouched
(nothing recognized), MISMATCH, FAIL (the patched model raised), or skip (neither config
builds and runs).
Exits 1 on any MISMATCH or FAIL.

    PYTHONPATH=torch-ext python scripts/compat_sweep.py [model_type ...] [--max-params 30e6]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import sys
import traceback
import warnings
from collections import Counter

import torch

TOL = 1e-5
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    try:
        return cls(**TINY)
    except Exception:  # noqa: BLE001 - configs that refuse a key get the values one by one
        config = cls()
        for key, value in TINY.items():
            if hasattr(config, key):
                try:
                    setattr(config, key, value)
                except Exception:  # noqa: BLE001
                    pass
        return config


# Second attempt for types that skip at TINY: their expert, latent-attention, state-space and
# layer-pattern sizes shrunk to match it (each key only where the config has it).
SHRUNK = dict(
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    num_experts_per_token=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
    shared_intermediate_size=64, n_group=1, topk_group=1, num_expert_group=1,
    first_k_dense_replace=1, num_dense_layers=1, n_shared_experts=1,
    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, rotary_dim=8,
    mamba_n_heads=8, mamba_d_head=16, mamba_headdim=16, n_mamba_heads=8, mamba_d_state=16,
    mamba_chunk_size=16, mamba_dt_rank=8, use_mamba_kernels=False,
    attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
    attn_layer_indices=[1], num_kv_shared_layers=0, vocab_size_per_layer_input=128,
    hidden_size_per_layer_input=16, laurel_rank=8, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
    indexer_compress_ratio=4)


# Layer patterns the shrunk retry cannot read from a type's defaults (one kind only, or none)
LAYER_PATTERNS = {"granitemoehybrid": ["mamba", "attention"],
                  "lfm2_moe": ["conv", "full_attention"],
                  "qwen4_exp_text": ["linear_attention", "qwen_sparse_attention"]}


def shrunk_config(model_type: str):
    """TINY with SHRUNK's sizes where the config has the key; latent attention (a kv LoRA rank)
    with as many kv heads as heads and its rotary width as the head size, and layer-type lists
    cut to TINY's layers, one of each type where the list has two."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls()
    values = dict(TINY, **{k: v for k, v in SHRUNK.items() if hasattr(defaults, k)})
    if getattr(defaults, "q_lora_rank", None):
        values["q_lora_rank"] = 32
    if hasattr(defaults, "kv_lora_rank"):
        values.update(num_key_value_heads=TINY["num_attention_heads"],
                      head_dim=SHRUNK["qk_rope_head_dim"])
    layers = TINY["num_hidden_layers"]
    for key in ("layer_types", "mlp_layer_types", "activation_sparsity_pattern"):
        kinds = getattr(defaults, key, None)
        derived = key not in inspect.signature(cls.__init__).parameters   # e.g. from periods
        if isinstance(kinds, (list, tuple)) and kinds and not derived:
            values[key] = (list(dict.fromkeys(kinds)) * layers)[:layers]
    if model_type in LAYER_PATTERNS:
        values["layer_types"] = LAYER_PATTERNS[model_type]
    try:
        return cls(**values)
    except Exception:  # noqa: BLE001 - as tiny_config: the values one by one
        config = cls()
        for key, value in values.items():
            try:
                setattr(config, key, value)
            except Exception:  # noqa: BLE001
                pass
        return config


# The vision tower of a text + vision model for the third try: one 32-wide layer on 28-pixel
# images (each key only where the vision config reads it)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14, depth=1, num_heads=2, out_hidden_size=64,
              embed_dim=32)


def multimodal_config(model_type: str):
    """A text + vision model (Gemma 3, Mllama...) with its text part as ``shrunk_config`` builds
    the text model type and a one-layer vision tower: the tokens-only forward runs the text
    model, the patch reaches the vision tower's modules too."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls()
    text = getattr(defaults, "text_config", None)
    if text is None or getattr(defaults, "vision_config", None) is None:
        raise ValueError(f"{model_type} has no text and vision configs")
    return cls(text_config=shrunk_config(text.model_type).to_dict(), vision_config=VISION)


CONFIG_LABELS = {"shrunk_config": " (shrunk config)", "multimodal_config": " (text + tiny vision)"}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def sweep_one(model_type: str, max_params: float) -> str:
    import fusebox

    built = None
    for make in (tiny_config, shrunk_config, multimodal_config):
        built = build_tiny(make, model_type, max_params)
        if not isinstance(built, str):
            break
    if isinstance(built, str):
        return built
    model, ids, ref, label = built
    try:
        report = fusebox.patch(model)
        with torch.no_grad():
            out = model(ids).logits
    except Exception as e:  # noqa: BLE001
        where = traceback.extract_tb(e.__traceback__)[-1]
        return f"FAIL {type(e).__name__}: {str(e)[:160]} ({where.filename.split('/')[-1]}:{where.lineno})"
    err = rel_err(out, ref)
    # fp32 logits differ from unpatched by the fused ops' summation order, about 1e-6; a
    # formula off in one module of a tiny model shows from a few 1e-5 up (Qwen4-Exp's grouped
    # norms read as row norms: 4e-5)
    if err >= TOL:
        return f"MISMATCH rel err {err:.1e}"
    if report.num_patched == 0:
        return "untouched: no module fusebox recognizes"
    fused = sorted({e.kind for e in report.patched})
    return f"OK rel err {err:.1e}, {report.num_patched} modules{label}: {', '.join(fused)}"


def build_tiny(make, model_type: str, max_params: float):
    """(model, tokens, unpatched logits, the config's label) of ``make``'s config, or the skip
    line."""
    import transformers

    try:
        config = make(model_type)
        with torch.device("meta"):
            params = sum(p.numel() for p in
                         transformers.AutoModelForCausalLM.from_config(config).parameters())
        if params > max_params:
            return f"skip: {params / 1e6:.0f}M parameters at the tiny settings"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:   # norm weights and biases off their init
                    p.add_(0.05 * torch.randn_like(p))
        vocab = min(getattr(config, "vocab_size", None) or 128, 128)
        ids = torch.randint(3, vocab, (2, 10), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref = model(ids).logits
    except Exception as e:  # noqa: BLE001
        return f"skip: the unpatched model does not run ({type(e).__name__})"
    return model, ids, ref, CONFIG_LABELS.get(make.__name__, "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_types", nargs="*", help="model types to run (default: all causal LMs)")
    ap.add_argument("--max-params", type=float, default=30e6)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    types = args.model_types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{len(types)} model types")
    counts = Counter()
    for model_type in types:
        line = sweep_one(model_type, args.max_params)
        counts[line.split()[0].rstrip(":")] += 1
        print(f"{model_type:28s} {line}", flush=True)
        gc.collect()
    print("summary: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 1 if counts["MISMATCH"] or counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
