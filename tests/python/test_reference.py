"""Checks of the test machinery itself (no fusebox needed): the float64 references agree with
torch / transformers / diffusers in float64, and poisoning really produces NaN."""

import pytest
import torch
import torch.nn.functional as F

import reference as ref
from helpers import DEVICES, poison_allocator, qk_pair, randn, rope_tables

D64 = torch.float64


def close64(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_norm_references(gen):
    x = randn(gen, (5, 33), D64)
    w, b = randn(gen, (33,), D64), randn(gen, (33,), D64)
    close64(ref.rms_norm(x, w, 1e-6), F.rms_norm(x, (33,), w, eps=1e-6))
    close64(ref.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (33,), w, b, eps=1e-5))
    close64(ref.rms_norm(x, w, 1e-6, weight_offset=1.0), F.rms_norm(x, (33,), 1 + w, eps=1e-6))


def test_activation_references(gen):
    x = randn(gen, (5, 33), D64, scale=3.0)
    close64(ref.act(x, "silu"), F.silu(x))
    close64(ref.act(x, "gelu"), F.gelu(x))
    close64(ref.act(x, "gelu_tanh"), F.gelu(x, approximate="tanh"))
    close64(ref.gated_act_packed(x[:, :32], "silu", False), x[:, :16] * F.silu(x[:, 16:32]))


def test_rope_reference_matches_transformers(gen):
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = qk_pair(gen, "bhsd", 2, 5, 4, 2, 16, D64)
    cos, sin = rope_tables(gen, "BS", "bhsd", 2, 5, 16, False, D64)
    eq, ek = apply_rotary_pos_emb(q, k, cos, sin)
    close64(ref.rope(q, cos, sin, False, heads_first=True), eq)
    close64(ref.rope(k, cos.unsqueeze(1), sin.unsqueeze(1), False, heads_first=True), ek)
    # bshd layout and [S, R] tables give the same numbers
    close64(ref.rope(q.transpose(1, 2), cos[0], sin[0], False).transpose(1, 2)[:1], eq[:1])


@pytest.mark.parametrize("sequence_dim", [1, 2])
def test_rope_reference_matches_diffusers(gen, sequence_dim):
    pytest.importorskip("diffusers")
    from diffusers.models.embeddings import apply_rotary_emb

    layout = "bshd" if sequence_dim == 1 else "bhsd"
    q, _ = qk_pair(gen, layout, 2, 5, 3, 3, 16, D64)
    cos, sin = rope_tables(gen, "S", layout, 2, 5, 16, True, D64)
    expect = apply_rotary_emb(q, (cos, sin), use_real=True, sequence_dim=sequence_dim)
    close64(ref.rope(q, cos, sin, True, heads_first=sequence_dim == 2), expect)


def test_partial_rope_reference(gen):
    q, _ = qk_pair(gen, "bshd", 2, 5, 3, 3, 24, D64)
    cos, sin = rope_tables(gen, "BS", "bshd", 2, 5, 8, False, D64)
    out = ref.rope(q, cos, sin)
    assert torch.equal(out[..., 8:], q[..., 8:])
    close64(out[..., :8], ref.rope(q[..., :8].contiguous(), cos, sin))


def test_rope_3d_reference_matches_diffusers_wan():
    pytest.importorskip("diffusers")
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    d, f, h, w = 128, 3, 4, 5
    cos, sin = WanRotaryPosEmbed(d, (1, 1, 1), max_seq_len=64)(torch.zeros(1, 1, f, h, w))
    hw = 2 * (d // 6)
    angles = ref.rope_3d_angles(f, h, w, (d - 2 * hw, hw, hw))
    rc, rs = ref.rope_table(angles, interleaved=True)
    # diffusers computes the table in float64 and stores it as float32
    torch.testing.assert_close(rc.float(), cos[0, :, 0], rtol=0, atol=1e-7)
    torch.testing.assert_close(rs.float(), sin[0, :, 0], rtol=0, atol=1e-7)


def test_rope_3d_reference_offsets_and_half_split():
    # token (f, h, w) = (1, 2, 3) of a 2x3x4 grid is s = 1*12 + 2*4 + 3 = 23; with offsets
    # (1, 0, 2) its positions are (2, 2, 5).
    axes = (4, 6, 6)
    a = ref.rope_3d_angles(2, 3, 4, axes, theta=100.0, offsets=(1, 0, 2))[23]
    expect = torch.cat([p * 100.0 ** (-2.0 * torch.arange(n // 2, dtype=D64) / n)
                        for p, n in zip((2, 2, 5), axes)])
    close64(a, expect)
    c, _ = ref.rope_table(a, interleaved=False)
    close64(c, torch.cat((a, a)).cos())


def test_qk_norm_reference_across_heads(gen):
    q, _ = qk_pair(gen, "bshd", 2, 5, 3, 3, 8, D64)
    w = randn(gen, (24,), D64)
    n = ref.head_rms_norm(q, w, 1e-6, across_heads=True)
    close64(n, F.rms_norm(q.flatten(-2), (24,), w, eps=1e-6).unflatten(-1, (3, 8)))
    nt = ref.head_rms_norm(q.transpose(1, 2), w, 1e-6, across_heads=True, heads_first=True)
    close64(nt, n.transpose(1, 2))


@pytest.mark.parametrize("device", DEVICES)
def test_poison_makes_fresh_allocations_nan(device):
    with poison_allocator(device):
        t = torch.empty(12345, device=device)
        u = torch.empty((3, 7), dtype=torch.bfloat16, device=device).new_empty((5,))
    assert t.isnan().all() and u.isnan().all()
    assert not torch.are_deterministic_algorithms_enabled()  # restored afterwards
