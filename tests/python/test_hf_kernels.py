"""fusebox as an HF ``kernels`` repository: scripts/build_hf_kernel.py writes a build that
``kernels.get_local_kernel`` loads, whose ``layers`` ``kernelize`` puts in place of the
transformers modules its ``use_kernel_forward_from_hub`` decorators name (RMSNorm, activations,
the rotary function), through kernels' API and through transformers' own ``KernelConfig`` /
``kernelize`` (``set_use_kernels`` builds mappings for GPU devices only: it runs where CUDA
is)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

kernels = pytest.importorskip("kernels")
transformers = pytest.importorskip("transformers")

import fusebox  # noqa: E402
import reference  # noqa: E402
from helpers import DEVICES, HAS_CUDA, TOL, rel_err, tiny_llm, token_ids  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_hf_kernel.py"

pytestmark = pytest.mark.skipif(fusebox.LOAD_ERROR is not None, reason="no operator library")


def _load_script():
    spec = importlib.util.spec_from_file_location("build_hf_kernel", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf-kernel")
    assert _load_script().main(["--out", str(out), "--library", fusebox.LIBRARY_PATH]) == 0
    return out


@pytest.fixture(scope="module")
def kernel(repo):
    return kernels.get_local_kernel(repo)


def tiny_llama(device, act="silu"):
    return tiny_llm("llama", device=device, hidden_act=act)


# --------------------------------------------------------------------------- layout and loading


def test_layout_and_metadata(repo):
    (variant,) = list((repo / "build").iterdir())
    names = {p.name for p in variant.iterdir()}
    assert {"metadata.json", "__init__.py", "_ops.py", "layers.py", "functional.py", "_fake.py",
            "_fusebox_C.so"} <= names
    meta = kernels.Metadata.read_from_file(variant / "metadata.json")   # kernels' strict parser
    raw = json.loads((variant / "metadata.json").read_text())
    assert raw["name"] == "fusebox" and raw["id"].isidentifier()
    assert raw["id"].startswith("_fusebox_")
    assert meta.id == raw["id"]
    assert meta.name.python_name == "fusebox" and meta.python_depends == []
    # the variant kernels resolves for this torch, as get_local_kernel does
    from kernels.variants import get_variants_local, resolve_variant

    chosen, _ = resolve_variant(get_variants_local(repo / "build"))
    assert chosen is not None and chosen.variant_str == variant.name
    torch_tag = "torch" + "".join(torch.__version__.split("+")[0].split(".")[:2])
    assert variant.name.startswith(torch_tag + "-cxx11-")
    if torch.version.cuda:
        assert raw["backend"]["type"] == "cuda" and raw["backend"]["archs"]


@pytest.mark.parametrize("device", DEVICES)
def test_get_local_kernel_runs_the_operators(kernel, device):
    x = torch.randn(4, 64, device=device)
    w = torch.randn(64, device=device)
    assert rel_err(kernel.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6)) < TOL[torch.float32]
    gate, up = torch.randn(2, 4, 64, device=device).unbind(0)
    assert rel_err(kernel.gated_activation(gate, up), reference.gated_act(gate, up, "silu")) < TOL[torch.float32]
    assert kernel.add_op_namespace_prefix("rms_norm") == "fusebox::rms_norm"
    # the namespace was registered by the fusebox package already: reused, not loaded twice
    assert kernel.ops is torch.ops.fusebox


# both the build's and the package's rms_norm against the formula, in a child process
_RMS_NORM_CHECK = (
    "x = torch.randn(2, 8); w = torch.randn(8); "
    "ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w; "
    "assert torch.allclose(k.rms_norm(x, w, 1e-6), ref, atol=1e-5); "
    "assert torch.allclose(fusebox.rms_norm(x, w, 1e-6), ref, atol=1e-5); ")


def test_kernel_first_then_fusebox_package(repo):
    """Loading the build before importing fusebox must not register the operator namespace
    twice (which aborts the process)."""
    import os
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; import kernels, torch; "
            f"k = kernels.get_local_kernel(Path({str(repo)!r})); import fusebox; "
            + _RMS_NORM_CHECK + "print('ok')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.setdefault("FUSEBOX_LIBRARY", fusebox.LIBRARY_PATH)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_kernel_loaded_alone_then_fusebox_package(repo):
    """The build loaded where fusebox cannot be imported registers the operators and their
    fake implementations itself; importing fusebox afterwards reuses both."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    package_root = str(Path(fusebox.__file__).resolve().parents[1])
    if Path(package_root).name in ("site-packages", "dist-packages"):
        pytest.skip("fusebox is installed, so the build imports it first")
    code = ("import sys; from pathlib import Path; import kernels, torch; "
            f"k = kernels.get_local_kernel(Path({str(repo)!r})); assert k.LOADED_HERE; "
            f"sys.path.insert(0, {package_root!r}); import fusebox; "
            + _RMS_NORM_CHECK
            + "f = torch.compile(fusebox.rms_norm, fullgraph=True); "
            "assert torch.allclose(f(x, w, 1e-6), ref, atol=1e-5); print('ok')")
    path = [p for p in sys.path if p and Path(p).resolve() != Path(package_root)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_layers_are_kernelize_compatible(kernel):
    for name in kernel.layers.__all__:
        cls = getattr(kernel.layers, name)
        assert issubclass(cls, torch.nn.Module) and cls.__init__ is torch.nn.Module.__init__
        assert cls.can_torch_compile is True and cls.has_backward is False


# --------------------------------------------------------------------------- kernelize


def _mapping(repo, device, mode, names):
    """kernels' mapping (hub name -> device -> mode -> repository) to the local build's layers:
    what ``KernelConfig.create_compatible_mapping`` builds for a GPU device."""
    return {hub: {device: {mode: kernels.LocalLayerRepository(repo_path=repo, layer_name=layer)}}
            for hub, layer in names.items()}


@pytest.fixture
def rotary_func():
    """transformers' ``apply_rotary_pos_emb`` of Llama: one module shared by every Llama model
    of the process, which ``kernelize`` changes in place; its own forward is put back after
    the test."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    yield apply_rotary_pos_emb
    apply_rotary_pos_emb.__dict__.pop("forward", None)


# transformers' hub names -> layers of the build
LLAMA_LAYERS = {"RMSNorm": "RMSNorm", "SiLU": "SiLU", "rotary_pos_emb": "RotaryPosEmb"}


def _assert_llama_kernelized(model, kernel, rotary_func):
    assert model.model.layers[0].input_layernorm.forward.__func__ is kernel.layers.RMSNorm.forward
    assert model.model.norm.forward.__func__ is kernel.layers.RMSNorm.forward
    assert model.model.layers[0].mlp.act_fn.forward.__func__ is kernel.layers.SiLU.forward
    assert rotary_func.forward.__func__ is kernel.layers.RotaryPosEmb.forward


def test_transformers_names_its_layers():
    """With kernels inside transformers' window, its decorators are live: the modules carry
    the hub names the mappings here use."""
    from transformers import activations
    from transformers.models.llama import modeling_llama
    from transformers.utils.import_utils import is_kernels_available

    assert is_kernels_available()
    assert modeling_llama.LlamaRMSNorm.kernel_layer_name == "RMSNorm"
    assert activations.SiLUActivation.kernel_layer_name == "SiLU"
    assert activations.GELUTanh.kernel_layer_name == "GeluTanh"
    assert modeling_llama.apply_rotary_pos_emb.kernel_layer_name == "rotary_pos_emb"
    attention = tiny_llama("cpu").model.layers[0].self_attn
    assert attention.__dict__["_kernel_funcs"]["rotary_pos_emb"] is \
        modeling_llama.apply_rotary_pos_emb


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compile_mode", [False, True], ids=["inference", "inference+compile"])
def test_kernelize_llama(repo, kernel, rotary_func, device, compile_mode):
    model = tiny_llama(device)
    ids = token_ids(seq=16, device=device)
    with torch.no_grad():
        ref = model(ids).logits
    mode = kernels.Mode.INFERENCE
    if compile_mode:
        mode |= kernels.Mode.TORCH_COMPILE
    with kernels.use_kernel_mapping(_mapping(repo, device, mode, LLAMA_LAYERS),
                                    inherit_mapping=False):
        kernels.kernelize(model, mode=mode, device=device)
    _assert_llama_kernelized(model, kernel, rotary_func)
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref) < 1e-5
        if compile_mode:
            compiled = torch.compile(model, fullgraph=True, backend="eager")
            assert rel_err(compiled(ids).logits, ref) < 1e-5


def test_kernelize_gelu_tanh_activation(repo, kernel):
    model = tiny_llama("cpu", act="gelu_pytorch_tanh")
    ids = token_ids(seq=16)
    with torch.no_grad():
        ref = model(ids).logits
    mode = kernels.Mode.INFERENCE
    with kernels.use_kernel_mapping(_mapping(repo, "cpu", mode, {"GeluTanh": "GeluTanh"}),
                                    inherit_mapping=False):
        kernels.kernelize(model, mode=mode, device="cpu")
    assert model.model.layers[0].mlp.act_fn.forward.__func__ is kernel.layers.GeluTanh.forward
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref) < 1e-5


@pytest.mark.parametrize("act", ["gelu_new", "gelu_fast"])
def test_kernelize_written_out_gelu_tanh(repo, kernel, act):
    """GPT-2's and Phi's NewGELU and the FastGELU form: the tanh GELU as elementwise torch code,
    one fusebox pass under their hub names."""
    layer = {"gelu_new": "NewGELU", "gelu_fast": "FastGELU"}[act]
    model = tiny_llama("cpu", act=act)
    assert type(model.model.layers[0].mlp.act_fn).kernel_layer_name == layer
    ids = token_ids(seq=16)
    with torch.no_grad():
        ref = model(ids).logits
    mode = kernels.Mode.INFERENCE
    with kernels.use_kernel_mapping(_mapping(repo, "cpu", mode, {layer: layer}),
                                    inherit_mapping=False):
        kernels.kernelize(model, mode=mode, device="cpu")
    assert model.model.layers[0].mlp.act_fn.forward.__func__ is getattr(kernel.layers, layer).forward
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref) < 1e-5


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernelize_t5_formula_rms_norm(repo, kernel, weight_dtype):
    """GPT-OSS's RMSNorm shares the hub name "RMSNorm" with Llama's but applies its weight
    before the rounding: kernelized, it keeps its output dtype (x's, also with an fp32 weight)
    and values."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    torch.manual_seed(0)
    norm = GptOssRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(64))
    norm = norm.to(weight_dtype)
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        ref = norm(x)
    mode = kernels.Mode.INFERENCE
    with kernels.use_kernel_mapping(_mapping(repo, "cpu", mode, {"RMSNorm": "RMSNorm"}),
                                    inherit_mapping=False):
        kernels.kernelize(torch.nn.Sequential(norm), mode=mode, device="cpu")
    assert norm.forward.__func__ is kernel.layers.RMSNorm.forward
    kernel.layers._T5_FORMULA.clear()   # the first call traced: the formula read at trace time
    with torch.no_grad():
        compiled = torch.compile(norm, fullgraph=True, backend="eager")(x)
        out = norm(x)
    for y in (compiled, out):
        assert y.dtype == ref.dtype == torch.bfloat16
        assert rel_err(y, ref) < 4e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernelize_zero_centered_rms_norm(repo, kernel, dtype):
    """Qwen3.5's RMSNorm, hub name "RMSNormZeroCentered": ``norm(x) * (1 + weight)`` in fp32,
    rounded once to x's dtype; kernelized, the same values, eager and compiled."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    assert Qwen3_5RMSNorm.kernel_layer_name == "RMSNormZeroCentered"
    torch.manual_seed(0)
    norm = Qwen3_5RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(64))
    norm = norm.to(dtype)
    x = torch.randn(3, 5, 64).to(dtype)
    with torch.no_grad():
        ref = norm(x)
    mode = kernels.Mode.INFERENCE
    with kernels.use_kernel_mapping(
            _mapping(repo, "cpu", mode, {"RMSNormZeroCentered": "RMSNormZeroCentered"}),
            inherit_mapping=False):
        kernels.kernelize(torch.nn.Sequential(norm), mode=mode, device="cpu")
    assert norm.forward.__func__ is kernel.layers.RMSNormZeroCentered.forward
    with torch.no_grad():
        compiled = torch.compile(norm, fullgraph=True, backend="eager")(x)
        out = norm(x)
    for y in (compiled, out):
        assert y.dtype == dtype
        assert rel_err(y, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-6)
    # a view strided along its rows, which the operators alone refuse: as the host's forward
    xt = torch.randn(3, 64, 5).to(dtype).transpose(1, 2)
    with torch.no_grad():
        out, ref = norm(xt), Qwen3_5RMSNorm.forward(norm, xt)
    assert rel_err(out, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-6)


def test_training_mode_is_refused(repo):
    """The layers have no backward: kernels refuses them for a TRAINING registration."""
    model = tiny_llama("cpu").train()
    mode = kernels.Mode.TRAINING
    with kernels.use_kernel_mapping(_mapping(repo, "cpu", mode, {"RMSNorm": "RMSNorm"}),
                                    inherit_mapping=False):
        with pytest.raises(ValueError, match="backward"):
            kernels.kernelize(model, mode=mode, device="cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_rotary_layer_matches_transformers(kernel, device, unsqueeze_dim):
    """``RotaryPosEmb`` is a drop-in for ``apply_rotary_pos_emb`` (same parameter kinds)."""
    import inspect

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    def kinds(fn):
        return [p.kind for p in inspect.signature(fn).parameters.values()]

    host = type(apply_rotary_pos_emb).forward     # kernels' module around the function
    assert kinds(kernel.layers.RotaryPosEmb.forward) == kinds(host)
    gen = torch.Generator().manual_seed(0)

    def heads(n):   # GQA: q with 4 heads, k with 2
        shape = (2, n, 8, 16) if unsqueeze_dim == 1 else (2, 8, n, 16)
        return torch.randn(shape, generator=gen).to(device)

    q, k = heads(4), heads(2)
    angle = torch.randn(2, 8, 8, generator=gen).to(device)
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    out_q, out_k = kernel.layers.RotaryPosEmb()(q, k, cos, sin, unsqueeze_dim)
    assert rel_err(out_q, ref_q) < 1e-6 and rel_err(out_k, ref_k) < 1e-6


# model modules whose apply_rotary_pos_emb carries the hub name "rotary_pos_emb", each of
# another form: (module, table width in a 16-wide head)
ROTARY_HOSTS = {
    "llama": 16,                   # half-split pairs
    "gpt_oss": 8,                  # half-split pairs, each frequency once in the tables
    "openai_privacy_filter": 8,    # neighbouring pairs, each frequency once
    "nanochat": 16,                # turned the other way: kept on its own code
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("module", list(ROTARY_HOSTS))
def test_rotary_layer_as_kernelize_binds_it(kernel, device, module):
    """``kernelize`` runs the layer's forward with transformers' wrapper around the function it
    replaces: the layer probes that function once and computes what it computes."""
    import importlib

    fn = importlib.import_module(f"transformers.models.{module}.modeling_{module}").apply_rotary_pos_emb
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, n, 8, 16, generator=gen).to(device) for n in (4, 2))
    angle = torch.randn(2, 8, ROTARY_HOSTS[module], generator=gen).to(device)
    cos, sin = angle.cos(), angle.sin()
    ref_q, ref_k = fn(q, k, cos, sin)
    out_q, out_k = kernel.layers.RotaryPosEmb.forward(fn, q, k, cos, sin, 1)
    assert rel_err(out_q, ref_q) < 1e-6 and rel_err(out_k, ref_k) < 1e-6


# --------------------------------------------------------------------------- transformers' path


def _kernel_config(repo):
    from transformers import KernelConfig

    return KernelConfig({hub: f"{repo}:{layer}" for hub, layer in LLAMA_LAYERS.items()},
                        use_local_kernel=True)


def test_transformers_kernel_config_cpu(repo, kernel, rotary_func):
    """transformers' own ``kernelize`` (what ``set_use_kernels`` runs) with a local
    ``KernelConfig`` on CPU. ``create_compatible_mapping`` takes GPU devices only, so the
    mapping it would build is given here for "cpu"; the rest is transformers' code."""
    from transformers.integrations.hub_kernels import kernelize

    model = tiny_llama("cpu")
    ids = token_ids(seq=16)
    with torch.no_grad():
        ref = model(ids).logits
    config = _kernel_config(repo)
    config.sanitize_kernel_mapping(model)     # every hub name is one the model registers
    with pytest.raises(ValueError, match="devices supported"):
        config.create_compatible_mapping(model)
    config.kernel_mapping = _mapping(repo, "cpu", kernels.Mode.INFERENCE, LLAMA_LAYERS)
    model.kernel_config = config
    kernelize(model)
    assert model.use_kernels
    _assert_llama_kernelized(model, kernel, rotary_func)
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="KernelConfig maps GPU devices only: needs CUDA")
def test_transformers_set_use_kernels(repo, kernel, rotary_func):
    """The whole transformers path: ``KernelConfig(..., use_local_kernel=True)`` and
    ``model.set_use_kernels(True, config)``."""
    model = tiny_llama("cuda")
    ids = token_ids(seq=16, device="cuda")
    with torch.no_grad():
        ref = model(ids).logits
    config = _kernel_config(repo)
    model.set_use_kernels(True, config)
    assert config.kernel_mapping["RMSNorm"]["cuda"]
    _assert_llama_kernelized(model, kernel, rotary_func)
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref) < 1e-5
