"""The fused pieces every DiT patcher builds on: when a fused path may run, the AdaLN /
gated-residual / activation / q-k-norm + RoPE formulas as fusebox calls, the bookkeeping that
marks the children a fused parent does the work of, the attention-processor swap (with the
processor of attention whose q/k norm spans all heads: LTX-Video, Wan), the patch steps the
families share, and the stream pieces of two-stream blocks (FLUX, HunyuanVideo).

Each formula helper (``modulation_sum``, ``modulated_norm``, ``gated_add``, ``gated_add_norm``,
``linear_gelu``, ``linear_add``, ``norm_rope``) computes what the diffusers code writes; it takes the fused path when its
operands allow (no autograd, supported dtypes and devices, the model's output dtype reachable)
and otherwise runs the eager formula, so a patched block never changes what a model computes.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import FP32LayerNorm, RMSNorm

from ... import functional as fb
# rows as the operators read them: a patch embedding's transposed output is copied once, as an
# eager norm would copy it
from ...functional import has_unit_stride_rows as has_contiguous_rows
from ...functional import unit_stride_rows as rows
from ...functional import _check_choice, _rotary_in_torch
from .._common import (add_undo, derived_once, gemm_bias_gelu_tanh, gemm_gelu_tanh_ok, has_hooks,
                       needs_autograd, replace_forward)

Tensor = torch.Tensor
FUSED_DTYPES = fb.FUSED_DTYPES
FUSED_DEVICES = ("cpu", "cuda")
FUSED_INTO_ATTR = "_fusebox_fused_into"  # a module whose work a patched parent now does


# --------------------------------------------------------------------------- eligibility


def fusable(x: Tensor, *small: Optional[Tensor], like_x: Tuple[Optional[Tensor], ...] = ()) -> bool:
    """Can the fused path take ``x``? ``small`` operands (weights, scale/shift, tables) may be
    fp32 or x's dtype and need contiguous rows (large ones go through :func:`rows`); ``like_x``
    operands (branches, gates the model adds in x's dtype) must have x's dtype. Every operand
    must sit on x's device (a weight an offload hook has not loaded yet does not). False when
    autograd must record the computation: fusebox operators have no backward."""
    # Plain loops, and the operands unpacked for needs_autograd only where grad is on: a patched
    # block asks this about six times a forward, and the host time of small DiTs is part of their
    # step (2.8-3.1 us a call, was 4.2-6.8: bench/results/2026-11-27_cpu_d4616d6/).
    if torch.is_grad_enabled() and needs_autograd(x, *small, *like_x):
        return False
    dtype, device = x.dtype, x.device
    if dtype not in FUSED_DTYPES or device.type not in FUSED_DEVICES:
        return False
    for t in small:
        if t is not None and (t.device != device or (t.dtype != torch.float32 and t.dtype != dtype)
                              or not has_contiguous_rows(t)):
            return False
    for t in like_x:
        if t is not None and (t.device != device or t.dtype != dtype):
            return False
    return True


def grad_needed(module: torch.nn.Module, *inputs: Optional[Tensor]) -> bool:
    """Must a call of ``module`` be differentiable, through its inputs or its parameters? A
    fused block forward checks this once and otherwise runs the original forward."""
    if not torch.is_grad_enabled():
        return False
    return needs_autograd(*inputs) or any(p.requires_grad for p in module.parameters())


def broadcasts_to(t: Tensor, target: Tensor) -> bool:
    """Does ``t`` broadcast to ``target``'s shape as it is? (``torch.broadcast_shapes`` answers
    the same in 29-34 us of Python a call on one CPU thread, this in 1.4-2.3:
    bench/results/2026-11-27_cpu_d4616d6/patch_helper_cost.txt.)"""
    if t.dim() > target.dim():
        return False
    return all(a == 1 or a == b for a, b in zip(reversed(t.shape), reversed(target.shape)))


# --------------------------------------------------------------------------- bookkeeping


def mark_fused(module: torch.nn.Module, into: str) -> None:
    """Records that a patched parent does ``module``'s work, so the generic pass leaves it
    (and reports it as done by ``into``). Its forward is untouched: a parent that falls back
    runs it as diffusers does."""
    if module.__dict__.get(FUSED_INTO_ATTR) == into:
        return
    module.__dict__[FUSED_INTO_ATTR] = into
    add_undo(module, functools.partial(module.__dict__.pop, FUSED_INTO_ATTR, None))


def _shared_with_original(name: str) -> property:
    """An attribute read from and written to the replaced processor (``self.original``)."""
    return property(lambda self: getattr(self.original, name, None),
                    lambda self, value: setattr(self.original, name, value))


class FusedAttnProcessor:
    """Base of the fused attention processors. Keeps the processor it replaced (``original``)
    for the calls it cannot fuse and for unpatch, and shares that processor's attention
    backend and parallel config, so ``model.set_attention_backend(...)`` reaches both."""

    # the model's, where its inputs are trimmed of text padding (:func:`trim_text_padding`)
    text_padding: Optional[TextPadding] = None

    def __init__(self, original):
        self.original = original

    _attention_backend = _shared_with_original("_attention_backend")
    _parallel_config = _shared_with_original("_parallel_config")

    def text_all_valid(self) -> bool:
        """Is every text token the model hands its blocks in this forward valid in every
        sample? Then attention needs no text mask. Known without a host read, compiled too."""
        return self.text_padding is not None and self.text_padding.all_valid

    def text_counts(self) -> Optional[Tuple[Any, ...]]:
        """Each sample's number of valid text tokens (its first ones) in this forward, where
        the model's input hook counted them (:attr:`TextPadding.counts`); else None. Sizes of a
        tensor a compiled graph takes as unknown (unbacked): a compiled block slices by them
        without a host read, and new counts do not recompile it."""
        carrier = None if self.text_padding is None else self.text_padding.counts
        return None if carrier is None else tuple(carrier.shape[1:])


class TokenQKNormAttnProcessor(FusedAttnProcessor):
    """Base of the processors of attention modules whose q/k RMSNorm spans all heads of a token
    (LTX-Video, LTX-2, Wan): the q/k/v projections (:meth:`project`), q/k RMSNorm + RoPE
    (:func:`qk_norm_rope_across_heads`, the tables laid out as :meth:`rope_layout` says),
    diffusers' attention dispatch, then ``to_out``. Calls it cannot fuse run the original
    processor (:meth:`call_original`). ``__call__`` has ``WanAttnProcessor``'s signature; a
    subclass for a processor whose parameters are named otherwise redefines it (some attention
    modules filter keyword arguments by it) and calls :meth:`run`."""

    # how the RoPE tables index q/k (one of ROPE_LAYOUTS): Wan's [1, S, 1, D] tables are
    # shared by the heads of [B, S, H, D] q/k
    rope_layout = "heads"

    def project(self, attn, hidden_states, encoder_hidden_states, attention_mask):
        """(query, key, value, attention mask as dispatch takes it); q/k/v ``[B, S, H * D]``."""
        raise NotImplementedError

    def rope_layout_of(self, attn) -> str:
        return self.rope_layout

    def parallel_config(self, encoder_hidden_states):
        return self._parallel_config

    def call_original(self, attn, hidden_states, encoder_hidden_states, attention_mask, rotary,
                      key_rotary):
        return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary)

    def heads_output(self, attn, hidden_states, attn_output):
        """The attention output ``[B, S, H * D]`` before ``to_out`` (a subclass gates heads)."""
        return attn_output

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Optional[Tensor] = None,
        attention_mask: Optional[Tensor] = None,
        rotary_emb: Optional[Tuple[Tensor, Tensor]] = None,
    ) -> Tensor:
        return self.run(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)

    def run(self, attn, hidden_states, encoder_hidden_states, attention_mask, rotary,
            key_rotary=None):
        """``key_rotary``: k's own tables (cross-attention between two streams); None: q's."""
        layout = self.rope_layout_of(attn)
        qk_norm = qk_norm_weights(attn, hidden_states)
        if (qk_norm is None or grad_needed(attn, hidden_states, encoder_hidden_states)
                or not fusable(hidden_states, qk_norm[0], qk_norm[1], *(rotary or ()),
                               *(key_rotary or ()))
                or not rotary_fits(layout, attn.heads, rotary, key_rotary)):
            return self.call_original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                      rotary, key_rotary)
        weight_q, weight_k, eps = qk_norm
        query, key, value, attention_mask = self.project(attn, hidden_states,
                                                         encoder_hidden_states, attention_mask)
        query, key = qk_norm_rope_across_heads(query, key, attn.heads, weight_q, weight_k, eps,
                                               rotary, key_rotary, layout)
        value = value.unflatten(2, (attn.heads, -1))

        out = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=self._attention_backend,
            parallel_config=self.parallel_config(encoder_hidden_states))
        out = self.heads_output(attn, hidden_states, out.flatten(2, 3).to(query.dtype))
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


def built_on(model: torch.nn.Module, model_class: type, block_class: type) -> bool:
    """Is ``model`` a ``model_class``, or built on its ``block_class`` (a ControlNet,
    FramePack), whose blocks then take the family's fused forwards?"""
    return isinstance(model, model_class) or any(type(m) is block_class for m in model.modules())


