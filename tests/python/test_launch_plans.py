"""Launch plans and kernel variants the tuning variables can force (FUSEBOX_NORM_ITEMS,
FUSEBOX_NORM_STAGE, FUSEBOX_ROPE_ITEMS, FUSEBOX_ACT_FLAT, FUSEBOX_NORM_FLAT, FUSEBOX_NORM_SHORT,
FUSEBOX_ROPE_SHORT, FUSEBOX_ROPE_EARLY, FUSEBOX_ADD_FLAT, FUSEBOX_MOE_ITEMS, FUSEBOX_MOE_CHUNK,
FUSEBOX_MOE_STAGE, FUSEBOX_MOE_SORT_TILE, FUSEBOX_MOE_SORT_WARPS, FUSEBOX_MOE_SORT_CLUSTER,
FUSEBOX_MOE_SORT_GRID, FUSEBOX_MOE_SORT_SMALL, used by scripts/tune.py): each still computes the
reference result on CUDA."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import requires_cuda

# Run in a child process: the core reads its tuning variables once per process.
_FORCED_PLAN_CHILD = """
import sys
import torch
sys.path[:0] = sys.argv[1:3]
import fusebox
import reference as ref
from helpers import BF16, F16, F32, assert_close, call, randn, small, weight


def check_gated_residual_norm(x, res, gate, scale, shift, w, b, norm_type, dtype, label):
    out, h = call(fusebox.gated_residual_norm, x, res, gate, scale, shift, w, b,
                  norm_type=norm_type, eps=1e-6)
    expect_out, expect_h = ref.gated_residual_norm(x, res, gate, scale, shift, w, b,
                                                   norm_type=norm_type, eps=1e-6)
    assert_close(h, expect_h, dtype, name=f"gated_residual_norm h{label}")
    assert_close(out, expect_out, dtype, name=f"gated_residual_norm{label}")

