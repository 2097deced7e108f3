"""Public functional API of fusebox.

Every function here calls one registered operator (``torch.ops.fusebox.*``), so it runs in
eager mode, traces into ``torch.compile(fullgraph=True)`` graphs without breaks, and works
on CPU (reference implementation) and CUDA tensors alike.

Numerics: inputs are widened to fp32, everything is computed in fp32 and each output is
rounded once. Small operands (weights, biases, scale/shift/gate, cos/sin tables) may be fp32
or the input's dtype (cos and sin the same one). Strided views (last dimension contiguous) are
read in place, never copied.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import torch

from ._ops import ops

Tensor = torch.Tensor

_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
_NORMS = ("rms", "layer")
# the dtypes every operator takes (the patches fuse only these)
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"fusebox: {name} must be one of {list(choices)}; got {value!r}")


def has_unit_stride_rows(x: Tensor) -> bool:
    """Is ``x``'s last dimension contiguous, as the operators read rows?"""
    return x.dim() == 0 or x.shape[-1] <= 1 or x.stride(-1) == 1


def unit_stride_rows(x: Tensor) -> Tensor:
    """``x`` where its last dimension is contiguous, else a contiguous copy. The operators read
    strided views in place but need unit stride along a row; the drop-in module forwards
    (``fusebox.patch``, ``fusebox.layers``) take whatever the module they replace takes, e.g. a
    transposed view, which an eager norm would copy too."""
    return x if has_unit_stride_rows(x) else x.contiguous()


# --------------------------------------------------------------------------- normalization


