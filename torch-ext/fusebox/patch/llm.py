"""transformers decoder LLMs (Llama, Mistral, Ministral, Ministral 3, Mixtral, Qwen2,
Qwen2-MoE, Qwen3, Qwen3-MoE, Qwen3-Next, Qwen3.5 and its MoE, GLM-4.5, GPT-OSS, OLMo, OLMoE,
OLMo-2, OLMo-3, SmolLM3, Phi-3/4, Gemma, Gemma2, Gemma3 text, Gemma 3n and Gemma 4 text,
Llama 4 text, StarCoder2, Seed-OSS, Apertus, LFM2, EXAONE 4, MiniMax-M2, HunYuan, Nemotron,
DeepSeek-V2/V3, MiniCPM3, Falcon, and the classes of other families whose forwards read as
these; the partial rotary of Phi, GPT-NeoX, StableLM, Persimmon and GPT-J; the LayerNorms,
plain MLPs and activations of every other) on fusebox.

What is replaced, module by module (every other module keeps its forward):

- ``*RMSNorm`` whose forward is one of the three transformers formulas (Llama's
  ``weight * norm(x).to(dtype)``, also as Llama 4 writes it, T5's ``(weight * norm(x)).to(dtype)``
  as GPT-OSS and OLMo write it, or Gemma's fp32 ``norm(x) * (1 + weight)``) -> ``rms_norm``, and
  Llama 4's weightless q/k norm (``Llama4TextL2Norm``) -> ``rms_norm`` without a weight;
- gated MLPs ``down(act(gate(x)) * up(x))`` with silu / gelu-tanh / gelu -> ``gated_activation``
  (Phi's packed ``gate_up_proj`` -> ``gated_activation_packed``; Llama 4's dense layers and
  shared experts);
- the attention of the known families: q/k RoPE -> ``rope``, or ``qk_norm_rope`` where the
  model normalizes q and k (per head: Qwen3, Gemma3/4, GLM-4.5, Qwen3.5; across heads: OLMo;
  without a weight, after Llama 4's complex rotation). The
  rotation is what a probe of the module's ``apply_rotary_pos_emb`` finds (``layers``). The
  KV-cache update and the attention interface (``config._attn_implementation``) are called
  exactly as the original does;
- the decoder layer of the known families: the residual add and the norm after it become one
  ``fused_add_rms_norm`` (pre-norm layers, Llama 4's included: attention add +
  ``post_attention_layernorm``;
  Gemma2/3 sandwich layers: attention add + ``pre_feedforward_layernorm``), and a norm with the
  residual add after it one ``rms_norm_add`` (Gemma2/3's ``post_feedforward_layernorm``,
  OLMo-2/3's post-norm layers);
- grouped keys under a mask (sliding windows, padding) reach SDPA as the cache holds them, with
  ``enable_gqa`` and the additive mask formed once per forward, where SDPA has a fused kernel
  for that (transformers repeats them over the query heads first);
- an attention or decoder layer of another family whose forward reads, word for word, as one
  of the known families' gets that family's fused forward;
- Cohere, Cohere2 and Cohere2-MoE (Command R, R7B, A): their fp32 ``LayerNorm`` without a bias
  -> ``layer_norm`` (the per-head q/k norms, a weight row per head, keep their code); Cohere's
  and Cohere2's interleaved rotary -> ``rope``;
- every ``torch.nn.LayerNorm`` over the last dimension -> ``layer_norm``, in any model;
- MLPs whose forward reads ``h = in(h); h = act(h); h = out(h)`` plus dropouts (GPT-2's ``Conv1D``
  projections or ``Linear`` ones: GPT-2, GPT-NeoX, Phi, StarCoder2, GPT-J...): on CUDA the tanh
  GELU forms as one GEMM whose epilogue adds the bias and applies the GELU, other activations as
  the projection then one ``activation`` pass;
- activation modules outside such an MLP or a gated one (``NewGELU``, ``FastGELU``,
  ``GELUTanh``, exact ``GELU``, ``SiLU``) -> one ``activation`` pass;
- Phi, GPT-NeoX (Pythia), StableLM, Persimmon and GPT-J (interleaved pairs): the rotary of the
  first ``rotary_ndims`` (GPT-J: ``rotary_dim``) channels of each head (the model slices,
  rotates and concatenates back) -> one ``rope`` that passes the other channels through;
  GPT-NeoX's and Persimmon's q and k read in place from their fused QKV projections, the
  models' optional per-head q/k LayerNorms run first;
- the families whose attention differs from Llama's in a detail the fused forward applies (see
  ``AttentionSpec``), Gemma 4 text (its q/k norms, rotary and shared keys and values; its
  layer's residual adds with their norms), Gemma 3n text (its attention as Gemma 4's, the
  shared keys and values found by layer index), Qwen3-Next/Qwen3.5 (gated attention; the hybrid
  layer's mixer add with its norm) and Llama 4 (its complex rotary as interleaved ``rope``);
- the experts of transformers' grouped experts implementation (its default; concatenated
  gate/up weights, no biases, the default gate): the gate -> ``gated_activation_packed`` over
  the (token, expert) rows, without the masks that only expert parallelism needs, and the
  weighted sum of each token's rows -> ``moe_combine``, in eager calls; compiled or over
  several ranks, the original;
- multi-head latent attention (DeepSeek-V2 and V3, MiniCPM3, and the classes that read as
  DeepSeek-V3's: Kimi K2 loads as it, GLM-4.7-Flash, Youtu): the rotary of q's last
  ``qk_rope_head_dim`` channels and of the shared key channels -> one ``rope``, V3's
  interleaved pairs written back in its de-interleaved order, so the latent cache holds what it
  holds unpatched;
- Falcon (rotary, not ALiBi): the rotary of q/k read in place from the fused QKV projection ->
  ``rope`` (for grouped keys, before they are
  repeated over the heads, which the model's cache then holds as it does unpatched). Multi-query
  keys reach SDPA expanded over the query heads, so a fused attention kernel runs where the
  unpatched model gets SDPA's fp32 math fallback. Its parallel residual adds keep their code.

A patched forward falls back to the original one when autograd needs it (fusebox operators
have no backward) or when its inputs are outside what the operators take (e.g. float64).
Classes that are recognized by name are also checked against the forward signature they had
when this module was written; a class that drifted is left alone and reported.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import sys
from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple, Optional, Tuple, Union

import torch

from .. import functional as F
from ..layers import probe_rotary, rotary_rounds_to_input, rotary_tables
from ._common import (
    add_undo,
    derived_once,
    gemm_bias_gelu_tanh,
    gemm_gelu_tanh_ok,
    has_hooks,
    needs_autograd,
    original_forward,
    replace_forward,
    source_text,
)

FUSED_DTYPES = F.FUSED_DTYPES
_FUSED_DTYPE_SET = frozenset(FUSED_DTYPES)


def _is_transformers_class(cls) -> bool:
    return cls.__module__.startswith("transformers.")


def applies(module: torch.nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(module, PreTrainedModel) and _is_transformers_class(type(module))


def _fusable(*tensors: Optional[torch.Tensor]) -> bool:
    """Inputs the fused path takes: supported dtypes, and no gradient to record."""
    # Plain loops: every fused forward asks this, and a decode step's host time is its cost
    # (1.0 us a call against 1.9 with ``all`` over a generator and ``needs_autograd``, CPU).
    if torch.is_grad_enabled() and needs_autograd(*tensors):
        return False
    for t in tensors:
        if t is not None and t.dtype not in _FUSED_DTYPE_SET:
            return False
    return True


# Classes whose forward a fused forward re-implements. A class of another family whose forward
# reads the same, word for word, gets the same fused forward (its signature, norms and rotary
# formula are checked as for the named classes): many transformers models copy these.
_ATTENTION_REFERENCES = (("llama", "LlamaAttention"), ("mistral", "MistralAttention"),
                         ("qwen2", "Qwen2Attention"), ("qwen3", "Qwen3Attention"),
                         ("gemma2", "Gemma2Attention"), ("gemma3", "Gemma3Attention"),
                         ("olmo2", "Olmo2Attention"))
_LAYER_REFERENCES = (("llama", "LlamaDecoderLayer"), ("mixtral", "MixtralDecoderLayer"),
                     ("gemma2", "Gemma2DecoderLayer"), ("gpt_oss", "GptOssDecoderLayer"),
                     ("olmo2", "Olmo2DecoderLayer"))


@functools.lru_cache(maxsize=None)
def _forward_reads_as(cls, references: Tuple[Tuple[str, str], ...]) -> Optional[str]:
    """The name of the first reference class whose forward has ``cls.forward``'s source."""
    src = source_text(cls.forward)
    for module, name in references:
        try:
            package = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
            ref = getattr(package, name)
        except (ImportError, AttributeError):
            continue
        if src and source_text(ref.forward) == src:
            return name
    return None


# --------------------------------------------------------------------------- RMSNorm


