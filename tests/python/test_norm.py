"""Normalization family: rms_norm, fused_add_rms_norm, layer_norm, adaln, gated_residual,
gated_residual_norm, their seed aliases, and agreement with transformers/diffusers modules."""

import pytest
import torch
import torch.nn.functional as F

import fusebox
import reference as ref
from helpers import (
    BF16, DTYPE_CASES, DTYPES, F16, F32, LAYOUTS, MOD_KINDS, ODD_ROWS, WIDTHS, assert_close,
    big_rows, call, make_input, modulation, randn, small, weight,
)

NORM_TYPES = ["rms", "layer"]
AFFINE = ["none", "weight", "weight_bias", "bias"]


def affine_params(gen, kind, d, dtype, device):
    w = weight(gen, d, dtype, device) if kind in ("weight", "weight_bias") else None
    b = small(gen, (d,), dtype, device) if kind in ("weight_bias", "bias") else None
    return w, b


# --------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", ODD_ROWS)
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "noweight"])
def test_rms_norm(device, gen, dtypes, width, rows, with_weight):
    xd, pd = dtypes
    x = randn(gen, (rows, width), xd, device)
    w = weight(gen, width, pd, device) if with_weight else None
    out = call(fusebox.rms_norm, x, w, eps=1e-6)
    assert_close(out, ref.rms_norm(x, w, 1e-6), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("width", [7, 769, 4096])
def test_rms_norm_layouts(device, gen, dtypes, layout, width):
    xd, pd = dtypes
    x = make_input(gen, layout, (3, 5, width), xd, device)
    w = weight(gen, width, pd, device)
    assert_close(call(fusebox.rms_norm, x, w), ref.rms_norm(x, w), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("rows", [17, 2100])  # 2100x2048: past a wave, the 2-vector plan on CUDA
def test_rms_norm_gemma_weight_offset(device, gen, dtypes, rows):
    xd, pd = dtypes
    width = 640 if rows == 17 else 2048
    x = randn(gen, (rows, width), xd, device)
    w = small(gen, (width,), pd, device)  # Gemma stores w around 0 and scales by (1 + w)
    out = call(fusebox.rms_norm, x, w, eps=1e-6, weight_offset=1.0)
    assert_close(out, ref.rms_norm(x, w, 1e-6, weight_offset=1.0), xd)


@pytest.mark.parametrize("xd", [F16, BF16, F32])
@pytest.mark.parametrize("pd", [F32, "x"])
def test_rms_norm_out_dtype_float32(device, gen, xd, pd):
    pd = xd if pd == "x" else pd
    x = randn(gen, (5, 1000), xd, device)
    w = weight(gen, 1000, pd, device)
    out = call(fusebox.rms_norm, x, w, out_dtype=torch.float32)
    assert_close(out, ref.rms_norm(x, w), F32)
    same = call(fusebox.rms_norm, x, w, out_dtype=xd)
    assert_close(same, ref.rms_norm(x, w), xd)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_eps(device, gen, dtype):
    # mean(x^2) ~ 1e-6: the result depends strongly on eps, so a wrong or ignored eps fails.
    x = make_input(gen, "contiguous", (9, 300), dtype, device, scale=1e-3)
    w = weight(gen, 300, dtype, device)
    assert_close(call(fusebox.rms_norm, x, w), ref.rms_norm(x, w, 1e-6), dtype)  # default
    assert_close(call(fusebox.rms_norm, x, w, eps=1e-4), ref.rms_norm(x, w, 1e-4), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)])
def test_rms_norm_empty(device, gen, dtype, shape):
    x = torch.empty(shape, dtype=dtype, device=device)
    w = weight(gen, 64, dtype, device)
    out = call(fusebox.rms_norm, x, w)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    out = call(fusebox.rms_norm, x, w, out_dtype=torch.float32)
    assert out.shape == x.shape and out.dtype == F32


