"""Layers for HF ``kernels`` (``kernelize``) and transformers ``use_kernels`` / ``KernelConfig``.

``kernelize`` swaps a host module's forward for ``Layer.forward`` and runs it with the host's
own attributes, so each class here is stateless (no ``__init__``, no members besides the two
flags) and reads the attribute names of the transformers class it replaces:

=====================  ==========================================  ============================
layer                  replaces (transformers hub name)            host attributes
=====================  ==========================================  ============================
``RMSNorm``            ``*RMSNorm`` ("RMSNorm"; Llama's and T5's    ``weight``, ``variance_epsilon``
                       formula, GPT-OSS / OLMo-2)
``SiLU``               ``SiLUActivation`` ("SiLU")                  none
``GeLU``               ``GELUActivation`` ("GeLU"), exact erf       none
``GeluTanh``           ``GELUTanh`` ("GeluTanh")                    none
``SiluAndMul``         vLLM-style packed ``silu(x[:N]) * x[N:]``   none
``GeluAndMul``         packed exact-GELU gate                       none
``GeluTanhAndMul``     packed tanh-GELU gate                        none
``RotaryPosEmb``       ``apply_rotary_pos_emb`` ("rotary_pos_emb";   none
                       Llama's, and GPT-OSS's with half tables)
=====================  ==========================================  ============================

fusebox operators have no backward (``has_backward = False``: ``kernelize`` keeps them out of
training mode); they have fake implementations and trace into ``torch.compile(fullgraph=True)``
graphs (``can_torch_compile = True``).
"""

from __future__ import annotations

import inspect
import re

import torch

from . import functional as F

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, t5: bool) -> torch.Tensor:
    """transformers' ``weight * norm(x).to(x.dtype)`` (Llama): the output takes the wider of
    x's and the weight's dtype; with ``t5``, ``(weight * norm(x)).to(x.dtype)`` (GPT-OSS,
    OLMo-2): the weight applied in fp32, the output in x's dtype."""
    out_dtype = x.dtype if t5 else torch.promote_types(x.dtype, weight.dtype)
    if x.dtype in _FUSED_DTYPES and weight.dtype in _FUSED_DTYPES:
        # the output dtype is x's or float32 for every pair of these
        return F.rms_norm(x, weight, eps, 0.0, out_dtype)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed).to(out_dtype) if t5 else weight * normed.to(x.dtype)


_T5_FORMULA = {}   # host class -> whether it applies the weight before the rounding


@torch.compiler.assume_constant_result   # (a graph takes the answer, not the source reading)
def _t5_formula(cls) -> bool:
    """Does the host RMSNorm class apply its weight before the rounding? Several classes share
    the hub name "RMSNorm": Llama's ``weight * x.to(dtype)``, GPT-OSS's and OLMo-2's
    ``(weight * x).to(dtype)``."""
    if cls not in _T5_FORMULA:
        try:
            src = re.sub(r"\s+", "", inspect.getsource(cls.forward))
        except (OSError, TypeError):
            src = ""
        _T5_FORMULA[cls] = "return(self.weight*hidden_states).to(input_dtype)" in src
    return _T5_FORMULA[cls]


def _rope(q, k, cos, sin, unsqueeze_dim):
    # transformers passes q, k as [B, H, S, D] (unsqueeze_dim=1) or [B, S, H, D] (2), and
    # cos/sin as [B, S, D]. GPT-OSS's function, under the same hub name, takes tables that hold
    # each frequency once ([B, S, D/2]) and rotates the halves of the head with them; Llama's
    # cannot take such tables, so their width tells the two apart.
    if cos.shape[-1] * 2 == q.shape[-1]:
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    return F.rope(q, k, cos, sin, heads_first=unsqueeze_dim == 1)


class _Layer(torch.nn.Module):
    """The two flags ``kernelize`` reads; a layer adds only its ``forward``."""

    can_torch_compile: bool = True
    has_backward: bool = False


def _layer(name: str, forward, doc: str) -> type:
    return type(name, (_Layer,), {"forward": forward, "__doc__": doc, "__module__": __name__,
                                  "__qualname__": name})


def _activation_layer(name: str, kind: str) -> type:
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.activation(input, None, kind)
    return _layer(name, forward, f"``{kind}(x)``.")


def _packed_gate_layer(name: str, kind: str) -> type:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gated_activation_packed(x, kind, True)
    return _layer(name, forward, f"``{kind}(x[..., :N]) * x[..., N:]`` of a packed [..., 2N] x.")


class RMSNorm(_Layer):
    weight: torch.Tensor
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # (kernelize runs this with the host module as self)
        return _rms_norm(hidden_states, self.weight, self.variance_epsilon, _t5_formula(type(self)))


class RotaryPosEmb(_Layer):
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return _rope(q, k, cos, sin, unsqueeze_dim)


SiLU = _activation_layer("SiLU", "silu")
GeLU = _activation_layer("GeLU", "gelu")
GeluTanh = _activation_layer("GeluTanh", "gelu_tanh")
SiluAndMul = _packed_gate_layer("SiluAndMul", "silu")
GeluAndMul = _packed_gate_layer("GeluAndMul", "gelu")
GeluTanhAndMul = _packed_gate_layer("GeluTanhAndMul", "gelu_tanh")

__all__ = ["GeLU", "GeluAndMul", "GeluTanh", "GeluTanhAndMul", "RMSNorm", "RotaryPosEmb",
           "SiLU", "SiluAndMul"]
