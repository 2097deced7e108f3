"""Mixture-of-experts family: moe_topk_softmax (the router's top-k), moe_sort (the (token, k)
pairs sorted by expert) and moe_combine (each token's expert rows, weighted and summed)."""

import pytest
import torch

import fusebox
import reference as ref
from helpers import BF16, DTYPE_CASES, F16, F32, HAS_CUDA, assert_close, call, randn, requires_cuda


def routing(gen, tokens, top_k, num_rows, index_dtype, weight_dtype, device, layout="contiguous"):
    """A permutation's index (every row used once where num_rows == tokens * top_k, as a MoE
    layer's sorted rows are) and softmax-like weights; "transposed" gives both strides
    (top_k, 1) -> (1, tokens)."""
    perm = torch.randperm(tokens * top_k, generator=gen) % max(num_rows, 1)
    w = torch.rand((tokens, top_k), generator=gen) + 0.1
    w = w / w.sum(-1, keepdim=True)
    index, weights = perm.view(tokens, top_k), w
    if layout == "transposed":
        index, weights = index.t().contiguous().t(), weights.t().contiguous().t()
    return index.to(device=device, dtype=index_dtype), weights.to(device=device, dtype=weight_dtype)


def expert_rows(gen, num_rows, width, dtype, device, layout="contiguous"):
    """The experts' output rows; "row_slice" takes them from wider rows (unaligned start)."""
    if layout == "row_slice":
        return randn(gen, (num_rows, width + 9), dtype, device)[:, 3:3 + width]
    return randn(gen, (num_rows, width), dtype, device)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize("top_k", [1, 2, 6, 8, 9, 13])
