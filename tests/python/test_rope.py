"""Rotary family: rope (table), rope_3d (in-kernel video frequencies), qk_norm_rope, the
rope_1d alias, and agreement with transformers/diffusers rotary code."""

import pytest
import torch

import fusebox
import reference as ref
from helpers import (
    BF16, DTYPE_CASES, DTYPES, F32, ROPE_LAYOUTS, TABLE_KINDS, TOL, assert_close, big_rows, call,
    qk_pair, randn, rope_tables, weight,
)

B, S, HQ, HK = 2, 5, 4, 2
# (head dim D, rotary dims R): full rotary and partial rotary (channels >= R pass through).
ROTARY = {"full": (64, 64), "partial": (96, 32)}


def table_kinds_for(layout):
    return [k for k in TABLE_KINDS if not (layout == "flat" and k == "4d")]


ROPE_CASES = [(layout, kind) for layout in ROPE_LAYOUTS for kind in table_kinds_for(layout)]


def check_rope(q, k, cos, sin, interleaved, heads_first, fn=None):
    fn = fn or fusebox.rope
    q_out, k_out = call(fn, q, k, cos, sin, interleaved=interleaved, heads_first=heads_first)
    assert_close(q_out, ref.rope(q, cos, sin, interleaved, heads_first), q.dtype, name="q_out")
    if k is None:
        assert k_out is None
    else:
        assert_close(k_out, ref.rope(k, cos, sin, interleaved, heads_first), k.dtype, name="k_out")
    return q_out, k_out


def assert_passthrough(out, x, r):
    """Channels >= R are copied bit for bit."""
    assert torch.equal(out[..., r:], x[..., r:]), "channels past the rotary dims changed"


# --------------------------------------------------------------------------- rope


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("layout,kind", ROPE_CASES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("rotary", list(ROTARY))
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "views"])
def test_rope(device, gen, dtypes, layout, kind, interleaved, rotary, strided):
    xd, pd = dtypes
    d, r = ROTARY[rotary]
    q, k = qk_pair(gen, layout, B, S, HQ, HK, d, xd, device, strided)
    cos, sin = rope_tables(gen, kind, layout, B, S, r, interleaved, pd, device)
    q_out, k_out = check_rope(q, k, cos, sin, interleaved, heads_first=layout == "bhsd")
    if rotary == "partial":
        assert_passthrough(q_out, q, r)
        assert_passthrough(k_out, k, r)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("layout", ROPE_LAYOUTS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope_independent_channel_tables(device, gen, dtypes, layout, interleaved):
    # Per-channel angles that differ within a pair (LTX-style tables are per channel): each
    # channel must use its own cos/sin entry, as transformers and diffusers compute it.
    xd, pd = dtypes
    q, k = qk_pair(gen, layout, B, S, HQ, HK, 64, xd, device)
    cos, sin = rope_tables(gen, "BS", layout, B, S, 48, interleaved, pd, device, independent=True)
    check_rope(q, k, cos, sin, interleaved, heads_first=layout == "bhsd")


@pytest.mark.parametrize("dtype", DTYPES)
# Heads wider than 32 vectors (past 256 channels of 16-byte vectors) take a lane group of up to
# a block without a norm (1000, 2048: LTX-Video's flat q/k), the rows kernel past that (3000
# with half-split pairs that 16-byte vectors do not align, so one element a vector: 1500 units).
@pytest.mark.parametrize("d", [2, 8, 80, 128, 256, 1000, 2048, 3000])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope_head_dims(device, gen, dtype, d, interleaved):
    q, k = qk_pair(gen, "bshd", 3, 7, 3, 1, d, dtype, device)
    cos, sin = rope_tables(gen, "BS", "bshd", 3, 7, d, interleaved, dtype, device)
    check_rope(q, k, cos, sin, interleaved, heads_first=False)


@pytest.mark.parametrize("layout", ROPE_LAYOUTS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope_k_none(device, gen, layout, interleaved):
    q, _ = qk_pair(gen, layout, B, S, HQ, HK, 64, BF16, device, strided=True)
    cos, sin = rope_tables(gen, "S", layout, B, S, 64, interleaved, F32, device)
    check_rope(q, None, cos, sin, interleaved, heads_first=layout == "bhsd")


@pytest.mark.parametrize("layout", ROPE_LAYOUTS)
def test_rope_empty(device, gen, layout):
    # zero tokens
    q, k = qk_pair(gen, layout, B, 0, HQ, HK, 64, BF16, device)
    cos, sin = rope_tables(gen, "BS", layout, B, 0, 64, False, F32, device)
    q_out, k_out = call(fusebox.rope, q, k, cos, sin, heads_first=layout == "bhsd")
    assert q_out.shape == q.shape and q_out.dtype == BF16
    assert k_out.shape == k.shape and k_out.dtype == BF16


@pytest.mark.large
@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope_large(device, gen, dtypes, layout, interleaved):
    xd, pd = dtypes
    s = 4 * big_rows(device)
    q, k = qk_pair(gen, layout, 2, s, 24, 8, 128, xd, device, strided=True)
    cos, sin = rope_tables(gen, "BS", layout, 2, s, 128, interleaved, pd, device)
    check_rope(q, k, cos, sin, interleaved, heads_first=layout == "bhsd")


def wide_strided(gen, shape, strides, dtype, device):
    """A view of `shape` and `strides` (elements) into a storage just large enough, its
    elements random where the view reaches and never read elsewhere."""
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, strides))
    storage = torch.empty(extent, dtype=dtype, device=device)
    view = storage.as_strided(shape, strides)
    view.copy_(randn(gen, shape, dtype, device))
    return view


