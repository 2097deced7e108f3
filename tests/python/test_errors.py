"""Invalid arguments raise errors that name the argument at fault (and what was expected)."""

import pytest
import torch

import fusebox
from helpers import BF16, F16, F32, qk_pair, randn, requires_cuda, rope_tables, weight

ERRORS = (ValueError, RuntimeError, TypeError)
DTYPE_NAMES = {
    torch.int32: r"(int32|\bInt\b|\bint\b)",
    torch.float64: r"(float64|Double|double)",
    torch.float16: r"(float16|Half|half)",
    torch.bfloat16: r"(bfloat16|BFloat16)",
}
# the rotary dims are cos/sin's last dimension: either name will do
ROTARY_DIM = r"(?<!\w)(cos|sin|rotary)"
SUPPORTED = r"(float32|float16|bfloat16|\bFloat\b|Half|BFloat16|fp32|fp16|bf16)"


def names(*patterns):
    """A `match` regex requiring every pattern somewhere in the message."""
    return "(?s)" + "".join(f"(?=.*{p})" for p in patterns)


def arg(name):
    """The argument's name as a whole word (so "x" does not match inside "fusebox")."""
    return rf"(?<![\w.]){name}(?!\w)"


def raises(*patterns):
    return pytest.raises(ERRORS, match=names(*patterns))


@pytest.fixture
def x(gen, device):
    return randn(gen, (4, 6, 64), BF16, device)


# --------------------------------------------------------------------------- dtypes


def test_residual_dtype_mismatch(gen, device):
    x = randn(gen, (4, 64), F16, device)
    with raises(arg("residual")):
        fusebox.fused_add_rms_norm(x, randn(gen, (4, 64), BF16, device))


def test_branch_dtype_mismatch(x, gen, device):
    with raises(arg("branch")):
        fusebox.gated_residual(x, randn(gen, x.shape, F16, device))


def test_k_dtype_mismatch(gen, device):
    q, _ = qk_pair(gen, "bshd", 2, 5, 4, 2, 64, BF16, device)
    _, k = qk_pair(gen, "bshd", 2, 5, 4, 2, 64, F16, device)
    cos, sin = rope_tables(gen, "S", "bshd", 2, 5, 64, False, F32, device)
    with raises(arg("k")):
        fusebox.rope(q, k, cos, sin)


def test_up_dtype_mismatch(gen, device):
    with raises(arg("up")):
        fusebox.gated_activation(randn(gen, (3, 8), BF16, device), randn(gen, (3, 8), F32, device))


def test_small_operand_of_a_third_dtype(x, gen, device):
    # small operands may be fp32 or x's dtype; fp16 with bf16 x is neither
    with raises(arg("weight"), SUPPORTED):
        fusebox.rms_norm(x, weight(gen, 64, F16, device))


@pytest.mark.parametrize("bad", [torch.int32, torch.float64])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "activation", "gated_act_packed",
                                "rope"])
def test_unsupported_dtype(gen, device, bad, op):
    x = randn(gen, (2, 5, 4, 64), F32, device).to(bad)
    with raises(arg("q" if op == "rope" else "x"), DTYPE_NAMES[bad], SUPPORTED):
        if op == "rope":
            cos, sin = rope_tables(gen, "S", "bshd", 2, 5, 64, False, F32, device)
            fusebox.rope(x, None, cos, sin)
        elif op == "gated_act_packed":
            fusebox.gated_activation_packed(x)
        else:
            getattr(fusebox, op)(x)


def test_unsupported_weight_dtype(x, gen, device):
    with raises(arg("weight"), f"({DTYPE_NAMES[torch.float64]}|{SUPPORTED})"):
        fusebox.rms_norm(x, weight(gen, 64, torch.float64, device))


def test_unsupported_out_dtype(x):
    with raises(r"(out_dtype|\bout\b)", SUPPORTED):
        fusebox.rms_norm(x, out_dtype=F16)  # only x's dtype or float32


# --------------------------------------------------------------------------- shapes


def test_weight_wrong_length(x, gen, device):
    with raises(arg("weight")):
        fusebox.rms_norm(x, weight(gen, 63, F32, device))


def test_layer_norm_bias_wrong_length(x, gen, device):
    with raises(arg("bias")):
        fusebox.layer_norm(x, weight(gen, 64, F32, device), weight(gen, 65, F32, device))


def test_residual_shape_mismatch(gen, device):
    with raises(arg("residual")):
        fusebox.fused_add_rms_norm(randn(gen, (4, 64), F32, device),
                                   randn(gen, (5, 64), F32, device))


