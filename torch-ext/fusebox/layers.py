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
``NewGELU``            ``NewGELUActivation`` ("NewGELU"), the tanh  none
                       form written out (GPT-2, Phi, GPT-J)
``FastGELU``           ``FastGELUActivation`` ("FastGELU"), the     none
                       same form
``SiluAndMul``         vLLM-style packed ``silu(x[:N]) * x[N:]``   none
``GeluAndMul``         packed exact-GELU gate                       none
``GeluTanhAndMul``     packed tanh-GELU gate                        none
``RotaryPosEmb``       ``apply_rotary_pos_emb`` ("rotary_pos_emb";   none
                       each function's form probed once)
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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, t5: bool) -> torch.Tensor:
    """transformers' ``weight * norm(x).to(x.dtype)`` (Llama): the output takes the wider of
    x's and the weight's dtype; with ``t5``, ``(weight * norm(x)).to(x.dtype)`` (GPT-OSS,
    OLMo-2): the weight applied in fp32, the output in x's dtype."""
    out_dtype = x.dtype if t5 else torch.promote_types(x.dtype, weight.dtype)
    if x.dtype in F.FUSED_DTYPES and weight.dtype in F.FUSED_DTYPES:
        # the output dtype is x's or float32 for every pair of these
        return F.rms_norm(F.unit_stride_rows(x), weight, eps, 0.0, out_dtype)
    normed = _normed_fp32(x, eps)
    return (weight * normed).to(out_dtype) if t5 else weight * normed.to(x.dtype)


