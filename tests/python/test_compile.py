"""torch.compile(fullgraph=True) of each public function family: no graph breaks, and the
compiled outputs equal the eager ones (and have the same dtype and shape)."""

import pytest
import torch

import fusebox
from helpers import BF16, F32, TOL, assert_close, call, randn, rope_tables, small, weight

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
