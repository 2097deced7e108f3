"""Independent float64 references of the fusebox operators, in plain torch.

Every function upcasts its inputs to float64 and returns a float64 result (no rounding),
except where the spec says an intermediate is rounded (`round_to`)."""

import math

import torch


def f64(t):
    return None if t is None else t.double()


def round_to(t, dtype):
    """Round a float64 tensor to `dtype` and back (an intermediate the model materializes)."""
    return t.to(dtype).double()


# --------------------------------------------------------------------------- norms


def affine(n, weight=None, bias=None, weight_offset=0.0):
    if weight is not None:
        n = n * (weight_offset + f64(weight))
    if bias is not None:
        n = n + f64(bias)
    return n


def rms_norm(x, weight=None, eps=1e-6, weight_offset=0.0, bias=None):
    x = f64(x)
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return affine(n, weight, bias, weight_offset)


def layer_norm(x, weight=None, bias=None, eps=1e-5, weight_offset=0.0):
    x = f64(x)
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    n = (x - mean) * torch.rsqrt(var + eps)
    return affine(n, weight, bias, weight_offset)


def norm(norm_type, x, weight=None, bias=None, eps=1e-6, weight_offset=0.0):
    if norm_type == "rms":
        return rms_norm(x, weight, eps, weight_offset, bias)
    if norm_type == "layer":
        return layer_norm(x, weight, bias, eps, weight_offset)
    raise ValueError(norm_type)


def modulate(n, scale=None, shift=None):
    """``n * (1 + scale) + shift``."""
    if scale is not None:
        n = n * (1 + f64(scale))
    if shift is not None:
        n = n + f64(shift)
    return n


def gated_residual(x, branch, gate=None):
    """``x + gate * branch`` (unrounded)."""
    b = f64(branch)
    if gate is not None:
        b = f64(gate) * b
    return f64(x) + b


def fused_add_rms_norm(x, residual, weight=None, eps=1e-6, weight_offset=0.0):
    """Returns (normed, h): h = x + residual rounded to x's dtype, normed from rounded h."""
    h = round_to(f64(x) + f64(residual), x.dtype)
    return rms_norm(h, weight, eps, weight_offset), h


def rms_norm_add(x, residual, weight=None, eps=1e-6, weight_offset=0.0):
    """residual + rms_norm(x), nothing rounded in between."""
    return f64(residual) + rms_norm(x, weight, eps, weight_offset)


def gated_residual_norm(x, branch, gate=None, scale=None, shift=None, weight=None, bias=None,
                        norm_type="layer", eps=1e-6, weight_offset=0.0):
    """Returns (out, h): h rounded to x's dtype, out computed from the rounded h."""
    h = round_to(gated_residual(x, branch, gate), x.dtype)
    out = modulate(norm(norm_type, h, weight, bias, eps, weight_offset), scale, shift)
    return out, h


# --------------------------------------------------------------------------- rotary


def _rotate(x, interleaved):
    """The partner of each channel with its sign: for pair (i, p), -x[p] at i and x[i] at p."""
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _table_for(x, t, heads_first):
    """Broadcast a cos/sin table ([S,R], [B,S,R] or 4-D) against x ([B,S,H,D], [B,H,S,D] or
    flat [B,S,W])."""
    t = f64(t)
    if x.dim() == 3 or t.dim() == 4:
        return t
    if t.dim() == 2:  # [S, R]
        return t if heads_first else t[:, None, :]
    return t[:, None] if heads_first else t[:, :, None]  # [B, S, R]


def rope(x, cos, sin, interleaved=False, heads_first=False):
    """out = x*cos + rotate(x)*sin on the first R channels (R = cos.shape[-1]); the rest pass
    through. Each channel uses its own table entry."""
    x = f64(x)
    r = cos.shape[-1]
    c, s = _table_for(x, cos, heads_first), _table_for(x, sin, heads_first)
    xr = x[..., :r]
    rotated = xr * c + _rotate(xr, interleaved) * s
    return torch.cat((rotated, x[..., r:]), dim=-1)


