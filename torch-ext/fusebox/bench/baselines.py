"""What users run today, written out as plain torch code: the eager chains of the Hugging Face
``transformers`` / ``diffusers`` modules (so no diffusers install is needed), rotary tables built
the way those models build them, and thin adapters over Liger-Kernel's functional API.

Every function returns its outputs in the same logical layout as the matching fusebox call
(rope outputs as ``[B, S, H, D]``), so results can be compared element by element.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


# --------------------------------------------------------------------------- norms


def llama_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers ``LlamaRMSNorm`` / ``Qwen3RMSNorm`` forward: fp32 statistics, cast to the
    input dtype before the weight multiply."""
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(dtype)


def t5_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers ``Olmo2RMSNorm`` (T5's formula): fp32 statistics, the weight applied in
    fp32, one cast to the input dtype."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(dtype)


def diffusers_rms_norm(x: Tensor, eps: float) -> Tensor:
    """diffusers ``RMSNorm(elementwise_affine=False)`` forward (weight is None): the product
    with the fp32 rsqrt promotes to fp32, then the result is cast back."""
    dtype = x.dtype
    var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    h = x * torch.rsqrt(var + eps)
    return h.to(dtype)


def layer_norm_nn(x: Tensor, eps: float, weight: Optional[Tensor] = None,
                  bias: Optional[Tensor] = None) -> Tensor:
    """``nn.LayerNorm`` forward (diffusers' ``LayerNorm`` is the same class)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def layer_norm_fp32(x: Tensor, eps: float, weight: Optional[Tensor] = None,
                    bias: Optional[Tensor] = None) -> Tensor:
    """diffusers ``FP32LayerNorm`` forward (Wan): fp32 math, output in the input dtype."""
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


def modulate(n: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """``norm(x) * (1 + scale) + shift`` as LTX / PixArt / Flux write it."""
    return n * (1 + scale) + shift


def adaln_eager(x: Tensor, scale: Tensor, shift: Tensor, norm: str, eps: float,
                fp32: bool) -> Tensor:
    """The AdaLN chains of the DiT blocks.

    rms (LTX-Video): ``norm1(x) * (1 + scale_msa) + shift_msa`` with diffusers RMSNorm, no weight.
    layer (Flux/PixArt ``AdaLayerNormZero``): ``LayerNorm(x) * (1 + scale) + shift``.
    layer + fp32 (Wan): ``(FP32LayerNorm(x.float()) * (1 + scale) + shift).type_as(x)``.
    """
    if fp32:
        if norm == "rms":
            n = diffusers_rms_norm(x.float(), eps)
        else:
            n = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps)
        return modulate(n, scale, shift).type_as(x)
    n = diffusers_rms_norm(x, eps) if norm == "rms" else layer_norm_nn(x, eps)
    return modulate(n, scale, shift)


def gated_residual_eager(x: Tensor, branch: Tensor, gate: Tensor, fp32: bool) -> Tensor:
    """``x + branch * gate`` (LTX/Flux); Wan: ``(x.float() + branch.float() * gate).type_as(x)``."""
    if fp32:
        return (x.float() + branch.float() * gate).type_as(x)
    return x + branch * gate


# --------------------------------------------------------------------------- rotary


def rotate_half(x: Tensor) -> Tensor:
    """transformers ``rotate_half``."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                            unsqueeze_dim: int = 1):
    """transformers ``apply_rotary_pos_emb`` (Llama/Qwen/Mistral): q, k ``[B, H, S, D]``,
    cos/sin ``[B, S, D]`` in the model dtype; math in the model dtype."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def diffusers_apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """diffusers ``apply_rotary_emb(use_real=True, use_real_unbind_dim=-1)`` (Flux, Hunyuan,
    and LTX's own copy for the flat ``[B, S, H*D]`` q/k): interleaved pairs, fp32 math.

    cos/sin: ``[S, D]`` (broadcast as ``[None, S, None, D]``, sequence_dim=1) or already in
    x's rank (LTX: ``[B, S, W]``)."""
    if cos.dim() != x.dim():
        cos = cos[None, :, None, :]
        sin = sin[None, :, None, :]
    x_real, x_imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(-2)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def wan_apply_rotary_emb(x: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """The rotary function inside diffusers' ``WanAttnProcessor``: x ``[B, S, H, D]``,
    freqs ``[1, S, 1, D]`` fp32 with each frequency duplicated in adjacent pairs."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def half_split_table(batch: int, seq: int, dim: int, theta: float, dtype: torch.dtype,
                     device) -> tuple:
    """cos/sin ``[B, S, D]`` as transformers' ``*RotaryEmbedding`` returns them:
    ``cat(freqs, freqs)``, computed in fp32, cast to the model dtype."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    pos = torch.arange(seq, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(dtype).expand(batch, seq, dim).contiguous()
    sin = emb.sin().to(dtype).expand(batch, seq, dim).contiguous()
    return cos, sin


def _pairs(angles: Tensor) -> tuple:
    """cos/sin of ``angles [..., R/2]`` with each value repeated for both members of a pair
    (diffusers ``repeat_interleave_real=True``), fp32."""
    return (angles.cos().repeat_interleave(2, dim=-1).float(),
            angles.sin().repeat_interleave(2, dim=-1).float())


def axes_table(positions: Sequence[Tensor], axes_dim: Sequence[int], theta: float) -> tuple:
    """Per-axis ``get_1d_rotary_pos_embed`` concatenated (Flux ``FluxPosEmbed``, Wan
    ``WanRotaryPosEmbed``): positions ``[S]`` per axis; returns cos/sin ``[S, sum(axes_dim)]``
    fp32, interleaved pairs. Frequencies in float64 as the models compute them."""
    parts = []
    for pos, d in zip(positions, axes_dim):
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=pos.device) / d))
        parts.append(torch.outer(pos.to(torch.float64), inv))
    return _pairs(torch.cat(parts, dim=-1))