@pytest.mark.large
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope_batches_2_pow_32_apart(device, gen, interleaved):
    """On CUDA, strides travel in 32 bits: a q whose batches lie 2^32 elements apart (8 GiB in
    bf16) runs as one launch per batch and still rotates both batches right."""
    if device != "cuda":
        pytest.skip("the 32-bit strides are the CUDA kernels' (the CPU path takes int64)")
    s, h, d = 3, 2, 64
    q = wide_strided(gen, (2, s, h, d), (1 << 32, h * d, d, 1), BF16, device)
    k = randn(gen, (2, s, h, d), BF16, device)
    cos, sin = rope_tables(gen, "BS", "bshd", 2, s, d, interleaved, F32, device)
    check_rope(q, k, cos, sin, interleaved, heads_first=False)
    del q
    torch.cuda.empty_cache()


@pytest.mark.large
def test_rope_sequence_stride_2_pow_32_rejected(device, gen):
    """A stride past 32 bits other than the batch's is refused with the tensor and dimension
    named, not wrapped into a wrong address."""
    if device != "cuda":
        pytest.skip("the 32-bit strides are the CUDA kernels' (the CPU path takes int64)")
    q = wide_strided(gen, (1, 2, 2, 64), (1 << 33, 1 << 32, 64, 1), BF16, device)
    cos, sin = rope_tables(gen, "BS", "bshd", 1, 2, 64, False, F32, device)
    with pytest.raises(ValueError, match=r"q.s stride along dimension 1 must be below 2\^32"):
        fusebox.rope(q, None, cos, sin)
    del q
    torch.cuda.empty_cache()


def test_rope_row_too_wide(device, gen):
    """A head past what one row of the CUDA kernel holds is refused with its width and the limit
    at its vector width (half-split pairs of 4104 channels do not align to 16 bytes: one element
    a vector, at most 4096 channels)."""
    if device != "cuda":
        pytest.skip("the limit is the CUDA kernel's (the CPU path takes any width)")
    q = randn(gen, (1, 2, 1, 4104), BF16, device)
    cos, sin = rope_tables(gen, "S", "bshd", 1, 2, 4104, False, F32, device)
    with pytest.raises(ValueError, match=r"one head, 4104 channels\) is too wide: at most 4096 are supported "
                                         r"with 1-element vectors \(8 where"):
        fusebox.rope(q, None, cos, sin)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_alias_rope_1d(device, gen, interleaved):
    q, k = qk_pair(gen, "bhsd", B, S, HQ, HK, 64, BF16, device, strided=True)
    cos, sin = rope_tables(gen, "4d", "bhsd", B, S, 64, interleaved, F32, device)
    check_rope(q, k, cos, sin, interleaved, heads_first=True, fn=fusebox.rope_1d)


# --------------------------------------------------------------------------- rope_3d