@pytest.mark.parametrize("width", [1, 7, 769, 2048, 5125])
def test_moe_combine(device, gen, dtypes, index_dtype, top_k, width):
    dtype, wdtype = dtypes
    tokens = 17
    rows = expert_rows(gen, tokens * top_k, width, dtype, device)
    index, weights = routing(gen, tokens, top_k, tokens * top_k, index_dtype, wdtype, device)
    out = call(fusebox.moe_combine, rows, index, weights)
    assert_close(out, ref.moe_combine(rows, index, weights), dtype)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize("top_k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("width", [264, 4104])
@pytest.mark.parametrize("tokens", [1, 16])
def test_moe_combine_decode_sizes_cuda(gen, dtypes, index_dtype, top_k, width, tokens):
    """1 and 16 tokens: the decode kernel (16-byte vectors up to top-k 4, 4-byte ones above,
    K padded to 2, 4 or 8, a last block only partly in the row), with more rows than pairs so
    that rows go unused."""
    dtype, wdtype = dtypes
    rows = expert_rows(gen, tokens * top_k + 5, width, dtype, "cuda")
    index, weights = routing(gen, tokens, top_k, tokens * top_k + 5, index_dtype, wdtype, "cuda")
    out = call(fusebox.moe_combine, rows, index, weights)
    assert_close(out, ref.moe_combine(rows, index, weights), dtype)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("top_k", [2, 6, 8, 9])
@pytest.mark.parametrize("width", [1001, 2048, 4104])
def test_moe_combine_many_tokens(device, gen, dtypes, top_k, width):
    """Enough tokens for a grid of more blocks than SMs: the plans of 2-4 vectors a thread over
    whole rows, several tokens a block, rows staged through shared memory (the 17 tokens above
    take the decode plan)."""
    dtype, wdtype = dtypes
    tokens = 300
    rows = expert_rows(gen, tokens * top_k, width, dtype, device)
    index, weights = routing(gen, tokens, top_k, tokens * top_k, torch.int32, wdtype, device)
    out = call(fusebox.moe_combine, rows, index, weights)
    assert_close(out, ref.moe_combine(rows, index, weights), dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("layout", ["row_slice", "transposed"])
def test_moe_combine_strided(device, gen, dtype, layout):
    """Rows read through a row stride and an unaligned start; index and weights transposed
    (column-major); rows named twice and rows never named."""
    tokens, top_k, num_rows, width = 33, 6, 101, 1040
    rows = expert_rows(gen, num_rows, width, dtype, device, "row_slice" if layout == "row_slice" else "contiguous")
    index, weights = routing(gen, tokens, top_k, num_rows, torch.int64, F32, device, layout)
    out = call(fusebox.moe_combine, rows, index, weights)
    assert_close(out, ref.moe_combine(rows, index, weights), dtype)


@pytest.mark.parametrize("weights_16bit", [False, True], ids=["f32w", "16bitw"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_moe_combine_matches_the_unfused_form(device, gen, dtype, weights_16bit):
    """The values of the grouped experts' combine (products in their dtype, summed in fp32 in k
    order, rounded once): the unfused torch form's up to the order of its fp32 sum, which on CUDA differs (an
    fp32 output then differs in the last place in about half its elements; a 16-bit one rarely
    after its rounding)."""
    tokens, top_k, width = 64, 6, 2048
    rows = expert_rows(gen, tokens * top_k, width, dtype, device)
    wdtype = dtype if weights_16bit else F32  # 16-bit weights: the unfused products are 16-bit
    index, weights = routing(gen, tokens, top_k, tokens * top_k, torch.int64, wdtype, device)
    unfused = (rows[index] * weights.unsqueeze(-1)).sum(1).to(dtype)
    out = call(fusebox.moe_combine, rows, index, weights)
    ulp = {F32: 1e-6, BF16: 1e-2, F16: 1e-3}[dtype]
    assert torch.allclose(out.float(), unfused.float(), rtol=ulp, atol=ulp), (out - unfused).abs().max()
    if dtype != F32:
        assert (out != unfused).float().mean().item() < 0.05


def test_moe_combine_empty(device):
    for num_rows, tokens, top_k in ((4, 0, 2), (4, 3, 0), (0, 3, 0)):
        rows = torch.randn(num_rows, 16, device=device, dtype=BF16)
        index = torch.zeros((tokens, top_k), dtype=torch.int64, device=device)
        out = call(fusebox.moe_combine, rows, index, torch.ones((tokens, top_k), device=device))
        assert out.shape == (tokens, 16) and out.dtype == BF16
        if tokens:  # no rows: the sum of nothing
            assert (out == 0).all()


def test_moe_combine_index_out_of_range_cpu(gen):
    rows = randn(gen, (6, 32), BF16)
    weights = torch.full((2, 3), 0.3)
    for bad in (6, -1):
        index = torch.tensor([[0, 1, 2], [3, bad, 5]])
        with pytest.raises(ValueError, match=r"index\[1, 1\] = -?\d+ is outside rows' 6 rows"):
            fusebox.moe_combine(rows, index, weights)


@requires_cuda
@pytest.mark.gpu
def test_moe_combine_index_out_of_range_cuda_is_nan(gen):
    """CUDA cannot raise without a host sync: the token's row turns NaN, the others are exact,
    and nothing is read out of bounds (the GPU suite also runs under compute-sanitizer)."""
    rows = randn(gen, (6, 40), BF16, "cuda")
    weights = torch.full((3, 3), 0.3, device="cuda")
    index = torch.tensor([[0, 1, 2], [3, 1 << 40, 5], [4, -7, 0]], device="cuda")
    out = call(fusebox.moe_combine, rows, index, weights)
    assert torch.isnan(out[1:].float()).all()
    good = index[:1]
    assert_close(out[:1], ref.moe_combine(rows, good, weights[:1]), BF16)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize("tokens", [3, 300])
@pytest.mark.parametrize("top_k", [2, 6, 9])
def test_moe_combine_out_of_range_token_spares_its_neighbours_cuda(gen, top_k, tokens, index_dtype):
    """Only the tokens with a bad index turn NaN: the others, several of them in the same
    blocks (a 264-wide row takes under a block's threads), are exact. 3 tokens take the
    decode kernel (top-k 2 and 6) or the general kernel's decode plan (top-k 9), 300 the
    staged plans."""
    width = 264
    rows = randn(gen, (tokens * top_k, width), BF16, "cuda")
    index = torch.randperm(tokens * top_k, generator=gen).view(tokens, top_k).to(index_dtype).cuda()
    weights = torch.rand((tokens, top_k), generator=gen).cuda()
    bad = [tokens // 2, tokens - 1]
    index[bad[0], top_k - 1] = (1 << 40) if index_dtype == torch.int64 else tokens * top_k
    index[bad[1], 0] = -1
    out = call(fusebox.moe_combine, rows, index, weights)
    assert torch.isnan(out[bad].float()).all()
    good = torch.ones(tokens, dtype=torch.bool)
    good[bad] = False
    assert not torch.isnan(out[good].float()).any()
    assert_close(out[good], ref.moe_combine(rows, index[good], weights[good]), BF16)


@pytest.mark.parametrize("case", ["rows_1d", "index_float", "index_3d", "weights_shape", "weights_f16",
                                  "rows_int", "rows_column_major", "devices"])
def test_moe_combine_errors(case):
    rows = torch.randn(8, 16, dtype=BF16)
    index = torch.zeros((4, 2), dtype=torch.int64)
    weights = torch.ones((4, 2))
    expect = {"rows_1d": (ValueError, "rows must be a 2-D tensor"),
              "index_float": (TypeError, "index must be int32 or int64"),
              "index_3d": (ValueError, "index must be a 2-D tensor"),
              "weights_shape": (ValueError, "weights must have the shape of index"),
              "weights_f16": (ValueError, "weights must be bfloat16 or float32"),
              "rows_int": (TypeError, "rows must be float32, float16 or bfloat16"),
              "rows_column_major": (ValueError, "rows must have a contiguous last dimension"),
              "devices": (ValueError, "all tensors of one call must be on the same device")}[case]
    if case == "rows_1d":
        rows = rows[0]
    elif case == "index_float":
        index = index.float()
    elif case == "index_3d":
        index = index[None]
    elif case == "weights_shape":
        weights = weights[:, :1]
    elif case == "weights_f16":
        weights = weights.half()
    elif case == "rows_int":
        rows = rows.int()
    elif case == "rows_column_major":
        rows = rows.t().contiguous().t()
    elif case == "devices":
        if not HAS_CUDA:
            pytest.skip("needs a CUDA device")
        index = index.cuda()
    with pytest.raises(expect[0], match=expect[1]):
        fusebox.moe_combine(rows, index, weights)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])])
def test_moe_combine_compiles_without_graph_breaks(device, gen):
    rows = randn(gen, (24, 64), BF16, device)
    index, weights = routing(gen, 8, 3, 24, torch.int64, F32, device)
    torch._dynamo.reset()
    compiled = torch.compile(fusebox.moe_combine, fullgraph=True, dynamic=True)
    out = compiled(rows, index, weights)
    assert_close(out, ref.moe_combine(rows, index, weights), BF16)


# --------------------------------------------------------------------------- moe_sort


def expert_index(gen, tokens, top_k, num_experts, skew="uniform"):
    """Each token's top_k experts, distinct per token where there are enough experts (as a
    router's top-k), drawn uniformly or "skewed": most pairs on the first few experts (many
    lanes of a warp on one expert), the rest spread."""
    if skew == "skewed":
        hot = torch.randint(0, min(3, num_experts), (tokens, top_k), generator=gen)
        cold = torch.randint(0, num_experts, (tokens, top_k), generator=gen)
        return torch.where(torch.rand((tokens, top_k), generator=gen) < 0.8, hot, cold)
    if top_k <= num_experts:
        return torch.rand((tokens, num_experts), generator=gen).argsort(-1)[:, :top_k]
    return torch.randint(0, num_experts, (tokens, top_k), generator=gen)


def check_sort(got, index, num_experts):
    """Each output equal to the stable sort's, element for element, int32, on index's device."""
    want = ref.moe_sort(index, num_experts)
    for name, g, w in zip(("row_token", "offsets", "pair_row"), got, want):
        assert g.dtype == torch.int32 and g.device == index.device, (name, g.dtype, g.device)
        assert g.shape == w.shape, (name, g.shape, w.shape)
        bad = (g.cpu().long() != w).nonzero()
        assert not bad.numel(), f"{name}: {bad.shape[0]} of {g.numel()} differ, first at {bad[0].tolist()}"


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize("top_k", [1, 2, 6, 8])
@pytest.mark.parametrize("tokens", [1, 5, 16, 21, 300, 2048, 8193])
@pytest.mark.parametrize("num_experts", [1, 8, 64, 257, 3001])
def test_moe_sort(device, gen, index_dtype, top_k, tokens, num_experts):
    """Against the stable sort, from one pair to 65544 (several rounds of every warp) and from
    one expert to 3001 (fewer warps, whose counts then fill the shared memory); up to 128 pairs
    of up to 1024 experts take the decode kernels (one round up to 32 pairs, two at 40 and 42,
    four at 96-128, with fewer expert warps than rounds at 96 pairs of 1-64 experts)."""
    index = expert_index(gen, tokens, top_k, num_experts).to(device=device, dtype=index_dtype)
    check_sort(call(fusebox.moe_sort, index, num_experts), index, num_experts)


@pytest.mark.parametrize("tokens", [5, 1500])
@pytest.mark.parametrize("skew", ["skewed", "uniform"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_moe_sort_layouts(device, gen, layout, skew, tokens):
    """Index read through strides (column-major; every other column of a wider one) and routings
    where most lanes of a warp name one expert, by the decode kernel (5 tokens) and the tiles."""
    top_k, num_experts = 6, 64
    full = expert_index(gen, tokens, 2 * top_k, num_experts, skew)
    index = {"contiguous": full[:, :top_k].contiguous(), "transposed": full[:, :top_k].t().contiguous().t(),
             "sliced": full[:, ::2]}[layout].to(device)
    check_sort(call(fusebox.moe_sort, index, num_experts), index, num_experts)


@pytest.mark.parametrize("skew", ["skewed", "uniform"])
@pytest.mark.parametrize("tokens, top_k, num_experts", [(8192, 8, 256), (8193, 6, 257), (4096, 8, 256),
                                                        (512, 8, 256), (513, 8, 64), (65, 8, 3001),
                                                        (65, 8, 3500)])
def test_moe_sort_wide_tiles(device, gen, tokens, top_k, num_experts, skew):
    """Shapes at the bounds of the CUDA plans: tiles of 16 or 32 warps in two launches (DeepSeek-V3's
    prefill: 64 tiles of 257 buckets); on sm_90+ one cluster of 16 blocks of 256 pairs (4096), tiles
    past it (4104), a cluster of one-warp blocks at 3001 experts and tiles where a cluster block's
    counts would not fit (3500)."""
    index = expert_index(gen, tokens, top_k, num_experts, skew).to(device)
    check_sort(call(fusebox.moe_sort, index, num_experts), index, num_experts)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens, top_k, num_experts", [(1024, 2, 8), (256, 8, 256), (8192, 8, 256)])
def test_moe_sort_allocates_only_a_workspace_it_reads(gen, tokens, top_k, num_experts):
    """The operator takes its three outputs from the caching allocator, and a fourth tensor for
    the tiles' counts only where this GPU reads one: not where one cluster sorts the index
    (sm_90+, up to 2048 pairs on every such GPU), always past 4096 pairs."""
    index = expert_index(gen, tokens, top_k, num_experts).cuda()
    fusebox.moe_sort(index, num_experts)  # the first call loads the library and plans
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    got = fusebox.moe_sort(index, num_experts)
    allocated = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    one_cluster = torch.cuda.get_device_capability()[0] >= 9 and tokens * top_k <= 2048
    assert allocated == (3 if one_cluster else 4), (allocated, torch.cuda.get_device_name())
    check_sort(got, index, num_experts)


def test_moe_sort_empty(device):
    for tokens, top_k in ((0, 2), (3, 0)):
        index = torch.zeros((tokens, top_k), dtype=torch.int64, device=device)
        row_token, offsets, pair_row = call(fusebox.moe_sort, index, 5)
        assert row_token.shape == (0,) and pair_row.shape == (tokens, top_k)
        assert offsets.tolist() == [0] * 5


def test_moe_sort_then_combine_is_the_grouped_experts_combine(device, gen):
    """The sort's outputs used as the grouped experts use them: rows gathered by row_token, each
    expert's between its offsets, combined by pair_row, equal the combine of the unfused sort."""
    tokens, top_k, num_experts, width = 200, 6, 16, 96
    index = expert_index(gen, tokens, top_k, num_experts).to(device)
    x = randn(gen, (tokens, width), F32, device)
    experts = randn(gen, (num_experts, width), F32, device)
    weights = routing(gen, tokens, top_k, 1, torch.int64, F32, device)[1]
    row_token, offsets, pair_row = fusebox.moe_sort(index, num_experts)
    starts = [0] + offsets.tolist()[:-1]
    rows = x[row_token.long()]
    for e in range(num_experts):  # "expert e" scales its rows by its own vector
        rows[starts[e]:offsets[e]] *= experts[e]
    out = fusebox.moe_combine(rows, pair_row, weights)
    want = ((x.unsqueeze(1) * experts[index]) * weights.unsqueeze(-1)).sum(1)
    assert_close(out, want.double(), F32)


def test_moe_sort_index_out_of_range_cpu():
    for bad in (4, -1):
        index = torch.tensor([[0, 1], [2, bad]])
        with pytest.raises(ValueError, match=r"index\[1, 1\] = -?\d+ is outside the 4 experts"):
            fusebox.moe_sort(index, 4)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("repeat", [1, 300])
def test_moe_sort_index_out_of_range_cuda(gen, repeat):
    """CUDA cannot raise without a host sync: a pair outside the experts goes after every
    expert's rows, outside all offsets, with pair_row -1, on which moe_combine writes NaN over
    its token's row; the other pairs sort as without it (12 pairs: the decode kernel; 3600: the
    tiles)."""
    index = torch.tensor([[0, 3, 1], [2, 1 << 40, 1], [3, -7, 0], [1, 2, 3]], device="cuda").repeat(repeat, 1)
    row_token, offsets, pair_row = call(fusebox.moe_sort, index, 4)
    valid = ((index >= 0) & (index < 4)).cpu()
    # the stable sort with the bad pairs in a fifth expert, whose end offsets leave out
    want_row_token, want_offsets, want_pair_row = ref.moe_sort(index.cpu().where(valid, 4), 5)
    assert row_token.tolist() == want_row_token.tolist()
    assert offsets.tolist() == want_offsets[:4].tolist() == [repeat * n for n in (2, 5, 7, 10)]
    assert pair_row.tolist() == want_pair_row.where(valid, -1).tolist()
    rows = randn(gen, (12 * repeat, 40), BF16, "cuda")
    out = fusebox.moe_combine(rows, pair_row, torch.full((4 * repeat, 3), 0.3, device="cuda")).view(repeat, 4, 40)
    assert torch.isnan(out[:, 1:3].float()).all() and not torch.isnan(out[:, [0, 3]].float()).any()


@pytest.mark.parametrize("case", ["index_1d", "index_float", "no_experts", "too_many_experts"])
def test_moe_sort_errors(case):
    index = torch.zeros((4, 2), dtype=torch.int64)
    num_experts = 8
    expect = {"index_1d": (ValueError, "index must be a 2-D tensor"),
              "index_float": (TypeError, "index must be int32 or int64"),
              "no_experts": (ValueError, "num_experts must be at least 1"),
              "too_many_experts": (ValueError, "num_experts must be at most 4009")}[case]
    if case == "index_1d":
        index = index[0]
    elif case == "index_float":
        index = index.float()
    elif case == "no_experts":
        num_experts = 0
    elif case == "too_many_experts":
        if not HAS_CUDA:
            pytest.skip("the limit is the CUDA kernel's shared memory")
        index, num_experts = index.cuda(), 4010
    with pytest.raises(expect[0], match=expect[1]):
        fusebox.moe_sort(index, num_experts)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])])
