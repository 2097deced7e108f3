#!/usr/bin/env python3
"""Writes fusebox as a local HF ``kernels`` repository, in kernel-builder's build layout:

    <out>/build/torch211-cxx11-cu130-x86_64-linux/
        metadata.json   name, id, version, license, python-depends, backend (kernels 0.16
                        requires every one of them)
        __init__.py     the functional API, ``ops`` and ``layers``
        _ops.py         loads the operator library; ``ops``, ``add_op_namespace_prefix``
        _fusebox_C.so   the compiled operator library (CPU and CUDA kernels)
        functional.py   _fake.py   _inductor.py   layers.py   (copied from torch-ext/fusebox)

Load it with ``kernels.get_local_kernel(Path(out))``, map transformers layers to it with
``KernelConfig({"RMSNorm": "<out>:RMSNorm"}, use_local_kernel=True)`` or
``LocalLayerRepository(repo_path=Path(out), layer_name="RMSNorm")``.

The variant name is the one ``kernels`` accepts for the torch this runs with (torch major.minor,
C++ ABI, CUDA major.minor, CPU, OS), so run it with the interpreter whose torch built the
library. Usage: ``python scripts/build_hf_kernel.py [--library PATH] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import json
import os
import platform
import re
import shutil
import sys
from pathlib import Path
from typing import List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "torch-ext" / "fusebox"
COPIED = ("functional.py", "_fake.py", "_inductor.py", "layers.py")
LIBRARY_NAME = "_fusebox_C.so"
KERNEL_NAME = "fusebox"
KERNEL_VERSION = 1
LICENSE = "Apache-2.0"

OPS_PY = '''"""Loads this build's operator library. The operators are registered in the fixed
``torch.ops.fusebox`` namespace, and a namespace can be registered once per process: when the
fusebox package (or another copy of this build) has registered it, it is reused; when the
fusebox package is installed, it is imported first, so that importing it after this build
does not register the namespace a second time."""

import importlib.util
import os

import torch


def _registered() -> bool:
    try:
        torch.ops.fusebox.rms_norm
    except (AttributeError, RuntimeError):
        return False
    return True


if not _registered() and importlib.util.find_spec("fusebox") is not None:
    import fusebox  # noqa: F401

LOADED_HERE = not _registered()
if LOADED_HERE:
    torch.ops.load_library(os.path.join(os.path.dirname(os.path.abspath(__file__)), "{library}"))
ops = torch.ops.fusebox


def add_op_namespace_prefix(name: str) -> str:
    return "fusebox::" + name
'''

INIT_PY = '''"""fusebox fused kernels as an HF kernels build: the functional API and ``layers``."""

from ._ops import LOADED_HERE, add_op_namespace_prefix, ops

if LOADED_HERE:
    from . import _fake  # noqa: F401  (fake implementations, for torch.compile)
from . import layers
from .functional import (
{imports}
)

__all__ = ["add_op_namespace_prefix", "layers", "ops",
{names}]
'''


def public_functions(path: Path) -> List[str]:
    """Top-level public function names of a module (its API, without importing it)."""
    tree = ast.parse(path.read_text())
    return [n.name for n in tree.body
            if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]


def variant_name() -> str:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    abi = "cxx11" if torch.compiled_with_cxx11_abi() else "cxx98"
    backend = "cu" + torch.version.cuda.replace(".", "") if torch.version.cuda else "cpu"
    system = platform.system().lower()
    return f"torch{major}{minor}-{abi}-{backend}-{platform.machine()}-{system}"


def find_library(explicit: Optional[str]) -> Path:
    candidates = [explicit, os.environ.get("FUSEBOX_LIBRARY")]
    candidates += sorted(glob.glob(str(PACKAGE / "_fusebox_C*.so")))
    candidates += sorted(glob.glob(str(ROOT / "build" / "_fusebox_C*.so")))
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    sys.exit("build_hf_kernel: no _fusebox_C*.so found; build it (scripts/build.sh) or pass "
             "--library")


def build_id(files: Sequence[Path], backend: str) -> str:
    """``_fusebox_<backend>_<hash of the build's files>``: unique per build, as kernels wants."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.read_bytes())
    return f"_{KERNEL_NAME}_{backend}_{digest.hexdigest()[:7]}"


def metadata(kernel_id: str, cuda_archs: Sequence[str]) -> dict:
    import torch

    backend = {"type": "cuda", "archs": list(cuda_archs)} if torch.version.cuda else {"type": "cpu"}
    return {"name": KERNEL_NAME, "id": kernel_id, "version": KERNEL_VERSION, "license": LICENSE,
            "python-depends": [], "backend": backend}


def write(out: Path, library: Path, cuda_archs: Sequence[str]) -> Path:
    variant_dir = out / "build" / variant_name()
    if variant_dir.exists():
        shutil.rmtree(variant_dir)
    variant_dir.mkdir(parents=True)
    shutil.copy2(library, variant_dir / LIBRARY_NAME)
    for name in COPIED:
        shutil.copy2(PACKAGE / name, variant_dir / name)
    (variant_dir / "_ops.py").write_text(OPS_PY.replace("{library}", LIBRARY_NAME))
    names = public_functions(PACKAGE / "functional.py")
    (variant_dir / "__init__.py").write_text(INIT_PY.format(
        imports="\n".join(f"    {n}," for n in names),
        names="\n".join(f'    "{n}",' for n in names)))
    files = sorted(p for p in variant_dir.iterdir() if p.is_file())
    backend = "cuda" if "-cu" in variant_dir.name else "cpu"
    meta = metadata(build_id(files, backend), cuda_archs)
    (variant_dir / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    return variant_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", help="the _fusebox_C*.so to ship (default: FUSEBOX_LIBRARY, "
                                          "then torch-ext/fusebox, then build/)")
    parser.add_argument("--out", default=str(ROOT / "build" / "hf-kernel"),
                        help="repository folder to write (default: build/hf-kernel)")
    parser.add_argument("--cuda-archs", default=os.environ.get("FUSEBOX_CUDA_ARCHS", "75;80;89;90"),
                        help="compute capabilities the library was built for "
                             "(as for scripts/build.sh)")
    args = parser.parse_args(argv)
    # CMake spelling ("90", "90a") to kernels' ("9.0", "9.0a")
    archs = [re.sub(r"^(\d+)(\d)", r"\1.\2", a) for a in re.split(r"[;,]", args.cuda_archs) if a]
    variant_dir = write(Path(args.out).resolve(), find_library(args.library), archs)
    print(f"[build_hf_kernel] {variant_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