def rms_norm(
    x: Tensor,
    weight: Optional[Tensor] = None,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * (weight_offset + weight)``.

    ``weight`` is optional ([D]); ``weight_offset=1`` gives Gemma's ``(1 + w)``.
    ``out_dtype`` (default: x's dtype) may be ``torch.float32``, as diffusers' RMSNorm
    returns when its weight is fp32.
    """
    return ops.rms_norm(x, weight, float(eps), float(weight_offset), out_dtype)


def fused_add_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Optional[Tensor] = None,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
) -> Tuple[Tensor, Tensor]:
    """``h = x + residual`` (rounded to x's dtype, as transformers does), then
    ``rms_norm(h)``. Returns ``(normed, h)``."""
    return ops.fused_add_rms_norm(x, residual, weight, float(eps), float(weight_offset))


def rms_norm_add(
    x: Tensor,
    residual: Tensor,
    weight: Optional[Tensor] = None,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
) -> Tensor:
    """``residual + rms_norm(x, weight)``: the residual add of a post-norm layer (OLMo-2's
    branches, Gemma2/3's post-feedforward norm) in one pass, rounded once to x's dtype.
    ``residual`` broadcasts against x as ``shift`` does in :func:`adaln`."""
    return ops.rms_norm_add(x, residual, weight, float(eps), float(weight_offset))


def layer_norm(
    x: Tensor,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """``(x - mean) * rsqrt(var + eps) * weight + bias`` with fp32 statistics and math.

    This is also the semantics of diffusers' ``FP32LayerNorm`` (fp32 math, output in the
    input dtype), whatever the dtype of the weight and bias."""
    return ops.layer_norm(x, weight, bias, float(eps), out_dtype)


def adaln(
    x: Tensor,
    scale: Tensor,
    shift: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    norm_type: str = "layer",
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    out_dtype: Optional[torch.dtype] = None,
    scale_table: Optional[Tensor] = None,
    shift_table: Optional[Tensor] = None,
) -> Tensor:
    """AdaLN modulation: ``norm(x) * (1 + scale) + shift``.

    ``norm_type`` is ``"layer"`` or ``"rms"``. ``scale``/``shift`` broadcast against x:
    ``[B, 1, D]`` per sample, ``[B, S, D]`` per token, or any strided view (a chunk of a
    ``[B, 6, D]`` modulation table) without copies.

    Split modulation: with ``scale_table`` (and ``shift_table`` where ``shift`` is given),
    ``[D]`` rows of a block's modulation table, fp32 or x's dtype, the terms are
    ``scale_table + scale`` and ``shift_table + shift``, added in fp32 as
    ``table.float() + temb`` would be, without writing the sum; ``scale``/``shift`` are then
    x's dtype (a per-token timestep projection, Wan 2.2 / SkyReels-V2)."""
    _check_choice("norm_type", norm_type, _NORMS)
    out, _ = ops.fused_norm(
        x, None, None, scale, shift, weight, bias, norm_type, float(eps), float(weight_offset),
        out_dtype, None, scale_table, shift_table,
    )
    return out


def gated_residual(x: Tensor, branch: Tensor, gate: Optional[Tensor] = None,
                   gate_table: Optional[Tensor] = None) -> Tensor:
    """``x + gate * branch`` (AdaLN-Zero's gated residual); ``gate`` broadcasts like
    ``scale`` in :func:`adaln` and may be fp32 (Wan) or x's dtype. With ``gate_table`` the
    gate is ``gate_table + gate``, split as in :func:`adaln`."""
    return ops.gated_residual(x, branch, gate, gate_table)


def gated_residual_norm(
    x: Tensor,
    branch: Tensor,
    gate: Optional[Tensor] = None,
    scale: Optional[Tensor] = None,
    shift: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    norm_type: str = "layer",
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    out_dtype: Optional[torch.dtype] = None,
    gate_table: Optional[Tensor] = None,
    scale_table: Optional[Tensor] = None,
    shift_table: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The DiT block boundary in one pass: ``h = x + gate * branch`` then
    ``out = norm(h) * (1 + scale) + shift``. Returns ``(out, h)``; ``h`` is the new
    residual stream (x's dtype). ``*_table``: split modulation, as in :func:`adaln`; every
    term given (gate, scale, shift) then has its table."""
    _check_choice("norm_type", norm_type, _NORMS)
    return ops.fused_norm(
        x, branch, gate, scale, shift, weight, bias, norm_type, float(eps),
        float(weight_offset), out_dtype, gate_table, scale_table, shift_table,
    )


# --------------------------------------------------------------------------- rotary


# Under torch.compile, the rotary of one token per sequence (a decode step) is written in torch
# operations instead of the operator, so the compiler can fuse it with what surrounds it: the
# cos/sin gather before it and the KV-cache write after it, which an opaque operator splits into
# launches of their own (bench/NOTES.md, Phi-2 and Qwen3-8B decode under CUDA graphs). Longer
# sequences keep the operator. "kernel" keeps the operator for every call (for comparisons).
COMPILED_ONE_TOKEN_ROTARY = os.environ.get("FUSEBOX_COMPILED_ONE_TOKEN_ROTARY", "torch")
_check_choice("FUSEBOX_COMPILED_ONE_TOKEN_ROTARY", COMPILED_ONE_TOKEN_ROTARY, ("torch", "kernel"))


def _one_token_under_compile(q: Tensor, heads_first: bool) -> bool:
    if COMPILED_ONE_TOKEN_ROTARY != "torch" or not torch.compiler.is_compiling():
        return False
    # (dynamo specializes sizes of 1, so this is decided once per graph)
    return q.dim() in (3, 4) and q.shape[2 if heads_first and q.dim() == 4 else 1] == 1


def _rotary_in_torch(x, cos, sin, norm, across_heads, weight, eps, weight_offset, interleaved,
                     heads_first):
    """The operator's result as torch operations (fp32 math, rounded once to x's dtype)."""
    y = x.float()
    if norm == "rms":
        across = across_heads and y.dim() == 4   # one norm over a token's heads
        tokens = (y.transpose(1, 2) if heads_first else y).flatten(-2) if across else y
        tokens = tokens * torch.rsqrt(tokens.pow(2).mean(-1, keepdim=True) + eps)
        if weight is not None:
            tokens = tokens * (weight.float() + weight_offset)
        if across:
            if heads_first:
                tokens = tokens.unflatten(-1, (y.shape[1], y.shape[3])).transpose(1, 2)
            else:
                tokens = tokens.unflatten(-1, y.shape[-2:])
        y = tokens

    def table(t):   # [S, R] / [B, S, R] / 4-D in x's layout, broadcast against x
        t = t.float()
        if x.dim() == 3 or t.dim() == 4:
            return t
        if t.dim() == 2:
            return t if heads_first else t.unsqueeze(1)
        return t.unsqueeze(1) if heads_first else t.unsqueeze(2)

    r = cos.shape[-1]
    y_r = y[..., :r]
    # each pair's partner: its other element, the first negated, as a flip (an index the compiler
    # folds into the pass; a cat of the halves was a copy of its own in a compiled LTX-2 block).
    # Both callers trace this under torch.compile, where the sign tensor is a constant.
    pairs = y_r.unflatten(-1, (-1, 2) if interleaved else (2, -1))
    sign = torch.tensor([-1.0, 1.0], device=x.device)
    partner = (pairs.flip(-1 if interleaved else -2)
               * (sign if interleaved else sign.view(2, 1))).flatten(-2)
    rotated = y_r * table(cos) + partner * table(sin)
    if r < y.shape[-1]:
        rotated = torch.cat((rotated, y[..., r:]), dim=-1)
    return rotated.to(x.dtype)


def _rotary(
    q, k, cos, sin, grid, axes_dim, theta, offsets, norm, across_heads, q_weight, k_weight,
    eps, weight_offset, interleaved, heads_first,
):
    if grid is None and _one_token_under_compile(q, heads_first):
        parts = [_rotary_in_torch(x, cos, sin, norm, across_heads, w, float(eps),
                                  float(weight_offset), bool(interleaved), bool(heads_first))
                 if x is not None else None for x, w in ((q, q_weight), (k, k_weight))]
        return parts[0], parts[1]
    q_out, k_out = ops.rotary(
        q, k, cos, sin, grid, axes_dim, float(theta), offsets, norm, bool(across_heads),
        q_weight, k_weight, float(eps), float(weight_offset), bool(interleaved),
        bool(heads_first),
    )
    return q_out, (k_out if k is not None else None)


def rope(
    q: Tensor,
    k: Optional[Tensor],
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    heads_first: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Rotary embedding of q and k in one launch.

    Layouts: ``[B, S, H, D]`` (default), ``[B, H, S, D]`` with ``heads_first=True``, or a
    flat ``[B, S, W]`` (one "head" of width W, as LTX-Video applies it). k may have a
    different head count (GQA) or be None.

    ``cos``/``sin``: ``[S, R]``, ``[B, S, R]``, or 4-D in q's layout with a size-1 head dim
    (``[B, 1, S, R]`` as transformers unsqueezes them). ``R <= D``: channels past R pass
    through (partial rotary).

    ``interleaved=False`` rotates pairs ``(i, i + R/2)`` (transformers ``rotate_half``);
    ``interleaved=True`` rotates ``(2i, 2i + 1)`` (diffusers ``apply_rotary_emb``).
    """
    return _rotary(q, k, cos, sin, None, None, 0.0, None, "none", False, None, None, 0.0, 0.0,
                   interleaved, heads_first)


def rope_3d(
    q: Tensor,
    k: Optional[Tensor],
    num_frames: int,
    height: int,
    width: int,
    axes_dim: Optional[Sequence[int]] = None,
    theta: float = 10000.0,
    offsets: Sequence[int] = (0, 0, 0),
    interleaved: bool = True,
    heads_first: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    """3-D video rotary embedding with the frequencies computed in the kernel (no table).

    Tokens are ordered frame-major: token s sits at ``(s // (H*W), (s // W) % H, s % W)``
    plus ``offsets``. Head channels split into ``axes_dim`` sections (default: Wan's split,
    ``d - 2*2*(d//6)`` for time and ``2*(d//6)`` each for height and width); in section a,
    pair j turns by ``pos_a * theta ** (-2j / axes_dim[a])``."""
    d = q.shape[-1]
    if axes_dim is None:
        hw = 2 * (d // 6)
        axes_dim = (d - 2 * hw, hw, hw)
    return _rotary(q, k, None, None, [int(num_frames), int(height), int(width)],
                   [int(a) for a in axes_dim], theta, [int(o) for o in offsets], "none", False,
                   None, None, 0.0, 0.0, interleaved, heads_first)


def qk_norm_rope(
    q: Tensor,
    k: Optional[Tensor],
    q_weight: Optional[Tensor],
    k_weight: Optional[Tensor],
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
    across_heads: bool = False,
    interleaved: bool = False,
    heads_first: bool = False,
    weight_offset: float = 0.0,
) -> Tuple[Tensor, Optional[Tensor]]:
    """RMSNorm of q and k followed by rotary embedding, both tensors in one launch.

    ``across_heads=False``: one norm per head over D channels (Qwen3, Gemma3, Flux,
    HunyuanVideo), weights ``[D]``. ``across_heads=True``: one norm over all heads of a token
    (LTX-Video, Wan), weights ``[H * D]``. Other arguments as in :func:`rope`."""
    return _rotary(q, k, cos, sin, None, None, 0.0, None, "rms", across_heads, q_weight,
                   k_weight, eps, weight_offset, interleaved, heads_first)


# --------------------------------------------------------------------------- activations


def gated_activation(gate: Tensor, up: Tensor, activation: str = "silu") -> Tensor:
    """``act(gate) * up`` for separate gate/up tensors (Llama's gate_proj/up_proj).
    ``activation`` is ``"silu"``, ``"gelu_tanh"`` or ``"gelu"`` (erf)."""
    _check_choice("activation", activation, _ACTIVATIONS)
    return ops.gated_act(gate, up, activation)


def gated_activation_packed(x: Tensor, activation: str = "silu", gate_first: bool = True) -> Tensor:
    """``act(gate) * up`` with gate and up packed in the last dimension of one tensor
    ``[..., 2N]``. ``gate_first=True`` is vLLM's layout (gate = first half);
    diffusers' GEGLU/SwiGLU put the gate second (``gate_first=False``)."""
    _check_choice("activation", activation, _ACTIVATIONS)
    return ops.gated_act_packed(x, activation, bool(gate_first))


def activation(x: Tensor, bias: Optional[Tensor] = None, activation: str = "gelu_tanh") -> Tensor:
    """``act(x + bias)``; ``bias`` optional ``[N]``."""
    _check_choice("activation", activation, _ACTIVATIONS)
    return ops.act(x, bias, activation)


def gelu_tanh(x: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``gelu(x + bias, approximate="tanh")``: the LTX-Video/Flux/Wan FFN activation."""
    return ops.act(x, bias, "gelu_tanh")


def silu_and_mul(x: Tensor) -> Tensor:
    """vLLM's ``silu_and_mul``: ``silu(x[..., :N]) * x[..., N:]``."""
    return ops.gated_act_packed(x, "silu", True)


def swiglu(gate: Tensor, up: Optional[Tensor] = None) -> Tensor:
    """``silu(gate) * up``. With ``up=None``, ``gate`` is a packed ``[..., 2N]`` tensor whose
    second half is the gate (diffusers ``SwiGLU`` layout)."""
    if up is None:
        return ops.gated_act_packed(gate, "silu", False)
    return ops.gated_act(gate, up, "silu")


def geglu(gate: Tensor, up: Optional[Tensor] = None, approximate: str = "tanh") -> Tensor:
    """``gelu(gate) * up`` (``approximate="tanh"`` or ``"none"``). With ``up=None``,
    ``gate`` is packed ``[..., 2N]`` with the gate second (diffusers ``GEGLU`` layout, which
    uses ``approximate="none"``)."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"fusebox: approximate must be 'tanh' or 'none'; got {approximate!r}")
    act = "gelu_tanh" if approximate == "tanh" else "gelu"
    if up is None:
        return ops.gated_act_packed(gate, act, False)
    return ops.gated_act(gate, up, act)


# --------------------------------------------------------------------------- mixture of experts


def moe_combine(rows: Tensor, index: Tensor, weights: Tensor) -> Tensor:
    """The combine step of a mixture-of-experts layer: ``out[n] = sum_k weights[n, k] *
    rows[index[n, k]]``, the values of ``(rows[index] * weights[..., None]).sum(1)`` in
    ``rows``' dtype (each product rounded to its dtype, fp32 or ``rows``', the sum accumulated in
    fp32), without the gathered, weighted rows in memory.

    ``rows`` ``[M, H]`` holds the experts' output rows (any row stride), ``index`` ``[N, K]``
    (int32 or int64) names each token's K rows, ``weights`` ``[N, K]`` (fp32 or ``rows``'
    dtype) their routing weights. An index outside ``[0, M)`` raises on the CPU and turns that
    token's row to NaN on CUDA (checking it there would wait for the GPU)."""
    return ops.moe_combine(rows, index, weights)


def moe_topk(logits: Tensor, top_k: int, score: str = "softmax", bias: Optional[Tensor] = None,
             num_groups: int = 1, topk_groups: int = 1, renormalize: bool = False, scale: float = 1.0,
             out_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
    """The router of a mixture-of-experts layer after its logits, in one launch. Returns
    ``(weights, index)``, ``[N, top_k]``: weights in ``out_dtype`` (fp32 by default, or
    ``logits``' dtype), index int64.

    - ``score``: ``"softmax"`` over each token's experts (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2)
      or each logit's ``"sigmoid"`` (DeepSeek-V3, Kimi K2, GLM-4.5), in fp32;
    - the experts are chosen by ``score + bias`` (``bias`` ``[E]``, optional: DeepSeek-V3's
      ``e_score_correction_bias``), ``top_k`` of them in descending order, of equal ones the lower
      expert first; with ``num_groups`` > 1 only from the ``topk_groups`` groups of consecutive
      experts whose two largest choice scores sum highest;
    - the weights are the chosen scores (without the bias), divided by their sum + 1e-20 where
      ``renormalize``, times ``scale``.

    The values of transformers' routers up to the order of the fp32 sums and of equal scores
    (``torch.topk`` leaves both open). ``logits`` ``[N, E]``: E <= 1024, ``top_k`` <= min(E, 32),
    ``num_groups`` <= 32."""
    return ops.moe_topk(logits, top_k, score, bias, num_groups, topk_groups, renormalize, scale,
                        out_dtype)


def moe_sort(index: Tensor, num_experts: int) -> Tuple[Tensor, Tensor, Tensor]:
    """The dispatch step of a mixture-of-experts layer in one launch (two, over up to 64 blocks,
    above 512 pairs): the ``(token, k)`` pairs of ``index`` ``[N, K]`` (each pair's
    expert, int32 or int64) sorted by expert, stably, for grouped GEMMs over each expert's rows.
    ``num_experts`` <= 4009 on CUDA. Returns int32 ``(row_token, offsets, pair_row)``:

    - ``row_token`` ``[N * K]``: the token each sorted row reads (``x[row_token]`` are the rows);
    - ``offsets`` ``[num_experts]``: where each expert's rows end (``torch._grouped_mm``'s
      ``offs``, the cumulative count of each expert's pairs);
    - ``pair_row`` ``[N, K]``: each pair's sorted row, the ``index`` :func:`moe_combine` takes.

    The same as ``perm = torch.sort(index.flatten(), stable=True)[1]``: ``row_token = perm //
    K``, ``offsets = cumsum(bincount(index))`` and ``pair_row`` the inverse of ``perm``. An expert
    outside ``[0, num_experts)`` raises on the CPU; on CUDA (checking would wait for the GPU) its
    pair goes after every expert's rows and its ``pair_row`` is -1, so :func:`moe_combine` writes
    NaN over that token's row."""
    return ops.moe_sort(index, num_experts)


# --------------------------------------------------------------------------- seed-compatible names


def rmsnorm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6) -> Tensor:
    """Alias of :func:`rms_norm`."""
    return rms_norm(x, weight, eps)


def rmsnorm_residual(
    x: Tensor, residual: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6
) -> Tuple[Tensor, Tensor]:
    """Alias of :func:`fused_add_rms_norm`: returns ``(normed, x + residual)``."""
    return fused_add_rms_norm(x, residual, weight, eps)


def rope_1d(q, k, cos, sin, interleaved: bool = False, heads_first: bool = False):
    """Alias of :func:`rope`."""
    return rope(q, k, cos, sin, interleaved=interleaved, heads_first=heads_first)


def adaln_rmsnorm(x, scale, shift=None, weight=None, eps: float = 1e-6):
    """``rms_norm(x, weight) * (1 + scale) + shift``."""
    return adaln(x, scale, shift, weight, None, "rms", eps)


def adaln_layernorm(x, scale, shift=None, weight=None, bias=None, eps: float = 1e-6):
    """``layer_norm(x, weight, bias) * (1 + scale) + shift``."""
    return adaln(x, scale, shift, weight, bias, "layer", eps)


def adaln_zero(x, branch, gate, scale=None, shift=None, norm_type: str = "layer",
               eps: float = 1e-6, weight=None, bias=None):
    """AdaLN-Zero residual: ``h = x + gate * branch``. With ``scale`` given, also returns the
    next block input ``norm(h) * (1 + scale) + shift`` as ``(h, out)``."""
    if scale is None and shift is None:
        return gated_residual(x, branch, gate)
    out, h = gated_residual_norm(x, branch, gate, scale, shift, weight, bias, norm_type, eps)
    return h, out
