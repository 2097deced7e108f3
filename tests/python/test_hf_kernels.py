"""fusebox as an HF ``kernels`` repository: scripts/build_hf_kernel.py writes a build that
``kernels.get_local_kernel`` loads, whose ``layers`` ``kernelize`` accepts in place of
transformers' RMSNorm, activations and rotary function, and that transformers' KernelConfig
maps to (the KernelConfig path itself only takes GPU devices: it runs where CUDA is)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

kernels = pytest.importorskip("kernels")
transformers = pytest.importorskip("transformers")

import fusebox  # noqa: E402
from helpers import DEVICES, HAS_CUDA  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_hf_kernel.py"
VOCAB = 128

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
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, hidden_act=act)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(device)


def token_ids(device):
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


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
    torch_tag = "torch" + "".join(torch.__version__.split("+")[0].split(".")[:2])
    assert variant.name.startswith(torch_tag + "-cxx11-")
    if torch.version.cuda:
        assert raw["backend"]["type"] == "cuda" and raw["backend"]["archs"]


@pytest.mark.parametrize("device", DEVICES)
def test_get_local_kernel_runs_the_operators(kernel, device):
    x = torch.randn(4, 64, device=device)
    w = torch.randn(64, device=device)
    assert torch.equal(kernel.rms_norm(x, w, 1e-6), fusebox.rms_norm(x, w, 1e-6))
    gate, up = torch.randn(2, 4, 64, device=device).unbind(0)
    assert torch.equal(kernel.gated_activation(gate, up), fusebox.gated_activation(gate, up))
    assert kernel.add_op_namespace_prefix("rms_norm") == "fusebox::rms_norm"
    # the namespace was registered by the fusebox package already: reused, not loaded twice
    assert kernel.ops is torch.ops.fusebox


def test_kernel_first_then_fusebox_package(repo):
    """Loading the build before importing fusebox must not register the operator namespace
    twice (which aborts the process)."""
    import os
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; import kernels, torch; "
            f"k = kernels.get_local_kernel(Path({str(repo)!r})); import fusebox; "
            "x = torch.randn(2, 8); w = torch.ones(8); "
            "assert torch.equal(k.rms_norm(x, w), fusebox.rms_norm(x, w)); print('ok')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.setdefault("FUSEBOX_LIBRARY", fusebox.LIBRARY_PATH)
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
    return {hub: {device: {mode: kernels.LocalLayerRepository(repo_path=repo, layer_name=layer)}}
            for hub, layer in names.items()}


def _transformers_uses_kernels() -> bool:
    """transformers decorates its layers only with a kernels version inside its own window
    (5.17: 0.16.x); otherwise its decorators are no-ops."""
    from transformers.utils.import_utils import is_kernels_available

    return is_kernels_available()


@pytest.fixture
def hub_names(monkeypatch):
    """The hub names transformers' decorators give these classes, set with kernels' own API
    when transformers left them undecorated (see _transformers_uses_kernels)."""
    from transformers import activations
    from transformers.models.llama import modeling_llama

    for cls, name in ((modeling_llama.LlamaRMSNorm, "RMSNorm"),
                      (activations.SiLUActivation, "SiLU"), (activations.GELUTanh, "GeluTanh")):
        if getattr(cls, "kernel_layer_name", None) is None:
            monkeypatch.setattr(cls, "kernel_layer_name", name, raising=False)


LLAMA_LAYERS = {"RMSNorm": "RMSNorm", "SiLU": "SiLU"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compile_mode", [False, True], ids=["inference", "inference+compile"])
def test_kernelize_llama(repo, kernel, hub_names, device, compile_mode):
    model = tiny_llama(device)
    ids = token_ids(device)
    with torch.no_grad():
        ref = model(ids).logits
    mode = kernels.Mode.INFERENCE
    if compile_mode:
        mode |= kernels.Mode.TORCH_COMPILE
    with kernels.use_kernel_mapping(_mapping(repo, device, mode, LLAMA_LAYERS),
                                    inherit_mapping=False):
        kernels.kernelize(model, mode=mode, device=device)
    assert model.model.layers[0].input_layernorm.forward.__func__ is kernel.layers.RMSNorm.forward
    assert model.model.norm.forward.__func__ is kernel.layers.RMSNorm.forward
    assert model.model.layers[0].mlp.act_fn.forward.__func__ is kernel.layers.SiLU.forward
    with torch.no_grad():
        assert rel(model(ids).logits, ref) < 1e-5
        if compile_mode:
            compiled = torch.compile(model, fullgraph=True, backend="eager")
            assert rel(compiled(ids).logits, ref) < 1e-5


def test_kernelize_gelu_tanh_activation(repo, kernel, hub_names):
    model = tiny_llama("cpu", act="gelu_pytorch_tanh")
    ids = token_ids("cpu")
    with torch.no_grad():
        ref = model(ids).logits
    mode = kernels.Mode.INFERENCE
    with kernels.use_kernel_mapping(_mapping(repo, "cpu", mode, {"GeluTanh": "GeluTanh"}),
                                    inherit_mapping=False):
        kernels.kernelize(model, mode=mode, device="cpu")
    assert model.model.layers[0].mlp.act_fn.forward.__func__ is kernel.layers.GeluTanh.forward
    with torch.no_grad():
        assert rel(model(ids).logits, ref) < 1e-5


def test_training_mode_is_refused(repo, hub_names):
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

    host = getattr(apply_rotary_pos_emb, "forward", apply_rotary_pos_emb)
    assert kinds(kernel.layers.RotaryPosEmb.forward)[-len(kinds(host)):] == kinds(host)
    gen = torch.Generator().manual_seed(0)

    def heads(n):   # GQA: q with 4 heads, k with 2
        shape = (2, n, 8, 16) if unsqueeze_dim == 1 else (2, 8, n, 16)
        return torch.randn(shape, generator=gen).to(device)

    q, k = heads(4), heads(2)
    angle = torch.randn(2, 8, 8, generator=gen).to(device)
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    out_q, out_k = kernel.layers.RotaryPosEmb()(q, k, cos, sin, unsqueeze_dim)
    assert rel(out_q, ref_q) < 1e-6 and rel(out_k, ref_k) < 1e-6


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA device"))])
def test_transformers_kernel_config(repo, kernel, hub_names, device):
    """KernelConfig accepts the local mapping; transformers builds it for GPU devices only, and
    applies it (``set_use_kernels``) only with a kernels version inside its window."""
    from transformers import KernelConfig

    model = tiny_llama(device)
    config = KernelConfig({"RMSNorm": f"{repo}:RMSNorm", "SiLU": f"{repo}:SiLU"},
                          use_local_kernel=True)
    config.sanitize_kernel_mapping(model)
    if device == "cpu":
        with pytest.raises(ValueError, match="devices supported"):
            config.create_compatible_mapping(model)
        return
    mapping = config.create_compatible_mapping(model)
    assert mapping["RMSNorm"]["cuda"]
    if not _transformers_uses_kernels():
        pytest.skip("this transformers does not accept the installed kernels version")
    ids = token_ids(device)
    with torch.no_grad():
        ref = model(ids).logits
    model.set_use_kernels(True, config)
    assert model.model.norm.forward.__func__ is kernel.layers.RMSNorm.forward
    with torch.no_grad():
        assert rel(model(ids).logits, ref) < 1e-5
