"""One call makes a transformers or diffusers model run its memory-bound layers on fusebox.

    import fusebox
    report = fusebox.patch(model)   # a transformers model, a diffusers transformer or pipeline
    print(report)                   # what was patched, what was left alone and why
    fusebox.unpatch(model)          # back to the original forwards

Each model family lives in its own module (``llm`` for transformers decoder LLMs, ``dit`` for
diffusers transformers); a family module provides ``applies(module) -> bool`` and
``patch(module, report, **options)``. Modules no family recognizes are left untouched and the
report says so; a model is never left half-patched by an error.
"""

from __future__ import annotations

import importlib
from typing import List

import torch

from . import _common
from .report import PatchEntry, PatchReport

FAMILY_MODULES = ("fusebox.patch.llm", "fusebox.patch.dit")


def _families() -> List[object]:
    out = []
    for name in FAMILY_MODULES:
        try:
            out.append(importlib.import_module(name))
        except ImportError:
            continue
    return out


def _pipeline_components(obj) -> List[tuple]:
    """(name, module) of a diffusers pipeline's torch modules."""
    comps = getattr(obj, "components", None)
    if not isinstance(comps, dict):
        return []
    return [(k, v) for k, v in comps.items() if isinstance(v, torch.nn.Module)]


def patch(obj, **options) -> PatchReport:
    """Patches ``obj`` (an ``nn.Module`` or a diffusers pipeline) in place and returns a
    :class:`PatchReport`. Options are passed to the family patchers (see their docs)."""
    report = PatchReport(model=type(obj).__name__)
    if isinstance(obj, torch.nn.Module):
        targets = [("", obj)]
    else:
        targets = _pipeline_components(obj)
        if not targets:
            raise TypeError(f"fusebox.patch expects a torch.nn.Module or a diffusers pipeline; "
                            f"got {type(obj).__name__}")
    families = _families()
    for name, module in targets:
        sub = PatchReport(model=type(module).__name__)
        family = next((f for f in families if f.applies(module)), None)
        if family is None:
            sub.skip(name or type(module).__name__, module,
                     "no fusebox patcher for this model class")
        else:
            try:
                family.patch(module, sub, **options)
            except Exception:
                unpatch(module)      # never leave a model half-patched
                raise
        report.merge(sub, prefix=name)
    return report


def unpatch(obj) -> int:
    """Restores every forward that :func:`patch` replaced; returns how many."""
    modules = [obj] if isinstance(obj, torch.nn.Module) else [m for _, m in _pipeline_components(obj)]
    n = 0
    for root in modules:
        for _, m in root.named_modules():
            n += int(_common.restore_forward(m))
            undo = m.__dict__.pop(_common.UNDO_ATTR, None)   # family-specific state to undo
            if undo is not None:
                undo()
    return n


def is_patched(obj) -> bool:
    modules = [obj] if isinstance(obj, torch.nn.Module) else [m for _, m in _pipeline_components(obj)]
    return any(_common.patched_modules(m) for m in modules)


__all__ = ["PatchEntry", "PatchReport", "is_patched", "patch", "unpatch"]