# The values a fused forward holds (NormStyle, AttentionSpec, strings, flags) are immutable
# tuples of constants, so that torch.compile's guards on a patched module stay as cheap as on an
# unpatched one: dynamo skips the guards of a module whose attributes hold only such values while
# its ``__dict__`` is unchanged, and adds a Python identity check per module for each other object
# that several modules share. Callables the forwards share are reached through module globals.
class NormStyle(NamedTuple):
    """How a transformers RMSNorm rounds and weights its output."""
    eps: float
    weight_offset: float        # 1.0 for Gemma's (1 + weight)
    promotes: bool              # Llama: ``weight * y.to(dtype)`` takes the wider of the two dtypes

    def out_dtype(self, x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
        return torch.promote_types(x.dtype, weight.dtype) if self.promotes else x.dtype


# Formulas as they read in transformers' source (whitespace removed).
_LLAMA_NORM = ("variance_epsilon", "returnself.weight*hidden_states.to(input_dtype)")
_GEMMA_NORM = ("output*(1.0+self.weight.float())", "returnoutput.type_as(x)")
# T5's, as GPT-OSS and OLMo-2 write it: the weight applied in fp32, then one rounding
_T5_NORM = ("variance_epsilon", "return(self.weight*hidden_states).to(input_dtype)")
# Llama 4's: Llama's rounding and weighting, written with ``eps`` and a ``_norm`` helper
_LLAMA4_NORM = ("output=self._norm(x.float()).type_as(x)", "returnoutput*self.weight")
# Gemma 4's: T5's (the optional weight applied in fp32, then one rounding), the inverse root
# written as pow(., -0.5); ``with_scale=False`` has no weight (its v_norm)
_GEMMA4_NORM = ("normed_output=self._norm(hidden_states.float())",
                "normed_output=normed_output*self.weight.float()",
                "returnnormed_output.type_as(hidden_states)")


def norm_style(module: torch.nn.Module) -> Optional[NormStyle]:
    """The module's RMSNorm formula, or None when it is not one fusebox reproduces."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    if getattr(module, "group_size", None) is not None:
        return None   # a norm over groups of a row (Qwen4-Exp's hyper-connections): not a row norm
    cls = type(module)
    src = source_text(cls.forward) + source_text(getattr(cls, "_norm", None))
    if all(s in src for s in _LLAMA_NORM) and hasattr(module, "variance_epsilon"):
        return NormStyle(float(module.variance_epsilon), 0.0, True)
    if all(s in src for s in _T5_NORM) and hasattr(module, "variance_epsilon"):
        return NormStyle(float(module.variance_epsilon), 0.0, False)
    if all(s in src for s in _GEMMA_NORM) and hasattr(module, "eps"):
        return NormStyle(float(module.eps), 1.0, False)
    if all(s in src for s in _LLAMA4_NORM) and hasattr(module, "eps"):
        return NormStyle(float(module.eps), 0.0, True)
    if all(s in src for s in _GEMMA4_NORM) and hasattr(module, "eps"):
        return NormStyle(float(module.eps), 0.0, False)
    return None


def _weightless_gemma4_norm(module: torch.nn.Module) -> bool:
    """A Gemma 4 RMSNorm without its weight (``with_scale=False``)."""
    return (getattr(module, "with_scale", True) is False and hasattr(module, "eps")
            and all(s in source_text(type(module).forward) for s in _GEMMA4_NORM))


# Llama 4's weightless RMSNorm of q and k (after their rotary): ``norm(x.float()).type_as(x)``
_L2_NORM = "returnself._norm(x.float()).type_as(x)"


def _l2_norm_patch(module: torch.nn.Module) -> Tuple[Optional[Callable], str]:
    src = source_text(type(module).forward)
    if _L2_NORM not in src or not isinstance(getattr(module, "eps", None), float):
        return None, "L2 norm formula not recognized"
    return _l2_norm_forward, "rms_norm (no weight)"


def _l2_norm_forward(self, x):
    if not _fusable(x):
        return original_forward(self)(x)
    return F.rms_norm(F.unit_stride_rows(x), None, self.eps)


def _make_rms_norm_forward(style: NormStyle) -> Callable:
    def forward(self, hidden_states):
        weight = self.weight
        if not _fusable(hidden_states, weight):
            return original_forward(self)(hidden_states)
        out_dtype = style.out_dtype(hidden_states, weight)
        return F.rms_norm(F.unit_stride_rows(hidden_states), weight, style.eps, style.weight_offset,
                          out_dtype)
    return forward


def _weight_readable(norm: torch.nn.Module, style: Optional[NormStyle], x: torch.Tensor) -> bool:
    """Can a parent's fused op use this norm's weight in place of calling it?

    Not when the norm has hooks of its own (accelerate's CPU offload brings the weight in only
    around the norm's forward), when the weight needs a gradient, or when the norm would not
    return x's dtype (what the fused ops write)."""
    return (style is not None and not has_hooks(norm) and _fusable(norm.weight)
            and style.out_dtype(x, norm.weight) == x.dtype)


def _add_norm(norm: torch.nn.Module, style: Optional[NormStyle], x: torch.Tensor,
              residual: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + x`` and ``norm(h)``, one fused op where possible. Returns (normed, h)."""
    if x.dtype == residual.dtype and _weight_readable(norm, style, x):
        return F.fused_add_rms_norm(x, residual, norm.weight, style.eps, style.weight_offset)
    h = residual + x
    return norm(h), h


def _norm_add(norm: torch.nn.Module, style: Optional[NormStyle], x: torch.Tensor,
              residual: torch.Tensor) -> torch.Tensor:
    """``residual + norm(x)`` (a post-norm layer's residual add), one fused op where possible."""
    if x.dtype == residual.dtype and x.shape == residual.shape and _weight_readable(norm, style, x):
        return F.rms_norm_add(x, residual, norm.weight, style.eps, style.weight_offset)
    return residual + norm(x)


# --------------------------------------------------------------------------- LayerNorm

def _layer_norm_patch(module: torch.nn.Module) -> Tuple[Optional[Callable], str]:
    if len(module.normalized_shape) != 1:
        return None, "LayerNorm over more than the last dimension"
    return _layer_norm_forward, "layer_norm"


def _layer_norm_forward(self, x):
    if not _fusable(x, self.weight, self.bias):
        return original_forward(self)(x)
    return F.layer_norm(F.unit_stride_rows(x), self.weight, self.bias, self.eps)


def _layer_norm_1p_patch(module: torch.nn.Module) -> Tuple[Optional[Callable], str]:
    """Nemotron's ``LayerNorm1P``: torch's LayerNorm of ``weight + 1``, outside autocast."""
    src = source_text(type(module).forward)
    if "self.weight+1.0" not in src or "F.layer_norm(*args)" not in src:
        return None, "LayerNorm1P formula not recognized"
    if len(module.normalized_shape) != 1 or module.weight is None:
        return None, "LayerNorm1P over more than the last dimension, or without a weight"
    return _layer_norm_1p_forward, "layer_norm (weight + 1)"


def _layer_norm_1p_forward(self, x):
    # (the weight + 1 is formed as the model forms it, in the weight's dtype; under autocast the
    # model casts its arguments first)
    if torch.is_autocast_enabled(x.device.type) or not _fusable(x, self.weight, self.bias):
        return original_forward(self)(x)
    return F.layer_norm(F.unit_stride_rows(x), self.weight + 1.0, self.bias, self.eps)


# Cohere's LayerNorm without a bias, in fp32 and rounded once: fusebox's layer_norm formula
_FP32_LAYER_NORM = ("hidden_states=hidden_states.to(torch.float32)",
                    "variance=(hidden_states-mean).pow(2).mean(-1,keepdim=True)",
                    "hidden_states=self.weight.to(torch.float32)*hidden_states"
                    "returnhidden_states.to(input_dtype)")


def _fp32_layer_norm_patch(module: torch.nn.Module) -> Tuple[Optional[Callable], str]:
    """A ``*LayerNorm`` class of that formula (Cohere, Cohere2, Cohere2-MoE); ``(None, "")`` for
    any other formula, which is not a candidate."""
    src = source_text(type(module).forward)
    if (not all(s in src for s in _FP32_LAYER_NORM) or "self.bias" in src
            or not hasattr(module, "variance_epsilon")):
        return None, ""
    if module.weight.dim() != 1:
        return None, "a weight per head (q/k norm): the layer_norm op takes one weight row"
    return _fp32_layer_norm_forward, "layer_norm"


def _fp32_layer_norm_forward(self, x):
    if not _fusable(x, self.weight):
        return original_forward(self)(x)
    return F.layer_norm(F.unit_stride_rows(x), self.weight, None, self.variance_epsilon)


# --------------------------------------------------------------------------- MLP

# transformers activation class -> fusebox activation name. NewGELU and FastGELU are the tanh
# form written out in the model's dtype (eight or nine passes); fusebox evaluates it in fp32.
_ACTIVATIONS = {
    "SiLUActivation": "silu",
    "SiLU": "silu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
}
_GATED_MLP = "down_proj=self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))"
# Llama 4: the same product, its activation named activation_fn
_GATED_MLP_LLAMA4 = ("down_proj=self.activation_fn(self.gate_proj(x))*self.up_proj(x)"
                     "returnself.down_proj(down_proj)")
# Phi-3: gate and up from one projection, gate first
_PACKED_MLP = ("gate,up_states=up_states.chunk(2,dim=-1)"
               "up_states=up_states*self.activation_fn(gate)returnself.down_proj(up_states)")


def mlp_form(module: torch.nn.Module) -> Optional[str]:
    """"gated" (separate gate and up projections), "packed" (one ``gate_up_proj``), "plain"
    (``out(act(in(x)))``, see :func:`plain_mlp_layout`) or None."""
    src = source_text(type(module).forward)
    if _GATED_MLP in src or _GATED_MLP_LLAMA4 in src:
        return "gated"
    if _PACKED_MLP in src:
        return "packed"
    return "plain" if plain_mlp_layout(type(module)) is not None else None


def _activation(module: torch.nn.Module) -> torch.nn.Module:
    """A gated MLP's activation module (``act_fn``, or ``activation_fn`` in Phi-3 and Llama 4)."""
    return module.act_fn if "act_fn" in module._modules else module.activation_fn


def activation_kind(act: torch.nn.Module) -> Tuple[Optional[str], str]:
    """(fusebox activation, "") for an activation module fusebox runs, else (None, why not)."""
    name = type(act).__name__
    if name == "GELUActivation":
        # transformers' "gelu" is exact erf unless it was built with the python formula
        exact = getattr(act, "act", None) is torch.nn.functional.gelu
        return ("gelu", "") if exact else (None, "python gelu formula")
    if name == "GELUTanh" and getattr(act, "act", None) == getattr(act, "_gelu_tanh_python", None):
        return None, "python gelu-tanh formula"
    if name in _ACTIVATIONS:
        return _ACTIVATIONS[name], ""
    return None, f"activation {name} has no fused kernel"


def mlp_activation(module: torch.nn.Module) -> Tuple[Optional[str], str]:
    """(fusebox activation, "") for an MLP fusebox can run, else (None, why not)."""
    form = mlp_form(module)
    if form is None:
        if hasattr(module, "experts"):
            return None, "mixture of experts: the routing keeps its code (the experts module is its own)"
        return None, "forward is not down(act(gate(x)) * up(x)) or out(act(in(x)))"
    if form == "plain":
        return activation_kind(getattr(module, plain_mlp_layout(type(module)).act))
    return activation_kind(_activation(module))


# --------------------------------------------------------------------------- plain MLPs


class PlainMLPLayout(NamedTuple):
    """The attribute names of an MLP whose forward is ``out(act(in(x)))`` plus dropouts."""
    fc_in: str
    act: str
    fc_out: str


def _self_call(node, arg: str) -> Optional[str]:
    """``name`` for a node that reads ``self.name(arg)``, else None."""
    import ast

    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
            and len(node.args) == 1 and not node.keywords
            and isinstance(node.args[0], ast.Name) and node.args[0].id == arg):
        return node.func.attr
    return None


def _functional_dropout(node, arg: str) -> bool:
    """``nn.functional.dropout(arg, p=..., training=self.training)`` (as Starcoder2 writes it)."""
    import ast

    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "dropout" and len(node.args) == 1
            and isinstance(node.args[0], ast.Name) and node.args[0].id == arg
            and any(k.arg == "training" and ast.unparse(k.value) == "self.training"
                    for k in node.keywords))


@functools.lru_cache(maxsize=None)
def plain_mlp_layout(cls) -> Optional[PlainMLPLayout]:
    """The layout of a forward that reads, statement by statement, ``h = self.IN(h)``,
    ``h = self.ACT(h)``, ``h = self.OUT(h)``, then dropouts of ``h`` (``self.dropout(h)`` or
    ``nn.functional.dropout(h, ..., training=self.training)``) and ``return h``: the MLPs of
    GPT-2, GPT-NeoX, Phi, StarCoder2, GPT-BigCode, GPT-J, CodeGen, Persimmon."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0]
    params = [a.arg for a in fn.args.args]
    if len(params) != 2 or fn.args.vararg or fn.args.kwonlyargs or fn.args.kwarg:
        return None
    h = params[1]
    body = [st for st in fn.body
            if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]  # docstring
    if len(body) < 4 or not (isinstance(body[-1], ast.Return) and isinstance(body[-1].value, ast.Name)
                             and body[-1].value.id == h):
        return None
    calls = []
    for st in body[:-1]:
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1
                and isinstance(st.targets[0], ast.Name) and st.targets[0].id == h):
            return None
        calls.append(st.value)
    names = [_self_call(c, h) for c in calls[:3]]
    if None in names:
        return None
    for c in calls[3:]:
        if _self_call(c, h) is None and not _functional_dropout(c, h):
            return None
    dropouts = tuple(_self_call(c, h) for c in calls[3:] if _self_call(c, h) is not None)
    return PlainMLPLayout(*names) if all(d == "dropout" for d in dropouts) else None


def _is_projection(module: torch.nn.Module) -> bool:
    """A ``torch.nn.Linear`` or transformers' ``Conv1D`` (GPT-2's, weight ``[in, out]``)."""
    return type(module) is torch.nn.Linear or (type(module).__name__ == "Conv1D"
                                               and _is_transformers_class(type(module)))


def _plain_mlp_patch(module: torch.nn.Module) -> Tuple[Optional[Callable], str]:
    layout = plain_mlp_layout(type(module))
    for name in (layout.fc_in, layout.fc_out):
        if not _is_projection(getattr(module, name, None)):
            return None, f"{name} is not a Linear or Conv1D"
    dropout = getattr(module, "dropout", None)
    if dropout is not None and not isinstance(dropout, torch.nn.Dropout):
        return None, "dropout is not torch.nn.Dropout"
    kind, why = activation_kind(getattr(module, layout.act))
    if kind is None:
        return None, why
    what = (f"{layout.fc_in} with {kind} in its GEMM epilogue (CUDA)" if kind == "gelu_tanh"
            else f"activation ({kind})")
    return _make_plain_mlp_forward(layout, kind), what


def _linear_activation(proj: torch.nn.Module, x: torch.Tensor, kind: str) -> torch.Tensor:
    """``act(proj(x))``: the tanh GELU on CUDA in the GEMM's epilogue, the rest as the projection
    then fusebox's activation pass."""
    if kind == "gelu_tanh" and not has_hooks(proj) and gemm_gelu_tanh_ok(x, proj.bias):
        weight_t = proj.weight if type(proj) is not torch.nn.Linear else proj.weight.t()
        if weight_t.dtype == x.dtype:
            return gemm_bias_gelu_tanh(x, weight_t, proj.bias)
    return F.activation(proj(x), None, kind)


def _make_plain_mlp_forward(layout: PlainMLPLayout, kind: str) -> Callable:
    def forward(self, hidden_states):
        fc_in = getattr(self, layout.fc_in)
        # training: the dropouts this forward leaves out are active
        if self.training or not _fusable(hidden_states, fc_in.weight):
            return original_forward(self)(hidden_states)
        return getattr(self, layout.fc_out)(_linear_activation(fc_in, hidden_states, kind))
    return forward


def _is_activation_class(cls) -> bool:
    return cls.__module__ == "transformers.activations"


def _activation_patch(module: torch.nn.Module) -> Tuple[Optional[Callable], str]:
    kind, why = activation_kind(module)
    if kind is None:
        return None, why
    return _ACTIVATION_FORWARDS[kind], f"activation ({kind})"


def _make_activation_forward(kind: str) -> Callable:
    # An activation module alone (the act_fn of Gemma 3n's sparse MLP, or of experts that keep
    # their code, whose caller multiplies by up) is one elementwise pass either way; compiled,
    # its torch form fuses with what its caller does around it, where the operator is a pass of
    # its own plus a copy of a strided input (DeepSeek-V2-Lite's experts compiled, H100: 1.3 ms
    # a prefill more than the fused form).
    def forward(self, input):
        if torch.compiler.is_compiling() or not _fusable(input):
            return original_forward(self)(input)
        return F.activation(F.unit_stride_rows(input), None, kind)
    return forward


_ACTIVATION_FORWARDS = {kind: _make_activation_forward(kind) for kind in set(_ACTIVATIONS.values())
                        | {"gelu"}}


def _has_dropout(module: torch.nn.Module) -> bool:
    """Whether the module's forward applies a dropout (Seed-OSS's MLP, after its down
    projection): its fused forward, which has none, steps aside in train mode."""
    return "dropout" in source_text(type(module).forward)


def _make_mlp_forward(activation: str, dropout: bool) -> Callable:
    def forward(self, x):
        if (dropout and self.training) or not _fusable(x, self.gate_proj.weight):
            return original_forward(self)(x)
        gate = self.gate_proj(x)
        up = self.up_proj(x)
        if gate.dtype != up.dtype:
            return self.down_proj(_activation(self)(gate) * up)
        return self.down_proj(F.gated_activation(gate, up, activation))
    return forward


def _make_packed_mlp_forward(activation: str, dropout: bool) -> Callable:
    def forward(self, hidden_states):
        if (dropout and self.training) or not _fusable(hidden_states, self.gate_up_proj.weight):
            return original_forward(self)(hidden_states)
        return self.down_proj(F.gated_activation_packed(self.gate_up_proj(hidden_states),
                                                        activation, gate_first=True))
    return forward


# --------------------------------------------------------------------------- mixture of experts

# transformers' grouped experts forward (``grouped_mm``, its default experts implementation),
# the lines the fused one re-implements: the (token, expert) pairs sorted by expert, the
# gate_up and down projections as grouped GEMMs over them, the gate as ``_default_apply_gate``
# computes it, the routing weights applied in fp32 and each token's top-k rows summed in fp32.
_GROUPED_EXPERTS = (
    "expert_ids_g,perm=torch.sort(expert_ids)selected_hidden_states_g=hidden_states[perm//num_top_k]"
    "sample_weights_g=sample_weights[perm]",
    "tokens_per_expert=torch.histc(histc_input,bins=self.num_experts,min=0,max=self.num_experts-1)"
    "offsets=torch.cumsum(tokens_per_expert,dim=0,dtype=torch.int32)",
    "proj_out=proj_out.masked_fill(sentinel_mask,0.0)ifself.has_gate:proj_out=self._apply_gate(proj_out)",
    "weighted_out=proj_out*sample_weights_g.unsqueeze(-1)inv_perm=torch.empty_like(perm)"
    "inv_perm[perm]=torch.arange(perm.size(0),device=device)weighted_out=weighted_out[inv_perm]",
    "final_hidden_states=weighted_out.view(num_tokens,num_top_k,hidden_dim).sum(dim=1)"
    "returnfinal_hidden_states.to(hidden_states.dtype)",
)
_DEFAULT_GATE = "gate,up=gate_up_out.chunk(2,dim=-1)returnself.act_fn(gate)*up"


def _experts_patch(module: torch.nn.Module) -> Tuple[Optional[Callable], str]:
    """The grouped experts forward for an experts class of transformers' experts interface with
    concatenated gate/up weights, no biases and the default gate; else (None, why)."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return None, "this transformers has no experts interface"
    grouped = getattr(moe, "grouped_mm_experts_forward", None)
    if (grouped is None or not hasattr(moe, "_grouped_linear")
            or not all(line in source_text(grouped) for line in _GROUPED_EXPERTS)):
        return None, "transformers' grouped experts forward differs from the supported versions"
    if not (getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)
            and not getattr(module, "has_bias", True)
            and _DEFAULT_GATE in source_text(getattr(type(module), "_apply_gate", None))):
        return None, "experts with biases, interleaved gate/up or a gate of their own"
    kind, why = activation_kind(module.act_fn)
    if kind is None:
        return None, why
    return _experts_forward, f"gated_activation_packed ({kind}) in the grouped experts"


def _expert_parallel() -> bool:
    """Several ranks: the experts may be split over them (expert parallelism), where the router
    marks the pairs of other ranks' experts with an index past this module's experts, which the
    original forward masks."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    # Compiled, the original: the compiler fuses its masks, gate and weighting with their
    # neighbours, as it cannot with an operator in between. The original is reached through the
    # class (a closure of transformers' experts interface, whose cells a compiled call would
    # check on every call if reached through the instance), and the activation is read off the
    # module, so this forward holds no closure values either.
    if (torch.compiler.is_compiling() or self.config._experts_implementation != "grouped_mm"
            or hidden_states.dim() != 2 or not hidden_states.shape[0] or _expert_parallel()
            or not _fusable(hidden_states, self.gate_up_proj, self.down_proj)):
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    return _grouped_experts(self, hidden_states, top_k_index, top_k_weights,
                            activation_kind(self.act_fn)[0])


def _grouped_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor, kind: str) -> torch.Tensor:
    """transformers' grouped experts forward with fewer passes over the (token, expert) rows,
    the same grouped GEMMs and sums: the (token, expert) pairs sorted by expert in one
    ``moe_sort``, no sentinel masks (every index names one of this module's experts without
    expert parallelism: the masks only copy), the gate as one
    ``gated_activation_packed`` (act(gate) * up rounded once, where the original rounds both),
    and the combine (each token's rows weighted and summed, the products and sums the
    original forms) as one ``moe_combine`` pass that writes the token's row once, where the
    original writes the weighted rows, permutes and sums them."""
    from transformers.integrations.moe import _grouped_linear

    num_tokens, num_top_k = hidden_states.shape[0], top_k_index.shape[-1]
    # one launch where the original sorts, counts, divides and inverts the permutation in eight
    # or more; rows of one expert in the stable order (the GEMMs' rows do not depend on it)
    row_token, offsets, pair_row = F.moe_sort(top_k_index.reshape(num_tokens, num_top_k),
                                              self.num_experts)
    gate_up = _grouped_linear(hidden_states.index_select(0, row_token), self.gate_up_proj, offsets,
                              is_transposed=self.is_transposed)
    out = _grouped_linear(F.gated_activation_packed(gate_up, kind, gate_first=True),
                          self.down_proj, offsets, is_transposed=self.is_transposed)
    weights = top_k_weights.reshape(num_tokens, num_top_k)
    if weights.dtype not in (torch.float32, out.dtype):
        weights = weights.float()
    return F.moe_combine(out, pair_row, weights).to(hidden_states.dtype)


