"""torch.library.opcheck of every registered operator: schema (no hidden mutation/aliasing),
fake (meta) implementation matching the real outputs, autograd registration and AOT dispatch,
on dense and strided inputs."""

import pytest
import torch

import fusebox  # noqa: F401  (loads the library, registers the fake implementations)
from helpers import BF16, F32, make_input, modulation, qk_pair, rope_tables, small, weight

OPS = ["rms_norm", "layer_norm", "fused_add_rms_norm", "rms_norm_add", "fused_norm",
       "gated_residual", "rotary", "gated_act", "gated_act_packed", "act", "moe_combine", "moe_sort", "moe_topk"]


def op_cases(name, gen, device, layout):
    """(id, args) pairs for one op; `layout` is "contiguous" or a strided layout."""
    def x_(shape, dtype=BF16):
        return make_input(gen, layout, shape, dtype, device)

    d = 96
    shape = (2, 5, d)
    w, b = weight(gen, d, F32, device), small(gen, (d,), F32, device)
    if name == "rms_norm":
        return [("w", (x_(shape), w, 1e-6, 0.0, None)),
                ("no_w_f32out", (x_(shape), None, 1e-5, 0.0, torch.float32))]
    if name == "layer_norm":
        return [("wb", (x_(shape), w, b, 1e-5, None)),
                ("none_f32out", (x_(shape), None, None, 1e-5, torch.float32))]
    if name == "fused_add_rms_norm":
        return [("w", (x_(shape), x_(shape), w, 1e-6, 1.0)),
                ("no_w", (x_(shape), x_(shape), None, 1e-6, 0.0))]
    if name == "rms_norm_add":
        (residual,) = modulation(gen, "sample_chunk", shape, 1, BF16, device)   # broadcast rows
        return [("w", (x_(shape), x_(shape), w, 1e-6, 1.0)),
                ("no_w_broadcast", (x_(shape), residual, None, 1e-5, 0.0))]
    if name == "fused_norm":
        gate, scale, shift = modulation(gen, "token_chunk", shape, 3, F32, device)
        # split modulation: [D] fp32 table rows plus per-token parts in x's dtype
        tables = list(small(gen, (3, shape[-1]), F32, device).unbind(0))
        parts = modulation(gen, "token_chunk", shape, 3, BF16, device)
        return [("adaln", (x_(shape), None, None, scale, shift, w, b, "layer", 1e-6, 0.0, None)),
                ("gated", (x_(shape), x_(shape), gate, scale, shift, w, None, "rms", 1e-6, 1.0,
                           torch.float32)),
                ("split", (x_(shape), x_(shape), *parts, w, b, "layer", 1e-6, 0.0, None,
                           *tables))]
    if name == "gated_residual":
        (gate,) = modulation(gen, "sample_chunk", shape, 1, F32, device)
        (part,) = modulation(gen, "token_chunk", shape, 1, BF16, device)
        table = small(gen, (shape[-1],), F32, device)
        return [("gate", (x_(shape), x_(shape), gate)), ("nogate", (x_(shape), x_(shape), None)),
                ("split", (x_(shape), x_(shape), part, table))]
    if name == "rotary":
        strided = layout != "contiguous"
        q, k = qk_pair(gen, "bshd", 2, 12, 4, 2, 64, BF16, device, strided)
        cos, sin = rope_tables(gen, "BS", "bshd", 2, 12, 64, False, F32, device)
        qw, kw = weight(gen, 64, F32, device), weight(gen, 64, F32, device)
        rope = (q, k, cos, sin, None, None, 0.0, None, "none", False, None, None, 0.0, 0.0,
                False, False)
        qk_norm = (q, k, cos, sin, None, None, 0.0, None, "rms", False, qw, kw, 1e-6, 0.0,
                   True, False)
        grid = (q, None, None, None, [2, 2, 3], [22, 20, 22], 10000.0, [0, 1, 0], "none", False,
                None, None, 0.0, 0.0, True, False)
        return [("rope", rope), ("qk_norm", qk_norm), ("grid_k_none", grid)]
    if name == "gated_act":
        return [("silu", (x_(shape), x_(shape), "silu")), ("gelu", (x_(shape), x_(shape), "gelu"))]
    if name == "gated_act_packed":
        return [("first", (x_((2, 5, 2 * d)), "silu", True)),
                ("second", (x_((2, 5, 2 * 7)), "gelu_tanh", False))]
    if name == "act":
        return [("bias", (x_(shape), b, "gelu_tanh")), ("nobias", (x_(shape), None, "silu"))]
    if name == "moe_combine":
        rows = x_((12, d))
        index = torch.randperm(12, generator=gen).view(4, 3).to(device)
        weights = small(gen, (4, 3), F32, device)
        return [("i64", (rows, index, weights)),
                ("i32_transposed", (rows, index.int().t().contiguous().t(), weights.to(BF16)))]
    if name == "moe_topk":
        logits = x_((5, 64))
        bias = small(gen, (64,), F32, device)
        return [("softmax_bf16_out", (logits, 6, "softmax", None, 1, 1, True, 1.0, BF16)),
                ("sigmoid_groups", (logits.float(), 4, "sigmoid", bias, 8, 2, True, 2.5, None))]
    if name == "moe_sort":
        index = torch.rand((5, 8), generator=gen).argsort(-1)[:, :3].to(device)
        return [("i64", (index, 8)), ("i32_transposed", (index.int().t().contiguous().t(), 8))]
    raise KeyError(name)


@pytest.mark.parametrize("layout", ["contiguous", "row_slice"])
@pytest.mark.parametrize("name", OPS)
def test_opcheck(device, gen, name, layout):
    op = getattr(torch.ops.fusebox, name).default
    for case_id, args in op_cases(name, gen, device, layout):
        try:
            torch.library.opcheck(op, args)
        except Exception as e:  # name the failing case
            raise AssertionError(f"opcheck {name}[{case_id}, {layout}] failed: {e}") from e


def test_all_ops_covered():
    """Every operator the library registers is opchecked here (catches new ones)."""
    ns = torch.ops.fusebox
    registered = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("fusebox::")}
    assert registered, "no fusebox operators registered"
    assert registered <= set(OPS), f"not opchecked: {sorted(registered - set(OPS))}"
    for name in OPS:
        assert hasattr(ns, name), f"fusebox::{name} is not registered"