def contains_class(module: torch.nn.Module, *class_names: str) -> bool:
    """Is ``module`` or one of its submodules of a class named in ``class_names``?"""
    return any(type(m).__name__ in class_names for m in module.modules())


def patch_block(path: str, block: torch.nn.Module, report, why: str, forward: Callable,
                tag: str, fused_norms, what: str) -> None:
    """Replaces ``block``'s forward by ``forward`` (its children ``fused_norms``, by name, are
    done by it) unless ``why`` says why it cannot be."""
    if why:
        report.skip(path, block, why)
        return
    replace_forward(block, forward, tag)
    for child in fused_norms:
        mark_fused(getattr(block, child), "the block's adaln / gated_residual_norm")
    report.add(path, block, what)


def patch_qk_norm_attention(path: str, attn: torch.nn.Module, report, processor_class: str,
                            fused_class, what: str, why: str = "") -> str:
    """Installs ``fused_class`` on an attention module whose processor is a ``processor_class``
    with q/k ``torch.nn.RMSNorm`` norms, unless :func:`attention_unfusable` or ``why`` says
    why not. Returns the reason it was left ("" when installed)."""
    why = attention_unfusable(attn, processor_class) or why
    if why:
        report.skip(path, attn, why)
        return why
    install_processor(attn, fused_class)
    for child in ("norm_q", "norm_k"):
        mark_fused(getattr(attn, child), "the attention processor")
    report.add(path, attn, what)
    return ""


def original_processor(attn: torch.nn.Module):
    """The processor fusebox did not put there (a patched model is patched again cleanly)."""
    processor = getattr(attn, "processor", None)
    return processor.original if isinstance(processor, FusedAttnProcessor) else processor


def install_processor(attn: torch.nn.Module, processor_class) -> None:
    """Replaces ``attn``'s processor by ``processor_class(original)``; unpatch puts the
    original processor object back."""
    original = original_processor(attn)
    attn.set_processor(processor_class(original))
    add_undo(attn, functools.partial(attn.set_processor, original))


def swap_processor(path: str, module: torch.nn.Module, report,
                   fused: Dict[type, Tuple[type, str]]) -> None:
    """Installs the fused processor ``fused[type(processor)]`` = (class, what it does) on an
    attention module and reports it; a module with another processor is reported as kept.
    Modules without processors are left alone."""
    if not (hasattr(module, "processor") and hasattr(module, "set_processor")):
        return
    processor = original_processor(module)
    if type(processor) in fused:
        fused_class, what = fused[type(processor)]
        install_processor(module, fused_class)
        report.add(path, module, what)
    elif processor is not None:
        report.skip(path, module, f"processor {type(processor).__name__} kept")