@pytest.mark.large
@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("width", [5125, 16384])
def test_rms_norm_large(device, gen, dtypes, width):
    xd, pd = dtypes
    x = randn(gen, (big_rows(device), width), xd, device)
    w = weight(gen, width, pd, device)
    assert_close(call(fusebox.rms_norm, x, w), ref.rms_norm(x, w), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
def test_plans_between_half_and_full_wave(device, gen, dtypes):
    """Calls of half a wave to two waves of resident threads on an H100/H200, where the default
    plan depends on the op: RMSNorm without a weight takes 2 vectors per thread (1 on GPUs of less
    DRAM bandwidth an SM, such as the H100), with a weight 1, a gated residual of 640 vectors a row
    2, and a residual add + RMSNorm the short rows of one vector a thread up to two waves (the
    smaller CPU rows check the same semantics)."""
    xd, pd = dtypes
    rows = 1024 if torch.device(device).type == "cuda" else 6
    x = randn(gen, (rows, 2048), xd, device)
    assert_close(call(fusebox.rms_norm, x, None), ref.rms_norm(x, None), xd, name="no weight")
    x = randn(gen, (rows // 2, 4096), xd, device)
    w = weight(gen, 4096, pd, device)
    assert_close(call(fusebox.rms_norm, x, w), ref.rms_norm(x, w), xd, name="weight")
    shape = (2, rows // 2, 5120)
    x, branch = randn(gen, shape, xd, device), randn(gen, shape, xd, device)
    gate = modulation(gen, "sample", shape, 1, pd, device)[0]
    assert_close(call(fusebox.gated_residual, x, branch, gate), ref.gated_residual(x, branch, gate), xd,
                 name="gated_residual")
    for shape, with_weight in (((rows // 2, 4096), True), ((2 * rows, 2048), True), ((2 * rows, 2048), False)):
        x, res = randn(gen, shape, xd, device), randn(gen, shape, xd, device, scale=4.0)
        check_fused_add(x, res, weight(gen, shape[1], pd, device) if with_weight else None)


# Calls of more than one wave of resident threads on an H100/H200 (the CPU rows check the same
# semantics): 16-bit rows take the 2- and 4-vector plans, whose small operands are held in
# registers, staged in shared memory or read at their use depending on op, width and dtype.
# One sample makes the rows one group even with per-sample modulation: the plans' flat twins.
# Among them the register-bounded 4-vector twins: LayerNorm alone with 16-bit (4096) or fp32
# (1536) operands, the residual + modulated norms with fp32 operands (3072), and the per-token
# rows of 192 vectors, which take 4 vectors a thread with fp32 modulation. With fp32 per-sample
# modulation the 1536- and 768-wide 16-bit rows take 3 vectors a thread (64-thread rows, and
# 32-thread rows four to a block).
BEYOND_ONE_WAVE = ["rms_weight_2048", "rms_weight_4096", "layer_affine_1536", "layer_affine_2048",
                   "layer_affine_4096", "adaln_sample_3072", "adaln_sample_1536", "adaln_token_1536",
                   "adaln_token_5120", "gated_residual_norm_sample_3072", "gated_residual_norm_rms_sample_3072",
                   "gated_residual_norm_sample_1536", "gated_residual_norm_rms_sample_1536", "adaln_sample_768",
                   "gated_residual_norm_sample_768"]


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("case", BEYOND_ONE_WAVE)
@pytest.mark.parametrize("samples", [2, 1])
def test_plans_beyond_one_wave(device, gen, dtypes, case, samples):
    xd, pd = dtypes
    kind, width = case.rsplit("_", 1)
    width = int(width)
    shape = (samples, (2304 if torch.device(device).type == "cuda" else 6) // samples, width)
    x = randn(gen, shape, xd, device)
    if kind in ("rms_weight", "layer_affine"):
        w, b = affine_params(gen, "weight" if kind == "rms_weight" else "weight_bias", width, pd, device)
        if kind == "rms_weight":
            assert_close(call(fusebox.rms_norm, x, w), ref.rms_norm(x, w), xd)
        else:
            assert_close(call(fusebox.layer_norm, x, w, b), ref.layer_norm(x, w, b), xd)
    elif kind.startswith("adaln"):
        scale, shift = modulation(gen, "token_chunk" if kind == "adaln_token" else "sample", shape, 2,
                                  pd, device)
        out = call(fusebox.adaln, x, scale, shift, norm_type="layer")
        assert_close(out, ref.modulate(ref.norm("layer", x), scale, shift), xd)
    else:
        branch = randn(gen, shape, xd, device)
        gate, scale, shift = modulation(gen, "sample", shape, 3, pd, device)
        check_gated_residual_norm(x, branch, gate, scale, shift, norm_type="rms" if "rms" in kind else "layer")


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("shape", [(3, 7, 256), (4, 5, 64), (2, 33, 2048), (2, 6001, 2048), (3, 1901, 3072),
                                   (2, 4300, 1536), (2, 1000, 2048)])
@pytest.mark.parametrize("kind", ["sample", "sample_chunk"])
def test_sample_batches(device, gen, dtypes, shape, kind):
    """Modulated rows of several samples, each with its own modulation row, with rows per sample
    that the rows a block stacks do not divide, contiguous and as a strided view of longer
    sequences. On an H100 / H200 the 2x6001x2048 rows span more than two waves of threads in every
    dtype and take the sample walk (the sample from the grid, no row split; 64- and 128-thread
    rows), and so do 3x1901x3072's (96-thread 16-bit rows, a thread count that is not a power of
    two, just past two waves; 192-thread fp32 rows), and 2x4300x1536's 16-bit rows, which take
    three vectors a thread with fp32 modulation (64-thread rows); the gated add alone takes the
    sample walk on all three. 2x1000x2048's residual + modulated 16-bit rows take the split at two
    vectors a thread (fp16's 80-register kernel of 128-thread blocks); the smaller shapes check
    the split too. The CPU rows check the same semantics on fewer rows."""
    xd, pd = dtypes
    if torch.device(device).type != "cuda":
        shape = (shape[0], min(shape[1], 9), shape[2])
    big = randn(gen, (shape[0], shape[1] + 3, shape[2]), xd, device)
    for name, x in (("contiguous", randn(gen, shape, xd, device)), ("strided", big[:, 1:1 + shape[1]])):
        for norm in ("rms", "layer"):
            scale, shift = modulation(gen, kind, shape, 2, pd, device)
            out = call(fusebox.adaln, x, scale, shift, norm_type=norm)
            assert_close(out, ref.modulate(ref.norm(norm, x), scale, shift), xd, name=f"adaln {norm} {name}")
            branch = randn(gen, shape, xd, device)
            gate, scale, shift = modulation(gen, kind, shape, 3, pd, device)
            check_gated_residual_norm(x, branch, gate, scale, shift, norm_type=norm)
        # the gated add alone (also the sample walk on the large shapes: one to two vectors a
        # thread, 192- to 512-thread rows)
        out = call(fusebox.gated_residual, x, branch, gate)
        assert_close(out, ref.gated_residual(x, branch, gate), xd, name=f"gated_residual {name}")


# --------------------------------------------------------------------------- fused_add_rms_norm


def check_fused_add(x, res, w, eps=1e-6, weight_offset=0.0):
    normed, h = call(fusebox.fused_add_rms_norm, x, res, w, eps=eps, weight_offset=weight_offset)
    ref_normed, ref_h = ref.fused_add_rms_norm(x, res, w, eps, weight_offset)
    assert_close(h, ref_h, x.dtype, name="h")
    assert_close(normed, ref_normed, x.dtype, name="normed")
    # h is x + residual computed in fp32 and rounded once, exactly what torch's add gives.
    assert torch.equal(h, x + res), "h differs from x + residual"


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", ODD_ROWS)
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "noweight"])
def test_fused_add_rms_norm(device, gen, dtypes, width, rows, with_weight):
    xd, pd = dtypes
    x = randn(gen, (rows, width), xd, device)
    res = randn(gen, (rows, width), xd, device, scale=4.0)
    w = weight(gen, width, pd, device) if with_weight else None
    check_fused_add(x, res, w)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("x_layout", LAYOUTS)
@pytest.mark.parametrize("res_layout", LAYOUTS)
def test_fused_add_rms_norm_layouts(device, gen, dtypes, x_layout, res_layout):
    xd, pd = dtypes
    x = make_input(gen, x_layout, (3, 5, 777), xd, device)
    res = make_input(gen, res_layout, (3, 5, 777), xd, device)
    check_fused_add(x, res, weight(gen, 777, pd, device))


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
def test_fused_add_rms_norm_gemma(device, gen, dtypes):
    xd, pd = dtypes
    x, res = randn(gen, (17, 512), xd, device), randn(gen, (17, 512), xd, device)
    check_fused_add(x, res, small(gen, (512,), pd, device), eps=1e-5, weight_offset=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_empty(device, gen, dtype):
    x = torch.empty((0, 96), dtype=dtype, device=device)
    w = weight(gen, 96, dtype, device)
    normed, h = call(fusebox.fused_add_rms_norm, x, torch.empty_like(x), w)
    for t in (normed, h):
        assert t.shape == (0, 96) and t.dtype == dtype


@pytest.mark.large
@pytest.mark.parametrize("dtypes", DTYPE_CASES)
def test_fused_add_rms_norm_large(device, gen, dtypes):
    xd, pd = dtypes
    shape = (big_rows(device), 16384)
    check_fused_add(randn(gen, shape, xd, device), randn(gen, shape, xd, device),
                    weight(gen, 16384, pd, device))


# --------------------------------------------------------------------------- rms_norm_add


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", ODD_ROWS)
def test_rms_norm_add(device, gen, dtypes, width, rows):
    xd, pd = dtypes
    x = randn(gen, (rows, width), xd, device, scale=3.0)
    res = randn(gen, (rows, width), xd, device)
    w = weight(gen, width, pd, device)
    out = call(fusebox.rms_norm_add, x, res, w)
    assert_close(out, ref.rms_norm_add(x, res, w), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("x_layout", LAYOUTS)
@pytest.mark.parametrize("res_layout", LAYOUTS)
def test_rms_norm_add_layouts(device, gen, dtypes, x_layout, res_layout):
    xd, pd = dtypes
    x = make_input(gen, x_layout, (3, 5, 2560), xd, device)
    res = make_input(gen, res_layout, (3, 5, 2560), xd, device)
    w = small(gen, (2560,), pd, device)
    out = call(fusebox.rms_norm_add, x, res, w, eps=1e-5, weight_offset=1.0)   # Gemma's (1 + w)
    assert_close(out, ref.rms_norm_add(x, res, w, 1e-5, 1.0), xd)


# --------------------------------------------------------------------------- layer_norm


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", ODD_ROWS)
@pytest.mark.parametrize("affine", AFFINE)
def test_layer_norm(device, gen, dtypes, width, rows, affine):
    xd, pd = dtypes
    x = randn(gen, (rows, width), xd, device, scale=2.0, offset=0.5)
    w, b = affine_params(gen, affine, width, pd, device)
    out = call(fusebox.layer_norm, x, w, b, eps=1e-5)
    if width == 1 and affine in ("none", "weight"):
        # A width-1 row normalizes to exactly 0 (x - mean == 0): no relative error to take.
        assert out.shape == x.shape and out.dtype == xd and torch.isfinite(out).all()
        assert (out == 0).all()
        return
    assert_close(out, ref.layer_norm(x, w, b, 1e-5), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("width", [2560, 3072])
def test_layer_norm_llm_rows(device, gen, dtypes, affine, rows, width):
    # Decode-sized LLM rows (Phi-2, StarCoder2-3B): one vector a thread in blocks of 10-12
    # warps on a GPU (the short rows for 16-bit operands), strided rows included.
    xd, pd = dtypes
    w, b = affine_params(gen, affine, width, pd, device)
    x = randn(gen, (rows, width), xd, device, scale=2.0, offset=0.5)
    assert_close(call(fusebox.layer_norm, x, w, b, eps=1e-5), ref.layer_norm(x, w, b, 1e-5), xd)
    x = make_input(gen, "row_slice", (rows, 1, width), xd, device)
    assert_close(call(fusebox.layer_norm, x, w, b, eps=1e-5), ref.layer_norm(x, w, b, 1e-5), xd,
                 name="row_slice")


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("width", [7, 769, 4096])
def test_layer_norm_layouts(device, gen, dtypes, layout, width):
    xd, pd = dtypes
    x = make_input(gen, layout, (3, 5, width), xd, device)
    w, b = affine_params(gen, "weight_bias", width, pd, device)
    assert_close(call(fusebox.layer_norm, x, w, b), ref.layer_norm(x, w, b, 1e-5), xd)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_eps(device, gen, dtype):
    # var(x) ~ 1e-5: the default eps (1e-5, unlike the 1e-6 of the rms ops) matters.
    x = make_input(gen, "contiguous", (9, 300), dtype, device, scale=3e-3)
    assert_close(call(fusebox.layer_norm, x), ref.layer_norm(x, eps=1e-5), dtype)
    assert_close(call(fusebox.layer_norm, x, eps=1e-3), ref.layer_norm(x, eps=1e-3), dtype)


def test_layer_norm_offset_mean_fp32(device, gen):
    # Rows with mean 8 and std 1: the variance must not be computed as E[x^2] - E[x]^2, which
    # cancels in fp32 (rel ~4e-5 here); a two-pass or Welford variance stays near 4e-6 even
    # with serial fp32 sums.
    x = randn(gen, (7, 1024), F32, device, offset=8.0)
    w, b = affine_params(gen, "weight_bias", 1024, F32, device)
    assert_close(call(fusebox.layer_norm, x, w, b), ref.layer_norm(x, w, b, 1e-5), F32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1024, 4096])
def test_layer_norm_outlier_first_element(device, gen, dtype, width):
    # Mean 8, std 1, and a first element 300 (width 1024) or 1000 (4096) std above: the
    # worst pivot for moments taken about a row's first element (16-bit rows), whose
    # cancellation must stay under the output's rounding; fp32 rows take two row sums.
    x = randn(gen, (6, width), F32, device, offset=8.0)
    x[:, 0] += 300.0 if width == 1024 else 1000.0
    x = x.to(dtype)
    w, b = affine_params(gen, "weight_bias", width, dtype, device)
    assert_close(call(fusebox.layer_norm, x, w, b), ref.layer_norm(x, w, b, 1e-5), dtype)


@pytest.mark.parametrize("xd", [F16, BF16])
def test_layer_norm_out_dtype_float32(device, gen, xd):
    x = randn(gen, (5, 1000), xd, device)
    w, b = affine_params(gen, "weight_bias", 1000, xd, device)
    out = call(fusebox.layer_norm, x, w, b, out_dtype=torch.float32)
    assert_close(out, ref.layer_norm(x, w, b), F32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_empty(device, gen, dtype):
    x = torch.empty((2, 0, 48), dtype=dtype, device=device)
    w, b = affine_params(gen, "weight_bias", 48, dtype, device)
    out = call(fusebox.layer_norm, x, w, b)
    assert out.shape == x.shape and out.dtype == dtype


@pytest.mark.large
@pytest.mark.parametrize("dtypes", DTYPE_CASES)
def test_layer_norm_large(device, gen, dtypes):
    xd, pd = dtypes
    x = randn(gen, (big_rows(device), 16384), xd, device)
    w, b = affine_params(gen, "weight_bias", 16384, pd, device)
    assert_close(call(fusebox.layer_norm, x, w, b), ref.layer_norm(x, w, b), xd)


# --------------------------------------------------------------------------- adaln


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("kind", MOD_KINDS)
@pytest.mark.parametrize("with_shift", [True, False], ids=["shift", "noshift"])
@pytest.mark.parametrize("width", [7, 769])
def test_adaln(device, gen, dtypes, norm_type, kind, with_shift, width):
    xd, pd = dtypes
    shape = (2, 5, width)
    x = randn(gen, shape, xd, device)
    scale, shift = modulation(gen, kind, shape, 2, pd, device)
    shift = shift if with_shift else None
    out = call(fusebox.adaln, x, scale, shift, norm_type=norm_type, eps=1e-6)
    assert_close(out, ref.modulate(ref.norm(norm_type, x, eps=1e-6), scale, shift), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("kind", ["sample", "sample_chunk", "token"])
def test_adaln_rows_past_a_wave(device, gen, dtypes, norm_type, kind):
    """LTX's rows (2048 wide) past half the resident threads, where the plan holds the small
    operands in registers (2 vectors a thread: 16-bit RMS rows) or stages them (3-4)."""
    xd, pd = dtypes
    shape = (2, 1500, 2048)
    x = randn(gen, shape, xd, device)
    scale, shift = modulation(gen, kind, shape, 2, pd, device)
    out = call(fusebox.adaln, x, scale, shift, norm_type=norm_type, eps=1e-6)
    assert_close(out, ref.modulate(ref.norm(norm_type, x, eps=1e-6), scale, shift), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_adaln_affine(device, gen, dtypes, norm_type, affine, weight_offset):
    xd, pd = dtypes
    shape = (3, 7, 640)
    x = randn(gen, shape, xd, device)
    w, b = affine_params(gen, affine, 640, pd, device)
    scale, shift = modulation(gen, "sample_chunk", shape, 2, pd, device)
    out = call(fusebox.adaln, x, scale, shift, w, b, norm_type=norm_type, eps=1e-5,
               weight_offset=weight_offset)
    expect = ref.modulate(ref.norm(norm_type, x, w, b, 1e-5, weight_offset), scale, shift)
    assert_close(out, expect, xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("layout", ["row_slice", "swapped"])
@pytest.mark.parametrize("kind", ["sample_chunk", "token_chunk"])
def test_adaln_strided_x(device, gen, dtypes, norm_type, layout, kind):
    xd, pd = dtypes
    shape = (3, 9, 1536)
    x = make_input(gen, layout, shape, xd, device)
    scale, shift = modulation(gen, kind, shape, 2, pd, device)
    out = call(fusebox.adaln, x, scale, shift, norm_type=norm_type)
    assert_close(out, ref.modulate(ref.norm(norm_type, x), scale, shift), xd)


@pytest.mark.parametrize("xd", [F16, BF16])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_adaln_out_dtype_float32(device, gen, xd, norm_type):
    shape = (2, 5, 384)
    x = randn(gen, shape, xd, device)
    scale, shift = modulation(gen, "sample", shape, 2, F32, device)
    out = call(fusebox.adaln, x, scale, shift, norm_type=norm_type, out_dtype=torch.float32)
    assert_close(out, ref.modulate(ref.norm(norm_type, x), scale, shift), F32)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_adaln_empty(device, gen, norm_type):
    x = torch.empty((2, 0, 64), dtype=BF16, device=device)
    scale, shift = modulation(gen, "sample", (2, 1, 64), 2, F32, device)
    out = call(fusebox.adaln, x, scale, shift, norm_type=norm_type)
    assert out.shape == x.shape and out.dtype == BF16


@pytest.mark.large
@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_adaln_large(device, gen, dtypes, norm_type):
    xd, pd = dtypes
    shape = (2, big_rows(device), 5125)
    x = randn(gen, shape, xd, device)
    scale, shift = modulation(gen, "token_chunk", shape, 2, pd, device)
    out = call(fusebox.adaln, x, scale, shift, norm_type=norm_type)
    assert_close(out, ref.modulate(ref.norm(norm_type, x), scale, shift), xd)


# --------------------------------------------------------------------------- gated_residual


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("gate_kind", ["none", *MOD_KINDS])
@pytest.mark.parametrize("width", [1, 7, 769, 2048, 5125])  # 2048: whole vectors (FUSEBOX_ADD_FLAT)
def test_gated_residual(device, gen, dtypes, gate_kind, width):
    xd, pd = dtypes
    shape = (2, 5, width)
    x, branch = randn(gen, shape, xd, device), randn(gen, shape, xd, device)
    gate = None if gate_kind == "none" else modulation(gen, gate_kind, shape, 1, pd, device)[0]
    out = call(fusebox.gated_residual, x, branch, gate)
    assert_close(out, ref.gated_residual(x, branch, gate), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("x_layout", LAYOUTS)
@pytest.mark.parametrize("branch_layout", LAYOUTS)
def test_gated_residual_layouts(device, gen, dtypes, x_layout, branch_layout):
    xd, pd = dtypes
    shape = (3, 5, 1000)
    x = make_input(gen, x_layout, shape, xd, device)
    branch = make_input(gen, branch_layout, shape, xd, device)
    (gate,) = modulation(gen, "sample_chunk", shape, 1, pd, device)
    assert_close(call(fusebox.gated_residual, x, branch, gate),
                 ref.gated_residual(x, branch, gate), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("broadcast", ["x", "branch"])
def test_gated_residual_broadcast_operand(device, gen, dtypes, broadcast):
    """One operand broadcast over the batch with stride 0 (a DiT's modulation table added to its
    per-sample embedding: table[None].expand(B, 6, D) + emb)."""
    xd, _ = dtypes
    shape = (3, 6, 771)
    table = randn(gen, shape[1:], xd, device)[None].expand(shape)
    other = randn(gen, shape, xd, device)
    x, branch = (table, other) if broadcast == "x" else (other, table)
    assert_close(call(fusebox.gated_residual, x, branch, None), ref.gated_residual(x, branch, None), xd)


def test_gated_residual_empty(device, gen):
    x = torch.empty((2, 0, 32), dtype=BF16, device=device)
    (gate,) = modulation(gen, "sample", (2, 1, 32), 1, F32, device)
    out = call(fusebox.gated_residual, x, torch.empty_like(x), gate)
    assert out.shape == x.shape and out.dtype == BF16


# --------------------------------------------------------------------------- split modulation

# Where the per-row parts come from: Wan 2.2's [B, S, 6, D] per-token projection, SkyReels-V2's
# [B, 6, S, D] (terms first) and a per-sample [B, 6, D] one.
SPLIT_LAYOUTS = ["token", "terms_first", "sample"]


def split_terms(gen, layout, shape, count, xd, td, device):
    """`count` split modulation terms for x of `shape` [B, S, D]: the [D] table rows (dtype td,
    one [6, D] table as a model holds it), the per-row parts (x's dtype) as views of one
    projection, and the fp32 sums the model would write (``table.float() + temb``)."""
    b, s, d = shape
    table = small(gen, (6, d), td, device)
    if layout == "token":
        temb = small(gen, (b, s, 6, d), xd, device)
        parts = [temb[:, :, i] for i in range(count)]
    elif layout == "terms_first":
        temb = small(gen, (b, 6, s, d), xd, device)
        parts = [temb[:, i] for i in range(count)]
    else:
        temb = small(gen, (b, 6, d), xd, device)
        parts = [temb[:, i:i + 1] for i in range(count)]
    tables = [table[i] for i in range(count)]
    sums = [t.float() + p for t, p in zip(tables, parts)]
    return tables, parts, sums


def split_rows(device, width):
    """Rows enough for the 2- and 4-vector plans on an H100/H200 at 1536 and 5120."""
    return 1152 if torch.device(device).type == "cuda" and width >= 1536 else 5


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("layout", SPLIT_LAYOUTS)
@pytest.mark.parametrize("width", [7, 768, 1536, 5120])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_adaln_split_modulation(device, gen, dtypes, layout, width, norm_type):
    """``adaln`` with each term as a [D] table plus a per-row part agrees with the reference of
    the summed fp32 terms and, bit for bit, with the same kernel given those sums."""
    xd, td = dtypes
    shape = (2, split_rows(device, width), width)
    x = randn(gen, shape, xd, device)
    (scale_t, shift_t), (scale, shift), (scale_sum, shift_sum) = split_terms(
        gen, layout, shape, 2, xd, td, device)
    out = call(fusebox.adaln, x, scale, shift, norm_type=norm_type, scale_table=scale_t,
               shift_table=shift_t)
    assert_close(out, ref.modulate(ref.norm(norm_type, x), scale_sum, shift_sum), xd)
    # the same fp32 terms written first run the same plan, bit for bit, where the row takes full
    # vectors (odd widths: split terms take the streaming path, which forms 1 + scale first)
    if td == F32 and width % (16 // x.element_size()) == 0:
        summed = call(fusebox.adaln, x, scale_sum, shift_sum, norm_type=norm_type)
        assert torch.equal(out, summed), "split and summed modulation differ"
    no_shift = call(fusebox.adaln, x, scale, None, norm_type=norm_type, scale_table=scale_t)
    assert_close(no_shift, ref.modulate(ref.norm(norm_type, x), scale_sum), xd, name="no shift")


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("layout", SPLIT_LAYOUTS)
@pytest.mark.parametrize("width", [7, 1536, 5120])
@pytest.mark.parametrize("terms", ["gate_affine", "scale_shift", "all"])
def test_gated_residual_norm_split_modulation(device, gen, dtypes, layout, width, terms):
    """Wan's two block boundaries (gate with an affine LayerNorm; scale and shift after a plain
    residual) and all three terms split."""
    xd, td = dtypes
    shape = (2, split_rows(device, width), width)
    x, branch = randn(gen, shape, xd, device), randn(gen, shape, xd, device)
    tables, parts, sums = split_terms(gen, layout, shape, 3, xd, td, device)
    use = {"gate_affine": (True, False), "scale_shift": (False, True), "all": (True, True)}[terms]
    pick = lambda seq, i: seq[i] if use[0 if i == 0 else 1] else None  # noqa: E731
    w, b = affine_params(gen, "weight_bias" if terms == "gate_affine" else "none", width, td, device)
    out, h = call(fusebox.gated_residual_norm, x, branch, pick(parts, 0), pick(parts, 1),
                  pick(parts, 2), w, b, norm_type="layer", gate_table=pick(tables, 0),
                  scale_table=pick(tables, 1), shift_table=pick(tables, 2))
    ref_out, ref_h = ref.gated_residual_norm(x, branch, pick(sums, 0), pick(sums, 1), pick(sums, 2),
                                             w, b, "layer", 1e-6, 0.0)
    assert_close(h, ref_h, xd, name="h")
    assert_close(out, ref_out, xd, name="out")


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("layout", SPLIT_LAYOUTS)
@pytest.mark.parametrize("width", [7, 1536, 5120])
def test_gated_residual_split_gate(device, gen, dtypes, layout, width):
    xd, td = dtypes
    shape = (2, split_rows(device, width), width)
    x, branch = randn(gen, shape, xd, device), randn(gen, shape, xd, device)
    (table,), (gate,), (gate_sum,) = split_terms(gen, layout, shape, 1, xd, td, device)
    out = call(fusebox.gated_residual, x, branch, gate, gate_table=table)
    assert_close(out, ref.gated_residual(x, branch, gate_sum), xd)


# --------------------------------------------------------------------------- gated_residual_norm


def check_gated_residual_norm(x, branch, gate, scale, shift, w=None, b=None, norm_type="layer",
                              eps=1e-6, weight_offset=0.0, out_dtype=None):
    out, h = call(fusebox.gated_residual_norm, x, branch, gate, scale, shift, w, b,
                  norm_type=norm_type, eps=eps, weight_offset=weight_offset, out_dtype=out_dtype)
    ref_out, ref_h = ref.gated_residual_norm(x, branch, gate, scale, shift, w, b, norm_type, eps,
                                             weight_offset)
    assert_close(h, ref_h, x.dtype, name="h")
    assert_close(out, ref_out, out_dtype or x.dtype, name="out")


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("gate_kind", ["none", "sample_chunk", "token_chunk", "sample_expanded"])
@pytest.mark.parametrize("mod_kind", ["none", "sample", "token", "sample_chunk"])
def test_gated_residual_norm(device, gen, dtypes, norm_type, gate_kind, mod_kind):
    xd, pd = dtypes
    shape = (2, 7, 769)
    x, branch = randn(gen, shape, xd, device), randn(gen, shape, xd, device)
    gate = None if gate_kind == "none" else modulation(gen, gate_kind, shape, 1, pd, device)[0]
    scale, shift = (None, None) if mod_kind == "none" else modulation(gen, mod_kind, shape, 2, pd,
                                                                       device)
    check_gated_residual_norm(x, branch, gate, scale, shift, norm_type=norm_type)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("affine", AFFINE)
def test_gated_residual_norm_affine(device, gen, dtypes, norm_type, affine):
    xd, pd = dtypes
    shape = (2, 5, 1024)
    x, branch = randn(gen, shape, xd, device), randn(gen, shape, xd, device)
    gate, scale, shift = modulation(gen, "token_chunk", shape, 3, pd, device)
    w, b = affine_params(gen, affine, 1024, pd, device)
    check_gated_residual_norm(x, branch, gate, scale, shift, w, b, norm_type, eps=1e-5,
                              weight_offset=1.0 if norm_type == "rms" else 0.0)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("layout", ["row_slice", "swapped"])
def test_gated_residual_norm_strided(device, gen, dtypes, layout):
    xd, pd = dtypes
    shape = (3, 5, 1111)
    x = make_input(gen, layout, shape, xd, device)
    branch = make_input(gen, layout, shape, xd, device)
    gate, scale, shift = modulation(gen, "sample_chunk", shape, 3, pd, device)
    check_gated_residual_norm(x, branch, gate, scale, shift)


@pytest.mark.parametrize("xd", [F16, BF16])
def test_gated_residual_norm_out_dtype_float32(device, gen, xd):
    shape = (2, 5, 512)
    x, branch = randn(gen, shape, xd, device), randn(gen, shape, xd, device)
    gate, scale, shift = modulation(gen, "sample", shape, 3, F32, device)
    check_gated_residual_norm(x, branch, gate, scale, shift, out_dtype=torch.float32)


def test_gated_residual_norm_empty(device, gen):
    x = torch.empty((2, 0, 64), dtype=BF16, device=device)
    gate, scale, shift = modulation(gen, "sample", (2, 1, 64), 3, F32, device)
    out, h = call(fusebox.gated_residual_norm, x, torch.empty_like(x), gate, scale, shift)
    for t in (out, h):
        assert t.shape == x.shape and t.dtype == BF16


@pytest.mark.large
@pytest.mark.parametrize("dtypes", DTYPE_CASES)
def test_gated_residual_norm_large(device, gen, dtypes):
    xd, pd = dtypes
    shape = (2, big_rows(device), 5120)
    x, branch = randn(gen, shape, xd, device), randn(gen, shape, xd, device)
    gate, scale, shift = modulation(gen, "token_chunk", shape, 3, pd, device)
    check_gated_residual_norm(x, branch, gate, scale, shift)


# --------------------------------------------------------------------------- seed aliases


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
def test_alias_rmsnorm(device, gen, dtypes):
    xd, pd = dtypes
    x, w = randn(gen, (5, 300), xd, device), weight(gen, 300, pd, device)
    assert_close(call(fusebox.rmsnorm, x, w, 1e-5), ref.rms_norm(x, w, 1e-5), xd)
    assert_close(call(fusebox.rmsnorm, x), ref.rms_norm(x, None, 1e-6), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
def test_alias_rmsnorm_residual(device, gen, dtypes):
    xd, pd = dtypes
    x, res = randn(gen, (5, 300), xd, device), randn(gen, (5, 300), xd, device)
    w = weight(gen, 300, pd, device)
    normed, h = call(fusebox.rmsnorm_residual, x, res, w, 1e-5)
    ref_normed, ref_h = ref.fused_add_rms_norm(x, res, w, 1e-5)
    assert_close(h, ref_h, xd, name="h")
    assert_close(normed, ref_normed, xd, name="normed")


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("with_shift", [True, False], ids=["shift", "noshift"])
def test_alias_adaln_rmsnorm(device, gen, dtypes, with_shift):
    xd, pd = dtypes
    shape = (2, 5, 256)
    x = randn(gen, shape, xd, device)
    scale, shift = modulation(gen, "sample_chunk", shape, 2, pd, device)
    shift = shift if with_shift else None
    w = weight(gen, 256, pd, device)
    out = call(fusebox.adaln_rmsnorm, x, scale, shift, w)
    assert_close(out, ref.modulate(ref.rms_norm(x, w, 1e-6), scale, shift), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("affine", ["none", "weight_bias"])
def test_alias_adaln_layernorm(device, gen, dtypes, affine):
    xd, pd = dtypes
    shape = (2, 5, 256)
    x = randn(gen, shape, xd, device)
    scale, shift = modulation(gen, "token", shape, 2, pd, device)
    w, b = affine_params(gen, affine, 256, pd, device)
    out = call(fusebox.adaln_layernorm, x, scale, shift, w, b)
    assert_close(out, ref.modulate(ref.layer_norm(x, w, b, 1e-6), scale, shift), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
def test_alias_adaln_zero_gate_only(device, gen, dtypes):
    xd, pd = dtypes
    shape = (2, 5, 256)
    x, branch = randn(gen, shape, xd, device), randn(gen, shape, xd, device)
    (gate,) = modulation(gen, "sample_chunk", shape, 1, pd, device)
    h = call(fusebox.adaln_zero, x, branch, gate)
    assert_close(h, ref.gated_residual(x, branch, gate), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_alias_adaln_zero_with_norm(device, gen, dtypes, norm_type):
    xd, pd = dtypes
    shape = (2, 5, 256)
    x, branch = randn(gen, shape, xd, device), randn(gen, shape, xd, device)
    gate, scale, shift = modulation(gen, "sample_chunk", shape, 3, pd, device)
    w, b = affine_params(gen, "weight_bias" if norm_type == "layer" else "weight", 256, pd, device)
    h, out = call(fusebox.adaln_zero, x, branch, gate, scale, shift, norm_type=norm_type,
                  weight=w, bias=b)  # note the order: (h, out)
    ref_out, ref_h = ref.gated_residual_norm(x, branch, gate, scale, shift, w, b, norm_type, 1e-6)
    assert_close(h, ref_h, xd, name="h")
    assert_close(out, ref_out, xd, name="out")


# --------------------------------------------------------------------------- real modules


def test_matches_transformers_llama_rmsnorm_fp32(device, gen):
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    m = LlamaRMSNorm(1024, eps=1e-5).to(device)
    with torch.no_grad():
        m.weight.copy_(weight(gen, 1024, F32, device))
    x = randn(gen, (3, 7, 1024), F32, device)
    with torch.no_grad():
        expect = m(x)
    out = call(fusebox.rms_norm, x, m.weight.detach(), eps=1e-5)
    assert_close(out, expect.double(), F32)


@pytest.mark.parametrize("name", ["gemma", "gemma3"])
def test_matches_transformers_gemma_rmsnorm(device, gen, name):
    import importlib

    pytest.importorskip("transformers")
    mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    cls = getattr(mod, f"{name.capitalize()}RMSNorm")
    m = cls(512, eps=1e-6).to(device)
    with torch.no_grad():
        m.weight.copy_(small(gen, (512,), F32, device))
    for dtype in (F32, BF16):
        x = randn(gen, (5, 512), dtype, device)
        with torch.no_grad():
            expect = m(x)  # fp32 math, (1 + w), one rounding
        out = call(fusebox.rms_norm, x, m.weight.detach(), eps=1e-6, weight_offset=1.0)
        assert_close(out, expect.double(), dtype)


def test_matches_torch_rms_norm_fp32(device, gen):
    x, w = randn(gen, (17, 769), F32, device), weight(gen, 769, F32, device)
    assert_close(call(fusebox.rms_norm, x, w, eps=1e-6),
                 F.rms_norm(x, (769,), w, eps=1e-6).double(), F32)


def test_matches_torch_layer_norm_fp32(device, gen):
    x = randn(gen, (17, 769), F32, device)
    w, b = weight(gen, 769, F32, device), small(gen, (769,), F32, device)
    assert_close(call(fusebox.layer_norm, x, w, b, eps=1e-5),
                 F.layer_norm(x, (769,), w, b, eps=1e-5).double(), F32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_diffusers_rmsnorm_no_affine(device, gen, dtype):
    pytest.importorskip("diffusers")
    from diffusers.models.normalization import RMSNorm

    m = RMSNorm(384, eps=1e-6, elementwise_affine=False)
    x = randn(gen, (2, 9, 384), dtype, device)
    with torch.no_grad():
        expect = m(x)
    assert expect.dtype == dtype
    assert_close(call(fusebox.rms_norm, x, eps=1e-6), expect.double(), dtype)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_matches_diffusers_rmsnorm_fp32_weight(device, gen, dtype):
    # diffusers' RMSNorm with an fp32 weight returns fp32 for 16-bit x: fusebox's out_dtype
    pytest.importorskip("diffusers")
    from diffusers.models.normalization import RMSNorm

    m = RMSNorm(384, eps=1e-6).to(device)
    with torch.no_grad():
        m.weight.copy_(weight(gen, 384, F32, device))
    x = randn(gen, (2, 9, 384), dtype, device)
    with torch.no_grad():
        expect = m(x)
    assert expect.dtype == F32
    out = call(fusebox.rms_norm, x, m.weight.detach(), eps=1e-6, out_dtype=torch.float32)
    assert_close(out, expect.double(), F32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_diffusers_fp32_layernorm(device, gen, dtype):
    pytest.importorskip("diffusers")
    from diffusers.models.normalization import FP32LayerNorm

    m = FP32LayerNorm(384, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        m.weight.copy_(weight(gen, 384, dtype, device))
        m.bias.copy_(small(gen, (384,), dtype, device))
    x = randn(gen, (2, 9, 384), dtype, device)
    with torch.no_grad():
        expect = m(x)
    out = call(fusebox.layer_norm, x, m.weight.detach(), m.bias.detach(), eps=1e-6)
    assert_close(out, expect.double(), dtype)

