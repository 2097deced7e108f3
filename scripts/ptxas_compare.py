"""Compares the register allocation of one CUDA source at two git revisions (or a revision and
the working tree): compiles both with ``nvcc -Xptxas -v`` for one architecture and prints every
kernel whose registers or spill bytes differ, and, where ``cuobjdump`` is found, the SASS
instruction count (NOPs excluded) of the kernels matching ``--sass``. A check for changes to
register-sensitive kernels before they go to a GPU, not a measurement of speed.

    python scripts/ptxas_compare.py 7b1937d 00ba0d1 csrc/norm/norm_cuda.cu \\
        --sass "norm_rows_kernel<bf16, bf16, 8, 1, (N)1, false, false>"

REV may be ``WORKTREE`` (the file as it is on disk).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_at(rev: str, path: str) -> str:
    if rev == "WORKTREE":
        with open(os.path.join(ROOT, path)) as f:
            return f.read()
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def short_name(mangled: str) -> str:
    name = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip() or mangled
    for long, short in (("fusebox::cuda::(anonymous namespace)::", ""), ("__nv_bfloat16", "bf16"),
                        ("fusebox::NormType", "N"), ("fusebox::Activation", "A")):
        name = name.replace(long, short)
    return re.sub(r"\((?:Norm|Rope|Act)KernelArgs(?:, int)?\)$", "", name)


def compile_at(rev: str, path: str, arch: str, out_dir: str):
    """(kernel -> (registers, spill store bytes), cubin path)."""
    # compiled next to the original, so that its includes resolve as they do in the build
    src = os.path.join(ROOT, os.path.dirname(path), f".ptxas_compare_{rev}_{os.path.basename(path)}")
    cubin = os.path.join(out_dir, f"{rev}.cubin")
    with open(src, "w") as f:
        f.write(source_at(rev, path))
    try:
        proc = subprocess.run(["nvcc", "-O3", "-std=c++17", f"-arch=sm_{arch}", "-cubin", "-Xptxas", "-v",
                               f"-I{ROOT}/csrc/include", f"-I{ROOT}/csrc", "-o", cubin, src],
                              capture_output=True, text=True)
    finally:
        os.remove(src)
    if proc.returncode != 0:
        sys.exit(f"nvcc failed at {rev}:\n{proc.stderr[-3000:]}")
    regs, current, spill = {}, None, 0
    for line in proc.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            current, spill = short_name(m.group(1)), 0
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            spill = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            regs[current] = (int(m.group(1)), spill)
    return regs, cubin


def sass_counts(cubin: str, cuobjdump: str):
    dump = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    counts, current = {}, None
    for line in dump.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = short_name(m.group(1))
            counts[current] = 0
        elif current and re.match(r"\s+/\*[0-9a-f]{4}\*/\s+\S", line) and " NOP" not in line:
            counts[current] += 1
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("path", help="the .cu file, relative to the repository root")
    ap.add_argument("--arch", default="90")
    ap.add_argument("--sass", action="append", default=[], help="kernel name substring for SASS counts")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (old, old_cubin), (new, new_cubin) = (compile_at(r, args.path, args.arch, tmp) for r in (args.old, args.new))
        print(f"{args.path}, sm_{args.arch}: registers (spill store bytes), {args.old} -> {args.new}")
        changed = [k for k in old if old[k] != new.get(k)]
        for k in changed:
            (r0, s0), (r1, s1) = old[k], new.get(k, (0, 0))
            print(f"  {r0:4d} ({s0:3d}) -> {r1:4d} ({s1:3d})  {k}")
        print(f"{len(changed)} of {len(old)} kernels changed")
        added = [k for k in new if k not in old]
        for k in added:
            print(f"     new -> {new[k][0]:4d} ({new[k][1]:3d})  {k}")
        if added:
            print(f"{len(added)} kernels only at {args.new}")
        if args.sass:
            if not args.cuobjdump:
                print("SASS counts skipped: no cuobjdump (pass --cuobjdump)")
                return 0
            before, after = sass_counts(old_cubin, args.cuobjdump), sass_counts(new_cubin, args.cuobjdump)
            for k in sorted(before):
                if any(s in k for s in args.sass):
                    print(f"  SASS instructions {before[k]} -> {after.get(k)}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