def video_positions(frames: int, height: int, width: int, device) -> list:
    """Frame-major token order: token s sits at (s // (H*W), (s // W) % H, s % W)."""
    s = torch.arange(frames * height * width, device=device)
    return [s // (height * width), (s // width) % height, s % width]


def wan_axes_dim(head_dim: int) -> tuple:
    """Wan's split of a head into time / height / width sections."""
    hw = 2 * (head_dim // 6)
    return (head_dim - 2 * hw, hw, hw)


def flux_table(seq: int, device, text_tokens: int = 512, theta: float = 10000.0) -> tuple:
    """Flux's ``[S, 128]`` table: text ids all zero, image ids ``[0, row, col]`` on a square
    grid, axes (16, 56, 56)."""
    text_tokens = min(text_tokens, seq // 2)
    img = seq - text_tokens
    side = max(1, int(round(math.sqrt(max(img, 1)))))
    s = torch.arange(img, device=device)
    zeros = torch.zeros(text_tokens, dtype=torch.long, device=device)
    pos = [torch.cat([zeros, torch.zeros_like(s)]),
           torch.cat([zeros, s // side]),
           torch.cat([zeros, s % side])]
    return axes_table(pos, (16, 56, 56), theta)


def random_pair_table(shape: Sequence[int], device, generator=None) -> tuple:
    """An fp32 table of the LTX kind (per token and channel, interleaved pairs) from random
    angles: ``shape[-1]`` channels."""
    angles = torch.rand(*shape[:-1], shape[-1] // 2, device=device, generator=generator,
                        dtype=torch.float32) * (2 * math.pi)
    return _pairs(angles)


# --------------------------------------------------------------------------- activations


def swiglu_eager(gate: Tensor, up: Tensor) -> Tensor:
    """``act_fn(gate_proj(x)) * up_proj(x)`` of LlamaMLP/Qwen3MLP with silu."""
    return F.silu(gate) * up


def geglu_tanh_eager(gate: Tensor, up: Tensor) -> Tensor:
    """Gemma3MLP: ``gelu_pytorch_tanh(gate) * up``."""
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_bias_eager(x: Tensor, bias: Tensor) -> Tensor:
    """diffusers ``GELU(approximate="tanh")`` with the projection's bias added separately."""
    return F.gelu(x + bias, approximate="tanh")


# --------------------------------------------------------------------------- Liger


def import_liger():
    """``liger_kernel.transformers.functional`` or raise ImportError with the reason."""
    try:
        import liger_kernel.transformers.functional as lk  # type: ignore
    except Exception as e:  # noqa: BLE001 - any failure means "absent"
        raise ImportError(f"liger_kernel not importable ({type(e).__name__}: {e})") from e
    return lk


def liger_rope_bshd(lk, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor):
    """Liger's rope takes HF's ``[B, H, S, D]`` views of ``[B, S, H, D]`` storage and rotates
    in place; returns ``[B, S, H, D]`` views."""
    qo, ko = lk.liger_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return qo.transpose(1, 2), ko.transpose(1, 2)
