"""pytest configuration of the fusebox Python suite.

Makes ``import fusebox`` resolve to the in-tree package (``torch-ext/fusebox``, next to which
the build drops ``_fusebox_C*.so``) unless an installed package is asked for with
``FUSEBOX_TEST_INSTALLED=1``, and provides the ``device`` and ``gen`` fixtures.
"""

import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent
_TORCH_EXT = _HERE.parents[1] / "torch-ext"

if os.environ.get("FUSEBOX_TEST_INSTALLED") != "1" and str(_TORCH_EXT) not in sys.path:
    sys.path.insert(0, str(_TORCH_EXT))
if str(_HERE) not in sys.path:  # shared helpers (helpers.py, reference.py)
    sys.path.insert(0, str(_HERE))

from helpers import DEVICES  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line(
        "markers", "large: big-width / many-row case; full size only on CUDA, reduced on CPU"
    )


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def gen(request):
    """A CPU generator seeded from the test's id: fresh, reproducible inputs per test."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
