"""torch.compile(fullgraph=True) of each public function family: no graph breaks, and the
compiled outputs equal the eager ones (and have the same dtype and shape)."""

import pytest
import torch

import fusebox
import reference as ref
from helpers import (BF16, DTYPES, F32, ROPE_LAYOUTS, TOL, assert_close, call, qk_pair, randn,
                     requires_cuda, rope_tables, small, weight)

# Inductor runs on both devices (on the CPU its C++ codegen uses the system compiler; graphs
# made only of these opaque operators and views need little of it).
BACKEND = "inductor"


def compile_and_compare(fn, *args):
    torch._dynamo.reset()
    eager = fn(*args)
    compiled = call(torch.compile(fn, fullgraph=True, backend=BACKEND), *args)
    flat_e = torch.utils._pytree.tree_leaves(eager)
    flat_c = torch.utils._pytree.tree_leaves(compiled)
    assert len(flat_e) == len(flat_c)
    for i, (e, c) in enumerate(zip(flat_e, flat_c)):
        if e is None:
            assert c is None
            continue
        tol = TOL[e.dtype] / 10  # the same kernels: equal up to a different vectorized path
        assert_close(c, e.double(), e.dtype, tol=tol, name=f"output {i}")


def test_compile_norms(device, gen):
    def fn(x, res, w, b):
        normed, h = fusebox.fused_add_rms_norm(x, res, w)
        return (fusebox.rms_norm(x, w), fusebox.rms_norm(x, None, out_dtype=torch.float32),
                normed, h, fusebox.layer_norm(h, w, b), fusebox.rmsnorm(x, w),
                fusebox.rmsnorm_residual(x, res, w), fusebox.rms_norm_add(x, res, w))

    x = randn(gen, (3, 7, 768), BF16, device)[:, :, :700]  # strided rows
    res = randn(gen, (3, 7, 700), BF16, device)
    compile_and_compare(fn, x, res, weight(gen, 700, F32, device), small(gen, (700,), F32, device))


def test_compile_adaln_gated_residual(device, gen):
    def fn(x, branch, table, w, b):
        shift, scale, gate, shift2, scale2, gate2 = table.chunk(6, dim=1)  # views in the graph
        out, h = fusebox.gated_residual_norm(x, branch, gate, scale, shift, w, b)
        return (fusebox.adaln(x, scale, shift, w, b, norm_type="rms"), out, h,
                fusebox.gated_residual(x, branch, gate2),
                fusebox.adaln_rmsnorm(x, scale2, shift2), fusebox.adaln_layernorm(x, scale2),
                fusebox.adaln_zero(x, branch, gate2),
                fusebox.adaln_zero(x, branch, gate, scale2, shift2, norm_type="rms"))

    shape = (2, 9, 256)
    x, branch = randn(gen, shape, BF16, device), randn(gen, shape, BF16, device)
    table = small(gen, (2, 6, 256), F32, device)
    compile_and_compare(fn, x, branch, table, weight(gen, 256, F32, device),
                        small(gen, (256,), F32, device))


def test_compile_rope_family(device, gen):
    b, s, hq, hk, d = 2, 12, 4, 2, 64

    def fn(qkv, cos, sin, qw, kw):
        q, k, _ = qkv.unflatten(-1, (-1, d)).split([hq, hk, hk], dim=2)  # views in the graph
        return (fusebox.rope(q, k, cos, sin),
                fusebox.rope(q.transpose(1, 2), None, cos, sin, interleaved=True,
                             heads_first=True),
                fusebox.qk_norm_rope(q, k, qw, kw, cos, sin, interleaved=True),
                fusebox.rope_3d(q, k, 2, 2, 3),
                fusebox.rope_1d(q, k, cos, sin))

    qkv = randn(gen, (b, s, (hq + 2 * hk) * d), BF16, device)
    cos, sin = rope_tables(gen, "BS", "bshd", b, s, d, False, F32, device)
    compile_and_compare(fn, qkv, cos, sin, weight(gen, d, F32, device), weight(gen, d, F32, device))


