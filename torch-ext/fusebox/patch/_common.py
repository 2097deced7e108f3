"""Mechanics shared by the model families: swapping a module's forward without dropping the
hooks that accelerate (CPU offload, ``device_map``) or diffusers (group offload, caching) put
around it, undoing that, and deciding when a patched forward must fall back to the original.

A hook system wraps ``module.forward`` and keeps the forward it wrapped somewhere:
accelerate in ``module._old_forward``, diffusers in the function references of
``module._diffusers_hook``. Replacing ``module.forward`` itself would drop the hooks, so the
original is replaced where the innermost wrapper keeps it; every hook keeps running around the
fused forward. Hooks added after the patch wrap the fused forward in turn, so unpatching puts
the original back wherever the fused forward is found then, and those hooks stay too.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import types
import weakref
from typing import Callable, Hashable, Iterator, List, Optional, Tuple, TypeVar

import torch

ORIGINAL_ATTR = "_fusebox_original_forward"   # the bound forward we replaced
FUSED_ATTR = "_fusebox_fused_forward"         # the bound fused forward we put in its place
SLOT_ATTR = "_fusebox_forward_slot"           # where the fused forward was put (for unpatch)
TAG_ATTR = "_fusebox_patch"                   # short description of the patch ("rms_norm", ...)
UNDO_ATTR = "_fusebox_undo"                   # other state of the patch, undone by fusebox.unpatch


def source_text(fn) -> str:
    """A function's source without whitespace or comments: the text two functions are compared
    by when a fused forward serves every class whose forward reads as the one it re-implements."""
    try:
        text = inspect.getsource(fn)
    except (OSError, TypeError):
        return ""
    text = re.sub(r"#[^\n]*", "", text)
    return re.sub(r"\s+", "", text)


def _class_forward(module: torch.nn.Module):
    return type(module).forward


def _is_original(fn, module) -> bool:
    """Is ``fn`` the module's own class forward, bound to it?"""
    return (isinstance(fn, types.MethodType) and fn.__self__ is module
            and fn.__func__ is _class_forward(module))


def _slots(module: torch.nn.Module) -> Iterator[Tuple[object, str]]:
    """(holder, attribute) pairs that may hold the module's original forward, innermost
    wrapper first."""
    reg = module.__dict__.get("_diffusers_hook")
    if reg is not None:
        for ref in getattr(reg, "_fn_refs", []):
            yield ref, "original_forward"
            yield ref, "forward"
    if "_old_forward" in module.__dict__:
        yield module, "_old_forward"
    yield module, "forward"


def has_hooks(module: torch.nn.Module) -> bool:
    return "_hf_hook" in module.__dict__ or "_diffusers_hook" in module.__dict__


def replace_forward(module: torch.nn.Module, fused: Callable, tag: str) -> None:
    """Makes ``fused(module, *args, **kwargs)`` the module's forward, inside any hooks.

    ``fused`` may call ``original_forward(module)(...)`` to fall back. Raises RuntimeError
    when the module's forward was wrapped by something this function does not know."""
    if is_patched(module):
        restore_forward(module)
    bound = types.MethodType(fused, module)
    if "forward" not in module.__dict__:
        # nothing wraps the class forward: an instance attribute shadows it
        module.forward = bound
        original = types.MethodType(_class_forward(module), module)
        _remember(module, original, bound, (module, "forward"), tag)
        return
    for holder, attr in _slots(module):
        fn = getattr(holder, attr, None)
        if fn is not None and _is_original(fn, module):
            setattr(holder, attr, bound)
            _remember(module, fn, bound, (holder, attr), tag)
            return
    raise RuntimeError(
        f"fusebox: cannot patch {type(module).__name__}: its forward is wrapped by something "
        "other than accelerate or diffusers hooks. Patch the model before wrapping it.")


def _remember(module, original, fused, slot, tag) -> None:
    module.__dict__[ORIGINAL_ATTR] = original
    module.__dict__[FUSED_ATTR] = fused
    module.__dict__[SLOT_ATTR] = slot
    module.__dict__[TAG_ATTR] = tag


def _run_all(*fns: Callable) -> None:
    for fn in fns:
        fn()


def add_undo(module: torch.nn.Module, fn: Callable[[], None]) -> None:
    """Registers ``fn`` to run when :func:`fusebox.unpatch` reaches ``module``."""
    previous = module.__dict__.get(UNDO_ATTR)
    if previous is not None:
        fn = functools.partial(_run_all, previous, fn)
    module.__dict__[UNDO_ATTR] = fn


