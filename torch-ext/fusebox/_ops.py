"""Loads the compiled operator library and exposes its namespace as ``ops``.

If the library is missing or cannot be loaded, importing fusebox still works (so that
``python -m fusebox bench`` can explain the situation); calling an operator then raises an
ImportError that says why."""

import glob
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _find_library() -> str:
    override = os.environ.get("FUSEBOX_LIBRARY")
    if override:
        return override
    hits = sorted(glob.glob(os.path.join(_HERE, "_fusebox_C*.so")))
    if hits:
        return hits[0]
    raise ImportError(
        "fusebox: the compiled operator library (_fusebox_C*.so) is not next to "
        f"{__file__}. Build it with `scripts/build.sh` or `pip install --no-build-isolation .`, "
        "or point FUSEBOX_LIBRARY at it."
    )


class _Unavailable:
    def __init__(self, error: BaseException):
        self._error = error

    def __getattr__(self, name):
        raise ImportError(f"fusebox operators are unavailable: {self._error}") from self._error


LOAD_ERROR = None
LIBRARY_PATH = None
LOADED_HERE = False  # whoever loads the library also registers the fake implementations
try:
    # Another copy of the library (e.g. an HF `kernels` build of fusebox) may have registered
    # the namespace already; loading a second one would abort the process.
    if not hasattr(torch.ops.fusebox, "rms_norm"):
        LIBRARY_PATH = _find_library()
        torch.ops.load_library(LIBRARY_PATH)
        LOADED_HERE = True
    ops = torch.ops.fusebox
except (ImportError, OSError) as error:
    LOAD_ERROR = error
    ops = _Unavailable(error)