gen = torch.Generator().manual_seed(7)
for dtype in (BF16, F16, F32):
    for rows, width in ((3, 2048), (64, 3072), (130, 4096), (5, 769)):
        x = randn(gen, (rows, width), dtype, "cuda")
        res = randn(gen, (rows, width), dtype, "cuda")
        w, b = weight(gen, width, dtype, "cuda"), small(gen, (width,), dtype, "cuda")
        scale, shift = small(gen, (1, width), dtype, "cuda"), small(gen, (1, width), dtype, "cuda")
        assert_close(call(fusebox.layer_norm, x, w, b, eps=1e-5),
                     ref.layer_norm(x, w, b, eps=1e-5), dtype, name="layer_norm")
        assert_close(call(fusebox.rms_norm, x, w, eps=1e-6), ref.rms_norm(x, w, eps=1e-6), dtype,
                     name="rms_norm")
        # the weight offset (Gemma) and a LayerNorm with a weight and no bias
        assert_close(call(fusebox.rms_norm, x, b, eps=1e-6, weight_offset=1.0),
                     ref.rms_norm(x, b, eps=1e-6, weight_offset=1.0), dtype, name="rms_norm offset")
        assert_close(call(fusebox.layer_norm, x, w, None, eps=1e-5),
                     ref.layer_norm(x, w, None, eps=1e-5), dtype, name="layer_norm weight")
        assert_close(call(fusebox.adaln, x, scale, shift, w, b, norm_type="layer"),
                     ref.modulate(ref.layer_norm(x, w, b, eps=1e-6), scale, shift), dtype,
                     name="adaln")
        # per-row gate / scale / shift (per-token modulation) with a residual and a LayerNorm
        gate, tscale, tshift = (small(gen, (rows, width), dtype, "cuda") for _ in range(3))
        check_gated_residual_norm(x, res, gate, tscale, tshift, w, b, "layer", dtype, "")
        # the residual add alone (elementwise; the row kernel under FUSEBOX_ADD_FLAT=0 and at odd widths)
        assert_close(call(fusebox.gated_residual, x, res, gate), ref.gated_residual(x, res, gate), dtype,
                     name="gated_residual")
        normed, h = call(fusebox.fused_add_rms_norm, x, res, w, eps=1e-6)
        expect_normed, expect_h = ref.fused_add_rms_norm(x, res, w, eps=1e-6)
        assert_close(h, expect_h, dtype, name="h")
        assert_close(normed, expect_normed, dtype, name="fused_add_rms_norm")
    # rows past half a wave of resident threads: the 4-vector plans of the modulated rows
    # (their 64-register kernel), per sample and per token (5120: 4 vectors even
    # per token), the modulation in x's dtype or fp32
    for rows, width in ((700, 2048), (300, 5120)):
        x = randn(gen, (rows, width), dtype, "cuda")
        for mod_dtype in (dtype, F32):
            for mod_rows in (1, rows):
                scale = small(gen, (mod_rows, width), mod_dtype, "cuda")
                shift = small(gen, (mod_rows, width), mod_dtype, "cuda")
                for norm_type in ("rms", "layer"):
                    assert_close(call(fusebox.adaln, x, scale, shift, norm_type=norm_type),
                                 ref.modulate(ref.norm(norm_type, x), scale, shift), dtype,
                                 name=f"adaln {norm_type} {rows}x{width} {mod_dtype} modulation")
                    # the residual + modulated rows without a weight or bias (gate, scale and
                    # shift only: their compile-time twins on the 2-4 vector plans)
                    res = randn(gen, (rows, width), dtype, "cuda")
                    gate = small(gen, (mod_rows, width), mod_dtype, "cuda")
                    check_gated_residual_norm(x, res, gate, scale, shift, None, None, norm_type,
                                              dtype, ", no affine")
                # a LayerNorm's weight and bias with the modulation (CogVideoX): no twin, the
                # operands read at use by default, staged under FUSEBOX_NORM_STAGE=1
                w, b = weight(gen, width, mod_dtype, "cuda"), small(gen, (width,), mod_dtype, "cuda")
                assert_close(call(fusebox.adaln, x, scale, shift, w, b, norm_type="layer"),
                             ref.modulate(ref.layer_norm(x, w, b, eps=1e-6), scale, shift), dtype,
                             name=f"adaln layer affine {rows}x{width} {mod_dtype} modulation")
                check_gated_residual_norm(x, res, gate, scale, shift, w, b, "layer", dtype,
                                          ", affine")
    for tokens, heads, kv_heads in ((1, 32, 8), (300, 32, 8), (40, 24, 24)):
        q = randn(gen, (1, tokens, heads, 128), dtype, "cuda")
        k = randn(gen, (1, tokens, kv_heads, 128), dtype, "cuda")
        cos, sin = randn(gen, (1, tokens, 128), dtype, "cuda"), randn(gen, (1, tokens, 128), dtype, "cuda")
        qw, kw = weight(gen, 128, dtype, "cuda"), weight(gen, 128, dtype, "cuda")
        for interleaved in (False, True):
            q_out, k_out = call(fusebox.rope, q, k, cos, sin, interleaved=interleaved)
            assert_close(q_out, ref.rope(q, cos, sin, interleaved), dtype, name="rope q")
            assert_close(k_out, ref.rope(k, cos, sin, interleaved), dtype, name="rope k")
            q_out, k_out = call(fusebox.qk_norm_rope, q, k, qw, kw, cos, sin, eps=1e-6,
                                interleaved=interleaved)
            assert_close(q_out, ref.qk_norm_rope(q, qw, cos, sin, 1e-6, False, interleaved),
                         dtype, name="qk_norm_rope q")
            assert_close(k_out, ref.qk_norm_rope(k, kw, cos, sin, 1e-6, False, interleaved),
                         dtype, name="qk_norm_rope k")
        # one norm across every head of q (of k): OLMo-2, LTX-Video (decode-sized: the short
        # kernel, a block a tensor, unless FUSEBOX_ROPE_SHORT=0; its half-split units with the
        # rotation factors loaded after the sum under FUSEBOX_ROPE_EARLY=0), with GQA
        qw_all, kw_all = weight(gen, heads * 128, dtype, "cuda"), weight(gen, kv_heads * 128, dtype, "cuda")
        for interleaved in (False, True):
            q_out, k_out = call(fusebox.qk_norm_rope, q, k, qw_all, kw_all, cos, sin, eps=1e-6,
                                across_heads=True, interleaved=interleaved)
            assert_close(q_out, ref.qk_norm_rope(q, qw_all, cos, sin, 1e-6, True, interleaved),
                         dtype, name="qk_norm_rope q across heads")
            assert_close(k_out, ref.qk_norm_rope(k, kw_all, cos, sin, 1e-6, True, interleaved),
                         dtype, name="qk_norm_rope k across heads")
        if dtype != F32:  # fp32 tables with 16-bit data: twice the bytes per rotation factor
            cos32, sin32 = cos.float(), sin.float()
            for interleaved in (False, True):
                q_out, k_out = call(fusebox.rope, q, k, cos32, sin32, interleaved=interleaved)
                assert_close(q_out, ref.rope(q, cos32, sin32, interleaved), dtype, name="rope q, fp32 tables")
                assert_close(k_out, ref.rope(k, cos32, sin32, interleaved), dtype, name="rope k, fp32 tables")
                q_out, k_out = call(fusebox.qk_norm_rope, q, k, qw, kw, cos32, sin32, eps=1e-6,
                                    interleaved=interleaved)
                assert_close(q_out, ref.qk_norm_rope(q, qw, cos32, sin32, 1e-6, False, interleaved),
                             dtype, name="qk_norm_rope q, fp32 tables")
                assert_close(k_out, ref.qk_norm_rope(k, kw, cos32, sin32, 1e-6, False, interleaved),
                             dtype, name="qk_norm_rope k, fp32 tables")
                q_out, k_out = call(fusebox.qk_norm_rope, q, k, qw_all, kw_all, cos32, sin32, eps=1e-6,
                                    across_heads=True, interleaved=interleaved)  # OLMo-2
                assert_close(q_out, ref.qk_norm_rope(q, qw_all, cos32, sin32, 1e-6, True, interleaved),
                             dtype, name="qk_norm_rope q across heads, fp32 tables")
                assert_close(k_out, ref.qk_norm_rope(k, kw_all, cos32, sin32, 1e-6, True, interleaved),
                             dtype, name="qk_norm_rope k across heads, fp32 tables")
    # activations: packed rows (one long row unless FUSEBOX_ACT_FLAT=0), a bias and a strided
    # input (the row plan either way), odd widths
    for rows, width in ((1, 11008), (37, 4104), (9, 1001)):
        gate, up = randn(gen, (rows, width), dtype, "cuda"), randn(gen, (rows, width), dtype, "cuda")
        for name in ("silu", "gelu_tanh"):
            assert_close(call(fusebox.gated_activation, gate, up, name),
                         ref.gated_act(gate, up, name), dtype, name=f"gated {name}")
        bias = small(gen, (width,), dtype, "cuda")
        assert_close(call(fusebox.activation, gate, bias, "gelu_tanh"),
                     ref.bias_act(gate, bias, "gelu_tanh"), dtype, name="bias gelu_tanh")
        packed = randn(gen, (rows, 2 * width), dtype, "cuda")
        assert_close(call(fusebox.gated_activation, packed[:, :width], packed[:, width:], "silu"),
                     ref.gated_act(packed[:, :width], packed[:, width:], "silu"), dtype,
                     name="gated strided")
    # the MoE combine: 1-4 vectors a thread, row chunks of 32-256 threads, 1-8 of its rows a token
    for tokens, top_k, width in ((1, 8, 2048), (16, 6, 2048), (33, 2, 4104), (5, 9, 1001), (300, 6, 2048),
                                  (300, 2, 4104)):
        rows = randn(gen, (tokens * top_k, width), dtype, "cuda")
        index = torch.randperm(tokens * top_k, generator=gen).view(tokens, top_k).cuda()
        weights = torch.rand((tokens, top_k), generator=gen).cuda()
        assert_close(call(fusebox.moe_combine, rows, index, weights), ref.moe_combine(rows, index, weights),
                     dtype, name="moe_combine")