GRID = (3, 4, 5)  # frames, height, width -> S = 60


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize(
    "d,axes_dim",
    [(64, None), (128, None), (96, (32, 32, 32)), (80, (16, 16, 16))],
    ids=["wan64", "wan128", "even96", "partial80"],
)
def test_rope_3d(device, gen, dtypes, layout, interleaved, d, axes_dim):
    xd, _ = dtypes
    s = GRID[0] * GRID[1] * GRID[2]
    q, k = qk_pair(gen, layout, B, s, HQ, HK, d, xd, device, strided=True)
    heads_first = layout == "bhsd"
    kw = dict(axes_dim=axes_dim, interleaved=interleaved, heads_first=heads_first)
    q_out, k_out = call(fusebox.rope_3d, q, k, *GRID, **kw)
    assert_close(q_out, ref.rope_3d(q, *GRID, **kw), xd, name="q_out")
    assert_close(k_out, ref.rope_3d(k, *GRID, **kw), xd, name="k_out")
    if axes_dim is not None and sum(axes_dim) < d:
        assert_passthrough(q_out, q, sum(axes_dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offsets", [(0, 0, 0), (2, 1, 3), (7, 0, 0)])
@pytest.mark.parametrize("theta", [10000.0, 256.0])
def test_rope_3d_offsets_theta(device, gen, dtype, offsets, theta):
    s = GRID[0] * GRID[1] * GRID[2]
    q, k = qk_pair(gen, "bshd", 1, s, 3, 3, 64, dtype, device)
    kw = dict(axes_dim=(16, 24, 24), theta=theta, offsets=offsets)
    q_out, k_out = call(fusebox.rope_3d, q, k, *GRID, **kw)
    assert_close(q_out, ref.rope_3d(q, *GRID, **kw), dtype, name="q_out")
    assert_close(k_out, ref.rope_3d(k, *GRID, **kw), dtype, name="k_out")


def test_rope_3d_k_none(device, gen):
    s = GRID[0] * GRID[1] * GRID[2]
    q, _ = qk_pair(gen, "bshd", B, s, HQ, HK, 64, BF16, device)
    q_out, k_out = call(fusebox.rope_3d, q, None, *GRID)
    assert k_out is None
    assert_close(q_out, ref.rope_3d(q, *GRID), BF16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_3d_matches_diffusers_wan(device, gen, dtype):
    pytest.importorskip("diffusers")
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    d, (f, h, w) = 128, GRID
    emb = WanRotaryPosEmbed(attention_head_dim=d, patch_size=(1, 1, 1), max_seq_len=64)
    cos, sin = emb(torch.zeros(1, 1, f, h, w))  # [1, S, 1, D] fp32 (computed in float64)
    cos, sin = cos[0, :, 0].to(device), sin[0, :, 0].to(device)  # [S, D]
    q, k = qk_pair(gen, "bshd", B, f * h * w, HQ, HK, d, dtype, device, strided=True)
    q_out, k_out = call(fusebox.rope_3d, q, k, f, h, w)  # Wan defaults: interleaved, Wan split
    assert_close(q_out, ref.rope(q, cos, sin, interleaved=True), dtype)
    assert_close(k_out, ref.rope(k, cos, sin, interleaved=True), dtype)
    # and the table path agrees with the in-kernel frequencies
    tq, tk = call(fusebox.rope, q, k, cos, sin, interleaved=True)
    assert_close(q_out, tq.double(), dtype)
    assert_close(k_out, tk.double(), dtype)


@pytest.mark.large
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_3d_large(device, gen, dtype):
    grid = (5, 30, 52) if torch.device(device).type == "cuda" else (2, 3, 4)
    s = grid[0] * grid[1] * grid[2]
    q, k = qk_pair(gen, "bshd", 1, s, 12, 12, 128, dtype, device, strided=True)
    q_out, k_out = call(fusebox.rope_3d, q, k, *grid, offsets=(0, 2, 2))
    assert_close(q_out, ref.rope_3d(q, *grid, offsets=(0, 2, 2)), dtype, name="q_out")
    assert_close(k_out, ref.rope_3d(k, *grid, offsets=(0, 2, 2)), dtype, name="k_out")


# --------------------------------------------------------------------------- qk_norm_rope


def norm_weights(gen, layout, across, q, k, dtype, device):
    """q/k weights: [D] per head, [H * D] across heads (flat: [W] either way)."""
    if layout == "flat" or not across:
        return weight(gen, q.shape[-1], dtype, device), weight(gen, k.shape[-1], dtype, device)
    hq, hk = (q.shape[1], k.shape[1]) if layout == "bhsd" else (q.shape[2], k.shape[2])
    d = q.shape[-1]
    return weight(gen, hq * d, dtype, device), weight(gen, hk * d, dtype, device)


def check_qk_norm_rope(q, k, qw, kw, cos, sin, eps, across, interleaved, heads_first,
                       weight_offset=0.0):
    q_out, k_out = call(fusebox.qk_norm_rope, q, k, qw, kw, cos, sin, eps=eps,
                        across_heads=across, interleaved=interleaved, heads_first=heads_first,
                        weight_offset=weight_offset)
    args = (cos, sin, eps, across, interleaved, heads_first, weight_offset)
    assert_close(q_out, ref.qk_norm_rope(q, qw, *args), q.dtype, name="q_out")
    if k is None:
        assert k_out is None
    else:
        assert_close(k_out, ref.qk_norm_rope(k, kw, *args), k.dtype, name="k_out")


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("layout", ROPE_LAYOUTS)
@pytest.mark.parametrize("across", [False, True], ids=["per_head", "across_heads"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("with_weights", [True, False], ids=["weights", "noweights"])
@pytest.mark.parametrize("rotary", list(ROTARY))
def test_qk_norm_rope(device, gen, dtypes, layout, across, interleaved, with_weights, rotary):
    xd, pd = dtypes
    d, r = ROTARY[rotary]
    q, k = qk_pair(gen, layout, B, S, HQ, HK, d, xd, device, strided=True)
    cos, sin = rope_tables(gen, "BS", layout, B, S, r, interleaved, pd, device)
    qw, kw = norm_weights(gen, layout, across, q, k, pd, device) if with_weights else (None, None)
    check_qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6, across, interleaved, layout == "bhsd")


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("heads,d,r", [(7, 80, 80), (13, 80, 48), (12, 128, 128), (32, 128, 128),
                                       (40, 128, 128)])
@pytest.mark.parametrize("tokens", [3, 200, 2048], ids=["decode", "mid", "prefill"])
def test_qk_norm_rope_across_heads_wide(device, gen, dtypes, interleaved, heads, d, r, tokens):
    # Rows of many heads. On CUDA a call whose rows fit one wave gives each unit a lane of its
    # own (OLMo-2's 32 half-split heads of 128 in 16-bit at 200 tokens with fp32 weights: a
    # kernel bounded to 64 registers, its rows between a quarter and half of the GPU's resident
    # threads; with weights of the data's dtype, the short kernel, a block a tensor); past that
    # each thread walks several units, whose head and channel change from item to item by a
    # thread count that is not always a whole number of heads.
    # 12 heads of 128 (Wan 1.3B) take the early-rotation rows in 128-thread blocks and 40 (Wan
    # 14B) in 160-thread ones, each with launch bounds of their own for 16-bit interleaved units.
    xd, pd = dtypes
    q, k = qk_pair(gen, "bshd", 1, tokens, heads, heads - 2, d, xd, device, strided=True)
    cos, sin = rope_tables(gen, "S", "bshd", 1, tokens, r, interleaved, pd, device)
    qw, kw = norm_weights(gen, "bshd", True, q, k, pd, device)
    check_qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6, True, interleaved, False)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("heads,d,r", [(1, 2048, 2048), (1, 1000, 512), (12, 128, 128), (40, 128, 128),
                                       (5, 80, 48), (2, 64, 64), (1, 8192, 8192)])
def test_qk_norm_rope_across_heads_paired(device, gen, dtypes, interleaved, heads, d, r):
    # As many k heads as q heads: wide rows of up to 256 interleaved units hold a token's q and
    # k together (LTX-Video's flat 2048 channels, Wan 1.3B's 12 heads of 128), each thread the
    # same units of both; half-split pairs, rows of at most 32 units (2 x 64) and wider ones
    # (Wan 14B's 40 heads, 8192 channels) keep separate q and k rows. q and k have different
    # strides.
    xd, pd = dtypes
    q, _ = qk_pair(gen, "bshd", 2, 3, heads, heads, d, xd, device, strided=True)
    k, _ = qk_pair(gen, "bshd", 2, 3, heads, heads, d, xd, device)
    cos, sin = rope_tables(gen, "BS", "bshd", 2, 3, r, interleaved, pd, device)
    qw, kw = norm_weights(gen, "bshd", True, q, k, pd, device)
    check_qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6, True, interleaved, False)
    check_qk_norm_rope(q, k, None, kw, cos, sin, 1e-6, True, interleaved, False)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("layout,kind", ROPE_CASES)
def test_qk_norm_rope_tables_and_dense(device, gen, dtypes, layout, kind):
    xd, pd = dtypes
    q, k = qk_pair(gen, layout, B, S, HQ, HK, 128, xd, device)
    cos, sin = rope_tables(gen, kind, layout, B, S, 128, True, pd, device)
    qw, kw = norm_weights(gen, layout, False, q, k, pd, device)
    check_qk_norm_rope(q, k, qw, kw, cos, sin, 1e-5, False, True, layout == "bhsd")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("across", [False, True], ids=["per_head", "across_heads"])
def test_qk_norm_rope_gemma_offset_k_none(device, gen, dtype, across):
    q, _ = qk_pair(gen, "bshd", B, S, HQ, HK, 64, dtype, device, strided=True)
    cos, sin = rope_tables(gen, "S", "bshd", B, S, 64, False, dtype, device)
    n = HQ * 64 if across else 64
    qw = randn(gen, (n,), dtype, device, scale=0.5)  # Gemma-style weights around 0
    check_qk_norm_rope(q, None, qw, None, cos, sin, 1e-6, across, False, False, weight_offset=1.0)


def test_qk_norm_rope_eps(device, gen):
    # tiny q so eps dominates: a dropped or wrong eps fails
    q, k = qk_pair(gen, "bshd", B, S, HQ, HK, 64, F32, device)
    q, k = q * 1e-3, k * 1e-3
    cos, sin = rope_tables(gen, "S", "bshd", B, S, 64, False, F32, device)
    check_qk_norm_rope(q, k, None, None, cos, sin, 1e-5, False, False, False)


@pytest.mark.large
@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("across", [False, True], ids=["per_head", "across_heads"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("heads", [(24, 8), (24, 24)], ids=["gqa", "as_many"])
def test_qk_norm_rope_large(device, gen, dtypes, across, interleaved, heads):
    # Enough tokens that a lane group takes 2-4 heads on CUDA: per-head weights read per head
    # (half-split), a bf16 table's rotation factors held packed, q and k with as many heads
    # (FLUX) or not; then q without weights and k's with Gemma's offset (a lane group's heads
    # may mix weighted and unweighted ones). Half-split heads with tables per batch and weights
    # of the data's dtype take the short kernel at any size; one table for both batches (strides
    # that do not fold into a token's) keeps them on the per-head kernel.
    xd, pd = dtypes
    s = (4 if heads[0] != heads[1] else 1) * big_rows(device)  # (48 heads: past a wave at 1031 tokens)
    q, k = qk_pair(gen, "bshd", 2, s, *heads, 128, xd, device, strided=True)
    qw, kw = norm_weights(gen, "bshd", across, q, k, pd, device)
    for kind in ("BS", "S"):
        cos, sin = rope_tables(gen, kind, "bshd", 2, s, 128, interleaved, pd, device)
        check_qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6, across, interleaved, False)
        check_qk_norm_rope(q, k, None, kw, cos, sin, 1e-6, across, interleaved, False, weight_offset=1.0)


# Decode-sized calls whose heads fill a block of 128+ threads take the short rotary kernel on
# CUDA (one token a block) where every operand's batch and sequence strides fold into one token
# stride; the others (heads first with several tokens of several sequences, a table broadcast
# over the batch) the per-head kernel. Heads of 16-32 lanes, and a last warp partly past the
# heads (13 + 4 heads of 8 lanes in 16-bit).
DECODE_HEADS = [(32, 8, 128), (13, 4, 128), (11, 1, 256)]


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "views"])
@pytest.mark.parametrize("b,s", [(1, 1), (4, 1), (1, 7), (2, 3)])
@pytest.mark.parametrize("heads", DECODE_HEADS, ids=lambda h: f"{h[0]}+{h[1]}x{h[2]}")
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope_decode_sizes(device, gen, dtypes, layout, strided, b, s, heads, interleaved):
    xd, pd = dtypes
    hq, hk, d = heads
    q, k = qk_pair(gen, layout, b, s, hq, hk, d, xd, device, strided)
    for kind in ("BS", "S"):
        cos, sin = rope_tables(gen, kind, layout, b, s, d, interleaved, pd, device)
        check_rope(q, k, cos, sin, interleaved, heads_first=layout == "bhsd")
    qw, kw = norm_weights(gen, layout, False, q, k, pd, device)
    check_qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6, False, interleaved, layout == "bhsd")
    check_qk_norm_rope(q, k, None, kw, cos, sin, 1e-6, False, interleaved, layout == "bhsd",
                       weight_offset=1.0)
    check_qk_norm_rope(q, None, qw, None, cos, sin, 1e-6, False, interleaved, layout == "bhsd")