def test_moe_sort_compiles_without_graph_breaks(device, gen):
    index = expert_index(gen, 9, 3, 8).to(device)
    torch._dynamo.reset()
    compiled = torch.compile(lambda i: fusebox.moe_sort(i, 8), fullgraph=True, dynamic=True)
    check_sort(compiled(index), index, 8)


# --------------------------------------------------------------------------- moe_topk


def check_topk(weights, index, logits, top_k, out_dtype=F32, **options):
    """weights against the float64 reference; the chosen experts' float64 choice scores, in the
    order chosen, equal to the reference's top_k (experts of choice scores equal in fp32 may come
    in either order), each expert once a token, none outside the chosen groups."""
    want, scores, choice = ref.moe_topk(logits, top_k, **options)
    assert weights.dtype == out_dtype and index.dtype == torch.int64
    assert weights.device == logits.device and index.device == logits.device
    assert index.shape == weights.shape == (logits.shape[0], top_k)
    got = index   # on the reference's device
    assert ((got >= 0) & (got < logits.shape[1])).all()
    assert (got.sort(-1).values.diff(dim=-1) != 0).all(), "an expert chosen twice"
    chosen, best = choice.gather(-1, got), choice.topk(top_k, dim=-1).values
    assert torch.isfinite(chosen).all(), "an expert outside the chosen groups"
    assert torch.allclose(chosen, best, rtol=1e-6, atol=1e-9), (chosen - best).abs().max()
    # the weights of the experts chosen (which a near-tie may swap with the reference's)
    got_weights = scores.gather(-1, got)
    if options.get("renormalize"):
        got_weights = got_weights / (got_weights.sum(-1, keepdim=True) + 1e-20)
    assert_close(weights, got_weights * options.get("scale", 1.0), out_dtype)
    assert_close(weights, want, out_dtype)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("num_experts,top_k", [(1, 1), (8, 2), (60, 4), (64, 6), (64, 8), (128, 8),
                                               (257, 9), (384, 8), (1024, 32)])