# transformers' top-k routers, recognized by their forward's whole text (whitespace and comments
# removed): the logits stay a GEMM; the scores, the top-k choice, renormalization, routing scale
# and cast after it run as one moe_topk.
_ROUTER_HEAD = ("defforward(self,hidden_states):"
                "hidden_states=hidden_states.reshape(-1,self.hidden_dim)"
                "router_logits=F.linear(hidden_states,self.weight)")
_ROUTER_TOPK = "router_top_value,router_indices=torch.topk(router_probs,self.top_k,dim=-1)"
_ROUTER_RENORM = "router_top_value/=router_top_value.sum(dim=-1,keepdim=True)"
_ROUTER_TAIL = "router_scores=router_top_valuereturnrouter_logits,router_scores,router_indices"
_MIXTRAL_ROUTER = "".join((
    _ROUTER_HEAD, "router_probs=torch.nn.functional.softmax(router_logits.float(),dim=-1)",
    _ROUTER_TOPK, _ROUTER_RENORM, _ROUTER_TAIL))
_QWEN_MOE_ROUTER = "".join((   # Qwen2/3-MoE's, OLMoE's
    _ROUTER_HEAD, "router_probs=torch.nn.functional.softmax(router_logits,dtype=torch.float,dim=-1)",
    _ROUTER_TOPK, "ifself.norm_topk_prob:", _ROUTER_RENORM,
    "router_top_value=router_top_value.to(router_logits.dtype)", _ROUTER_TAIL))
_FP32_ROUTER_HEAD = (
    "defforward(self,hidden_states):hidden_states=hidden_states.view(-1,self.hidden_dim)"
    "router_logits=F.linear(hidden_states.type(torch.float32),self.weight.type(torch.float32))")
_GROUP_MASK = (
    "group_mask=torch.zeros_like(group_scores)group_mask.scatter_(1,group_idx,1)"
    "score_mask=(group_mask.unsqueeze(-1).expand(-1,self.num_group,self.num_experts//self.num_group)"
    ".reshape(-1,self.num_experts))")
_DEEPSEEK_V2_ROUTER = "".join((  # its greedy method alone is fused
    _FP32_ROUTER_HEAD,
    "scores=router_logits.softmax(dim=-1,dtype=torch.float32)",
    'ifself.topk_method=="greedy":',
    "topk_weights,topk_indices=torch.topk(scores,k=self.top_k,dim=-1,sorted=False)",
    'elifself.topk_method=="group_limited_greedy":',
    "group_scores=scores.view(-1,self.num_group,self.num_experts//self.num_group).max(dim=-1).values",
    "group_idx=torch.topk(group_scores,k=self.topk_group,dim=-1,sorted=False)[1]", _GROUP_MASK,
    "scores=scores.masked_fill(~score_mask.bool(),0.0)",
    "topk_weights,topk_indices=torch.topk(scores,k=self.top_k,dim=-1,sorted=False)",
    "topk_weights=topk_weights*self.routed_scaling_factor",
    "returnrouter_logits,topk_weights,topk_indices"))
_DEEPSEEK_V3_ROUTER = "".join((  # DeepSeek-V3's, GLM-4.5's: sigmoid scores, bias, groups
    _FP32_ROUTER_HEAD,
    "scores=router_logits.sigmoid()scores_for_choice=scores+self.e_score_correction_bias",
    "group_scores=(scores_for_choice.view(-1,self.num_group,self.num_experts//self.num_group)"
    ".topk(2,dim=-1)[0].sum(dim=-1))",
    "group_idx=torch.topk(group_scores,k=self.topk_group,dim=-1,sorted=False)[1]", _GROUP_MASK,
    'scores_for_choice=scores_for_choice.masked_fill(~score_mask.bool(),float("-inf"))',
    "topk_indices=torch.topk(scores_for_choice,k=self.top_k,dim=-1,sorted=False)[1]",
    "topk_weights=scores.gather(1,topk_indices)",
    "ifself.norm_topk_prob:denominator=topk_weights.sum(dim=-1,keepdim=True)+1e-20"
    "topk_weights/=denominator",
    "topk_weights=topk_weights*self.routed_scaling_factor",
    "returnrouter_logits,topk_weights,topk_indices"))


class RouterForm(NamedTuple):
    """What a router does after its logits."""
    score: str                      # "softmax" or "sigmoid"
    renormalize: Union[bool, str]   # always, never, or as this attribute says (norm_topk_prob)
    scale: Optional[str]            # the attribute holding the routing scale
    fp32_logits: bool               # the logits from fp32 casts of the input and weight
    weights_in_logits_dtype: bool   # else fp32
    grouped: bool = False           # the choice by score + e_score_correction_bias, in groups


_ROUTERS: Dict[str, RouterForm] = {
    _MIXTRAL_ROUTER: RouterForm("softmax", True, None, False, False),
    _QWEN_MOE_ROUTER: RouterForm("softmax", "norm_topk_prob", None, False, True),
    _DEEPSEEK_V2_ROUTER: RouterForm("softmax", False, "routed_scaling_factor", True, False),
    _DEEPSEEK_V3_ROUTER: RouterForm("sigmoid", "norm_topk_prob", "routed_scaling_factor", True, False,
                                    grouped=True),
}