def custom_processor(attn: torch.nn.Module, processor_class: str) -> str:
    """Why ``attn``'s processor is not the diffusers ``processor_class`` a fused one replaces
    ("" when it is)."""
    processor = original_processor(attn)
    if type(processor).__name__ != processor_class:
        return f"custom processor {type(processor).__name__}"
    return ""


def attention_unfusable(attn: torch.nn.Module, processor_class: str) -> str:
    """Why an attention module with q/k ``torch.nn.RMSNorm`` norms keeps its processor (""
    when a fused one can replace it)."""
    why = custom_processor(attn, processor_class)
    if why:
        return why
    norms = (getattr(attn, "norm_q", None), getattr(attn, "norm_k", None))
    if not all(isinstance(n, torch.nn.RMSNorm) for n in norms):
        return "q/k norms are not torch.nn.RMSNorm"
    if _torch_rms_eps(norms[0]) != _torch_rms_eps(norms[1]):
        return "q and k norms have different eps"     # one eps per fused q/k launch
    return ""


# --------------------------------------------------------------------------- norms


class NormParams(NamedTuple):
    kind: str                  # "layer" or "rms"
    weight: Optional[Tensor]
    bias: Optional[Tensor]
    eps: float
    dtype: torch.dtype         # what the module returns for this input


LAYER_NORMS = (torch.nn.LayerNorm, FP32LayerNorm)


def norm_kind(norm: torch.nn.Module) -> Optional[str]:
    """The fused norm kind ("layer" or "rms") of a norm module, None if it has none."""
    if type(norm) in LAYER_NORMS and len(norm.normalized_shape) == 1:
        return "layer"
    if type(norm) is RMSNorm and norm.bias is None and len(norm.dim) == 1:
        return "rms"
    if type(norm) is torch.nn.RMSNorm and len(norm.normalized_shape) == 1:
        return "rms"
    return None


def _torch_rms_eps(norm: torch.nn.Module) -> float:
    """``torch.nn.RMSNorm`` takes ``eps=None`` as the fp32 machine epsilon."""
    return torch.finfo(torch.float32).eps if norm.eps is None else float(norm.eps)


def norm_params(norm: torch.nn.Module, x: Tensor) -> Optional[NormParams]:
    """How a norm module normalizes ``x``, or None when it is not one fusebox reproduces or
    when a hook owns its weights (offloaded weights arrive only when its own forward runs)."""
    if has_hooks(norm):
        return None
    kind = norm_kind(norm)
    if kind == "layer":
        return NormParams(kind, norm.weight, norm.bias, norm.eps, x.dtype)
    if kind == "rms" and type(norm) is torch.nn.RMSNorm:
        return NormParams(kind, norm.weight, None, _torch_rms_eps(norm), x.dtype)
    if kind == "rms":   # diffusers returns the weight's dtype (fp32 for an fp32 weight)
        dtype = x.dtype if norm.weight is None else norm.weight.dtype
        return NormParams(kind, norm.weight, None, norm.eps, dtype)
    return None


def rms_params(norm: torch.nn.Module, x: Tensor) -> Optional[Tuple[Optional[Tensor], float]]:
    """(weight, eps) of an RMSNorm module (diffusers' or torch's) that returns x's dtype for
    ``x``, else None."""
    p = norm_params(norm, x)
    if p is None or p.kind != "rms" or p.dtype != x.dtype:
        return None
    return p.weight, p.eps


def qk_norm_weights(attn: torch.nn.Module, x: Tensor):
    """(q weight, k weight, eps) of ``attn.norm_q`` / ``attn.norm_k`` when one fused launch can
    apply both to ``x``'s projections, else None."""
    q, k = rms_params(attn.norm_q, x), rms_params(attn.norm_k, x)
    if q is None or k is None or q[1] != k[1]:
        return None
    return q[0], k[0], q[1]


def _modulation_dtype(p: NormParams, x: Tensor, scale: Optional[Tensor],
                      shift: Optional[Tensor]):
    """dtype of ``norm(x) * (1 + scale) + shift`` (``norm(x)`` without scale) in eager PyTorch,
    or None when the fused op cannot write it."""
    dtype = p.dtype if scale is None else torch.promote_types(p.dtype, scale.dtype)
    if shift is not None:
        dtype = torch.promote_types(dtype, shift.dtype)
    return dtype if dtype in (x.dtype, torch.float32) else None


def _modulate(normed: Tensor, scale: Optional[Tensor], shift: Optional[Tensor]) -> Tensor:
    if scale is None:
        return normed
    return normed * (1 + scale) if shift is None else normed * (1 + scale) + shift


def modulated_norm(norm: torch.nn.Module, x: Tensor, scale: Optional[Tensor],
                   shift: Optional[Tensor] = None) -> Tensor:
    """``norm(x) * (1 + scale) + shift`` (AdaLN; no shift where None; ``norm(x)`` alone without
    scale); scale/shift broadcast as ``[B, 1, D]``."""
    p = norm_params(norm, x)
    if p is not None and fusable(x, scale, shift, p.weight, p.bias):
        dtype = _modulation_dtype(p, x, scale, shift)
        if dtype is not None:
            return fb.adaln(rows(x), scale, shift, p.weight, p.bias, p.kind, p.eps,
                            out_dtype=dtype)
    return _modulate(norm(x), scale, shift)


def modulation_sum(table: Tensor, emb: Tensor) -> Tensor:
    """``table + emb``: a block's modulation terms, its ``scale_shift_table`` broadcast over the
    timestep embedding ``emb`` (same dtype). One fusebox launch where it can take them: eager
    PyTorch computes the sum once and the block passes views of it, but inductor, which cannot
    see into the fused operators, recomputes the add into a separate buffer for each term it
    hands one (PixArt-Σ: five more launches per block). The sum is exact either way."""
    if (table.dtype == emb.dtype and has_contiguous_rows(emb) and broadcasts_to(table, emb)
            and fusable(emb, like_x=(table,))):
        return fb.gated_residual(emb, table.expand_as(emb))
    return table + emb