def _normed_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` in fp32, as the transformers norms compute it (for dtypes the op does not
    take)."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


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


# --------------------------------------------------------------------------- rotary forms

# How a transformers ``apply_rotary_pos_emb(q, k, cos, sin)`` turns q and k with the tables it
# is given, in the terms ``rope`` takes (pairs, tables):
# - "half": pairs (i, i + R/2), tables as given (Llama);
# - "interleaved": pairs (2j, 2j + 1), tables as given;
# - "interleaved, first half": pairs (2j, 2j + 1) turned by entry j of the tables' first half
#   (GLM, Ernie 4.5: ``cos[..., :R/2].repeat_interleave(2)``).
# With ``half_tables`` the model's tables hold each frequency once, [.., D/2] (GPT-OSS: "half";
# its "interleaved" kin pairs neighbours); they are written out for ``rope``.
ROTARY_FORMS = ("half", "interleaved", "interleaved, first half")


def rotary_tables(form: str, cos, sin, half_tables: bool = False):
    """The full-width tables ``rope`` takes for a model's (cos, sin) of ``form``."""
    if half_tables:
        if form == "half":
            return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    if form == "interleaved, first half":
        half = cos.shape[-1] // 2
        return (cos[..., :half].repeat_interleave(2, dim=-1),
                sin[..., :half].repeat_interleave(2, dim=-1))
    return cos, sin


def _turned(x, cos, sin, interleaved: bool):
    """The reference rotation of ``x`` by full-width tables (what the probe expects)."""
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))
        partner = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        partner = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + partner * sin


def rotary_form(fn, half_tables: bool = False):
    """Which of ``ROTARY_FORMS`` ``fn`` (an ``apply_rotary_pos_emb``) computes with full-width
    tables (``half_tables``: with tables of half the head), or None. A small probe on the CPU,
    not a reading of its source: transformers may hand the function to a hub-kernel wrapper."""
    if fn is None:
        return None
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 3, 8, generator=gen, device="cpu") for _ in range(2))
    cos, sin = (torch.randn(1, 3, 4 if half_tables else 8, generator=gen, device="cpu")
                for _ in range(2))
    try:
        q_out, k_out = fn(q, k, cos, sin)
    except Exception:  # noqa: BLE001 - any failure means "not a form fusebox runs"
        return None
    for form in ROTARY_FORMS[:2] if half_tables else ROTARY_FORMS:
        c, s = rotary_tables(form, cos, sin, half_tables)
        if all(torch.allclose(out, _turned(x, c[:, None], s[:, None], form != "half"))
               for x, out in ((q, q_out), (k, k_out))):
            return form
    return None


def rotary_rounds_to_input(fn, form: str, half_tables: bool = False) -> bool:
    """Whether ``fn`` (of ``form``), given 16-bit q and k with fp32 tables, rotates in fp32
    and returns q's and k's dtype, as OLMo-2's does: then the fused op, which computes in fp32
    and writes q's dtype, takes fp32 tables as they come. (Llama's returns the promoted fp32.)"""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 3, 8, generator=gen).to(torch.bfloat16) for _ in range(2))
    cos, sin = (torch.randn(1, 3, 4 if half_tables else 8, generator=gen) for _ in range(2))
    try:
        q_out, k_out = fn(q, k, cos, sin)
    except Exception:  # noqa: BLE001 - any failure means "no"
        return False
    c, s = rotary_tables(form, cos, sin, half_tables)
    return all(out.dtype == x.dtype and torch.equal(
        out, _turned(x.float(), c[:, None], s[:, None], form != "half").to(x.dtype))
        for x, out in ((q, q_out), (k, k_out)))


def probe_rotary(fn):
    """(form, half_tables) of an ``apply_rotary_pos_emb``: its form with full-width tables, or
    failing that with tables of half the head; (None, ...) when neither is one rope runs.
    (No function takes both: Llama's cannot broadcast half tables, GPT-OSS's full ones.)"""
    form = rotary_form(fn)
    return (form, False) if form is not None else (rotary_form(fn, half_tables=True), True)


_HOST_FORMS = {}   # kernels' wrapper class -> (form or None, half_tables)


def _host_function(wrapper_cls):
    """The function kernels wrapped in ``wrapper_cls`` (its forward's closure holds it), or
    None when the layer runs on its own."""
    cells = getattr(getattr(wrapper_cls, "forward", None), "__closure__", None) or ()
    return next((c.cell_contents for c in cells
                 if getattr(c.cell_contents, "__name__", "") == "apply_rotary_pos_emb"), None)


@torch.compiler.assume_constant_result   # (a graph takes the answer, not the probe)
def _host_form(wrapper_cls):
    """(form, half_tables) of the function in ``wrapper_cls``, trying full-width then
    half-width tables (form None: none fusebox runs); ("direct", False) without one."""
    if wrapper_cls not in _HOST_FORMS:
        host = _host_function(wrapper_cls)
        _HOST_FORMS[wrapper_cls] = ("direct", False) if host is None else probe_rotary(host)
    return _HOST_FORMS[wrapper_cls]


def _rope(layer, q, k, cos, sin, unsqueeze_dim):
    # transformers passes q, k as [B, H, S, D] (unsqueeze_dim=1) or [B, S, H, D] (2), and
    # cos/sin as [B, S, D]. Functions of several forms share the hub name "rotary_pos_emb"
    # (Llama's, GPT-OSS's with half-width tables, NanoChat's turning the other way...): the one
    # kernelize replaced is probed once; a form rope does not run keeps its own code.
    form, half_tables = _host_form(type(layer))
    if form == "direct":   # the layer called on its own: Llama's, or GPT-OSS's by table width
        form, half_tables = "half", cos.shape[-1] * 2 == q.shape[-1]
    elif form is None:
        return _host_function(type(layer))(q, k, cos, sin, unsqueeze_dim)
    cos, sin = rotary_tables(form, cos, sin, half_tables)
    return F.rope(q, k, cos, sin, interleaved=form != "half", heads_first=unsqueeze_dim == 1)


class _Layer(torch.nn.Module):
    """The two flags ``kernelize`` reads; a layer adds only its ``forward``."""

    can_torch_compile: bool = True
    has_backward: bool = False


def _layer(name: str, forward, doc: str) -> type:
    return type(name, (_Layer,), {"forward": forward, "__doc__": doc, "__module__": __name__,
                                  "__qualname__": name})


def _activation_layer(name: str, kind: str) -> type:
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.activation(F.unit_stride_rows(input), None, kind)
    return _layer(name, forward, f"``{kind}(x)``.")


def _packed_gate_layer(name: str, kind: str) -> type:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gated_activation_packed(F.unit_stride_rows(x), kind, True)
    return _layer(name, forward, f"``{kind}(x[..., :N]) * x[..., N:]`` of a packed [..., 2N] x.")


class RMSNorm(_Layer):
    weight: torch.Tensor
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # (kernelize runs this with the host module as self)
        return _rms_norm(hidden_states, self.weight, self.variance_epsilon, _t5_formula(type(self)))


class RMSNormZeroCentered(_Layer):
    """Qwen3.5's RMSNorm: ``(norm(x) * (1 + weight)).to(x.dtype)``, in fp32 (the weight is held
    as its offset from one)."""
    weight: torch.Tensor
    eps: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in F.FUSED_DTYPES and self.weight.dtype in F.FUSED_DTYPES:
            return F.rms_norm(F.unit_stride_rows(x), self.weight, self.eps, 1.0)
        return (_normed_fp32(x, self.eps) * (1.0 + self.weight.float())).type_as(x)


class RotaryPosEmb(_Layer):
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return _rope(self, q, k, cos, sin, unsqueeze_dim)


SiLU = _activation_layer("SiLU", "silu")
GeLU = _activation_layer("GeLU", "gelu")
GeluTanh = _activation_layer("GeluTanh", "gelu_tanh")
NewGELU = _activation_layer("NewGELU", "gelu_tanh")
FastGELU = _activation_layer("FastGELU", "gelu_tanh")
SiluAndMul = _packed_gate_layer("SiluAndMul", "silu")
GeluAndMul = _packed_gate_layer("GeluAndMul", "gelu")
GeluTanhAndMul = _packed_gate_layer("GeluTanhAndMul", "gelu_tanh")

__all__ = ["FastGELU", "GeLU", "GeluAndMul", "GeluTanh", "GeluTanhAndMul", "NewGELU", "RMSNorm",
           "RMSNormZeroCentered", "RotaryPosEmb", "SiLU", "SiluAndMul"]