@pytest.mark.parametrize("tokens", [1, 37, 1000])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_moe_topk(device, gen, dtype, num_experts, top_k, tokens, score):
    logits = randn(gen, (tokens, num_experts), dtype, device, scale=2.0)
    weights, index = call(fusebox.moe_topk, logits, top_k, score)
    check_topk(weights, index, logits, top_k, score=score)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize("out", ["f32", "logits_dtype"])
def test_moe_topk_options(device, gen, dtype, renormalize, scale, out):
    """The softmax routers' forms: Mixtral (renormalized, fp32), Qwen / OLMoE (optionally
    renormalized, cast to the logits' dtype), DeepSeek-V2 (times the routing scale, fp32); logits
    read through a row stride."""
    out_dtype = F32 if out == "f32" else dtype
    logits = randn(gen, (301, 80), dtype, device, scale=3.0)[:, 5:69]
    weights, index = call(fusebox.moe_topk, logits, 6, renormalize=renormalize, scale=scale,
                          out_dtype=out_dtype)
    check_topk(weights, index, logits, 6, out_dtype, renormalize=renormalize, scale=scale)


@pytest.mark.parametrize("bias_dtype", [F32, BF16])
@pytest.mark.parametrize("experts,top_k,groups,topk_groups", [(256, 8, 8, 4), (64, 6, 1, 1), (160, 6, 8, 3),
                                                              (128, 8, 4, 1), (72, 4, 6, 6)])
