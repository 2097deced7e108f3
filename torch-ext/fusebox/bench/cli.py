"""``fusebox bench``: times every fusebox op against what users run today.

Without a GPU it says so, lists what it would measure, and exits 0. The fusebox operators
are imported only when a GPU run starts, so a missing compiled library is reported, not fatal
(the baselines are still timed).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from typing import List, Optional, Sequence

from . import suite

PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EPILOG = """\
examples:
  fusebox bench                       full default suite (bf16 + fp16), all ops
  fusebox bench --quick               representative subset, bf16, about a minute
  fusebox bench --ops rms_norm,rope --shapes llm --dtype bf16
  fusebox bench --list                print the selected cases, run nothing
  fusebox bench --resume --max-minutes 9
                                      continue an interrupted run in the same folder,
                                      stopping cleanly before a time limit
  fusebox bench --from-json DIR/results.json[.gz]
                                      rewrite results.md and the plots from a results.json
  fusebox bench e2e --model qwen3-8b  end to end: a whole model (random weights, real config),
                                      eager / patched / torch.compile / patched + compile;
                                      `fusebox bench e2e --help` for the models
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fusebox bench",
        description="Time fusebox kernels against eager HF/diffusers code, the fused PyTorch "
                    "op, torch.compile and Liger-Kernel; report TB/s, % of copy bandwidth, "
                    "ratio to the floor and speedups.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="all",
                   help="comma-separated ops (default: all): " + ", ".join(suite.OP_NAMES))
    p.add_argument("--shapes", default="all",
                   help="shape groups: llm, seeds, dit, or all (default: all)")
    p.add_argument("--dtype", default=None,
                   help="comma-separated dtypes: bf16, fp16, fp32 (default: bf16,fp16; "
                        "with --quick: bf16)")
    p.add_argument("--quick", action="store_true",
                   help="a small representative subset (about a minute on an H200)")
    p.add_argument("--out", default=None,
                   help="results folder (default: bench/results/<date>_<gpu>_<commit>/, "
                        "under bench/results/_scratch/ with --quick)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--no-liger", action="store_true", help="skip the Liger-Kernel baseline")
    p.add_argument("--json-only", action="store_true",
                   help="write results.json only (no markdown, no plots)")
    p.add_argument("--list", action="store_true", help="print the selected cases and exit")
    p.add_argument("--resume", action="store_true",
                   help="keep the cases already in OUT/results.json and run the rest")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new case after this many minutes; reports are still written")
    p.add_argument("--iters", type=int, default=None,
                   help="timed calls per implementation (default 100; --quick 30)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up calls per implementation (default 10; --quick 5)")
    p.add_argument("--from-json", metavar="PATH", default=None,
                   help="regenerate results.md and plots from an existing results.json")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.op_list = suite.parse_ops(args.ops)
        args.group_list = suite.parse_groups(args.shapes)
        args.dtype_list = suite.parse_dtypes(args.dtype or ("bf16" if args.quick else "bf16,fp16"))
    except ValueError as e:
        parser.error(str(e))
    if args.iters is not None and args.iters < 1:
        parser.error("--iters must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.iters is None:
        args.iters = 30 if args.quick else 100
    if args.warmup is None:
        args.warmup = 5 if args.quick else 10
    return args


# --------------------------------------------------------------------------- environment bits


def library_status() -> tuple:
    """(path or None, text) of the compiled operator library, without loading it."""
    override = os.environ.get("FUSEBOX_LIBRARY")
    if override:
        if os.path.exists(override):
            return override, f"FUSEBOX_LIBRARY={override}"
        return None, f"FUSEBOX_LIBRARY={override} does not exist"
    hits = sorted(glob.glob(os.path.join(PKG_DIR, "_fusebox_C*.so"))
                  + glob.glob(os.path.join(PKG_DIR, "_fusebox_C*.pyd")))
    if hits:
        return hits[0], hits[0]
    return None, (f"not built: no _fusebox_C*.so in {PKG_DIR} (build it with "
                  "`pip install --no-build-isolation .` or scripts/build.sh)")


def _git(args: List[str], cwd: str) -> Optional[str]:
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else None
    except Exception:  # noqa: BLE001
        return None


def repo_root() -> Optional[str]:
    """The checkout this package lives in (``<root>/torch-ext/fusebox``), if any."""
    top = _git(["rev-parse", "--show-toplevel"], PKG_DIR)
    if top and os.path.abspath(os.path.join(top, "torch-ext", "fusebox")) == PKG_DIR:
        return top
    return None


def git_info() -> dict:
    """Commit of the checkout. ``FUSEBOX_COMMIT``, when set, names it instead: a working tree
    copied to a GPU machine may carry no .git, or a stale one."""
    root = repo_root()
    override = os.environ.get("FUSEBOX_COMMIT") or None
    if root is None or override:
        return {"commit": override, "dirty": None}
    commit = _git(["rev-parse", "--short", "HEAD"], root)
    status = _git(["status", "--porcelain", "--untracked-files=no"], root)
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def fusebox_version() -> str:
    mod = sys.modules.get("fusebox")
    v = getattr(mod, "__version__", None) if mod is not None else None
    if v:
        return str(v)
    try:
        from importlib.metadata import version
        return version("fusebox")
    except Exception:  # noqa: BLE001
        return "unknown"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-") or "gpu"


def default_out_dir(gpu: str, commit: Optional[str], quick: bool,
                    date: Optional[str] = None) -> str:
    root = repo_root() or os.getcwd()
    date = date or datetime.date.today().isoformat()
    base = os.path.join(root, "bench", "results")
    if quick:
        base = os.path.join(base, "_scratch")
    return os.path.join(base, f"{date}_{slug(gpu)}_{commit or 'nogit'}")


# --------------------------------------------------------------------------- messages


def _baselines_of(spec) -> str:
    names = ["eager"]
    if spec.torch is not None:
        names.append(spec.torch_doc)
    names.append("torch.compile")
    if spec.liger is not None:
        names.append("Liger")
    return ", ".join(names)


def _mb(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def suite_table(cases: Sequence[suite.Case]) -> List[str]:
    lines = []
    for op in dict.fromkeys(c.op for c in cases):
        cs = [c for c in cases if c.op == op]
        mbs = [c.nbytes / 1e6 for c in cs]
        dts = ",".join(dict.fromkeys(c.dtype for c in cs))
        lines.append(f"  {op:<20} {len(cs):>3} cases ({dts}; {_mb(min(mbs))}-{_mb(max(mbs))} MB "
                     f"moved)  vs {_baselines_of(suite.REGISTRY[op])}")
    return lines


def no_gpu_message(cases: Sequence[suite.Case], args: argparse.Namespace) -> str:
    import torch

    lib_path, lib_text = library_status()
    liger = ("importable" if importlib.util.find_spec("liger_kernel") is not None
             else "not installed here (pip install liger-kernel; the bench skips it cleanly)")
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    why = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
    if cvd is not None:
        why += f", CUDA_VISIBLE_DEVICES={cvd!r}"
    lines = [
        f"fusebox bench: no CUDA GPU found ({why}); nothing was timed.",
        "",
        f"What it would measure: {len(cases)} cases "
        f"(ops x shapes x dtypes, --shapes {','.join(args.group_list)}, "
        f"--dtype {','.join(args.dtype_list)}{', --quick' if args.quick else ''}):",
        *suite_table(cases),
        "plus, in the same run, the device-to-device copy bandwidth and the empty-kernel launch",
        "time; for every case the median kernel time (CUDA events, L2 kept cold), achieved TB/s,",
        "% of copy bandwidth, ratio to the floor (launch + bytes / copy bandwidth) and the speedup",
        "over each baseline, with CUDA-graph replay and host-inclusive latency for small inputs.",
        "Output: results.json, results.md and one PNG per op and dtype in the results folder.",
        "",
        f"fusebox library: {'found at ' + lib_path if lib_path else lib_text}"
        + ("" if lib_path else " (a GPU run would then time the baselines only)"),
        f"Liger-Kernel: {liger}",
        "",
        "How to run it: on a machine with an NVIDIA GPU (H100/H200 class), after building fusebox:",
        "  python -m fusebox bench                 # full default suite",
        "  python -m fusebox bench --quick         # about a minute",
        "  python -m fusebox bench --list          # the cases, without running them",
        "  python -m fusebox bench --help          # all options",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- run


def _op_notes(ops: Sequence[str]) -> dict:
    out = {}
    for op in ops:
        s = suite.REGISTRY[op]
        out[op] = {"title": s.title, "eager": s.eager_doc, "torch": s.torch_doc,
                   "liger": s.liger_doc}
    return out


def regenerate(path: str, json_only: bool) -> int:
    from . import report

    if os.path.isdir(path):
        path = os.path.join(path, "results.json")
        if not os.path.exists(path) and os.path.exists(path + ".gz"):
            path += ".gz"  # older committed runs keep their results gzipped
    try:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        print(f"fusebox bench: cannot read {path}: {e}", file=sys.stderr)
        return 2
    out_dir = os.path.dirname(os.path.abspath(path))
    paths = report.write_all(out_dir, doc, json_only)
    print("\n".join(report.stdout_table(doc)))
    print(f"wrote {len(paths)} files to {out_dir}")
    return 0


def run(args: argparse.Namespace, cases: List[suite.Case]) -> int:
    import torch

    from . import report
    from .runner import CudaContextLost, Runner, environment
    from .timing import Timer

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        tqdm = None

    timer = Timer(warmup=args.warmup, iters=args.iters, min_iters=min(20, args.iters))
    runner = Runner(timer, use_compile=not args.no_compile, use_liger=not args.no_liger)
    env = environment(runner)
    env.update(git_info())
    env["fusebox_version"] = fusebox_version()
    env["library"] = library_status()[1]
    out_dir = args.out or default_out_dir(env.get("gpu", "gpu"), env.get("commit"), args.quick)
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "results.json")

    doc = None
    if args.resume and os.path.exists(json_path):
        with open(json_path) as f:
            doc = json.load(f)
        if doc.get("env", {}).get("gpu") != env.get("gpu"):
            print(f"fusebox bench: {json_path} was measured on {doc.get('env', {}).get('gpu')}, "
                  f"not {env.get('gpu')}; use another --out", file=sys.stderr)
            return 2
    print(f"fusebox bench: {env.get('gpu')} · torch {env['torch']} (CUDA {env['cuda']}) · "
          f"fusebox {env['fusebox_version']} @ {env.get('commit') or 'nogit'}")
    if runner.fb is None:
        print(f"  fusebox operators NOT loaded ({runner.fb_error}); timing the baselines only")
    print(f"  Liger: {runner.liger_status} · torch.compile: "
          f"{'off' if args.no_compile else 'on'}")
    calib = timer.calibrate()
    if doc is None:
        doc = {"schema": 1, "env": env, "calibration": calib, "results": []}
    else:
        doc.setdefault("recalibrations", []).append(calib)   # derived numbers keep the first
        env["resumed_from"] = doc["env"].get("date")
        doc["env"] = {**doc["env"], "last_run": env}
    doc["settings"] = {"ops": args.op_list, "shapes": args.group_list,
                       "dtypes": args.dtype_list, "quick": args.quick, "iters": args.iters,
                       "warmup": args.warmup, "compile": not args.no_compile,
                       "liger": not args.no_liger}
    doc["ops"] = {**doc.get("ops", {}), **_op_notes(args.op_list)}
    c = doc["calibration"]
    print(f"  copy {c['copy_tbps']:.2f} TB/s · empty launch {c['launch_us']:.2f} us (events), "
          f"{c.get('launch_graph_us') or float('nan'):.2f} us (graph), "
          f"{c.get('launch_host_us') or float('nan'):.2f} us (host) · results: {out_dir}")
    sys.stdout.flush()

    done = {r["key"] for r in doc["results"]}
    todo = [cs for cs in cases if cs.key not in done]
    order = {cs.key: i for i, cs in enumerate(cases)}
    deadline = time.time() + 60 * args.max_minutes if args.max_minutes else None
    bar = tqdm(total=len(todo), unit="case", dynamic_ncols=True) if tqdm else None
    stopped = lost = interrupted = False
    try:
        for case in todo:
            if deadline is not None and time.time() > deadline:
                stopped = True
                break
            if bar is not None:
                bar.set_postfix_str(f"{case.op} {case.label} {case.dtype}"[:60])
            try:
                rec = runner.run_case(case)
            except CudaContextLost as e:
                print(f"\nfusebox bench: CUDA context lost, stopping: {e}", file=sys.stderr)
                lost = True
                break
            doc["results"].append(rec)
            doc["complete"] = False
            report.finalize(doc)
            report.write_json(json_path, doc)
            if bar is not None:
                bar.update(1)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if bar is not None:
            bar.close()
        timer.release()
    doc["results"].sort(key=lambda r: order.get(r["key"], len(order)))
    measured = {r["key"] for r in doc["results"]}
    left = [cs for cs in cases if cs.key not in measured]
    doc["complete"] = not left
    paths = report.write_all(out_dir, doc, args.json_only)
    print()
    print("\n".join(report.stdout_table(doc)))
    print(f"wrote {len(paths)} files to {out_dir}")
    if left:
        why = ("--max-minutes reached" if stopped else "interrupted" if interrupted
               else "CUDA context lost" if lost else "not run")
        print(f"incomplete ({why}): {len(left)} of {len(cases)} cases left; continue with "
              f"`fusebox bench --resume --out {out_dir}` and the same selection")
    if lost:
        return 1
    return 130 if interrupted else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "e2e":
        from .e2e import main as e2e_main
        return e2e_main(argv[1:])
    args = parse_args(argv)
    if args.from_json:
        return regenerate(args.from_json, args.json_only)
    cases = suite.select(args.op_list, args.group_list, args.dtype_list, args.quick)
    if not cases:
        print("fusebox bench: no case matches this selection (--ops / --shapes / --quick); "
              "try --list with fewer filters", file=sys.stderr)
        return 2
    if args.list:
        print(f"{len(cases)} cases:")
        for cs in cases:
            print(f"  {cs.op:<20} {cs.group:<5} {cs.dtype:<4} {cs.nbytes / 1e6:>10.3f} MB  "
                  f"{cs.label}")
        print("\n".join(suite_table(cases)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(no_gpu_message(cases, args))
        return 0
    return run(args, cases)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
