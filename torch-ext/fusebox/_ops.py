"""Loads the compiled operator library and exposes its namespace as ``ops``."""

import glob
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _find_library() -> str:
    override = os.environ.get("FUSEBOX_LIBRARY")
    if override:
        return override
    for pattern in ("_fusebox_C*.so", "_fusebox_C*.pyd"):
        hits = sorted(glob.glob(os.path.join(_HERE, pattern)))
        if hits:
            return hits[0]
    raise ImportError(
        "fusebox: the compiled operator library (_fusebox_C*.so) is not next to "
        f"{__file__}. Build it with `pip install --no-build-isolation .` or "
        "`scripts/build.sh`, or point FUSEBOX_LIBRARY at it."
    )


LIBRARY_PATH = _find_library()
torch.ops.load_library(LIBRARY_PATH)
ops = torch.ops.fusebox