def _router_patch(module: torch.nn.Module) -> Tuple[Optional[Callable], str]:
    """The fused forward of a router of one of the forms above, or (None, why)."""
    form = _ROUTERS[source_text(type(module).forward)]
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None, "router without a [experts, hidden] weight"
    experts, top_k = weight.shape[0], module.top_k
    if experts > 1024 or not 1 <= top_k <= min(32, experts):
        return None, f"{experts} experts, top-{top_k} (the kernel takes up to 1024 experts and top-32)"
    if form.score == "softmax" and form.scale is not None and getattr(module, "topk_method", None) != "greedy":
        return None, f"topk_method {getattr(module, 'topk_method', None)!r} (greedy alone is fused)"
    if form.grouped:
        groups, chosen = module.num_group, module.topk_group
        if not (1 <= groups <= 32 and experts % groups == 0 and 1 <= chosen <= groups
                and (groups == 1 or (experts // groups >= 2 and chosen * experts // groups >= top_k))):
            return None, f"{groups} groups of {experts} experts, {chosen} chosen (the kernel takes up to 32)"
    return _make_router_forward(form), "moe_topk in the router"


def _make_router_forward(form: RouterForm) -> Callable:
    score, renormalize, scale, fp32_logits, cast, grouped = form

    def forward(self, hidden_states):
        if (not _fusable(hidden_states, self.weight)
                or (score == "softmax" and scale is not None and self.topk_method != "greedy")):
            return type(self).forward(self, hidden_states)
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        if fp32_logits:
            logits = torch.nn.functional.linear(hidden_states.type(torch.float32),
                                                self.weight.type(torch.float32))
        else:
            logits = torch.nn.functional.linear(hidden_states, self.weight)
        renorm = renormalize if isinstance(renormalize, bool) else bool(getattr(self, renormalize))
        weights, index = F.moe_topk(
            logits, self.top_k, score, self.e_score_correction_bias if grouped else None,
            self.num_group if grouped else 1, self.topk_group if grouped else 1, renorm,
            1.0 if scale is None else float(getattr(self, scale)),
            logits.dtype if cast else torch.float32)
        return logits, weights, index

    return forward


# --------------------------------------------------------------------------- attention


class AttentionSpec(NamedTuple):
    """What a family's attention forward does beyond Llama's."""
    qk_norm: bool = False                                   # per-head q_norm / k_norm
    # extra attention-interface kwargs: (name, the module attribute it reads, or the attribute of
    # one of the module's attributes, "config.sliding_window"; None where the last is missing)
    extra: Tuple[Tuple[str, str], ...] = ()
    # q_norm / k_norm span all heads of a token, applied to the projections (OLMo-2)
    qk_norm_across: bool = False
    # the layer rotates q and k only where one of these attributes is true (SmolLM3's NoPE
    # layers; Cohere2's sliding layers, and Cohere2-MoE's where force_rope is set)
    rope_flag: Optional[Tuple[str, ...]] = None
    # q, k and v are column ranges of one projection, qkv_proj (Phi-3): read where it writes them
    fused_qkv: bool = False
    # the q/k norms exist only where this attribute is true (GLM-4.5's use_qk_norm)
    qk_norm_flag: Optional[str] = None
    # the q/k norm modules' names (LFM2's q_layernorm / k_layernorm)
    qk_norm_names: Tuple[str, str] = ("q_norm", "k_norm")
    # partial rotary: the attribute naming how many leading channels of a head turn (Phi's
    # rotary_ndims; the rest pass through, which rope does for tables narrower than the head)
    rotary_width: Optional[str] = None
    # q/k norm modules (qk_norm_names) called as they are, before the rotary, where this
    # attribute is true (Phi's per-head LayerNorms, Cohere's of a weight row per head)
    qk_norm_modules_flag: Optional[str] = None
    out_proj: str = "o_proj"
    # the attribute holding the dropout probability applied to the output projection (StarCoder2,
    # Seed-OSS): the fused forward steps aside while it is active
    out_dropout: Optional[str] = None
    # config values the fused forward does not apply (OLMo's clip_qkv): patched where they are None
    none_configs: Tuple[str, ...] = ()
    # per-head norms of q and k applied after the rotary (HunYuan's query_layernorm and
    # key_layernorm): rope, then the two norm modules
    post_rope_norms: Optional[Tuple[str, str]] = None
    # q_proj writes each head's q and an output gate side by side; the attention output is
    # multiplied by sigmoid(gate) before o_proj (Qwen3-Next, Qwen3.5)
    gated_output: bool = False
    # EXAONE 4's hybrid layers: sliding-window layers rotate, global ones do not where the model
    # has a window at all, and only sliding layers pass their window on
    hybrid_nope: bool = False
    # q scaled by position after the rotary, by the module's get_llama_4_attn_scale with the
    # config's llama_4_scaling_beta (Ministral 3); the forward takes position_ids
    position_scale: bool = False
    # the attribute by which the key projection is multiplied before the rotary (Falcon-H1)
    key_multiplier: Optional[str] = None
    # a norm module applied to the attention output before the output projection (BitNet's
    # attn_sub_norm)
    out_norm: Optional[str] = None
    # the forward takes attention_mask before position_embeddings (Mllama's text self-attention)
    mask_first: bool = False
    # the attribute holding the attention dropout probability (Mllama: dropout)
    dropout_attr: str = "attention_dropout"
    # values of a head size of their own (this attribute) and scaled by another attribute after
    # the projection (MiMo-V2-Flash's v_head_dim and v_scale)
    value_head_dim: Optional[str] = None
    value_scale: Optional[str] = None


def _split_extra(extra: Tuple[Tuple[str, str], ...]) -> Tuple[Tuple[str, str, str], ...]:
    """(kwarg, owner attribute or "", attribute) of each extra kwarg: "config.sliding_window" is
    the config's, "sliding_window" the module's own."""
    return tuple((name, *path.rpartition(".")[::2]) for name, path in extra)


def _extra_kwargs(module: torch.nn.Module, extra: Tuple[Tuple[str, str, str], ...]) -> dict:
    """The extra attention-interface kwargs, from ``_split_extra``'s triples."""
    return {name: getattr(getattr(module, owner) if owner else module, attr, None)
            for name, owner, attr in extra}


_SLIDING = (("sliding_window", "sliding_window"),)
_CONFIG_SLIDING = (("sliding_window", "config.sliding_window"),)
_LLAMA_ATTENTION = AttentionSpec()
_MISTRAL_ATTENTION = AttentionSpec(extra=_CONFIG_SLIDING)
_QWEN2_ATTENTION = AttentionSpec(extra=_SLIDING)
_QWEN3_ATTENTION = AttentionSpec(qk_norm=True, extra=_SLIDING)
_SINKS_ATTENTION = AttentionSpec(extra=_SLIDING + (("s_aux", "sinks"),))
_LFM2_ATTENTION = AttentionSpec(qk_norm=True, qk_norm_names=("q_layernorm", "k_layernorm"),
                                out_proj="out_proj")

# The attention classes fused, by name (their forward signature and rotary formula are checked
# too). The MoE families' attention reads as their dense family's, word for word.
ATTENTION: Dict[str, AttentionSpec] = {
    "LlamaAttention": _LLAMA_ATTENTION,
    "GemmaAttention": _LLAMA_ATTENTION,
    "Qwen2MoeAttention": _LLAMA_ATTENTION,
    "MistralAttention": _MISTRAL_ATTENTION,
    "MixtralAttention": _MISTRAL_ATTENTION,
    "Qwen2Attention": _QWEN2_ATTENTION,
    "MinistralAttention": _QWEN2_ATTENTION,
    "Ministral3Attention": AttentionSpec(extra=_CONFIG_SLIDING, position_scale=True),
    "Qwen3Attention": _QWEN3_ATTENTION,
    "Qwen3MoeAttention": _QWEN3_ATTENTION,
    "GptOssAttention": _SINKS_ATTENTION,
    "Olmo2Attention": AttentionSpec(qk_norm=True, qk_norm_across=True),
    "MiniMaxM2Attention": AttentionSpec(qk_norm=True, qk_norm_across=True),
    "ApertusAttention": AttentionSpec(qk_norm=True),
    "HYV3Attention": AttentionSpec(qk_norm=True),            # (Apertus's forward)
    "NemotronAttention": _LLAMA_ATTENTION,   # (its apply_rotary_pos_emb takes partial tables)
    "HunYuanDenseV1Attention": AttentionSpec(post_rope_norms=("query_layernorm",
                                                              "key_layernorm")),
    "HunYuanMoEV1Attention": AttentionSpec(post_rope_norms=("query_layernorm", "key_layernorm")),
    "OlmoAttention": AttentionSpec(none_configs=("clip_qkv",)),
    "OlmoeAttention": AttentionSpec(qk_norm=True, qk_norm_across=True, extra=_CONFIG_SLIDING,
                                    none_configs=("clip_qkv",)),
    "Starcoder2Attention": AttentionSpec(extra=_CONFIG_SLIDING, out_dropout="residual_dropout"),
    "SeedOssAttention": AttentionSpec(out_dropout="residual_dropout"),
    "Olmo3Attention": AttentionSpec(qk_norm=True, qk_norm_across=True, extra=_SLIDING),
    "SmolLM3Attention": AttentionSpec(extra=_SLIDING, rope_flag=("use_rope",)),
    "Glm4MoeAttention": AttentionSpec(qk_norm=True, qk_norm_flag="use_qk_norm"),
    "Phi3Attention": AttentionSpec(fused_qkv=True, extra=_CONFIG_SLIDING),
    "PhiAttention": AttentionSpec(rotary_width="rotary_ndims", qk_norm_modules_flag="qk_layernorm",
                                  qk_norm_names=("q_layernorm", "k_layernorm"),
                                  out_proj="dense"),
    "Gemma2Attention": AttentionSpec(
        extra=_SLIDING + (("softcap", "attn_logit_softcapping"),)),
    "Gemma3Attention": AttentionSpec(qk_norm=True, extra=_SLIDING),
    "Exaone4Attention": AttentionSpec(qk_norm=True, hybrid_nope=True),
    "ExaoneMoeAttention": AttentionSpec(qk_norm=True, hybrid_nope=True),   # (EXAONE 4's)
    "CohereAttention": AttentionSpec(qk_norm_modules_flag="use_qk_norm"),
    # (Command R7B, A: rotary on the sliding-window layers only)
    "Cohere2Attention": AttentionSpec(rope_flag=("sliding_window",), extra=_SLIDING),
    "Cohere2MoeAttention": AttentionSpec(rope_flag=("sliding_window", "force_rope"),
                                         extra=_SLIDING),
    "Lfm2Attention": _LFM2_ATTENTION,
    "Lfm2MoeAttention": _LFM2_ATTENTION,
    "FalconH1Attention": AttentionSpec(key_multiplier="key_multiplier"),
    "BitNetAttention": AttentionSpec(out_norm="attn_sub_norm"),
    "MllamaTextSelfAttention": AttentionSpec(mask_first=True, dropout_attr="dropout"),
    "MiMoV2FlashAttention": AttentionSpec(extra=_SINKS_ATTENTION.extra, value_head_dim="v_head_dim",
                                          value_scale="v_scale"),
    # (no rotary where the layer gets no position embeddings: its forward's own code)
    "GraniteSWAAttention": _SINKS_ATTENTION,
    "GraniteMoeSWAAttention": _SINKS_ATTENTION,
    "Qwen3NextAttention": AttentionSpec(qk_norm=True, gated_output=True),
    "Qwen3_5Attention": AttentionSpec(qk_norm=True, gated_output=True),
    "Qwen3_5MoeAttention": AttentionSpec(qk_norm=True, gated_output=True),
}
_ATTENTION_PARAMS = ("self", "hidden_states", "position_embeddings", "attention_mask",
                     "past_key_values", "kwargs")
_MASK_FIRST_PARAMS = ("self", "hidden_states", "attention_mask", "position_embeddings",
                      "past_key_values", "kwargs")
_POSITION_SCALE_PARAMS = ("self", "hidden_states", "position_embeddings", "attention_mask",
                          "position_ids", "past_key_values", "kwargs")
# (transformers' attention registry, the module's eager_attention_forward) by the module name of
# each patched attention class
_ATTENTION_INTERFACES: Dict[str, Tuple[object, Callable]] = {}


def _attention_interface(module: torch.nn.Module, family: str) -> Callable:
    """The attention function the module's config names, as the model's own forward finds it."""
    registry, eager = _ATTENTION_INTERFACES[family]
    return registry.get_interface(module.config._attn_implementation, eager)


@functools.lru_cache(maxsize=None)
def _sdpa_interface() -> Optional[Callable]:
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        return None
    return sdpa_attention_forward


def _grouped_masked_sdpa_applies(module, interface, query, key, value, attention_mask,
                                 kwargs) -> bool:
    """Whether ``_grouped_masked_sdpa`` can stand in for transformers' SDPA call: grouped
    keys with a mask (a sliding window, padding), in eager code on a GPU, where SDPA has a
    fused kernel for the grouped heads (cuDNN's on Hopper). transformers repeats the keys and
    values over the query heads there, since SDPA's grouped path used to take masks only in its
    math kernel: two strided copies of the keys' size a layer (Gemma3-4B at 2048 tokens:
    12.8 us each), and SDPA turns the bool mask into an additive one in every layer (12.3 us)."""
    if (attention_mask is None or getattr(module, "num_key_value_groups", 1) <= 1
            or torch.compiler.is_compiling() or not query.is_cuda
            or interface is not _sdpa_interface() or kwargs.get("position_bias") is not None
            or kwargs.get("output_attentions") or module.training):
        return False
    # SDPA's own choice for these inputs, once per mask tensor and layout (the layers of a
    # forward share the mask): any fused kernel beats the repeat, the math one does not.
    layout = ("grouped sdpa", query.shape, key.shape, value.shape, query.stride(), key.stride(),
              value.stride(), query.dtype, getattr(module, "scaling", None))
    return derived_once(attention_mask, layout, lambda: _fused_grouped_kernel(
        query, key, value, _additive_mask(attention_mask, query.dtype),
        getattr(module, "scaling", None)))


def _fused_grouped_kernel(query, key, value, mask, scale) -> bool:
    """Whether SDPA picks a fused kernel (not its math one) for grouped heads under ``mask``; no
    where this torch cannot say."""
    try:
        choice = torch._fused_sdp_choice(query, key, value, mask, 0.0, False, scale=scale,
                                         enable_gqa=True)
        return choice != int(torch.nn.attention.SDPBackend.MATH)
    except (AttributeError, RuntimeError, TypeError):
        return False


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the additive one SDPA forms from it (0 where attended, -inf elsewhere),
    formed once per mask for the layers that share it; other masks as they are."""
    if mask.dtype != torch.bool:
        return mask
    return derived_once(mask, f"additive {dtype}", lambda: torch.zeros(
        mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf")))


def _grouped_masked_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         **kwargs):
    """transformers' SDPA attention for a mask and grouped keys (see
    ``_grouped_masked_sdpa_applies``), the keys and values as the cache holds them: the same
    result (SDPA computes the grouped heads as repeated ones), without the repeat."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=_additive_mask(attention_mask, query.dtype),
        dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _make_attention_forward(spec: AttentionSpec, form: str, half_tables: bool, fp32_tables: bool,
                            q_style: Optional[NormStyle], k_style: Optional[NormStyle],
                            family: str, position_scale: Optional[Callable] = None) -> Callable:
    """The fused attention forward; ``family`` is the module of the class (the key of its
    attention interfaces in ``_ATTENTION_INTERFACES``); ``position_scale``: the module's
    ``get_llama_4_attn_scale`` (``spec.position_scale``)."""
    # the spec's fields one by one: a spec shared by all layers would cost an identity guard each
    fused_qkv, rope_flag, qk_norm_across, extra = (spec.fused_qkv, spec.rope_flag,
                                                   spec.qk_norm_across, _split_extra(spec.extra))
    rotary_width, qk_norm_modules_flag, out_proj, out_dropout, post_rope_norms, gated_output = (
        spec.rotary_width, spec.qk_norm_modules_flag, spec.out_proj, spec.out_dropout,
        spec.post_rope_norms, spec.gated_output)
    hybrid_nope, (q_norm_name, k_norm_name) = spec.hybrid_nope, spec.qk_norm_names
    key_multiplier, out_norm, dropout_attr = spec.key_multiplier, spec.out_norm, spec.dropout_attr
    value_head_dim, value_scale = spec.value_head_dim, spec.value_scale

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        if position_embeddings is None:   # (a layer without rotary: Granite SWA's global ones)
            return _llama_like_fallback(self, hidden_states, position_embeddings,
                                        attention_mask, past_key_values, kwargs)
        cos, sin = position_embeddings
        projection = self.qkv_proj if fused_qkv else self.q_proj
        # transformers rotates in the dtype of q*cos: the fused op writes q's dtype, which is
        # what the model returns for tables of q's dtype, or of fp32 where it rounds the
        # rotated values back to q's dtype (fp32_tables: OLMo-2)
        tables_as_model = cos.dtype == hidden_states.dtype or (
            fp32_tables and cos.dtype == torch.float32)
        if not _fusable(hidden_states, projection.weight, cos, sin) or cos.dtype != sin.dtype \
                or not tables_as_model or (rotary_width is not None
                                           and cos.shape[-1] != getattr(self, rotary_width)) \
                or (out_dropout is not None and self.training and getattr(self, out_dropout)):
            return _llama_like_fallback(self, hidden_states, position_embeddings,
                                        attention_mask, past_key_values, kwargs)
        position_ids = kwargs.pop("position_ids") if position_scale is not None else None
        if half_tables or form == "interleaved, first half":
            # (GPT-OSS: tables of half the head; GLM, Ernie: the first half's entries paired)
            cos, sin = derived_once(cos, form, lambda: rotary_tables(form, cos, sin, half_tables))
        interleaved = form != "half"
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        # q and k stay [B, S, H, D] for the rotary op; the per-head norm is the same before
        # or after the transpose
        if fused_qkv:
            qkv = self.qkv_proj(hidden_states)
            q_width = self.config.num_attention_heads * self.head_dim
            kv_width = self.num_key_value_heads * self.head_dim
            query = qkv[..., :q_width].view(hidden_shape)
            key = qkv[..., q_width:q_width + kv_width].view(hidden_shape)
            value = qkv[..., q_width + kv_width:].view(hidden_shape).transpose(1, 2)
        else:
            if gated_output:   # (q a strided view the rotary op reads in place)
                query, gate = torch.chunk(
                    self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2,
                    dim=-1)
                gate = gate.reshape(*input_shape, -1)
            else:
                query = self.q_proj(hidden_states).view(hidden_shape)
            key = self.k_proj(hidden_states).view(hidden_shape)
            value = self.v_proj(hidden_states).view(
                *input_shape, -1, getattr(self, value_head_dim or "head_dim")).transpose(1, 2)
            if value_scale is not None:
                value = value * getattr(self, value_scale)
        if key_multiplier is not None:
            key = key * getattr(self, key_multiplier)
        if qk_norm_modules_flag is not None and getattr(self, qk_norm_modules_flag):
            query = getattr(self, q_norm_name)(query)
            key = getattr(self, k_norm_name)(key)
        rotate = rope_flag is None or any(getattr(self, flag) for flag in rope_flag)
        if hybrid_nope:
            rotate = self.sliding_window is None or self.is_sliding
            kwargs["sliding_window"] = self.sliding_window if self.is_sliding else None
        if q_style is not None:
            q_norm, k_norm = getattr(self, q_norm_name), getattr(self, k_norm_name)
        if q_style is not None and rotate and _weight_readable(q_norm, q_style, query) \
                and _weight_readable(k_norm, k_style, key):
            query, key = F.qk_norm_rope(
                query, key, q_norm.weight, k_norm.weight, cos, sin, eps=q_style.eps,
                across_heads=qk_norm_across, interleaved=interleaved,
                weight_offset=q_style.weight_offset)
        else:
            if q_style is not None and qk_norm_across:
                query = q_norm(query.flatten(-2)).view(hidden_shape)
                key = k_norm(key.flatten(-2)).view(hidden_shape)
            elif q_style is not None:
                query, key = q_norm(query), k_norm(key)
            if rotate:
                query, key = F.rope(query, key, cos, sin, interleaved=interleaved)
            if post_rope_norms is not None:
                query = getattr(self, post_rope_norms[0])(query)
                key = getattr(self, post_rope_norms[1])(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        if position_scale is not None:   # (as the model scales the rotated q)
            rope = self.config.rope_parameters
            query = query * position_scale(
                position_ids, rope.get("llama_4_scaling_beta"),
                rope.get("original_max_position_embeddings")).to(query.dtype)

        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)

        attention_interface = _attention_interface(self, family)
        if _grouped_masked_sdpa_applies(self, attention_interface, query, key, value,
                                        attention_mask, kwargs):
            attention_interface = _grouped_masked_sdpa
        attn_output, attn_weights = attention_interface(
            self, query, key, value, attention_mask,
            # (LFM2's attention has no dropout)
            dropout=0.0 if not self.training else getattr(self, dropout_attr, 0.0),
            scaling=self.scaling,
            **_extra_kwargs(self, extra),
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        if gated_output:
            attn_output = attn_output * torch.sigmoid(gate)
        if out_norm is not None:
            attn_output = getattr(self, out_norm)(attn_output)
        return getattr(self, out_proj)(attn_output), attn_weights

    fused = forward
    if spec.mask_first:
        def forward(self, hidden_states, attention_mask, position_embeddings,
                    past_key_values=None, **kwargs):   # (the signature of the model's forward)
            return fused(self, hidden_states, position_embeddings, attention_mask,
                         past_key_values, **kwargs)
        return forward
    if position_scale is None:
        return forward

    def forward(self, hidden_states, position_embeddings, attention_mask, position_ids,
                past_key_values=None, **kwargs):   # (the signature of the model's forward)
        return fused(self, hidden_states, position_embeddings, attention_mask, past_key_values,
                     position_ids=position_ids, **kwargs)
    return forward


def _llama_like_fallback(self, hidden_states, position_embeddings, attention_mask,
                         past_key_values, kwargs):
    """The model's own forward, its arguments by name (the parameter order differs between
    families: Mllama's attention mask comes first)."""
    return original_forward(self)(hidden_states, position_embeddings=position_embeddings,
                                  attention_mask=attention_mask,
                                  past_key_values=past_key_values, **kwargs)


_FALCON_ATTENTION_PARAMS = ("self", "hidden_states", "alibi", "attention_mask", "position_ids",
                            "layer_past", "use_cache", "output_attentions", "position_embeddings",
                            "kwargs")


def _falcon_qkv(self, fused_qkv, cos, sin):
    """q, k, v ``[B, H, S, D]`` (k and v with the heads the model's cache holds) from Falcon's
    fused projection, q and k rotated. Same values as ``_split_heads`` + transposes +
    ``apply_rotary_pos_emb``: the rotary reads q/k where the projection wrote them."""
    if self.new_decoder_architecture:
        # [B, S, kv groups, heads per group + 2, D]: rotate each group's key once, then repeat
        # it over the group's query heads as the model does
        batch, seq_len, _ = fused_qkv.shape
        qkv = fused_qkv.view(batch, seq_len, -1, self.num_heads // self.num_kv_heads + 2,
                             self.head_dim)
        grouped = qkv[:, :, :, :-2]
        query, key = F.rope(grouped.flatten(2, 3), qkv[:, :, :, -2], cos, sin)
        key = torch.broadcast_to(key.unsqueeze(3), grouped.shape).flatten(2, 3)
        value = torch.broadcast_to(qkv[:, :, :, [-1]], grouped.shape).flatten(2, 3)
    else:
        query, key, value = self._split_heads(fused_qkv)   # views of the projection
        query, key = F.rope(query, key, cos, sin)
    # the heads the model's cache holds: all of them (new architecture), one (multi-query)
    kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
    batch, seq_len = query.shape[:2]
    key, value = (t.transpose(1, 2).reshape(batch, kv_heads, seq_len, self.head_dim)
                  for t in (key, value))
    return query.transpose(1, 2), key, value


def _falcon_attention_forward(self, hidden_states, alibi, attention_mask, position_ids=None,
                              layer_past=None, use_cache=False, output_attentions=False,
                              position_embeddings=None, **kwargs):
    cos, sin = position_embeddings if position_embeddings is not None else (None, None)
    if (alibi is not None or cos is None
            or not _fusable(hidden_states, self.query_key_value.weight, cos, sin)
            or not cos.dtype == sin.dtype == hidden_states.dtype):
        return original_forward(self)(hidden_states, alibi, attention_mask, position_ids,
                                      layer_past, use_cache, output_attentions,
                                      position_embeddings, **kwargs)
    query, key, value = _falcon_qkv(self, self.query_key_value(hidden_states), cos, sin)
    batch_size, _, query_length, _ = query.shape
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    # the rest is FalconAttention's rotary branch
    if self.config._attn_implementation == "sdpa" and not output_attentions:
        is_causal = self.is_causal and attention_mask is None and query_length > 1
        if key.shape[1] != self.num_heads and query_length > 1:
            # Multi-query keys (one head) broadcast over the query heads: SDPA's fused kernels
            # need equal head counts (enable_gqa excludes the mask Falcon always builds), so the
            # unpatched model runs the math fallback, in fp32 (Falcon-7B prefill: about 170 of
            # 229 ms of kernels). Expanded views are the same values and let a fused kernel run.
            # Not for one-token decode steps: with it, patched decode measured 37.1 tokens/s
            # against 44.1 unpatched (Falcon-7B, batch 1; the kernel SDPA picks was not profiled).
            key = key.expand(-1, self.num_heads, -1, -1)
            value = value.expand(-1, self.num_heads, -1, -1)
        attn_output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=is_causal)
        attention_scores = None
    else:
        attention_scores = query @ key.transpose(-1, -2)
        attention_scores /= math.sqrt(self.head_dim)
        attention_scores = torch.nn.functional.softmax(attention_scores + attention_mask, dim=-1,
                                                       dtype=hidden_states.dtype)
        attn_output = attention_scores @ value
    attn_output = attn_output.view(batch_size, self.num_heads, query_length, self.head_dim)
    attn_output = attn_output.permute(0, 2, 1, 3).reshape(batch_size, query_length,
                                                          self.num_heads * self.head_dim)
    return self.dense(attn_output), attention_scores


def _falcon_attention_patch(module) -> Tuple[Optional[Callable], str]:
    if _params(type(module).forward) != _FALCON_ATTENTION_PARAMS:
        return None, "forward signature differs from the supported transformers versions"
    if getattr(module.config, "alibi", False):
        return None, "ALiBi positions (no rotary to fuse)"
    return _falcon_attention_forward, ("rope (q/k read from the fused QKV projection); multi-query "
                                      "keys expanded so SDPA runs a fused kernel")


_GEMMA4_ATTENTION_PARAMS = ("self", "hidden_states", "position_embeddings", "attention_mask",
                            "shared_kv_states", "past_key_values", "kwargs")


def _gemma4_attention_forward(self, hidden_states, position_embeddings, attention_mask,
                              shared_kv_states, past_key_values=None, **kwargs):
    """Gemma 4's: shared keys and values stored and read by the layer's type."""
    if _shared_kv_falls_back(self, hidden_states, position_embeddings):
        return original_forward(self)(hidden_states, position_embeddings, attention_mask,
                                      shared_kv_states, past_key_values=past_key_values, **kwargs)
    return _shared_kv_attention(self, hidden_states, position_embeddings, attention_mask,
                                past_key_values, kwargs, shared_kv_states, self.layer_type,
                                self.layer_type)


def _gemma3n_attention_forward(self, hidden_states, position_embeddings, attention_mask,
                               past_key_values=None, shared_kv_states=None, **kwargs):
    """Gemma 3n's: shared keys and values stored by layer index, read from the last layer of
    the same type before the sharing starts."""
    if _shared_kv_falls_back(self, hidden_states, position_embeddings):
        return original_forward(self)(hidden_states, position_embeddings, attention_mask,
                                      past_key_values=past_key_values,
                                      shared_kv_states=shared_kv_states, **kwargs)
    return _shared_kv_attention(self, hidden_states, position_embeddings, attention_mask,
                                past_key_values, kwargs, shared_kv_states,
                                self.kv_shared_layer_index, self.layer_idx)


def _shared_kv_falls_back(self, hidden_states, position_embeddings) -> bool:
    cos, sin = position_embeddings
    style = self.q_norm.__dict__.get(NORM_STYLE_ATTR)
    return (not _fusable(hidden_states, self.q_proj.weight, cos, sin) or style is None
            or not cos.dtype == sin.dtype == hidden_states.dtype
            or not _weight_readable(self.q_norm, style, hidden_states)
            or not (self.is_kv_shared_layer or _weight_readable(self.k_norm, style, hidden_states)))


def _shared_kv_attention(self, hidden_states, position_embeddings, attention_mask, cache, kwargs,
                         shared_kv_states, read_key, store_key):
    """Gemma 3n's and Gemma 4's attention: q and k ``[B, S, H, D]`` normed per head and rotated
    in one launch (the model: norm, round, rotate); a layer that shares the keys and values of
    an earlier one (``shared_kv_states[read_key]``) rotates q alone; a layer that others share
    stores its own under ``store_key``."""
    cos, sin = position_embeddings
    shared = self.is_kv_shared_layer
    eps = self.q_norm.__dict__[NORM_STYLE_ATTR].eps
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query = self.q_proj(hidden_states).view(hidden_shape)
    if shared:
        query, _ = F.qk_norm_rope(query, None, self.q_norm.weight, None, cos, sin, eps=eps)
        key, value = shared_kv_states[read_key]
        key, value = key.to(query.device), value.to(query.device)
    else:
        key = self.k_proj(hidden_states).view(hidden_shape)
        value = self.v_proj(hidden_states).view(hidden_shape) if self.v_proj is not None else key
        query, key = F.qk_norm_rope(query, key, self.q_norm.weight, self.k_norm.weight, cos, sin,
                                    eps=eps)
        key, value = key.transpose(1, 2), self.v_norm(value).transpose(1, 2)
    query = query.transpose(1, 2)
    if cache is not None and not shared:
        key, value = cache.update(key, value, self.layer_idx)
    if self.store_full_length_kv:
        shared_kv_states[store_key] = key, value
    return _attend(self, query, key, value, attention_mask, None, self.o_proj,
                   dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
                   sliding_window=self.sliding_window, **kwargs)


# rope types whose tables are of modulus one (no attention scaling in them)
_UNSCALED_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "llama3"})


