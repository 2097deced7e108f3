"""Generic diffusers modules on fusebox: :func:`patch_generic` replaces the forwards of the
building blocks every diffusers model is made of, when no family patcher already covered them
(a model of an unknown family still gets its norms and activations fused):

- ``normalization.RMSNorm`` -> ``rms_norm`` (weight may be None; the output dtype is the
  weight's, fp32 for an fp32 weight, as diffusers returns it; inputs whose last dimension is
  strided, such as a VAE's channels, keep diffusers' forward);
- the fp32 RMSNorms of Cosmos 3 (``Cosmos3NemotronRMSNorm``) and Stable Audio 3
  (``StableAudio3RMSNorm``) -> ``rms_norm``;
- ``nn.LayerNorm`` / ``FP32LayerNorm`` -> ``layer_norm``;
- ``AdaLayerNormZero``, ``AdaLayerNormZeroSingle``, ``SD35AdaLayerNormZeroX``,
  ``AdaLayerNormContinuous`` and Chroma's pruned forms of three of them (terms without a
  projection): the conditioning projection stays, ``norm(x) * (1 + scale) + shift`` becomes
  one ``adaln`` pass;
- ``activations.GELU``: the projection without its bias, then the bias + GELU in one pass
  (this is also the feed-forward fusion of every family's blocks);
- ``GEGLU`` / ``SwiGLU`` -> ``gated_activation_packed`` (gate = second half);
- attention modules whose processor is one a family patcher fuses (``FluxAttnProcessor``, which
  models outside the FLUX family also use) get that fused processor.
"""

from __future__ import annotations

import torch
from diffusers.models.activations import GEGLU, GELU, SwiGLU
from diffusers.models.normalization import (
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    AdaLayerNormZeroSingle,
    FP32LayerNorm,
    RMSNorm,
    SD35AdaLayerNormZeroX,
)

from ... import functional as fb
from .._common import is_patched, original_forward, replace_forward
from ._shared import (
    FUSED_INTO_ATTR,
    FusedAttnProcessor,
    GELU_KINDS,
    LAYER_NORMS,
    fusable,
    grad_needed,
    has_contiguous_rows,
    linear_gelu,
    mark_fused,
    modulated_norm,
    norm_kind,
    rows,
    swap_processor,
)

# --------------------------------------------------------------------------- module forwards


def _rms_norm_forward(self, hidden_states):
    weight = self.weight
    dtype = hidden_states.dtype if weight is None else weight.dtype
    # Rows with a strided last dimension keep diffusers' forward: the LTX-Video VAE normalizes
    # the channels of [B, C, F, H, W] through a permuted view, where diffusers' elementwise ops
    # keep that layout and a copy into rows would cost a pass here and another one in the
    # convolution that follows.
    if (not fusable(hidden_states, weight) or dtype not in (hidden_states.dtype, torch.float32)
            or not has_contiguous_rows(hidden_states)):
        return original_forward(self)(hidden_states)
    return fb.rms_norm(hidden_states, weight, self.eps, out_dtype=dtype)


# RMSNorms of single families that compute in fp32 (``x.float()`` normalized, times the weight
# in fp32, cast back to x's dtype): rms_norm's own numerics. Class name -> the weight's name.
_FP32_RMS_NORMS = {"Cosmos3NemotronRMSNorm": "weight", "StableAudio3RMSNorm": "gamma"}


def _fp32_rms_norm_forward(self, hidden_states):
    weight = getattr(self, _FP32_RMS_NORMS[type(self).__name__])
    if not fusable(hidden_states, weight) or hidden_states.shape[-1] != weight.shape[-1]:
        return original_forward(self)(hidden_states)
    return fb.rms_norm(rows(hidden_states), weight, self.eps)


def _layer_norm(self, x):
    if not fusable(x, self.weight, self.bias):
        return original_forward(self)(x)
    return fb.layer_norm(rows(x), self.weight, self.bias, self.eps)


