"""fusebox.patch._common: replacing a module's forward inside accelerate / diffusers hooks and
putting the original back, whichever was installed first."""

import pytest
import torch

from fusebox.patch import _common

accelerate = pytest.importorskip("accelerate")
from accelerate.hooks import remove_hook_from_module  # noqa: E402


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.full((4,), 0.5))

    def forward(self, x):
        return self.proj(x) * self.scale


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Tiny()

    def forward(self, x):
        return self.inner(x) + 1


def _counting_forward(module, x):
    """A stand-in fused forward: the original's result, counted."""
    module.__dict__["fused_calls"] = module.__dict__.get("fused_calls", 0) + 1
    return _common.original_forward(module)(x)


def _fused_calls(module):
    return module.__dict__.get("fused_calls", 0)


def _setup():
    torch.manual_seed(0)
    model = Outer().eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        ref = model(x)
    return model, x, ref


def _run(model, x):
    with torch.no_grad():
        return model(x)


def _offloaded(module):
    return "_hf_hook" in module.__dict__ and module.scale.device.type == "meta"


@pytest.mark.parametrize("order", ["patch-offload-unpatch", "offload-patch-unpatch"])
def test_cpu_offload_hooks_survive_unpatch(order):
    model, x, ref = _setup()
    inner = model.inner
    if order == "patch-offload-unpatch":
        _common.replace_forward(inner, _counting_forward, "test")
        accelerate.cpu_offload(model, execution_device="cpu")
    else:
        accelerate.cpu_offload(model, execution_device="cpu")
        _common.replace_forward(inner, _counting_forward, "test")
    assert _offloaded(inner)
    assert torch.equal(_run(model, x), ref)
    assert _fused_calls(inner) == 1                  # the fused forward ran inside the hook

    assert _common.restore_forward(inner)
    assert not _common.is_patched(inner)
    assert _offloaded(inner)                         # the hook is still there ...
    assert _common.has_hooks(inner)
    assert torch.equal(_run(model, x), ref)          # ... and still loads the weights
    assert _fused_calls(inner) == 1                  # the original ran
    assert _common._is_original(inner._old_forward, inner)

    remove_hook_from_module(inner)                   # and accelerate can still take it off
    assert "forward" not in inner.__dict__ or _common._is_original(inner.forward, inner)


def test_patch_offload_patch_again_unpatch():
    model, x, ref = _setup()
    inner = model.inner
    _common.replace_forward(inner, _counting_forward, "test")
    accelerate.cpu_offload(model, execution_device="cpu")
    _common.replace_forward(inner, _counting_forward, "test")     # re-patch inside the hook
    assert _offloaded(inner) and _common.is_patched(inner)
    assert torch.equal(_run(model, x), ref) and _fused_calls(inner) == 1
    _common.restore_forward(inner)
    assert _offloaded(inner)
    assert torch.equal(_run(model, x), ref) and _fused_calls(inner) == 1


def test_hook_removed_before_unpatch():
    """patch -> offload -> hook removed: the fused forward is back in ``forward``; unpatch
    leaves the class forward."""
    model, x, ref = _setup()
    inner = model.inner
    _common.replace_forward(inner, _counting_forward, "test")
    accelerate.cpu_offload(model, execution_device="cpu")
    _run(model, x)
    remove_hook_from_module(model, recurse=True)
    assert _common.is_patched(inner) and not _common.has_hooks(inner)
    _common.restore_forward(inner)
    assert "forward" not in inner.__dict__


@pytest.mark.parametrize("order", ["patch-hook-unpatch", "hook-patch-unpatch"])
def test_diffusers_hooks_survive_unpatch(order):
    pytest.importorskip("diffusers")
    from diffusers.hooks import HookRegistry, ModelHook

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    model, x, ref = _setup()
    inner = model.inner

    def add_hook():
        HookRegistry.check_if_exists_or_initialize(inner).register_hook(Counting(), "counting")

    if order == "patch-hook-unpatch":
        _common.replace_forward(inner, _counting_forward, "test")
        add_hook()
    else:
        add_hook()
        _common.replace_forward(inner, _counting_forward, "test")
    assert torch.equal(_run(model, x), ref)
    assert (_fused_calls(inner), Counting.calls) == (1, 1)

    _common.restore_forward(inner)
    assert not _common.is_patched(inner) and _common.has_hooks(inner)
    assert torch.equal(_run(model, x), ref)
    assert (_fused_calls(inner), Counting.calls) == (1, 2)   # hook ran, original forward ran
    registry = inner._diffusers_hook
    registry.remove_hook("counting")
    assert _common._is_original(inner.forward, inner) or "forward" not in inner.__dict__
    assert torch.equal(_run(model, x), ref)


@pytest.mark.parametrize("shape, target", [
    ((1, 6, 8), (2, 6, 8)), ((6, 8), (2, 6, 8)), ((8,), (2, 6, 8)), ((2, 6, 8), (2, 6, 8)),
    ((1, 1, 1), (3, 4, 5)), ((2, 6, 8), (1, 6, 8)), ((3, 6, 8), (2, 6, 8)), ((1, 2, 6, 8), (2, 6, 8)),
    ((6, 1), (2, 6, 8)), ((), (2, 6, 8)), ((0, 8), (0, 8)), ((1, 8), (0, 8))])
def test_broadcasts_to_agrees_with_torch(shape, target):
    pytest.importorskip("diffusers")  # the DiT patchers' module imports it
    from fusebox.patch.dit._shared import broadcasts_to

    try:
        expect = torch.broadcast_shapes(shape, target) == torch.Size(target)
    except RuntimeError:
        expect = False
    assert broadcasts_to(torch.empty(shape), torch.empty(target)) == expect