def _make_llama4_attention_forward(norm_first: bool) -> Callable:
    """Llama 4's attention on its rotary layers: q and k rotated by the complex ``freqs_cis``
    written out as interleaved cos/sin tables, then normalized without a weight where the layer
    has ``qk_norm``. ``norm_first``: both in one ``qk_norm_rope``, normalizing first, the same
    since a rotation by tables of modulus one keeps each pair's length."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        freqs = position_embeddings
        if (not _fusable(hidden_states, self.q_proj.weight) or freqs is None
                or freqs.dtype != torch.complex64):
            return original_forward(self)(hidden_states, position_embeddings, attention_mask,
                                          past_key_values=past_key_values, **kwargs)
        norm = getattr(self, "qk_norm", None)
        freqs = freqs.to(hidden_states.device)
        cos, sin = derived_once(freqs, "llama4 tables", lambda: rotary_tables(
            "interleaved", freqs.real, freqs.imag, half_tables=True))
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)
        key = self.k_proj(hidden_states).view(hidden_shape)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if norm is not None and norm_first:
            query, key = F.qk_norm_rope(query, key, None, None, cos, sin, eps=norm.eps,
                                        interleaved=True)
        else:
            query, key = F.rope(query, key, cos, sin, interleaved=True)
            if norm is not None:
                query, key = norm(query), norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        return _attend(self, query, key, value, attention_mask, past_key_values, self.o_proj,
                       dropout=0.0 if not self.training else self.attention_dropout,
                       scaling=self.scaling, **kwargs)
    return forward


def _llama4_attention_patch(module) -> Tuple[Optional[Callable], str]:
    if _params(type(module).forward) != _ATTENTION_PARAMS:
        return None, "forward signature differs from the supported transformers versions"
    norm = getattr(module, "qk_norm", None)
    if norm is not None and _l2_norm_patch(norm)[0] is None:
        return None, "qk_norm formula not recognized"
    module_name = type(module).__module__
    error = _register_attention_interface(module_name, ("interleaved", True),
                                          _complex_rotary_form(module_name))
    if error:
        return None, error
    if not module.use_rope:
        return None, "a NoPE layer (its temperature tuning keeps the model's code)"
    rope_type = (getattr(module.config, "rope_parameters", None) or {}).get("rope_type", "default")
    norm_first = norm is not None and rope_type in _UNSCALED_ROPE_TYPES
    return _make_llama4_attention_forward(norm_first), (
        "qk_norm_rope" if norm_first else "rope" + (", then qk_norm" if norm is not None else ""))


@functools.lru_cache(maxsize=None)
def _complex_rotary_form(module_name: str, heads_first: bool = False) -> Tuple[Optional[str], bool]:
    """An ``apply_rotary_emb(xq, xk, freqs_cis)`` (Llama 4's, q and k ``[B, S, H, D]``;
    DeepSeek-V2's, ``heads_first``: ``[B, H, S, D]``) probed as the other families' are, with
    its complex table formed from the probe's half-width tables."""
    fn = getattr(sys.modules[module_name], "apply_rotary_emb", None)
    if fn is None:
        return None, False

    def as_probed(q, k, cos, sin):   # (the probe's q and k are [B, H, S, D])
        if heads_first:
            return fn(q, k, torch.complex(cos, sin))
        q_out, k_out = fn(q.transpose(1, 2), k.transpose(1, 2), torch.complex(cos, sin))
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    return probe_rotary(as_probed)


def _single_tensor_rotary(fn):
    """Gemma 4's ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim)`` as the probe calls one
    of q and k."""
    return lambda q, k, cos, sin, unsqueeze_dim=1: (fn(q, cos, sin, unsqueeze_dim),
                                                    fn(k, cos, sin, unsqueeze_dim))


_SHARED_KV_ATTENTION = {   # class -> (forward parameters, fused forward)
    "Gemma4TextAttention": (_GEMMA4_ATTENTION_PARAMS, _gemma4_attention_forward),
    "Gemma3nTextAttention": (("self", "hidden_states", "position_embeddings", "attention_mask",
                              "past_key_values", "shared_kv_states", "kwargs"),
                             _gemma3n_attention_forward),
}


_SHARED_KV_REFERENCES = (("gemma4", "Gemma4TextAttention"), ("gemma3n", "Gemma3nTextAttention"))


def _shared_kv_attention_patch(module, reference: Optional[str] = None
                               ) -> Tuple[Optional[Callable], str]:
    """The fused forward of a shared-KV attention class, or of one whose forward reads as
    ``reference``'s (Gemma 4 Unified's as Gemma 4's)."""
    params, forward = _SHARED_KV_ATTENTION[reference or type(module).__name__]
    if _params(type(module).forward) != params:
        return None, "forward signature differs from the supported transformers versions"
    q_style = norm_style(module.q_norm)
    k_style = norm_style(module.k_norm) if hasattr(module, "k_norm") else q_style
    if q_style is None or q_style != k_style:
        return None, "q_norm/k_norm formula not recognized"
    fn = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
    error = _register_attention_interface(type(module).__module__, ("half", False),
                                          probe_rotary(_single_tensor_rotary(fn)))
    if error:
        return None, error
    module.q_norm.__dict__[NORM_STYLE_ATTR] = q_style
    add_undo(module, functools.partial(module.q_norm.__dict__.pop, NORM_STYLE_ATTR, None))
    return forward, "qk_norm_rope"


def _attend(self, query, key, value, attention_mask, cache, out_proj, **kwargs):
    """The end of a transformers attention forward once q and k are rotated (q, k and v
    ``[B, H, S, D]``): the KV-cache update (none where ``cache`` is None: the caller's own),
    the attention implementation the config names, the output projection ``out_proj``.
    ``kwargs``: the interface's (dropout, scaling, ...)."""
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx)
    attn_output, attn_weights = _attention_interface(self, type(self).__module__)(
        self, query, key, value, attention_mask, **kwargs)
    return out_proj(attn_output.flatten(2).contiguous()), attn_weights


