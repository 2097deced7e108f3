"""Activation family: gated_activation, gated_activation_packed, activation, gelu_tanh and the
seed aliases (silu_and_mul, swiglu, geglu), plus diffusers' GEGLU/SwiGLU modules."""

import pytest
import torch

import fusebox
import reference as ref
from helpers import (
    BF16, DTYPE_CASES, DTYPES, F16, F32, LAYOUTS, ODD_ROWS, WIDTHS, assert_close, big_rows, call,
    make_input, randn, small,
)

ACTS = ["silu", "gelu_tanh", "gelu"]
PACKED_WIDTHS = [1, 7, 128, 769, 2048, 5125, pytest.param(16384, marks=pytest.mark.large)]


def gate_up(gen, layout, shape, dtype, device):
    """Separate gate and up tensors; "chunked" takes both from one packed [..., 2N] tensor."""
    if layout == "chunked":
        *lead, n = shape
        packed = randn(gen, (*lead, 2 * n), dtype, device, scale=2.0)
        return packed.chunk(2, dim=-1)
    return (make_input(gen, layout, shape, dtype, device, scale=2.0),
            make_input(gen, layout, shape, dtype, device))


# --------------------------------------------------------------------------- gated_activation


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", ODD_ROWS)
def test_gated_activation(device, gen, dtype, act, width, rows):
    gate, up = gate_up(gen, "contiguous", (rows, width), dtype, device)
    out = call(fusebox.gated_activation, gate, up, act)
    assert_close(out, ref.gated_act(gate, up, act), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("layout", [*LAYOUTS, "chunked"])
def test_gated_activation_layouts(device, gen, dtype, act, layout):
    gate, up = gate_up(gen, layout, (3, 5, 1001), dtype, device)
    out = call(fusebox.gated_activation, gate, up, act)
    assert_close(out, ref.gated_act(gate, up, act), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activation_default_is_silu(device, gen, dtype):
    gate, up = gate_up(gen, "contiguous", (3, 100), dtype, device)
    assert_close(call(fusebox.gated_activation, gate, up), ref.gated_act(gate, up, "silu"), dtype)


@pytest.mark.parametrize("act", ACTS)
def test_gated_activation_empty(device, act):
    gate = torch.empty((0, 64), dtype=BF16, device=device)
    out = call(fusebox.gated_activation, gate, torch.empty_like(gate), act)
    assert out.shape == (0, 64) and out.dtype == BF16


@pytest.mark.large
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_gated_activation_large(device, gen, dtype, act):
    gate, up = gate_up(gen, "chunked", (big_rows(device), 14336), dtype, device)
    assert_close(call(fusebox.gated_activation, gate, up, act), ref.gated_act(gate, up, act),
                 dtype)


# --------------------------------------------------------------------------- packed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("gate_first", [True, False], ids=["gate_first", "gate_second"])
@pytest.mark.parametrize("n", PACKED_WIDTHS)
def test_gated_activation_packed(device, gen, dtype, act, gate_first, n):
    x = randn(gen, (5, 2 * n), dtype, device, scale=2.0)
    out = call(fusebox.gated_activation_packed, x, act, gate_first)
    assert_close(out, ref.gated_act_packed(x, act, gate_first), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("gate_first", [True, False], ids=["gate_first", "gate_second"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gated_activation_packed_layouts(device, gen, dtype, act, gate_first, layout):
    x = make_input(gen, layout, (3, 7, 2 * 771), dtype, device, scale=2.0)
    out = call(fusebox.gated_activation_packed, x, act, gate_first)
    assert_close(out, ref.gated_act_packed(x, act, gate_first), dtype)


def test_gated_activation_packed_empty(device):
    x = torch.empty((2, 0, 64), dtype=BF16, device=device)
    out = call(fusebox.gated_activation_packed, x)
    assert out.shape == (2, 0, 32) and out.dtype == BF16


# --------------------------------------------------------------------------- activation


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_activation(device, gen, dtypes, act, width, with_bias):
    xd, pd = dtypes
    x = randn(gen, (3, width), xd, device, scale=2.0)
    bias = small(gen, (width,), pd, device) if with_bias else None
    out = call(fusebox.activation, x, bias, act)
    assert_close(out, ref.bias_act(x, bias, act), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("rows", [1, 4, 5, 9, 203])
@pytest.mark.parametrize("width", [24, 1000, 8200])
def test_activation_bias_rows(device, gen, dtypes, rows, width):
    """Biased rows at row counts around the plan's rows per block: narrow rows several a block,
    rows of several column chunks."""
    xd, pd = dtypes
    x = randn(gen, (rows, width), xd, device, scale=2.0)
    bias = small(gen, (width,), pd, device)
    assert_close(call(fusebox.gelu_tanh, x, bias), ref.bias_act(x, bias, "gelu_tanh"), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_activation_layouts(device, gen, dtypes, act, layout):
    xd, pd = dtypes
    x = make_input(gen, layout, (3, 5, 1025), xd, device, scale=2.0)
    bias = small(gen, (1025,), pd, device)
    assert_close(call(fusebox.activation, x, bias, act), ref.bias_act(x, bias, act), xd)


@pytest.mark.parametrize("dtypes", DTYPE_CASES)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_gelu_tanh(device, gen, dtypes, with_bias):
    xd, pd = dtypes
    x = randn(gen, (17, 3072), xd, device, scale=2.0)
    bias = small(gen, (3072,), pd, device) if with_bias else None
    assert_close(call(fusebox.gelu_tanh, x, bias), ref.bias_act(x, bias, "gelu_tanh"), xd)
    # the default activation of `activation` is gelu_tanh too
    assert_close(call(fusebox.activation, x, bias), ref.bias_act(x, bias, "gelu_tanh"), xd)


def test_activation_empty(device, gen):
    x = torch.empty((0, 3, 128), dtype=BF16, device=device)
    out = call(fusebox.activation, x, small(gen, (128,), F32, device), "gelu")
    assert out.shape == x.shape and out.dtype == BF16


@pytest.mark.large
@pytest.mark.parametrize("dtypes", DTYPE_CASES)
def test_gelu_tanh_large(device, gen, dtypes):
    xd, pd = dtypes
    x = randn(gen, (big_rows(device), 16384), xd, device, scale=2.0)
    bias = small(gen, (16384,), pd, device)
    assert_close(call(fusebox.gelu_tanh, x, bias), ref.bias_act(x, bias, "gelu_tanh"), xd)


@pytest.mark.parametrize("dtype", [pytest.param(F16, id="f16"), pytest.param(BF16, id="bf16")])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("gated", [False, True], ids=["act", "gated"])
def test_activation_pointwise_accuracy(device, dtype, act, gated):
    # Every input in [-3, 3]: with fp32 math rounded once, each 16-bit output is within one
    # ulp of the exact value (the fp32 formulas lose < 0.1 ulp there). The norm-wise bound
    # cannot see errors confined to small outputs, e.g. gelu_tanh's 1 + tanh(u) for x near -3
    # computed with an approximate tanh.
    x = torch.linspace(-3, 3, 6001, dtype=torch.float64).to(dtype).to(device)
    if gated:
        up = torch.ones_like(x) * 1.5  # exact in every dtype
        out = call(fusebox.gated_activation, x, up, act)
        expect = ref.gated_act(x, up, act)
    else:
        out = call(fusebox.activation, x, None, act)
        expect = ref.bias_act(x, None, act)
    assert out.dtype == dtype and torch.isfinite(out).all()
    finfo = torch.finfo(dtype)
    err = (out.double() - expect).abs()
    bound = finfo.eps * expect.abs() + finfo.tiny
    bad = err > bound
    if bad.any():
        i = int((err / bound).argmax())
        pytest.fail(f"{int(bad.sum())} of {x.numel()} outputs off by more than 1 ulp; worst at "
                    f"x={x[i].item():.4f}: got {out[i].item():.6g}, exact {expect[i].item():.6g} "
                    f"(rel error {(err[i] / expect[i].abs()).item():.2e})")


# --------------------------------------------------------------------------- seed aliases


@pytest.mark.parametrize("dtype", DTYPES)
def test_alias_silu_and_mul(device, gen, dtype):
    x = randn(gen, (7, 2 * 333), dtype, device, scale=2.0)
    assert_close(call(fusebox.silu_and_mul, x), ref.gated_act_packed(x, "silu", True), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_alias_swiglu(device, gen, dtype):
    gate, up = gate_up(gen, "contiguous", (7, 333), dtype, device)
    assert_close(call(fusebox.swiglu, gate, up), ref.gated_act(gate, up, "silu"), dtype)
    packed = randn(gen, (7, 2 * 333), dtype, device, scale=2.0)  # gate second
    assert_close(call(fusebox.swiglu, packed), ref.gated_act_packed(packed, "silu", False), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate,act", [("tanh", "gelu_tanh"), ("none", "gelu")])
def test_alias_geglu(device, gen, dtype, approximate, act):
    gate, up = gate_up(gen, "contiguous", (7, 333), dtype, device)
    assert_close(call(fusebox.geglu, gate, up, approximate), ref.gated_act(gate, up, act), dtype)
    packed = randn(gen, (7, 2 * 333), dtype, device, scale=2.0)  # gate second
    assert_close(call(fusebox.geglu, packed, None, approximate),
                 ref.gated_act_packed(packed, act, False), dtype)


def test_alias_geglu_default_is_tanh(device, gen):
    gate, up = gate_up(gen, "contiguous", (7, 333), F32, device)
    assert_close(call(fusebox.geglu, gate, up), ref.gated_act(gate, up, "gelu_tanh"), F32)


# --------------------------------------------------------------------------- real modules


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,fn", [("GEGLU", fusebox.geglu), ("SwiGLU", fusebox.swiglu)])
def test_matches_diffusers_gated_modules(device, gen, dtype, name, fn):
    pytest.importorskip("diffusers")
    from diffusers.models import activations

    torch.manual_seed(0)  # module init
    m = getattr(activations, name)(64, 96).to(device=device, dtype=dtype)
    x = randn(gen, (2, 5, 64), dtype, device)
    with torch.no_grad():
        expect = m(x)
        projected = m.proj(x)
    out = call(fn, projected, None, "none") if name == "GEGLU" else call(fn, projected)
    # diffusers rounds act(gate) before the product: 16-bit types get the loose 1e-2 bound
    assert_close(out, expect.double(), dtype, tol=1e-5 if dtype == F32 else 1e-2)