# Decode-sized calls of a norm across heads whose q heads and k heads each fill at most a
# block take the short kernel on CUDA, a block per token and tensor with a block-wide sum:
# OLMo-2's 32 + 32 heads, GQA (12 + 4; 13 + 5 and 16 + 6 heads, whose blocks end in partly used
# warps and k's with threads past its heads), and q alone. 40 heads of 128 in fp32 (640
# lanes) take the rows kernel.
ACROSS_DECODE_HEADS = [(32, 32, 128), (12, 4, 128), (16, 6, 64), (8, 0, 128), (13, 5, 128), (40, 8, 128)]


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("b,s", [(1, 1), (4, 1), (2, 3)])
@pytest.mark.parametrize("heads", ACROSS_DECODE_HEADS, ids=lambda h: f"{h[0]}+{h[1]}x{h[2]}")
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_qk_norm_rope_across_heads_decode(device, gen, dtypes, layout, b, s, heads, interleaved):
    xd, pd = dtypes
    hq, hk, d = heads
    q, k = qk_pair(gen, layout, b, s, hq, max(hk, 1), d, xd, device, strided=True)
    k = k if hk else None
    cos, sin = rope_tables(gen, "BS", layout, b, s, d, interleaved, pd, device)
    qw = weight(gen, hq * d, xd, device)  # weights of the data's dtype (the short kernel's)
    kw = weight(gen, hk * d, xd, device) if hk else None
    heads_first = layout == "bhsd"
    check_qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6, True, interleaved, heads_first)
    check_qk_norm_rope(q, k, None, kw, cos, sin, 1e-6, True, interleaved, heads_first, weight_offset=1.0)