def test_moe_topk_sigmoid_with_bias_and_groups(device, gen, bias_dtype, experts, top_k, groups, topk_groups):
    """DeepSeek-V3's form (Kimi K2's and GLM-4.5's with one group): sigmoid scores, the choice
    by score + bias within the groups whose two largest choice scores sum highest, the weights
    the scores without the bias, renormalized, times the routing scale; fp32 logits."""
    logits = randn(gen, (500, experts), F32, device, scale=2.0)
    bias = randn(gen, (experts,), bias_dtype, device, scale=0.3)
    options = dict(score="sigmoid", bias=bias, num_groups=groups, topk_groups=topk_groups,
                   renormalize=True, scale=2.5)
    weights, index = call(fusebox.moe_topk, logits, top_k, **options)
    check_topk(weights, index, logits, top_k, **options)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("experts,top_k,groups,topk_groups", [(8, 2, 1, 1), (64, 6, 1, 1), (100, 5, 1, 1),
                                                              (128, 8, 1, 1), (256, 8, 8, 4), (64, 6, 2, 1),
                                                              (160, 6, 5, 3), (96, 4, 3, 3), (512, 16, 16, 4)])
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_moe_topk_decode_sizes_cuda(gen, dtype, score, bias, experts, top_k, groups, topk_groups, tokens):
    """1-16 tokens: grouped routers whose chosen groups of 32 hold up to 128 experts take a block a
    token, slots by counting; routers without groups the warp kernel. Both give the reference's
    choices and weights, logits read through a row stride, renormalized or not."""
    logits = randn(gen, (tokens, experts + 8), dtype, "cuda", scale=2.0)[:, 3:3 + experts]
    options = dict(score=score, num_groups=groups, topk_groups=topk_groups, renormalize=bias, scale=2.5)
    if bias:
        options["bias"] = randn(gen, (experts,), F32, "cuda", scale=0.3)
    weights, index = call(fusebox.moe_topk, logits, top_k, **options)
    check_topk(weights, index, logits, top_k, **options)