# --------------------------------------------------------------------------- latent attention

# Multi-head latent attention: q's last qk_rope_head_dim channels of each head and the key
# channels shared by all heads rotated, the rest as the model writes it. DeepSeek-V3 (and the
# classes that read as it) rotates interleaved pairs (config.rope_interleave) and returns them
# de-interleaved, or half-split pairs; MiniCPM3 half-split pairs; DeepSeek-V2 interleaved pairs
# by a complex table, in fp32.
_MLA_REFERENCE = (("deepseek_v3", "DeepseekV3Attention"),)
_MLA_V2_PARAMS = ("self", "hidden_states", "attention_mask", "past_key_values",
                  "position_embeddings", "kwargs")


def _deinterleaved(x: torch.Tensor) -> torch.Tensor:
    """``x``'s channel pairs ``(2i, 2i + 1)`` laid out at ``(i, i + D/2)``: the order in which
    DeepSeek-V3's interleaved rotary returns its pairs (a view)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2)


@functools.lru_cache(maxsize=None)
def _deinterleaving_rotary_ok(module_name: str) -> bool:
    """Whether the module's ``apply_rotary_pos_emb_interleave`` turns each pair ``(2i, 2i + 1)``
    by the tables' first half and returns the pairs de-interleaved: its outputs, re-interleaved,
    probe as that form."""
    fn = getattr(sys.modules[module_name], "apply_rotary_pos_emb_interleave", None)
    if fn is None:
        return False

    def reinterleaved(q, k, cos, sin):
        return tuple(out.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
                     for out in fn(q, k, cos, sin))
    return probe_rotary(reinterleaved) == ("interleaved, first half", False)


def _mla_attention_patch(module) -> Tuple[Optional[Callable], str]:
    name, module_name = type(module).__name__, type(module).__module__
    if name == "DeepseekV2Attention":
        params, form, forward = (_MLA_V2_PARAMS, _complex_rotary_form(module_name, True),
                                 _mla_complex_attention_forward)
        expected, rotary_ok = ("interleaved", True), True
    else:
        params, form = _ATTENTION_PARAMS, _rotary_form(module_name)[:2]
        expected = ("half", False)
        if name == "MiniCPM3Attention":
            forward, rotary_ok = _mla_half_attention_forward, True
        else:
            forward, rotary_ok = _mla_attention_forward, _deinterleaving_rotary_ok(module_name)
    if _params(type(module).forward) != params:
        return None, "forward signature differs from the supported transformers versions"
    error = _register_attention_interface(module_name, expected, form)
    if error or not rotary_ok:
        return None, error or "apply_rotary_pos_emb_interleave is none of the rotations fusebox runs"
    return forward, "rope (latent attention)"


def _mla_falls_back(self, hidden_states, cos, sin) -> bool:
    """Whether the model's forward runs: autograd, dtypes the op does not take, tables of
    another dtype than the activations or another width than the rotated channels."""
    q_in = self.q_proj if self.q_lora_rank is None else self.q_a_proj
    return (not _fusable(hidden_states, q_in.weight, cos, sin)
            or not cos.dtype == sin.dtype == hidden_states.dtype
            or cos.shape[-1] != self.qk_rope_head_dim)


def _mla_attention_forward(self, hidden_states, position_embeddings, attention_mask,
                           past_key_values=None, **kwargs):
    """DeepSeek-V3's: tables of the activations' dtype, pairs as ``config.rope_interleave``."""
    cos, sin = position_embeddings
    if _mla_falls_back(self, hidden_states, cos, sin):
        return original_forward(self)(hidden_states, position_embeddings, attention_mask,
                                      past_key_values=past_key_values, **kwargs)
    interleaved = bool(self.config.rope_interleave)
    if interleaved:
        form = "interleaved, first half"
        cos, sin = derived_once(cos, form, lambda: rotary_tables(form, cos, sin))
    return _latent_attention(self, hidden_states, cos, sin, interleaved, interleaved,
                             attention_mask, past_key_values, kwargs)


def _mla_half_attention_forward(self, hidden_states, position_embeddings, attention_mask=None,
                                past_key_values=None, **kwargs):
    """MiniCPM3's: half-split pairs, tables of the activations' dtype."""
    cos, sin = position_embeddings
    if _mla_falls_back(self, hidden_states, cos, sin):
        return original_forward(self)(hidden_states, position_embeddings, attention_mask,
                                      past_key_values=past_key_values, **kwargs)
    return _latent_attention(self, hidden_states, cos, sin, False, False, attention_mask,
                             past_key_values, kwargs)


def _mla_complex_attention_forward(self, hidden_states, attention_mask=None, past_key_values=None,
                                   position_embeddings=None, **kwargs):
    """DeepSeek-V2's: interleaved pairs turned by the complex ``freqs_cis`` in fp32 and rounded
    once, which the op does with the fp32 tables written out."""
    freqs = position_embeddings
    q_in = self.q_proj if self.q_lora_rank is None else self.q_a_proj
    if (freqs is None or freqs.dtype != torch.complex64 or not _fusable(hidden_states, q_in.weight)
            or 2 * freqs.shape[-1] != self.qk_rope_head_dim):
        return original_forward(self)(hidden_states, attention_mask, past_key_values,
                                      position_embeddings, **kwargs)
    freqs = freqs.to(hidden_states.device)
    cos, sin = derived_once(freqs, "complex tables", lambda: rotary_tables(
        "interleaved", freqs.real, freqs.imag, half_tables=True))
    return _latent_attention(self, hidden_states, cos, sin, True, False, attention_mask,
                             past_key_values, kwargs)


def _latent_attention(self, hidden_states, cos, sin, interleaved: bool, deinterleave: bool,
                      attention_mask, cache, kwargs):
    """The latent attention with both rotaries in one ``rope``: q ``[B, S, H, D]`` and the
    shared key channels read in place; with ``deinterleave``, the turned pairs written back in
    the model's de-interleaved order, so the cache holds what it holds unpatched."""
    batch_size, seq_length = hidden_states.shape[:-1]
    if self.q_lora_rank is None:
        q_states = self.q_proj(hidden_states)
    else:
        q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q_states = q_states.view(batch_size, seq_length, -1, self.qk_head_dim)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states),
                                 [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    kv_pass = self.kv_a_layernorm(kv_pass).view(batch_size, 1, seq_length, self.kv_lora_rank)
    q_rot, k_rot = F.rope(q_rot, k_rot.unsqueeze(2), cos, sin, interleaved=interleaved)
    if deinterleave:
        query = q_states.new_empty(q_states.shape)
        query[..., :self.qk_nope_head_dim].copy_(q_pass)
        query[..., self.qk_nope_head_dim:].unflatten(-1, (2, -1)).copy_(_deinterleaved(q_rot))
        k_rot = _deinterleaved(k_rot).flatten(-2)   # (the one copy of the shared key channels)
    else:
        query = torch.cat((q_pass, q_rot), dim=-1)
    k_rot = k_rot.transpose(1, 2)
    if cache is not None:
        kv_pass, k_rot = cache.update(kv_pass, k_rot, self.layer_idx)
    key_states, value_states = self.expand_kv(kv_pass, k_rot)
    return _attend(self, query.transpose(1, 2), key_states, value_states, attention_mask, None,
                   self.o_proj, dropout=0.0 if not self.training else self.attention_dropout,
                   scaling=self.scaling, **kwargs)


_NEOX_ATTENTION_PARAMS = ("self", "hidden_states", "attention_mask", "layer_past",
                          "position_embeddings", "kwargs")


def _neox_attention_forward(self, hidden_states, attention_mask, layer_past=None,
                            position_embeddings=None, **kwargs):
    cos, sin = position_embeddings if position_embeddings is not None else (None, None)
    if (cos is None or not _fusable(hidden_states, self.query_key_value.weight, cos, sin)
            or not cos.dtype == sin.dtype == hidden_states.dtype
            or cos.shape[-1] != self.rotary_ndims):
        return original_forward(self)(hidden_states, attention_mask, layer_past,
                                      position_embeddings, **kwargs)
    input_shape = hidden_states.shape[:-1]
    # [B, S, H, 3 * D]: each head's q, k and v side by side; rope reads q and k in place and
    # turns their first rotary_ndims channels, the rest pass through
    qkv = self.query_key_value(hidden_states).view(*input_shape, -1, 3 * self.head_size)
    query, key, value = qkv.chunk(3, dim=-1)
    query, key = F.rope(query, key, cos, sin)
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    return _attend(self, query, key, value, attention_mask, layer_past, self.dense,
                   scaling=self.scaling,
                   dropout=0.0 if not self.training else self.attention_dropout, **kwargs)


def _sliced_rotary_patch(params: Tuple[str, ...], fused: Callable, what: str) -> Callable:
    """The patch of an attention class whose forward has ``params`` and whose module rotates
    as Llama's does (GPT-NeoX, StableLM, Persimmon): ``fused`` where both hold."""
    def patch_(module) -> Tuple[Optional[Callable], str]:
        if _params(type(module).forward) != params:
            return None, "forward signature differs from the supported transformers versions"
        error = _register_attention_interface(type(module).__module__, ("half", False))
        return (None, error) if error else (fused, what)
    return patch_


_QKV_IN_PLACE = "rope (q/k read from the fused QKV projection)"


_LEGACY_ATTENTION_PARAMS = ("self", "hidden_states", "attention_mask", "position_ids",
                            "past_key_values", "output_attentions", "use_cache",
                            "position_embeddings", "kwargs")


def _make_legacy_rotary_attention_forward(fused_qkv: bool, out_proj: str,
                                          pass_position_ids: bool) -> Callable:
    """StableLM's and Persimmon's attention: q and k of ``[B, H, S, D]``, their optional q/k
    LayerNorms, then the rotary of the first ``rotary_ndims`` channels as one ``rope`` (heads
    first) where the model slices, rotates and concatenates. ``fused_qkv``: q, k and v from
    ``_split_heads`` of one projection (Persimmon)."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                output_attentions=False, use_cache=False, position_embeddings=None, **kwargs):
        cos, sin = position_embeddings if position_embeddings is not None else (None, None)
        weight = (self.query_key_value if fused_qkv else self.q_proj).weight
        if (cos is None or not _fusable(hidden_states, weight, cos, sin)
                or not cos.dtype == sin.dtype == hidden_states.dtype
                or cos.shape[-1] != self.rotary_ndims):
            return original_forward(self)(hidden_states, attention_mask, position_ids,
                                          past_key_values, output_attentions, use_cache,
                                          position_embeddings, **kwargs)
        bsz, q_len, _ = hidden_states.size()
        if fused_qkv:
            query, key, value = self._split_heads(self.query_key_value(hidden_states))
        else:
            query = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)
            key = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)
            value = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if self.qk_layernorm:    # (StableLM's per-head norms split the heads on dim 1)
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        query, key = F.rope(query, key, cos, sin, heads_first=True)
        if pass_position_ids:
            kwargs["position_ids"] = position_ids
        return _attend(self, query, key, value, attention_mask, past_key_values,
                       getattr(self, out_proj),
                       dropout=0.0 if not self.training else self.config.attention_dropout,
                       scaling=self.scaling, **kwargs)
    return forward


_GPTJ_ATTENTION_PARAMS = ("self", "hidden_states", "layer_past", "attention_mask", "position_ids",
                          "use_cache", "output_attentions", "kwargs")


@functools.lru_cache(maxsize=None)
def _every_two_rotary_ok(module_name: str) -> bool:
    """Whether GPT-J's ``apply_rotary_pos_emb(tensor, sin, cos)`` (one of q and k
    ``[B, S, H, R]``, tables of half the width) turns interleaved pairs, each by its table
    entry: probed as the other families' functions are."""
    fn = getattr(sys.modules[module_name], "apply_rotary_pos_emb", None)
    if fn is None:
        return False

    def as_probed(q, k, cos, sin):   # (the probe's q and k are [B, H, S, D])
        return tuple(fn(x.transpose(1, 2), sin, cos).transpose(1, 2) for x in (q, k))
    return probe_rotary(as_probed) == ("interleaved", True)


