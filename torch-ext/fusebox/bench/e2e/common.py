"""Shared pieces of the end-to-end benchmarks: device timing of a whole forward, peak memory,
output differences, and the result files (results_e2e.json + results_e2e.md, merged with what
the folder already holds)."""

from __future__ import annotations

import datetime
import gc
import json
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device, warmup: int = 3, iters: int = 10) -> Dict[str, float]:
    """Median and min wall time of ``fn()`` in ms, synchronized on both sides of each call
    (for a whole forward the host and device times both count)."""
    for _ in range(warmup):
        fn()
    sync(device)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "iters": iters}


PROGRESS_KEYS = ("forward_ms", "prefill_ms", "decode_tok_s_b1", "decode_tok_s_b16", "compile_s",
                 "capture_s")


def progress(variant: str, rec: Optional[dict] = None) -> None:
    """A line when a variant starts (``rec`` None) and one with its headline figures when it
    ends, so that a long run (a whole-model compile takes minutes) shows where it is."""
    if rec is None:
        print(f"  {variant} ...", flush=True)
    elif rec.get("error"):
        print(f"  {variant}: error: {str(rec['error'])[:200]}", flush=True)
    else:
        figures = [f"{k} {v:.4g}" for k, v in rec.items() if k in PROGRESS_KEYS and isinstance(v, (int, float))]
        print(f"  {variant}: {', '.join(figures) or 'done'}", flush=True)


def error_text(e: BaseException) -> str:
    first = str(e).splitlines()[0][:300] if str(e) else ""
    return f"{type(e).__name__}: {first}"


def release(device) -> None:
    """Frees what the last variant left on the device."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def merge_rounds(recs: List[dict], keys: Sequence[str]) -> dict:
    """One variant's record over several rounds: the first timed round's record with each of
    ``keys`` the median over the rounds that have it (every round's value kept in
    ``<key>_rounds``), and the errors of rounds that failed in ``round_errors``."""
    timed = [r for r in recs if any(k in r for k in keys)]
    if len(recs) == 1 or not timed:
        return recs[0]
    merged = dict(timed[0])
    for key in keys:
        values = [r[key] for r in timed if key in r]
        if values:
            merged[key] = statistics.median(values)
            merged[f"{key}_rounds"] = values
    errors = [r["error"] for r in recs if r.get("error")]
    if errors:
        merged["round_errors"] = errors
    return merged


def run_guarded(variant: str, device, call: Callable[[], tuple]) -> tuple:
    """``call()``'s (record, output) between two progress lines; a failure becomes the variant's
    error record, since one failing variant must not end the run."""
    progress(variant)
    try:
        rec, out = call()
    except Exception as e:  # noqa: BLE001
        rec, out = {"error": error_text(e)}, None
    progress(variant, rec)
    release(device)
    return rec, out


def peak_memory_mb(fn: Callable[[], object], device) -> Optional[float]:
    if torch.device(device).type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated() / 2**20


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (inf on NaN)."""
    a64, b64 = a.detach().double(), b.detach().double()
    if not bool(torch.isfinite(a64).all()):
        return float("inf")
    den = float(b64.norm())
    return float((a64 - b64).norm()) / den if den > 0 else float((a64 - b64).norm())


def environment() -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__}
    for pkg in ("transformers", "diffusers"):
        try:
            from importlib.metadata import version
            env[pkg] = version(pkg)
        except Exception:  # noqa: BLE001
            env[pkg] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    try:
        from ..cli import git_info
        env.update(git_info())
    except Exception:  # noqa: BLE001
        pass
    return env


def default_out_dir() -> str:
    from ..cli import default_out_dir as bench_out, git_info, slug  # noqa: F401

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return bench_out(gpu, git_info().get("commit"), quick=False) + "_e2e"


def format_record(rec: dict) -> List[str]:
    """A short text table of one model's record: variant, then its numeric fields."""
    lines = []
    variants = rec.get("variants", {})
    keys: List[str] = []
    for v in variants.values():
        for k, val in v.items():
            if isinstance(val, (int, float)) and k not in keys:
                keys.append(k)
    if variants:
        lines.append("  " + f"{'variant':<22}" + "".join(f"{k:>18}" for k in keys))
        for name, v in variants.items():
            cells = []
            for k in keys:
                val = v.get(k)
                cells.append(f"{val:>18.4g}" if isinstance(val, (int, float)) else f"{'—':>18}")
            lines.append("  " + f"{name:<22}" + "".join(cells))
            if v.get("error"):
                lines.append(f"    error: {v['error']}")
    for k, val in rec.get("summary", {}).items():
        lines.append(f"  {k}: {val}")
    return lines


def write_results(out_dir: str, records: Sequence[dict]) -> List[str]:
    """Merges ``records`` (by model name) into out_dir/results_e2e.json and rewrites
    results_e2e.md."""
    os.makedirs(out_dir, exist_ok=True)
    jpath = os.path.join(out_dir, "results_e2e.json")
    doc = {"schema": 1, "env": environment(), "models": {}}
    if os.path.exists(jpath):
        with open(jpath) as f:
            old = json.load(f)
        doc["models"] = old.get("models", {})
    for rec in records:
        doc["models"][rec["model"]] = rec
    with open(jpath, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    mpath = os.path.join(out_dir, "results_e2e.md")
    env = doc["env"]
    md = ["# fusebox bench e2e", "",
          f"- date: {env.get('date')} · GPU: {env.get('gpu', 'none')} · torch {env.get('torch')} · "
          f"transformers {env.get('transformers')} · diffusers {env.get('diffusers')} · "
          f"commit {env.get('commit')}", ""]
    for name, rec in doc["models"].items():
        md += [f"## {name}", "", rec.get("description", ""), ""]
        md += ["```"] + format_record(rec) + ["```", ""]
    with open(mpath, "w") as f:
        f.write("\n".join(md))
    return [jpath, mpath]