@requires_cuda
@pytest.mark.gpu
def test_moe_topk_decode_sizes_ties_and_too_few_choices_cuda():
    """Decode sizes, groups of 32 (a block a token) and none: of equal groups the lower ones are
    chosen, of equal experts the lower first; a bias of -inf leaving fewer than top_k choices marks
    the rest NaN, expert -1."""
    flat = torch.zeros((2, 256), device="cuda")
    weights, index = call(fusebox.moe_topk, flat, 4, "sigmoid", num_groups=8, topk_groups=2)
    assert index.tolist() == [[0, 1, 2, 3]] * 2 and (weights == 0.5).all()
    logits = torch.full((1, 256), 0.5, device="cuda")
    logits[0, [200, 70, 71]] = 2.0   # groups 6 and 2 rank first; expert 70 before 71, both before 200
    _, index = call(fusebox.moe_topk, logits, 5, "sigmoid", num_groups=8, topk_groups=2)
    assert index[0].tolist() == [70, 71, 200, 64, 65]
    bias = torch.full((256,), float("-inf"), device="cuda")
    bias[[40, 5]] = 0.0
    weights, index = call(fusebox.moe_topk, torch.randn(3, 256, device="cuda"), 3, "sigmoid", bias,
                          num_groups=8, topk_groups=2)
    assert sorted(index[:, :2].flatten().tolist()) == [5, 5, 5, 40, 40, 40]
    assert (index[:, 2] == -1).all() and torch.isnan(weights[:, 2]).all()
    assert torch.isfinite(weights[:, :2]).all()
    logits = torch.full((1, 100), -4.0, dtype=BF16, device="cuda")
    logits[0, [67, 3, 35, 99]] = 1.5
    weights, index = call(fusebox.moe_topk, logits, 5)
    assert index[0].tolist() == [3, 35, 67, 99, 0] and weights[0, 0] == weights[0, 3]


