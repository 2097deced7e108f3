"""Shape-only (fake) implementations, so torch.compile and FakeTensor tracing can run the
operators without data. Each mirrors the output allocation of the C++ implementation."""

import functools

import torch
from torch.library import register_fake as _register_fake

from . import _inductor
from . import _ops  # noqa: F401  (loads the operator library first)


def register_fake(qualname: str):
    """torch.library.register_fake, also recording the operator for the inductor fallbacks
    (see _inductor.py), which every fake call registers once inductor is loaded."""
    _inductor.OP_NAMES.append(qualname.split("::", 1)[1])

    def decorate(fn):
        @functools.wraps(fn)
        def fake(*args, **kwargs):
            _inductor.register_fallbacks()
            return fn(*args, **kwargs)

        _register_fake(qualname)(fake)
        return fn

    return decorate


def _like(x, dtype=None):
    return x.new_empty(x.shape, dtype=dtype if dtype is not None else x.dtype)


@register_fake("fusebox::rms_norm")
def _rms_norm(x, weight, eps, weight_offset, out_dtype):
    return _like(x, out_dtype)


@register_fake("fusebox::layer_norm")
def _layer_norm(x, weight, bias, eps, out_dtype):
    return _like(x, out_dtype)


@register_fake("fusebox::fused_add_rms_norm")
def _fused_add_rms_norm(x, residual, weight, eps, weight_offset):
    return _like(x), _like(x)


@register_fake("fusebox::rms_norm_add")
def _rms_norm_add(x, residual, weight, eps, weight_offset):
    return _like(x)


@register_fake("fusebox::fused_norm")
def _fused_norm(x, branch, gate, scale, shift, weight, bias, norm_type, eps, weight_offset,
                out_dtype, gate_table=None, scale_table=None, shift_table=None):
    h = _like(x) if branch is not None else x.new_empty((0,))
    return _like(x, out_dtype), h


@register_fake("fusebox::gated_residual")
def _gated_residual(x, branch, gate, gate_table=None):
    return _like(x)


@register_fake("fusebox::rotary")
def _rotary(q, k, cos, sin, grid, axes_dim, theta, offsets, norm, across_heads, q_weight,
            k_weight, eps, weight_offset, interleaved, heads_first):
    return _like(q), (_like(k) if k is not None else q.new_empty((0,)))


@register_fake("fusebox::gated_act")
def _gated_act(gate, up, act):
    return _like(gate)


@register_fake("fusebox::gated_act_packed")
def _gated_act_packed(x, act, gate_first):
    torch._check(x.shape[-1] % 2 == 0, lambda: "fusebox: x's last dimension must be even")
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@register_fake("fusebox::act")
def _act(x, bias, act):
    return _like(x)


@register_fake("fusebox::moe_combine")
def _moe_combine(rows, index, weights):
    torch._check(rows.dim() == 2, lambda: "fusebox: rows must be a 2-D tensor [rows, hidden]")
    torch._check(index.dim() == 2, lambda: "fusebox: index must be a 2-D tensor [tokens, top_k]")
    return rows.new_empty((index.shape[0], rows.shape[1]))


@register_fake("fusebox::moe_sort")
def _moe_sort(index, num_experts):
    torch._check(index.dim() == 2, lambda: "fusebox: index must be a 2-D tensor [tokens, top_k]")
    torch._check(num_experts >= 1, lambda: "fusebox: num_experts must be at least 1")
    return (index.new_empty((index.numel(),), dtype=torch.int32),
            index.new_empty((num_experts,), dtype=torch.int32),
            index.new_empty(index.shape, dtype=torch.int32))


@register_fake("fusebox::moe_topk")
def _moe_topk(logits, top_k, score, bias, num_groups, topk_groups, renormalize, scale, out_dtype):
    torch._check(logits.dim() == 2, lambda: "fusebox: logits must be a 2-D tensor [tokens, experts]")
    shape = (logits.shape[0], top_k)
    return (logits.new_empty(shape, dtype=out_dtype or torch.float32),
            logits.new_empty(shape, dtype=torch.int64))