def original_forward(module: torch.nn.Module):
    """The forward the patch replaced (bound), or the class forward when unpatched."""
    original = module.__dict__.get(ORIGINAL_ATTR)
    if original is not None:   # no truth test on a method: torch.compile cannot trace one
        return original
    return types.MethodType(_class_forward(module), module)


def is_patched(module: torch.nn.Module) -> bool:
    return ORIGINAL_ATTR in module.__dict__


def _fused_slot(module: torch.nn.Module, fused, recorded) -> Optional[Tuple[object, str]]:
    """Where the fused forward is now: the slot it was put in, unless a hook added since then
    took it from there (accelerate into ``_old_forward``, diffusers into its function
    references)."""
    for holder, attr in (recorded, *_slots(module)):
        if holder.__dict__.get(attr) is fused:
            return holder, attr
    return None


def restore_forward(module: torch.nn.Module) -> bool:
    """Puts the original forward back where the fused one is now, inside any hooks added before
    or after the patch. False if unpatched."""
    if not is_patched(module):
        return False
    recorded = module.__dict__.pop(SLOT_ATTR)
    original = module.__dict__.pop(ORIGINAL_ATTR)
    fused = module.__dict__.pop(FUSED_ATTR)
    module.__dict__.pop(TAG_ATTR, None)
    slot = _fused_slot(module, fused, recorded)
    if slot is None:
        return True     # nothing reaches the fused forward any more
    holder, attr = slot
    if holder is module and attr == "forward" and _is_original(original, module):
        # back to the class forward when nothing else wrapped it
        module.__dict__.pop("forward", None)
    else:
        setattr(holder, attr, original)
    return True


def patched_modules(root: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in root.named_modules() if is_patched(m)]


def needs_autograd(*tensors: Optional[torch.Tensor]) -> bool:
    """fusebox operators have no backward: a forward that must be differentiated falls back."""
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


# --------------------------------------------------------------------------- per-forward values

T = TypeVar("T")
# (source tensor, its version, what was derived, the value); the few most recent
_DERIVED: List[Tuple[weakref.ref, int, Hashable, object]] = []


def derived_once(source: torch.Tensor, kind: Hashable, make: Callable[[], T]) -> T:
    """``make()``, formed once per ``source`` tensor and ``kind`` (a string, or a tuple that
    also holds the shapes the value depends on) in eager calls. The layers of
    one forward get the same rotary tables, so tables derived from them (another layout, both
    halves written out) are formed by the first layer and reused by the rest; a new forward
    brings new tensors. Under ``torch.compile`` the value is formed in the graph."""
    if torch.compiler.is_compiling():
        return make()
    version = _version(source)
    for ref, seen, what, value in _DERIVED:
        if ref() is source and seen == version and what == kind:
            return value
    value = make()
    _DERIVED[:] = [e for e in _DERIVED if e[0]() is not None][-7:]
    _DERIVED.append((weakref.ref(source), version, kind, value))
    return value


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place version; inference-mode tensors keep none (-1)."""
    return -1 if t.is_inference() else t._version


# --------------------------------------------------------------------------- GEMM epilogue

# A projection followed by GELU-tanh runs as one GEMM whose epilogue adds the bias and applies
# the GELU (``torch._addmm_activation``: cuBLASLt's GELU_BIAS epilogue, the tanh form on CUDA)
# instead of writing the product for a separate pass to read back. FUSEBOX_GEMM_GELU=0 keeps the
# separate pass, for side-by-side measurements.
GEMM_GELU = os.environ.get("FUSEBOX_GEMM_GELU", "1") != "0"


def gemm_gelu_tanh_ok(x: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Can :func:`gemm_bias_gelu_tanh` take ``x``? CUDA only (on CPU the same op applies the
    exact erf GELU), with a bias in x's dtype."""
    return (GEMM_GELU and x.is_cuda and x.dim() >= 2 and bias is not None
            and bias.dtype == x.dtype)


def gemm_bias_gelu_tanh(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x @ weight_t + bias)`` in one GEMM; ``weight_t`` is ``[in, out]``."""
    flat = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight_t, use_gelu=True)
    return flat.view(*x.shape[:-1], weight_t.shape[1])