def test_moe_topk_matches_the_routers(device, gen):
    """Against the routers' own code: indices equal (no near-equal scores in fp32 logits of this
    spread) and weights within a few fp32 ulps."""
    logits = randn(gen, (513, 64), F32, device, scale=4.0)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, top_index = torch.topk(probs, 8, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    weights, index = call(fusebox.moe_topk, logits, 8, renormalize=True)
    assert torch.equal(index, top_index)
    assert torch.allclose(weights, top, rtol=1e-6, atol=0), (weights - top).abs().max()


def test_moe_topk_equal_scores_take_the_lower_expert_first(device):
    """bf16 logits repeat often; of equal scores the lower expert comes first, across lanes
    (experts 3, 35, 67 of one lane group and others) and within one; of equally ranked groups the
    lower group."""
    logits = torch.full((2, 100), -4.0, dtype=BF16)
    logits[0, [67, 3, 35, 99]] = 1.5
    logits[1, [96, 64, 2]] = 0.75
    logits[1, 40] = 2.0
    weights, index = call(fusebox.moe_topk, logits.to(device), 5)
    assert index[0].tolist() == [3, 35, 67, 99, 0]
    assert index[1].tolist() == [40, 2, 64, 96, 0]
    assert weights[0, 0] == weights[0, 3] and weights[1, 1] == weights[1, 3]
    flat = torch.zeros((1, 64), device=device)   # 8 groups, all alike: groups 0 and 1 are chosen
    _, index = call(fusebox.moe_topk, flat, 4, "sigmoid", num_groups=8, topk_groups=2)
    assert index[0].tolist() == [0, 1, 2, 3]


def test_moe_topk_too_few_choices():
    """A bias of -inf leaves fewer than top_k experts to choose from: the CPU raises."""
    bias = torch.full((8,), float("-inf"))
    bias[:2] = 0.0
    with pytest.raises(ValueError, match=r"token 0 has fewer than top_k \(3\) experts to choose from"):
        fusebox.moe_topk(torch.randn(2, 8), 3, "sigmoid", bias)


@requires_cuda
@pytest.mark.gpu
def test_moe_topk_too_few_choices_cuda_marks_them():
    """CUDA cannot raise without a host sync: each missing choice is expert -1 with a NaN weight;
    the others are chosen as usual."""
    bias = torch.full((8,), float("-inf"), device="cuda")
    bias[[5, 2]] = 0.0
    weights, index = call(fusebox.moe_topk, torch.randn(2, 8, device="cuda"), 3, "sigmoid", bias)
    assert sorted(index[:, :2].flatten().tolist()) == [2, 2, 5, 5]
    assert (index[:, 2] == -1).all() and torch.isnan(weights[:, 2]).all()
    assert torch.isfinite(weights[:, :2]).all()


def test_moe_topk_empty(device):
    for tokens, top_k in ((0, 2), (3, 0)):
        weights, index = call(fusebox.moe_topk, torch.randn(tokens, 8, device=device), top_k)
        assert weights.shape == index.shape == (tokens, top_k)


@pytest.mark.parametrize("case", ["logits_1d", "logits_int", "too_many_experts", "k_over_experts",
                                  "k_over_32", "out_f16", "column_major", "score", "bias_shape",
                                  "groups_divide", "topk_groups", "groups_too_small"])
def test_moe_topk_errors(case):
    logits, top_k, kwargs = torch.randn(4, 16, dtype=BF16), 2, {}
    expect = {"logits_1d": (ValueError, "logits must be a 2-D tensor"),
              "logits_int": (TypeError, "logits must be float32, float16 or bfloat16"),
              "too_many_experts": (ValueError, "at most 1024 experts"),
              "k_over_experts": (ValueError, r"top_k \(index's columns\) must be at most the 16 experts"),
              "k_over_32": (ValueError, "and at most 32; got 33"),
              "out_f16": (ValueError, "weights must be bfloat16 or float32"),
              "column_major": (ValueError, "logits must have a contiguous last dimension"),
              "score": (ValueError, "score must be 'softmax' or 'sigmoid'; got 'tanh'"),
              "bias_shape": (ValueError, "bias must be a 1-D tensor of the 16 experts"),
              "groups_divide": (ValueError, "num_groups must divide the 16 experts"),
              "topk_groups": (ValueError, r"topk_groups must be 1-num_groups \(4\); got 5"),
              "groups_too_small": (ValueError, "2 chosen groups of 2 experts must hold top_k")}[case]
    if case == "logits_1d":
        logits = logits[0]
    elif case == "logits_int":
        logits = logits.int()
    elif case == "too_many_experts":
        logits = torch.randn(2, 1025)
    elif case == "k_over_experts":
        top_k = 17
    elif case == "k_over_32":
        logits, top_k = torch.randn(2, 64), 33
    elif case == "out_f16":
        kwargs = dict(out_dtype=F16)
    elif case == "column_major":
        logits = logits.t().contiguous().t()
    elif case == "score":
        kwargs = dict(score="tanh")
    elif case == "bias_shape":
        kwargs = dict(bias=torch.zeros(15))
    elif case == "groups_divide":
        kwargs = dict(num_groups=3)
    elif case == "topk_groups":
        kwargs = dict(num_groups=4, topk_groups=5)
    elif case == "groups_too_small":
        top_k, kwargs = 6, dict(num_groups=8, topk_groups=2)
    with pytest.raises(expect[0], match=expect[1]):
        fusebox.moe_topk(logits, top_k, **kwargs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])])
def test_moe_topk_compiles_without_graph_breaks(device, gen):
    logits = randn(gen, (9, 64), BF16, device)
    bias = randn(gen, (64,), F32, device, scale=0.1)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, b: (fusebox.moe_topk(x, 6, renormalize=True, out_dtype=x.dtype),
                                           fusebox.moe_topk(x.float(), 4, "sigmoid", b, 8, 2, True, 2.5)),
                             fullgraph=True, dynamic=True)
    (weights, index), (v3_weights, v3_index) = compiled(logits, bias)
    check_topk(weights, index, logits, 6, BF16, renormalize=True)
    check_topk(v3_weights, v3_index, logits.float(), 4, score="sigmoid", bias=bias, num_groups=8,
               topk_groups=2, renormalize=True, scale=2.5)