@pytest.mark.parametrize("residual", [(4, 7, 64), (2, 4, 6, 64), torch.float64, torch.int32, 1.0])
def test_rms_norm_add_residual_invalid(x, gen, device, residual):
    if isinstance(residual, tuple):
        bad, expected = randn(gen, residual, BF16, device), "broadcast"
    elif isinstance(residual, torch.dtype):
        bad, expected = randn(gen, x.shape, F32, device).to(residual), DTYPE_NAMES[residual]
    else:
        bad, expected = residual, "Tensor"
    with raises(arg("residual"), expected):
        fusebox.rms_norm_add(x, bad, weight(gen, 64, BF16, device))


@pytest.mark.parametrize("name,shape", [("scale", (4, 3, 64)), ("scale", (4, 1, 32)),
                                        ("shift", (3, 1, 64)), ("shift", (4, 6, 63))])
def test_adaln_modulation_not_broadcastable(x, gen, device, name, shape):
    good = randn(gen, (4, 1, 64), F32, device)
    bad = randn(gen, shape, F32, device)
    scale, shift = (bad, good) if name == "scale" else (good, bad)
    with raises(arg(name)):
        fusebox.adaln(x, scale, shift)


@pytest.mark.parametrize("shape", [(4, 2, 64), (2, 1, 64), (4, 1, 16)])
def test_gate_not_broadcastable(x, gen, device, shape):
    with raises(arg("gate")):
        fusebox.gated_residual(x, randn(gen, x.shape, BF16, device), randn(gen, shape, F32, device))


def test_gated_residual_norm_scale_not_broadcastable(x, gen, device):
    with raises(arg("scale")):
        fusebox.gated_residual_norm(x, randn(gen, x.shape, BF16, device), None,
                                    randn(gen, (4, 6, 65), F32, device))


# Split modulation: a [D] table per term, every present term with its table, the terms x's dtype
@pytest.mark.parametrize("case,name", [
    ("table_without_term", "shift_table"), ("term_without_table", "shift"),
    ("table_shape", "scale_table"), ("table_strided", "scale_table"), ("term_dtype", "scale"),
    ("table_dtype", "scale_table"),
])
def test_split_modulation_invalid(x, gen, device, case, name):
    d = x.shape[-1]
    scale, shift = randn(gen, (4, 6, d), BF16, device), randn(gen, (4, 6, d), BF16, device)
    scale_table, shift_table = randn(gen, (d,), F32, device), randn(gen, (d,), F32, device)
    kwargs = dict(scale_table=scale_table, shift_table=shift_table)
    if case == "table_without_term":
        shift = None
    elif case == "term_without_table":
        kwargs["shift_table"] = None
    elif case == "table_shape":
        kwargs["scale_table"] = randn(gen, (d + 1,), F32, device)
    elif case == "table_strided":
        kwargs["scale_table"] = randn(gen, (2 * d,), F32, device)[::2]
    elif case == "term_dtype":
        scale = scale.float()
    elif case == "table_dtype":
        kwargs["scale_table"] = scale_table.double()
    with raises(arg(name)):
        fusebox.adaln(x, scale, shift, **kwargs)


def test_gate_table_without_gate(x, gen, device):
    with raises(arg("gate_table")):
        fusebox.gated_residual_norm(x, randn(gen, x.shape, BF16, device), None,
                                    randn(gen, x.shape, BF16, device),
                                    gate_table=randn(gen, (x.shape[-1],), F32, device),
                                    scale_table=randn(gen, (x.shape[-1],), F32, device))


def test_up_shape_mismatch(gen, device):
    with raises(arg("up")):
        fusebox.gated_activation(randn(gen, (3, 8), F32, device), randn(gen, (3, 9), F32, device))


def test_activation_bias_wrong_length(gen, device):
    with raises(arg("bias")):
        fusebox.activation(randn(gen, (3, 8), F32, device), randn(gen, (9,), F32, device))


@pytest.mark.parametrize("fn", [fusebox.gated_activation_packed, fusebox.silu_and_mul])
def test_packed_odd_last_dim(gen, device, fn):
    with raises(arg("x"), r"even|2N|odd|divisible"):
        fn(randn(gen, (3, 13), F32, device))


# --------------------------------------------------------------------------- rope shapes


@pytest.fixture
def qk(gen, device):
    return qk_pair(gen, "bshd", 2, 5, 4, 2, 8, BF16, device)