def _compiled_with_graph_ops(fn, *args):
    """``fn`` compiled by inductor (fullgraph) and run; also the operators its graph calls."""
    from torch._inductor.compile_fx import compile_fx

    called = []

    def backend(gm, example_inputs):
        called.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    return call(torch.compile(fn, fullgraph=True, backend=backend), *args), called


# Every dtype on CUDA; bf16 alone on the CPU, which tests the same decomposition and whose C++
# codegen of these graphs took 85-119 s a case on one core (the slowest of the GPU suite's test
# phases: bench/results/2026-12-07_h100_2b8c83a/checks.txt).
ONE_TOKEN_CASES = [pytest.param("cpu", BF16, id="cpu-bf16")] + [
    pytest.param("cuda", dtype.values[0], id=f"cuda-{dtype.id}", marks=[pytest.mark.gpu, requires_cuda])
    for dtype in DTYPES]


@pytest.mark.parametrize("device, dtype", ONE_TOKEN_CASES)
@pytest.mark.parametrize("layout", ROPE_LAYOUTS)
def test_compiled_one_token_rotary_is_left_to_the_compiler(layout, dtype, device, gen):
    # a decode step's rotary (one token a sequence) is written in torch operations under
    # compile, so the compiler fuses it with the table gather and the cache write; it must
    # give what the operator gives, for every form the operator takes
    b, hq, hk, d = 3, 4, 2, 64

    def fn(q, k, cos, sin, cos_r, sin_r, qw, kw, qw_all, kw_all):
        heads_first = layout == "bhsd"
        return (fusebox.rope(q, k, cos, sin, heads_first=heads_first),
                fusebox.rope(q, None, cos_r, sin_r, interleaved=True, heads_first=heads_first),
                fusebox.qk_norm_rope(q, k, qw, kw, cos, sin, eps=1e-5, heads_first=heads_first,
                                     weight_offset=1.0),
                fusebox.qk_norm_rope(q, k, None, None, cos_r, sin_r, interleaved=True,
                                     heads_first=heads_first),
                fusebox.qk_norm_rope(q, k, qw_all, kw_all, cos, sin, across_heads=True,
                                     heads_first=heads_first))

    q, k = qk_pair(gen, layout, b, 1, hq, hk, d, dtype, device, strided=True)
    cos, sin = rope_tables(gen, "4d" if layout != "flat" else "BS", layout, b, 1, d, False,
                           dtype, device)
    cos_r, sin_r = rope_tables(gen, "S", layout, b, 1, d // 2, True, F32, device)  # partial
    width = (lambda h: d) if layout == "flat" else (lambda h: h * d)
    args = (q, k, cos, sin, cos_r, sin_r, weight(gen, d, F32, device), weight(gen, d, dtype, device),
            weight(gen, width(hq), F32, device), weight(gen, width(hk), F32, device))
    compiled, called = _compiled_with_graph_ops(fn, *args)
    assert not [t for t in called if "fusebox" in t], called
    heads_first = layout == "bhsd"
    expected = (
        (ref.rope(q, cos, sin, False, heads_first), ref.rope(k, cos, sin, False, heads_first)),
        (ref.rope(q, cos_r, sin_r, True, heads_first), None),
        tuple(ref.qk_norm_rope(x, w, cos, sin, 1e-5, False, False, heads_first, 1.0)
              for x, w in ((q, args[6]), (k, args[7]))),
        tuple(ref.qk_norm_rope(x, None, cos_r, sin_r, 1e-6, False, True, heads_first)
              for x in (q, k)),
        tuple(ref.qk_norm_rope(x, w, cos, sin, 1e-6, True, False, heads_first)
              for x, w in ((q, args[8]), (k, args[9]))))
    eager = fn(*args)
    for i, (got, want, op) in enumerate(zip(compiled, expected, eager)):
        for j in range(2):
            if want[j] is None:
                assert got[j] is None and op[j] is None
                continue
            assert_close(got[j], want[j], dtype, name=f"call {i} output {j}")
            assert_close(got[j], op[j].double(), dtype, tol=TOL[dtype] / 10,
                         name=f"call {i} output {j} against the operator")


def test_compiled_rotary_keeps_the_operator_past_one_token_or_when_asked(gen, monkeypatch):
    d = 32
    q, k = qk_pair(gen, "bshd", 2, 2, 4, 2, d, BF16)
    cos, sin = rope_tables(gen, "BS", "bshd", 2, 2, d, False, F32)
    fn = lambda q, k, cos, sin: fusebox.rope(q, k, cos, sin)  # noqa: E731
    _, called = _compiled_with_graph_ops(fn, q, k, cos, sin)
    assert any("fusebox.rotary" in t for t in called), called
    monkeypatch.setattr(fusebox.functional, "COMPILED_ONE_TOKEN_ROTARY", "kernel")
    one = (q[:, :1], k[:, :1], cos[:, :1], sin[:, :1])
    out, called = _compiled_with_graph_ops(fn, *one)
    assert any("fusebox.rotary" in t for t in called), called
    assert_close(out[0], ref.rope(one[0], one[2], one[3]), BF16)


def test_compile_activations(device, gen):
    def fn(x, packed, bias):
        gate, up = packed.chunk(2, dim=-1)
        return (fusebox.gated_activation(gate, up, "gelu"),
                fusebox.gated_activation_packed(packed, "silu", False),
                fusebox.activation(x, bias, "silu"), fusebox.gelu_tanh(x, bias),
                fusebox.silu_and_mul(packed), fusebox.swiglu(gate, up), fusebox.geglu(packed))

    x = randn(gen, (3, 5, 320), BF16, device)
    packed = randn(gen, (3, 5, 2 * 320), BF16, device)
    compile_and_compare(fn, x, packed, small(gen, (320,), F32, device))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_dynamic_shapes(device, gen, dynamic):
    # recompiles (or not) across row counts; outputs still match eager
    fn = torch.compile(lambda x, w: fusebox.rms_norm(x, w), fullgraph=True, backend=BACKEND,
                       dynamic=dynamic)
    torch._dynamo.reset()
    w = weight(gen, 128, F32, device)
    for rows in (3, 17, 5):
        x = randn(gen, (rows, 128), BF16, device)
        assert_close(call(fn, x, w), fusebox.rms_norm(x, w).double(), BF16, tol=TOL[BF16] / 10)


def test_inductor_lowers_every_operator_without_the_implicit_fallback(monkeypatch, gen):
    # Inductor's implicit fallback prints the inputs' IR, a tree of the whole graph upstream:
    # an operator first met deep in a graph made whole-model compiles of a patched LTX-Video
    # run for hours. Every fusebox operator must get its fallback registered up front.
    import torch._inductor.exc as inductor_exc

    from fusebox import _inductor

    met = []
    real = inductor_exc.OperatorIssue.operator_str

    def spy(target, args, kwargs):
        met.append(str(target))
        return real(target, args, kwargs)

    monkeypatch.setattr(inductor_exc.OperatorIssue, "operator_str", staticmethod(spy))

    def deep(x, w):
        for _ in range(12):  # the layer norm comes after a chain of other operators
            x = fusebox.gated_residual(x, fusebox.activation(x, None, "gelu_tanh"), w)
        return fusebox.layer_norm(x, w, None)

    x, w = randn(gen, (4, 64), F32), weight(gen, 64, F32)
    # lower the graph instead of loading a cached one
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        compile_and_compare(deep, x, w)
    assert not [t for t in met if t.startswith("fusebox.")], met
    lowerings = torch._inductor.lowering.lowerings
    assert all(getattr(torch.ops.fusebox, name).default in lowerings for name in _inductor.OP_NAMES)
    assert len(_inductor.OP_NAMES) == len(set(_inductor.OP_NAMES)) >= 9