def _gptj_tables(table, position_ids, dtype):
    """rope's interleaved cos and sin for GPT-J's sinusoid rows ``[sin | cos]`` at the
    positions, rounded to the activations' dtype first as the model rounds them."""
    sin, cos = table[position_ids].to(dtype).chunk(2, dim=-1)
    return rotary_tables("interleaved", cos, sin, half_tables=True)


def _gptj_attention_patch(module) -> Tuple[Optional[Callable], str]:
    if _params(type(module).forward) != _GPTJ_ATTENTION_PARAMS:
        return None, "forward signature differs from the supported transformers versions"
    if module.rotary_dim is None:
        return None, "rotary over the whole embedding (no rotary_dim): the model's tables"
    if not _every_two_rotary_ok(type(module).__module__):
        return None, "apply_rotary_pos_emb is none of the rotations fusebox runs"
    return _gptj_attention_forward, "rope"


def _gptj_attention_forward(self, hidden_states, layer_past=None, attention_mask=None,
                            position_ids=None, use_cache=False, output_attentions=False,
                            **kwargs):
    """GPT-J's attention: the interleaved rotary of the first ``rotary_dim`` channels of q and k
    (the model slices, rotates with pairs stacked and flattened, and concatenates back, for q
    and k each) as one ``rope`` from its sin/cos table rows, in the activations' dtype as the
    model rounds them; the rest as the model writes it."""
    if position_ids is None or not _fusable(hidden_states, self.q_proj.weight):
        return original_forward(self)(hidden_states, layer_past, attention_mask, position_ids,
                                      use_cache, output_attentions, **kwargs)
    heads, head_dim = self.num_attention_heads, self.head_dim
    query = self._split_heads(self.q_proj(hidden_states), heads, head_dim, True)   # [B, S, H, D]
    key = self._split_heads(self.k_proj(hidden_states), heads, head_dim, True)
    value = self._split_heads(self.v_proj(hidden_states), heads, head_dim, False)
    table = self.embed_positions
    if table.device != position_ids.device:     # (moved and kept, as the model does)
        table = self.embed_positions = table.to(position_ids.device)
    # the rows of the positions, formed by the first layer of a forward for all of them (the
    # layers' tables are the same: one sinusoid of rotary_dim, the table's width)
    cos, sin = derived_once(position_ids, ("gptj tables", key.dtype, table.shape[-1]),
                            lambda: _gptj_tables(table, position_ids, key.dtype))
    query, key = F.rope(query, key, cos, sin, interleaved=True)   # channels past R pass through
    query, key = query.permute(0, 2, 1, 3), key.permute(0, 2, 1, 3)
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    attn_output, attn_weights = self._attn(query, key, value, attention_mask)
    attn_output = self._merge_heads(attn_output, heads, head_dim)
    return self.resid_dropout(self.out_proj(attn_output)), attn_weights


def _register_attention_interface(module_name: str, expected_form=None, form=None) -> str:
    """Records the attention interfaces of the family in ``module_name``; the reason it cannot
    be fused ("" when it can), also where its rotary (``form``: (form, half_tables), by default
    what a probe of the module's ``apply_rotary_pos_emb`` finds) is not ``expected_form``."""
    form = _rotary_form(module_name)[:2] if form is None else form
    if form[0] is None or (expected_form is not None and form != expected_form):
        return "apply_rotary_pos_emb is none of the rotations fusebox runs"
    eager = getattr(sys.modules[module_name], "eager_attention_forward", None)
    if eager is None:
        return "no eager_attention_forward next to the class"
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _ATTENTION_INTERFACES[module_name] = (ALL_ATTENTION_FUNCTIONS, eager)
    return ""


@functools.lru_cache(maxsize=None)
def _rotary_form(module_name: str) -> Tuple[Optional[str], bool, bool]:
    """(form, half_tables, fp32_tables) of the ``apply_rotary_pos_emb`` next to an attention
    class (``layers.probe_rotary``, ``layers.rotary_rounds_to_input``); form None when rope
    runs none of its rotations."""
    fn = getattr(sys.modules[module_name], "apply_rotary_pos_emb", None)
    form, half_tables = probe_rotary(fn)
    return form, half_tables, form is not None and rotary_rounds_to_input(fn, form, half_tables)


def _attention_patch(module) -> Tuple[Optional[Callable], str]:
    spec, reads_as = ATTENTION.get(type(module).__name__), ""
    if spec is None:
        reference = _forward_reads_as(type(module), _ATTENTION_REFERENCES)
        if reference is None:
            return None, "no fused attention for this class"
        spec, reads_as = ATTENTION[reference], f" (forward as {reference}'s)"
    if _params(type(module).forward) != (_POSITION_SCALE_PARAMS if spec.position_scale
                                         else _MASK_FIRST_PARAMS if spec.mask_first
                                         else _ATTENTION_PARAMS):
        return None, "forward signature differs from the supported transformers versions"
    position_scale = None
    if spec.position_scale:
        position_scale = getattr(sys.modules[type(module).__module__], "get_llama_4_attn_scale",
                                 None)
        if position_scale is None:
            return None, "no get_llama_4_attn_scale next to the class"
    for name in spec.none_configs:
        if getattr(module.config, name, None) is not None:
            return None, f"config.{name} is set (the fused forward does not apply it)"
    error = _register_attention_interface(type(module).__module__)
    if error:
        return None, error
    form, half_tables, fp32_tables = _rotary_form(type(module).__module__)
    if spec.qk_norm_flag is not None and not getattr(module, spec.qk_norm_flag):
        spec = spec._replace(qk_norm=False)
    q_style = k_style = None
    if spec.qk_norm:
        q_style, k_style = (norm_style(getattr(module, name)) for name in spec.qk_norm_names)
        if q_style is None or k_style is None or q_style != k_style:
            return None, "q_norm/k_norm formula not recognized"
    return _make_attention_forward(spec, form, half_tables, fp32_tables, q_style, k_style,
                                   type(module).__module__, position_scale), (
        ("qk_norm_rope" if spec.qk_norm else "rope") + reads_as)


# --------------------------------------------------------------------------- decoder layers


def _params(fn) -> Tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


# The NormStyle of each norm a fused decoder-layer forward computes, kept on that norm. The layer
# forwards below are module functions without closure cells: dynamo checks a decoder layer's guards
# on every call of a compiled step (the layer is not a guard root it may skip, patched or not), so
# values in a layer forward's closure cost a dozen checks a layer and call, where a norm's
# attributes sit under a root that it skips while they are unchanged.
NORM_STYLE_ATTR = "_fusebox_norm_style"


def _style(norm: torch.nn.Module) -> NormStyle:
    return getattr(norm, NORM_STYLE_ATTR)


def _attention_then_add_norm(self, fused_norm: torch.nn.Module, hidden_states: torch.Tensor,
                             attention_out_norm=None,
                             **attention_kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
    """``norm1`` + self-attention, then the attention residual add and ``fused_norm`` in one
    op (``attention_out_norm`` first normalizes the attention output, as Gemma2/3 do).
    Returns ``(fused_norm(h), h)``."""
    residual = hidden_states
    hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                      **attention_kwargs)
    if attention_out_norm is not None:
        hidden_states = attention_out_norm(hidden_states)
    return _add_norm(fused_norm, _style(fused_norm), hidden_states, residual)


def _mlp_output(out):
    """The MLP's output: GPT-OSS's and Llama 4's MoE blocks return it first, with the router's
    scores or logits."""
    return out[0] if isinstance(out, tuple) else out


def _prenorm_layer_forward(self, hidden_states, attention_mask=None, position_ids=None,
                           past_key_values=None, use_cache=False, position_embeddings=None,
                           **kwargs):
    """Llama-style layer: ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))`` with the
    attention add and norm2 fused."""
    if not _fusable(hidden_states, self.post_attention_layernorm.weight):
        return original_forward(self)(hidden_states, attention_mask, position_ids,
                                      past_key_values, use_cache, position_embeddings, **kwargs)
    normed, hidden_states = _attention_then_add_norm(
        self, self.post_attention_layernorm, hidden_states,
        attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, use_cache=use_cache,
        position_embeddings=position_embeddings, **kwargs)
    return hidden_states + _mlp_output(self.mlp(normed))


def _feed_forward_layer_forward(self, hidden_states, attention_mask=None, position_ids=None,
                                past_key_values=None, use_cache=False, position_embeddings=None,
                                **kwargs):
    """Llama 4's pre-norm layer: its MLP or MoE block is ``feed_forward`` (the MoE block returns
    its output flattened to rows, with the router's logits), and its attention takes no
    ``position_ids``."""
    if not _fusable(hidden_states, self.post_attention_layernorm.weight):
        return original_forward(self)(hidden_states, attention_mask, position_ids,
                                      past_key_values, use_cache, position_embeddings, **kwargs)
    normed, hidden_states = _attention_then_add_norm(
        self, self.post_attention_layernorm, hidden_states,
        position_embeddings=position_embeddings, attention_mask=attention_mask,
        past_key_values=past_key_values, use_cache=use_cache, **kwargs)
    return hidden_states + _mlp_output(self.feed_forward(normed)).view(hidden_states.shape)


def _prenorm_dropout_layer_forward(self, hidden_states, *args, **kwargs):
    """Phi-3's pre-norm layer, whose residual dropouts must be inactive for the fused path (as
    they are in eval mode)."""
    if any(d.training and d.p > 0 for d in (self.resid_attn_dropout, self.resid_mlp_dropout)):
        return original_forward(self)(hidden_states, *args, **kwargs)
    return _prenorm_layer_forward(self, hidden_states, *args, **kwargs)


def _rotary_first_layer_forward(self, hidden_states, position_embeddings=None,
                                attention_mask=None, position_ids=None, past_key_values=None,
                                **kwargs):
    """Mixtral's pre-norm layer, whose forward takes the position embeddings second (no
    ``use_cache``), with the attention add and the norm after it fused."""
    if not _fusable(hidden_states, self.post_attention_layernorm.weight):
        return original_forward(self)(hidden_states, position_embeddings, attention_mask,
                                      position_ids, past_key_values, **kwargs)
    normed, hidden_states = _attention_then_add_norm(
        self, self.post_attention_layernorm, hidden_states,
        position_embeddings=position_embeddings, attention_mask=attention_mask,
        position_ids=position_ids, past_key_values=past_key_values, **kwargs)
    return hidden_states + self.mlp(normed)


def _hybrid_layer_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                          position_ids=None, past_key_values=None, **kwargs):
    """Qwen3-Next's and Qwen3.5's pre-norm layer, whose token mixer is linear attention or
    self-attention by layer, with the mixer's residual add and the norm after it fused."""
    if not _fusable(hidden_states, self.post_attention_layernorm.weight):
        return original_forward(self)(hidden_states, position_embeddings, attention_mask,
                                      position_ids, past_key_values, **kwargs)
    if self.block_type != "linear_attention":
        normed, hidden_states = _attention_then_add_norm(
            self, self.post_attention_layernorm, hidden_states,
            position_embeddings=position_embeddings, attention_mask=attention_mask,
            position_ids=position_ids, past_key_values=past_key_values, **kwargs)
    else:
        mixed = self.linear_attn(hidden_states=self.input_layernorm(hidden_states),
                                 cache_params=past_key_values, attention_mask=attention_mask,
                                 **kwargs)
        norm = self.post_attention_layernorm
        normed, hidden_states = _add_norm(norm, _style(norm), mixed, hidden_states)
    return hidden_states + _mlp_output(self.mlp(normed))


def _sandwich_layer_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                            position_ids=None, past_key_values=None, **kwargs):
    """Gemma2/3's sandwich layer, ``h = x + norm2(attn(norm1(x))); out = h + norm4(mlp(norm3(h)))``:
    the attention add and norm3 one ``fused_add_rms_norm``, norm4 and the add after it one
    ``rms_norm_add``."""
    if not _fusable(hidden_states, self.pre_feedforward_layernorm.weight):
        return original_forward(self)(hidden_states, position_embeddings, attention_mask,
                                      position_ids, past_key_values, **kwargs)
    normed, hidden_states = _attention_then_add_norm(
        self, self.pre_feedforward_layernorm, hidden_states, self.post_attention_layernorm,
        position_embeddings=position_embeddings, attention_mask=attention_mask,
        position_ids=position_ids, past_key_values=past_key_values, **kwargs)
    norm = self.post_feedforward_layernorm
    return _norm_add(norm, _style(norm), self.mlp(normed), hidden_states)