def test_rope_odd_rotary_dim(qk, gen, device):
    q, k = qk
    cos, sin = randn(gen, (5, 7), F32, device), randn(gen, (5, 7), F32, device)
    with raises(ROTARY_DIM):
        fusebox.rope(q, k, cos, sin)


def test_rope_odd_head_dim(gen, device):
    q, k = qk_pair(gen, "bshd", 2, 5, 4, 2, 7, BF16, device)
    cos, sin = randn(gen, (5, 7), F32, device), randn(gen, (5, 7), F32, device)
    with raises(r"(?<!\w)(cos|sin|rotary|q)(?!\w)"):
        fusebox.rope(q, k, cos, sin)


def test_rope_table_wider_than_head(qk, gen, device):
    q, k = qk
    cos, sin = randn(gen, (5, 10), F32, device), randn(gen, (5, 10), F32, device)
    with raises(ROTARY_DIM):
        fusebox.rope(q, k, cos, sin)


def test_rope_table_wrong_seq_len(qk, gen, device):
    q, k = qk
    cos, sin = rope_tables(gen, "BS", "bshd", 2, 6, 8, False, F32, device)
    with raises(arg("cos")):
        fusebox.rope(q, k, cos, sin)


def test_rope_sin_shape_differs(qk, gen, device):
    q, k = qk
    cos, _ = rope_tables(gen, "S", "bshd", 2, 5, 8, False, F32, device)
    with raises(arg("sin")):
        fusebox.rope(q, k, cos, randn(gen, (5, 6), F32, device))


def test_rope_sin_dtype_differs(qk, gen, device):
    q, k = qk
    cos, sin = rope_tables(gen, "S", "bshd", 2, 5, 8, False, F32, device)
    with raises(arg("sin"), arg("cos"), DTYPE_NAMES[torch.bfloat16]):
        fusebox.rope(q, k, cos, sin.to(BF16))


def test_rope_4d_table_in_wrong_layout(gen, device):
    q, k = qk_pair(gen, "bhsd", 2, 5, 4, 2, 8, BF16, device)
    cos, sin = rope_tables(gen, "4d", "bshd", 2, 5, 8, False, F32, device)  # [B, S, 1, R]
    with raises(arg("cos")):
        fusebox.rope(q, k, cos, sin, heads_first=True)


def test_rope_k_head_dim_differs(gen, device):
    q, _ = qk_pair(gen, "bshd", 2, 5, 4, 2, 8, BF16, device)
    _, k = qk_pair(gen, "bshd", 2, 5, 4, 2, 16, BF16, device)
    cos, sin = rope_tables(gen, "S", "bshd", 2, 5, 8, False, F32, device)
    with raises(arg("k")):
        fusebox.rope(q, k, cos, sin)


@pytest.mark.parametrize("across", [False, True])
def test_qk_norm_weight_wrong_length(qk, gen, device, across):
    q, k = qk
    cos, sin = rope_tables(gen, "S", "bshd", 2, 5, 8, False, F32, device)
    good_k = weight(gen, 2 * 8 if across else 8, F32, device)
    bad_q = weight(gen, 8 if across else 4 * 8, F32, device)  # per-head vs across-heads swapped
    with raises(arg("q_weight")):
        fusebox.qk_norm_rope(q, k, bad_q, good_k, cos, sin, across_heads=across)


def test_rope_3d_axes_dim_too_wide(gen, device):
    q, k = qk_pair(gen, "bshd", 1, 24, 2, 2, 64, BF16, device)
    with raises(arg("axes_dim")):
        fusebox.rope_3d(q, k, 2, 3, 4, axes_dim=(32, 32, 32))


def test_rope_3d_axes_dim_past_the_grid_limit(gen, device):
    """The grid's per-pair table is a kernel parameter: at most 512 rotary dims, on every
    device alike."""
    q, k = qk_pair(gen, "bshd", 1, 24, 1, 1, 640, BF16, device)
    with raises(arg("axes_dim")):
        fusebox.rope_3d(q, k, 2, 3, 4, axes_dim=(256, 192, 192))
    out, _ = fusebox.rope_3d(q, k, 2, 3, 4, axes_dim=(256, 128, 128))   # 512 passes
    assert torch.isfinite(out).all()


def test_rope_3d_axes_dim_odd(gen, device):
    q, k = qk_pair(gen, "bshd", 1, 24, 2, 2, 64, BF16, device)
    with raises(arg("axes_dim")):
        fusebox.rope_3d(q, k, 2, 3, 4, axes_dim=(21, 21, 22))


