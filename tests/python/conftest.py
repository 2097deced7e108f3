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


def pytest_collection_modifyitems(config, items):
    """``FUSEBOX_TEST_SHARD=i/n`` keeps every n-th collected test from the i-th (0 <= i < n), so n
    processes can share one GPU (``scripts/gpu_check.sh`` with ``GPU_TEST_SHARDS``). Round robin
    over the collection order spreads each file's slow and fast cases over the shards."""
    spec = os.environ.get("FUSEBOX_TEST_SHARD")
    if not spec:
        return
    try:
        index, count = (int(part) for part in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"FUSEBOX_TEST_SHARD must be i/n with integers; got {spec!r}") from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"FUSEBOX_TEST_SHARD must be i/n with 0 <= i < n; got {spec!r}")
    kept, dropped = [], []
    for n, item in enumerate(items):
        (kept if n % count == index else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_runtest_logreport(report):
    """``FUSEBOX_SLOW_TEST_LOG=path``: each test phase of a second or more is appended to that file
    as it ends (duration, phase, test id), so a run cut off by a time limit still shows where its
    time went (``--durations`` reports only at the end of a session)."""
    path = os.environ.get("FUSEBOX_SLOW_TEST_LOG")
    if path and report.duration >= 1.0:
        with open(path, "a") as log:
            log.write(f"{report.duration:8.2f} s  {report.when:8}  {report.nodeid}\n")


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def gen(request):
    """A CPU generator seeded from the test's id: fresh, reproducible inputs per test."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