def _gemma4_layer_forward(self, hidden_states, per_layer_input=None, shared_kv_states=None,
                          position_embeddings=None, attention_mask=None, position_ids=None,
                          past_key_values=None, **kwargs):
    """Gemma 4's layer: Gemma3's sandwich (the attention add and pre_feedforward_layernorm one
    ``fused_add_rms_norm``, post_feedforward_layernorm and its add one ``rms_norm_add``), then
    the per-layer input's branch with post_per_layer_input_norm and its add one
    ``rms_norm_add``, then the layer's scalar."""
    if not _fusable(hidden_states, self.pre_feedforward_layernorm.weight):
        return original_forward(self)(hidden_states, per_layer_input, shared_kv_states,
                                      position_embeddings, attention_mask, position_ids,
                                      past_key_values, **kwargs)
    normed, hidden_states = _attention_then_add_norm(
        self, self.pre_feedforward_layernorm, hidden_states, self.post_attention_layernorm,
        position_embeddings=position_embeddings, attention_mask=attention_mask,
        shared_kv_states=shared_kv_states, position_ids=position_ids,
        past_key_values=past_key_values, **kwargs)
    norm = self.post_feedforward_layernorm
    hidden_states = _norm_add(norm, _style(norm), self.mlp(normed), hidden_states)
    if self.hidden_size_per_layer_input:
        branch = self.act_fn(self.per_layer_input_gate(hidden_states)) * per_layer_input
        norm = self.post_per_layer_input_norm
        hidden_states = _norm_add(norm, _style(norm), self.per_layer_projection(branch),
                                  hidden_states)
    hidden_states *= self.layer_scalar
    return hidden_states


def _postnorm_layer_forward(self, hidden_states, attention_mask=None, position_ids=None,
                            past_key_values=None, use_cache=False, position_embeddings=None,
                            **kwargs):
    """OLMo-2/3's post-norm layer, ``h = x + norm1(attn(x)); out = h + norm2(mlp(h))``, each
    norm and the residual add after it one ``rms_norm_add``."""
    if not _fusable(hidden_states, self.post_attention_layernorm.weight):
        return original_forward(self)(hidden_states, attention_mask, position_ids,
                                      past_key_values, use_cache, position_embeddings, **kwargs)
    attn_out, _ = self.self_attn(
        hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, use_cache=use_cache,
        position_embeddings=position_embeddings, **kwargs)
    norm1, norm2 = self.post_attention_layernorm, self.post_feedforward_layernorm
    hidden_states = _norm_add(norm1, _style(norm1), attn_out, hidden_states)
    return _norm_add(norm2, _style(norm2), self.mlp(hidden_states), hidden_states)


@dataclass(frozen=True)
class LayerTemplate:
    params: Tuple[str, ...]
    norms: Tuple[str, ...]                # the norms the fused forward computes (one formula)
    forward: Callable
    what: str                             # the report's line


_PRENORM_PARAMS = ("self", "hidden_states", "attention_mask", "position_ids", "past_key_values",
                   "use_cache", "position_embeddings", "kwargs")
_PRENORM_WHAT = "fused_add_rms_norm (attention residual + post_attention_layernorm)"
_PRENORM = LayerTemplate(_PRENORM_PARAMS, ("post_attention_layernorm",),
                         _prenorm_layer_forward, _PRENORM_WHAT)
_PRENORM_RESIDUAL_DROPOUT = LayerTemplate(_PRENORM_PARAMS, ("post_attention_layernorm",),
                                          _prenorm_dropout_layer_forward, _PRENORM_WHAT)
_PRENORM_FEED_FORWARD = LayerTemplate(_PRENORM_PARAMS, ("post_attention_layernorm",),
                                      _feed_forward_layer_forward, _PRENORM_WHAT)
_POSTNORM = LayerTemplate(
    _PRENORM_PARAMS, ("post_attention_layernorm", "post_feedforward_layernorm"),
    _postnorm_layer_forward,
    "rms_norm_add (post_attention_layernorm + residual, post_feedforward_layernorm + residual)")
_ROTARY_FIRST_PARAMS = ("self", "hidden_states", "position_embeddings", "attention_mask",
                        "position_ids", "past_key_values", "kwargs")
_PRENORM_ROTARY_FIRST = LayerTemplate(_ROTARY_FIRST_PARAMS, ("post_attention_layernorm",),
                                      _rotary_first_layer_forward, _PRENORM_WHAT)
_HYBRID = LayerTemplate(
    _ROTARY_FIRST_PARAMS, ("post_attention_layernorm",), _hybrid_layer_forward,
    "fused_add_rms_norm (token mixer residual + post_attention_layernorm)")
_SANDWICH = LayerTemplate(
    _ROTARY_FIRST_PARAMS, ("pre_feedforward_layernorm", "post_feedforward_layernorm"),
    _sandwich_layer_forward,
    "fused_add_rms_norm (attention residual + pre_feedforward_layernorm), "
    "rms_norm_add (post_feedforward_layernorm + residual)")

# The MoE layers add their expert block's output as the dense layers add their MLP's.
DECODER_LAYERS: Dict[str, LayerTemplate] = {
    "LlamaDecoderLayer": _PRENORM,
    "MistralDecoderLayer": _PRENORM,
    "MinistralDecoderLayer": _PRENORM,
    "Qwen2DecoderLayer": _PRENORM,
    "Qwen2MoeDecoderLayer": _PRENORM,
    "Qwen3DecoderLayer": _PRENORM,
    "Qwen3MoeDecoderLayer": _PRENORM,
    "MixtralDecoderLayer": _PRENORM_ROTARY_FIRST,
    "GptOssDecoderLayer": _PRENORM,
    "SmolLM3DecoderLayer": _PRENORM,
    "Phi3DecoderLayer": _PRENORM_RESIDUAL_DROPOUT,
    "GemmaDecoderLayer": _PRENORM,
    "Gemma2DecoderLayer": _SANDWICH,
    "Gemma3DecoderLayer": _SANDWICH,
    "Olmo2DecoderLayer": _POSTNORM,
    "Olmo3DecoderLayer": _POSTNORM,
    "Llama4TextDecoderLayer": _PRENORM_FEED_FORWARD,
    "Qwen3NextDecoderLayer": _HYBRID,
    "Qwen3_5DecoderLayer": _HYBRID,
    "Qwen3_5MoeDecoderLayer": _HYBRID,
}


_GEMMA4_LAYER_PARAMS = ("self", "hidden_states", "per_layer_input", "shared_kv_states",
                        "position_embeddings", "attention_mask", "position_ids",
                        "past_key_values", "kwargs")


def _gemma4_layer_patch(module) -> Tuple[Optional[Callable], str]:
    if module.enable_moe_block:
        return None, "an expert block beside the MLP: the layer keeps its forward"
    norms = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    if module.hidden_size_per_layer_input:
        norms += ("post_per_layer_input_norm",)
    what = ("fused_add_rms_norm (attention residual + pre_feedforward_layernorm), rms_norm_add ("
            + " and ".join(f"{name} + residual" for name in norms[1:]) + ")")
    return _apply_layer_template(
        module, LayerTemplate(_GEMMA4_LAYER_PARAMS, norms, _gemma4_layer_forward, what), "")


def _layer_patch(module) -> Tuple[Optional[Callable], str]:
    template, reads_as = DECODER_LAYERS.get(type(module).__name__), ""
    if template is None:
        reference = _forward_reads_as(type(module), _LAYER_REFERENCES)
        if reference is None:
            return None, "no fused decoder layer for this class"
        template, reads_as = DECODER_LAYERS[reference], f" (forward as {reference}'s)"
    return _apply_layer_template(module, template, reads_as)


def _apply_layer_template(module, template: LayerTemplate,
                          reads_as: str) -> Tuple[Optional[Callable], str]:
    """``template``'s forward for ``module`` where its signature and norms are the template's
    (each norm's style kept on it for the forward); else (None, why)."""
    if _params(type(module).forward) != template.params:
        return None, "forward signature differs from the supported transformers versions"
    styles = [norm_style(getattr(module, name)) for name in template.norms]
    for name, style in zip(template.norms, styles):
        if style is None:
            return None, f"{name} formula not recognized"
    if any(style != styles[0] for style in styles):
        return None, f"{' and '.join(template.norms)} differ in formula or eps"
    for name, style in zip(template.norms, styles):
        norm = getattr(module, name)
        norm.__dict__[NORM_STYLE_ATTR] = style
        add_undo(module, functools.partial(norm.__dict__.pop, NORM_STYLE_ATTR, None))
    return template.forward, template.what + reads_as


# --------------------------------------------------------------------------- entry point


# Classes with their own patch or a known reason to be left, ahead of the name patterns below.
SPECIAL_CLASSES: Dict[str, Callable[[torch.nn.Module], Tuple[Optional[Callable], str]]] = {
    "FalconAttention": _falcon_attention_patch,
    "GPTNeoXAttention": _sliced_rotary_patch(_NEOX_ATTENTION_PARAMS, _neox_attention_forward,
                                             _QKV_IN_PLACE),
    "StableLmAttention": _sliced_rotary_patch(
        _LEGACY_ATTENTION_PARAMS,
        _make_legacy_rotary_attention_forward(False, "o_proj", pass_position_ids=True), "rope"),
    "GPTJAttention": _gptj_attention_patch,
    "PersimmonAttention": _sliced_rotary_patch(
        _LEGACY_ATTENTION_PARAMS,
        _make_legacy_rotary_attention_forward(True, "dense", pass_position_ids=False),
        _QKV_IN_PLACE),
    "FalconMLP": lambda m: (None, "not gated: up, activation, down (its activation module is fused)"),
    "FalconDecoderLayer": lambda m: (
        None, "residual adds kept as written (LayerNorm model, parallel attention + MLP)"),
    "Llama4TextL2Norm": _l2_norm_patch,
    "NemotronLayerNorm1P": _layer_norm_1p_patch,
    "Gemma4TextAttention": _shared_kv_attention_patch,
    "Gemma3nTextAttention": _shared_kv_attention_patch,
    "Llama4TextAttention": _llama4_attention_patch,
    "Gemma4TextDecoderLayer": _gemma4_layer_patch,
}


def _classify(module) -> Tuple[Optional[Callable], str, bool]:
    """(fused forward or None, what/why, is a candidate worth reporting)."""
    name = type(module).__name__
    if type(module) is torch.nn.LayerNorm:   # torch's formula: the op's, in every family
        fn, what = _layer_norm_patch(module)
        return fn, what, True
    if type(module) is torch.nn.SiLU or _is_activation_class(type(module)):
        fn, what = _activation_patch(module)
        return fn, what, fn is not None   # one without a kernel is its MLP's to report
    if not _is_transformers_class(type(module)):
        return None, "", False
    if name in SPECIAL_CLASSES:
        fn, what = SPECIAL_CLASSES[name](module)
        return fn, what, True
    if name.endswith("LayerNorm"):
        fn, what = _fp32_layer_norm_patch(module)
        return fn, what, bool(what)
    if name.endswith("RMSNorm"):
        style = norm_style(module)
        if style is None and _weightless_gemma4_norm(module):
            return _l2_norm_forward, "rms_norm (no weight)", True
        if style is None:
            return None, "RMSNorm formula not recognized", True
        return _make_rms_norm_forward(style), "rms_norm", True
    if name.endswith("MLP"):
        activation, why = mlp_activation(module)
        if activation is None:
            return None, why, True
        if mlp_form(module) == "plain":
            fn, what = _plain_mlp_patch(module)
            return fn, what, True
        if mlp_form(module) == "packed":
            return (_make_packed_mlp_forward(activation, _has_dropout(module)),
                    f"gated_activation_packed ({activation})", True)
        return (_make_mlp_forward(activation, _has_dropout(module)),
                f"gated_activation ({activation})", True)
    if name.endswith("Router") and source_text(type(module).forward) in _ROUTERS:
        # (routers of other forms, sigmoid or grouped scores, are not candidates: not reported)
        fn, what = _router_patch(module)
        return fn, what, True
    if name.endswith("Experts") and hasattr(module, "gate_up_proj") and hasattr(module, "has_gate"):
        # an experts class of transformers' experts interface (which sets has_gate)
        fn, what = _experts_patch(module)
        return fn, what, True
    if name.endswith("Attention"):
        if name in ("DeepseekV3Attention", "DeepseekV2Attention", "MiniCPM3Attention"):
            fn, what = _mla_attention_patch(module)
        elif _forward_reads_as(type(module), _MLA_REFERENCE):
            fn, what = _mla_attention_patch(module)
            what += f" (forward as {_MLA_REFERENCE[0][1]}'s)" if fn is not None else ""
        elif (reference := _forward_reads_as(type(module), _SHARED_KV_REFERENCES)) is not None:
            fn, what = _shared_kv_attention_patch(module, reference)
            what += f" (forward as {reference}'s)" if fn is not None else ""
        else:
            fn, what = _attention_patch(module)
        return fn, what, True
    if name.endswith("DecoderLayer"):
        fn, what = _layer_patch(module)
        return fn, what, True
    return None, "", False


def patch(model: torch.nn.Module, report, **options) -> None:
    """Patches every recognized module of ``model`` in place (see the module docstring)."""
    config = getattr(model, "config", None)
    report.family = getattr(config, "model_type", "") or ""
    plan = []
    for path, module in model.named_modules():
        fn, what, candidate = _classify(module)
        if fn is not None:
            plan.append((path, module, fn, what))
        elif candidate:
            report.skip(path, module, what)
    # An MLP fused as a whole runs its activation itself: the activation module is not called.
    fused_mlps = {path for path, module, _, _ in plan if type(module).__name__.endswith("MLP")}
    plan = [(path, module, fn, what) for path, module, fn, what in plan
            if not (fn in _ACTIVATION_FORWARDS.values() and path.rpartition(".")[0] in fused_mlps)]
    patched = 0
    for path, module, fn, what in plan:
        try:
            replace_forward(module, fn, what)
        except RuntimeError as error:   # forward already replaced by something else (kernelize)
            report.skip(path, module, str(error))
            continue
        report.add(path, module, what)
        patched += 1
    if not patched:
        report.note(f"{type(model).__name__}: no module fusebox recognizes; model left untouched")
    elif not any(e.what.startswith(("fused_add_rms_norm", "rms_norm_add")) for e in report.patched):
        report.note("decoder layers keep their residual adds (see why above); norms, MLPs "
                    "and attention patched where recognized")