def _layer_norm_forward(self, input):       # nn.LayerNorm.forward's signature
    return _layer_norm(self, input)


def _fp32_layer_norm_forward(self, inputs):  # FP32LayerNorm.forward's signature
    return _layer_norm(self, inputs)


def _zero_terms(self, x, terms):
    """AdaLN-Zero's outputs from its six terms ``[B, 6D]``: the modulated norm and the rest."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = terms.chunk(6, dim=1)
    x = modulated_norm(self.norm, x, scale_msa[:, None], shift_msa[:, None])
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def _zero_single_terms(self, x, terms):
    shift_msa, scale_msa, gate_msa = terms.chunk(3, dim=1)
    return modulated_norm(self.norm, x, scale_msa[:, None], shift_msa[:, None]), gate_msa


def _ada_layer_norm_zero_forward(self, x, timestep=None, class_labels=None, hidden_dtype=None,
                                 emb=None):
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    return _zero_terms(self, x, self.linear(self.silu(emb)))


def _ada_layer_norm_zero_single_forward(self, x, emb=None):
    return _zero_single_terms(self, x, self.linear(self.silu(emb)))


# Chroma's pruned AdaLN layers take their terms ready-made ([B, n, D]), without a projection.
def _pruned_ada_layer_norm_zero_forward(self, x, timestep=None, class_labels=None,
                                        hidden_dtype=None, emb=None):
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    return _zero_terms(self, x, emb.flatten(1, 2))


def _pruned_ada_layer_norm_zero_single_forward(self, x, emb=None):
    return _zero_single_terms(self, x, emb.flatten(1, 2))


def _pruned_ada_layer_norm_continuous_forward(self, x, emb):
    shift, scale = torch.chunk(emb.flatten(1, 2).to(x.dtype), 2, dim=1)
    return modulated_norm(self.norm, x, scale[:, None, :], shift[:, None, :])


def _sd35_ada_layer_norm_zero_x_forward(self, hidden_states, emb=None):
    emb = self.linear(self.silu(emb))
    (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
     shift_msa2, scale_msa2, gate_msa2) = emb.chunk(9, dim=1)
    # two modulations of one norm: each pass normalizes again, cheaper than writing norm(x)
    out = modulated_norm(self.norm, hidden_states, scale_msa[:, None], shift_msa[:, None])
    out2 = modulated_norm(self.norm, hidden_states, scale_msa2[:, None], shift_msa2[:, None])
    return out, gate_msa, shift_mlp, scale_mlp, gate_mlp, out2, gate_msa2


def _ada_layer_norm_continuous_forward(self, x, conditioning_embedding):
    emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return modulated_norm(self.norm, x, scale[:, None, :], shift[:, None, :])


def _gelu_forward(self, hidden_states):
    return linear_gelu(self.proj, hidden_states, self.approximate)


def _geglu_forward(self, hidden_states, *args, **kwargs):
    if (args or kwargs.get("scale") is not None or grad_needed(self.proj, hidden_states)
            or not fusable(hidden_states)):
        return original_forward(self)(hidden_states, *args, **kwargs)   # it warns about `scale`
    # diffusers' GEGLU is exact-erf GELU with the gate in the second half
    return fb.gated_activation_packed(self.proj(hidden_states), "gelu", gate_first=False)


def _swiglu_forward(self, hidden_states):
    if grad_needed(self.proj, hidden_states) or not fusable(hidden_states):
        return original_forward(self)(hidden_states)
    return fb.gated_activation_packed(self.proj(hidden_states), "silu", gate_first=False)


# --------------------------------------------------------------------------- generic pass

_ADA_NORMS = {
    AdaLayerNormZero: (_ada_layer_norm_zero_forward, "adaln"),
    AdaLayerNormZeroSingle: (_ada_layer_norm_zero_single_forward, "adaln"),
    SD35AdaLayerNormZeroX: (_sd35_ada_layer_norm_zero_x_forward, "adaln x2"),
    AdaLayerNormContinuous: (_ada_layer_norm_continuous_forward, "adaln"),
}
try:
    from diffusers.models.transformers.transformer_chroma import (
        ChromaAdaLayerNormContinuousPruned,
        ChromaAdaLayerNormZeroPruned,
        ChromaAdaLayerNormZeroSinglePruned,
    )

    _ADA_NORMS.update({
        ChromaAdaLayerNormZeroPruned: (_pruned_ada_layer_norm_zero_forward, "adaln"),
        ChromaAdaLayerNormZeroSinglePruned: (_pruned_ada_layer_norm_zero_single_forward, "adaln"),
        ChromaAdaLayerNormContinuousPruned: (_pruned_ada_layer_norm_continuous_forward, "adaln"),
    })
except ImportError:     # a diffusers without Chroma
    pass


def _generic_rule(module: torch.nn.Module):
    """(forward, what) for a module the generic pass fuses, (None, why not) for a candidate it
    leaves alone, None for anything else."""
    cls = type(module)
    if cls in _ADA_NORMS:
        forward, what = _ADA_NORMS[cls]
        kind = norm_kind(module.norm)
        if kind is None:
            return None, f"its norm ({type(module.norm).__name__}) has no fused form"
        return forward, f"{what} ({kind})"
    if cls is RMSNorm:
        if module.bias is not None or len(module.dim) != 1:
            return None, "RMSNorm with a bias or over several dims"
        return _rms_norm_forward, "rms_norm"
    if cls.__name__ in _FP32_RMS_NORMS:
        weight = getattr(module, _FP32_RMS_NORMS[cls.__name__], None)
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
            return None, f"{cls.__name__} without a 1-D weight"
        if not getattr(module, "force_fp32", True):
            return None, "computes in the input's dtype"
        return _fp32_rms_norm_forward, "rms_norm"
    if cls in LAYER_NORMS:
        if len(module.normalized_shape) != 1:
            return None, "LayerNorm over several dims"
        forward = _fp32_layer_norm_forward if cls is FP32LayerNorm else _layer_norm_forward
        return forward, "layer_norm"
    if cls is GELU:
        if module.approximate not in GELU_KINDS:
            return None, f"GELU approximate={module.approximate!r}"
        return _gelu_forward, f"linear + {GELU_KINDS[module.approximate]}(+bias)"
    if cls is GEGLU:
        return _geglu_forward, "gated_activation_packed (gelu)"
    if cls is SwiGLU:
        return _swiglu_forward, "gated_activation_packed (silu)"
    return None


def _generic_processors():
    """The diffusers processors whose fused form serves any model that uses them."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    from .flux import FluxFusedAttnProcessor
    return {FluxAttnProcessor: (FluxFusedAttnProcessor,
                                "qk_norm_rope per head (interleaved), per stream")}


def patch_generic(model: torch.nn.Module, report, **options) -> None:
    """Fuses the generic diffusers modules of ``model`` that no family patcher covered."""
    processors = _generic_processors()
    for path, module in model.named_modules():
        if is_patched(module):
            continue
        processor = getattr(module, "processor", None)
        if processor is not None and not isinstance(processor, FusedAttnProcessor) and \
                type(processor) in processors:
            swap_processor(path, module, report, processors)
            continue
        into = module.__dict__.get(FUSED_INTO_ATTR)
        if into is not None:
            report.skip(path, module, f"done by {into}")
            continue
        rule = _generic_rule(module)
        if rule is None:
            continue
        forward, what = rule
        if forward is None:
            report.skip(path, module, what)
            continue
        replace_forward(module, forward, what)
        report.add(path, module, what)
        if type(module) in _ADA_NORMS:
            mark_fused(module.norm, "the parent AdaLayerNorm's adaln")