def gated_add(x: Tensor, branch: Tensor, gate: Optional[Tensor] = None) -> Tensor:
    """``x + gate * branch`` (the AdaLN-Zero residual; ``x + branch`` without a gate)."""
    if fusable(x, like_x=(branch, gate)):
        return fb.gated_residual(rows(x), rows(branch), gate)
    return x + branch if gate is None else x + gate * branch


def gated_add_norm(x: Tensor, branch: Tensor, gate: Optional[Tensor], norm: torch.nn.Module,
                   scale: Optional[Tensor],
                   shift: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """A DiT block boundary: ``h = x + gate * branch``, then ``norm(h) * (1 + scale) + shift``
    (no shift where None; ``norm(h)`` alone without scale). Returns ``(normed, h)``."""
    p = norm_params(norm, x)
    if p is not None and fusable(x, scale, shift, p.weight, p.bias, like_x=(branch, gate)):
        dtype = _modulation_dtype(p, x, scale, shift)
        if dtype is not None:
            return fb.gated_residual_norm(rows(x), rows(branch), gate, scale, shift, p.weight,
                                          p.bias, p.kind, p.eps, out_dtype=dtype)
    h = gated_add(x, branch, gate)
    return modulated_norm(norm, h, scale, shift), h


# --------------------------------------------------------------------------- activations

GELU_KINDS = {"tanh": "gelu_tanh", "none": "gelu"}


def _plain_linear(proj: torch.nn.Module) -> bool:
    """A plain Linear that no hook (offload, casting) wraps: its weight and bias are the ones its
    own forward would use, so a fused path may read them directly."""
    return type(proj) is torch.nn.Linear and not has_hooks(proj)


def _bias_foldable(proj: torch.nn.Module) -> bool:
    """Can the projection's bias move into the activation?"""
    return _plain_linear(proj) and proj.bias is not None


def linear_gelu(proj: torch.nn.Module, x: Tensor, approximate: str = "tanh") -> Tensor:
    """``gelu(proj(x))``: on CUDA with the tanh form, one GEMM whose epilogue adds the bias
    and applies the GELU; otherwise the matmul without bias, then bias + GELU in one pass (the
    projection run as a module, then the GELU alone, when its bias cannot move)."""
    kind = GELU_KINDS[approximate]
    if _bias_foldable(proj) and fusable(x, proj.bias, like_x=(proj.weight,)):
        if approximate == "tanh" and gemm_gelu_tanh_ok(x, proj.bias):
            return gemm_bias_gelu_tanh(x, proj.weight.t(), proj.bias)
        return fb.activation(torch.nn.functional.linear(x, proj.weight), proj.bias, kind)
    h = proj(x)
    if fusable(h):
        return fb.activation(rows(h), None, kind)
    return torch.nn.functional.gelu(h, approximate=approximate)


MAX_SLICE_GEMMS = 8  # batches multiplied one by one; more take the copy F.linear makes


def linear_rows(proj: torch.nn.Module, x: Tensor) -> Tensor:
    """``proj(x)`` for ``x`` a slice of a longer sequence (one stream of a joint attention
    output): ``[B, S, C]`` with contiguous rows whose batches are not adjacent when B > 1.
    ``F.linear`` copies such an input and then adds the bias in a separate pass; in eager calls
    each batch's rows are multiplied where they lie instead, the bias inside the GEMM. Compiled
    graphs keep the module call (the compiler fuses the copy into the attention's epilogue)."""
    eligible = (_plain_linear(proj) and x.dim() == 3 and 1 < x.shape[0] <= MAX_SLICE_GEMMS
                and not x.is_contiguous() and x.stride(2) == 1 and x.stride(1) == x.shape[2]
                and not torch.compiler.is_compiling() and fusable(x, like_x=(proj.weight,)))
    if not eligible:
        return proj(x)
    out = x.new_empty(x.shape[0], x.shape[1], proj.out_features)
    weight_t = proj.weight.t()
    for b in range(x.shape[0]):
        if proj.bias is None:
            torch.mm(x[b], weight_t, out=out[b])
        else:
            torch.addmm(proj.bias, x[b], weight_t, out=out[b])
    return out


def linear_add(proj: torch.nn.Module, x: Tensor, other: Tensor) -> Tensor:
    """``proj(x) + other`` (a parallel block's attention output plus its feed-forward output):
    for a plain Linear without bias, one GEMM that accumulates onto ``other`` (``addmm``), so
    the product is not written for a separate add to read back. fp32 accumulation, one
    rounding."""
    if (_plain_linear(proj) and proj.bias is None and x.dim() >= 2 and other.is_contiguous()
            and other.shape == (*x.shape[:-1], proj.out_features)
            and fusable(x, like_x=(other, proj.weight))):
        out = torch.addmm(other.reshape(-1, other.shape[-1]), x.reshape(-1, x.shape[-1]),
                          proj.weight.t())
        return out.view(other.shape)
    return proj(x) + other


def linear_act(proj: torch.nn.Module, act: torch.nn.Module, x: Tensor) -> Tensor:
    """``act(proj(x))``, fused when ``act`` is a torch GELU."""
    if type(act) is torch.nn.GELU and act.approximate in GELU_KINDS:
        return linear_gelu(proj, x, act.approximate)
    return act(proj(x))


# --------------------------------------------------------------------------- q/k norm + RoPE


def _eager_norm_rope(q, k, norm_q, norm_k, rotary, upcast=False):
    dtype = q.dtype
    if upcast:
        q, k = q.float(), k.float()
    if norm_q is not None:
        q = norm_q(q)
    if norm_k is not None:
        k = norm_k(k)
    if rotary is not None:
        q = apply_rotary_emb(q, rotary, sequence_dim=1)
        k = apply_rotary_emb(k, rotary, sequence_dim=1)
    return (q.to(dtype), k.to(dtype)) if upcast else (q, k)


def host_readable(t: Tensor, parallel_config) -> bool:
    """May a call read ``t`` on the host and shape its work by what it finds? Not in a compiled
    or captured graph, nor under context parallelism (``parallel_config``: the sequence split
    over ranks, which must all take the same path)."""
    return not (parallel_config is not None or torch.compiler.is_compiling()
                or (t.is_cuda and torch.cuda.is_current_stream_capturing()))


def valid_key_counts(processor: FusedAttnProcessor, mask: Tensor) -> Optional[Tuple[int, ...]]:
    """Each sample's number of valid keys under a boolean key mask (``[B, N]`` or ``[B, 1, 1,
    N]``, True = attend) when in every sample they are its first ones (the counts may differ
    between samples); else None. The mask is read on the host once per mask tensor: a model
    hands every block the same one, so once a forward. None without a read where the counts
    cannot be used: in a compiled or captured graph, and under context parallelism (keys split
    over ranks)."""
    if (mask.dtype != torch.bool or mask.dim() not in (2, 4) or mask.shape[1:-1].numel() != 1
            or not host_readable(mask, processor._parallel_config)):
        return None
    return _prefix_counts(mask)


def _prefix_counts(mask: Tensor) -> Optional[Tuple[int, ...]]:
    """:func:`valid_key_counts` without its checks: one host read per mask tensor."""
    def read() -> Optional[Tuple[int, ...]]:
        valid = mask.reshape(mask.shape[0], -1).bool()
        counts = valid.sum(1)
        positions = torch.arange(valid.shape[1], device=valid.device)
        prefix = (valid == (positions < counts[:, None])).all()
        *values, is_prefix = torch.cat([counts, prefix.long().reshape(1)]).tolist()
        return tuple(values) if is_prefix else None

    return derived_once(mask, "valid key counts", read)


def valid_key_prefix(processor: FusedAttnProcessor, mask: Tensor) -> Optional[int]:
    """How many keys a boolean key mask lets through when, in every sample, they are the same
    first ones (:func:`valid_key_counts`, all equal and not zero); else None. Attention over that
    prefix needs no mask, so SDPA runs its unmasked kernels, where a mask (even all True) keeps
    it on the masked one."""
    counts = valid_key_counts(processor, mask)
    return counts[0] if counts and min(counts) == max(counts) > 0 else None


def attend(processor: FusedAttnProcessor, query: Tensor, key: Tensor, value: Tensor,
           valid_keys: Optional[int], key_mask: Optional[Tensor]) -> Tensor:
    """``dispatch_attention_fn`` as diffusers calls it (the processor's backend and parallel
    config), over the first ``valid_keys`` keys unmasked when that count is known, else over
    all keys with ``key_mask``."""
    if valid_keys is not None:
        key, value, key_mask = key[:, :valid_keys], value[:, :valid_keys], None
    return dispatch_attention_fn(query, key, value, attn_mask=key_mask, dropout_p=0.0,
                                 is_causal=False, backend=processor._attention_backend,
                                 parallel_config=processor._parallel_config)


def stream_qkv(attn: torch.nn.Module, x: Tensor, context: bool = False):
    """q, k, v ``[B, S, H, D]`` of one stream of a diffusers ``Attention``: its own projections,
    or (``context``) the added ones of the text stream. The head count follows the projection's
    width (a column-sharded projection holds fewer heads)."""
    head_dim = attn.inner_dim // attn.heads
    projections = ((attn.add_q_proj, attn.add_k_proj, attn.add_v_proj) if context
                   else (attn.to_q, attn.to_k, attn.to_v))
    return tuple(p(x).unflatten(-1, (-1, head_dim)) for p in projections)


def norm_rope(q: Tensor, k: Tensor, norm_q: Optional[torch.nn.Module],
              norm_k: Optional[torch.nn.Module], rotary: Optional[Tuple[Tensor, Tensor]],
              upcast: bool = False):
    """Per-head RMSNorm of q and k (``[B, S, H, D]``; modules ``norm_q``/``norm_k``, or None
    for none), then diffusers' interleaved RoPE with its ``(cos, sin)`` ``[S, D]`` tables
    (``apply_rotary_emb(..., sequence_dim=1)``), q and k in one launch. ``upcast``: the model
    normalizes and rotates ``q.float()`` / ``k.float()`` and casts the result back to q's dtype
    (FLUX.3), which is what the fused op computes; only the eager fallback differs."""
    cos, sin = rotary if rotary is not None else (None, None)
    if cos is not None and (cos.dim() != 2 or sin.dim() != 2):
        return _eager_norm_rope(q, k, norm_q, norm_k, rotary, upcast)
    if norm_q is None and norm_k is None:
        if cos is not None and fusable(q, cos, sin, like_x=(k,)):
            return fb.rope(rows(q), rows(k), cos, sin, interleaved=True)
        return _eager_norm_rope(q, k, norm_q, norm_k, rotary, upcast)
    pq = rms_params(norm_q, q) if norm_q is not None else None
    pk = rms_params(norm_k, k) if norm_k is not None else None
    if pq is None or pk is None or pq[1] != pk[1] or not fusable(q, pq[0], pk[0], cos, sin,
                                                                  like_x=(k,)):
        return _eager_norm_rope(q, k, norm_q, norm_k, rotary, upcast)
    q, k = rows(q), rows(k)
    if cos is None:
        return fb.rms_norm(q, pq[0], pq[1]), fb.rms_norm(k, pk[0], pk[1])
    return fb.qk_norm_rope(q, k, pq[0], pk[0], cos, sin, pq[1], interleaved=True)


# How RoPE tables index the q/k of attention whose q/k norm spans all heads of a token:
# "flat": interleaved, a frequency per channel of the flat [B, S, H * D] q/k ([B or 1, S, H * D]
# tables: LTX-Video, LTX-2); "heads": interleaved, [.., S, 1, D] tables shared by the heads of
# [B, S, H, D] q/k (Wan); "split": each head's pairs (j, j + D/2) with per-head tables
# [B, H, S, D/2] (LTX-2's ``apply_split_rotary_emb``).
ROPE_LAYOUTS = ("flat", "heads", "split")


def rotary_fits(layout: str, heads: int, *rotaries: Optional[Tuple[Tensor, Tensor]]) -> bool:
    """Can :func:`qk_norm_rope_across_heads` take these (cos, sin) tables (None: no RoPE)? Split
    tables must hold one half-head table per head of the attention."""
    for rotary in rotaries:
        if rotary is None:
            continue
        cos, sin = rotary
        if cos.shape != sin.shape:
            return False
        if layout == "split" and (cos.dim() != 4 or cos.shape[1] != heads):
            return False
    return True


def split_rotary_rows(cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    """Per-head split tables ``[B, H, S, D/2]`` as the non-interleaved rotary's rows
    ``[B, S * H, D]`` (each half written twice: pair j is channels j and j + D/2), for q/k viewed
    as ``[B, S * H, 1, D]``: a table per head where the kernel reads one per row. Formed once
    per forward."""
    def rows_of(t):
        t = t.transpose(1, 2)                      # [B, S, H, D/2]
        return torch.cat([t, t], dim=-1).flatten(1, 2)
    return derived_once(cos, ("split rows", sin.shape), lambda: (rows_of(cos), rows_of(sin)))


# Under torch.compile the split RoPE is written in torch operations (fp32 math, rounded once, as
# the operator computes it) instead of the operator on rows from split_rotary_rows: a compiled
# block cannot reuse the rows the first eager layer forms, so each block would write them again,
# both tables at twice their size. For LTX-2 19B's 6144 video tokens that is about 1.2 GB a block
# (the self-attention's tables and the cross-modal ones). The compiler fuses the rotation into
# one pass that reads the tables as they are: LTX-2's patched + regional compile forward went
# from 703.4 ms ("kernel") to 677.5 on an H100 (bench/results/2026-12-05_h100_39a6971/), ahead
# of patched eager (688.6). "kernel" keeps the operator (for comparisons).
COMPILED_SPLIT_ROTARY = os.environ.get("FUSEBOX_COMPILED_SPLIT_ROTARY", "torch")
_check_choice("FUSEBOX_COMPILED_SPLIT_ROTARY", COMPILED_SPLIT_ROTARY, ("torch", "kernel"))


def _split_rope_in_torch(x: Optional[Tensor], heads: int, cos: Tensor, sin: Tensor) -> Optional[Tensor]:
    """:func:`_split_rope` of one flat ``[B, S, H * D]`` tensor (``[B, S, H, D]`` out) as the operator's torch form
    (``functional._rotary_in_torch``), the tables ``[B, H, S, D/2]`` read where they lie: each
    half written twice and laid out as x, views the compiler folds into one pass."""
    if x is None:
        return None
    c, s = (torch.cat([t, t], dim=-1).transpose(1, 2) for t in (cos, sin))
    return _rotary_in_torch(x.unflatten(2, (heads, -1)), c, s, "none", False, None, 0.0, 0.0,
                            False, False)


def _split_rope(q: Tensor, k: Optional[Tensor], heads: int, rotary) -> Tuple[Tensor, Tensor]:
    """Split RoPE of (already normed) flat q [and k] with per-head tables; [B, S, H, D] out."""
    if COMPILED_SPLIT_ROTARY == "torch" and torch.compiler.is_compiling():
        return _split_rope_in_torch(q, heads, *rotary), _split_rope_in_torch(k, heads, *rotary)
    cos, sin = split_rotary_rows(*rotary)

    def per_head_rows(x):
        return None if x is None else x.unflatten(2, (heads, -1)).flatten(1, 2).unsqueeze(2)

    q_out, k_out = fb.rope(per_head_rows(q), per_head_rows(k), cos, sin, interleaved=False)
    q_out = q_out.view(q.shape[0], q.shape[1], heads, -1)
    return q_out, None if k is None else k_out.view(k.shape[0], k.shape[1], heads, -1)


def qk_norm_rope_across_heads(query: Tensor, key: Tensor, heads: int, weight_q: Optional[Tensor],
                              weight_k: Optional[Tensor], eps: float,
                              rotary: Optional[Tuple[Tensor, Tensor]],
                              key_rotary: Optional[Tuple[Tensor, Tensor]] = None,
                              layout: str = "flat") -> Tuple[Tensor, Tensor]:
    """RMSNorm of q and k over all heads of a token (weights ``[H * D]``, or None), then RoPE
    with ``rotary`` laid out as ``layout`` says (:data:`ROPE_LAYOUTS`); q/k come flat
    ``[B, S, H * D]`` and leave ``[B, S, H, D]``. ``key_rotary``: k's own tables (k from another
    stream, of its own length); None: q's. Interleaved tables: the norm and the rotation in one
    launch, q and k together where they share tables. Split tables hold a table per head, which
    the rotary kernel reads per row: the norm first (``rms_norm``, rounding where diffusers
    rounds), then one rotary launch over heads as rows."""
    if rotary is None or layout == "split":
        query, key = fb.rms_norm(query, weight_q, eps), fb.rms_norm(key, weight_k, eps)
        if rotary is None:
            return query.unflatten(2, (heads, -1)), key.unflatten(2, (heads, -1))
        if key_rotary is None:
            return _split_rope(query, key, heads, rotary)
        return _split_rope(query, None, heads, rotary)[0], _split_rope(key, None, heads,
                                                                       key_rotary)[0]
    if layout == "heads":
        query, key = query.unflatten(2, (heads, -1)), key.unflatten(2, (heads, -1))
    if key_rotary is None:
        query, key = fb.qk_norm_rope(query, key, weight_q, weight_k, *rotary, eps=eps,
                                     across_heads=True, interleaved=True)
    else:
        query = fb.qk_norm_rope(query, None, weight_q, None, *rotary, eps=eps,
                                across_heads=True, interleaved=True)[0]
        key = fb.qk_norm_rope(key, None, weight_k, None, *key_rotary, eps=eps,
                              across_heads=True, interleaved=True)[0]
    if layout == "flat":
        query, key = query.unflatten(2, (heads, -1)), key.unflatten(2, (heads, -1))
    return query, key


def complex_rotary_tables(freqs: Tensor) -> Tuple[Tensor, Tensor]:
    """``(cos, sin)`` fp32 tables ``[..., D]`` of complex frequencies ``[..., D/2]``, for the
    models that rotate a head as complex numbers (``view_as_complex(x) * freqs``): pair j
    (channels 2j, 2j + 1) turns by the angle of ``freqs[..., j]``, which is the interleaved
    rotation with each pair's cos and sin written twice. Formed once per forward."""
    return derived_once(freqs, "interleaved tables", lambda: (
        freqs.real.repeat_interleave(2, dim=-1).float(),
        freqs.imag.repeat_interleave(2, dim=-1).float()))


def split_rotary(rotary: Optional[Tuple[Tensor, Tensor]], n: int):
    """The tables of the first ``n`` tokens and of the rest (views; None stays None)."""
    if rotary is None:
        return None, None
    cos, sin = rotary
    return (cos[:n], sin[:n]), (cos[n:], sin[n:])


# --------------------------------------------------------------------------- two-stream blocks


def stream_tail(x: Tensor, attn_output: Tensor, gate_msa: Tensor, norm2: torch.nn.Module,
                scale_mlp: Tensor, shift_mlp: Tensor, ff: torch.nn.Module,
                gate_mlp: Tensor) -> Tensor:
    """One stream of a double-stream block after its attention: ``h = x + gate_msa * attn``,
    then ``h + gate_mlp * ff(norm2(h) * (1 + scale_mlp) + shift_mlp)``. The terms are
    AdaLayerNormZero's ``[B, D]`` or already ``[B, 1, D]`` / ``[B, S, D]``."""
    def rows_of(t):
        return t.unsqueeze(1) if t.dim() == 2 else t
    normed, x = gated_add_norm(x, attn_output, rows_of(gate_msa), norm2, rows_of(scale_mlp),
                               rows_of(shift_mlp))
    return gated_add(x, ff(normed), rows_of(gate_mlp))


def context_stream_tail(block: torch.nn.Module, x: Tensor, attn_output: Tensor, gate_msa: Tensor,
                        scale_mlp: Tensor, shift_mlp: Tensor, gate_mlp: Tensor) -> Tensor:
    """The text stream's :func:`stream_tail` in FLUX's double-stream blocks (FLUX.1, Chroma,
    FLUX.2), through the block's ``norm2_context`` / ``ff_context``, clipped to fp16's range
    in fp16 as those blocks clip it."""
    x = stream_tail(x, attn_output, gate_msa, block.norm2_context, scale_mlp, shift_mlp,
                    block.ff_context, gate_mlp)
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


def single_stream_out(block: torch.nn.Module, residual: Tensor, attn_output: Tensor,
                      mlp_hidden_states: Tensor, gate: Tensor) -> Tensor:
    """``residual + gate * proj_out(cat(attn, mlp))`` of a single-stream block."""
    hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)
    return gated_add(residual, block.proj_out(hidden_states), gate.unsqueeze(1))


def patch_two_stream_model(model: torch.nn.Module, report, family: str, double_block,
                           single_block, patch_attention: Callable) -> None:
    """Patches the double-stream blocks (``double_block``: (class, fused forward)) and the
    single-stream blocks (``single_block``: likewise) of ``model``; every other module goes to
    ``patch_attention(path, module, report)``."""
    report.family = family
    for path, module in model.named_modules():
        cls = type(module)
        if cls is double_block[0]:
            replace_forward(module, double_block[1], f"{family} double block")
            report.add(path, module, "gated_residual_norm + gated_residual, both streams")
            mark_fused(module.norm2, "the block's gated_residual_norm")
            mark_fused(module.norm2_context, "the block's gated_residual_norm")
        elif cls is single_block[0]:
            replace_forward(module, single_block[1], f"{family} single block")
            report.add(path, module, "linear + gelu_tanh(+bias), gated_residual")
        else:
            patch_attention(path, module, report)


# --------------------------------------------------------------------------- text padding


class TextPadding:
    """What one model's fused attention processors know of the forward under way:
    ``all_valid`` is True while every text token the model hands its blocks is valid in every
    sample (its inputs were trimmed of padding), so attention needs no text mask. A plain
    attribute, read without a host sync; compiled blocks guard on it, so a flip recompiles them
    instead of running a graph traced for the other value. ``counts``, where the model counts
    (``trim_text_padding(count_mask=...)``) and the valid text of each sample is a prefix: an
    empty tensor of sizes ``[0, n_0, n_1, ...]`` (n_i: sample i's valid text tokens), its sizes
    marked unbacked, so a compiled graph neither guards on them nor specializes 0 and 1."""

    def __init__(self):
        self.all_valid = False
        self.counts: Optional[Tensor] = None


class PaddedStream(NamedTuple):
    mask: Tensor                # [B, N]; nonzero where a token is valid
    states: Tensor              # [B, N, ...]: the tokens
    never_empty: bool = False   # a stream the model cannot take without a token keeps one


class TrimmedText(NamedTuple):
    streams: List[Tuple[Tensor, Tensor]]   # (mask, states) of each stream
    all_valid: bool                        # every token left is valid in every sample
    flags: List[bool]                      # the values of the flags read alongside


def drop_padded_columns(streams: Sequence[PaddedStream], *flags: Tensor,
                        suffix_only: bool = False) -> TrimmedText:
    """Each stream without the columns (tokens) that are padding in every sample, its mask and
    states indexed alike (views where a prefix stays), with ``suffix_only`` only those after
    every sample's last valid token (for a model that counts valid tokens rather than reading
    where they are). One host read for all streams and the 0-d boolean tensors ``flags``."""
    device = streams[0].mask.device
    parts = []
    for stream in streams:
        valid = stream.mask.bool()
        parts += [valid.any(0), valid.all(0)]
    parts += [flag.reshape(1) for flag in flags]
    values = torch.cat([part.to(device) for part in parts]).tolist()

    trimmed, all_valid, at = [], True, 0
    for stream in streams:
        n = stream.mask.shape[1]
        used, full = values[at:at + n], values[at + n:at + 2 * n]
        at += 2 * n
        keep = [i for i in range(n) if used[i]]
        if suffix_only and keep:
            keep = list(range(keep[-1] + 1))
        if not keep and stream.never_empty and n:
            keep = [0]
        all_valid = all_valid and all(full[i] for i in keep)
        trimmed.append(_columns(stream, keep))
    return TrimmedText(trimmed, all_valid, [bool(v) for v in values[at:]])


def _columns(stream: PaddedStream, keep: List[int]) -> Tuple[Tensor, Tensor]:
    mask, states = stream.mask, stream.states
    if keep == list(range(len(keep))):
        return mask[:, :len(keep)], states[:, :len(keep)]
    index = torch.tensor(keep, device=mask.device)
    return mask.index_select(1, index), states.index_select(1, index.to(states.device))


def text_suffix_trim(states: str, mask: str) -> Callable[[Dict[str, Any]], Optional[bool]]:
    """The ``trim`` of :func:`trim_text_padding` for a model with one text stream, the inputs
    ``states`` and ``mask``, from which only the columns after every sample's last valid token may
    go (its text RoPE numbers columns, or its blocks count valid tokens rather than read where
    they are); one column always stays. None without a mask."""
    def trim(inputs: Dict[str, Any]) -> Optional[bool]:
        if inputs[states] is None or inputs[mask] is None:
            return None
        trimmed = drop_padded_columns([PaddedStream(inputs[mask], inputs[states], never_empty=True)],
                                      suffix_only=True)
        (inputs[mask], inputs[states]), = trimmed.streams
        return trimmed.all_valid
    return trim


TEXT_PADDING_ATTR = "_fusebox_text_padding"   # the model's TextPadding, while patched


def trim_text_padding(model: torch.nn.Module, names: Sequence[str],
                      trim: Callable[[Dict[str, Any]], Optional[bool]],
                      count_mask: Optional[str] = None) -> None:
    """Trims the text padding off ``model``'s inputs before each eager forward and tells the
    model's fused attention processors when none is left. A forward pre-hook hands ``trim`` the
    forward's arguments ``names`` (positional or keyword; absent ones as None); ``trim``
    replaces in that dict the ones it trims and returns whether every text token left is valid
    in every sample (None when it cannot tell: an input it needs is missing). In compiled or
    captured calls and under context parallelism the hook does nothing. A forward hook that
    also runs when the forward raises clears the processors' state, so no later call sees a
    stale one (a whole-model compile, where the pre-hook does nothing, reads it in its graph).
    ``count_mask`` names the trimmed input whose per-sample valid prefixes the hook counts
    (:attr:`TextPadding.counts`, read with the count the eager blocks read, so no read more).
    Patching again keeps the hooks and hands the state to the new processors."""
    state = model.__dict__.get(TEXT_PADDING_ATTR)
    if state is None:
        state = TextPadding()
        parameters = list(inspect.signature(type(model).forward).parameters)[1:]   # no self
        positions = {name: parameters.index(name) for name in names}
        trim_hook = model.register_forward_pre_hook(
            functools.partial(_trim_inputs, state, positions, trim, count_mask), with_kwargs=True)
        clear_hook = model.register_forward_hook(functools.partial(_clear, state),
                                                 always_call=True)
        model.__dict__[TEXT_PADDING_ATTR] = state
        add_undo(model, functools.partial(_remove_text_trim, model, trim_hook, clear_hook))
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if isinstance(processor, FusedAttnProcessor):
            processor.text_padding = state


def _context_parallel(model: torch.nn.Module):
    return getattr(getattr(model, "_parallel_config", None), "context_parallel_config", None)


def _trim_inputs(state: TextPadding, positions: Dict[str, int], trim, count_mask, model, args,
                 kwargs):
    if torch.compiler.is_compiling():     # before any other work, which a graph would trace
        return None
    inputs = {name: args[at] if at < len(args) else kwargs.get(name)
              for name, at in positions.items()}
    tensors = [t for t in inputs.values() if isinstance(t, Tensor)]
    if not tensors or not host_readable(tensors[0], _context_parallel(model)):
        return None
    all_valid = trim(inputs)
    if all_valid is None:
        return None
    args, kwargs = list(args), dict(kwargs)
    for name, at in positions.items():
        if at < len(args):
            args[at] = inputs[name]
        elif name in kwargs:
            kwargs[name] = inputs[name]
    state.all_valid = all_valid
    counts = None if all_valid or count_mask is None else _prefix_counts(inputs[count_mask])
    if counts is not None:
        # strides 0: a compiled graph guards on none that a size enters
        state.counts = torch.empty_strided((0,) + counts, (0,) * (len(counts) + 1))
        torch._dynamo.decorators.mark_unbacked(state.counts, list(range(1, len(counts) + 1)))
    return tuple(args), kwargs


def _clear(state: TextPadding, model, args, output) -> None:
    state.all_valid = False
    state.counts = None


def _remove_text_trim(model: torch.nn.Module, *hooks) -> None:
    for hook in hooks:
        hook.remove()
    model.__dict__.pop(TEXT_PADDING_ATTR, None)