def rope_3d_angles(frames, height, width, axes_dim, theta=10000.0, offsets=(0, 0, 0)):
    """[S, R/2] angles of a frame-major video grid: section a holds pairs
    j < axes_dim[a]/2 turning by pos_a * theta**(-2j/axes_dim[a])."""
    s = torch.arange(frames * height * width, dtype=torch.float64)
    pos = (
        torch.div(s, height * width, rounding_mode="floor") + offsets[0],
        torch.remainder(torch.div(s, width, rounding_mode="floor"), height) + offsets[1],
        torch.remainder(s, width) + offsets[2],
    )
    angles = []
    for p, d in zip(pos, axes_dim):
        j = torch.arange(d // 2, dtype=torch.float64)
        inv_freq = torch.tensor(float(theta), dtype=torch.float64) ** (-2.0 * j / d)
        angles.append(p[:, None] * inv_freq[None, :])
    return torch.cat(angles, dim=-1)


def rope_table(angles, interleaved):
    """cos/sin [.., R] from [.., R/2] angles: interleaved pairs repeat each angle twice in a
    row; half-split pairs (i, i + R/2) use cat(angles, angles)."""
    if interleaved:
        full = angles.repeat_interleave(2, dim=-1)
    else:
        full = torch.cat((angles, angles), dim=-1)
    return full.cos(), full.sin()


def rope_3d(x, frames, height, width, axes_dim=None, theta=10000.0, offsets=(0, 0, 0),
            interleaved=True, heads_first=False):
    d = x.shape[-1]
    if axes_dim is None:
        hw = 2 * (d // 6)
        axes_dim = (d - 2 * hw, hw, hw)
    cos, sin = rope_table(rope_3d_angles(frames, height, width, axes_dim, theta, offsets),
                          interleaved)
    return rope(x, cos.to(x.device), sin.to(x.device), interleaved, heads_first)


def head_rms_norm(x, weight=None, eps=1e-6, across_heads=False, heads_first=False,
                  weight_offset=0.0):
    """RMS norm per head over D, or over all H*D channels of a token (across_heads)."""
    x = f64(x)
    if not across_heads or x.dim() == 3:
        return rms_norm(x, weight, eps, weight_offset)
    t = x.transpose(1, 2) if heads_first else x  # [B, S, H, D]
    n = rms_norm(t.flatten(-2), weight, eps, weight_offset).unflatten(-1, t.shape[-2:])
    return n.transpose(1, 2) if heads_first else n


def qk_norm_rope(x, weight, cos, sin, eps=1e-6, across_heads=False, interleaved=False,
                 heads_first=False, weight_offset=0.0):
    n = head_rms_norm(x, weight, eps, across_heads, heads_first, weight_offset)
    return rope(n, cos, sin, interleaved, heads_first)


# --------------------------------------------------------------------------- activations


def act(x, name):
    x = f64(x)
    if name == "silu":
        return x / (1 + torch.exp(-x))
    if name == "gelu":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))
    raise ValueError(name)


def gated_act(gate, up, name):
    return act(gate, name) * f64(up)


def gated_act_packed(x, name, gate_first=True):
    n = x.shape[-1] // 2
    a, b = x[..., :n], x[..., n:]
    gate, up = (a, b) if gate_first else (b, a)
    return gated_act(gate, up, name)


def bias_act(x, bias, name):
    x = f64(x)
    return act(x if bias is None else x + f64(bias), name)


# --------------------------------------------------------------------------- mixture of experts


def moe_combine(rows, index, weights):
    """out[n] = sum_k weights[n, k] * rows[index[n, k]]."""
    return (f64(rows)[index.long()] * f64(weights).unsqueeze(-1)).sum(1)


def moe_sort(index, num_experts):
    """(row_token, offsets, pair_row) of the pairs sorted by expert as transformers' grouped
    experts sort them (a stable sort of the flattened index), int64 on the CPU."""
    flat = index.cpu().long().reshape(-1)
    perm = torch.sort(flat, stable=True)[1]
    pair_row = torch.empty_like(perm)
    pair_row[perm] = torch.arange(perm.numel())
    offsets = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0)
    return perm // max(index.shape[1], 1), offsets, pair_row.view(index.shape)


def moe_topk(logits, top_k, score="softmax", bias=None, num_groups=1, topk_groups=1,
             renormalize=False, scale=1.0):
    """(weights, scores, choice) in float64: each token's scores (softmax or sigmoid), the
    choice scores (+ bias, -inf outside the topk_groups groups whose two largest choice scores
    sum highest), the top_k scores by choice in descending order of choice, divided by their sum
    where renormalize, times scale; with the whole scores and choice (to check which experts were
    chosen)."""
    x = f64(logits)
    scores = torch.softmax(x, dim=-1) if score == "softmax" else torch.sigmoid(x)
    choice = scores + (f64(bias) if bias is not None else 0)
    if num_groups > 1:
        grouped = choice.view(x.shape[0], num_groups, -1)
        group_rank = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_rank, dtype=torch.bool)
        keep.scatter_(1, group_rank.topk(topk_groups, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(x)
    top = scores.gather(-1, choice.topk(top_k, dim=-1).indices)
    if renormalize:
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
    return top * scale, scores, choice