# the MoE sort: tiles of 32 pairs up to one block for all, of 1 to 32 warps, clusters of 2 to 16
# blocks (sm_90+), one cooperative launch or two, the decode kernels
# (one round by shuffles, two or four ranked, blocks with fewer expert warps than rounds) or none;
# equal to the stable sort
for tokens, top_k, num_experts in ((1, 8, 64), (8, 6, 100), (16, 8, 256), (21, 6, 1000), (16, 6, 64), (13, 5, 8),
                                   (300, 6, 64), (2048, 8, 257), (777, 3, 5)):
    index = torch.randint(0, num_experts, (tokens, top_k), generator=gen).cuda()
    got = fusebox.moe_sort(index, num_experts)
    for name, g, w in zip(("row_token", "offsets", "pair_row"), got, ref.moe_sort(index, num_experts)):
        assert torch.equal(g.cpu().long(), w.cpu().long()), (name, tokens, top_k, num_experts)
print("ok")
"""


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["FUSEBOX_NORM_ITEMS=1", "FUSEBOX_NORM_ITEMS=2", "FUSEBOX_NORM_ITEMS=3",
                                     "FUSEBOX_NORM_ITEMS=4",
                                     "FUSEBOX_NORM_ITEMS=8", "FUSEBOX_NORM_STAGE=0", "FUSEBOX_NORM_STAGE=1",
                                     "FUSEBOX_ROPE_ITEMS=1",
                                     "FUSEBOX_ROPE_ITEMS=2", "FUSEBOX_ROPE_ITEMS=4",
                                     "FUSEBOX_ACT_FLAT=0", "FUSEBOX_ACT_FLAT=1", "FUSEBOX_NORM_FLAT=0",
                                     "FUSEBOX_NORM_SHORT=0", "FUSEBOX_ROPE_SHORT=0", "FUSEBOX_ROPE_SHORT=2",
                                     "FUSEBOX_ROPE_EARLY=0", "FUSEBOX_ADD_FLAT=0", "FUSEBOX_ADD_FLAT=2",
                                     "FUSEBOX_MOE_ITEMS=1", "FUSEBOX_MOE_ITEMS=4", "FUSEBOX_MOE_CHUNK=32",
                                     "FUSEBOX_MOE_CHUNK=64", "FUSEBOX_MOE_STAGE=0",
                                     "FUSEBOX_MOE_SORT_TILE=32", "FUSEBOX_MOE_SORT_TILE=300",
                                     "FUSEBOX_MOE_SORT_TILE=1000000", "FUSEBOX_MOE_SORT_WARPS=1",
                                     "FUSEBOX_MOE_SORT_WARPS=8", "FUSEBOX_MOE_SORT_WARPS=32",
                                     "FUSEBOX_MOE_SORT_CLUSTER=0", "FUSEBOX_MOE_SORT_CLUSTER=8",
                                     "FUSEBOX_MOE_SORT_CLUSTER=2,FUSEBOX_MOE_SORT_TILE=1024",
                                     "FUSEBOX_MOE_SORT_GRID=0", "FUSEBOX_MOE_SORT_GRID=1,FUSEBOX_MOE_SORT_CLUSTER=0",
                                     "FUSEBOX_MOE_SORT_GRID=1,FUSEBOX_PDL=0",
                                     "FUSEBOX_MOE_SORT_SMALL=0",
                                     "FUSEBOX_MOE_SORT_SMALL=64", "FUSEBOX_MOE_SORT_SMALL=32"])
def test_forced_launch_plans_cuda(setting):
    """Every plan the tuning variables can force gives the reference result (NORM_ITEMS=8
    applies to ops without a residual, NORM_ITEMS=3 to 16-bit rows with fp32 modulation; the
    others keep their default plan; comma-separated variables are set together: a cluster of 2
    blocks takes at most 2 x 1024 pairs). Named for `-k cuda`, which selects the CUDA cases of the
    other tests by their device parameter."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ, **dict(kv.split("=") for kv in setting.split(",")))
    child = subprocess.run(
        [sys.executable, "-c", _FORCED_PLAN_CHILD, str(here), str(here.parents[1] / "torch-ext")],
        env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0 and child.stdout.strip().endswith("ok"), child.stderr[-3000:]
