"""Explicit inductor fallbacks for the fusebox operators.

Inductor runs an operator it has no lowering for through an implicit fallback, and first
formats a log message that prints the operator's inputs as IR, whether or not that log is
enabled. Printing an input expands the graph upstream of it as a tree, so for an operator first
met deep in a whole-model graph (LTX-Video's final LayerNorm, after 28 blocks) the text grows
exponentially with depth and the compile does not end. Registering the same fallback up front
skips that path. Inductor's lowering module is imported only once torch.compile compiles, so
the fake implementations (which run while it traces) call :func:`register_fallbacks`.
"""

from __future__ import annotations

import sys
from typing import List

import torch

OP_NAMES: List[str] = []  # filled by _fake.py, one entry per operator
_registered = False


def register_fallbacks() -> None:
    """Registers a fallback lowering for every fusebox operator, with the layout constraint the
    implicit one would choose; a no-op until inductor is loaded, and after the first time."""
    global _registered
    if _registered:
        return
    lowering = sys.modules.get("torch._inductor.lowering")
    if lowering is None:
        return
    _registered = True
    try:  # inductor internals: where they differ, inductor's implicit fallback still works
        from torch._library.utils import get_layout_constraint_tag

        for name in OP_NAMES:
            op = getattr(torch.ops.fusebox, name).default
            if op not in lowering.lowerings:
                tag = get_layout_constraint_tag(op, with_default=True)
                lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag), warn=False)
    except (AttributeError, ImportError, TypeError):
        pass