# --------------------------------------------------------------------------- real modules


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_4d", [False, True], ids=["cos_BSD", "cos_B1SD"])
def test_matches_transformers_apply_rotary_pos_emb(device, gen, dtype, table_4d):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    d = 128
    cfg = LlamaConfig(hidden_size=HQ * d, num_attention_heads=HQ, num_key_value_heads=HK,
                      head_dim=d)
    rotary = LlamaRotaryEmbedding(cfg).to(device)
    q, k = qk_pair(gen, "bhsd", B, S, HQ, HK, d, dtype, device, strided=True)
    pos = (torch.arange(S)[None] + torch.randint(0, 100, (B, 1), generator=gen)).to(device)
    cos, sin = rotary(q, pos)  # [B, S, D] in q's dtype
    expect_q, expect_k = apply_rotary_pos_emb(q, k, cos, sin)  # k broadcasts (GQA)
    c, s = (cos.unsqueeze(1), sin.unsqueeze(1)) if table_4d else (cos, sin)
    q_out, k_out = call(fusebox.rope, q, k, c, s, heads_first=True)
    # transformers rounds q*cos and rotate_half(q)*sin to q's dtype too: 16-bit types get the
    # project's loose 1e-2 bound against it (the float64 reference tests hold the tight ones)
    tol = TOL[dtype] if dtype == F32 else 1e-2
    assert_close(q_out, expect_q.double(), dtype, tol=tol, name="q_out")
    assert_close(k_out, expect_k.double(), dtype, tol=tol, name="k_out")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sequence_dim", [1, 2])
def test_matches_diffusers_apply_rotary_emb(device, gen, dtype, sequence_dim):
    pytest.importorskip("diffusers")
    from diffusers.models.embeddings import apply_rotary_emb, get_1d_rotary_pos_embed

    d = 128
    layout = "bshd" if sequence_dim == 1 else "bhsd"
    q, k = qk_pair(gen, layout, B, S, HQ, HQ, d, dtype, device, strided=True)
    cos, sin = get_1d_rotary_pos_embed(d, S, use_real=True, repeat_interleave_real=True)
    cos, sin = cos.to(device), sin.to(device)  # [S, D] fp32
    expect_q = apply_rotary_emb(q, (cos, sin), use_real=True, sequence_dim=sequence_dim)
    expect_k = apply_rotary_emb(k, (cos, sin), use_real=True, sequence_dim=sequence_dim)
    q_out, k_out = call(fusebox.rope, q, k, cos, sin, interleaved=True,
                        heads_first=sequence_dim == 2)
    assert_close(q_out, expect_q.double(), dtype, name="q_out")
    assert_close(k_out, expect_k.double(), dtype, name="k_out")