def test_rope_3d_grid_does_not_match_seq_len(gen, device):
    q, k = qk_pair(gen, "bshd", 1, 24, 2, 2, 64, BF16, device)
    with raises(r"(?<!\w)(grid|num_frames|frames|height|width)(?!\w)"):
        fusebox.rope_3d(q, k, 2, 3, 5)


# --------------------------------------------------------------------------- strides


def test_rms_norm_non_unit_last_stride(gen, device):
    x = randn(gen, (4, 128), F32, device)[..., ::2]
    with raises(arg("x"), "stride"):
        fusebox.rms_norm(x)


def test_residual_non_unit_last_stride(gen, device):
    x = randn(gen, (4, 64), F32, device)
    with raises(arg("residual"), "stride"):
        fusebox.fused_add_rms_norm(x, randn(gen, (4, 128), F32, device)[..., ::2])


def test_scale_non_unit_last_stride(x, gen, device):
    scale = randn(gen, (4, 1, 128), F32, device)[..., ::2]
    with raises(arg("scale"), "stride"):
        fusebox.adaln(x, scale)


def test_rope_non_unit_last_stride(gen, device):
    q = randn(gen, (2, 5, 4, 16), BF16, device)[..., ::2]
    cos, sin = rope_tables(gen, "S", "bshd", 2, 5, 8, False, F32, device)
    with raises(arg("q"), "stride"):
        fusebox.rope(q, None, cos, sin)


def test_cos_non_unit_last_stride(qk, gen, device):
    q, k = qk
    cos = randn(gen, (5, 16), F32, device)[:, ::2]
    sin = randn(gen, (5, 8), F32, device)
    with raises(arg("cos"), "stride"):
        fusebox.rope(q, k, cos, sin)


def test_up_non_unit_last_stride(gen, device):
    with raises(arg("up"), "stride"):
        fusebox.gated_activation(randn(gen, (3, 8), F32, device),
                                 randn(gen, (3, 16), F32, device)[:, ::2])


# --------------------------------------------------------------------------- devices


@requires_cuda
@pytest.mark.gpu
def test_weight_on_other_device(gen):
    x = randn(gen, (4, 64), BF16, "cuda")
    with raises(arg("weight")):
        fusebox.rms_norm(x, weight(gen, 64, F32, "cpu"))


@requires_cuda
@pytest.mark.gpu
def test_cos_on_other_device(gen):
    q, k = qk_pair(gen, "bshd", 2, 5, 4, 2, 8, BF16, "cuda")
    cos, sin = rope_tables(gen, "S", "bshd", 2, 5, 8, False, F32, "cpu")
    with raises(arg("cos")):
        fusebox.rope(q, k, cos, sin)


@requires_cuda
@pytest.mark.gpu
def test_residual_on_other_device(gen):
    x = randn(gen, (4, 64), BF16, "cuda")
    with raises(arg("residual")):
        fusebox.fused_add_rms_norm(x, randn(gen, (4, 64), BF16, "cpu"))


# --------------------------------------------------------------------------- strings


def test_bad_activation_string(gen, device):
    x = randn(gen, (3, 8), F32, device)
    for call in (lambda: fusebox.activation(x, None, "relu"),
                 lambda: fusebox.gated_activation(x, x, "relu"),
                 lambda: fusebox.gated_activation_packed(x, "relu")):
        with pytest.raises(ValueError, match=names(arg("activation"), "relu")):
            call()


def test_bad_norm_type_string(x, gen, device):
    scale = randn(gen, (4, 1, 64), F32, device)
    with pytest.raises(ValueError, match=names(arg("norm_type"), "group")):
        fusebox.adaln(x, scale, norm_type="group")
    with pytest.raises(ValueError, match=names(arg("norm_type"), "group")):
        fusebox.gated_residual_norm(x, x, None, scale, norm_type="group")


def test_bad_geglu_approximate(gen, device):
    x = randn(gen, (3, 8), F32, device)
    with pytest.raises(ValueError, match=names(arg("approximate"), "erf")):
        fusebox.geglu(x, x, approximate="erf")


def test_raw_ops_reject_bad_strings(x, gen, device):
    # the registered operators validate their string arguments too (no silent default)
    with raises(r"(?<!\w)(act|activation)(?!\w)", "relu"):
        fusebox.ops.act(x, None, "relu")
    with raises(r"(?<!\w)(act|activation)(?!\w)", "relu"):
        fusebox.ops.gated_act_packed(x, "relu", True)
    with raises(r"(?<!\w)(norm|norm_type)(?!\w)", "group"):
        fusebox.ops.fused_norm(x, None, None, None, None, None, None, "group", 1e-6, 0.0, None)
